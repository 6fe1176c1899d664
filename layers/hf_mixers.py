"""Token mixers other than softmax attention split over tensor-parallel ranks: Mamba-2 mixers (Bamba, Falcon-H1,
Granite 4.0 hybrid, Nemotron-H, Mamba-2, Zamba 2's ``mamba``) by heads, Mamba-1 mixers (Jamba, Mamba, Falcon-Mamba) by
channels, MiniMax's lightning attention by heads, LFM2's short convolutions by channels, and Doge's dynamic-mask
projection (:class:`SharedRowLinear`, ``rowwise_heads``).

Hugging Face's plans leave these blocks out, so every rank would run every head of the scan, and sequence
parallelism would have no column projection to gather the sequence. tessel splits them as Megatron-LM and vLLM split
Mamba-2. The mixer of ``H`` heads of ``P`` features (``I = H·P``), ``G`` groups of B and C of ``N`` states each,
projects its input once, ``in_proj → [z (I) | x (I) | B (G·N) | C (G·N) | dt (H)]``, convolves ``[x | B | C]``
channel by channel, scans each head with its group's B and C, normalises ``y·silu(z)`` per group, and projects back:

    in_proj     colwise_qkv over its five parts: this rank's I/t of z and of x, G·N/t of B and of C, H/t of dt
    conv1d      colwise_conv over [x | B | C]: this rank's channels of each
    A_log, dt_bias, D [H]: this rank's heads' values
    norm        colwise_gated_norm (:class:`SplitGatedRMSNorm`): its weight ``r·I/t …``
    out_proj    rowwise

Head ``h`` reads group ``h // (H/G)``, so a contiguous share of the heads keeps its groups. When the groups split
over the ranks (``G % t == 0``) each rank holds whole groups and nothing more travels than the two projections'.
When they do not (``t % G == 0``: Bamba, Granite 4.0 and Falcon-H1 have ``G = 1``) the ``t/G`` ranks of a group each
hold a share of its B and C: the block all-gathers them after ``in_proj`` (``2·G·N`` features a token, against the
``H`` its output projection reduces) and keeps its own group, the convolution's B and C channels are gathered from
their shards the same way, and the gated norm of a group that spans ranks sums its squares over them (one fp32 a
token). Every parameter stays a shard of the whole (its gradient that of the dense model's rows), whatever ``G``.

The mixer's head counts and widths (``num_heads``, ``intermediate_size``, ``n_groups``, ``conv_dim``), which its
forward reads, take their local values; Falcon-H1's per-feature multipliers (``mup_vector``) keep this rank's
features. In training Hugging Face fuses the whole block into one ``mamba_ssm`` kernel when that package is installed,
reading ``out_proj``'s weight itself, which would skip the row layer's reduction: a split mixer (Mamba-2 or Mamba-1)
runs its unfused path (the same ``mamba_ssm`` scan kernels where installed). Falcon-H1's scale of the mixer's input
(``ssm_in_multiplier``) is applied to the input the mixer receives, where a sequence-parallel block gathers it from.

A Mamba-1 mixer (Jamba's, Mamba's, Falcon-Mamba's) of ``I`` channels, ``N`` states and a time step of rank ``R``,
``in_proj → [x | z]``, convolves x, projects it to ``[dt (R) | B (N) | C (N)]`` (``x_proj``, over every channel),
normalises each, widens dt back to the channels (``dt_proj``) and scans channel by channel:

    in_proj     packed_colwise over [x | z]: this rank's I/t of each
    conv1d      colwise_conv: this rank's channels
    x_proj      rowwise_shared (:class:`SharedRowLinear`): its input columns, the sum replicated (R + 2N a token),
                which every rank's channels read
    dt_layernorm, b_layernorm, c_layernorm: whole, their gradients summed over the group
    dt_proj     colwise (its weight and bias, which the mixer reads itself: this rank's channels)
    A_log [I, N], D [I]: this rank's channels' rows
    out_proj    rowwise

Under sequence parallelism ``x_proj`` and ``dt_proj`` read the whole sequence inside the block
(:func:`inner_projections`).

MiniMax's lightning attention (linear attention whose heads decay at their own rates, ``slope_rate``) projects
``[q k v]`` head by head (``qkv_proj``), gates its output feature by feature and normalises it over every head:

    qkv_proj    colwise: a contiguous share of its rows is this rank's heads' q, k and v
    output_gate colwise
    norm        colwise_norm (:class:`~tessel.layers.norm.SplitRMSNorm`: its mean of squares summed over the group)
    out_proj    rowwise

and each rank keeps its heads' decay rates, its decay tables recomputed from them (``decay_factors``).

LFM2's short convolution ``in_proj → [B | C | x]``, ``y = C · conv(B · x)``, ``out_proj`` mixes no channels with
another: ``in_proj`` is ``colwise_qkv`` over its three parts, the depthwise ``conv`` ``colwise_conv``, ``out_proj``
``rowwise``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.collectives import copy_to_tp, gather_from_sequence, sum_over_ranks
from ..parallel.comm import group_rank, group_size
from ..parallel.sharding import local_shard
from .hf_grouped_output import grouped_output_updates
from .hf_linear_attention import delta_parts, is_delta_net, is_kimi_delta, kimi_delta_updates
from .linear import RowParallelLinear
from .meta import derived_buffer

__all__ = [
    "DECAY_BUFFERS",
    "SharedRowLinear",
    "SplitGatedRMSNorm",
    "check_mixers_whole",
    "install_mamba_hooks",
    "is_lightning",
    "is_mamba1",
    "is_mamba2",
    "is_short_conv",
    "lightning_styles",
    "mamba1_styles",
    "mamba_parts",
    "mamba_styles",
    "mamba_updates",
    "mixer_installer",
    "mixer_updates",
    "move_input_scale",
    "packed_parts",
    "run_unfused",
    "short_conv_styles",
]

_COUNTS = ("num_heads", "head_dim", "n_groups", "ssm_state_size", "intermediate_size", "conv_dim")
_PER_HEAD = ("A_log", "dt_bias", "D")


def _plain_linear(m) -> bool:
    return isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward


def _depthwise(m, channels: int) -> bool:
    return isinstance(m, nn.Conv1d) and m.groups == m.in_channels == m.out_channels == channels


def _norm_kind(norm: nn.Module, width: int, groups: int) -> str | None:
    """``"identity"``, ``"grouped"`` (Mamba-2's gated norm: ``group_size``, the gate applied before the norm, the
    weight after the cast back), ``"falcon"`` (Falcon-H1's: ``n_groups``, ``norm_before_gate``, the weight in fp32),
    or None for a norm tessel does not reproduce."""
    if type(norm) is nn.Identity:
        return "identity"
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.shape != (width,) or len(list(norm.parameters())) != 1:
        return None
    if not isinstance(getattr(norm, "variance_epsilon", None), float):
        return None
    if getattr(norm, "group_size", None) == width // groups and not hasattr(norm, "norm_before_gate"):
        return "grouped"
    if getattr(norm, "n_groups", None) == groups and isinstance(getattr(norm, "norm_before_gate", None), bool):
        return "falcon"
    return None


def is_mamba2(m: nn.Module, t: int = 1) -> bool:
    """Whether ``m`` is a Hugging Face Mamba-2 mixer (the attributes and children the module's notes name, plain
    projections, a gated norm tessel reproduces) whose heads split over ``t`` ranks with their groups (``G % t == 0``)
    or their groups' shares (``t % G == 0``, B and C of ``G·N`` features divisible by ``t``)."""
    counts = [getattr(m, n, None) for n in _COUNTS]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in counts):
        return False
    heads, head_dim, groups, states, width, conv_dim = counts
    if heads * head_dim != width or heads % groups or conv_dim != width + 2 * groups * states:
        return False
    in_proj, out_proj = getattr(m, "in_proj", None), getattr(m, "out_proj", None)
    if not (_plain_linear(in_proj) and _plain_linear(out_proj) and _depthwise(getattr(m, "conv1d", None), conv_dim)):
        return False
    if in_proj.out_features != width + conv_dim + heads or out_proj.in_features != width:
        return False
    if not all(isinstance(p := getattr(m, n, None), nn.Parameter) and p.shape == (heads,) for n in _PER_HEAD):
        return False
    if _norm_kind(getattr(m, "norm", None) or nn.Identity(), width, groups) is None:
        return False
    mup = getattr(m, "mup_vector", None)
    if mup is not None and (not isinstance(mup, torch.Tensor) or mup.shape[-1] != in_proj.out_features):
        return False
    if heads % t:
        return False
    return groups % t == 0 or (t % groups == 0 and groups * states % t == 0)


