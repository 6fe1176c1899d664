"""The adam benchmark suite on a CPU in quick mode: its rows, its figures and its correctness check."""

import math

import pytest
import torch

import tessel.bench.adam as adam_bench
from tessel.bench.adam import COLUMNS, adam_shards, bytes_per_element, run_adam_suite
from tessel.bench.matmul import BenchmarkError


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_quick_cpu_rows(dtype):
    rows = run_adam_suite(dtype, quick=True, device="cpu")
    assert [(r["case"], r["n"]) for r in rows] == adam_shards(cuda=False, quick=True)
    expected_dtype = dtype or torch.float32
    for row in rows:
        assert tuple(row) == COLUMNS
        assert row["dtype"] == str(expected_dtype).removeprefix("torch.")
        assert row["bytes_per_elem"] == bytes_per_element(expected_dtype) == (28 if dtype else 32)
        numbers = [v for k, v in row.items() if k not in ("case", "dtype")]
        assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in numbers), row
        # The check ran and passed: errors recorded and within the suite's tolerances.
        assert 0 <= row["max_rel_err"] <= 1e-5 and 0 <= row["ref_rel_err"] <= 1e-5
        assert 0 <= row["copy_rel_err"] <= 1e-2
        assert min(row["tessel_ms"], row["torch_ms"], row["copy_ms"]) > 0
        assert row["tessel/torch"] == pytest.approx(row["torch_ms"] / row["tessel_ms"])
        assert row["tessel_GBps"] == pytest.approx(row["bytes_per_elem"] * row["n"] / row["tessel_ms"] / 1e6)
        assert row["tessel_of_copy"] == pytest.approx(row["tessel_GBps"] / row["copy_GBps"])


def test_a_wrong_step_stops_the_suite(monkeypatch):
    def off_by_a_bit(param, *args, **kwargs):
        adam_bench.adam_step_reference(param, *args, **kwargs)
        param.mul_(1.001)

    monkeypatch.setattr(adam_bench, "adam_step", off_by_a_bit)
    with pytest.raises(BenchmarkError, match="adam suite: n=4099: tessel's step differs"):
        run_adam_suite(None, quick=True, device="cpu")
