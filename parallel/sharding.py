"""How a tensor-parallel parameter's local shard relates to its global tensor.

Tensor-parallel layers tag each sharded parameter with ``tensor_parallel = True``, ``tp_dim`` (the dim
it is split along) and ``tp_parts`` (the global sizes along ``tp_dim`` of the parts fused in it: one
part for most weights; Q, K, V or gate, up for fused projections). The local tensor of rank ``r`` of
``t`` is the concatenation along ``tp_dim`` of each part's ``r``-th of ``t`` equal chunks. Parameters
without the tag are replicated on every TP rank.

Used by initialisation that must not depend on the layout, by checkpoints that save and load each
rank's pieces of the global tensors (:func:`global_pieces`), and by tests that compare shards with a
dense model.

A ZeRO shard holds a flat range ``[start, stop)`` of a parameter's (local) flattened elements, which is
not one block of the tensor. :func:`flat_boxes` cuts such a range into blocks that are contiguous in
row-major order (a partial first row, whole rows, a partial last row, recursively in more dims), and
:func:`global_pieces` places each block in the global tensor, split where the fused parts meet.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .comm import all_gather, group_rank, group_size

__all__ = ["expert_spec", "flat_boxes", "full_tensor", "global_pieces", "global_shape", "is_tp_sharded",
           "local_shard", "shard_like", "tp_spec"]  # fmt: skip


def is_tp_sharded(p: torch.Tensor) -> bool:
    return bool(getattr(p, "tensor_parallel", False))


def tp_spec(p: torch.Tensor, t: int) -> tuple[int, tuple[int, ...]]:
    """``(tp_dim, global part sizes)`` of a sharded parameter on a group of ``t`` ranks."""
    dim = getattr(p, "tp_dim", 0)
    parts = getattr(p, "tp_parts", None) or (p.shape[dim] * t,)
    return dim, tuple(parts)


def _check_layout(op: str, ndim: int, dim, parts, t, rank=None) -> None:
    if not isinstance(dim, int) or not -ndim <= dim < max(ndim, 1):
        raise ValueError(f"{op}: dim must be a dimension of a {ndim}-d tensor, received {dim!r}")
    if not isinstance(t, int) or t < 1:
        raise ValueError(f"{op}: the group size must be a positive int, received {t!r}")
    if rank is not None and not (isinstance(rank, int) and 0 <= rank < t):
        raise ValueError(f"{op}: rank must be in [0, {t}), received {rank!r}")
    if not parts or any(not isinstance(n, int) or n < 0 or n % t for n in parts):
        raise ValueError(f"{op}: parts must be sizes divisible by the group size {t}, received {tuple(parts)}")


def expert_spec(p: torch.Tensor) -> tuple[int, int] | None:
    """``(first expert, expert count)`` of a parameter that holds experts ``[first, first + p.shape[0])`` of the
    ``expert_count`` of its global tensor (tessel's :class:`~tessel.layers.moe.ParallelMoE` under expert
    parallelism: ``expert_range`` and ``expert_count``), else None."""
    held, count = getattr(p, "expert_range", None), getattr(p, "expert_count", None)
    return None if held is None or count is None else (held[0], count)


def global_shape(p: torch.Tensor, t: int, shape: torch.Size | None = None) -> torch.Size:
    """The shape of ``p``'s global tensor on a group of ``t`` (``shape``: its local shape, default ``p.shape``);
    an expert-parallel parameter's dim 0 is every expert's (:func:`expert_spec`)."""
    shape = list(p.shape if shape is None else shape)
    if is_tp_sharded(p):
        dim, parts = tp_spec(p, t)
        shape[dim] = sum(parts)
    experts = expert_spec(p)
    if experts is not None:
        shape[0] = experts[1]
    return torch.Size(shape)


def local_shard(full: torch.Tensor, dim: int, parts: tuple[int, ...], rank: int, t: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full``: each part's ``rank``-th of ``t`` chunks along ``dim``, concatenated."""
    _check_layout("local_shard", full.dim(), dim, parts, t, rank)
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
    _check_layout("full_tensor", local.dim(), dim, parts, t)
    if local.shape[dim] * t != sum(parts):
        raise ValueError(f"full_tensor: dim {dim} of the local shard is {local.shape[dim]}, expected "
                         f"{sum(parts) // t} (parts {tuple(parts)} over {t} ranks)")  # fmt: skip
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
    """``full`` cut to this rank's shard if ``p`` is TP-sharded (and to its experts if it holds some of them,
    :func:`expert_spec`), else ``full`` itself."""
    experts = expert_spec(p)
    if experts is not None:
        full = full.narrow(0, experts[0], p.shape[0])
    if not is_tp_sharded(p):
        return full
    t = group_size(group)
    dim, parts = tp_spec(p, t)
    return local_shard(full, dim, parts, group_rank(group), t)


