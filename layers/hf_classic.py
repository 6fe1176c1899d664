"""Hugging Face decoders that carry no tensor-parallel plan of their own: GPT-2, GPT-BigCode (StarCoder's family),
GPT-Neo, OPT, XGLM, BioGPT, BLOOM, Falcon, MPT and Persimmon. :func:`classic_plan` finds their attention, MLPs and
vocabulary and splits them as Megatron-LM splits a GPT:

- **attention by heads**, from the fused projection each family has:

  ================================  ===============================  ==============================================
  family (projections)              fused layout                     split
  ================================  ===============================  ==============================================
  GPT-2 (``c_attn``/``c_proj``,      ``[q | k | v]``, each ``H·D``     ``colwise_qkv``: this rank's heads of each part
  ``Conv1D``); MPT (``Wqkv``/
  ``out_proj``)
  GPT-BigCode without multi-query   head by head, ``[q_h k_h v_h]``  ``colwise``: a contiguous block of heads
  (``c_attn``/``c_proj``); BLOOM,
  Persimmon, Falcon-RW
  (``query_key_value``/``dense``)
  Falcon's new architecture         kv group by group, the group's   ``colwise``: a contiguous block of kv groups
  (Falcon-40B, -180B)               queries then its key and value
  multi-query GPT-BigCode           ``[q | k | v]``, q ``H·D``, k     ``colwise_qkv``: this rank's query heads and a
  (StarCoder, SantaCoder); Falcon   and v one head each               copy of the kv head (``max_chunks``)
  (Falcon-7B)
  DBRX (``Wqkv``/``out_proj``)      ``[q | k | v]``, q ``H·D``, k     ``colwise_qkv``: this rank's heads of each part
                                    and v ``G·D`` (``G`` kv heads)    (``G`` a multiple of the ranks)
  ================================  ===============================  ==============================================

  and the output projection ``rowwise``. Per-head q/k norms (Persimmon's ``[head_dim]`` LayerNorms) stay whole,
  their gradients summed over the group. The attention's head counts and widths become this rank's
  (:func:`~tessel.layers.hf_plans.local_head_updates`: ``num_heads``, ``split_size``...), and ALiBi's per-head
  biases (BLOOM's ``alibi``, MPT's ``position_bias``, built for every head by the model) are cut to this rank's heads
  as they enter the attention (:func:`head_bias_installer`).
- **MLPs by intermediate features**: ``c_fc``/``c_proj`` (GPT-2, GPT-BigCode, GPT-Neo), ``dense_h_to_4h``/
  ``dense_4h_to_h`` (BLOOM, Falcon, Persimmon), the decoder layer's own ``fc1``/``fc2`` (OPT, XGLM, BioGPT, whose
  layers hold their MLP's projections themselves), each checked to act feature by feature.
- **the vocabulary** (when it splits over the ranks): the input embedding ``embedding_rowwise`` and the output
  projection ``colwise_gather_output``, as Hugging Face's own plans do. GPT-2's 50257 tokens do not split over an even
  number of ranks: its embedding and head then stay whole on every rank.

GPT-2's ``Conv1D`` layers (weight ``[in, out]``) become tessel's column and row layers, of ``nn.Linear``'s layout
(weight ``[out, in]``): their weights are tagged ``hf_transposed``, which :func:`~tessel.layers.load_pretrained`
reads transposed. Falcon's ``FalconLinear`` computes what ``nn.Linear`` computes and is split as one.

Multi-query attention keeps its one key and value head on every rank (:mod:`~tessel.layers.hf_kv_replicas`), the
copies' gradients summed over the group. What stays whole: Falcon's attention with ALiBi (its MLP still splits; under
sequence parallelism a whole attention is refused by name, as for any family), and BLOOM's ``slow_but_exact``
emulation of its pretraining's tensor parallelism, attention and MLP, which leaves nothing in its layers to split:
``parallelize`` refuses such a model by name (:func:`~tessel.layers.hf.check_layers_split`).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ..parallel.comm import group_rank, group_size
from .hf import is_hf_model
from .hf_plans import (
    ACTIVATION_NAMES,
    HEAD_NORM_NAMES,
    _permutes_features,
    head_dim_of,
    is_conv1d,
    linear_widths,
    positive_int_attr,
)

__all__ = ["as_linear", "classic_plan", "classic_qkv_parts", "head_bias_installer", "linear_like"]

# transformers' subclasses of nn.Linear whose forward computes nn.Linear's (Falcon's x @ Wᵀ + b)
_LINEAR_EQUIVALENTS = ("FalconLinear",)


def linear_like(m) -> bool:
    """An ``nn.Linear`` (or a transformers subclass computing the same) or a ``Conv1D``: what tessel's column and row
    layers replace."""
    if isinstance(m, nn.Linear):
        same = type(m).__name__ in _LINEAR_EQUIVALENTS and type(m).__module__.startswith("transformers")
        return type(m).forward is nn.Linear.forward or same
    return is_conv1d(m)


def as_linear(m: nn.Module) -> nn.Module:
    """``m`` as a plain ``nn.Linear`` sharing its values: a ``Conv1D``'s weight transposed (a view), a
    ``FalconLinear``'s parameters themselves; any other module as it is."""
    if not linear_like(m) or (isinstance(m, nn.Linear) and type(m) is nn.Linear):
        return m
    k, n = linear_widths(m)
    bias = getattr(m, "bias", None)
    linear = nn.Linear(k, n, bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(m.weight.t() if is_conv1d(m) else m.weight, requires_grad=m.weight.requires_grad)
    if bias is not None:
        linear.bias = bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias)
    return linear


