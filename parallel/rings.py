"""The chunked schedules that braid communication into GEMMs; shared by the overlapped ops' forward and backward.

Legend: ``t`` group size, ``r`` this rank, ``m`` rows per shard, rows of a gathered matrix are ``t·m``,
shard ``c`` is rows ``[c·m, (c+1)·m)``. Every transfer is issued before the GEMM it overlaps starts
and waited on after that GEMM, and each step is logged with :func:`~.comm.record_event` so tests can
check that order without timing anything.

All-gather ring (:func:`ring_all_gather`): at step ``s`` rank ``r`` holds shard ``(r - s) mod t``;
it sends that shard on to ``r+1`` and receives the next from ``r-1`` while its GEMM runs on the shard
it holds, writing straight into that shard's rows of the output::

    step:   0            1            2            3
    comm:   recv s(r-1)  recv s(r-2)  recv s(r-3)
    gemm:   s(r)·W       s(r-1)·W     s(r-2)·W     s(r-3)·W

Reduce-scatter ring (:func:`ring_reduce_scatter`): at step ``s`` rank ``r`` computes its partial of
chunk ``(r - 1 - s) mod t`` and adds, in the GEMM epilogue, the accumulator received from ``r-1``
(the sum of the partials of the ranks before it), then passes it on; at the last step the chunk is
its own. The GEMM of a step needs the accumulator of the previous one, so each chunk is cut in two
halves that alternate: half ``b``'s GEMM runs while half ``a``'s accumulator travels, and back::

    gemm:   a0  b0  a1  b1  a2  b2  a3  b3
    comm:       a0  b0  a1  b1  a2  b2

All-reduce chunks (:func:`chunked_all_reduce`): the rows are cut into chunks; chunk ``j``'s all-reduce
runs during chunk ``j+1``'s GEMM. The last chunk's all-reduce is exposed (1/chunks of the traffic)
unless the caller has other work for it, as backward passes do with the weight gradient.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.distributed as dist

from .comm import all_reduce, group_rank, group_size, record_event, ring_exchange

__all__ = ["chunked_all_reduce", "ring_all_gather", "ring_reduce_scatter", "row_chunks"]


def row_chunks(rows: int, n_chunks: int) -> list[tuple[int, int]]:
    """``n_chunks`` contiguous ``(lo, hi)`` row ranges as even as possible (empty ones dropped)."""
    bounds = [rows * j // n_chunks for j in range(n_chunks + 1)]
    return [(lo, hi) for lo, hi in itertools.pairwise(bounds) if hi > lo]


def ring_all_gather(
    x_shard: torch.Tensor, group: dist.ProcessGroup | None, op: str, gemm: Callable[[int, torch.Tensor], None]
) -> torch.Tensor:
    """Gather ``x_shard [m, K]`` from every rank into ``x_full [t·m, K]``, calling ``gemm(c, rows)`` per shard.

    ``gemm`` runs once for every shard ``c`` with that shard's rows, while the next shard is in flight.
    Returns the gathered matrix (backward passes keep it for their weight gradients).
    """
    t, r = group_size(group), group_rank(group)
    m = x_shard.shape[0]
    x_full = x_shard.new_empty((t * m, *x_shard.shape[1:]))
    x_full[r * m : (r + 1) * m].copy_(x_shard)
    for s in range(t):
        c = (r - s) % t
        rows = x_full[c * m : (c + 1) * m]
        handle = None
        if s < t - 1:
            nxt = (r - s - 1) % t
            handle = ring_exchange(rows, x_full[nxt * m : (nxt + 1) * m], group)
            record_event("send", op, s + 1)
        record_event("gemm", op, s)
        gemm(c, rows)
        if handle is not None:
            handle.wait()
            record_event("wait", op, s + 1)
    return x_full


def _halves(m: int) -> list[tuple[int, int]]:
    return row_chunks(m, 2)


def ring_reduce_scatter(
    m: int,
    n: int,
    like: torch.Tensor,
    group: dist.ProcessGroup | None,
    op: str,
    gemm: Callable[[int, int, int, torch.Tensor, bool, bool], None],
    after_step: Callable[[int, int, int], None] | None = None,
) -> torch.Tensor:
    """Sum over ranks of per-rank partials ``[t·m, n]``, keeping this rank's chunk ``[m, n]``.

    ``gemm(c, lo, hi, out, accumulate, last)`` writes (or, with ``accumulate``, adds) this rank's partial
    of rows ``[c·m + lo, c·m + hi)`` into ``out``; ``last`` marks the final step, whose chunk is this
    rank's own (where a bias that must be added once goes). ``after_step(c, lo, hi)`` runs after each
    GEMM's accumulator has been sent on, so work placed there (the weight gradient of the same rows,
    in backward passes) hides behind the transfer.
    """
    t, r = group_size(group), group_rank(group)
    out = like.new_empty((m, n))
    halves = _halves(m)
    incoming: dict[int, tuple[object, torch.Tensor]] = {}
    k = 0  # index of the GEMM (and of the transfer that follows it) across all steps and halves
    for s in range(t):
        c, last = (r - 1 - s) % t, s == t - 1
        for h, (lo, hi) in enumerate(halves):
            target = out[lo:hi] if last else like.new_empty((hi - lo, n))
            if s > 0:
                handle, received = incoming.pop(h)
                handle.wait()
                record_event("wait", op, k - len(halves))
                target = received
            record_event("gemm", op, k)
            gemm(c, lo, hi, target, s > 0, last)
            if not last:
                nxt = out[lo:hi] if s + 1 == t - 1 else like.new_empty((hi - lo, n))
                incoming[h] = (ring_exchange(target, nxt, group), nxt)
                record_event("send", op, k)
            if after_step is not None:
                after_step(c, lo, hi)
            k += 1
    return out


def chunked_all_reduce(
    rows: int,
    n: int,
    like: torch.Tensor,
    group: dist.ProcessGroup | None,
    op: str,
    n_chunks: int,
    gemm: Callable[[int, int, torch.Tensor], None],
    after_issue: Callable[[], None] | None = None,
) -> torch.Tensor:
    """``[rows, n]`` computed by ``gemm(lo, hi, out_rows)`` chunk by chunk, each chunk all-reduced in flight.

    ``after_issue()`` runs once, after the last chunk's all-reduce is issued: work placed there (the
    weight gradient, in backward) hides the one transfer no later chunk's GEMM can hide.
    """
    out = like.new_empty((rows, n))
    pending = []
    chunks = row_chunks(rows, n_chunks)
    for j, (lo, hi) in enumerate(chunks):
        record_event("gemm", op, j)
        gemm(lo, hi, out[lo:hi])
        _, work = all_reduce(out[lo:hi], group, async_op=True)
        pending.append((j, work))
        record_event("send", op, j)
        if j == len(chunks) - 1 and after_issue is not None:
            after_issue()
    for j, work in pending:
        work.wait()
        record_event("wait", op, j)
    return out
