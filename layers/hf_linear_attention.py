"""Gated DeltaNet linear attention (Qwen3.5's, Qwen3-Next's and OLMo-hybrid's ``linear_attn``) split by heads over
tensor-parallel ranks.

Hugging Face's plans gather the block's projections whole (``colwise_gather_output``) or leave them out, so every
rank runs every head of the recurrence. The heads are independent, so tessel splits them instead, each of ``t``
ranks keeping ``Hk/t`` key heads and ``Hv/t`` value heads (value head ``j`` reads key head ``j // (Hv/Hk)``: a
contiguous share of each keeps the pairs together). Qwen3.5 projects q, k, v, z, b and a apart:

    in_proj_qkv [2·Hk·Dk + Hv·Dv, H]  colwise_qkv over its parts (q, k, v): rows of this rank's heads of each
    in_proj_z   [Hv·Dv, H], in_proj_b, in_proj_a [Hv, H]: colwise (this rank's value heads)

Qwen3-Next packs them by key head (``[q k v z]`` of key head 0, then of key head 1...; ``[b a]`` likewise), so a
contiguous share of the rows is this rank's key heads with their value heads:

    in_proj_qkvz [2·Hk·Dk + 2·Hv·Dv, H], in_proj_ba [2·Hv, H]: colwise

OLMo-hybrid projects each apart under attention's names, and its plan leaves the block whole:

    q_proj, k_proj [Hk·Dk, H], v_proj, g_proj [Hv·Dv, H], a_proj, b_proj [Hv, H]: colwise

and for all three:

    conv1d      depthwise over the channels [q | k | v]: colwise_conv, this rank's channels of each (weights, bias)
    A_log, dt_bias [Hv]: this rank's value heads' values
    norm        a gated RMSNorm over each head's Dv features (OLMo-hybrid's o_norm): whole, its gradient summed
                over the group
    out_proj    rowwise (OLMo-hybrid's o_proj)

Kimi Delta Attention (Kimi Linear's ``self_attn`` in its linear layers) is a Gated DeltaNet whose decay is per
channel, from a low-rank forget gate, and whose output gate is low-rank too; ``num_heads`` heads of ``head_dim``
for q, k and v alike:

    q_proj, k_proj, v_proj [H·D, H], b_proj [H, H]: colwise; conv1d over [q | k | v]: colwise_conv
    forget_gate.f_a_proj [D, H], g_a_proj [D, H]: replicated (a latent every head reads), their gradients whole since
                the columns after them sum theirs over the group
    forget_gate.f_b_proj, g_b_proj [H·D, D]: colwise; forget_gate.dt_bias [H·D], forget_gate.A_log [1, 1, H, 1]:
                this rank's heads' values
    o_norm      whole, its gradient summed; o_proj: rowwise

Bailing's (Ling/Ring hybrids') projects both gates at full rank, ``forget_gate.f_proj`` and ``g_proj`` ``[H·D, H]``:
colwise, its ``A_log`` ``[H]``.

The module's head counts and widths (``num_k_heads``, ``num_v_heads``, ``key_dim``, ``value_dim``, ``conv_dim``; Kimi's
``num_heads`` and ``qkv_dim``), which its forward reads to split the mixed channels, take their local values. Under
sequence parallelism the block gathers the sequence once for its input projections (one ring), and the causal
convolution and the recurrence run over the whole sequence of this rank's heads.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel.comm import group_rank, group_size
from ..parallel.sharding import local_shard

__all__ = [
    "KIMI_LATENTS",
    "KIMI_LATENT_FED",
    "delta_layout",
    "delta_net_styles",
    "delta_net_updates",
    "delta_parts",
    "gathered_delta_rules",
    "is_delta_net",
    "is_kimi_delta",
    "kimi_delta_inputs",
    "kimi_delta_styles",
    "kimi_delta_updates",
    "kimi_gates",
    "split_depthwise_conv",
]

# each layout's input projections, by its first one's name, and the styles that split them
_LAYOUTS = {"in_proj_qkv": {"in_proj_qkv": "colwise_qkv", "in_proj_z": "colwise", "in_proj_b": "colwise",
                            "in_proj_a": "colwise"},
            "in_proj_qkvz": {"in_proj_qkvz": "colwise", "in_proj_ba": "colwise"},
            "q_proj": dict.fromkeys(("q_proj", "k_proj", "v_proj", "g_proj", "a_proj", "b_proj"),
                                    "colwise")}  # fmt: skip
# each layout's output projection and norm
_OUTPUTS = {"in_proj_qkv": ("out_proj", "norm"), "in_proj_qkvz": ("out_proj", "norm"), "q_proj": ("o_proj", "o_norm")}


def _split_rest(first: str) -> dict[str, str]:
    out, norm = _OUTPUTS[first]
    return {out: "rowwise", "conv1d": "colwise_conv", "A_log": "colwise", "dt_bias": "colwise",
            norm: "replicated_with_grad_allreduce"}  # fmt: skip


def _widths(first: str, hk: int, hv: int, dk: int, dv: int) -> dict[str, int]:
    """The output width of each input projection of a layout."""
    if first == "in_proj_qkv":
        return {"in_proj_qkv": 2 * hk * dk + hv * dv, "in_proj_z": hv * dv, "in_proj_b": hv, "in_proj_a": hv}
    if first == "q_proj":
        return {"q_proj": hk * dk, "k_proj": hk * dk, "v_proj": hv * dv, "g_proj": hv * dv, "a_proj": hv, "b_proj": hv}
    return {"in_proj_qkvz": 2 * hk * dk + 2 * hv * dv, "in_proj_ba": 2 * hv}


def is_delta_net(m: nn.Module, t: int = 1) -> bool:
    """Whether ``m`` is a Gated DeltaNet block of plain projections whose key and value heads split over ``t``."""
    counts = [getattr(m, n, None) for n in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in counts):
        return False
    hk, hv, dk, dv = counts
    first = delta_layout(m)
    if first is None or hv % hk:
        return False
    out = _OUTPUTS[first][0]
    widths = {**_widths(first, hk, hv, dk, dv), out: hv * dv}
    for name, width in widths.items():
        p = getattr(m, name, None)
        if not isinstance(p, nn.Linear) or type(p).forward is not nn.Linear.forward:
            return False
        if (p.in_features if name == out else p.out_features) != width:
            return False
    conv = getattr(m, "conv1d", None)
    if (
        not isinstance(conv, nn.Conv1d)
        or not conv.groups == conv.in_channels == conv.out_channels == 2 * hk * dk + hv * dv
    ):
        return False
    return hk % t == 0 and all(isinstance(getattr(m, n, None), nn.Parameter) for n in ("A_log", "dt_bias"))


def delta_layout(m: nn.Module) -> str | None:
    """The name of the block's first input projection (``in_proj_qkv``: Qwen3.5's; ``in_proj_qkvz``: Qwen3-Next's;
    ``q_proj``: OLMo-hybrid's, beside a ``conv1d``), or None."""
    if not isinstance(getattr(m, "conv1d", None), nn.Conv1d):
        return None
    return next((first for first in _LAYOUTS if isinstance(getattr(m, first, None), nn.Linear)), None)