def _heads(m: nn.Module) -> int | None:
    return positive_int_attr(m, ("num_heads", "n_heads"))


def _layout(m: nn.Module, children: dict) -> tuple[str, str, str] | None:
    """``(fused projection, output projection, layout)`` of classic attention: ``"thirds"`` ([q | k | v]),
    ``"heads"`` (head by head), ``"groups"`` (Falcon's kv groups), ``"mqa"`` ([q | k | v] of one kv head), ``"gqa"``
    ([q | k | v] of fewer kv heads than query heads: DBRX's); None for another module or one that stays whole."""
    if "c_attn" in children and "c_proj" in children:
        if is_conv1d(children["c_attn"]):
            return "c_attn", "c_proj", "thirds"  # GPT-2: split by split_size
        multi_query = getattr(m, "multi_query", None)  # GPT-BigCode
        return ("c_attn", "c_proj", "mqa" if multi_query else "heads") if isinstance(multi_query, bool) else None
    if "Wqkv" in children and "out_proj" in children:  # MPT: chunk(3); DBRX: its kv heads fewer
        kv = positive_int_attr(m, ("num_key_value_heads",))
        return "Wqkv", "out_proj", "gqa" if kv is not None and kv != _heads(m) else "thirds"
    if "query_key_value" in children and "dense" in children:
        if getattr(m, "pretraining_tp", 1) > 1 and getattr(m, "slow_but_exact", False):
            return None  # BLOOM's emulation slices dense.weight by the pretraining's ranks
        if getattr(m, "new_decoder_architecture", False):
            return "query_key_value", "dense", "groups"
        if getattr(getattr(m, "config", None), "alibi", False) is True:
            return None  # Falcon-RW's ALiBi, folded into its mask for every head
        return "query_key_value", "dense", "mqa" if getattr(m, "multi_query", False) else "heads"  # Falcon-7B: mqa
    return None


