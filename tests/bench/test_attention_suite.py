"""The attention benchmark suite on a CPU in quick mode: its rows, its figures and its correctness check."""

import importlib
import math
import re

import pytest
import torch
import triton

import tessel.bench.attention as attention_bench
from tessel.bench.attention import COLUMNS, PASSES, attention_flops, attention_shapes, run_attention_suite
from tessel.bench.matmul import BenchmarkError


def test_quick_cpu_rows():
    rows = run_attention_suite(None, quick=True)
    measured = [r for r in rows if r["case"] != "geomean"]
    shapes = attention_shapes(cuda=False, quick=True)
    assert [(r["case"], r["causal"], r["pass"]) for r in measured] == [
        (s.label, causal, p) for s in shapes for causal in (False, True) for p in PASSES
    ]
    for row, shape in zip(measured, [s for s in shapes for _ in range(2 * len(PASSES))]):
        assert tuple(row) == COLUMNS
        assert (row["B"], row["H"], row["S"], row["D"]) == (shape.b, shape.h, shape.s, shape.d)
        assert row["dtype"] == "float32" and row["torch_backend"] == "default" and row["tessel_of_peak"] is None
        assert row["programs"] == "interpreter"
        # The check ran and passed: the error against SDPA is recorded and within fp32's tolerance.
        assert 0 <= row["max_rel_err"] <= 1e-4
        assert min(row["tessel_ms"], row["torch_ms"]) > 0
        flops = attention_flops(shape, row["causal"], row["pass"])
        assert row["tessel_tflops"] == pytest.approx(flops / row["tessel_ms"] / 1e9)
        assert row["tessel/torch"] == pytest.approx(row["torch_ms"] / row["tessel_ms"])
        numbers = [row[k] for k in ("max_rel_err", "tessel_ms", "torch_ms", "tessel_tflops", "torch_tflops")]
        assert all(math.isfinite(v) for v in numbers)
    geomeans = rows[len(measured) :]
    assert [r["case"] for r in geomeans] == ["geomean"] * len(PASSES) and [r["pass"] for r in geomeans] == list(PASSES)
    assert all(r["tessel/torch"] > 0 for r in geomeans)


def test_flop_counts():
    shape = attention_bench.AttentionShape("x", 4, 32, 1024, 128)
    fwd = 4 * 4 * 32 * 1024**2 * 128
    assert attention_flops(shape, False, "fwd") == fwd
    assert attention_flops(shape, True, "fwd") == fwd / 2
    assert attention_flops(shape, False, "fwd+bwd") == 3.5 * fwd
    assert attention_flops(shape, True, "fwd+bwd-atomic") == 3.5 * fwd / 2
    assert attention_flops(shape, False, "bwd") == attention_flops(shape, False, "bwd-atomic") == 2.5 * fwd


@pytest.mark.parametrize("wrong_pass", PASSES)
def test_a_wrong_kernel_stops_the_suite(monkeypatch, wrong_pass):
    flash_attention = attention_bench.flash_attention

    def off_by_a_bit(q, k, v, causal, deterministic=True):
        out = flash_attention(q, k, v, causal, deterministic=deterministic)
        if wrong_pass == "fwd":
            return out * 1.01  # 1% off
        if wrong_pass in ("fwd+bwd", "bwd") or not deterministic:  # the output is right, its gradient 1% off
            return out + 0.01 * (out - out.detach())
        return out

    monkeypatch.setattr(attention_bench, "flash_attention", off_by_a_bit)
    if wrong_pass.startswith("bwd"):  # the fwd+bwd passes run the same backward first: leave them out
        cases = attention_bench.attention_cases
        only_backward = lambda *a: {p: f for p, f in cases(*a).items() if p.startswith("bwd")}
        monkeypatch.setattr(attention_bench, "attention_cases", only_backward)
    with pytest.raises(BenchmarkError, match=re.escape(f"attention suite: tiny {wrong_pass} causal=False")):
        run_attention_suite(torch.float32, quick=True)


def test_rows_name_the_tuned_tiles(monkeypatch):
    """On CUDA a row records the tiles each kernel of its pass ran (the autotuners' latest picks)."""
    kernels = importlib.import_module("tessel.kernels.attention_kernels")
    for name in ("fwd", "dkdv", "dq", "dkdv+dq"):
        monkeypatch.delattr(kernels._TUNED[name], "best_config", raising=False)
    assert kernels.tuned_programs("fwd") is None  # nothing tuned yet
    picks = {"fwd": (64, 64, 4, 3), "dkdv": (32, 128, 8, 3), "dq": (128, 64, 8, 2), "dkdv+dq": (64, 128, 8, 3)}
    for name, (bm, bn, w, s) in picks.items():
        config = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        monkeypatch.setattr(kernels._TUNED[name], "best_config", config, raising=False)
    programs = {p: kernels.tuned_programs(*attention_bench.PROGRAMS[p]) for p in PASSES}
    assert programs == {
        "fwd": "fwd 64x64 w4 s3",
        "fwd+bwd": "fwd 64x64 w4 s3, dkdv 32x128 w8 s3, dq 128x64 w8 s2",
        "fwd+bwd-atomic": "fwd 64x64 w4 s3, dkdv+dq 64x128 w8 s3",
        "bwd": "dkdv 32x128 w8 s3, dq 128x64 w8 s2",
        "bwd-atomic": "dkdv+dq 64x128 w8 s3",
    }
    with pytest.raises(ValueError, match=r"kernels: expected names among .*got \['bwd'\]"):
        kernels.tuned_programs("fwd", "bwd")