def mamba_parts(m: nn.Module, child: str) -> tuple[int, ...]:
    """The widths of the parts a Mamba-2 mixer's ``in_proj`` (z, x, B, C, dt) or ``conv1d`` (x, B, C) packs."""
    bc = m.n_groups * m.ssm_state_size
    if child == "in_proj":
        return m.intermediate_size, m.intermediate_size, bc, bc, m.num_heads
    return m.intermediate_size, bc, bc


def mamba_styles(m: nn.Module, t: int) -> dict[str, str] | None:
    """The styles that split ``m`` by heads over ``t`` ranks (as the module's notes lay out), when it is a Mamba-2
    mixer whose heads split; None otherwise."""
    if t < 2 or not is_mamba2(m, t):
        return None
    styles = {"in_proj": "colwise_qkv", "conv1d": "colwise_conv", "A_log": "colwise", "dt_bias": "colwise",
              "D": "colwise", "out_proj": "rowwise"}  # fmt: skip
    if any(True for _ in m.norm.parameters()):
        styles["norm"] = "colwise_gated_norm"
    return styles


def check_mixers_whole(model: nn.Module, named: dict[str, str], t: int) -> None:
    """Raise ``ValueError`` when a plan (``named``: module and parameter names → canonical styles) splits some of a
    Mamba-2 mixer over ``t`` ranks and not all of it: its forward reads every part together, so each child and
    per-head parameter of :func:`mamba_styles` must have its style."""
    for parent in sorted({n.rpartition(".")[0] for n in named}):
        m = model.get_submodule(parent)
        styles = mamba_styles(m, t) if t > 1 and is_mamba2(m) else None
        kinds = {n.rpartition(".")[2]: k for n, k in named.items() if n.rpartition(".")[0] == parent}
        missing = {c: s for c, s in (styles or {}).items() if kinds.get(c) != s}
        if missing:
            raise ValueError(f"parallelize: {parent} is a Mamba-2 mixer whose plan splits some of it; it must also "
                             f"split {missing} (tessel.layers.hf_mixers)")  # fmt: skip


