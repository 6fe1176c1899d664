"""The experts benchmark suite on a CPU in quick mode: its rows, its figures and its correctness check."""

import math

import pytest
import torch

import tessel.bench.experts as experts_bench
from tessel.bench.experts import COLUMNS, expert_shapes, make_inputs, run_experts_suite
from tessel.bench.matmul import BenchmarkError


def test_quick_cpu_rows():
    rows = run_experts_suite(None, quick=True)
    shapes = expert_shapes(cuda=False, quick=True)
    assert [(r["case"], r["pass"]) for r in rows[:-1]] == [(s.label, p) for s in shapes for p in ("fwd", "wgrad")]
    for row in rows[:-1]:
        assert tuple(row) == COLUMNS and row["dtype"] == "float32"
        baseline = ("grouped_mm_ms", "tessel/grouped_mm")
        numbers = [v for k, v in row.items() if k not in ("case", "pass", "dtype", *baseline)]
        assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in numbers), row
        if row["grouped_mm_ms"] is None:  # torch's grouped GEMM refused these operands (CPU: 16-byte strides)
            assert row["tessel/grouped_mm"] is None and row["pass"] == "wgrad", row
        else:
            assert row["tessel/grouped_mm"] == pytest.approx(row["grouped_mm_ms"] / row["tessel_ms"])
        assert 0 <= row["max_rel_err"] <= 1e-4  # the check ran and passed
        flops = 2 * row["rows"] * row["k"] * row["n"]
        assert row["tessel_TFLOPs"] == pytest.approx(flops / row["tessel_ms"] / 1e9)
        assert row["tessel/torch"] == pytest.approx(row["torch_ms"] / row["tessel_ms"])
    assert rows[-1]["case"] == "geomean" and rows[-1]["tessel/torch"] > 0 and rows[-1]["tessel/grouped_mm"] > 0


def test_rows_spread_over_every_expert():
    shape = expert_shapes(cuda=False)[-1]
    a, w, g, offsets, bounds = make_inputs(shape, torch.float32, "cpu")
    assert g.shape == (shape.rows, shape.n)
    counts = torch.tensor(bounds).diff()
    assert bounds[0] == 0 and bounds[-1] == shape.rows and (counts > 0).all() and offsets.tolist() == bounds
    assert a.shape == (shape.rows, shape.k) and w.shape == (shape.experts, shape.n, shape.k)


def test_a_wrong_kernel_stops_the_suite(monkeypatch):
    def off(a, b, offsets):
        return experts_bench.grouped_matmul_reference(a, b, offsets) * 1.01

    monkeypatch.setattr(experts_bench, "grouped_matmul", off)
    with pytest.raises(BenchmarkError, match="experts suite: odd-4 fwd: a result differs from the reference"):
        run_experts_suite(None, quick=True)


def test_torch_grouped_gemm_baseline_is_checked_too(monkeypatch):
    """torch's grouped GEMM joins the correctness check: a baseline that computes something else stops the suite."""
    real = experts_bench.grouped_mm_cases

    def off(*args):
        return {name: (lambda fn=fn: fn() * 1.01) for name, fn in real(*args).items()}

    monkeypatch.setattr(experts_bench, "grouped_mm_cases", off)
    with pytest.raises(BenchmarkError, match="experts suite: odd-4 fwd: a result differs from the reference"):
        run_experts_suite(None, quick=True)
