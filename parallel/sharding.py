"""How a tensor-parallel parameter's local shard relates to its global tensor.

Tensor-parallel layers tag each sharded parameter with ``tensor_parallel = True``, ``tp_dim`` (the dim
it is split along) and ``tp_parts`` (the global sizes along ``tp_dim`` of the parts fused in it: one
part for most weights; Q, K, V or gate, up for fused projections). The local tensor of rank ``r`` of
``t`` is the concatenation along ``tp_dim`` of each part's ``r``-th of ``t`` equal chunks. Parameters
without the tag are replicated on every TP rank.

A part may be cut into fewer chunks than there are ranks: ``tp_max_chunks`` (one entry per part, ``None`` for
no limit) caps it at ``m`` chunks, so over ``t > m`` ranks (``t`` a multiple of ``m``) each chunk sits on ``t/m``
consecutive ranks, chunk ``r·m/t`` on rank ``r`` (Megatron-LM's kv heads replicated when they are fewer than the
ranks). :func:`tp_chunks` says how many chunks each part is cut into on a group; a norm counts a replicated chunk
once, on the first rank that holds it (:func:`uncounted_rows`).

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
           "local_shard", "part_chunks", "shard_like", "square_sum", "tp_chunks", "tp_spec", "uncounted_ranges",
           "uncounted_rows"]  # fmt: skip


def is_tp_sharded(p: torch.Tensor) -> bool:
    return bool(getattr(p, "tensor_parallel", False))


def tp_spec(p: torch.Tensor, t: int) -> tuple[int, tuple[int, ...]]:
    """``(tp_dim, global part sizes)`` of a sharded parameter on a group of ``t`` ranks."""
    dim = getattr(p, "tp_dim", 0)
    parts = getattr(p, "tp_parts", None) or (p.shape[dim] * t,)
    return dim, tuple(parts)


def part_chunks(parts, max_chunks, t: int) -> tuple[int, ...]:
    """How many chunks each of ``parts`` is cut into over ``t`` ranks: ``t``, or ``min(t, m)`` for a part whose
    ``max_chunks`` entry is ``m`` (``max_chunks`` None: ``t`` for every part)."""
    if max_chunks is None:
        return (t,) * len(parts)
    if len(max_chunks) != len(parts):
        raise ValueError(f"part_chunks: max_chunks must hold one entry per part of {tuple(parts)}, received "
                         f"{tuple(max_chunks)}")  # fmt: skip
    return tuple(t if m is None else min(t, m) for m in max_chunks)


def tp_chunks(p: torch.Tensor, t: int) -> tuple[int, ...]:
    """How many chunks each part of a sharded parameter is cut into on a group of ``t`` (``tp_max_chunks``)."""
    return part_chunks(tp_spec(p, t)[1], getattr(p, "tp_max_chunks", None), t)


def _chunk_index(rank: int, chunks: int, t: int) -> int:
    """The chunk rank ``rank`` of ``t`` holds of a part cut into ``chunks``: each sits on ``t/chunks`` ranks."""
    return rank * chunks // t


def _check_layout(op: str, ndim: int, dim, parts, t, rank=None, chunks=None) -> tuple[int, ...]:
    """Raise a ValueError for a bad layout; the chunks of each part (``chunks``, default ``t`` each)."""
    if not isinstance(dim, int) or not -ndim <= dim < max(ndim, 1):
        raise ValueError(f"{op}: dim must be a dimension of a {ndim}-d tensor, received {dim!r}")
    if not isinstance(t, int) or t < 1:
        raise ValueError(f"{op}: the group size must be a positive int, received {t!r}")
    if rank is not None and not (isinstance(rank, int) and 0 <= rank < t):
        raise ValueError(f"{op}: rank must be in [0, {t}), received {rank!r}")
    if chunks is None:
        if not parts or any(not isinstance(n, int) or n < 0 or n % t for n in parts):
            raise ValueError(f"{op}: parts must be sizes divisible by the group size {t}, received {tuple(parts)}")
        return (t,) * len(parts)
    chunks = tuple(chunks)
    ok = bool(parts) and len(chunks) == len(parts)
    ok = ok and all(isinstance(n, int) and isinstance(c, int) and n >= 0 and c >= 1 for n, c in zip(parts, chunks))
    if not ok or any(n % c or t % c for n, c in zip(parts, chunks)):
        raise ValueError(f"{op}: parts must be sizes divisible by their chunk counts, which divide the group size "
                         f"{t}, received parts {tuple(parts)} in chunks {chunks}")  # fmt: skip
    return chunks


def uncounted_rows(p: torch.Tensor, t: int, rank: int) -> list[tuple[int, int]]:
    """Ranges ``[lo, hi)`` along ``tp_dim`` of rank ``rank``'s local tensor of ``p`` that a norm over the group
    leaves out: the chunks it holds as a copy of an earlier rank's (``tp_max_chunks``). Empty for most parameters."""
    if not is_tp_sharded(p) or getattr(p, "tp_max_chunks", None) is None:
        return []
    out, lo = [], 0
    for n, c in zip(tp_spec(p, t)[1], tp_chunks(p, t)):
        if rank % (t // c):
            out.append((lo, lo + n // c))
        lo += n // c
    return out


def uncounted_ranges(p: torch.Tensor, start: int, stop: int, t: int, rank: int) -> list[tuple[int, int]]:
    """:func:`uncounted_rows` within the flattened elements ``[start, stop)`` of rank ``rank``'s local tensor of
    ``p``, as ranges relative to ``start`` (a parameter replicating chunks is split along dim 0)."""
    rows = uncounted_rows(p, t, rank)
    if rows and getattr(p, "tp_dim", 0) % p.dim() != 0:
        raise ValueError(f"uncounted_ranges: replicated chunks are supported along dim 0, received tp_dim={p.tp_dim}")
    inner = math.prod(p.shape[1:])
    out = []
    for lo, hi in rows:
        a, b = max(lo * inner, start), min(hi * inner, stop)
        if a < b:
            out.append((a - start, b - start))
    return out


def square_sum(p: torch.Tensor, flat: torch.Tensor, start: int, t: int, rank: int) -> torch.Tensor:
    """Σ x² in fp32 of ``flat``, the flattened elements ``[start, start + flat.numel())`` of rank ``rank``'s local
    tensor of ``p`` (a gradient), leaving out the chunks another rank of the ``t`` counts (:func:`uncounted_rows`):
    summed over the tensor-parallel group, each element of the global tensor is counted once."""
    squares = flat.float().pow(2)
    ranges = uncounted_ranges(p, start, start + flat.numel(), t, rank)
    if not ranges:
        return squares.sum()
    keep = torch.ones(flat.numel(), dtype=torch.bool, device=flat.device)
    for lo, hi in ranges:
        keep[lo:hi] = False
    return squares[keep].sum()


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


def local_shard(full: torch.Tensor, dim: int, parts: tuple[int, ...], rank: int, t: int,
                chunks: tuple[int, ...] | None = None) -> torch.Tensor:  # fmt: skip
    """Rank ``rank``'s shard of ``full``: each part's ``rank``-th of ``t`` chunks along ``dim``, concatenated (of a
    part cut into ``chunks[i] < t``, the chunk ``rank·chunks[i]/t``: see the module)."""
    chunks = _check_layout("local_shard", full.dim(), dim, parts, t, rank, chunks)
    if full.shape[dim] != sum(parts):
        raise ValueError(f"local_shard: dim {dim} of the full tensor is {full.shape[dim]}, expected {sum(parts)}")
    blocks, start = [], 0
    for n, c in zip(parts, chunks):
        chunk = n // c
        blocks.append(full.narrow(dim, start + _chunk_index(rank, c, t) * chunk, chunk))
        start += n
    return torch.cat(blocks, dim)


def full_tensor(local: torch.Tensor, dim: int, parts: tuple[int, ...], group: dist.ProcessGroup | None,
                chunks: tuple[int, ...] | None = None) -> torch.Tensor:  # fmt: skip
    """The global tensor from every rank's ``local`` shard (an all-gather; not differentiable; a part cut into
    ``chunks[i] < t`` read from the first rank holding each chunk)."""
    t = group_size(group)
    chunks = _check_layout("full_tensor", local.dim(), dim, parts, t, chunks=chunks)
    held = sum(n // c for n, c in zip(parts, chunks))
    if local.shape[dim] != held:
        raise ValueError(f"full_tensor: dim {dim} of the local shard is {local.shape[dim]}, expected "
                         f"{held} (parts {tuple(parts)} over {t} ranks)")  # fmt: skip
    if t == 1:
        return local.detach().clone()
    moved = local.detach().movedim(dim, 0).contiguous()
    gathered, _ = all_gather(moved, group)
    per_rank = gathered.chunk(t)  # rank q's local tensor, tp_dim first
    blocks, offset = [], 0
    for n, c in zip(parts, chunks):
        chunk = n // c
        blocks.extend(per_rank[q * (t // c)][offset : offset + chunk] for q in range(c))
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
    return local_shard(full, dim, parts, group_rank(group), t, tp_chunks(p, t))


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
    TP-sharded are their own global tensor; an expert-parallel one's blocks start at its first expert. The ranks
    holding copies of a chunk (``tp_max_chunks``) each return its blocks.
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
    chunks = _check_layout("global_pieces", len(shape), dim, parts, t, rank, tp_chunks(p, t))
    dim %= len(shape)
    pieces, local_lo, global_lo = [], 0, 0
    edges = []  # (local start, local stop, global start of this rank's chunk) per part
    for n, c in zip(parts, chunks):
        edges.append((local_lo, local_lo + n // c, global_lo + _chunk_index(rank, c, t) * (n // c)))
        local_lo, global_lo = local_lo + n // c, global_lo + n
    for off, view in views:
        lo, hi = off[dim], off[dim] + view.shape[dim]
        for a, b, g in edges:
            a2, b2 = max(a, lo), min(b, hi)
            if a2 < b2:
                goff = (*off[:dim], g + a2 - a, *off[dim + 1 :])
                pieces.append((goff, view.narrow(dim, a2 - lo, b2 - a2)))
    return pieces
