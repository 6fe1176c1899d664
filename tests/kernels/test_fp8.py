"""tessel.kernels.fp8: quantisation against PyTorch's own fp8 rounding, the scaled GEMM against float64.

Quantisation is exact arithmetic (a power-of-two scale, then one rounding to the format), so the Triton kernel
must equal the reference bit for bit; the reference itself is checked against the format's rounding bound. The
GEMM's products of fp8 values are exact in fp32, so it differs from the float64 product only by fp32 accumulation
(≈ K·2⁻²⁴ relative to |A|·|B|) and one rounding of the output (two ulps of the output dtype, as test_matmul).
"""

import importlib

import pytest
import torch

from tessel.kernels import (
    FP8_FORMATS,
    Fp8Tensor,
    fp8_matmul,
    fp8_matmul_reference,
    quantize_fp8,
    quantize_fp8_reference,
)

fp8_module = importlib.import_module("tessel.kernels.fp8")

SOURCES = [torch.float32, torch.float16, torch.bfloat16]
OUT_RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SHAPES = [(37, 53), (1, 1), (5, 130), (64, 33)]
MANTISSA = {"e4m3": 3, "e5m2": 2}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _random(shape, dtype, seed, scale=3.0, transposed=False):
    g = torch.Generator().manual_seed(seed)
    if transposed:
        return (torch.randn(shape[::-1], generator=g) * scale).to(dtype).t()
    return (torch.randn(shape, generator=g) * scale).to(dtype)


