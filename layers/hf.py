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

Context parallelism in a Hugging Face decoder (:class:`HFContextLayout`, ``parallelize(cp_group=)``):
every rank feeds its :func:`~tessel.parallel.context.split_sequence` share of the tokens, ``[B, S/c]``.
The model's attention implementation becomes tessel's, which runs
:func:`~tessel.parallel.context.ring_attention` for the modules marked with the group; the rotary
module receives the tokens' global (zigzag) positions in place of the local ``0 … S/c-1``, while the
base model keeps building its mask from local, contiguous positions (a plain causal mask is then
``None``). Packed documents: the caller passes the WHOLE sequence's ``position_ids [B or 1, S]``
(restarting at each document, as a padding-free collator makes them; the same on every rank). The base
model's hook takes each rank's positions from them for the rotary module, calls the base model without
them (so it builds no mask), and hands the attention modules the documents' segment ids
(:func:`packed_positions`) through the model's ``**kwargs``: the ring then attends within documents.
Documents are read from position ids with or without a cache (Hugging Face itself reads them only
with ``use_cache=False``). A sliding window (Mistral's ``sliding_window``) runs in the ring
(``ring_attention(window=)``). Padding: the caller passes the WHOLE sequence's ``attention_mask [B, S]``
(left or right padded rows; the same on every rank), which the hook turns into runs (padding before,
the tokens, padding after: :func:`padding_runs`) for the ring, so each token sees what the mask lets it
see; Hugging Face reads documents from position ids only without a mask, and so does the hook. What the
local view would get wrong is refused with a ``ValueError`` instead: position ids or a mask that are
not the whole sequence's, a mask with a gap inside a row, a key-value cache longer than the tokens
(decoding), and labels that
the model would shift itself (a chunk's last token predicts the first token of the next chunk, held by
another rank: pass ``shift_labels``, the globally shifted labels split the same way).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from ..parallel.collectives import gather_from_tp, scatter_to_sequence
from ..parallel.comm import group_rank, group_size
from ..parallel.context import zigzag_positions
from ..parallel.overlap import all_gather_matmul
from .hf_attention import CP_GROUP_ATTR, SEGMENT_IDS_KWARG, register_hf_attention, tessel_attention_forward
from .hf_experts import _inside, check_expert_blocks, expert_blocks, gather_router_logits
from .linear import ColumnParallelLinear, _check_input, _sequence_from_token_major, _sequence_token_major, _use_overlap

__all__ = [
    "HFContextLayout",
    "HFSequenceLayout",
    "RingColumnLinear",
    "SequenceRing",
    "hf_tp_plan",
    "is_hf_model",
    "packed_positions",
    "register_hf_attention",
    "tessel_attention_forward",
]

# Attention-module attributes holding a head count (or a width of heads) that Hugging Face modules of
# various versions read in forward; each becomes its local value (``/ t``) when the heads are split.
# transformers 5.x Llama/Mistral/Qwen2 attention reshapes with -1 and reads none of them.


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
    (:mod:`tessel.layers.hf_experts`), which compute on the shard and gather only inside their experts.
    """

    layers: list[str]
    final_norm: str
    norms: list[str]
    blocks: list[str]
    local_blocks: list[str]

    @classmethod
    def find(cls, model: nn.Module, column_names: list[str], expert_names: list[str] = ()) -> HFSequenceLayout:
        prefix, base = base_model(model)
        layers_name, norm_name = _decoder_names(model, base)
        layers = getattr(base, layers_name)
        layer_names = [f"{prefix}{layers_name}.{i}" for i in range(len(layers))]
        norms = [f"{name}.{child}" for name, layer in zip(layer_names, layers)
                 for child, m in layer.named_children() if _is_norm(m)]  # fmt: skip
        norms.append(prefix + norm_name)
        blocks = sorted({name.rsplit(".", 1)[0] for name in column_names if _inside(name, layer_names)})
        return cls(layer_names, prefix + norm_name, norms, blocks, expert_blocks(layer_names, blocks, expert_names))

    def in_region(self, name: str) -> bool:
        """Whether module ``name`` sees the sequence shard (inside a layer, or a residual-stream norm)."""
        return name in self.norms or _inside(name, self.layers)

    def check(self, model: nn.Module, split_names: set[str]) -> None:
        """Every block of every layer must be split by the plan: its input is a sequence shard."""
        modules = dict(model.named_modules())
        for name in self.layers:
            for child, m in modules[name].named_children():
                full = f"{name}.{child}"
                if full in self.norms or not any(True for _ in m.parameters()):
                    continue
                if full in split_names:
                    raise ValueError(
                        f"parallelize: sequence_parallel=True cannot split {full}: a decoder layer's direct "
                        "children see a sequence shard; only blocks below them gather it"
                    )
                if full not in self.blocks and full not in self.local_blocks:
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
                if x.dim() != 3 or x.shape[1] % t:
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
        modules[self.layers[0]].register_forward_pre_hook(scatter, with_kwargs=True)
        for name in self.blocks:
            ring = rings[name]
            modules[name].register_forward_pre_hook(
                lambda m, args, kwargs, ring=ring: _map_hidden_states(args, kwargs, ring.begin, ring.block),
                with_kwargs=True,
            )
            modules[name].register_forward_hook(lambda m, args, out, ring=ring: ring.end(), always_call=True)
        modules[self.final_norm].register_forward_hook(gather_output)


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


class SequenceRing:
    """The column projections of one block sharing one gathered input (q/k/v; gate/up): one ring for all.

    ``begin(shard)`` (the block's forward pre-hook) keeps the ``[B, S/t, H]`` shard and returns a
    ``[B, S, H]`` placeholder; the first projection called computes every projection's output with one
    :func:`~tessel.parallel.overlap.all_gather_matmul`; ``end()`` (the block's forward hook) drops what
    is left. A projection called a second time in the same forward runs a ring of its own.
    """

    def __init__(self, block: str, columns: list[RingColumnLinear], tp_group):
        if not columns:
            raise ValueError(f"SequenceRing: block {block} has no column-parallel projection to run")
        self.block, self.columns, self.tp_group = block, columns, tp_group
        self._shard = self._placeholder = None
        self._outputs: dict[int, object] = {}
        self._ran = False
        for c in columns:
            c.ring = self

    def begin(self, x: torch.Tensor) -> torch.Tensor:
        first = self.columns[0]
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

    def output(self, column: RingColumnLinear, x: torch.Tensor):
        if self._placeholder is None or x is not self._placeholder:
            raise ValueError(
                f"parallelize: under sequence_parallel=True the projections of {self.block} read the sequence "
                "shard the block received; this one was called with another tensor (the block transformed its "
                "input before projecting it, or a projection takes another projection's output): split such a "
                "module with sequence_parallel=False"
            )
        if id(column) not in self._outputs:
            self._outputs.update(self._run(self.columns if not self._ran else [column]))
            self._ran = True
        return self._outputs.pop(id(column))

    def end(self) -> None:
        self._shard = self._placeholder = None
        self._outputs = {}

    def _run(self, columns: list[RingColumnLinear]) -> dict[int, object]:
        x = self._shard
        x2 = _sequence_token_major(x)
        t, first = group_size(self.tp_group), columns[0]
        n_local = sum(c.weight.shape[0] for c in columns)
        overlap = _use_overlap(first.overlap, t, x2.shape[0] * t, first.in_features, n_local)
        ys = all_gather_matmul(x2, [c.weight for c in columns], self.tp_group, biases=[c.bias for c in columns],
                               overlap=overlap, regather=first.regather_input)  # fmt: skip
        outputs = {}
        for c, y in zip(columns, ys):
            y = _sequence_from_token_major(y, x)
            outputs[id(c)] = y.split(c.local_parts, dim=-1) if len(c.local_parts) > 1 else y
        return outputs


def _decoder_names(model: nn.Module, base: nn.Module) -> tuple[str, str]:
    """Names (in the base model) of the decoder layers' ModuleList and of the final norm."""
    pp_plan = list(getattr(model.config, "base_model_pp_plan", None) or {})
    names = pp_plan or [name for name, _ in base.named_children()]
    layers = [n for n in names if isinstance(getattr(base, n, None), nn.ModuleList)]
    norms = [n for n in names[names.index(layers[0]) + 1 :] if _is_norm(getattr(base, n, None))] if layers else []
    if len(layers) != 1 or not norms:
        raise ValueError(
            f"parallelize: sequence_parallel=True cannot find one ModuleList of decoder layers followed by a final "
            f"norm in {type(base).__name__} (children {names}); pass sequence_parallel=False"
        )
    return layers[0], norms[-1]


def _is_norm(module) -> bool:
    return isinstance(module, nn.Module) and "norm" in type(module).__name__.lower()


# ---------------------------------------------------------------------------------------------------- context parallel


def _bind(module: nn.Module, args, kwargs) -> inspect.BoundArguments:
    return inspect.signature(module.forward).bind(*args, **kwargs)


def _replace_argument(module: nn.Module, args: tuple, kwargs: dict, name: str, value) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of a call of ``module`` with argument ``name`` set to ``value`` where the caller put it
    (positionally or by keyword); the other arguments stay as they were passed, since wrappers around
    ``forward`` may add keywords of their own."""
    index = list(inspect.signature(module.forward).parameters).index(name)
    if index < len(args):
        return (*args[:index], value, *args[index + 1 :]), kwargs
    return args, {**kwargs, name: value}


def padding_runs(module: nn.Module, c: int, mask, tokens: torch.Tensor) -> torch.Tensor | None:
    """The padding given to a context-parallel Hugging Face model as ids of runs ``[B, S]``, or None.

    ``mask`` is the base model's ``attention_mask``: ``None``, or the WHOLE sequence's mask ``[B, S]``
    (``S = c ·`` the local length; the same on every rank, as for position ids) of ones and zeros, whose
    ones are one run per row: left or right padding (or both); all ones is no padding. A mask of this
    rank's share of the tokens is refused even when it masks nothing, since another rank's share may not:
    every rank then refuses alike instead of some waiting in the ring for the others. The result numbers each row's runs
    ``0`` (padding before), ``1`` (the tokens), ``2`` (padding after), so that the ring attends within
    them: every token sees exactly the tokens its row's mask lets it see, and padding sees padding only
    (its outputs are meaningless, as they are everywhere: leave them out of the loss). Raises a
    ValueError naming what is wrong.
    """
    if mask is None:
        return None
    b, length = tokens.shape[0], c * tokens.shape[1]
    what = (f"a {mask.dim()}-D {mask.dtype} mask of shape {list(mask.shape)}" if isinstance(mask, torch.Tensor)
            else type(mask).__name__)  # fmt: skip
    if not (isinstance(mask, torch.Tensor) and tuple(mask.shape) == (b, length) and not mask.is_floating_point()
            and not mask.is_complex() and bool(((mask == 0) | (mask == 1)).all())):  # fmt: skip
        raise ValueError(
            f"{type(module).__name__} under context parallelism over {c} ranks: an attention mask that pads must "
            f"be the whole sequence's integer or boolean mask [{b}, {length}] of ones and zeros (the same on every "
            f"rank, as position_ids), received {what}"
        )
    real = mask.bool()
    if bool(real.all()):
        return None
    pos = torch.arange(length, device=mask.device)
    start = torch.where(real, pos, length).min(1, keepdim=True).values
    end = torch.where(real, pos + 1, 0).max(1, keepdim=True).values
    inside = (pos >= start) & (pos < end)
    if not bool(torch.equal(inside, real)) or not bool(real.any(1).all()):
        raise ValueError(
            f"{type(module).__name__} under context parallelism over {c} ranks: the attention mask's ones must be "
            "one run in each row (left or right padding), with at least one token; received a row with a gap "
            "or with none"
        )
    return (pos >= start).to(torch.int32) + (pos >= end).to(torch.int32)


def _tokens(bound: inspect.BoundArguments) -> torch.Tensor:
    """The base model's input tokens (``input_ids``, or ``inputs_embeds``)."""
    tokens = bound.arguments.get("input_ids")
    return bound.arguments.get("inputs_embeds") if tokens is None else tokens


def _split_of(bound: inspect.BoundArguments, split: int) -> int:
    """The sequence-parallel split the base model's input may carry: hidden states (``inputs_embeds``, a later
    pipeline stage's input) may be split already; ``input_ids`` never are."""
    return split if bound.arguments.get("input_ids") is None else 1


def _check_var_keyword(module: nn.Module) -> None:
    """Raise unless ``module.forward`` takes ``**kwargs``, through which extra arguments reach the attention modules."""
    kinds = [p.kind for p in inspect.signature(module.forward).parameters.values()]
    if inspect.Parameter.VAR_KEYWORD not in kinds:
        raise ValueError(
            f"parallelize: under context parallelism, packed documents (position_ids) need "
            f"{type(module).__name__}.forward to pass **kwargs on to its attention modules; it takes none"
        )


def packed_positions(position_ids, tokens: torch.Tensor, cp_size: int, split: int = 1
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """The whole sequence's ``position_ids`` given to a context-parallel Hugging Face model, checked, and its
    documents: ``(position_ids, segment_ids [B, S] or None)``.

    ``position_ids`` must cover the whole sequence, ``[B or 1, S]`` with ``S = cp_size ·`` the local
    length of ``tokens [B, S/c, …]`` (the same on every rank; ``split``: the tokens may also be hidden states already
    split over that many sequence-parallel ranks, ``[B, S/(c·split), H]``, as a later pipeline stage receives them),
    as a padding-free collator packs documents:
    a document begins wherever a position is not the previous one plus one (Hugging Face's rule for
    packed sequences). ``segment_ids`` numbers the documents ``0, 1, …`` along each row, ``None`` when every
    row is one document. Raises a ValueError naming what is wrong.
    """
    b, local = tokens.shape[0], tokens.shape[1]
    lengths = sorted({cp_size * local, cp_size * local * split})
    want = f"[{b} or 1, {' or '.join(map(str, lengths))}]"
    ok = isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2
    ok = ok and not (position_ids.is_floating_point() or position_ids.is_complex() or position_ids.dtype == torch.bool)
    if not ok or position_ids.shape[0] not in (1, b) or position_ids.shape[1] not in lengths:
        got = type(position_ids).__name__
        if isinstance(position_ids, torch.Tensor):
            got = f"{position_ids.dtype} tensor of shape {list(position_ids.shape)}"
        raise ValueError(
            f"parallelize: under context parallelism position_ids must be the whole sequence's integer positions "
            f"{want} (the same on every rank; each rank takes its own tokens' positions from them), received {got}"
        )
    if position_ids.device != tokens.device:
        raise ValueError(f"parallelize: position_ids must be on the inputs' device {tokens.device}, received "
                         f"{position_ids.device}")  # fmt: skip
    begins = torch.ones(position_ids.shape, device=position_ids.device, dtype=torch.int32)
    begins[:, 0] = 0
    begins[:, 1:] = (position_ids[:, 1:] - position_ids[:, :-1] != 1).to(torch.int32)
    if not bool(begins.any()):
        return position_ids, None
    return position_ids, begins.cumsum(1, dtype=torch.int32).expand(b, -1)


@dataclass
class HFContextLayout:
    """Where context parallelism reaches into a Hugging Face decoder (see the module docstring).

    ``attention``: the modules that call the attention implementation (class names ending in
    ``Attention``); ``rotary``: the base model's rotary-embedding module, fed the global positions;
    ``base``: the base model, whose caller may not pass position ids; ``head``: whether ``model`` is a
    head model above the base (its loss would shift ``labels`` itself).
    """

    attention: list[str]
    rotary: str
    base: str
    head: bool

    @classmethod
    def find(cls, model: nn.Module) -> HFContextLayout:
        prefix, base = base_model(model)
        attention = [name for name, m in model.named_modules() if type(m).__name__.endswith("Attention")]
        rotary = [name for name, m in base.named_children() if "rotary" in type(m).__name__.lower()]
        if not attention:
            raise ValueError(f"parallelize: cp_group needs attention modules (class names ending in Attention) in "
                             f"{type(model).__name__}, found none")  # fmt: skip
        if len(rotary) != 1:
            raise ValueError(
                f"parallelize: cp_group needs one rotary-embedding module among the children of {type(base).__name__} "
                f"(it is fed the global positions of this rank's tokens), found {rotary or 'none'}"
            )
        return cls(attention, prefix + rotary[0], prefix.rstrip("."), bool(prefix))

    def install(self, model: nn.Module, cp_group, split: int = 1) -> None:
        """Mark the attention modules with ``cp_group``, switch the model to tessel's attention, and hook the
        rotary module (global positions), the base model (whole-sequence position ids: packed documents)
        and the head (no self-shifted labels). ``split``: the tensor-parallel ranks the sequence is also split
        over (sequence parallelism), whose shares a later pipeline stage's base model receives as its input."""
        c, r = group_size(cp_group), group_rank(cp_group)
        modules = dict(model.named_modules())
        for name in self.attention:
            setattr(modules[name], CP_GROUP_ATTR, cp_group)
        # the positions of this rank's tokens that the caller gave the base model, for its rotary module
        # (None: the zigzag share of 0 … S-1); set by every call of the base model, before its rotary runs
        held = {"positions": None}

        def positions(module, args, kwargs):
            bound = _bind(module, args, kwargs)
            ids = bound.arguments.get("position_ids")
            if not isinstance(ids, torch.Tensor):
                raise ValueError(f"parallelize: {self.rotary} was called without position_ids under context "
                                 "parallelism")  # fmt: skip
            if ids.shape[-1] % 2:
                raise ValueError(
                    f"parallelize: under context parallelism each rank holds two equal chunks of the sequence "
                    f"(tessel.parallel.split_sequence), so its length must be even, received {ids.shape[-1]}"
                )
            given = held["positions"]
            if given is None:
                glob = zigzag_positions(ids.shape[-1] * c, c, r, device=ids.device).expand_as(ids)
            else:
                glob = given.expand(ids.shape[0], -1) if given.shape[0] == 1 else given
            bound.arguments["position_ids"] = glob.to(ids.dtype)
            return bound.args, bound.kwargs

        def whole_positions(module, args, kwargs):
            bound = _bind(module, args, kwargs)
            given = bound.arguments.get("position_ids")
            held["positions"] = None
            if c == 1:
                if given is None:
                    return None
                held["positions"] = packed_positions(given, _tokens(bound), c, _split_of(bound, split))[0]
                return None  # the local view is the whole: the model reads its documents itself
            runs = None
            masked = bound.arguments.get("attention_mask") is not None
            if masked:
                runs = padding_runs(module, c, bound.arguments["attention_mask"], _tokens(bound))
                # the padding goes to the ring as runs. Any mask the model builds is then its own, from
                # the local view (a sliding window over the local tokens, which the ring replaces with
                # the global one)
                args, kwargs = _replace_argument(module, args, kwargs, "attention_mask", None)
            segment_ids = None
            if given is not None:
                whole, segment_ids = packed_positions(given, _tokens(bound), c, _split_of(bound, split))
                if masked:  # as Hugging Face reads them: documents from position ids only without a mask
                    segment_ids = None
                held["positions"] = whole[:, zigzag_positions(whole.shape[1], c, r, device=whole.device)]
                # the local view: positions 0 … S/c-1, a plain causal mask
                args, kwargs = _replace_argument(module, args, kwargs, "position_ids", None)
            if runs is not None:
                segment_ids = runs
            if segment_ids is not None:
                _check_var_keyword(module)
                kwargs = {**kwargs, SEGMENT_IDS_KWARG: segment_ids}
            return args, kwargs

        def forget_positions(module, args, output):
            held["positions"] = None

        def no_self_shift(module, args, kwargs):
            if _bind(module, args, kwargs).arguments.get("labels") is not None and kwargs.get("shift_labels") is None:
                raise ValueError(
                    "parallelize: under context parallelism the model cannot shift labels itself (a chunk's last token "
                    "predicts a token another rank holds): pass shift_labels=split_sequence(labels shifted left by one "
                    "over the whole sequence, -100 at the end) along with labels"
                )

        modules[self.rotary].register_forward_pre_hook(positions, with_kwargs=True)
        modules[self.base].register_forward_pre_hook(whole_positions, with_kwargs=True)
        modules[self.base].register_forward_hook(forget_positions)
        if self.head:
            model.register_forward_pre_hook(no_self_shift, with_kwargs=True)
        register_hf_attention()
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation("tessel")
        else:  # transformers < 4.56
            model.config._attn_implementation = "tessel"