_MAMBA1 = ("intermediate_size", "ssm_state_size", "time_step_rank")
_MAMBA1_NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")


def is_mamba1(m: nn.Module, t: int = 1) -> bool:
    """Whether ``m`` is a Hugging Face Mamba (Mamba-1) mixer such as Jamba's (the attributes and children the module's
    notes name, plain projections, norms of the time step and of B and C or none) whose channels split over ``t``."""
    counts = [getattr(m, n, None) for n in _MAMBA1]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in counts):
        return False
    width, states, rank = counts
    layers = [getattr(m, n, None) for n in ("in_proj", "x_proj", "dt_proj", "out_proj")]
    if not all(_plain_linear(p) for p in layers) or not _depthwise(getattr(m, "conv1d", None), width):
        return False
    in_proj, x_proj, dt_proj, out_proj = layers
    shapes = [(in_proj.out_features, 2 * width), (x_proj.in_features, width), (x_proj.out_features, rank + 2 * states),
              (dt_proj.in_features, rank), (dt_proj.out_features, width), (out_proj.in_features, width)]  # fmt: skip
    a_log, d = getattr(m, "A_log", None), getattr(m, "D", None)
    if any(a != b for a, b in shapes) or not (isinstance(a_log, nn.Parameter) and a_log.shape == (width, states)):
        return False
    learning = {n for n, c in m.named_children() if any(True for _ in c.parameters())}
    allowed = {"in_proj", "x_proj", "dt_proj", "out_proj", "conv1d", *_MAMBA1_NORMS}
    return isinstance(d, nn.Parameter) and d.shape == (width,) and learning <= allowed and width % t == 0


