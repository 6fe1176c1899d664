"""Gated DeltaNet linear attention (Qwen3.5's ``linear_attn``) split by heads over tensor-parallel ranks.

Hugging Face's plan gathers the block's projections whole (``colwise_gather_output``), so every rank runs every
head of the recurrence. The heads are independent, so tessel splits them instead, each of ``t`` ranks keeping
``Hk/t`` key heads and ``Hv/t`` value heads (value head ``j`` reads key head ``j // (Hv/Hk)``: a contiguous share of
each keeps the pairs together):

    in_proj_qkv [2·Hk·Dk + Hv·Dv, H]  colwise_qkv over its parts (q, k, v): rows of this rank's heads of each
    conv1d      depthwise over the same channels [q | k | v]: colwise_conv, this rank's channels (weights, bias)
    in_proj_z   [Hv·Dv, H], in_proj_b, in_proj_a [Hv, H]: colwise (this rank's value heads)
    A_log, dt_bias [Hv]: this rank's value heads' values
    norm        a gated RMSNorm over each head's Dv features: whole, its gradient summed over the group
    out_proj    rowwise

The module's head counts and widths (``num_k_heads``, ``num_v_heads``, ``key_dim``, ``value_dim``, ``conv_dim``),
which its forward reads to split the mixed channels, take their local values. Under sequence parallelism the block
gathers the sequence once for its four input projections (one ring), and the causal convolution and the
recurrence run over the whole sequence of this rank's heads.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel.comm import group_rank, group_size
from ..parallel.sharding import local_shard

__all__ = ["delta_net_plan", "delta_net_updates", "delta_parts", "is_delta_net", "split_depthwise_conv"]

_INPUTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
_GATHERED = {**dict.fromkeys(_INPUTS, "colwise_gather_output"), "out_proj": "colwise_gather_output"}


def is_delta_net(m: nn.Module, t: int = 1) -> bool:
    """Whether ``m`` is a Gated DeltaNet block of plain projections whose key and value heads split over ``t``."""
    counts = [getattr(m, n, None) for n in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in counts):
        return False
    hk, hv, dk, dv = counts
    linears = [getattr(m, n, None) for n in (*_INPUTS, "out_proj")]
    if not all(isinstance(p, nn.Linear) and type(p).forward is nn.Linear.forward for p in linears):
        return False
    conv = getattr(m, "conv1d", None)
    if not isinstance(conv, nn.Conv1d) or conv.groups != conv.in_channels or conv.out_channels != conv.in_channels:
        return False
    qkv, z, b, a, out = linears
    widths = (qkv.out_features, conv.in_channels, z.out_features, b.out_features, a.out_features, out.in_features)
    if widths != (2 * hk * dk + hv * dv, 2 * hk * dk + hv * dv, hv * dv, hv, hv, hv * dv) or hv % hk:
        return False
    return hk % t == 0 and all(isinstance(getattr(m, n, None), nn.Parameter) for n in ("A_log", "dt_bias"))


def delta_parts(m: nn.Module) -> tuple[int, int, int]:
    """The widths of q, k and v in the mixed channels (``in_proj_qkv``'s rows, ``conv1d``'s channels)."""
    return m.num_k_heads * m.head_k_dim, m.num_k_heads * m.head_k_dim, m.num_v_heads * m.head_v_dim


def delta_net_plan(model: nn.Module, plan: dict[str, str], regex_of, t: int) -> dict[str, str]:
    """``plan`` with the Gated DeltaNet blocks it gathers whole (every input projection and ``out_proj``
    ``colwise_gather_output``, as Hugging Face's Qwen3.5 plan does) split by heads instead, as the module's notes lay
    out, where every block a glob stem matches is one whose heads split over ``t`` ranks; ``regex_of(glob)`` is the
    compiled pattern of a glob."""
    out = dict(plan)
    if t < 2:
        return out
    modules = dict(model.named_modules())
    for glob in plan:
        stem, _, leaf = glob.rpartition(".")
        if leaf != "in_proj_qkv" or any(plan.get(f"{stem}.{n}") != s for n, s in _GATHERED.items()):
            continue
        regex = regex_of(stem)
        blocks = [m for n, m in modules.items() if regex.fullmatch(n)]
        if blocks and all(is_delta_net(m, t) for m in blocks):
            out.update({glob: "colwise_qkv", **{f"{stem}.{n}": "colwise" for n in _INPUTS[1:]},
                        f"{stem}.out_proj": "rowwise", f"{stem}.conv1d": "colwise_conv", f"{stem}.A_log": "colwise",
                        f"{stem}.dt_bias": "colwise", f"{stem}.norm": "replicated_with_grad_allreduce"})  # fmt: skip
    return out


def delta_net_updates(m: nn.Module, t: int) -> dict[str, int]:
    """The block's head counts and channel widths on each of ``t`` ranks."""
    hk, hv = m.num_k_heads // t, m.num_v_heads // t
    key, value = hk * m.head_k_dim, hv * m.head_v_dim
    updates = {"num_k_heads": hk, "num_v_heads": hv, "key_dim": key, "value_dim": value}
    if hasattr(m, "conv_dim"):
        updates["conv_dim"] = 2 * key + value
    return updates


def split_depthwise_conv(conv: nn.Conv1d, parts: tuple[int, ...], tp_group) -> nn.Conv1d:
    """This rank's channels of a depthwise convolution over packed ``parts`` (its share of each part, in order):
    a new ``nn.Conv1d`` whose weight (and bias) are tagged for :mod:`tessel.parallel.sharding`."""
    t, r = group_size(tp_group), group_rank(tp_group)
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
