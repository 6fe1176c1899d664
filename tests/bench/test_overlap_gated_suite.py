"""The overlap-gated suite: the all-gather ring as one gated GEMM launch, and the GEMM pushing each chunk to a
destination of its own (the fused reduce-scatter's producer), checked against the plain GEMM."""

import pytest
import torch

import tessel.bench.overlap as overlap_bench
from tessel.bench.__main__ import ON_REQUEST, SUITES
from tessel.bench.overlap_gated import run_overlap_gated_suite
from tessel.bench.shapes import MatmulShape


def test_suite_runs_only_when_named():
    assert SUITES["overlap-gated"] is run_overlap_gated_suite and "overlap-gated" in ON_REQUEST


def test_cpu_rows_cover_every_ranks_arrival_order_and_match_the_plain_gemm():
    rows = run_overlap_gated_suite(quick=True)
    assert [(r["tp"], r["rank"]) for r in rows] == [(2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)]
    for row in rows:
        assert row["max_rel_err"] <= 1e-6 and row["pushed_max_rel_err"] <= 1e-6, row


@pytest.mark.gpu
@pytest.mark.timeout(240, method="thread")  # the kernel spins on flags: a missed one would hang, not fail
def test_gpu_rows_time_both_rings_and_the_gated_one_matches_the_gemm(monkeypatch):
    shape = MatmulShape("small", 1000, 384, 256)
    monkeypatch.setattr(overlap_bench, "matmul_shapes", lambda cuda, quick=False: (shape,))
    rows = run_overlap_gated_suite(torch.bfloat16, quick=True)
    assert [r["tp"] for r in rows] == [2, 4, 8]
    for row in rows:
        for column in ("gemm_ms", "ring_ms", "gated_ring_ms", "gated_host_ms", "pushed_ms"):
            assert row[column] > 0, (column, row)
        assert row["gated ring/gemm"] == pytest.approx(row["gated_ring_ms"] / row["gemm_ms"])
        assert row["max_rel_err"] < 2e-2 and row["pushed_max_rel_err"] < 2e-2, row
