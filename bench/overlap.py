"""The overlap suite: what the chunked tensor-parallel schedules move and hide, and what they cost.

Three settings, chosen by what is present:

- **CPU** (no GPU): ``tp`` gloo ranks are spawned on this machine and each overlapped op runs forward and
  backward on a small problem. Rows report what is hardware-independent: the bytes each rank sent
  (measured by :func:`~tessel.parallel.comm.count_bytes`) against the ring formula ((t-1)/t·|X| for
  all-gather and reduce-scatter, 2(t-1)/t·|X| for all-reduce), and the schedule recorded by
  :func:`~tessel.parallel.comm.record_events`, with the number of GEMMs that ran while a transfer was
  in flight. No speed is reported.
- **One GPU**: the ring's stream structure with its peers emulated by local buffers — each step's
  GEMM runs on the compute stream while the next chunk is copied on a side stream (standing in for
  the link), ordered by events. The time is reported relative to one unchunked GEMM of the same total
  size (the cost of chunking, target ≤ 1.05×) for tp ∈ {2, 4, 8} at the matmul suite's shapes.
  ``ring_host_ms`` is the host time of one ring issued without waiting for the GPU: where it reaches
  ``emulated_ring_ms`` the GPU waits for the host's launches. ``graph_gemm_ms`` / ``graph_ring_ms`` replay
  both captured in CUDA graphs (as a captured training step runs them: the steps' launches cost no host
  time), and ``graph ring/gemm`` is what chunking costs the GPU itself.
- **Several GPUs under torchrun** (``torchrun --nproc_per_node=N -m tessel.bench overlap``): the real
  ops on NCCL (``all_gather_matmul`` and ``matmul_reduce_scatter``). Overlap efficiency
  ``(T_gemm + T_comm − T_overlapped) / min(T_gemm, T_comm)`` (1: the shorter of the two is fully hidden;
  0: nothing is) and the speed-up over the plain path (one collective, then one GEMM); the same two for the
  device-signalled transport (``peer_*``: the ops of :mod:`tessel.parallel.peer`, writes into the peers' memory
  around one GEMM launch). Every rank times the same number of calls.
"""

from __future__ import annotations

import itertools
import os
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..kernels.matmul import matmul, matmul_unchecked
from ..parallel.comm import all_gather, count_bytes, record_events, reduce_scatter
from ..parallel.overlap import all_gather_matmul, matmul_all_reduce, matmul_grad_all_reduce, matmul_reduce_scatter
from ..parallel.peer import PeerAllGather, PeerReduceScatter, peer_all_gather_matmul, peer_matmul_reduce_scatter
from .runner import graph_time, host_time, time_fn
from .shapes import matmul_shapes

__all__ = ["OPS", "gemms_in_flight", "ring_bytes", "run_overlap_suite"]

OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "matmul_grad_all_reduce")
CPU_SHAPE = (24, 40, 32)  # rows per rank m, N, K: small and not multiples of the interpreter's blocks


# ---------------------------------------------------------------------------------------------------- formulas


def ring_bytes(op: str, direction: str, t: int, m: int, n: int, k: int, elem: int) -> int:
    """Bytes one rank sends in ``op``'s ``direction`` ("forward"/"backward") by the ring formulas.

    Shapes as the ops take them with ``t·m`` tokens: all-gather of the ``[t·m, K]`` input (forward) and
    reduce-scatter of its gradient (backward); reduce-scatter of the ``[t·m, N]`` output and all-gather
    of its gradient; all-reduce of the ``[t·m, N]`` output (its backward moves nothing); all-reduce of
    the ``[t·m, K]`` input gradient (its forward moves nothing).
    """
    ring = lambda numel: (t - 1) * numel * elem // t
    x_full, y_full = t * m * k, t * m * n
    table = {
        ("all_gather_matmul", "forward"): ring(x_full),
        ("all_gather_matmul", "backward"): ring(x_full),
        ("matmul_reduce_scatter", "forward"): ring(y_full),
        ("matmul_reduce_scatter", "backward"): ring(y_full),
        ("matmul_all_reduce", "forward"): 2 * ring(y_full),
        ("matmul_all_reduce", "backward"): 0,
        ("matmul_grad_all_reduce", "forward"): 0,
        ("matmul_grad_all_reduce", "backward"): 2 * ring(x_full),
    }
    return table[(op, direction)]


def gemms_in_flight(events: list[tuple[str, str, int]]) -> tuple[int, int]:
    """``(GEMMs issued while a transfer was in flight, all GEMMs)`` of a recorded schedule.

    A transfer is in flight from its ``send`` event until the ``wait`` of the same step.
    """
    in_flight, hidden, gemms = set(), 0, 0
    for kind, _, step in events:
        if kind == "send":
            in_flight.add(step)
        elif kind == "wait":
            in_flight.discard(step)
        elif kind == "gemm":
            gemms += 1
            hidden += bool(in_flight)
    return hidden, gemms


