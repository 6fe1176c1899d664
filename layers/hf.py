"""Hugging Face models in tessel: their tensor-parallel plans and their decoder layout (tessel's attention
implementation for them is in :mod:`tessel.layers.hf_attention`, re-exported here).

Nothing here imports ``transformers`` at module level: :func:`register_hf_attention` imports it when it
is called, and the rest reads models by duck typing (``config.base_model_tp_plan``,
``base_model_prefix``, ``config.base_model_pp_plan``), so ``import tessel.layers`` never needs it.

Legend: ``B`` batch, ``S`` sequence, ``H`` model width, ``Hq``/``Hkv`` query/key-value heads, ``D`` head
dim, ``t`` tensor-parallel size.

Sequence parallelism in a Hugging Face decoder (:class:`HFSequenceLayout`). The base model computes
position ids, rotary tables and the causal mask from the full ``inputs_embeds`` before its first layer,
so the residual stream is split only where the layers begin, and every block sees whole positions::

    embed_tokens → [B, S, H] ──scatter──▶ [B, S/t, H] ─ layer 0 … L-1 ─ norm ──gather──▶ [B, S, H] → lm_head
    inside a layer:  norm (shard) → block: q/k/v or gate/up as ONE all-gather ring over the shard
                     (heads of this rank, rotary on global positions) → o_proj / down_proj: GEMM +
                     reduce-scatter ring → [B, S/t, H]

The column projections of a block share one :class:`SequenceRing`: the first projection the block
calls runs :func:`~tessel.parallel.overlap.all_gather_matmul` for all of them at once, each GEMM step
working on the shard that has arrived while the next one travels, and hands its siblings their
outputs when they are called. Hugging Face attention reads the sequence length from its input
(``hidden_states.shape[:-1]``) to reshape q, k, v, so the block receives, in place of its input, a
placeholder of the whole sequence's shape that holds no memory (one NaN, expanded): the projections
recognise it by identity and read the shard instead; a block that computes with its input other than
through its projections would see NaN, and a projection called with anything else raises. Backward:
the ring's reduce-scatter sums every projection's input gradient over the group, with the weight
gradients computed while it is in flight. Under sequence parallelism the intermediate
``output_hidden_states`` are sequence shards, and decoding one token at a time (whose length does not
split) needs ``sequence_parallel=False``.

Context parallelism in a Hugging Face decoder (``parallelize(cp_group=)``) is in :mod:`tessel.layers.hf_context`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from ..parallel.collectives import copy_to_tp, gather_from_tp, scatter_to_sequence
from ..parallel.comm import group_size
from .hf_attention import register_hf_attention, tessel_attention_forward
from .hf_experts import _inside, check_expert_blocks, expert_blocks, gather_router_logits
from .hf_mixers import _plain_linear
from .linear import ColumnParallelLinear, _check_input, column_outputs

__all__ = [
    "HFSequenceLayout",
    "RingColumnLinear",
    "RingLatentLinear",
    "SequenceRing",
    "check_layers_split",
    "decoder_layer_list",
    "hf_tp_plan",
    "is_hf_model",
    "register_hf_attention",
    "tessel_attention_forward",
]


def is_hf_model(model: nn.Module) -> bool:
    """A ``transformers.PreTrainedModel`` (recognised without importing transformers)."""
    return hasattr(model, "config") and hasattr(type(model), "base_model_prefix")


def base_model(model: nn.Module) -> tuple[str, nn.Module]:
    """``(name prefix, base model)``: ``("model.", model.model)`` for a head model, ``("", model)`` for a base one."""
    prefix = getattr(type(model), "base_model_prefix", "") or ""
    base = getattr(model, prefix, None) if prefix else None
    if isinstance(base, nn.Module) and base is not model:
        return prefix + ".", base
    # a head model whose base model has another name than its prefix (Llama 4's: "model", not "language_model")
    bases = [(name, child) for name, child in model.named_children() if is_hf_model(child)]
    if len(bases) == 1:
        return bases[0][0] + ".", bases[0][1]
    return "", model


def hf_tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The model's own plan: ``config.base_model_tp_plan`` (keys prefixed with the base model's name), the
    input embedding over the vocabulary as transformers 5.x adds it (when it is a plain ``nn.Embedding``:
    Gemma's scales its output in its own forward and stays replicated), and the head model's ``_tp_plan``."""
    if not is_hf_model(model):
        return None
    base_plan = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    if not base_plan:
        return None
    prefix, base = base_model(model)
    embed = getattr(base, "embed_tokens", None)
    if isinstance(embed, nn.Embedding) and type(embed).forward is nn.Embedding.forward:
        base_plan = {"embed_tokens": "embedding_rowwise", **base_plan}
    plan = {prefix + key: style for key, style in base_plan.items()}
    if prefix:
        plan.update(getattr(type(model), "_tp_plan", None) or {})
    return plan