# ------------------------------------------------------------------------------------------------- quantisation


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", SOURCES)
@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_equals_the_reference_bit_for_bit(fmt, dtype, shape):
    for transposed in (False, True):
        x = _random(shape, dtype, seed=sum(shape), transposed=transposed)
        got = quantize_fp8(x, fmt, transpose=True)
        want = quantize_fp8_reference(x, fmt, transpose=True)
        assert got.data.dtype == FP8_FORMATS[fmt] and got.data.is_contiguous() and got.data.shape == shape
        assert torch.equal(_bits(got.data), _bits(want.data)), (fmt, dtype, shape, transposed)
        assert torch.equal(_bits(got.data_t), _bits(want.data.t().contiguous()))
        assert torch.equal(got.scale_inv, want.scale_inv) and got.scale_inv.shape == (1,)
        assert quantize_fp8(x, fmt).data_t is None


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_a_batch_of_matrices_has_a_scale_each(fmt):
    """A 3-D x (experts' weights) is quantised matrix by matrix: each as quantize_fp8 quantises it alone, bit for
    bit, however far apart the matrices' magnitudes; the transposes are each matrix's."""
    x = _random((5, 37, 53), torch.bfloat16, seed=4) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 2e4]).view(5, 1, 1)
    x = x.to(torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous matrices
    q = quantize_fp8(x, fmt, transpose=True)
    assert q.data.shape == (5, 37, 53) and q.data_t.shape == (5, 53, 37) and q.scale_inv.shape == (5,)
    for e in range(5):
        alone = quantize_fp8_reference(x[e], fmt, transpose=True)
        assert torch.equal(_bits(q.data[e]), _bits(alone.data)) and torch.equal(_bits(q.data_t[e]), _bits(alone.data_t))
        assert q.scale_inv[e] == alone.scale_inv[0]
    want = quantize_fp8_reference(x, fmt, transpose=True)
    assert torch.equal(_bits(q.data), _bits(want.data)) and torch.equal(q.scale_inv, want.scale_inv)


def test_quantize_rounds_ties_to_even_and_across_binades():
    """Values exactly between two e4m3 neighbours go to the even one; rounding up may carry into the next power of
    two (Triton's interpreter's own cast gets that wrong: 127.7 came out as 64)."""
    x = torch.tensor([[100.0, 104.0 + 4.0, 127.7, -127.7, 1.0625, 448.0, 0.0, -0.0]])  # amax 448: scale 1
    got = quantize_fp8(x).data.float()
    assert got.tolist() == [[96.0, 112.0, 128.0, -128.0, 1.0, 448.0, 0.0, 0.0]]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_reference_scale_is_a_power_of_two_and_error_within_half_a_step(fmt):
    x = _random((40, 70), torch.float32, seed=7) * torch.logspace(-3, 3, 70)  # six decades in one tensor
    q = quantize_fp8_reference(x, fmt)
    scale = 1.0 / q.scale_inv.item()
    assert scale == 2.0 ** round(torch.tensor(scale).log2().item())
    fp8_max = torch.finfo(FP8_FORMATS[fmt]).max
    assert fp8_max / 2 < x.abs().max().item() * scale <= fp8_max  # the largest value uses the top binade
    scaled, err = x * scale, (q.data.float() - x * scale).abs()
    tiny = torch.finfo(FP8_FORMATS[fmt]).smallest_normal
    # Half a step: 2^-(mantissa+1) of the value among normal numbers, half the subnormal spacing below them.
    bound = torch.where(
        scaled.abs() >= tiny, scaled.abs() * 2.0 ** -(MANTISSA[fmt] + 1), tiny * 2.0 ** -(MANTISSA[fmt] + 1)
    )
    assert (err <= bound).all()
    assert torch.equal(q.dequantize(), q.data.float() / scale)


@pytest.mark.parametrize("quantize", [quantize_fp8, quantize_fp8_reference])
def test_quantize_edge_cases(quantize):
    zeros = quantize(torch.zeros(3, 5))
    assert zeros.scale_inv.item() == 1.0 and not zeros.data.float().any()
    # A NaN stays NaN and leaves the others finite; an infinity turns the whole tensor into NaN (the scale is 0),
    # which a dynamic loss scale sees.
    x = torch.randn(4, 6)
    x[1, 2] = float("nan")
    q = quantize(x, "e5m2").dequantize()
    assert q[1, 2].isnan() and torch.isfinite(q).sum() == x.numel() - 1
    x[1, 2] = float("inf")
    assert quantize(x, "e4m3").dequantize().isnan().all()
    # A tiny tensor: the scale stops at 2^126 (its inverse is fp32's smallest normal), the values stay finite.
    tiny = torch.full((2, 3), 1e-40)
    q = quantize(tiny, "e4m3")
    assert q.scale_inv.item() == 2.0**-126 and torch.isfinite(q.dequantize()).all()
    empty = quantize(torch.zeros(0, 4), transpose=True)
    assert empty.data.shape == (0, 4) and empty.data_t.shape == (4, 0)


def test_quantize_refuses_bad_input():
    x = torch.randn(4, 4)
    with pytest.raises(ValueError, match=r"fmt must be one of \('e4m3', 'e5m2'\), received 'e3m4'"):
        quantize_fp8(x, "e3m4")
    with pytest.raises(ValueError, match=r"x must be 2-D \(or 3-D: a batch of matrices\), received shape \(4,\)"):
        quantize_fp8(torch.randn(4))
    with pytest.raises(ValueError, match=r"amax must be None or a 3-element float32 tensor on cpu .*received \(1,\)"):
        quantize_fp8(torch.randn(3, 4, 4), amax=torch.ones(1))
    with pytest.raises(TypeError, match=r"x must be float32, float16 or bfloat16, received torch\.float64"):
        quantize_fp8(x.double())
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor, received list"):
        quantize_fp8([[1.0]])
    with pytest.raises(TypeError, match="transpose must be a bool, received int"):
        quantize_fp8(x, transpose=1)


# ---------------------------------------------------------------------------------------------------------- GEMM


def _operands(m, n, k, a_fmt="e4m3", b_fmt="e4m3", seed=0):
    """Quantised a [m, k] (row-major) and b [k, n] (K-major: the transpose of a row-major [n, k])."""
    a = quantize_fp8(_random((m, k), torch.float32, seed), a_fmt)
    w = quantize_fp8(_random((n, k), torch.float32, seed + 1, scale=0.1), b_fmt)
    return a, Fp8Tensor(w.data.t(), w.scale_inv)


def _assert_gemm_close(got, a, b, want, dtype):
    magnitude = (a.data.double().abs() @ b.data.double().abs()) * (a.scale_inv.double() * b.scale_inv.double())
    allowed = OUT_RTOL[dtype] * (magnitude + want.double().abs()) + 1e-30
    err = (got.double() - want.double()).abs()
    assert (err <= allowed).all(), f"max error {err.max().item():.3g}, allowed {allowed.min().item():.3g}"


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("m", "n", "k"), [(37, 29, 45), (1, 64, 100), (64, 1, 33), (70, 40, 130)])
def test_fp8_matmul_matches_float64(out_dtype, m, n, k):
    a, b = _operands(m, n, k, seed=m + n + k)
    bias = _random((n,), out_dtype, seed=3)
    got = fp8_matmul(a.data, b.data, a.scale_inv, b.scale_inv, bias, out_dtype=out_dtype)
    assert got.dtype == out_dtype and got.shape == (m, n)
    want = fp8_matmul_reference(a.data, b.data, a.scale_inv, b.scale_inv, bias, out_dtype=torch.float64)
    _assert_gemm_close(got, a, b, want, out_dtype)