def delta_parts(m: nn.Module) -> tuple[int, int, int]:
    """The widths of q, k and v in the mixed channels (``in_proj_qkv``'s rows, ``conv1d``'s channels)."""
    return m.num_k_heads * m.head_k_dim, m.num_k_heads * m.head_k_dim, m.num_v_heads * m.head_v_dim


def delta_net_styles(m: nn.Module, t: int) -> dict[str, str] | None:
    """The styles that split ``m`` by heads over ``t`` ranks, by its children's and parameters' names (as the module's
    notes lay out), when it is a Gated DeltaNet block whose heads split; None otherwise."""
    if t < 2 or not is_delta_net(m, t):
        return None
    first = delta_layout(m)
    return {**_LAYOUTS[first], **_split_rest(first)}


def gathered_delta_rules(t: int) -> list[tuple[dict[str, str], object]]:
    """``(gathered, styles_of)`` for each layout Hugging Face's plans gather whole (every input projection and
    ``out_proj`` ``colwise_gather_output``: Qwen3.5's, Qwen3-Next's): what a plan says of a block's children, and
    the styles that split such a block over ``t`` ranks (:func:`delta_net_styles`; None where it does not split)."""
    rules = []
    for first in ("in_proj_qkv", "in_proj_qkvz"):
        gathered = dict.fromkeys((*_LAYOUTS[first], "out_proj"), "colwise_gather_output")
        rules.append((gathered, lambda m, first=first: delta_net_styles(m, t) if delta_layout(m) == first else None))
    return rules


