"""The loss benchmark suite on a CPU in quick mode: its rows, its memory figures and its correctness check."""

import math

import pytest

import tessel.bench.loss as loss_bench
from tessel.bench.loss import COLUMNS, LOSS_SHAPES_CPU, run_loss_suite
from tessel.bench.matmul import BenchmarkError


def test_quick_cpu_rows():
    rows = run_loss_suite(quick=True, device="cpu")
    assert [r["case"] for r in rows] == [s.label for s in LOSS_SHAPES_CPU if not s.extra]
    for row, shape in zip(rows, LOSS_SHAPES_CPU, strict=False):
        assert tuple(row) == COLUMNS and row["memory"] == "largest tensor" and row["chunk"] == shape.chunk
        numbers = [v for k, v in row.items() if k not in ("case", "dtype", "memory")]
        assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in numbers), row
        assert row["loss_rel_err"] <= 1e-5 and row["grad_rel_err"] <= 1e-4
        assert row["tessel/torch"] == pytest.approx(row["torch_ms"] / row["tessel_ms"])
        # torch's largest tensor is a [N, V] fp32 one; tessel's is a chunk of logits or the fp32 weight gradient.
        assert row["torch_MB"] * 2**20 >= shape.n * shape.v * 4
        assert row["logits_MB"] * 2**20 >= shape.n * shape.v * 4 and row["logits_ms"] > 0  # the logits, fp32 here
        largest = max(shape.chunk * shape.v, shape.v * shape.e, shape.n * shape.e) * 4
        assert row["tessel_MB"] * 2**20 <= largest
        assert row["torch/tessel memory"] == pytest.approx(row["torch_MB"] / row["tessel_MB"])


def test_a_wrong_loss_stops_the_suite(monkeypatch):
    real = loss_bench.linear_cross_entropy
    monkeypatch.setattr(loss_bench, "linear_cross_entropy", lambda *a, **k: real(*a, **k) * 1.001)
    with pytest.raises(BenchmarkError, match="loss suite: tiny: tessel differs from torch"):
        run_loss_suite(quick=True, device="cpu")
