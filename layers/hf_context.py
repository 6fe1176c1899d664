"""Context parallelism in a Hugging Face decoder (:class:`HFContextLayout`, ``parallelize(cp_group=)``).

Every rank feeds its :func:`~tessel.parallel.context.split_sequence` share of the tokens, ``[B, S/c]``.
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
from dataclasses import dataclass, field

import torch
from torch import nn

from ..parallel.comm import group_rank, group_size
from ..parallel.context import zigzag_positions
from ..parallel.context_shared import sequence_from_shares
from .hf import base_model, decoder_layer_list
from .hf_attention import CP_GROUP_ATTR, SEGMENT_IDS_KWARG, SHARED_KEYS_ATTR, register_hf_attention
from .hf_mixer_context import MixerContext, context_mixers, entry_names, install_mixer_context, mixer_context

__all__ = ["HFContextLayout", "packed_positions", "padding_runs"]


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


# Hugging Face's names for decoder layers that are not attention (config.layer_types / layers_block_type)
# DeepSeek-V4's compressed layers: attention over a sliding window and keys compressed from the whole sequence, which
# every rank compresses from the gathered sequence (:func:`_share_compressed_keys`)
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "attention",
                          "compressed_sparse_attention", "heavily_compressed_attention")  # fmt: skip


def _other_sequence_mixers(model: nn.Module, mixers: list[str]) -> list[str]:
    """Modules that mix tokens along the sequence other than attention and the ``mixers`` that run under context
    parallelism (:mod:`~tessel.layers.hf_mixer_context`): convolutions over the sequence (Mamba-1's), or the decoder
    layers whose type the config names as other than attention (``linear_attention``, ``mamba``, ``conv``...) and
    that hold none of ``mixers``."""
    inside = tuple(f"{n}." for n in mixers)
    found = [f"{name} ({type(m).__name__})" for name, m in model.named_modules()
             if isinstance(m, nn.Conv1d) and not name.startswith(inside)]  # fmt: skip
    config = getattr(model, "config", None)
    types = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
    if isinstance(types, list | tuple):
        layers = _decoder_layers(model)
        kinds = sorted({str(kind) for i, kind in enumerate(types) if kind not in _ATTENTION_LAYER_TYPES
                        and not (i < len(layers) and any(n.startswith(f"{layers[i]}.") for n in mixers))})  # fmt: skip
        found += [f"its layers of type {kind!r}" for kind in kinds]
    return found


def _decoder_layers(model: nn.Module) -> list[str]:
    """The names of the base model's decoder layers (its ``layers`` ModuleList), or none."""
    prefix, base = base_model(model)
    layers = getattr(base, "layers", None)
    return [f"{prefix}layers.{i}" for i in range(len(layers))] if isinstance(layers, nn.ModuleList) else []


@dataclass
class HFContextLayout:
    """Where context parallelism reaches into a Hugging Face decoder (see the module docstring).

    ``attention``: the modules that call the attention implementation (class names ending in
    ``Attention``); ``rotary``: the base model's rotary-embedding module, fed the global positions (None: a hybrid
    whose attention reads no positions, its only embedding the tokens');
    ``base``: the base model, whose caller may not pass position ids; ``head``: whether ``model`` is a
    head model above the base (its loss would shift ``labels`` itself); ``mixers``: the token mixers other than
    attention that trade the sequence split for a split of their heads (:mod:`~tessel.layers.hf_mixer_context`).
    """

    attention: list[str]
    rotary: str | None
    base: str
    head: bool
    mixers: list[str] = field(default_factory=list)
    plans: list[MixerContext] = field(default_factory=list)

    @classmethod
    def find(cls, model: nn.Module) -> HFContextLayout:
        prefix, base = base_model(model)
        attention = [name for name, m in model.named_modules() if type(m).__name__.endswith("Attention")]
        rotary = [name for name, m in base.named_children() if "rotary" in type(m).__name__.lower()]
        mixers = context_mixers(model)
        others = _other_sequence_mixers(model, mixers)
        if others:
            raise ValueError(
                f"parallelize: cp_group splits the sequence for attention and for the Mamba, Gated DeltaNet, lightning "
                f"attention and short convolution mixers, but {type(model).__name__} also mixes tokens in {others[0]}, "
                "which would see this rank's share of the tokens alone; train it without context parallelism"
            )
        own = own_attention(model, attention, mixers)
        if own:
            raise ValueError(
                f"parallelize: cp_group runs attention through Hugging Face's attention functions (as tessel's ring), "
                f"but {own[0]} ({type(model.get_submodule(own[0])).__name__}) computes its own; train "
                f"{type(model).__name__} without context parallelism"
            )
        if not attention and not mixers:
            raise ValueError(f"parallelize: cp_group needs attention modules (class names ending in Attention) in "
                             f"{type(model).__name__}, found none")  # fmt: skip
        embeddings = [m for m in base.modules() if isinstance(m, nn.Embedding)]
        if not rotary and mixers and len(embeddings) == 1:  # a hybrid's attention without positions (NoPE: Granite
            return cls(attention, None, prefix.rstrip("."), bool(prefix), mixers)  # 4.0 hybrid, Nemotron-H)
        if len(rotary) != 1:
            raise ValueError(
                f"parallelize: cp_group needs one rotary-embedding module among the children of {type(base).__name__} "
                f"(it is fed the global positions of this rank's tokens), found {rotary or 'none'}"
            )
        return cls(attention, prefix + rotary[0], prefix.rstrip("."), bool(prefix), mixers)

    def plan_mixers(self, model: nn.Module, split: set[str], t: int, cp_group) -> None:
        """Plan each mixer (raising before anything changes when its heads do not split); ``split``: the names of the
        modules that ``parallelize`` splits over its ``t`` tensor-parallel ranks."""
        c, modules = group_size(cp_group), dict(model.named_modules())
        self.plans = []
        for n in self.mixers if c > 1 else ():
            split_over = t if f"{n}.{entry_names(modules[n])[0]}" in split else 1  # whole where tp leaves it so
            self.plans.append(mixer_context(n, modules[n], split_over, c))

    def install(self, model: nn.Module, cp_group, split: int = 1) -> None:
        """Mark the attention modules with ``cp_group``, switch the model to tessel's attention, and hook the
        rotary module (global positions), the base model (whole-sequence position ids: packed documents)
        and the head (no self-shifted labels). ``split``: the tensor-parallel ranks the sequence is also split
        over (sequence parallelism), whose shares a later pipeline stage's base model receives as its input."""
        c, r = group_size(cp_group), group_rank(cp_group)
        modules = dict(model.named_modules())
        # the positions of this rank's tokens that the caller gave the base model, for its rotary module
        # (None: the zigzag share of 0 … S-1); set by every call of the base model, before its rotary runs
        held = {"positions": None, "rotary": None}  # and what the rotary module was given
        for name in self.attention:
            setattr(modules[name], CP_GROUP_ATTR, cp_group)
            if getattr(modules[name], "compressor", None) is not None:
                _share_compressed_keys(modules[name], cp_group, held)

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
                glob = given.expand(ids.shape[-2], -1) if given.shape[0] == 1 else given  # [B, S/c]
                if ids.dim() > 2:  # Qwen3.5's multimodal rotary takes [3, B, S/c]: for text, equal rows
                    glob = glob.expand(*ids.shape[:-2], *glob.shape)
            bound.arguments["position_ids"] = glob.to(ids.dtype)
            held["rotary"] = bound.arguments["position_ids"]
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
                if self.mixers and runs is not None and bool((runs == 0).any()):
                    raise ValueError(
                        f"parallelize: under context parallelism {self.mixers[0]} runs its recurrence over the whole "
                        "sequence without a mask, which would carry left padding's state into the tokens: pad on the "
                        "right (nothing after a token reaches it)"
                    )
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
            held["positions"] = held["rotary"] = None

        def no_self_shift(module, args, kwargs):
            if _bind(module, args, kwargs).arguments.get("labels") is not None and kwargs.get("shift_labels") is None:
                raise ValueError(
                    "parallelize: under context parallelism the model cannot shift labels itself (a chunk's last token "
                    "predicts a token another rank holds): pass shift_labels=split_sequence(labels shifted left by one "
                    "over the whole sequence, -100 at the end) along with labels"
                )

        if self.rotary is not None:
            modules[self.rotary].register_forward_pre_hook(positions, with_kwargs=True)
        modules[self.base].register_forward_pre_hook(whole_positions, with_kwargs=True)
        modules[self.base].register_forward_hook(forget_positions)
        if self.head:
            model.register_forward_pre_hook(no_self_shift, with_kwargs=True)
        for plan in self.plans:
            install_mixer_context(model.get_submodule(plan.name), plan, cp_group)
        if not self.attention:  # a state-space model: nothing calls an attention implementation
            return
        register_hf_attention()
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation("tessel")
        else:  # transformers < 4.56
            model.config._attn_implementation = "tessel"


def _share_compressed_keys(attention: nn.Module, cp_group, held: dict) -> None:
    """DeepSeek-V4's compressed attention under context parallelism: its compressor (and its indexer's) compresses the
    whole sequence, gathered in order from every rank's share of its projections (:func:`sequence_from_shares`, whose
    backward sums each rank's gradient of a share into its owner's), so every rank holds every compressed key; it
    reads the tokens' global positions (which compressed windows each query has closed), those the rotary module
    received; and the attention, marked :data:`SHARED_KEYS_ATTR`, attends to the compressed keys beside the sequence's
    (:func:`~tessel.parallel.context_shared.shared_keys_attention`)."""
    compressor = attention.compressor
    setattr(attention, SHARED_KEYS_ATTR, True)
    owners = [compressor] + ([compressor.indexer] if getattr(compressor, "indexer", None) is not None else [])
    for owner in owners:
        for name in ("kv_proj", "gate_proj"):
            getattr(owner, name).register_forward_hook(lambda m, args, out: sequence_from_shares(out, cp_group, dim=1))

    def global_positions(module, args, kwargs):
        if held["rotary"] is None:
            raise ValueError(f"parallelize: {type(module).__name__} ran before the rotary module under context "
                             "parallelism: no global positions to compress by")  # fmt: skip
        return _replace_argument(module, args, kwargs, "position_ids", held["rotary"])

    compressor.register_forward_pre_hook(global_positions, with_kwargs=True)


def check_own_attention(model: nn.Module) -> None:
    """Raise where ``model`` runs tessel's attention implementation and holds attention that computes itself: its
    causal mask would be tessel's, None (which the kernel's causal flag stands for), and it would see every key."""
    if getattr(model.config, "_attn_implementation", None) != "tessel":
        return
    own = own_attention(model)
    if own:
        raise ValueError(f"parallelize: {type(model).__name__} runs tessel's attention implementation, but {own[0]} "
                         f"computes its own attention, which would see no causal mask: set "
                         "attn_implementation='eager'")  # fmt: skip


def own_attention(model: nn.Module, attention: list[str] | None = None, mixers: list[str] | None = None) -> list[str]:
    """The names of the attention modules in ``model``'s decoder layers (among ``attention``: default, those whose class
    name ends in Attention) that compute their attention themselves (BLOOM's, MPT's, Falcon's): Hugging Face's
    attention functions, tessel's among them, never run there. A vision or audio tower's, which build their own masks,
    are not the decoder's."""
    try:
        layers = decoder_layer_list(model)
    except ValueError:
        return []
    inside = {id(m) for m in layers.modules()}
    if attention is None:
        attention = [name for name, m in model.named_modules() if type(m).__name__.endswith("Attention")]
    mixers = context_mixers(model) if mixers is None else mixers
    modules = {n: model.get_submodule(n) for n in attention}
    return [n for n, m in modules.items() if id(m) in inside and _computes_its_own(m, mixers, n)]


def _computes_its_own(m: nn.Module, mixers: list[str], name: str) -> bool:
    """Whether attention module ``m`` (not a mixer, holding no other attention) computes its attention itself rather
    than through ``ALL_ATTENTION_FUNCTIONS`` (Falcon's): judged by its forward's source, where it can be read."""
    inner = any(type(c).__name__.endswith("Attention") for c in m.modules() if c is not m)
    if inner or any(name == n or name.startswith(n + ".") for n in mixers):
        return False
    try:
        source = inspect.getsource(type(m).forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" not in source and "attention_interface" not in source