def mamba1_styles(m: nn.Module, t: int) -> dict[str, str] | None:
    """The styles that split ``m`` by channels over ``t`` ranks (as the module's notes lay out), when it is a Mamba-1
    mixer whose channels split; None otherwise."""
    if t < 2 or not is_mamba1(m, t):
        return None
    styles = {"in_proj": "packed_colwise", "conv1d": "colwise_conv", "x_proj": "rowwise_shared", "dt_proj": "colwise",
              "A_log": "colwise", "D": "colwise", "out_proj": "rowwise"}  # fmt: skip
    for name in _MAMBA1_NORMS:
        if any(True for _ in getattr(m, name, nn.Identity()).parameters()):
            styles[name] = "replicated_with_grad_allreduce"
    return styles


def inner_projections(parent: nn.Module) -> tuple[str, ...]:
    """The split projections of ``parent`` that read another of its tensors than its input, which a sequence-parallel
    block does not gather for them: a Mamba-1 mixer's ``x_proj`` and ``dt_proj``, Doge's attention's ``dt_proj``."""
    return ("x_proj", "dt_proj") if is_mamba1(parent) else ("dt_proj",) if is_dynamic_mask(parent) else ()


def is_dynamic_mask(m: nn.Module, t: int = 1) -> bool:
    """Whether ``m`` is Doge's dynamic-mask attention (its mask from the values of every kv head, ``dt_proj``
    ``[Hkv, Hkv·D]``, scaled per kv head by ``A``) whose kv heads split over ``t`` ranks."""
    a, dt, v = getattr(m, "A", None), getattr(m, "dt_proj", None), getattr(m, "v_proj", None)
    if not (isinstance(a, nn.Parameter) and a.dim() == 1 and _plain_linear(dt) and _plain_linear(v)):
        return False
    return dt.in_features == v.out_features and dt.out_features == a.shape[0] and a.shape[0] % t == 0


class SharedRowLinear(RowParallelLinear):
    """A row-parallel layer inside a block whose ranks each read its whole (summed) output with their own share of
    the block (a Mamba-1 mixer's ``x_proj``): forward, this rank's input columns and the sum over the group, as
    :class:`~tessel.layers.RowParallelLinear`; backward, the ranks' gradients of the output are summed too
    (``copy_to_tp``), each being a share. With ``per_head`` (style ``rowwise_heads``: Doge's ``dt_proj``, one output
    per kv head) each rank keeps its heads' share of the sum."""

    per_head = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = copy_to_tp(super().forward(x), self.tp_group)
        if not self.per_head:
            return y
        n = y.shape[-1] // self.tp_size
        return y.narrow(-1, group_rank(self.tp_group) * n, n)


DECAY_BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


def is_lightning(m: nn.Module, t: int = 1) -> bool:
    """Whether ``m`` is MiniMax's lightning attention (the children, buffers and method the module's notes name, plain
    projections, nothing else that learns) whose heads split over ``t`` ranks."""
    heads, head_dim = getattr(m, "num_attention_heads", None), getattr(m, "head_dim", None)
    if not (isinstance(heads, int) and isinstance(head_dim, int) and callable(getattr(m, "decay_factors", None))):
        return False
    layers = [getattr(m, n, None) for n in ("qkv_proj", "output_gate", "out_proj")]
    if not all(_plain_linear(p) for p in layers) or not all(
        isinstance(getattr(m, b, None), torch.Tensor) for b in DECAY_BUFFERS
    ):
        return False
    qkv, gate, out = layers
    width = heads * head_dim
    norm_weight = getattr(getattr(m, "norm", None), "weight", None)
    if (qkv.out_features, gate.out_features, out.in_features) != (3 * width, width, width) or m.slope_rate.shape[
        0
    ] != heads:
        return False
    learning = {n for n, c in m.named_children() if any(True for _ in c.parameters())}
    fits = isinstance(norm_weight, torch.Tensor) and norm_weight.shape == (width,)
    return fits and learning == {"qkv_proj", "output_gate", "out_proj", "norm"} and heads % t == 0