def _classic_attention(m: nn.Module, t: int) -> dict[str, str] | None:
    """The styles that split classic attention (the table above) by heads over ``t`` ranks; None when ``m`` is not
    such attention, keeps its attention whole, or its heads do not split."""
    children = dict(m.named_children())
    found = _layout(m, children)
    heads, head_dim = _heads(m), head_dim_of(m)
    if found is None or heads is None or head_dim is None:
        return None
    qkv_name, out_name, layout = found
    qkv, out = children[qkv_name], children[out_name]
    if not (linear_like(qkv) and linear_like(out)):
        return None
    groups = {"groups": getattr(m, "num_kv_heads", None), "mqa": 1,
              "gqa": getattr(m, "num_key_value_heads", None)}.get(layout, heads)  # fmt: skip
    if not isinstance(groups, int) or groups < 1 or heads % groups:
        return None
    width = (heads + 2 * groups) * head_dim if layout in ("groups", "mqa", "gqa") else 3 * heads * head_dim
    split = heads if layout == "mqa" else groups  # the kv head of multi-query attention replicated over the ranks
    if linear_widths(qkv)[1] != width or linear_widths(out)[0] != heads * head_dim or split % t:
        return None
    styles = {qkv_name: "colwise_qkv" if layout in ("thirds", "mqa", "gqa") else "colwise", out_name: "rowwise"}
    for name, child in children.items():
        if name in styles or not any(True for _ in child.parameters()):
            continue
        weight = getattr(child, "weight", None)
        if name not in HEAD_NORM_NAMES or not isinstance(weight, torch.Tensor) or weight.shape != (head_dim,):
            return None
        styles[name] = "replicated_with_grad_allreduce"  # applied to each of this rank's heads
    return styles


def classic_qkv_parts(parent: nn.Module, child: str) -> tuple[int, int, int] | None:
    """``(H·D, H·D, H·D)``: the parts of GPT-2's ``c_attn`` and MPT's ``Wqkv`` (``[q | k | v]``); ``(H·D, D, D)``: a
    multi-query GPT-BigCode's ``c_attn`` or Falcon's ``query_key_value``; ``(H·D, G·D, G·D)``: DBRX's ``Wqkv`` of
    ``G`` kv heads; None otherwise."""
    found = _layout(parent, dict(parent.named_children()))
    heads, head_dim = _heads(parent), head_dim_of(parent)
    if found is None or found[0] != child or found[2] not in ("thirds", "mqa", "gqa") or heads is None \
            or head_dim is None:  # fmt: skip
        return None
    kv = {"thirds": heads, "mqa": 1}.get(found[2], getattr(parent, "num_key_value_heads", None))
    return (heads * head_dim, kv * head_dim, kv * head_dim)


_MLPS = (("c_fc", "c_proj"), ("dense_h_to_4h", "dense_4h_to_h"))
_ACTIVATIONS = (*ACTIVATION_NAMES, "gelu_impl")  # BLOOM's


def _classic_mlp(m: nn.Module, t: int) -> dict[str, str] | None:
    """``c_fc``/``c_proj`` or ``dense_h_to_4h``/``dense_4h_to_h`` (``nn.Linear`` or ``Conv1D``) split by intermediate
    features over ``t`` ranks, where nothing else learns but the activation and permuting the features leaves the
    output unchanged (probed); None otherwise."""
    children = dict(m.named_children())
    for up, down in _MLPS:
        if not (linear_like(children.get(up)) and linear_like(children.get(down))):
            continue
        width = linear_widths(children[down])[0]
        learning = {n for n, c in children.items() if any(True for _ in c.parameters())}
        if learning - {up, down, *_ACTIVATIONS} or width % t:
            return None
        if getattr(m, "pretraining_tp", 1) > 1 and getattr(m, "slow_but_exact", False):
            return None
        return {up: "colwise", down: "rowwise"} if _permutes_features(m, up, down, halves=False) else None
    return None


def _layer_mlp(m: nn.Module, t: int) -> dict[str, str] | None:
    """A decoder layer holding its MLP's projections itself (OPT, XGLM, BioGPT: ``fc1``, ``activation_fn``, ``fc2``
    beside ``self_attn``): ``fc1`` ``colwise``, ``fc2`` ``rowwise`` over ``t`` ranks, where the activation acts
    feature by feature (probed); None otherwise."""
    fc1, fc2, act = (getattr(m, n, None) for n in ("fc1", "fc2", "activation_fn"))
    if not isinstance(getattr(m, "self_attn", None), nn.Module) or not (linear_like(fc1) and linear_like(fc2)):
        return None
    width = linear_widths(fc2)[0]
    if linear_widths(fc1)[1] != width or width % t or not callable(act) or any(True for _ in _parameters(act)):
        return None
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        if not torch.allclose(act(x[:, perm]), act(x)[:, perm]):
            return None
    return {"fc1": "colwise", "fc2": "rowwise"}


def _parameters(m) -> list:
    return list(m.parameters()) if isinstance(m, nn.Module) else []


