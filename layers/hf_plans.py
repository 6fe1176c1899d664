"""Hugging Face plans that gather what tessel splits: the rewrites :func:`~tessel.layers.parallelize` applies to a
model's own plan.

Some of Hugging Face's ``base_model_tp_plan`` entries gather a column projection's output whole
(``colwise_gather_output``) and split the next projection's input again (``rowwise_split_input``): every rank then
runs every head of the attention, or every feature of the MLP's activation, and the block pays an all-gather beside
its all-reduce. The plan does so where splitting needs more than a linear layer can know:

- **q/k norms over every head** (OLMo 2 and 3, OLMoE, FlexOlmo, MiniMax-M2): each norm's mean of squares spans all
  heads. tessel splits q/k/v by heads and keeps the norms whole with
  :class:`~tessel.layers.norm.SplitRMSNorm` (style ``colwise_norm``: each rank sums its heads' squares, one fp32
  per token all-reduced).
- **a fused qkv_proj sliced by the config's head counts** (Phi-3, Phi-4-mini): tessel splits each of q, k and v by
  heads (style ``colwise_qkv``) and gives the attention a view of its config with this rank's head counts
  (:class:`LocalHeadsConfig`).
- **a fused gate_up_proj** whose halves the MLP pairs feature by feature (Phi-3's ``chunk(2)``): rank ``r`` keeps
  ``[gate_r; up_r]`` (style ``packed_colwise``) and the down projection its input columns. The pairing is probed
  once per module, on a copy of its weights with the intermediate features permuted (gate and up alike): the
  output must not change, which holds for ``act(gate)·up`` of the two halves and fails for interleaved pairs.

- **differential attention** (DiffLlama: head ``i`` paired with head ``i + H/2``): each half of the heads split over
  the ranks, so that every pair stays on one rank (:func:`_differential_attention`).
- **attention, MLPs or experts the plan does not name** (Phi-3.5-MoE, Granite-MoE, Hunyuan-MoE, DeepSeek-V3, Afmoe,
  whose plans split the MLPs or experts alone; GPT-OSS, whose plan splits its embedding alone): every rank would run
  every head and every expert's every feature, and sequence parallelism would have no projection to gather the
  sequence. Plain attention (``q_proj``/``k_proj``/``v_proj``/``o_proj``, q/k norms, an output gate; per-head
  parameters such as GPT-OSS's sinks follow their heads) and multi-head latent attention (as DeepSeek-V2's plan splits
  it) whose heads split over the ranks are split by heads, gated MLPs (``gate_proj``/``up_proj``/``down_proj``) and
  Hugging Face experts modules (``moe_tp_experts``, :mod:`~tessel.layers.hf_experts`) by features
  (:func:`whole_attention_plan`).

A rule rewrites a glob stem (``"model.layers.*.self_attn."``) only where every module it matches is of its kind;
everything else is left as Hugging Face wrote it. A plan the user passes is never rewritten.

:func:`local_head_updates` gives the head counts (and head widths) of an attention module on each rank of a split.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.func import functional_call

from .hf_experts import expert_splits
from .hf_grouped_output import grouped_output_styles
from .hf_linear_attention import delta_net_styles, gathered_delta_rules, kimi_delta_styles
from .hf_mixers import _plain_linear, is_dynamic_mask, lightning_styles, mamba1_styles, mamba_styles, short_conv_styles
from .hf_stacked_experts import stacked_layout
from .meta import probe_copy

__all__ = [
    "ACTIVATION_NAMES",
    "HEAD_COUNT_ATTRS",
    "HEAD_NORM_NAMES",
    "HEAD_WIDTH_ATTRS",
    "LocalHeadsConfig",
    "fused_qkv_parts",
    "head_dim_of",
    "head_split_plan",
    "is_conv1d",
    "linear_widths",
    "local_head_updates",
    "pairs_halves",
    "whole_attention_plan",
]

# Attention-module attributes holding a head count (or a width of heads) that Hugging Face modules of
# various versions read in forward; each becomes its local value (``/ t``) when the heads are split.
# transformers 5.x Llama/Mistral/Qwen2 attention reshapes with -1 and reads none of them. CodeGen's mp_num counts the
# groups of heads its fused projection's rows are interleaved in ([q | v | k] of each group's heads): a rank holds
# whole groups, ``mp_num / t`` of them.
HEAD_COUNT_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_heads", "n_kv_heads",
                    "kv_heads", "mp_num")  # fmt: skip
# split_size: GPT-2's [q | k | v] widths; kv_dim: GPT-BigCode's keys' width (one kv head per query head)
HEAD_WIDTH_ATTRS = ("hidden_size", "embed_dim", "all_head_size", "split_size", "kv_dim")

_GATHERING = ("colwise_gather_output", "colwise_rep", "gather", "colwise_gather", "rowwise_split_input",
              "rowwise_rep", "rowwise_split")  # fmt: skip
_GATHERED_ATTENTION = {"q_proj": "colwise_gather_output", "k_proj": "colwise_gather_output",
                       "v_proj": "colwise_gather_output", "o_proj": "rowwise_split_input"}  # fmt: skip
_SPLIT_ATTENTION = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise",
                    "q_norm": "colwise_norm", "k_norm": "colwise_norm"}  # fmt: skip
_GATHERED_QKV = {"qkv_proj": "colwise_gather_output", "o_proj": "rowwise_split_input"}
# Doge's plan: dt_proj (from every kv head's values to one value per kv head) rowwise, each rank then holding the mask
# of every head
_DYNAMIC_MASK = {
    "q_proj": "colwise",
    "k_proj": "colwise",
    "v_proj": "colwise",
    "dt_proj": "rowwise",
    "o_proj": "rowwise",
}
_SPLIT_MASK = {**_DYNAMIC_MASK, "dt_proj": "rowwise_heads", "A": "colwise"}
_SPLIT_QKV = {"qkv_proj": "colwise_qkv", "o_proj": "rowwise"}
_GATHERED_MLP = {"gate_up_proj": "colwise_gather_output", "down_proj": "rowwise_split_input"}
_SPLIT_MLP = {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}


def head_split_plan(model: nn.Module, plan: dict[str, str], regex_of, t: int = 1) -> dict[str, str]:
    """``plan`` with what it gathers whole for the reasons above split instead (and the Gated DeltaNet blocks it
    gathers, over ``t`` ranks: :func:`~tessel.layers.hf_linear_attention.gathered_delta_rules`); ``regex_of(glob)`` is
    the compiled pattern of a glob. The modules a stem matches are the parents of its first projection's matches."""
    modules = dict(model.named_modules())
    out = dict(plan)

    def fixed(split, fits):  # the same styles for every module that fits
        return lambda m: split if fits(m) else None

    rules = [(_GATHERED_ATTENTION, fixed(_SPLIT_ATTENTION, _norms_span_heads)),
             (_GATHERED_QKV, fixed(_SPLIT_QKV, lambda m: fused_qkv_parts(m) is not None)),
             (_DYNAMIC_MASK, lambda m: _SPLIT_MASK if is_dynamic_mask(m, t) else None),
             (_GATHERED_MLP, fixed(_SPLIT_MLP, pairs_halves)), *gathered_delta_rules(t)]  # fmt: skip
    for glob in plan:
        stem, _, leaf = glob.rpartition(".")
        stem = stem + "." if stem else ""
        for gathered, styles_of in rules:
            if leaf != next(iter(gathered)) or any(plan.get(stem + n) != s for n, s in gathered.items()):
                continue
            regex = regex_of(glob)
            splits = [styles_of(modules[n.rpartition(".")[0]]) for n in modules if regex.fullmatch(n)]
            if splits and all(split is not None and split == splits[0] for split in splits):
                out.update({stem + n: style for n, style in splits[0].items()})
    return out


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
# the names Hugging Face gives a block's activation module (ACT2FN[...])
ACTIVATION_NAMES = ("act_fn", "act", "activation_fn", "activation", "act_func")
# a projection of the block's input that gates the attention's output before o_proj, feature by feature (Afmoe's) or
# head by head (LFM3's)
_OUTPUT_GATES = ("gate_proj", "g_proj")
# per-head q/k norms ([head_dim] weights, applied to each rank's heads) under the names Hugging Face gives them
HEAD_NORM_NAMES = ("q_norm", "k_norm", "query_layernorm", "key_layernorm", "q_layernorm", "k_layernorm")
_QUERY_NORMS = ("q_norm", "query_layernorm", "q_layernorm")


