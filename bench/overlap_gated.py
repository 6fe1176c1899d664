"""The all-gather ring as one GEMM launch, against the ring of one launch per chunk (``overlap-gated``).

The overlap suite's emulated ring launches one GEMM per chunk; where a chunk's GEMM is short, each step costs
more than its GEMM (host work per launch, and chunks too small to fill the SMs). Here the same ring runs as one
launch of :func:`~tessel.kernels.gated_matmul.gated_matmul`: the kernel starts on this rank's shard while a side
stream copies the other shards in (from a buffer standing for the peers, as the overlap suite emulates them)
and sets each one's flag after its copy; the kernel's programs wait for a shard's flag before reading it.

- **One GPU**: per matmul-suite shape and tp ∈ {2, 4, 8}, the unchunked GEMM, the per-chunk ring and the gated
  ring, each ring relative to the GEMM (target ≤ 1.05×), the gated ring's host time per call (see the overlap
  suite's ``ring_host_ms``), and its largest error relative to the unchunked GEMM's output. Beside them the
  reduce-scatter's producer half: the GEMM storing each chunk into a destination of its own (separate buffers
  standing for the owners' slots) and raising its flag (``pushed_ms``, its error), what the fused reduce-scatter
  of :mod:`tessel.parallel.peer` costs the GEMM before any link.
- **CPU**: nothing runs concurrently, so the shards are copied and flagged first and the gated GEMM runs after
  (Triton's interpreter); rows report the error against the plain GEMM for every rank's arrival order, no time.

A diagnostic, run when named (``python -m tessel.bench overlap-gated``): its kernel spins on flags, so a GPU
session runs it as a step of its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..kernels.gated_matmul import gated_matmul, gated_matmul_unchecked
from ..kernels.matmul import matmul
from .matmul import max_rel_error
from .overlap import CPU_SHAPE, _emulated_ring, emulated_inputs
from .runner import host_time, time_fn

__all__ = ["gated_emulated_ring", "pushed_gemm", "run_overlap_gated_suite"]


def gated_emulated_ring(x_full: torch.Tensor, w: torch.Tensor, out: torch.Tensor, t: int) -> Callable[[], None]:
    """One call runs the emulated all-gather ring (rank 0's order) as one gated GEMM launch into ``out``.

    ``x_full`` holds this rank's shard in rows ``[0, m)``; each call copies the other shards into their rows from
    a copy standing for the peers, on a side stream, each copy followed by its flag, enqueued after the launch.
    """
    m = x_full.shape[0] // t
    peers = x_full.clone()
    rows = [(x_full[s * m : (s + 1) * m], peers[s * m : (s + 1) * m]) for s in range(t)]
    ready = torch.zeros(t, dtype=torch.int32, device=x_full.device)
    flags = [ready[s : s + 1] for s in range(t)]
    b = w.t()
    side = torch.cuda.Stream()
    flags[0].fill_(1)  # the producers' kernel loaded before any gated launch spins (see gated_matmul's notes)
    torch.cuda.synchronize()

    def run():
        compute = torch.cuda.current_stream()
        ready.zero_()
        side.wait_stream(compute)  # flags cleared; the previous call's GEMM has read the rows the copies rewrite
        gated_matmul_unchecked(x_full, b, ready, t, 0, 1, out)
        with torch.cuda.stream(side):  # after the launch, as a ring issues its transfers
            for s in range(1, t):
                rows[s][0].copy_(rows[s][1], non_blocking=True)
                flags[s].fill_(1)
        compute.wait_stream(side)

    return run


def pushed_gemm(x: torch.Tensor, w: torch.Tensor, t: int, first: int = 1) -> tuple[Callable[[], None], list]:
    """``(run, destinations)``: one call multiplies ``x @ wᵀ`` in one launch, chunk ``first`` first, storing chunk
    ``c``'s rows into ``destinations[c]`` (a buffer of its own) and raising chunk ``c``'s flag once they are all
    stored, as the fused reduce-scatter does with the owners' slots."""
    m = x.shape[0] // t
    dests = [x.new_empty((m, w.shape[0])) for _ in range(t)]
    done = [torch.zeros(1, dtype=torch.int32, device=x.device) for _ in range(t)]
    b = w.t()
    return (lambda: gated_matmul_unchecked(x, b, None, t, first % t, 1, dests, done=done)), dests


def _gpu_rows(dtype: torch.dtype, quick: bool) -> list[dict]:
    rows = []
    for shape, x_full, w, out in emulated_inputs(dtype, quick):
        t_gemm = time_fn(lambda x_full=x_full, w=w, out=out: matmul(x_full, w.t(), out=out))
        expected = out.clone()
        for t in (2, 4, 8):
            if shape.m % t:
                continue
            ring, gated = _emulated_ring(x_full, w, out, t), gated_emulated_ring(x_full, w, out, t)
            out.fill_(float("nan"))
            gated()
            torch.cuda.synchronize()
            err = max_rel_error(out, expected)
            pushed, dests = pushed_gemm(x_full, w, t)
            pushed()
            torch.cuda.synchronize()
            push_err = max_rel_error(torch.cat(dests), expected)
            t_ring, t_gated, t_pushed = time_fn(ring), time_fn(gated), time_fn(pushed)
            rows.append({
                "case": shape.name, "tp": t, "gemm_ms": t_gemm, "ring_ms": t_ring, "gated_ring_ms": t_gated,
                "ring/gemm": t_ring / t_gemm, "gated ring/gemm": t_gated / t_gemm, "gated_host_ms": host_time(gated),
                "max_rel_err": err, "pushed_ms": t_pushed, "pushed/gemm": t_pushed / t_gemm,
                "pushed_max_rel_err": push_err, "target": "<= 1.05",
            })  # fmt: skip
    return rows


def _cpu_rows(dtype: torch.dtype) -> list[dict]:
    """Every rank's ring order on a small problem: the shards flagged as they are copied in, then the gated GEMM."""
    m, n, k = CPU_SHAPE
    rows = []
    for t in (2, 4):
        peers = torch.randn(t * m, k, dtype=dtype)
        w = torch.randn(n, k, dtype=dtype)
        expected = matmul(peers, w.t())
        for rank in range(t):
            x_full = torch.full_like(peers, float("nan"))
            ready = torch.zeros(t, dtype=torch.int32)
            for s in range(t):  # the ring's arrival order on this rank: its own shard, then r-1, r-2, ...
                c = (rank - s) % t
                x_full[c * m : (c + 1) * m] = peers[c * m : (c + 1) * m]
                ready[c] = 1
            out = gated_matmul(x_full, w.t(), ready, chunks=t, first=rank, step=t - 1)
            err = max_rel_error(out, expected)
            pushed, dests = pushed_gemm(peers, w, t, rank + 1)  # the reduce-scatter's order on this rank
            pushed()
            push_err = max_rel_error(torch.cat(dests), expected)
            rows.append({"case": f"{t * m}x{n}x{k}", "tp": t, "rank": rank, "max_rel_err": err,
                         "pushed_max_rel_err": push_err})  # fmt: skip
    return rows


def run_overlap_gated_suite(dtype: torch.dtype | None = None, quick: bool = False) -> list[dict]:
    """Rows for the hardware present (see the module docstring)."""
    cuda = torch.cuda.is_available()
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    return _gpu_rows(dtype, quick) if cuda else _cpu_rows(dtype)