def _vocab_plan(model: nn.Module, t: int) -> dict[str, str]:
    """The input embedding ``embedding_rowwise`` and the output projection ``colwise_gather_output`` when both are
    plain and the vocabulary splits over ``t`` ranks (tied or not); nothing otherwise."""
    names = {id(m): n for n, m in model.named_modules()}
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if type(embedding) is not nn.Embedding or embedding.num_embeddings % t or id(embedding) not in names:
        return {}
    if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
        return {}
    plan = {names[id(embedding)]: "embedding_rowwise"}
    if head is not None:
        if type(head) is not nn.Linear or head.out_features != embedding.num_embeddings or id(head) not in names:
            return {}
        plan[names[id(head)]] = "colwise_gather_output"
    return plan


def classic_plan(model: nn.Module, plan: dict[str, str], regex_of, t: int) -> dict[str, str]:
    """``plan`` (of a Hugging Face model with no plan of its own) with the classic attention and MLPs it does not name
    split over ``t`` ranks (over one rank: tessel's layers, which the fused loss reads), and a classic decoder's
    vocabulary; ``regex_of(glob)`` is the compiled pattern of a glob."""
    if not is_hf_model(model) or getattr(model.config, "base_model_tp_plan", None):
        return plan
    covered = [regex_of(glob) for glob in plan]
    out = dict(plan)
    for name, m in model.named_modules():
        styles = name and next((s for detect in (_classic_attention, _classic_mlp, _layer_mlp) if (s := detect(m, t))),
                               None)  # fmt: skip
        if styles:
            full = {child: f"{name}.{child}" for child in styles}
            if not any(r.fullmatch(n) for r in covered for n in full.values()):
                out.update({full[child]: style for child, style in styles.items()})
    vocab = _vocab_plan(model, t)
    if _is_classic(model) and not any(r.fullmatch(n) for r in covered for n in vocab):
        out.update(vocab)
    return out


# the projections by which a classic decoder's blocks are known, split or not
_CLASSIC_NAMES = (("c_attn", "c_proj"), ("Wqkv", "out_proj"), ("query_key_value", "dense"), *_MLPS, ("fc1", "fc2"))


def _is_classic(model: nn.Module) -> bool:
    """Whether ``model`` holds blocks of the classic decoders' (the table above), split or kept whole."""
    modules = list(model.modules())
    return any(all(linear_like(getattr(m, n, None)) for n in names) for m in modules for names in _CLASSIC_NAMES)


# ALiBi biases as the model hands them to each attention module: (argument, how many heads lead its first dim)
_HEAD_BIASES = {"alibi": "batch·heads", "position_bias": "heads"}


def head_bias_installer(attention: nn.Module, tp_group):
    """For attention split by heads that receives ALiBi biases of every head (BLOOM's ``alibi`` ``[B·H, 1, S]``, MPT's
    ``position_bias`` ``[H, 1, S]``): a function that installs a hook cutting them to this rank's heads; None for
    other attention."""
    try:
        params = list(inspect.signature(attention.forward).parameters)  # bound: without self
    except (TypeError, ValueError):
        return None
    found = [(name, params.index(name), kind) for name, kind in _HEAD_BIASES.items() if name in params]
    if len(found) != 1 or _heads(attention) is None:
        return None
    arg, index, kind = found[0]
    t, r = group_size(tp_group), group_rank(tp_group)

    def local(bias: torch.Tensor) -> torch.Tensor:
        h = _heads(attention)  # this rank's, once installed
        if kind == "heads":
            return bias[r * h : (r + 1) * h]
        whole = bias.view(-1, h * t, *bias.shape[1:])
        return whole[:, r * h : (r + 1) * h].reshape(-1, *bias.shape[1:])

    def hook(module, args, kwargs):
        if isinstance(kwargs.get(arg), torch.Tensor):
            return args, {**kwargs, arg: local(kwargs[arg])}
        if len(args) > index and isinstance(args[index], torch.Tensor):
            return (*args[:index], local(args[index]), *args[index + 1 :]), kwargs
        return None

    return lambda: attention.register_forward_pre_hook(hook, with_kwargs=True)