def whole_attention_plan(model: nn.Module, plan: dict[str, str], regex_of, t: int) -> dict[str, str]:
    """``plan`` with the attention and MLPs it leaves whole split: each module whose projections the plan does not
    name (Phi-3.5-MoE, Granite-MoE, Hunyuan-MoE: plans of the experts alone; DeepSeek-V3's attention; Afmoe's dense
    first MLP) and that splits over ``t`` ranks as plain attention (:func:`_plain_attention`: q/k/v ``colwise``,
    ``o_proj`` ``rowwise``, per-head q/k norms ``replicated_with_grad_allreduce``, norms over all heads
    ``colwise_norm``), latent attention (:func:`_latent_attention`), a gated MLP (:func:`_plain_mlp`), a Gated DeltaNet
    block (OLMo-hybrid's: :func:`~tessel.layers.hf_linear_attention.delta_net_styles`) or a Hugging Face experts
    module (``moe_tp_experts``, GPT-OSS's). Modules are named in full, each on its own: layers of another kind
    beside them are left as they are. A module the plan gathers whole (``colwise_gather_output``, LaraMini's linear
    attention's ``out_proj``) counts as unnamed: the split replaces what the plan says of it."""
    # a module the plan gathers whole (LaraMini's linear attention: out_proj colwise_gather_output) is not split by it
    covered = [regex_of(glob) for glob, style in plan.items() if style not in _GATHERING]
    out = dict(plan)
    for name, m in model.named_modules():
        if name and _experts(m, t) and not any(r.fullmatch(name) for r in covered):
            out[name] = "moe_tp_experts"  # also for t = 1: an expert-parallel group may split them
            continue
        if t < 2 or not name:
            continue
        detectors = (_differential_attention, _plain_attention, _latent_attention, grouped_output_styles, _plain_mlp,
                     _adapted_mlp, delta_net_styles, kimi_delta_styles, mamba_styles, mamba1_styles, short_conv_styles,
                     lightning_styles)  # fmt: skip
        styles = next((found for detect in detectors if (found := detect(m, t))), None)
        names = {child: f"{name}.{child}" if child else name for child in styles or ()}  # "": the module itself
        if styles and not any(r.fullmatch(n) for r in covered for n in (name, *names.values())):
            out.update({names[child]: style for child, style in styles.items()})
    named = set(out) - set(plan)
    for glob, style in plan.items():  # the plan's gathering globs whose every module is now split otherwise
        hits = [n for n, _ in model.named_modules() if regex_of(glob).fullmatch(n)]
        if style in _GATHERING and hits and all(n in named for n in hits):
            del out[glob]
    return out