def delta_net_updates(m: nn.Module, t: int) -> dict[str, int]:
    """The block's head counts and channel widths on each of ``t`` ranks."""
    if not is_delta_net(m, t):
        raise ValueError(f"delta_net_updates: expected a Gated DeltaNet block whose key and value heads split over {t} "
                         f"ranks, received {type(m).__name__}")  # fmt: skip
    hk, hv = m.num_k_heads // t, m.num_v_heads // t
    key, value = hk * m.head_k_dim, hv * m.head_v_dim
    updates = {"num_k_heads": hk, "num_v_heads": hv, "key_dim": key, "value_dim": value}
    if hasattr(m, "conv_dim"):
        updates["conv_dim"] = 2 * key + value
    return updates


# Kimi Delta Attention's low-rank gates: the projections of the block's input to one head's width, and those after
KIMI_LATENTS, KIMI_LATENT_FED = ("forget_gate.f_a_proj", "g_a_proj"), ("forget_gate.f_b_proj", "g_b_proj")


def kimi_gates(m: nn.Module) -> str | None:
    """How Kimi Delta Attention ``m`` (see the module's notes) projects its gates: ``"low_rank"`` (Kimi Linear's,
    through one head's width), ``"full"`` (Bailing's ``forget_gate.f_proj`` and ``g_proj``); None for another module
    (or one of other shapes)."""
    h, d, gate = getattr(m, "num_heads", None), getattr(m, "head_dim", None), getattr(m, "forget_gate", None)
    if not (isinstance(h, int) and isinstance(d, int) and h > 0 and d > 0 and isinstance(gate, nn.Module)):
        return None
    hidden, width = getattr(getattr(m, "o_proj", None), "out_features", None), h * d
    shapes = {"q_proj": (width, hidden), "k_proj": (width, hidden), "v_proj": (width, hidden), "b_proj": (h, hidden),
              "o_proj": (hidden, width)}  # fmt: skip
    low_rank = {"g_a_proj": (d, hidden), "g_b_proj": (width, d), "forget_gate.f_a_proj": (d, hidden),
                "forget_gate.f_b_proj": (width, d)}  # fmt: skip
    full = {"g_proj": (width, hidden), "forget_gate.f_proj": (width, hidden)}
    kind = "low_rank" if _has(m, "g_a_proj") else "full"
    for name, shape in {**shapes, **(low_rank if kind == "low_rank" else full)}.items():
        p = m.get_submodule(name) if _has(m, name) else None
        if not isinstance(p, nn.Linear) or type(p).forward is not nn.Linear.forward or p.weight.shape != shape:
            return None
    conv = getattr(m, "conv1d", None)
    if not isinstance(conv, nn.Conv1d) or not conv.groups == conv.in_channels == conv.out_channels == 3 * width:
        return None
    dt_bias, a_log = getattr(gate, "dt_bias", None), getattr(gate, "A_log", None)
    if not (isinstance(dt_bias, nn.Parameter) and dt_bias.shape == (width,) and isinstance(a_log, nn.Parameter)):
        return None
    return kind if a_log.shape in ((1, 1, h, 1), (h,)) else None