# ---------------------------------------------------------------------------------------------------- sequence parallel


def _map_hidden_states(args, kwargs, fn, where: str):
    """Apply ``fn`` to the hidden-states argument of a forward call (first positional or ``hidden_states=``)."""
    if args and isinstance(args[0], torch.Tensor):
        return (fn(args[0]), *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
    raise ValueError(f"parallelize: {where} was called without a hidden-states tensor to split along the sequence")


@dataclass
class HFSequenceLayout:
    """Where a Hugging Face decoder's residual stream starts, runs and ends (``sequence_parallel=True``).

    ``layers``: names of the decoder layers; ``final_norm``: the base model's last norm; ``norms``:
    residual-stream norms (direct children of the layers whose class name says Norm, and the final
    norm); ``blocks``: modules inside a layer holding column-parallel projections, which gather the
    sequence at their input; ``local_blocks``: direct children of the layers holding split experts
    (:mod:`tessel.layers.hf_experts`), which compute on the shard and gather only inside their experts;
    ``token_blocks``: plain ``nn.Linear`` direct children of the layers the plan leaves whole (Gemma 4's per-layer
    input gate and projection), and the modules beside experts that sit directly in a layer (Gemma 4's
    router), which compute on the shard token by token, their gradients summed over the group. A layer that takes a
    ``per_layer_input`` (Gemma 4's: ``[B, S, P]`` beside the residual stream) receives this rank's share of
    it.
    """

    layers: list[str]
    final_norm: str
    norms: list[str]
    blocks: list[str]
    local_blocks: list[str]
    token_blocks: list[str] = field(default_factory=list)
    sublayers: list[str] = field(default_factory=list)

    @classmethod
    def find(cls, model: nn.Module, column_names: list[str], expert_names: list[str] = ()) -> HFSequenceLayout:
        prefix, base = base_model(model)
        layers_name, norm_name = _decoder_names(model, base)
        layers = base.get_submodule(layers_name)
        layer_names = [f"{prefix}{layers_name}.{i}" for i in range(len(layers))]
        norms = [f"{name}.{child}" for name, layer in zip(layer_names, layers)
                 for child, m in layer.named_children() if _is_norm(m)]  # fmt: skip
        norms.append(prefix + norm_name)
        # a layer's own column projections (OPT's fc1, beside its fc2) gather the shard themselves: no block
        blocks = {name.rsplit(".", 1)[0] for name in column_names if _inside(name, layer_names)} - set(layer_names)
        blocks = sorted(b for b in blocks if not _inside(b, blocks - {b}))  # a Sequential inside a block is its block's
        for name, layer in zip(layer_names, layers):  # a wrapper of one block (GPT-Neo's attn.attention): the block
            for child, m in layer.named_children():
                inner = [f"{name}.{child}.{n}" for n, c in m.named_children() if any(True for _ in c.parameters())]
                if not m._parameters and len(inner) == 1 and inner[0] in blocks:
                    blocks[blocks.index(inner[0])] = f"{name}.{child}"
        local = expert_blocks(layer_names, blocks, expert_names)
        tokens, sublayers = [], []
        for name, layer in zip(layer_names, layers):  # decoder layers inside a layer (Zamba 2's hybrid layers')
            for child, m in layer.named_children():
                full = f"{name}.{child}"
                inner = [(f"{full}.{n}", c) for n, c in m.named_children() if any(True for _ in c.parameters())]
                holds = any(_is_norm(c) for _, c in inner) and any(n in blocks for n, _ in inner)
                if full in (*blocks, *local) or _is_norm(m) or m._parameters or not holds:  # norms and blocks alone
                    continue
                if all(_is_norm(c) or n in blocks or _plain_linear(c) for n, c in inner):
                    sublayers.append(full)
                    norms += [n for n, c in inner if _is_norm(c)]
                    tokens += [n for n, c in inner if _plain_linear(c) and n not in blocks]
        for name, layer in zip(layer_names, layers):
            holds_experts = any(block.rpartition(".")[0] == name for block in local if block in expert_names)
            for child, m in layer.named_children():
                full, plain = f"{name}.{child}", _plain_linear(m) or _hyper_connection(m)
                # beside experts that sit in the layer itself, its other modules (their router) see the shard too
                beside = holds_experts and full not in (*norms, *blocks, *local) and any(True for _ in m.parameters())
                if plain or beside:
                    tokens.append(full)
        # the final collapse of hyper-connections' streams, before the final norm: token by token too
        tokens += [prefix + n for n, m in base.named_children() if _hyper_connection(m)]
        return cls(layer_names, prefix + norm_name, norms, blocks, local, tokens, sublayers)

    def in_region(self, name: str) -> bool:
        """Whether module ``name`` sees the sequence shard (inside a layer, or a residual-stream norm)."""
        return name in self.norms or _inside(name, self.layers)

    def check(self, model: nn.Module, split_names: set[str]) -> None:
        """Every block of every layer must be split by the plan: its input is a sequence shard."""
        modules = dict(model.named_modules())
        for name in (*self.layers, *self.sublayers):
            for child, m in modules[name].named_children():
                full = f"{name}.{child}"
                if full in (*self.norms, *self.sublayers) or not any(True for _ in m.parameters()):
                    continue
                if full in split_names and _own_linear(m, full, split_names, modules[name]):
                    continue  # a column → row pair of the layer's own (OPT's fc1, fc2): Megatron's gather and scatter
                if full in split_names:
                    raise ValueError(
                        f"parallelize: sequence_parallel=True cannot split {full}: a decoder layer's direct "
                        "children see a sequence shard; only blocks below them gather it"
                    )
                if full not in self.blocks and full not in self.local_blocks and full not in self.token_blocks:
                    raise ValueError(
                        f"parallelize: sequence_parallel=True but the plan splits nothing in {full} "
                        f"({type(m).__name__}): every block of a decoder layer receives a sequence shard, so each "
                        "must hold column-parallel projections that gather it (or split experts)"
                    )
        check_expert_blocks(modules, self.local_blocks, self.blocks, split_names)
        for block in self.blocks:
            for sub, m in modules[block].named_modules():
                if isinstance(m, nn.Linear) and f"{block}.{sub}" not in split_names:
                    raise ValueError(
                        f"parallelize: sequence_parallel=True but {block}.{sub} is an nn.Linear the plan leaves "
                        "replicated inside a block that gathers the sequence; split it (colwise/rowwise) as well"
                    )

    def install(self, model: nn.Module, tp_group, rings: dict[str, SequenceRing], cp_group=None) -> None:
        """Scatter before the first layer, a ring per block (``rings``: block name → its ring), gather after
        the final norm (once the layers have run); the router logits are gathered over ``tp_group`` (and
        ``cp_group``, when given)."""
        modules = dict(model.named_modules())
        t = group_size(tp_group)

        def scatter(module, args, kwargs):
            def split(x):
                if x.dim() < 3 or x.shape[1] % t:  # [batch, seq, streams, hidden] with hyper-connections
                    raise ValueError(
                        "parallelize: sequence_parallel=True needs [batch, seq, hidden] hidden states with seq "
                        f"divisible by the tensor-parallel size {t}, received {tuple(x.shape)}"
                    )
                return scatter_to_sequence(x, tp_group, dim=1)

            return _map_hidden_states(args, kwargs, split, self.layers[0])

        # whether this forward has entered a decoder layer: a final norm the model also runs before its layers
        # (NanoChat's) sees the whole sequence there, and gathers only after them
        state = {"split": False}

        def enter(split: bool):
            def hook(module, args):
                state["split"] = split

            return hook

        def gather_output(module, args, out):
            return gather_from_tp(out, tp_group, dim=1) if state["split"] else out

        base_model(model)[1].register_forward_pre_hook(enter(False))
        for name in self.layers:
            modules[name].register_forward_pre_hook(enter(True))
        if self.local_blocks:
            gather_router_logits(model, type(base_model(model)[1]), self.local_blocks, tp_group, cp_group)
        for name in self.local_blocks:  # a shard in the row layers' token-major layout, which blocks of experts may
            modules[name].register_forward_pre_hook(  # view(-1, hidden) (LFM2-MoE's)
                lambda m, args, kwargs, name=name: _map_hidden_states(args, kwargs, _contiguous, name),
                with_kwargs=True,
            )
        modules[self.layers[0]].register_forward_pre_hook(scatter, with_kwargs=True)
        for name in self.layers:
            _scatter_per_layer_input(modules[name], tp_group)
        for name in self.blocks:
            ring = rings[name]
            modules[name].register_forward_pre_hook(
                lambda m, args, kwargs, ring=ring: _map_hidden_states(args, kwargs, ring.begin, ring.block),
                with_kwargs=True,
            )
            modules[name].register_forward_hook(lambda m, args, out, ring=ring: ring.end(), always_call=True)
        modules[self.final_norm].register_forward_hook(gather_output)


def _hyper_connection(m: nn.Module) -> bool:
    """Hyper-connections (DeepSeek-V4's, HY-V4's): per token, the mix of a layer's residual streams into its input and
    its output back into them (``*HyperConnection``), and the collapse of the streams before the final norm
    (``*HyperHead``); they run on a sequence shard as they are, their parameters' gradients summed over the group."""
    return type(m).__name__.endswith(("HyperConnection", "HyperHead")) and any(True for _ in m.parameters())


def _contiguous(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous()


# a layer's inputs of the whole sequence beside its hidden states: Gemma 4's per-layer inputs ([B, S, P]), Zamba 2's
# embeddings, which its hybrid layers' shared attention reads beside the hidden states, DeepSeek-V4's token ids
# ([B, S]), by which its hash-routed experts choose each token's experts
_SEQUENCE_INPUTS = ("per_layer_input", "original_hidden_states", "input_ids")


def _scatter_per_layer_input(layer: nn.Module, tp_group) -> None:
    """A layer whose forward takes one of :data:`_SEQUENCE_INPUTS` (the whole sequence, as the base model computes
    it) receives this rank's share of its sequence, as its hidden states are; the gradient is gathered back."""
    names = list(inspect.signature(type(layer).forward).parameters)[1:]
    for arg in (n for n in _SEQUENCE_INPUTS if n in names):
        index = names.index(arg)

        def split(module, args, kwargs, arg=arg, index=index):
            if index < len(args) and isinstance(args[index], torch.Tensor):
                args = (*args[:index], scatter_to_sequence(args[index], tp_group, dim=1), *args[index + 1 :])
            elif isinstance(kwargs.get(arg), torch.Tensor):
                kwargs = {**kwargs, arg: scatter_to_sequence(kwargs[arg], tp_group, dim=1)}
            return args, kwargs

        layer.register_forward_pre_hook(split, with_kwargs=True)


class RingColumnLinear(ColumnParallelLinear):
    """A column-parallel projection inside a sequence-parallel Hugging Face block: its output comes from the
    block's :class:`SequenceRing`, which computes it together with its siblings' in one all-gather ring.

    Called with the placeholder its block received (not a tensor of values); see the module docstring.
    """

    ring: SequenceRing | None = None

    def forward(self, x: torch.Tensor):
        if self.ring is None:
            raise RuntimeError(f"{type(self).__name__} runs only inside the block that parallelize() gave a ring")
        return self.ring.output(self, x)


class RingLatentLinear(nn.Linear):
    """A replicated projection to a narrow latent inside a sequence-parallel Hugging Face block (multi-head latent
    attention's ``q_a_proj`` and ``kv_a_proj_with_mqa``): it multiplies this rank's ``[B, S/t, H]`` shard, which
    its block's :class:`SequenceRing` holds, and all-gathers the ``[B, S/t, r]`` result along the sequence
    (:func:`~tessel.parallel.collectives.gather_from_tp`: what follows is replicated, so the backward keeps this
    rank's rows of the gradient). The latent, not the hidden state, travels: ``r`` is a fraction of ``H``. The
    weight and bias, shared with the module it replaces, reach the GEMM through ``copy_to_tp``: each rank's tokens
    give a share of their gradient, summed over the group in backward.

    Called with the placeholder its block received, as :class:`RingColumnLinear` is.
    """

    ring: SequenceRing | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> RingLatentLinear:
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight, layer.bias = linear.weight, linear.bias
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ring is None:
            raise RuntimeError(f"{type(self).__name__} runs only inside the block that parallelize() gave a ring")
        shard = self.ring.shard(self, x)
        group = self.ring.tp_group
        bias = None if self.bias is None else copy_to_tp(self.bias, group)
        y = nn.functional.linear(shard, copy_to_tp(self.weight, group), bias)
        return gather_from_tp(y, group, dim=y.dim() - 2)


class SequenceRing:
    """The column projections of one block sharing one gathered input (q/k/v; gate/up): one ring for all.

    ``begin(shard)`` (the block's forward pre-hook) keeps the ``[B, S/t, H]`` shard and returns a
    ``[B, S, H]`` placeholder; the first projection called computes every projection's output with one
    :func:`~tessel.parallel.overlap.all_gather_matmul`; ``end()`` (the block's forward hook) drops what
    is left. A projection called a second time in the same forward runs a ring of its own. ``latents``
    (:class:`RingLatentLinear`) read the shard itself. Projections in fp8 share one ring of the shard in fp8 (their
    weights quantised as one), beside the others' ring.
    """

    def __init__(self, block: str, columns: list[RingColumnLinear], tp_group, latents: list[RingLatentLinear] = ()):
        if not columns and not latents:
            raise ValueError(f"SequenceRing: block {block} has no column-parallel projection to run")
        self.block, self.columns, self.latents, self.tp_group = block, columns, list(latents), tp_group
        self._shard = self._placeholder = None
        self._outputs: dict[int, object] = {}
        self._ran = False
        for c in columns:
            c.ring = self
        for c in self.latents:
            c.ring, c.tp_group = self, tp_group

    def begin(self, x: torch.Tensor) -> torch.Tensor:
        first = (self.columns or self.latents)[0]
        _check_input(first, x, first.in_features, "in_features")
        if x.dim() not in (2, 3):
            raise ValueError(
                f"parallelize: {self.block} needs [batch, seq/t, hidden] (or [tokens/t, hidden]) hidden states under "
                f"sequence parallelism, received shape {tuple(x.shape)}"
            )
        shape = list(x.shape)
        shape[-2] *= group_size(self.tp_group)
        self._shard, self._outputs, self._ran = x, {}, False
        self._placeholder = x.new_full((1,) * x.dim(), float("nan")).expand(shape)
        return self._placeholder

    def shard(self, latent: RingLatentLinear, x: torch.Tensor) -> torch.Tensor:
        """The shard behind the placeholder ``x`` that ``latent`` was called with."""
        self._check_placeholder(x)
        return self._shard

    def output(self, column: RingColumnLinear, x: torch.Tensor):
        self._check_placeholder(x)
        if id(column) not in self._outputs:
            self._outputs.update(self._run(self.columns if not self._ran else [column]))
            self._ran = True
        return self._outputs.pop(id(column))

    def _check_placeholder(self, x) -> None:
        if self._placeholder is None or x is not self._placeholder:
            raise ValueError(
                f"parallelize: under sequence_parallel=True the projections of {self.block} read the sequence "
                "shard the block received; this one was called with another tensor (the block transformed its "
                "input before projecting it, or a projection takes another projection's output): split such a "
                "module with sequence_parallel=False"
            )

    def end(self) -> None:
        self._shard = self._placeholder = None
        self._outputs = {}

    def _run(self, columns: list[RingColumnLinear]) -> dict[int, object]:
        outputs = {}
        for fp8 in (False, True):  # the projections in fp8 gather the shard in fp8, the others in their dtype
            if same := [c for c in columns if c.fp8 == fp8]:
                outputs.update(zip(map(id, same), column_outputs(same, self._shard)))
        return outputs


def _layers_name(model: nn.Module, base: nn.Module) -> str | None:
    """The name in the base model of its decoder layers: the one ModuleList among its children (in its pipeline plan's
    order where it has one) that learns (``layers``, GPT-2's ``h``), or ``layers`` of its one child holding them (OPT's
    ``decoder.layers``); None where there is no such one."""
    pp_plan = list(getattr(model.config, "base_model_pp_plan", None) or {})
    names = pp_plan or [name for name, _ in base.named_children()]
    # a ModuleList that learns nothing (Granite-MoE-SWA's rotary embeddings, one per kind of layer) is not the layers
    lists = [
        n for n in names if isinstance(m := getattr(base, n, None), nn.ModuleList) and any(True for _ in m.parameters())
    ]
    if lists or pp_plan:
        return lists[0] if len(lists) == 1 else None
    inner = [n for n, m in base.named_children() if isinstance(getattr(m, "layers", None), nn.ModuleList)]
    return f"{inner[0]}.layers" if len(inner) == 1 else None


def decoder_layer_list(model: nn.Module) -> nn.ModuleList:
    """A Hugging Face model's decoder layers: its base model's ``layers``, else as :func:`_layers_name` finds them
    (GPT-2's ``h``, OPT's ``decoder.layers``)."""
    base = base_model(model)[1]
    if isinstance(getattr(base, "layers", None), nn.ModuleList):
        return base.layers
    name = _layers_name(model, base)
    if name is None:
        raise ValueError(f"cannot find the decoder layers of {type(base).__name__}: no one ModuleList of them")
    return base.get_submodule(name)


def check_layers_split(model: nn.Module, split_names) -> None:
    """Refuse (``ValueError``) to split a Hugging Face model by its own plan when nothing the plan names lies inside
    its decoder layers (DBRX's, whose fused attention and 2-d experts no plan names): only its embeddings and head
    would be split, and every rank would run every layer whole, silently. A model whose layers tessel cannot find is
    let through (its plan has been checked otherwise)."""
    base_prefix, base = base_model(model)
    name = _layers_name(model, base)
    if name is None:
        return
    layers = base_prefix + name
    if not any(n.startswith(layers + ".") for n in split_names):
        raise ValueError(
            f"parallelize: {type(model).__name__}'s plan splits nothing inside its decoder layers ({layers}.*; it "
            f"splits {sorted(split_names) or 'nothing'}): every rank would run every layer whole; pass "
            "plan={module-name glob: style} naming their projections"
        )


def _decoder_names(model: nn.Module, base: nn.Module) -> tuple[str, str]:
    """Names (in the base model) of the decoder layers' ModuleList and of the final norm: the last norm after the
    layers, among the children of the module holding them (OPT's decoder, whose ``final_layer_norm`` is defined
    before its layers: that one)."""
    layers, norm = _layers_name(model, base), None
    if layers is not None:
        holder_name, _, leaf = layers.rpartition(".")
        holder = base.get_submodule(holder_name) if holder_name else base
        pp_plan = list(getattr(model.config, "base_model_pp_plan", None) or {})
        names = pp_plan if pp_plan and not holder_name else [name for name, _ in holder.named_children()]
        norms = [n for n in names[names.index(leaf) + 1 :] if _is_norm(getattr(holder, n, None))]
        if holder_name and not norms and _is_norm(getattr(holder, "final_layer_norm", None)):
            norms = ["final_layer_norm"]
        norm = f"{holder_name}.{norms[-1]}" if holder_name and norms else norms[-1] if norms else None
    if layers is None or norm is None:
        raise ValueError(
            f"parallelize: sequence_parallel=True cannot find one ModuleList of decoder layers followed by a final "
            f"norm in {type(base).__name__} (children {[n for n, _ in base.named_children()]}); pass "
            "sequence_parallel=False"
        )
    return layers, norm


def _own_linear(m: nn.Module, name: str, split_names: set[str], layer: nn.Module) -> bool:
    """Whether ``m`` (``name``, split) is a linear layer of a decoder ``layer`` that holds a column → row pair of its
    own, as OPT's holds its MLP's fc1 and fc2."""
    from .hf_classic import linear_like

    prefix = name.rpartition(".")[0]
    own = [c for n, c in layer.named_children() if f"{prefix}.{n}" in split_names and linear_like(c)]
    return linear_like(m) and len(own) >= 2


def _is_norm(module) -> bool:
    return isinstance(module, nn.Module) and "norm" in type(module).__name__.lower()