@pytest.mark.parametrize(("a_fmt", "b_fmt"), [("e5m2", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e5m2")])
def test_fp8_matmul_mixes_formats(a_fmt, b_fmt):
    a, b = _operands(33, 20, 48, a_fmt, b_fmt, seed=11)
    got = fp8_matmul(a.data, b.data, a.scale_inv, b.scale_inv, out_dtype=torch.float32, split_accumulator=False)
    want = fp8_matmul_reference(a.data, b.data, a.scale_inv, b.scale_inv, out_dtype=torch.float64)
    _assert_gemm_close(got, a, b, want, torch.float32)


def test_fp8_matmul_writes_and_accumulates_into_a_slice():
    a, b = _operands(21, 17, 40, seed=5)
    buffer = torch.full((30, 50), float("nan"), dtype=torch.bfloat16)
    out = buffer[4:25, 10:27]
    assert fp8_matmul(a.data, b.data, a.scale_inv, b.scale_inv, out=out) is out
    want = fp8_matmul_reference(a.data, b.data, a.scale_inv, b.scale_inv, out_dtype=torch.float64)
    _assert_gemm_close(out, a, b, want, torch.bfloat16)
    untouched = torch.ones_like(buffer, dtype=torch.bool)
    untouched[4:25, 10:27] = False
    assert buffer[untouched].isnan().all()
    before = out.double()
    fp8_matmul(a.data, b.data, a.scale_inv, b.scale_inv, out=out, accumulate=True)
    _assert_gemm_close(out, a, b, before + want, torch.bfloat16)


def test_fp8_matmul_refuses_bad_input():
    a, b = _operands(8, 16, 32)
    args = (a.scale_inv, b.scale_inv)
    with pytest.raises(TypeError, match=r"a must be float8_e4m3fn or float8_e5m2, received torch\.float32"):
        fp8_matmul(a.data.float(), b.data, *args)
    with pytest.raises(ValueError, match=r"b must be K-major .* received strides \(16, 1\)"):
        fp8_matmul(a.data, b.data.contiguous(), *args)
    with pytest.raises(ValueError, match=r"a must be row-major .* received strides \(1, 8\)"):
        fp8_matmul(a.data.t().contiguous().t(), b.data, *args)
    with pytest.raises(ValueError, match=r"inner dimensions differ"):
        fp8_matmul(a.data[:, :16], b.data, *args)
    with pytest.raises(ValueError, match=r"a_scale_inv must be a one-element float32 tensor on cpu, received shape"):
        fp8_matmul(a.data, b.data, torch.ones(2), b.scale_inv)
    with pytest.raises(ValueError, match=r"bias must be a \(16,\) torch.bfloat16 tensor"):
        fp8_matmul(a.data, b.data, *args, torch.zeros(16))
    with pytest.raises(ValueError, match="accumulate=True needs out="):
        fp8_matmul(a.data, b.data, *args, accumulate=True)
    with pytest.raises(ValueError, match=r"out must be a \(8, 16\) torch.float32 tensor"):
        fp8_matmul(a.data, b.data, *args, out=torch.empty(8, 16, dtype=torch.bfloat16), out_dtype=torch.float32)
    with pytest.raises(TypeError, match=r"out_dtype must be bfloat16, float16 or float32, received torch\.float64"):
        fp8_matmul(a.data, b.data, *args, out_dtype=torch.float64)
    with pytest.raises(TypeError, match="split_accumulator must be a bool"):
        fp8_matmul(a.data, b.data, *args, split_accumulator=None)


def test_the_scaled_epilogue_is_what_the_matmul_reference_computes():
    """The PyTorch backend (Triton's interpreter off) runs the same definition: the product, then both scales."""
    a, b = _operands(9, 16, 32, seed=2)
    out = torch.empty(9, 16)
    importlib.import_module("tessel.kernels.matmul_reference")._reference_into(
        a.data, b.data, None, None, out, False, None, (a.scale_inv, b.scale_inv)
    )
    want = fp8_matmul_reference(a.data, b.data, a.scale_inv, b.scale_inv, out_dtype=torch.float64)
    _assert_gemm_close(out, a, b, want, torch.float32)


# ----------------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize(("m", "n", "k"), [(512, 768, 1024), (333, 257, 4096), (4096, 4096, 4096)])
def test_fp8_matmul_on_the_gpu(split, m, n, k):
    """The compiled kernel (autotuned: plain, persistent and TMA programs, fp8 tensor cores) against float64."""
    torch.manual_seed(m + n)
    a = quantize_fp8(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    w = quantize_fp8(torch.randn(n, k, device="cuda", dtype=torch.bfloat16), transpose=True)
    got = fp8_matmul(a.data, w.data.t(), a.scale_inv, w.scale_inv, out_dtype=torch.float32, split_accumulator=split)
    want = fp8_matmul_reference(a.data.cpu(), w.data.t().cpu(), a.scale_inv.cpu(), w.scale_inv.cpu(),
                                out_dtype=torch.float64)  # fmt: skip
    magnitude = (a.data.cpu().double().abs() @ w.data.t().cpu().double().abs()) * (
        a.scale_inv.cpu().double() * w.scale_inv.cpu().double()
    )
    rtol = 5e-4 if split else 1.6e-2  # sm_90's fp8 accumulator keeps ~14 bits: per K block (split) or throughout
    err = (got.cpu().double() - want).abs()
    assert (err <= rtol * magnitude + 1e-30).all(), err.max().item()
    # Quantising on the GPU is bitwise PyTorch's rounding too, transposes included.
    x = torch.randn(300, 200, device="cuda", dtype=torch.bfloat16) * 5
    q, r = quantize_fp8(x, "e5m2", transpose=True), quantize_fp8_reference(x.cpu(), "e5m2", transpose=True)
    assert torch.equal(_bits(q.data.cpu()), _bits(r.data)) and torch.equal(_bits(q.data_t.cpu()), _bits(r.data_t))
    assert torch.equal(q.scale_inv.cpu(), r.scale_inv)