def _experts(m: nn.Module, t: int) -> bool:
    """Whether ``m`` is a Hugging Face experts module (3-d parameters, the layout its class declares) whose
    intermediate features split over ``t`` ranks (:func:`~tessel.layers.hf_experts.expert_splits`)."""
    if not any(p.dim() == 3 for p in m.parameters(recurse=False)) and stacked_layout(m) is None:
        return False  # neither 3-d weights nor DBRX's stacked 2-d ones
    try:
        expert_splits(m, t)
    except ValueError:
        return False
    return True


# MLPs by their projections' names: the styles that split them by intermediate features, and whether the names alone
# say the activation acts feature by feature (else it is probed: _permutes_features): gated, LFM2's SwiGLU,
# Nemotron-H's relu², Granite's shared MLP (packed, chunk(2))
_MLPS = (({"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}, True),
         ({"w1": "colwise", "w3": "colwise", "w2": "rowwise"}, True),
         ({"up_proj": "colwise", "down_proj": "rowwise"}, False),
         ({"input_linear": "packed_colwise", "output_linear": "rowwise"}, False))  # fmt: skip


def _plain_mlp(m: nn.Module, t: int) -> dict[str, str] | None:
    """The styles that split an MLP of plain ``nn.Linear``s by its intermediate features over ``t`` ranks (column
    projections ``colwise``, or ``packed_colwise`` over two packed halves, the last ``rowwise``), with nothing else that
    learns but its activation: a gated MLP by its names (``gate_proj``/``up_proj``/``down_proj``, LFM2's
    ``w1``/``w3``/``w2``), an MLP of ``up_proj``/``down_proj`` (Nemotron-H's) or a packed one
    (``input_linear``/``output_linear``, Granite's shared MLP) whose output the probe
    :func:`_permutes_features` finds unchanged when its intermediate features are permuted."""
    children = dict(m.named_children())
    for styles, named in _MLPS:
        layers = [children.get(n) for n in styles]
        if not all(isinstance(p, nn.Linear) and type(p).forward is nn.Linear.forward for p in layers):
            continue
        *columns, down = layers
        halves = styles[next(iter(styles))] == "packed_colwise"
        width = down.in_features
        if any(c.out_features != width * (2 if halves else 1) for c in columns) or width % t:
            return None
        learning = [n for n, c in children.items() if any(True for _ in c.parameters())]
        if any(n not in (*styles, *ACTIVATION_NAMES) for n in learning):
            return None
        if not named and not _permutes_features(m, next(iter(styles)), list(styles)[-1], halves):
            return None
        return dict(styles)
    return None


def _adapted_mlp(m: nn.Module, t: int) -> dict[str, str] | None:
    """Zamba 2's MLP, shared by several hybrid layers, each adding its own low-rank adapter to the packed
    ``gate_up_proj`` (``gate_up_proj_adapter_list[layer_dic[layer_idx]]``: ``H → r → 2I``): split by intermediate
    features over ``t`` ranks, ``gate_up_proj`` and each adapter's second projection ``packed_colwise`` (this rank's
    share of each half), ``down_proj`` ``rowwise``; the adapters' first projections, to their rank ``r``, stay
    replicated (the column layer after each sums its input's gradient over the group). The pairing of the halves is
    probed with the adapters permuted alike (:func:`_permutes_features`). None for another module."""
    children, adapters = dict(m.named_children()), getattr(m, "gate_up_proj_adapter_list", None)
    up, down, table = children.get("gate_up_proj"), children.get("down_proj"), getattr(m, "layer_dic", None)
    if not isinstance(adapters, nn.ModuleList) or not isinstance(table, dict) or not table:
        return None
    if not (_plain_linear(up) and _plain_linear(down)):
        return None
    width = down.in_features
    if up.out_features != 2 * width or width % t:
        return None
    learning = {n for n, c in children.items() if any(True for _ in c.parameters())}
    if learning - {"gate_up_proj", "down_proj", "gate_up_proj_adapter_list"}:
        return None
    styles = {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}
    for i, adapter in enumerate(adapters):
        if isinstance(adapter, nn.Identity):
            continue
        parts = list(adapter) if isinstance(adapter, nn.Sequential) else []
        plain = len(parts) == 2 and all(map(_plain_linear, parts))
        if not plain or parts[1].out_features != 2 * width or parts[0].out_features != parts[1].in_features:
            return None
        styles[f"gate_up_proj_adapter_list.{i}.1"] = "packed_colwise"
    more = tuple(n for n in styles if n.startswith("gate_up_proj_adapter_list"))
    layer = next((k for k, i in table.items() if f"gate_up_proj_adapter_list.{i}.1" in more), next(iter(table)))
    if not _permutes_features(m, "gate_up_proj", "down_proj", True, more, (layer,)):
        return None
    return styles


def _latent_attention(m: nn.Module, t: int) -> dict[str, str] | None:
    """The styles that split multi-head latent attention (DeepSeek-V2/V3's ``kv_a_proj_with_mqa`` → ``kv_b_proj``,
    ``q_proj`` or ``q_a_proj`` → ``q_b_proj``; a per-head output gate ``g_proj`` with them) by heads over ``t`` ranks,
    as DeepSeek-V2's plan does; None when ``m`` is not such a module or its ``num_heads`` do not split."""
    children = dict(m.named_children())
    heads = getattr(m, "num_heads", None)
    query = "q_b_proj" if isinstance(children.get("q_b_proj"), nn.Linear) else "q_proj"
    names = (query, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    if not isinstance(heads, int) or heads % t or not all(isinstance(children.get(n), nn.Linear) for n in names):
        return None
    if any(children[n].out_features % heads for n in (query, "kv_b_proj")) or children["o_proj"].in_features % heads:
        return None
    allowed = {*names, "q_a_proj", "q_a_layernorm", "kv_a_layernorm"}
    # a gate of one value per head on the heads' outputs (Bailing's): split with them
    gate = children.get("g_proj")
    gated = isinstance(gate, nn.Linear) and type(gate).forward is nn.Linear.forward and gate.out_features == heads
    if any(n not in allowed and not (n == "g_proj" and gated) and any(True for _ in c.parameters())
           for n, c in children.items()):  # fmt: skip
        return None
    styles = {query: "colwise", "kv_a_proj_with_mqa": "mla_kv_a_proj", "kv_b_proj": "colwise", "o_proj": "rowwise"}
    return {**styles, "g_proj": "colwise"} if gated else styles


_LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


def _differential_attention(m: nn.Module, t: int) -> dict[str, str] | None:
    """Differential attention (DiffLlama's: ``softmax(Q₁K₁ᵀ) − λ·softmax(Q₂K₂ᵀ)``, query head ``i`` paired with head
    ``i + H/2``, the values' first and second halves of kv heads with each), split over ``t`` ranks by pairs: q, k and
    v ``packed_colwise`` (this rank's share of each half of the heads, so its pairs stay on it), ``o_proj`` ``rowwise``
    (its input is pair by pair), and the module's own ``λ`` vectors, which every head shares,
    ``replicated_with_grad_allreduce``. None when ``m`` is not such a module or its halves do not split."""
    if not all(isinstance(getattr(m, n, None), nn.Parameter) for n in _LAMBDAS) or not hasattr(m, "groupnorm"):
        return None
    styles = _head_styles(m, 2 * t, replicate_kv=False)  # each half of the heads splits over t
    if styles is None or set(styles) != {"q_proj", "k_proj", "v_proj", "o_proj"}:
        return None
    if {n for n, _ in m.named_parameters(recurse=False)} != set(_LAMBDAS):
        return None
    return {"q_proj": "packed_colwise", "k_proj": "packed_colwise", "v_proj": "packed_colwise", "o_proj": "rowwise",
            "": "replicated_with_grad_allreduce"}  # fmt: skip


def _plain_attention(m: nn.Module, t: int) -> dict[str, str] | None:
    """:func:`_head_styles` of attention that does not pair its heads (as differential attention does)."""
    return None if any(hasattr(m, n) for n in _LAMBDAS) else _head_styles(m, t)


def _head_styles(m: nn.Module, t: int, replicate_kv: bool = True) -> dict[str, str] | None:
    """The styles that split ``m`` by heads over ``t`` ranks, when it is attention of plain ``nn.Linear``
    projections whose heads (of its ``head_dim``) split evenly, or whose kv heads are fewer than the ranks and
    ``replicate_kv`` (each replicated over them: :mod:`~tessel.layers.hf_kv_replicas`), with nothing else that learns
    but q/k norms and a gate of its output (``gate_proj`` or ``g_proj``, one value per query feature or per query
    head). The output projection is ``o_proj``, or LFM2's ``out_proj``."""
    head_dim = getattr(m, "head_dim", None)
    children = dict(m.named_children())
    out = "o_proj" if "o_proj" in children else "out_proj"  # LFM2's
    projections = [children.get(n) for n in (*_PROJECTIONS[:3], out)]
    if not isinstance(head_dim, int) or not all(isinstance(p, nn.Linear) for p in projections):
        return None
    if any(type(p).forward is not nn.Linear.forward for p in projections):
        return None
    q, k, v, o = projections
    if o.in_features != q.out_features or k.out_features != v.out_features:
        return None
    if q.out_features % head_dim or k.out_features % head_dim:
        return None
    heads, kv_heads = q.out_features // head_dim, k.out_features // head_dim
    # kv heads fewer than the ranks are replicated (tessel.layers.hf_kv_replicas), without a norm over them all
    replicated = replicate_kv and kv_heads < t and t % kv_heads == 0
    if heads % t or (kv_heads % t and not replicated):
        return None
    styles = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", out: "rowwise"}
    for name, child in children.items():
        if name in styles or not any(True for _ in child.parameters()):
            continue
        if name in _OUTPUT_GATES and isinstance(child, nn.Linear) and type(child).forward is nn.Linear.forward:
            if child.out_features not in (q.out_features, q.out_features // head_dim):
                return None
            styles[name] = "colwise"  # a gate on each output feature or head of the attention: this rank's heads'
            continue
        weight = getattr(child, "weight", None)
        if name not in HEAD_NORM_NAMES or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            return None
        width = (q if name in _QUERY_NORMS else k).out_features
        if weight.shape[0] == head_dim:
            styles[name] = "replicated_with_grad_allreduce"
        elif weight.shape[0] == width and not (replicated and name not in _QUERY_NORMS):
            styles[name] = "colwise_norm"
        else:
            return None
    return styles


def _norms_span_heads(attention: nn.Module) -> bool:
    for projection, norm in (("q_proj", "q_norm"), ("k_proj", "k_norm")):
        p, weight = getattr(attention, projection, None), getattr(getattr(attention, norm, None), "weight", None)
        if not isinstance(p, nn.Linear) or not isinstance(weight, torch.Tensor) or weight.shape != (p.out_features,):
            return False
    return True


def fused_qkv_parts(attention: nn.Module) -> tuple[int, int, int] | None:
    """``(H·D, Hkv·D, Hkv·D)``: the widths of q, k and v in ``attention.qkv_proj`` as its forward slices them, by
    its config's ``num_attention_heads`` and ``num_key_value_heads`` and its ``head_dim`` (None when the module has
    no such projection or its width is another)."""
    config, qkv = getattr(attention, "config", None), getattr(attention, "qkv_proj", None)
    counts = (getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None),
              getattr(attention, "head_dim", None))  # fmt: skip
    if not isinstance(qkv, nn.Linear) or not all(isinstance(n, int) and n > 0 for n in counts):
        return None
    heads, kv_heads, head_dim = counts
    parts = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    return parts if sum(parts) == qkv.out_features else None


def pairs_halves(mlp: nn.Module) -> bool:
    """Whether ``mlp`` pairs the two halves of its ``gate_up_proj`` output feature by feature before ``down_proj``
    (so that each rank may keep the same features of both halves): :func:`_permutes_features`."""
    return _permutes_features(mlp, "gate_up_proj", "down_proj", halves=True)


def is_conv1d(m) -> bool:
    """Whether ``m`` is transformers' ``Conv1D`` (GPT-2's): a linear layer ``x @ W + b`` of weight ``[in, out]``."""
    return (type(m).__name__ == "Conv1D" and type(m).__module__.startswith("transformers")
            and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2)  # fmt: skip


def linear_widths(m) -> tuple[int, int] | None:
    """``(in, out)`` of an ``nn.Linear`` or a ``Conv1D``; None for another module."""
    if isinstance(m, nn.Linear):
        return m.in_features, m.out_features
    return tuple(m.weight.shape) if is_conv1d(m) else None


def _probe_args(mlp: nn.Module, rows: int, width: int, dtype, device) -> tuple:
    """The arguments after the input that ``mlp``'s forward needs: a zero ``residual`` (BLOOM's and MPT's MLPs add
    it themselves)."""
    try:
        params = list(inspect.signature(mlp.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return ()
    needed = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if [p.name for p in needed] == ["residual"]:
        return (torch.zeros(rows, width, dtype=dtype, device=device),)
    return ()


def _permutes_features(mlp: nn.Module, column: str, row: str, halves: bool, more: tuple[str, ...] = (),
                       args: tuple = ()) -> bool:  # fmt: skip
    """Whether ``mlp``'s output is unchanged when the intermediate features between its ``column`` and ``row``
    projections are permuted (in both halves of ``column``'s output alike, with ``halves``, and in the output of the
    ``more`` column projections added to it): probed on two random rows, ``mlp(x, *args)`` (a zero ``residual`` where
    its forward takes one). It holds for an activation that acts feature by feature (``act(gate)·up`` of two halves),
    and fails for interleaved pairs or features mixed otherwise. The projections are ``nn.Linear`` or ``Conv1D``
    layers. False for a module of another shape. On the meta device it is probed on a copy with random values
    (:func:`~tessel.layers.meta.probe_copy`)."""
    up, down = linear_widths(getattr(mlp, column, None)), linear_widths(getattr(mlp, row, None))
    if up is None or down is None:
        return False
    width = down[0]
    if up[1] != width * (2 if halves else 1) or not getattr(mlp, column).weight.is_floating_point():
        return False
    mlp = probe_copy(mlp)
    up, down = getattr(mlp, column), getattr(mlp, row)
    w = up.weight
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(width, generator=gen).to(w.device)
    rows = torch.cat([perm, perm + width]) if halves else perm
    x = torch.randn(2, linear_widths(up)[0], generator=gen).to(w.device, w.dtype)
    args = args or _probe_args(mlp, 2, linear_widths(down)[1], w.dtype, w.device)
    names = {p: n for n, p in mlp.named_parameters()}
    # a Conv1D's output features are its weight's columns and its input features its rows
    swapped = {names[down.weight]: down.weight[perm] if is_conv1d(down) else down.weight[:, perm]}
    for layer in (up, *(mlp.get_submodule(n) for n in more)):
        swapped[names[layer.weight]] = layer.weight[:, rows] if is_conv1d(layer) else layer.weight[rows]
        if layer.bias is not None:
            swapped[names[layer.bias]] = layer.bias[rows]
    training = mlp.training
    mlp.eval()  # no dropout
    try:
        with torch.no_grad():
            want, got = mlp(x, *args).float(), functional_call(mlp, swapped, (x, *args)).float()
    finally:
        mlp.train(training)
    tol = 1e-4 if w.dtype == torch.float32 else 3e-2
    return got.shape == want.shape and torch.allclose(got, want, rtol=tol, atol=tol * want.abs().max().item())


class LocalHeadsConfig:
    """A view of a model's config with this rank's head counts, for attention that reads its head counts from its
    config in its forward (Phi-3: ``self.config.num_attention_heads``). Every other attribute, read or written, is
    the shared config's (``set_attn_implementation`` reaches it); ``isinstance`` sees the config's class."""

    def __init__(self, config, **local: int):
        object.__setattr__(self, "_shared", config)
        object.__setattr__(self, "_local", dict(local))

    def __getattr__(self, name: str):
        if name.startswith("__"):  # copy, pickle and friends see this object, not the shared config
            raise AttributeError(name)
        local = object.__getattribute__(self, "_local")
        return local[name] if name in local else getattr(object.__getattribute__(self, "_shared"), name)

    def __setattr__(self, name: str, value) -> None:
        if name in object.__getattribute__(self, "_local"):
            raise AttributeError(f"{name} is this rank's share of the model's; set it on the model's config")
        setattr(object.__getattribute__(self, "_shared"), name, value)

    @property
    def __class__(self):
        return type(object.__getattribute__(self, "_shared"))

    def __reduce_ex__(self, protocol):
        return _local_heads_config, (object.__getattribute__(self, "_shared"), object.__getattribute__(self, "_local"))

    def __repr__(self) -> str:
        local = ", ".join(f"{k}={v}" for k, v in object.__getattribute__(self, "_local").items())
        return f"LocalHeadsConfig({local}) of {object.__getattribute__(self, '_shared')!r}"


def _local_heads_config(config, local: dict) -> LocalHeadsConfig:
    return LocalHeadsConfig(config, **local)


def positive_int_attr(module: nn.Module, attrs: tuple[str, ...]) -> int | None:
    """The first of ``module``'s attributes ``attrs`` that holds a positive int; None where none does."""
    for attr in attrs:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def head_dim_of(module: nn.Module) -> int | None:
    """The module's head dim, by the names Hugging Face attention modules use."""
    return positive_int_attr(module, ("head_dim", "attention_head_size"))


def local_head_updates(module: nn.Module, t: int) -> dict[str, int]:
    """The head-count attributes ``module`` has and their local values on each of ``t`` ranks.

    Raises ``ValueError`` (naming the attribute) when a count does not split evenly. Widths of heads
    (``hidden_size``...) are only touched when they equal the query width ``num_heads · head_dim``.
    """
    updates = {}
    for attr in HEAD_COUNT_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            if value % t:
                raise ValueError(
                    f"{type(module).__name__}.{attr}={value} does not split over {t} tensor-parallel ranks: use a "
                    "tensor-parallel size that divides every head count"
                )
            updates[attr] = value // t
    head_dim, heads = head_dim_of(module), updates.get("num_heads", updates.get("num_attention_heads"))
    if head_dim is not None and heads is not None:
        for attr in HEAD_WIDTH_ATTRS:
            if getattr(module, attr, None) == heads * t * head_dim:
                updates[attr] = heads * head_dim
    return updates