def lightning_styles(m: nn.Module, t: int) -> dict[str, str] | None:
    """The styles that split lightning attention by heads over ``t`` ranks (the module's notes), or None."""
    if t < 2 or not is_lightning(m, t):
        return None
    return {"qkv_proj": "colwise", "output_gate": "colwise", "norm": "colwise_norm", "out_proj": "rowwise"}


def mixer_installer(m: nn.Module, tp_group):
    """What a split mixer needs once its layers and attributes are local, as a function of no argument that installs
    it (computed before anything changes, from the whole module): a Mamba-2 mixer's hooks (:func:`install_mamba_hooks`),
    a Mamba-1 mixer's unfused path, lightning attention's decay rates and tables of this rank's heads; None for another
    module."""
    if is_mamba2(m):
        groups, mup = m.n_groups, getattr(m, "mup_vector", None)
        return lambda: install_mamba_hooks(m, groups, mup, tp_group)
    if is_mamba1(m):
        return lambda: run_unfused(m)
    if is_lightning(m):
        t, r, heads = group_size(tp_group), group_rank(tp_group), m.slope_rate.shape[0]
        rates = m.slope_rate.narrow(0, r * heads // t, heads // t).clone()

        def install():
            tables = dict(zip(DECAY_BUFFERS, (rates, *m.decay_factors(rates)), strict=True))
            for name, table in tables.items():  # tagged as a split parameter is: its heads' rows of the whole
                table.tensor_parallel, table.tp_dim, table.tp_parts = True, int(name == "diagonal_decay"), (heads,)
                m.register_buffer(name, table, persistent=name in m.state_dict())

        return install
    return None


def mixer_updates(m: nn.Module, t: int) -> dict[str, int] | None:
    """The attributes a split mixer's forward reads, with their values on each of ``t`` ranks (a Mamba-2 mixer's
    :func:`mamba_updates`; a Mamba-1 mixer's ``intermediate_size``; DeepSeek-V4's attention's heads and groups,
    :mod:`~tessel.layers.hf_grouped_output`), None for another module; raises ``ValueError`` for a mixer that does not
    split over ``t``."""
    if (grouped := grouped_output_updates(m, t)) is not None:
        return grouped
    if is_mamba2(m):
        return mamba_updates(m, t)
    if is_kimi_delta(m):
        return kimi_delta_updates(m, t)
    if is_mamba1(m):
        if not is_mamba1(m, t):
            raise ValueError(f"its {m.intermediate_size} channels do not split over {t} tensor-parallel ranks")
        return {"intermediate_size": m.intermediate_size // t}
    return None


def packed_parts(parent: nn.Module, child: str) -> tuple[int, ...] | None:
    """The widths of the parts that ``parent``'s ``child`` packs, each split on its own: a Gated DeltaNet's
    ``in_proj_qkv`` and ``conv1d`` (q, k, v), a Mamba-2 mixer's ``in_proj`` (z, x, B, C, dt) and ``conv1d`` (x, B, C), a
    short convolution's ``in_proj`` (B, C, x) and ``conv``; None for another module."""
    if is_delta_net(parent) and child in ("in_proj_qkv", "conv1d"):
        return delta_parts(parent)
    if is_kimi_delta(parent) and child == "conv1d":
        return (parent.num_heads * parent.head_dim,) * 3
    if is_mamba2(parent) and child in ("in_proj", "conv1d"):
        return mamba_parts(parent, child)
    if is_mamba1(parent) and child == "conv1d":
        return (parent.intermediate_size,)
    if is_short_conv(parent) and child in ("in_proj", "conv"):
        return (parent.conv.in_channels,) * (3 if child == "in_proj" else 1)
    return None


def _local_groups(m: nn.Module, t: int) -> int:
    return m.n_groups // t if m.n_groups % t == 0 else 1


def mamba_updates(m: nn.Module, t: int) -> dict[str, int]:
    """The mixer's head counts and widths on each of ``t`` ranks."""
    if not is_mamba2(m, t):
        raise ValueError(f"mamba_updates: expected a Mamba-2 mixer whose heads and groups split over {t} ranks, "
                         f"received {type(m).__name__}" + (f" of {m.num_heads} heads and {m.n_groups} groups"
                                                           if is_mamba2(m) else ""))  # fmt: skip
    groups, width = _local_groups(m, t), m.intermediate_size // t
    updates = {"num_heads": m.num_heads // t, "intermediate_size": width, "n_groups": groups,
               "conv_dim": width + 2 * groups * m.ssm_state_size}  # fmt: skip
    if hasattr(m, "groups_time_state_size"):  # Falcon-H1's
        updates["groups_time_state_size"] = groups * m.ssm_state_size
    return updates


def _own_group(shards: torch.Tensor, dim: int, states: int, groups: int, tp_group) -> torch.Tensor:
    """``[B_r | C_r]`` along ``dim`` (this rank's ``G·N/t`` of each) → ``[B_g | C_g]``, the ``N`` features of this
    rank's group ``g`` of each: all-gathered (backward: the ranks' gradients reduce-scattered onto the shards)."""
    t, r = group_size(tp_group), group_rank(tp_group)
    share = shards.shape[dim] // 2
    full = gather_from_sequence(shards, tp_group, dim=dim)  # [B_0 | C_0 | B_1 | C_1 ...]
    by_rank = full.unflatten(dim, (t, 2, share))
    g = r * groups // t
    parts = [by_rank.select(dim + 1, i).flatten(dim, dim + 1).narrow(dim, g * states, states) for i in (0, 1)]
    return torch.cat(parts, dim)


class _SharedGroups:
    """The hooks of a mixer whose groups span ranks: ``in_proj``'s output and the convolution's B and C channels
    become this rank's group's, gathered from the ranks' shards."""

    def __init__(self, mixer: nn.Module, groups: int, tp_group):
        self.groups, self.states, self.tp_group = groups, mixer.ssm_state_size, tp_group
        self.x_width = mixer.intermediate_size  # local, as updated
        self.saved: list[dict] = []

    def projected(self, module, args, out: torch.Tensor) -> torch.Tensor:
        a, share = 2 * self.x_width, self.groups * self.states // group_size(self.tp_group)
        bc = _own_group(out[..., a : a + 2 * share], out.dim() - 1, self.states, self.groups, self.tp_group)
        return torch.cat([out[..., :a], bc, out[..., a + 2 * share :]], -1)

    def enter(self, conv: nn.Conv1d) -> None:
        own = {}
        for name in ("weight", "bias"):
            p = conv._parameters.get(name)
            if p is None:
                continue
            own[name] = p
            bc = _own_group(p[self.x_width :], 0, self.states, self.groups, self.tp_group)
            conv._parameters[name] = torch.cat([p[: self.x_width], bc])
        self.saved.append(own)

    def leave(self, conv: nn.Conv1d) -> None:
        conv._parameters.update(self.saved.pop())


def run_unfused(mixer: nn.Module) -> None:
    """The mixer's forward runs as in evaluation (``training`` off on the mixer alone, its children untouched):
    Hugging Face fuses a Mamba block into one ``mamba_ssm`` kernel in training, reading ``out_proj``'s (and Mamba-1's
    ``x_proj``'s) weight itself, which would skip the split layers' reductions."""
    saved: list[bool] = []

    def enter(m, args):
        saved.append(m.training)
        m.training = False

    def leave(m, args, out):
        m.training = saved.pop()

    mixer.register_forward_pre_hook(enter)
    mixer.register_forward_hook(leave, always_call=True)


def move_input_scale(mixer: nn.Module) -> None:
    """Falcon-H1 scales its mixer's input inside the mixer (``ssm_in_multiplier``; ``x * 1.0`` too is another tensor):
    the scale moves to a forward pre-hook, so that the projections receive the very tensor the mixer did, which a
    sequence-parallel block's ring (or a context-parallel mixer) hands them. Nothing for another mixer."""
    scale = getattr(mixer, "ssm_in_multiplier", None)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        return
    mixer.ssm_in_multiplier = _UNIT
    if scale == 1:
        return

    def scaled(m, args, kwargs):
        if args:
            return (args[0] * scale, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"] * scale}

    mixer.register_forward_pre_hook(scaled, with_kwargs=True)


def install_mamba_hooks(mixer: nn.Module, full_groups: int, mup: torch.Tensor | None, tp_group) -> None:
    """After the split (the mixer's attributes local): the unfused path in training, the shared groups' hooks where
    ``full_groups`` do not split over the group, and this rank's share of ``mup`` (Falcon-H1's ``mup_vector``)."""
    t = group_size(tp_group)
    shared = _SharedGroups(mixer, full_groups, tp_group) if full_groups % t else None
    run_unfused(mixer)
    move_input_scale(mixer)

    def enter(m, args, kwargs):
        if shared is not None:
            shared.enter(m.conv1d)

    def leave(m, args, kwargs, out):
        if shared is not None:
            shared.leave(m.conv1d)

    mixer.register_forward_pre_hook(enter, with_kwargs=True)
    mixer.register_forward_hook(leave, with_kwargs=True, always_call=True)
    if shared is not None:
        mixer.in_proj.register_forward_hook(shared.projected)
    if mup is not None:
        width, heads = mixer.intermediate_size, mixer.num_heads  # local
        states, share = mixer.ssm_state_size, full_groups * mixer.ssm_state_size // t
        r, g = group_rank(tp_group), group_rank(tp_group) * full_groups // t

        def own(whole: torch.Tensor) -> torch.Tensor:
            sizes = [width * t, width * t, full_groups * states, full_groups * states, heads * t]
            z, x, b, c, dt = whole.split(sizes, -1)
            parts = [z.narrow(-1, r * width, width), x.narrow(-1, r * width, width)]
            if shared is None:
                parts += [b.narrow(-1, r * share, share), c.narrow(-1, r * share, share)]
            else:
                parts += [b.narrow(-1, g * states, states), c.narrow(-1, g * states, states)]
            return torch.cat([*parts, dt.narrow(-1, r * heads, heads)], -1)

        derived_buffer(mixer, "mup_vector", mup, own)


class _Unit:
    """The multiplier 1 that gives back the tensor itself (``x * _UNIT is x``): a sequence-parallel block's projections
    must receive the very tensor the block did."""

    def __rmul__(self, x):
        return x

    __mul__ = __rmul__

    def __repr__(self) -> str:
        return "1"


_UNIT = _Unit()


class SplitGatedRMSNorm(nn.Module):
    """A Mamba-2 mixer's gated RMS norm over ``groups`` groups of features that a column layer splits over
    ``tp_group``: this rank's weight ``r·I/t …``. Each group is normalised over its features; a group that spans
    ranks (``t % groups == 0``) sums its squares over them (one fp32 a token, its gradient summed back). ``kind`` is
    Hugging Face's form (:func:`_norm_kind`): ``"grouped"`` gates before the norm and scales after the cast back,
    ``"falcon"`` gates before or after (``norm_before_gate``) and scales in fp32."""

    def __init__(self, weight: torch.Tensor, groups: int, eps: float, kind: str, norm_before_gate: bool, tp_group):
        super().__init__()
        t = group_size(tp_group)
        width = weight.shape[0] * t
        if kind not in ("grouped", "falcon") or not (groups % t == 0 or t % groups == 0) or width % groups:
            raise ValueError(f"SplitGatedRMSNorm: expected kind 'grouped' or 'falcon' and groups that split over or "
                             f"divide the {t} ranks, received kind={kind!r}, groups={groups}")  # fmt: skip
        self.weight = nn.Parameter(weight)
        self.weight.tensor_parallel, self.weight.tp_dim, self.weight.tp_parts = True, 0, (width,)
        self.group_size, self.groups, self.variance_epsilon = width // groups, groups, eps
        self.kind, self.norm_before_gate, self.tp_group = kind, norm_before_gate, tp_group

    @classmethod
    def from_module(cls, norm: nn.Module, groups: int, tp_group) -> SplitGatedRMSNorm:
        """This rank's share of a Hugging Face gated norm over ``groups`` groups of its ``weight``'s features."""
        kind = _norm_kind(norm, getattr(getattr(norm, "weight", None), "shape", (0,))[0], groups)
        if kind not in ("grouped", "falcon"):
            raise TypeError(f"SplitGatedRMSNorm.from_module: expected a Mamba-2 gated RMS norm over {groups} groups "
                            f"(group_size, or Falcon-H1's n_groups and norm_before_gate), received {norm}")  # fmt: skip
        t, r = group_size(tp_group), group_rank(tp_group)
        width = norm.weight.shape[0]
        if width % t:
            raise ValueError(f"SplitGatedRMSNorm.from_module: {width} features do not split over {t} ranks")
        shard = local_shard(norm.weight.detach(), 0, (width,), r, t).clone().requires_grad_(norm.weight.requires_grad)
        return cls(shard, groups, norm.variance_epsilon, kind, bool(getattr(norm, "norm_before_gate", False)), tp_group)

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        dtype = hidden_states.dtype
        gate_first = gate is not None and not (self.kind == "falcon" and self.norm_before_gate)
        x = hidden_states.float()
        if gate_first:
            x = x * F.silu(gate.float())
        t = group_size(self.tp_group)
        if self.groups % t == 0:  # whole groups on this rank
            grouped = x.unflatten(-1, (-1, self.group_size))
            normed = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).flatten(-2)
        else:  # this rank's features are a share of one group: its squares summed over the group's ranks
            g = group_rank(self.tp_group) * self.groups // t
            one_hot = F.one_hot(torch.tensor(g, device=x.device), self.groups).to(x.dtype)
            squares = sum_over_ranks(x.pow(2).sum(-1, keepdim=True) * one_hot, self.tp_group)[..., g : g + 1]
            normed = x * torch.rsqrt(squares / self.group_size + self.variance_epsilon)
        if self.kind == "grouped":
            return self.weight * normed.to(dtype)
        out = self.weight * normed
        if gate is not None and not gate_first:
            out = out * F.silu(gate.float())
        return out.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]} of {self.group_size * self.groups} features, {self.groups} groups, {self.kind}"


