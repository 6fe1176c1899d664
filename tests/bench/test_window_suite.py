"""The sliding-window benchmark suite on a CPU in quick mode: its rows, its figures and its correctness check."""

import math
import re

import pytest
import torch

import tessel.bench.window as window_bench
from tessel.bench.matmul import BenchmarkError
from tessel.bench.window import COLUMNS, PASSES, run_window_suite, window_flops, window_pairs, window_shapes


def test_quick_cpu_rows():
    rows = run_window_suite(None, quick=True)
    measured = [r for r in rows if r["case"] != "geomean"]
    shapes = window_shapes(cuda=False, quick=True)
    assert [(r["case"], r["pass"]) for r in measured] == [(s.label, p) for s in shapes for p in PASSES]
    for row, shape in zip(measured, [s for s in shapes for _ in PASSES]):
        assert tuple(row) == COLUMNS
        assert (row["B"], row["H"], row["S"], row["D"], row["window"]) == (shape.b, shape.h, shape.s, shape.d,
                                                                           shape.window)  # fmt: skip
        assert row["dtype"] == "float32" and row["torch_impl"] == "sdpa-mask" and row["tessel_of_peak"] is None
        assert 0 <= row["max_rel_err"] <= 1e-4  # checked against torch's masked attention
        assert min(row["tessel_ms"], row["torch_ms"], row["causal_ms"]) > 0
        assert row["tessel_tflops"] == pytest.approx(window_flops(shape, row["pass"]) / row["tessel_ms"] / 1e9)
        assert row["window_speedup"] == pytest.approx(row["causal_ms"] / row["tessel_ms"])
        assert all(math.isfinite(row[k]) for k in ("tessel_tflops", "torch_tflops", "tessel/torch"))
    geomeans = rows[len(measured) :]
    assert [(r["case"], r["pass"]) for r in geomeans] == [("geomean", p) for p in PASSES]


def test_pair_and_flop_counts():
    # brute force over the causal band
    for s, w in ((10, 3), (64, 16), (5, 9), (7, 1)):
        assert window_pairs(s, w) == sum(1 for i in range(s) for j in range(s) if 0 <= i - j < w)
    shape = window_bench.WindowShape("x", 4, 32, 4096, 128, 1024)
    fwd = 4 * 4 * 32 * 128 * (1024 * 1025 // 2 + 3072 * 1024)
    assert window_flops(shape, "fwd") == fwd and window_flops(shape, "fwd+bwd") == 3.5 * fwd


@pytest.mark.parametrize("wrong_pass", PASSES)
def test_a_wrong_window_stops_the_suite(monkeypatch, wrong_pass):
    flash_attention = window_bench.flash_attention

    def off(q, k, v, causal, window=None):
        if window is None:  # the full causal attention timed beside the window is left alone
            return flash_attention(q, k, v, causal)
        if wrong_pass == "fwd":  # a window one key short
            return flash_attention(q, k, v, causal, window=window - 1)
        out = flash_attention(q, k, v, causal, window=window)
        return out + 0.01 * (out - out.detach())  # the output right, its gradient 1% off

    monkeypatch.setattr(window_bench, "flash_attention", off)
    with pytest.raises(BenchmarkError, match=re.escape(f"attention suite: tiny-w16 {wrong_pass} window=16")):
        run_window_suite(torch.float32, quick=True)


def test_a_failing_flex_attention_falls_back_to_masked_sdpa(monkeypatch, capsys):
    """On CUDA torch's side is FlexAttention, compiled on a first forward and backward; if that fails the
    suite times masked SDPA and the rows say so (here with a stand-in FlexAttention on the CPU)."""
    shape = window_bench.WindowShape("x", 1, 2, 24, 16, 5)
    probe = window_bench.make_inputs(shape, torch.float32, "cpu")

    def broken(q, k, v):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(window_bench, "_flex_fn", lambda shape, device: broken)
    impl, fn = window_bench.torch_window_attention(shape, True, "cpu", probe)
    assert impl == "sdpa-mask (flex failed)" and "RuntimeError: no compiler" in capsys.readouterr().err
    want = window_bench.flash_attention(*probe[:3], causal=True, window=5)
    torch.testing.assert_close(fn(*probe[:3]), want)
    masked = window_bench._masked_sdpa_fn(shape, "cpu")
    monkeypatch.setattr(window_bench, "_flex_fn", lambda shape, device: masked)
    assert window_bench.torch_window_attention(shape, True, "cpu", probe)[0] == "flex"
