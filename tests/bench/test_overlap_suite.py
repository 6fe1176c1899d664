"""The overlap suite on a CPU: measured bytes equal the ring formulas and every communicating pass overlaps."""

import time

import pytest
import torch

import tessel.bench.overlap as overlap_bench
from tessel.bench.overlap import OPS, gemms_in_flight, ring_bytes, run_overlap_suite
from tessel.bench.runner import capture_graph
from tessel.bench.shapes import MatmulShape
from tests.multiprocess import REFERENCE_KERNELS, run_ranks


def test_gemms_in_flight_counts_gemms_between_a_send_and_its_wait():
    events = [("send", "op", 1), ("gemm", "op", 0), ("wait", "op", 1), ("gemm", "op", 1)]
    assert gemms_in_flight(events) == (1, 2)
    assert gemms_in_flight([("gemm", "op", 0)]) == (0, 1)


def test_ring_bytes_follow_the_ring_formulas():
    # t=4, m=2, n=3, k=5, fp32: all-gather of [8, 5] moves 3/4 of 160 bytes; all-reduce twice that of [8, 3].
    assert ring_bytes("all_gather_matmul", "forward", 4, 2, 3, 5, 4) == 120
    assert ring_bytes("matmul_all_reduce", "forward", 4, 2, 3, 5, 4) == 2 * 72
    assert ring_bytes("matmul_all_reduce", "backward", 4, 2, 3, 5, 4) == 0


@pytest.mark.multiprocess
def test_cpu_suite_reports_ring_bytes_and_overlapped_schedules():
    rows = run_overlap_suite(quick=True)
    assert {(r["op"], r["pass"]) for r in rows} == {(op, p) for op in OPS for p in ("forward", "backward")}
    for row in rows:
        assert row["tp"] == 2
        assert row["sent_bytes"] == row["ring_bytes"], row
        hidden, gemms = (int(v) for v in row["gemms_overlapped"].split("/"))
        if row["ring_bytes"]:  # every pass that communicates runs a GEMM while a transfer is in flight
            assert hidden >= 1, row
            assert gemms >= 2, row


@pytest.mark.gpu
def test_emulated_ring_rows_on_a_gpu(monkeypatch):
    """On one GPU each row holds the eager and graph-replayed times of the GEMM and of the ring, and the host
    time of one ring; the ring captured in a CUDA graph (side-stream copies, events) writes the full GEMM."""
    shape = MatmulShape("small", 1000, 384, 256)
    monkeypatch.setattr(overlap_bench, "matmul_shapes", lambda cuda, quick=False: (shape,))
    rows = run_overlap_suite(torch.bfloat16, quick=True)
    assert [r["tp"] for r in rows] == [2, 4, 8]
    for row in rows:
        for column in ("gemm_ms", "emulated_ring_ms", "ring_host_ms", "graph_gemm_ms", "graph_ring_ms"):
            assert row[column] > 0, (column, row)
        assert row["graph ring/gemm"] == pytest.approx(row["graph_ring_ms"] / row["graph_gemm_ms"])

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1000, 256, generator=gen, device="cuda").to(torch.bfloat16)
    w = torch.randn(384, 256, generator=gen, device="cuda").to(torch.bfloat16)
    out = torch.full((1000, 384), float("nan"), device="cuda", dtype=torch.bfloat16)
    graph, _ = capture_graph(overlap_bench._emulated_ring(x, w, out, 8))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = x.double() @ w.double().t()
    assert torch.isfinite(out).all()
    assert (out.double() - want).abs().max() / want.abs().max() < 2e-2


def test_ranks_time_the_same_number_of_calls():
    """Under torchrun every rank must issue the same collectives: the timer's call count is fixed, never adapted to
    how fast the calls were on one rank (which would leave the others waiting for collectives never issued)."""
    counts = []
    for delay in (0.0, 0.002):  # a fast rank and a slow one
        calls = []
        overlap_bench._time_together(lambda calls=calls, delay=delay: (calls.append(1), time.sleep(delay)))
        counts.append(len(calls))
    assert counts[0] == counts[1] == 5 + 3 * 20


def _time_ops_rank(rank, t):
    return {op: overlap_bench._time_ops(op, 8 * t, 12, 4 * t, t, None, torch.float32, device="cpu")
            for op in ("all_gather_matmul", "matmul_reduce_scatter")}  # fmt: skip


@pytest.mark.multiprocess
def test_torchrun_rows_time_every_way_to_run_both_ops_on_every_rank():
    """The several-GPU rows' timings run on gloo ranks too: the gathered GEMM, the collective, the ring, the plain
    path and the device-signalled transport, for the all-gather and the reduce-scatter GEMM."""
    for times in run_ranks(_time_ops_rank, 2, env=REFERENCE_KERNELS):
        for op_times in times.values():
            assert sorted(op_times) == ["comm", "gemm", "overlapped", "peer", "plain"]
            assert all(ms > 0 for ms in op_times.values())