def is_short_conv(m: nn.Module, t: int = 1) -> bool:
    """Whether ``m`` is LFM2's short convolution (``in_proj`` to ``[B | C | x]``, a depthwise ``conv`` over the
    ``D`` channels, ``out_proj`` from them, plain layers) whose channels split over ``t`` ranks."""
    in_proj, out_proj, conv = (getattr(m, n, None) for n in ("in_proj", "out_proj", "conv"))
    if not (_plain_linear(in_proj) and _plain_linear(out_proj) and isinstance(conv, nn.Conv1d)):
        return False
    channels = conv.in_channels
    if not _depthwise(conv, channels) or in_proj.out_features != 3 * channels or out_proj.in_features != channels:
        return False
    others = {n for n, c in m.named_children() if any(True for _ in c.parameters())} - {"in_proj", "out_proj", "conv"}
    return not others and not list(m.parameters(recurse=False)) and channels % t == 0


def short_conv_styles(m: nn.Module, t: int) -> dict[str, str] | None:
    """``in_proj`` ``colwise_qkv`` over ``[B | C | x]``, ``conv`` ``colwise_conv``, ``out_proj`` ``rowwise``, when ``m``
    is a short convolution whose channels split over ``t`` ranks; None otherwise."""
    if t < 2 or not is_short_conv(m, t):
        return None
    return {"in_proj": "colwise_qkv", "conv": "colwise_conv", "out_proj": "rowwise"}
