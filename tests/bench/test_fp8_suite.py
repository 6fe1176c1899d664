"""The fp8 benchmark suite on a CPU in quick mode: its rows, its figures and its correctness check."""

import math

import pytest

import tessel.bench.fp8 as fp8_bench
from tessel.bench.experts import expert_shapes
from tessel.bench.fp8 import COLUMNS, OPS, run_fp8_suite
from tessel.bench.matmul import BenchmarkError
from tessel.bench.shapes import matmul_shapes


def test_quick_cpu_rows():
    rows = run_fp8_suite(None, quick=True)
    gemm_ops = [op for op in OPS if op != "experts"]
    cases = [(s.label, op) for s in matmul_shapes(cuda=False, quick=True) for op in gemm_ops]
    cases += [(s.label, "experts") for s in expert_shapes(cuda=False, quick=True)]
    assert [(r["case"], r["op"]) for r in rows] == [*cases, *(("geomean", op) for op in OPS)]
    for row in rows[: -len(OPS)]:
        assert tuple(row) == COLUMNS
        # The check ran and passed: the GEMMs agree with the float64 product of the same fp8 values to bf16's
        # rounding, the layers with bf16's to fp8's precision.
        assert 0 <= row["max_rel_err"] <= (0.15 if row["op"] in ("linear", "experts") else 1.6e-2), row
        assert min(row["tessel_ms"], row["torch_ms"]) > 0
        flops = 2 * row["M"] * row["N"] * row["K"] * (3 if row["op"] in ("linear", "experts") else 1)
        assert row["tessel_tflops"] == pytest.approx(flops / row["tessel_ms"] / 1e9)
        assert row["tessel/torch"] == pytest.approx(row["torch_ms"] / row["tessel_ms"])
        assert row["tessel_of_peak"] is None  # no GPU, no peak
        assert (row["program"] is None) == (row["op"] in ("linear", "experts"))
    for row, op in zip(rows[-len(OPS) :], OPS):
        assert row["op"] == op and math.isfinite(row["tessel/torch"])


def test_a_wrong_gemm_stops_the_suite(monkeypatch):
    real = fp8_bench.fp8_matmul

    def off_by_a_bit(*args, **kwargs):
        return real(*args, **kwargs) * 1.05

    monkeypatch.setattr(fp8_bench, "fp8_matmul", off_by_a_bit)
    with pytest.raises(BenchmarkError, match=r"fp8 suite: gemm on cube-128 128x128x128: tessel differs"):
        run_fp8_suite(None, quick=True)