def flat_boxes(shape, start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Blocks covering the flattened elements ``[start, stop)`` of a tensor of ``shape``, in order.

    Each is ``(offsets, sizes, first)``: a block contiguous in row-major order whose first element is
    flat element ``first``; at most ``2·ndim - 1`` of them.
    """
    shape = tuple(shape)
    numel = math.prod(shape)
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"flat_boxes: need 0 <= start <= stop <= {numel} for shape {shape}, received {start}, {stop}")
    if not shape:
        return [((), (), 0)] if stop > start else []
    return _boxes(shape, start, stop, 0)


def _boxes(shape: tuple[int, ...], start: int, stop: int, base: int) -> list:
    if start >= stop:
        return []
    if len(shape) == 1:
        return [((start,), (stop - start,), base + start)]
    inner = math.prod(shape[1:])
    (i0, r0), (i1, r1) = divmod(start, inner), divmod(stop, inner)
    zeros = (0,) * (len(shape) - 1)

    def within(i, lo, hi):  # a part of slice i
        return [((i, *o), (1, *z), base + f) for o, z, f in _boxes(shape[1:], lo, hi, i * inner)]

    if i0 == i1:
        return within(i0, r0, r1)
    out = []
    if r0:
        out += within(i0, r0, inner)
        i0 += 1
    if i1 > i0:
        out.append(((i0, *zeros), (i1 - i0, *shape[1:]), base + i0 * inner))
    if r1:
        out += within(i1, 0, r1)
    return out


def global_pieces(p: torch.Tensor, flat: torch.Tensor, start: int, t: int, rank: int,
                  shape: torch.Size | None = None) -> list[tuple[tuple[int, ...], torch.Tensor]]:  # fmt: skip
    """Where the elements in ``flat`` sit in ``p``'s global tensor, as ``(global offsets, block view)`` pairs.

    ``flat`` is a 1-D tensor holding the flattened elements ``[start, start + flat.numel())`` of rank
    ``rank``'s local tensor of ``p`` (of local shape ``shape``, default ``p.shape``) on a group of ``t``.
    Each block is a view of ``flat`` (writing into it writes ``flat``). Parameters that are not
    TP-sharded are their own global tensor; an expert-parallel one's blocks start at its first expert.
    """
    pieces = _tp_pieces(p, flat, start, t, rank, tuple(p.shape if shape is None else shape))
    experts = expert_spec(p)
    if experts is None:
        return pieces
    return [((off[0] + experts[0], *off[1:]), view) for off, view in pieces]


def _tp_pieces(p: torch.Tensor, flat: torch.Tensor, start: int, t: int, rank: int, shape: tuple[int, ...]) -> list:
    if flat.dim() != 1:
        raise ValueError(f"global_pieces: flat must be 1-D, received shape {tuple(flat.shape)}")
    boxes = flat_boxes(shape, start, start + flat.numel())
    views = [(off, flat[first - start : first - start + math.prod(size)].view(size)) for off, size, first in boxes]
    if not is_tp_sharded(p):
        return views
    dim, parts = tp_spec(p, t)
    _check_layout("global_pieces", len(shape), dim, parts, t, rank)
    dim %= len(shape)
    pieces, local_lo, global_lo = [], 0, 0
    edges = []  # (local start, local stop, global start of this rank's chunk) per part
    for n in parts:
        edges.append((local_lo, local_lo + n // t, global_lo + rank * (n // t)))
        local_lo, global_lo = local_lo + n // t, global_lo + n
    for off, view in views:
        lo, hi = off[dim], off[dim] + view.shape[dim]
        for a, b, g in edges:
            a2, b2 = max(a, lo), min(b, hi)
            if a2 < b2:
                goff = (*off[:dim], g + a2 - a, *off[dim + 1 :])
                pieces.append((goff, view.narrow(dim, a2 - lo, b2 - a2)))
    return pieces
