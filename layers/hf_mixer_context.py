"""Context parallelism in a Hugging Face hybrid's token mixers other than attention: Mamba-2 blocks (Bamba, Falcon-H1,
Granite 4.0 hybrid, Nemotron-H, Zamba 2, Mamba-2), Mamba-1 blocks (Jamba, Mamba, Falcon-Mamba), Gated DeltaNet linear
attention (Qwen3.5, Qwen3-Next, OLMo-hybrid) and Kimi Linear's Kimi Delta Attention, MiniMax's lightning attention and
LFM2's short convolutions.

Under context parallelism each rank holds its zigzag share of the tokens (two chunks of ``S/2c``). Attention runs as
the ring; a recurrence or a causal convolution cannot run on such a share. As Megatron-LM does for Mamba, each such
mixer trades the sequence split for a split of its heads for the length of the recurrence:

    input projections   this rank's tokens, every head (tensor-parallel shards as usual), then
                        :func:`~tessel.parallel.context_heads.sequence_to_heads`: the whole sequence of 1/c of
                        the heads (of each part the projection packs: z, x, B, C, dt; q, k, v...); a mixer's
                        several projections of its input (a Gated DeltaNet's q/k/v, z, b and a) are computed
                        together when the first is called and travel in one exchange
    convolution, scan   over the whole sequence, on this rank's heads: the mixer's head counts divided by c, its
                        per-head parameters (A_log, dt_bias, D, the convolution's channels, Falcon-H1's
                        ``mup_vector``) read as this rank's slice of the replicated whole
    (Kimi's gates)      their first projections, to one head's width, on this rank's tokens, their second ones'
                        outputs sent to the heads as the input projections' are
    way back            :func:`~tessel.parallel.context_heads.heads_to_sequence` of the scan's output a Mamba-2
                        block hands its gated norm (the norm, whose groups may span heads, then runs on this rank's
                        tokens with every head, and with the gate z, which never left them), or of lightning
                        attention's output its norm over every head (its output gate reads this rank's tokens), or
                        of what the others hand ``out_proj``
    output projection   this rank's tokens, as usual

A Mamba-1 block splits by channels; its ``x_proj``, which reads every channel, multiplies this rank's and sums over
the cp ranks (its time step and B and C, ``R + 2N`` features a token; the gradient summed back). Mamba-2's B and C
follow their groups: where the groups split over the ranks each holds whole groups; where they do
not (one group, as Bamba, Granite 4.0 and Falcon-H1 ship) every rank receives the group its heads read, as a Gated
DeltaNet's ranks receive the key head their value heads read where there are fewer key heads than ranks. Parameters
stay replicated over the context-parallel ranks, each rank's gradient holding its heads' share: reduce gradients over
the cp group as over a data-parallel one (as for the rest of the model). The mixer receives a placeholder of the whole
sequence's shape (which it reads for its reshapes); its projections are handed this rank's tokens instead, so a mixer
that transforms its input before projecting it is refused by name. The fused ``mamba_ssm`` training kernel, which
would read ``out_proj``'s weight itself, is bypassed as under tensor parallelism. A cache is not handed to the mixers
(under context parallelism decoding is refused); left padding is refused (the recurrence would carry the padding's
state into the tokens; Hugging Face zeroes it with the mask), right padding needs nothing. Packed documents (the whole
sequence's ``position_ids``) reach attention's ring; the recurrences run over the whole row, as Hugging Face's own do
without a collator's document lengths, which are refused here (``cu_seq_lens_q``...: the local view's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..parallel.collectives import sum_over_ranks
from ..parallel.comm import group_rank, group_size
from ..parallel.context_heads import heads_to_sequence, sequence_to_heads, split_features
from .hf_linear_attention import (
    KIMI_LATENT_FED,
    KIMI_LATENTS,
    delta_layout,
    delta_net_updates,
    is_delta_net,
    is_kimi_delta,
    kimi_delta_inputs,
    kimi_delta_updates,
    kimi_gates,
)
from .hf_mixers import (
    DECAY_BUFFERS,
    is_lightning,
    is_mamba1,
    is_mamba2,
    is_short_conv,
    mamba_updates,
    move_input_scale,
    run_unfused,
)

__all__ = ["MixerContext", "context_mixers", "entry_names", "install_mixer_context", "mixer_context"]

# each Gated DeltaNet layout's input projections (by its first one's name) and output projection
_DELTA_ENTRIES = {"in_proj_qkv": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
                  "in_proj_qkvz": ("in_proj_qkvz", "in_proj_ba"),
                  "q_proj": ("q_proj", "k_proj", "v_proj", "g_proj", "a_proj", "b_proj")}  # fmt: skip
_VARLEN = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "seq_idx")  # flash-attention collators' document lengths
_DELTA_EXIT = {"in_proj_qkv": "out_proj", "in_proj_qkvz": "out_proj", "q_proj": "o_proj"}


@dataclass
class MixerContext:
    """How one mixer runs under context parallelism over ``c`` ranks (the module's notes): ``entries``, its input
    projections and the features ``[c, F']`` of each one's output that each rank owns; ``exit``, the child whose tensor
    arguments go back to the sequence split; ``params``, ``(child, attribute, dim, [c, n])``: the per-head tensors
    read as each rank's slice (``""``: the mixer's own); ``counts``, the head counts and widths its forward reads;
    ``mamba``: a Mamba block, kept off Hugging Face's fused training kernel; ``local``, projections of the mixer's
    input that stay on this rank's tokens (lightning attention's output gate, applied after the way back); ``sums``,
    children that read every head's features, whose outputs are summed over the cp ranks (Mamba-1's ``x_proj``);
    ``gate``, the width of the gate the input projection's output begins with (a Mamba-2 block's z, which only its
    norm reads), kept on this rank's tokens for the norm instead of travelling to the heads and back (0: none);
    ``fed``, the entries that project the output of a ``local`` one rather than the mixer's input (Kimi Delta
    Attention's gates' second projections)."""

    name: str
    entries: dict[str, torch.Tensor]
    exit: str
    params: list[tuple[str, str, int, torch.Tensor]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    mamba: bool = False
    local: tuple[str, ...] = ()
    sums: tuple[str, ...] = ()
    gate: int = 0
    fed: tuple[str, ...] = ()


def _is_context_mixer(m: nn.Module) -> bool:
    return is_mamba2(m) or is_delta_net(m) or is_short_conv(m) or is_mamba1(m) or is_lightning(m) or is_kimi_delta(m)


def context_mixers(model: nn.Module) -> list[str]:
    """The names of the mixers of ``model`` that run under context parallelism (the module's notes)."""
    return [n for n, m in model.named_modules() if _is_context_mixer(m)]


def entry_names(m: nn.Module) -> tuple[str, ...]:
    """The input projections of a mixer of :func:`context_mixers`."""
    if is_lightning(m):
        return ("qkv_proj", "output_gate")
    if is_delta_net(m):
        return _DELTA_ENTRIES[delta_layout(m)]
    if is_kimi_delta(m):
        return kimi_delta_inputs(m)
    return ("in_proj",)


def _packed(*parts: tuple[torch.Tensor, int]) -> torch.Tensor:
    """The features of parts packed one after the other: each ``(index [c, n] of its own features, its width)``."""
    columns, offset = [], 0
    for index, width in parts:
        columns.append(index + offset)
        offset += width
    return torch.cat(columns, 1)


def _by_key_head(hk: int, widths: tuple[int, ...], shared: tuple[bool, ...], c: int) -> torch.Tensor:
    """``[c, F']`` over features packed key head by key head (Qwen3-Next's ``in_proj_qkvz``: ``[q k v z]`` of key head
    0, then of key head 1…; ``in_proj_ba``), each head's parts of ``widths``: rank ``k`` owns whole key heads where they
    split over the ranks, else key head ``k·Hk/c`` with its ``shared`` parts (q, k) whole and its share of the
    others (the value heads')."""
    block = sum(widths)
    if hk % c == 0:
        return split_features(hk * block, c)
    ranks_per_head, rows = c // hk, []
    for k in range(c):
        head, j, offset, row = k * hk // c, k % (c // hk), 0, []
        for width, whole in zip(widths, shared, strict=True):
            n = width if whole else width // ranks_per_head
            start = head * block + offset + (0 if whole else j * n)
            row.append(torch.arange(start, start + n))
            offset += width
        rows.append(torch.cat(row))
    return torch.stack(rows)


def _refuse(name: str, what: str, t: int, c: int) -> None:
    on = f" on each of {t} tensor-parallel ranks" if t > 1 else ""
    raise ValueError(f"parallelize: {name}: its {what}{on} do not split over the {c} context-parallel ranks (each "
                     "runs the recurrence of a share of them over the whole sequence), nor do the ranks split over "
                     "them")  # fmt: skip


def _mamba_context(name: str, m: nn.Module, t: int, c: int) -> MixerContext:
    local = mamba_updates(m, t) if t > 1 else {}
    heads, width = local.get("num_heads", m.num_heads), local.get("intermediate_size", m.intermediate_size)
    groups, states = local.get("n_groups", m.n_groups), m.ssm_state_size
    if heads % c:
        _refuse(name, f"{heads} heads", t, c)
    if groups % c and c % groups:
        _refuse(name, f"{groups} groups of B and C", t, c)
    x, bc, dt = (
        (split_features(width, c), width),
        (split_features(groups * states, c, states), groups * states),
        (split_features(heads, c), heads),
    )
    conv = _packed(x, bc, bc)
    params = [("conv1d", p, 0, conv) for p in ("weight", "bias") if getattr(m.conv1d, p) is not None]
    params += [("", p, 0, dt[0]) for p in ("A_log", "dt_bias", "D")]
    projected = _packed(x, x, bc, bc, dt)
    if isinstance(getattr(m, "mup_vector", None), torch.Tensor):  # Falcon-H1's, over in_proj's features
        params.append(("", "mup_vector", -1, projected))
    g = groups // c if groups % c == 0 else 1
    counts = {"num_heads": heads // c, "intermediate_size": width // c, "n_groups": g,
              "conv_dim": width // c + 2 * g * states}  # fmt: skip
    if hasattr(m, "groups_time_state_size"):
        counts["groups_time_state_size"] = g * states
    norm = getattr(m, "norm", None)
    exit = "norm" if norm is not None and any(True for _ in norm.parameters()) else "out_proj"
    if exit == "out_proj" or any(p[1] == "mup_vector" for p in params):  # the gate multiplies the heads' outputs, or
        return MixerContext(name, {"in_proj": projected}, exit, params, counts, mamba=True)  # is scaled with them
    # z stays on this rank's tokens for the norm, which then runs there: half the traffic of z there and back
    return MixerContext(name, {"in_proj": _packed(x, bc, bc, dt) + width}, exit, params, counts, mamba=True,
                        gate=width)  # fmt: skip


def _delta_context(name: str, m: nn.Module, t: int, c: int) -> MixerContext:
    first = delta_layout(m)
    local = delta_net_updates(m, t) if t > 1 else {}
    hk, hv = local.get("num_k_heads", m.num_k_heads), local.get("num_v_heads", m.num_v_heads)
    if hk % c and (c % hk or hv % c):
        _refuse(name, f"{hk} key heads", t, c)
    dk, dv = m.head_k_dim, m.head_v_dim
    q, v, heads = (
        (split_features(hk * dk, c, dk), hk * dk),
        (split_features(hv * dv, c), hv * dv),
        split_features(hv, c),
    )
    if first == "in_proj_qkv":
        entries = {"in_proj_qkv": _packed(q, q, v), "in_proj_z": v[0], "in_proj_b": heads, "in_proj_a": heads}
    elif first == "in_proj_qkvz":
        r = hv // hk
        entries = {"in_proj_qkvz": _by_key_head(hk, (dk, dk, r * dv, r * dv), (True, True, False, False), c),
                   "in_proj_ba": _by_key_head(hk, (r, r), (False, False), c)}  # fmt: skip
    else:
        entries = dict(zip(_DELTA_ENTRIES[first], (q[0], q[0], v[0], v[0], heads, heads), strict=True))
    conv = _packed(q, q, v)
    params = [("conv1d", p, 0, conv) for p in ("weight", "bias") if getattr(m.conv1d, p) is not None]
    params += [("", p, 0, heads) for p in ("A_log", "dt_bias")]
    key, value = max(hk // c, 1) * dk, hv // c * dv
    counts = {"num_k_heads": max(hk // c, 1), "num_v_heads": hv // c, "key_dim": key, "value_dim": value}
    if hasattr(m, "conv_dim"):
        counts["conv_dim"] = 2 * key + value
    return MixerContext(name, entries, _DELTA_EXIT[first], params, counts)


def _kimi_context(name: str, m: nn.Module, t: int, c: int) -> MixerContext:
    """Kimi Delta Attention: q, k, v, β and both gates (their first projections on this rank's tokens, their second
    ones' outputs to the heads) over the whole sequence of this rank's heads, the output gated there too; its
    per-channel decay bias and per-head decay rate read as this rank's heads'."""
    heads = (kimi_delta_updates(m, t) if t > 1 else {}).get("num_heads", m.num_heads)
    if heads % c:
        _refuse(name, f"{heads} heads", t, c)
    width = heads * m.head_dim
    own, per_head = split_features(width, c), split_features(heads, c)
    entries = {child: per_head if child == "b_proj" else own for child in kimi_delta_inputs(m)}
    conv = _packed((own, width), (own, width), (own, width))
    params = [("conv1d", p, 0, conv) for p in ("weight", "bias") if getattr(m.conv1d, p) is not None]
    decay_dim = 2 if m.forget_gate.A_log.dim() == 4 else 0  # Kimi's [1, 1, H, 1], Bailing's [H]
    params += [("forget_gate", "dt_bias", 0, own), ("forget_gate", "A_log", decay_dim, per_head)]
    counts = {"num_heads": heads // c, "qkv_dim": width // c, "conv_dim": 3 * width // c,
              "forget_gate.num_heads": heads // c, "forget_gate.qkv_dim": width // c}  # fmt: skip
    if kimi_gates(m) == "full":  # both gates from the mixer's input, sent with q, k, v
        return MixerContext(name, entries, "o_proj", params, counts)
    return MixerContext(name, entries, "o_proj", params, counts, local=KIMI_LATENTS, fed=KIMI_LATENT_FED)


def _mamba1_context(name: str, m: nn.Module, t: int, c: int) -> MixerContext:
    width = m.intermediate_size // t
    if width % c:
        _refuse(name, f"{width} channels", t, c)
    if m.x_proj.bias is not None:
        raise ValueError(f"parallelize: {name}: its x_proj has a bias, which the sum of the context-parallel ranks' "
                         "channels would count once on each rank")  # fmt: skip
    own = split_features(width, c)
    params = [("conv1d", p, 0, own) for p in ("weight", "bias") if getattr(m.conv1d, p) is not None]
    params += [("dt_proj", p, 0, own) for p in ("weight", "bias") if getattr(m.dt_proj, p) is not None]
    params += [("x_proj", "weight", 1, own), ("", "A_log", 0, own), ("", "D", 0, own)]
    entries = {"in_proj": _packed((own, width), (own, width))}
    return MixerContext(name, entries, "out_proj", params, {"intermediate_size": width // c}, mamba=True,
                        sums=("x_proj",))  # fmt: skip


def mixer_context(name: str, m: nn.Module, t: int, c: int) -> MixerContext:
    """The plan of the mixer ``m`` (whole, a mixer of :func:`context_mixers`) split over ``t`` tensor-parallel ranks
    (1: whole) and run over ``c`` context-parallel ones; raises ``ValueError`` when its heads do not split."""
    if is_mamba2(m):
        return _mamba_context(name, m, t, c)
    if is_delta_net(m):
        return _delta_context(name, m, t, c)
    if is_mamba1(m):
        return _mamba1_context(name, m, t, c)
    if is_kimi_delta(m):
        return _kimi_context(name, m, t, c)
    if is_lightning(m):
        heads = m.num_attention_heads // t
        if heads % c:
            _refuse(name, f"{heads} heads", t, c)
        own = split_features(heads, c)
        params = [("", b, 1 if b == "diagonal_decay" else 0, own) for b in DECAY_BUFFERS]
        return MixerContext(name, {"qkv_proj": split_features(3 * heads * m.head_dim, c)}, "norm", params,
                            {"num_attention_heads": heads // c}, local=("output_gate",))  # fmt: skip
    if is_short_conv(m):
        channels = m.conv.in_channels // t
        if channels % c:
            _refuse(name, f"{channels} channels", t, c)
        own = (split_features(channels, c), channels)
        params = [("conv", p, 0, own[0]) for p in ("weight", "bias") if getattr(m.conv, p) is not None]
        return MixerContext(name, {"in_proj": _packed(own, own, own)}, "out_proj", params)
    raise ValueError(f"parallelize: {name} ({type(m).__name__}) is not a mixer tessel runs under context parallelism")


def install_mixer_context(m: nn.Module, plan: MixerContext, cp_group) -> None:
    """Hook ``m`` (split over its tensor-parallel ranks already, if at all) to run as ``plan`` says."""
    c, k = group_size(cp_group), group_rank(cp_group)
    if plan.mamba:
        if type(m.in_proj) is nn.Linear:  # not split over tensor-parallel ranks, whose install bypasses it already
            run_unfused(m)
        move_input_scale(m)
    for key, value in plan.counts.items():  # the mixer's, or a child's (``child.attr``)
        child, _, attr = key.rpartition(".")
        setattr(m.get_submodule(child) if child else m, attr, value)
    own = [(child, attr, dim, index[k]) for child, attr, dim, index in plan.params]
    placed: dict[tuple[int, torch.device], torch.Tensor] = {}

    def on(index: torch.Tensor, device: torch.device) -> torch.Tensor:  # each index copied to a device once
        key = (id(index), device)
        if key not in placed:
            placed[key] = index.to(device)
        return placed[key]

    held: dict = {}
    saved: list[list] = []

    def enter(module, args, kwargs):
        varlen = [n for n in _VARLEN if kwargs.get(n) is not None]
        if varlen:  # the lengths of the local view's documents, which the whole sequence's scan would misread
            raise ValueError(f"parallelize: under context parallelism {plan.name} runs over the whole sequence: pass "
                             f"packed documents as the whole sequence's position_ids, not {varlen[0]}")  # fmt: skip
        x = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"parallelize: {plan.name} needs [batch, tokens, hidden] hidden states under context "
                             f"parallelism, received {getattr(x, 'shape', type(x).__name__)}")  # fmt: skip
        shape = (x.shape[0], c * x.shape[1], x.shape[2])
        held["x"], held["placeholder"] = x, x.new_full((1, 1, 1), float("nan")).expand(shape)
        slices = []
        for child, attr, dim, index in own:
            owner = module.get_submodule(child) if child else module
            table = owner._parameters if attr in owner._parameters else owner._buffers
            whole = table[attr]
            slices.append((table, attr, whole))
            table[attr] = whole.index_select(dim, on(index, whole.device))
        saved.append(slices)
        kwargs = {**kwargs, "cache": None} if "cache" in kwargs else kwargs
        if args:
            return (held["placeholder"], *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": held["placeholder"]}

    def leave(module, args, kwargs, out):  # also after a refusal in enter, which swapped nothing
        for table, attr, whole in saved.pop() if saved else ():
            table[attr] = whole
        held.clear()

    def projection_input(module, args):
        if not args or args[0] is not held.get("placeholder"):
            raise ValueError(f"parallelize: under context parallelism the input projections of {plan.name} read the "
                             "tokens the mixer received; one was called with another tensor (the mixer transformed "
                             "its input before projecting it)")  # fmt: skip
        return (held["x"], *args[1:])

    def to_heads(child):
        return lambda module, args, out: sequence_to_heads(out, cp_group, on(plan.entries[child], out.device))

    def gated_to_heads(module, args, out):  # the gate stays here; the mixer splits its own off a hole of zeros
        held["gate"] = out[..., : plan.gate]
        heads = sequence_to_heads(out, cp_group, on(plan.entries[first], out.device))
        return torch.cat([heads.new_zeros(*heads.shape[:-1], plan.gate // c), heads], -1)

    def to_sequence(module, args, kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        back = {}
        if plan.gate:  # the norm's (output, gate): the gate is the one this rank kept
            if len(tensors) != 2 or tensors[1].shape[-1] != plan.gate // c:
                raise ValueError(f"parallelize: under context parallelism {plan.name}.{plan.exit} must be called with "
                                 f"the scan's output and the gate of {plan.gate // c} features a head share, received "
                                 f"{[tuple(a.shape) for a in tensors]}")  # fmt: skip
            back[id(tensors[1])] = held["gate"]
            tensors = tensors[:1]
        for dtype in dict.fromkeys(a.dtype for a in tensors):  # one exchange for the tensors of each dtype
            alike = [a for a in tensors if a.dtype == dtype]
            widths = [a.shape[-1] for a in alike]
            joined = heads_to_sequence(torch.cat(alike, -1), cp_group).unflatten(-1, (c, sum(widths)))
            back.update(zip(map(id, alike), [p.flatten(-2) for p in joined.split(widths, -1)], strict=True))
        args = tuple(back[id(a)] if isinstance(a, torch.Tensor) else a for a in args)
        return args, {n: back[id(a)] if isinstance(a, torch.Tensor) else a for n, a in kwargs.items()}

    # the input projections of the mixer's input, when there are several: computed together when the first is called,
    # their outputs sent to the heads in one exchange (one all-to-all forward and one backward, not one each)
    joined = [e for e in plan.entries if e not in plan.fed] if not plan.gate else []
    joined = joined if len(joined) > 1 else []

    def exchange_joined():
        outs = [type(p).forward(p, held["x"]) for p in map(m.get_submodule, joined)]
        widths = [o.shape[-1] for o in outs]
        key = ("joined", outs[0].device)
        if key not in placed:  # each entry's features, offset by the widths before it
            placed[key] = _packed(*((on(plan.entries[e], outs[0].device), w) for e, w in zip(joined, widths)))
        heads = sequence_to_heads(torch.cat(outs, -1), cp_group, placed[key])
        parts = heads.split([plan.entries[e].shape[1] for e in joined], -1)
        held["joined"] = dict(zip(joined, parts, strict=True))

    def joined_forward(child):
        def forward(x, *args, **kwargs):
            projection_input(None, (x,))  # the mixer's input, or refused
            if child not in held.get("joined", {}):
                exchange_joined()
            return held["joined"].pop(child)

        return forward

    m.register_forward_pre_hook(enter, with_kwargs=True)
    m.register_forward_hook(leave, with_kwargs=True, always_call=True, prepend=True)
    for child in joined:
        m.get_submodule(child).forward = joined_forward(child)
    for child in (*(e for e in plan.entries if e not in (*plan.fed, *joined)), *plan.local):
        m.get_submodule(child).register_forward_pre_hook(projection_input)
    first = next(iter(plan.entries))
    for child in (e for e in plan.entries if e not in joined):
        m.get_submodule(child).register_forward_hook(
            gated_to_heads if plan.gate and child == first else to_heads(child)
        )
    for child in plan.sums:  # every rank's channels' share of the output, summed (and so the gradients back)
        m.get_submodule(child).register_forward_hook(lambda module, args, out: sum_over_ranks(out, cp_group))
    m.get_submodule(plan.exit).register_forward_pre_hook(to_sequence, with_kwargs=True)
