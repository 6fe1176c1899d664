"""The decode benchmark suite on a CPU in quick mode: its rows, its byte counts and its correctness check."""

import math
import re

import pytest
import torch

import tessel.bench.decode as decode_bench
from tessel.bench.decode import COLUMNS, CPU_SPLITS, DecodeShape, decode_bytes, decode_shapes, run_decode_suite
from tessel.bench.matmul import BenchmarkError


def test_quick_cpu_rows():
    rows = run_decode_suite(None, quick=True)
    shapes = decode_shapes(cuda=False, quick=True)
    measured, (summary,) = rows[:-1], rows[-1:]
    assert [r["case"] for r in measured] == [s.label for s in shapes]
    for row, shape in zip(measured, shapes):
        assert tuple(row) == COLUMNS
        dims = (row["B"], row["Hq"], row["Hkv"], row["Sk"], row["D"])
        assert dims == (shape.b, shape.hq, shape.hkv, shape.sk, shape.d)
        assert row["dtype"] == "float32"
        # The interpreter is asked for CPU_SPLITS splits; 16-key tiles give as many over 100 keys.
        assert row["splits"] == CPU_SPLITS
        assert 0 <= row["max_rel_err"] <= 1e-4  # checked against SDPA before timing
        moved = decode_bytes(shape, torch.float32)
        assert row["tessel_GBps"] == pytest.approx(moved / (row["tessel_us"] * 1e-6) / 1e9)
        assert row["tessel/torch"] == pytest.approx(row["torch_us"] / row["tessel_us"])
        assert row["split/one_pass"] == pytest.approx(row["one_pass_us"] / row["tessel_us"])
        assert all(math.isfinite(row[c]) and row[c] > 0 for c in COLUMNS[9:16])
        # host and graph times exist on CUDA only: on a CPU the host does the work itself
        assert all(row[c] is None for c in COLUMNS[16:])
    assert summary["case"] == "geomean" and summary["B"] is None
    ratios = [r["tessel/torch"] for r in measured]
    assert summary["tessel/torch"] == pytest.approx(math.prod(ratios) ** (1 / len(ratios)))
    assert summary["graph tessel/torch"] is None


@pytest.mark.gpu
def test_gpu_rows_separate_the_hosts_time_from_the_kernels(monkeypatch):
    """On CUDA every row has the host time of a call and both graph replays: the decode step (split-KV
    kernels and their allocations) is captured in a CUDA graph."""
    shape = DecodeShape("small", 2, 8, 2, 1000, 64)
    monkeypatch.setattr(decode_bench, "decode_shapes", lambda cuda, quick=False: (shape,))
    (row, summary) = run_decode_suite(torch.bfloat16, quick=True)
    for column in COLUMNS[16:]:
        assert math.isfinite(row[column]) and row[column] > 0, (column, row)
    assert summary["graph tessel/torch"] == pytest.approx(row["graph tessel/torch"])
    assert row["graph tessel/torch"] == pytest.approx(row["torch_graph_us"] / row["tessel_graph_us"])


def test_byte_count():
    shape = DecodeShape("x", 2, 32, 8, 4096, 128)
    assert decode_bytes(shape, torch.bfloat16) == 2 * (2 * 2 * 8 * 4096 * 128 + 2 * 2 * 32 * 128)


@pytest.mark.parametrize("wrong", ["tessel", "one_pass"])
def test_a_wrong_result_stops_the_run(monkeypatch, wrong):
    flash_attention = decode_bench.flash_attention

    def off_by_a_bit(q, k, v, num_splits=None):
        out = flash_attention(q, k, v, num_splits=num_splits)
        return out * 1.01 if (num_splits == 1) == (wrong == "one_pass") else out

    monkeypatch.setattr(decode_bench, "flash_attention", off_by_a_bit)
    with pytest.raises(BenchmarkError, match=re.escape("decode suite: tiny-gqa")):
        run_decode_suite(torch.float32, quick=True)