def _schedule(events: list[tuple[str, str, int]]) -> str:
    short = {"send": "s", "gemm": "g", "wait": "w", "wgrad": "dW"}
    return " ".join(f"{short.get(kind, kind)}{step}" for kind, _, step in events)


# ---------------------------------------------------------------------------------------------------- CPU: gloo ranks


def _run_op(op: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if op == "all_gather_matmul":
        return all_gather_matmul(x, w, None, overlap=True)
    if op == "matmul_reduce_scatter":
        return matmul_reduce_scatter(x, w, None, overlap=True)
    if op == "matmul_all_reduce":
        return matmul_all_reduce(x, w, None, overlap=True)
    return matmul_grad_all_reduce(x, w, None, overlap=True)


def _rank_rows(t: int, dtype: torch.dtype) -> list[dict]:
    """Every op forward and backward on this rank; the rows (this rank's measurements)."""
    m, n, k = CPU_SHAPE
    gen = torch.Generator().manual_seed(dist.get_rank())
    rows = []
    for op in OPS:
        rows_in = m if op == "all_gather_matmul" else t * m
        k_in = k // t if op in ("matmul_reduce_scatter", "matmul_all_reduce") else k
        x = torch.randn(rows_in, k_in, generator=gen, dtype=dtype).requires_grad_()
        w = torch.randn(n, k_in, generator=gen, dtype=dtype).requires_grad_()
        with record_events() as fwd_log, count_bytes() as fwd_bytes:
            y = _run_op(op, x, w)
        with record_events() as bwd_log, count_bytes() as bwd_bytes:
            y.backward(torch.randn(y.shape, generator=gen, dtype=dtype))
        for direction, log, counted in (("forward", fwd_log, fwd_bytes), ("backward", bwd_log, bwd_bytes)):
            hidden, gemms = gemms_in_flight(log.events)
            formula = ring_bytes(op, direction, t, m, n, k_in if op != "all_gather_matmul" else k, x.element_size())
            rows.append({
                "op": op, "pass": direction, "tp": t, "sent_bytes": counted.sent, "ring_bytes": formula,
                "sent/ring": counted.sent / formula if formula else None,
                "gemms_overlapped": f"{hidden}/{gemms}", "schedule": _schedule(log.events),
            })  # fmt: skip
    return rows


def _rank_main(rank: int, t: int, port: int, dtype: torch.dtype, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=t)
    try:
        rows = _rank_rows(t, dtype)
        dist.barrier()
        if rank == 0:
            results.put(rows)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_rows(dtype: torch.dtype, quick: bool) -> list[dict]:
    rows = []
    ctx = mp.get_context("spawn")
    for t in (2,) if quick else (2, 4):
        results = ctx.SimpleQueue()
        ranks = mp.start_processes(
            _rank_main, args=(t, _free_port(), dtype, results), nprocs=t, join=False, start_method="spawn"
        )
        rows += results.get()  # before joining: a child cannot exit while its result fills the pipe
        while not ranks.join():
            pass
    return rows


# -------------------------------------------------------------------------------------------- one GPU: emulated peers


def _emulated_ring(x_full: torch.Tensor, w: torch.Tensor, out: torch.Tensor, t: int) -> Callable[[], None]:
    """The all-gather ring's streams on one GPU: chunk s's GEMM while chunk s+1 is copied on a side stream.

    ``x_full`` stands for the peers' shards (rank-ordered rows); each step copies the next shard into one
    of two receive buffers — as the ring's ``irecv`` fills them — and the compute stream waits on the copy's
    event only after issuing the GEMM it overlaps.
    """
    m = x_full.shape[0] // t
    shards = x_full.view(t, m, -1)
    recv = [torch.empty_like(shards[0]) for _ in range(2)]
    side = torch.cuda.Stream()

    def run():
        compute = torch.cuda.current_stream()
        current = shards[0]
        for s in range(t):
            if s + 1 < t:
                nxt = recv[s % 2]
                side.wait_stream(compute)  # the buffer's previous reader (step s-1's GEMM) has finished
                with torch.cuda.stream(side):
                    nxt.copy_(shards[s + 1], non_blocking=True)
                arrived = side.record_event()
            matmul_unchecked(current, w.t(), out=out[s * m : (s + 1) * m])  # as the ops' ring steps
            if s + 1 < t:
                compute.wait_event(arrived)
                current = nxt

    return run


def emulated_inputs(dtype: torch.dtype, quick: bool):
    """``(shape, x_full [M, K], w [N, K], out [M, N])`` on the GPU for each matmul-suite shape the ops chunk."""
    for shape in matmul_shapes(True, quick):
        if shape.m < 64:
            continue  # decode-sized GEMMs are not chunked by the ops
        x_full = torch.randn(shape.m, shape.k, device="cuda", dtype=dtype)
        w = torch.randn(shape.n, shape.k, device="cuda", dtype=dtype)
        yield shape, x_full, w, torch.empty(shape.m, shape.n, device="cuda", dtype=dtype)


def _gpu_emulated_rows(dtype: torch.dtype, quick: bool) -> list[dict]:
    rows = []
    for shape, x_full, w, out in emulated_inputs(dtype, quick):
        gemm = lambda x_full=x_full, w=w, out=out: matmul(x_full, w.t(), out=out)
        t_gemm, g_gemm = time_fn(gemm), graph_time(gemm, label=f"gemm {shape.name}")
        for t in (2, 4, 8):
            ring = _emulated_ring(x_full, w, out, t)
            t_ring, g_ring = time_fn(ring), graph_time(ring, label=f"ring {shape.name} tp {t}")
            rows.append({
                "case": shape.name, "tp": t, "gemm_ms": t_gemm, "emulated_ring_ms": t_ring,
                "ring/gemm": t_ring / t_gemm, "ring_host_ms": host_time(ring), "graph_gemm_ms": g_gemm,
                "graph_ring_ms": g_ring, "graph ring/gemm": None if None in (g_gemm, g_ring) else g_ring / g_gemm,
                "target": "<= 1.05",
            })  # fmt: skip
    return rows


# ------------------------------------------------------------------------------------------------ GPUs under torchrun


def _time_together(fn: Callable[[], object], warmup: int = 5, calls: int = 20, reps: int = 3) -> float:
    """Milliseconds per ``fn()``: the median over ``reps`` runs of ``calls`` calls (timed by CUDA events on a GPU,
    by the host's clock on a CPU). Every rank
    makes the same number of calls: an adaptive count (``do_bench``'s) would leave ranks waiting in collectives
    their peers never issue."""
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        if cuda:
            end.record()
            end.synchronize()
        ms = start.elapsed_time(end) if cuda else (time.perf_counter() - began) * 1e3
        times.append(ms / calls)
    return statistics.median(times)


def _time_ops(op: str, m: int, n: int, k: int, t: int, group, dtype: torch.dtype, device="cuda") -> dict[str, float]:
    """Each way to run ``op`` at the gathered shape ``m×n×k`` on ``t`` ranks, and its parts alone."""
    randn = lambda *shape: torch.randn(*shape, device=device, dtype=dtype)
    if op == "all_gather_matmul":
        x, w, x_full = randn(m // t, k), randn(n, k), randn(m, k)
        peer = PeerAllGather(m // t, k, dtype, group, device=device)
        calls = {
            "gemm": lambda: matmul(x_full, w.t()), "comm": lambda: all_gather(x, group, out=x_full),
            "overlapped": lambda: all_gather_matmul(x, w, group, overlap=True),
            "plain": lambda: all_gather_matmul(x, w, group, overlap=False),
            "peer": lambda: peer_all_gather_matmul(x, w, peer),
        }  # fmt: skip
    else:
        x, w, y = randn(m, k // t), randn(n, k // t), randn(m, n)
        peer = PeerReduceScatter(m // t, n, dtype, group, device=device)
        calls = {
            "gemm": lambda: matmul(x, w.t(), out=y), "comm": lambda: reduce_scatter(y, group),
            "overlapped": lambda: matmul_reduce_scatter(x, w, group, overlap=True),
            "plain": lambda: matmul_reduce_scatter(x, w, group, overlap=False),
            "peer": lambda: peer_matmul_reduce_scatter(x, w, peer),
        }  # fmt: skip
    return {name: _time_together(call) for name, call in calls.items()}


def _multi_gpu_rows(dtype: torch.dtype, quick: bool) -> list[dict]:
    from ..parallel.dims import init_parallel

    dims = init_parallel(tp=int(os.environ["WORLD_SIZE"]))
    group, t = dims.tp_group, dims.tp
    rows = []
    for shape, op in itertools.product(matmul_shapes(True, quick), ("all_gather_matmul", "matmul_reduce_scatter")):
        if shape.m < 64 or shape.m % t or shape.k % t:
            continue
        times = _time_ops(op, shape.m, shape.n, shape.k, t, group, dtype)
        efficiency = lambda name, times=times: (
            (times["gemm"] + times["comm"] - times[name]) / min(times["gemm"], times["comm"])
        )
        rows.append({
            "case": shape.name, "op": op, "tp": t, **{f"{k}_ms": v for k, v in times.items()},
            "efficiency": efficiency("overlapped"), "speedup_vs_plain": times["plain"] / times["overlapped"],
            "peer_efficiency": efficiency("peer"), "peer_speedup_vs_plain": times["plain"] / times["peer"],
        })  # fmt: skip
    return rows if dims.rank == 0 else None


def run_overlap_suite(dtype: torch.dtype | None = None, quick: bool = False) -> list[dict] | None:
    """Rows for the hardware present (see the module docstring); None on the ranks other than 0 of torchrun."""
    cuda = torch.cuda.is_available()
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    if cuda and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return _multi_gpu_rows(dtype, quick)
    if cuda:
        return _gpu_emulated_rows(dtype, quick)
    return _cpu_rows(dtype, quick)