def is_kimi_delta(m: nn.Module, t: int = 1) -> bool:
    """Whether ``m`` is Kimi Delta Attention of plain projections (Kimi Linear's, Bailing's: :func:`kimi_gates`) whose
    heads split over ``t``."""
    return kimi_gates(m) is not None and m.num_heads % t == 0


def _has(m: nn.Module, name: str) -> bool:
    try:
        m.get_submodule(name)
    except AttributeError:
        return False
    return True


def kimi_delta_inputs(m: nn.Module) -> tuple[str, ...]:
    """Kimi Delta Attention's projections to its heads: q, k, v, β, and its gates' (their second ones where they are
    low-rank, :data:`KIMI_LATENT_FED`)."""
    gates = KIMI_LATENT_FED if kimi_gates(m) == "low_rank" else ("forget_gate.f_proj", "g_proj")
    return ("q_proj", "k_proj", "v_proj", "b_proj", *gates)


def kimi_delta_styles(m: nn.Module, t: int) -> dict[str, str] | None:
    """The styles that split Kimi Delta Attention ``m`` by heads over ``t`` ranks; None for another module or heads
    that do not split."""
    if t < 2 or not is_kimi_delta(m, t):
        return None
    return {**dict.fromkeys((*kimi_delta_inputs(m), "forget_gate.dt_bias", "forget_gate.A_log"), "colwise"),
            "conv1d": "colwise_conv", "o_norm": "replicated_with_grad_allreduce", "o_proj": "rowwise"}  # fmt: skip


def kimi_delta_updates(m: nn.Module, t: int) -> dict[str, int]:
    """Kimi Delta Attention's head count and channel widths on each of ``t`` ranks (its forget gate's are set with the
    gate's projection)."""
    if not is_kimi_delta(m, t):
        raise ValueError(f"its {getattr(m, 'num_heads', None)} heads do not split over {t} tensor-parallel ranks")
    heads = m.num_heads // t
    return {"num_heads": heads, "qkv_dim": heads * m.head_dim, "conv_dim": 3 * heads * m.head_dim}


def split_depthwise_conv(conv: nn.Conv1d, parts: tuple[int, ...], tp_group) -> nn.Conv1d:
    """This rank's channels of a depthwise convolution over packed ``parts`` (its share of each part, in order):
    a new ``nn.Conv1d`` whose weight (and bias) are tagged for :mod:`tessel.parallel.sharding`."""
    t, r = group_size(tp_group), group_rank(tp_group)
    if not isinstance(conv, nn.Conv1d) or not conv.groups == conv.in_channels == conv.out_channels:
        raise TypeError(f"split_depthwise_conv: conv must be a depthwise nn.Conv1d (groups = channels), received "
                        f"{conv}")  # fmt: skip
    if sum(parts) != conv.in_channels or any(n % t for n in parts):
        raise ValueError(f"split_depthwise_conv: parts must add up to the {conv.in_channels} channels, each divisible "
                         f"by the tensor-parallel size {t}, received {tuple(parts)}")  # fmt: skip
    local = sum(parts) // t
    new = nn.Conv1d(local, local, conv.kernel_size[0], stride=conv.stride, padding=conv.padding,
                    dilation=conv.dilation, groups=local, bias=conv.bias is not None, padding_mode=conv.padding_mode,
                    device=conv.weight.device, dtype=conv.weight.dtype)  # fmt: skip
    with torch.no_grad():
        for name in ("weight", "bias"):
            p = getattr(conv, name)
            if p is None:
                continue
            shard = getattr(new, name)
            shard.copy_(local_shard(p.detach(), 0, parts, r, t))
            shard.requires_grad_(p.requires_grad)
            shard.tensor_parallel, shard.tp_dim, shard.tp_parts = True, 0, tuple(parts)
    return new
