"""How a tensor-parallel parameter's local shard relates to its global tensor.

Tensor-parallel layers tag each sharded parameter with ``tensor_parallel = True``, ``tp_dim`` (the dim
it is split along) and ``tp_parts`` (the global sizes along ``tp_dim`` of the parts fused in it: one
part for most weights; Q, K, V or gate, up for fused projections). The local tensor of rank ``r`` of
``t`` is the concatenation along ``tp_dim`` of each part's ``r``-th of ``t`` equal chunks. Parameters
without the tag are replicated on every TP rank.

Used by initialisation that must not depend on the layout, by checkpoints that save global tensors, and
by tests that compare shards with a dense model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import all_gather, group_rank, group_size

__all__ = ["full_tensor", "is_tp_sharded", "local_shard", "shard_like", "tp_spec"]


def is_tp_sharded(p: torch.Tensor) -> bool:
    return bool(getattr(p, "tensor_parallel", False))


def tp_spec(p: torch.Tensor, t: int) -> tuple[int, tuple[int, ...]]:
    """``(tp_dim, global part sizes)`` of a sharded parameter on a group of ``t`` ranks."""
    dim = getattr(p, "tp_dim", 0)
    parts = getattr(p, "tp_parts", None) or (p.shape[dim] * t,)
    return dim, tuple(parts)


def local_shard(full: torch.Tensor, dim: int, parts: tuple[int, ...], rank: int, t: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full``: each part's ``rank``-th of ``t`` chunks along ``dim``, concatenated."""
    if full.shape[dim] != sum(parts):
        raise ValueError(f"local_shard: dim {dim} of the full tensor is {full.shape[dim]}, expected {sum(parts)}")
    blocks, start = [], 0
    for n in parts:
        chunk = n // t
        blocks.append(full.narrow(dim, start + rank * chunk, chunk))
        start += n
    return torch.cat(blocks, dim)


def full_tensor(local: torch.Tensor, dim: int, parts: tuple[int, ...], group: dist.ProcessGroup | None) -> torch.Tensor:
    """The global tensor from every rank's ``local`` shard (an all-gather; not differentiable)."""
    t = group_size(group)
    if t == 1:
        return local.detach().clone()
    moved = local.detach().movedim(dim, 0).contiguous()
    gathered, _ = all_gather(moved, group)
    per_rank = gathered.chunk(t)  # rank q's local tensor, tp_dim first
    blocks, offset = [], 0
    for n in parts:
        chunk = n // t
        blocks.extend(shard[offset : offset + chunk] for shard in per_rank)
        offset += chunk
    return torch.cat(blocks).movedim(0, dim)


def shard_like(full: torch.Tensor, p: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``full`` cut to this rank's shard if ``p`` is TP-sharded, else ``full`` itself."""
    if not is_tp_sharded(p):
        return full
    t = group_size(group)
    dim, parts = tp_spec(p, t)
    return local_shard(full, dim, parts, group_rank(group), t)
