"""tessel.kernels.matmul against a float64 reference: odd shapes, strides, dtypes, epilogues, autograd.

Tolerances follow the classic GEMM error bound |C - Ĉ| ≤ c·u·(|A|·|B|) plus one rounding of the result:
products of fp16/bf16 values are exact in fp32, so a low-precision result differs from float64 by the
fp32 accumulation (≈ K·2⁻²⁴ relative to |A|·|B|) and one final rounding (half an ulp of |C|). RTOL
is two ulps of each dtype, applied to |A|·|B| + |C|.
"""

import importlib
import math

import pytest
import torch

from tessel.kernels import matmul, matmul_reference

# The package exports the function under the module's name, so fetch the module itself.
matmul_module = importlib.import_module("tessel.kernels.matmul")

RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ACTIVATIONS = [None, "relu", "gelu", "silu"]
# Odd shapes: nothing is a multiple of a block; M=1 and N=1; K smaller than, equal to and spanning blocks.
SHAPES = [(37, 53, 29), (1, 64, 100), (64, 1, 33), (130, 70, 100), (5, 3, 1), (33, 65, 64)]


def assert_gemm_close(actual, expected, magnitude, dtype):
    """|actual - expected| ≤ RTOL·(magnitude + |expected|) elementwise, with a readable failure."""
    actual, expected = actual.double(), expected.double()
    assert actual.shape == expected.shape
    allowed = RTOL[dtype] * (magnitude + expected.abs()) + 1e-12
    err = (actual - expected).abs()
    bad = ~(err <= allowed)  # also catches NaN
    if bad.any():
        i = bad.nonzero()[0].tolist()
        raise AssertionError(
            f"{int(bad.sum())} of {err.numel()} elements differ; first at {i}: got {actual[tuple(i)].item()}, "
            f"expected {expected[tuple(i)].item()}, allowed error {allowed[tuple(i)].item():.3g} ({dtype})"
        )


def make(shape, dtype, transposed=False):
    """Random data; a transposed request returns a non-contiguous view of the transposed storage."""
    if transposed:
        return torch.randn(shape[::-1], dtype=dtype).t()
    return torch.randn(shape, dtype=dtype)


def reference(a, b, bias=None, activation=None):
    """float64 result and the |A|·|B| + |bias| magnitude that bounds its rounding error."""
    mag = a.double().abs() @ b.double().abs()
    if bias is not None:
        mag = mag + bias.double().abs()
    if activation in ("gelu", "silu"):
        mag = 1.2 * mag  # both are ≤1.2-Lipschitz: input errors grow by at most that
    return matmul_reference(a.double(), b.double(), None if bias is None else bias.double(), activation), mag


# ---------------------------------------------------------------------------------------------------- forward


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_forward_shapes_dtypes(seed, shape, dtype, with_bias):
    m, n, k = shape
    a, b = make((m, k), dtype), make((k, n), dtype)
    bias = torch.randn(n, dtype=dtype) if with_bias else None
    out = matmul(a, b, bias)
    assert out.shape == (m, n) and out.dtype == dtype
    assert_gemm_close(out, *reference(a, b, bias), dtype)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_forward_activations(seed, activation, dtype, with_bias):
    a, b = make((37, 29), dtype), make((29, 53), dtype)
    bias = torch.randn(53, dtype=dtype) if with_bias else None
    assert_gemm_close(matmul(a, b, bias, activation), *reference(a, b, bias, activation), dtype)


def test_gelu_is_the_erf_form(seed):
    a, b = make((16, 8), torch.float32), make((8, 24), torch.float32)
    z = (a.double() @ b.double()).float()
    exact = torch.nn.functional.gelu(z, approximate="none")
    tanh = torch.nn.functional.gelu(z, approximate="tanh")
    got = matmul(a, b, activation="gelu")
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-6)
    assert (got - tanh).abs().max() > 1e-5  # would pass for the tanh form only if the forms agreed


@pytest.mark.parametrize("ta, tb", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_transposed_views_are_read_in_place(seed, monkeypatch, ta, tb, dtype):
    a, b = make((37, 29), dtype, ta), make((29, 53), dtype, tb)
    seen = []
    launch = matmul_module._launch

    def spy(a_, b_, *args, **kwargs):
        seen.append((a_.data_ptr(), a_.stride(), b_.data_ptr(), b_.stride()))
        return launch(a_, b_, *args, **kwargs)

    monkeypatch.setattr(matmul_module, "_launch", spy)
    out = matmul(a, b)
    assert seen == [(a.data_ptr(), a.stride(), b.data_ptr(), b.stride())]  # the views themselves, no copies
    assert_gemm_close(out, *reference(a, b), dtype)


def test_strided_slices(seed):
    """Operands with non-unit strides in both dimensions (every other row and column)."""
    a = torch.randn(2 * 37, 3 * 29)[::2, ::3]
    b = torch.randn(53 * 2, 29 * 2).t()[::2, ::2]
    assert_gemm_close(matmul(a, b), *reference(a, b), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_dimensions(seed, dtype):
    assert matmul(make((0, 7), dtype), make((7, 5), dtype)).shape == (0, 5)
    assert matmul(make((4, 7), dtype), make((7, 0), dtype)).shape == (4, 0)
    bias = torch.randn(5, dtype=dtype)
    out = matmul(make((4, 0), dtype), make((0, 5), dtype), bias, "relu")  # K = 0: epilogue only
    torch.testing.assert_close(out, torch.relu(bias).expand(4, 5))


# ---------------------------------------------------------------------------------------------------- out= / accumulate


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", [None, "gelu"])
def test_out_row_block_of_nan_buffer(seed, dtype, activation):
    """out is a strided row/column block of a larger NaN-poisoned buffer; nothing around it changes."""
    m, n, k = 37, 53, 29
    buf = torch.full((m + 11, n + 6), float("nan"), dtype=dtype)
    out = buf[5 : 5 + m, 2 : 2 + n]
    a, b, bias = make((m, k), dtype), make((k, n), dtype, True), torch.randn(n, dtype=dtype)
    ret = matmul(a, b, bias, activation, out=out)
    assert ret.data_ptr() == out.data_ptr()
    assert_gemm_close(buf[5 : 5 + m, 2 : 2 + n], *reference(a, b, bias, activation), dtype)
    outside = torch.ones_like(buf, dtype=torch.bool)
    outside[5 : 5 + m, 2 : 2 + n] = False
    assert buf[outside].isnan().all()


def test_out_transposed_view(seed):
    a, b = make((37, 29), torch.float32), make((29, 53), torch.float32)
    buf = torch.full((60, 70), float("nan"))
    out = buf.t()[1:54, 2:39].t()  # [37, 53] with column-major strides
    matmul(a, b, out=out)
    assert_gemm_close(out, *reference(a, b), torch.float32)
    assert buf.isnan().sum() == buf.numel() - 37 * 53


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", [None, "silu"])
def test_accumulate(seed, dtype, activation):
    m, n, k = 37, 53, 29
    buf = torch.full((m + 4, n), float("nan"), dtype=dtype)
    out = buf[2 : 2 + m]
    prev = torch.randn(m, n, dtype=dtype)
    out.copy_(prev)
    a, b, bias = make((m, k), dtype, True), make((k, n), dtype), torch.randn(n, dtype=dtype)
    matmul(a, b, bias, activation, out=out, accumulate=True)
    expected, mag = reference(a, b, bias, activation)
    assert_gemm_close(out, expected + prev.double(), mag + prev.double().abs(), dtype)
    assert buf[:2].isnan().all() and buf[2 + m :].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs_into_fp32_out(seed, dtype):
    """Partial sums can be accumulated in an fp32 buffer without a low-precision rounding per step."""
    a, b = make((37, 29), dtype), make((29, 53), dtype)
    out = torch.zeros(37, 53)
    for _ in range(3):
        matmul(a, b, out=out, accumulate=True)
    expected, mag = reference(a, b)
    assert_gemm_close(out, 3 * expected, 3 * mag, torch.float32)


def test_64bit_offsets(seed):
    """A row stride of 2**30 elements puts row 2 at offset 2**31, past int32: the kernel indexes in 64 bits."""
    storage = torch.empty(2**31 + 64, dtype=torch.float16)  # 4 GiB of address space, three rows touched
    a = storage.as_strided((3, 16), (2**30, 1))
    a.copy_(torch.randn(3, 16, dtype=torch.float16))
    b = make((16, 8), torch.float16)
    assert matmul_module._needs_int64(a, b)
    assert not matmul_module._needs_int64(a[:2], b)
    assert_gemm_close(matmul(a, b), *reference(a.clone(), b), torch.float16)


# ---------------------------------------------------------------------------------------------------- backward


def reference_grads(a, b, bias, activation, grad_out):
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    bias64 = None if bias is None else bias.detach().double().requires_grad_()
    out = matmul_reference(a64, b64, bias64, activation)
    out.backward(grad_out.double())
    return a64.grad, b64.grad, None if bias is None else bias64.grad


def grad_magnitudes(a, b, grad_out, activation):
    """Bounds for dA = dZ·Bᵀ, dB = Aᵀ·dZ, dbias = Σ dZ, with |dZ| ≤ 1.2·|dOut| for every activation."""
    gz = (1.2 if activation else 1.0) * grad_out.double().abs()
    return gz @ b.double().abs().t(), a.double().abs().t() @ gz, gz.sum(0)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 53, 29), (1, 19, 40), (70, 33, 65)])
def test_backward(seed, activation, dtype, shape):
    m, n, k = shape
    a = make((m, k), dtype).requires_grad_()
    b = make((k, n), dtype, transposed=True).detach().requires_grad_()
    bias = torch.randn(n, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(m, n, dtype=dtype)
    matmul(a, b, bias, activation).backward(grad_out)
    expected = reference_grads(a, b, bias, activation, grad_out)
    mags = grad_magnitudes(a, b, grad_out, activation)
    for got, want, mag in zip((a.grad, b.grad, bias.grad), expected, mags):
        assert got.dtype == dtype
        assert_gemm_close(got, want, mag, dtype)


def test_backward_only_what_is_needed(seed, monkeypatch):
    """dB is not computed when only a needs a gradient: one backward GEMM, not two."""
    calls = []
    launch = matmul_module._launch
    monkeypatch.setattr(matmul_module, "_launch", lambda *a, **k: calls.append(1) or launch(*a, **k))
    a, b = make((9, 7), torch.float32).requires_grad_(), make((7, 5), torch.float32)
    matmul(a, b).sum().backward()
    assert len(calls) == 2 and b.grad is None


def test_backward_through_accumulate_into_a_view(seed):
    """out= a slice of a buffer that is itself part of the graph: the old contents receive dOut."""
    m, n, k = 13, 11, 7
    base = torch.randn(m + 3, n, dtype=torch.float64)
    prev = base.clone().requires_grad_()
    buf = prev * 1.0  # non-leaf, so it may be written in place
    a, b = make((m, k), torch.float32).requires_grad_(), make((k, n), torch.float32)
    buf = buf.float()
    matmul(a, b, out=buf[1 : 1 + m], accumulate=True)
    grad = torch.randn(m + 3, n)
    buf.backward(grad)
    torch.testing.assert_close(prev.grad, grad.double())  # accumulate passes dOut through to the old values
    torch.testing.assert_close(a.grad, (grad[1 : 1 + m].double() @ b.double().t()).float(), rtol=1e-5, atol=1e-5)


def test_backward_overwrite_blocks_gradient_to_old_contents(seed):
    m, n, k = 6, 5, 4
    prev = torch.randn(m, n, requires_grad=True)
    buf = prev * 1.0
    a, b = make((m - 2, k), torch.float32).requires_grad_(), make((k, n), torch.float32)
    matmul(a, b, out=buf[2:], accumulate=False)
    buf.sum().backward()
    assert (prev.grad[:2] == 1).all() and (prev.grad[2:] == 0).all()


# ---------------------------------------------------------------------------------------------------- bad input


def _good():
    return make((4, 3), torch.float32), make((3, 5), torch.float32)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(a=torch.randn(4, 3), b=torch.randn(4, 5)), ValueError, ["inner dimensions", "(4, 3)", "(4, 5)"]),
        (dict(a=torch.randn(2, 4, 3)), ValueError, ["a must be 2-D", "(2, 4, 3)"]),
        (dict(b=torch.randn(3)), ValueError, ["b must be 2-D", "(3,)"]),
        (dict(b=torch.randn(3, 5, dtype=torch.float16)), TypeError, ["b must have a's dtype", "float16"]),
        (dict(a=torch.ones(4, 3, dtype=torch.int32)), TypeError, ["a must be float32, float16 or bfloat16", "int32"]),
        (dict(b=torch.randn(3, 5, device="meta")), ValueError, ["b must be on a's device", "meta"]),
        (dict(a=[[1.0]]), TypeError, ["a must be a torch.Tensor", "list"]),
        (dict(activation="tanh"), ValueError, ["activation must be one of", "'tanh'"]),
        (dict(out=torch.empty(5, 4)), ValueError, ["out must have shape (4, 5)", "(5, 4)"]),
        (dict(out=torch.empty(4, 5, dtype=torch.float16)), TypeError, ["out must be", "float16"]),
        (dict(out=torch.empty(4, 5, device="meta")), ValueError, ["out must be on", "meta"]),
        (dict(out=torch.empty(5).expand(4, 5)), ValueError, ["broadcast"]),
        (dict(accumulate=True), ValueError, ["accumulate=True needs out="]),
        (dict(accumulate=1), TypeError, ["accumulate must be a bool", "int"]),
        (dict(bias=torch.randn(4)), ValueError, ["bias must be a (5,)", "(4,)"]),
        (dict(bias=torch.randn(5, dtype=torch.float64)), TypeError, ["bias must be float32", "float64"]),
    ],
)
def test_bad_input(kwargs, error, words):
    a, b = _good()
    args = dict(a=a, b=b) | kwargs
    with pytest.raises(error) as info:
        matmul(**args)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_out_aliasing_an_operand_is_refused_and_nothing_changes():
    buf = torch.randn(8, 8)
    before = buf.clone()
    a, b = buf[:4, :3], torch.randn(3, 5)
    with pytest.raises(ValueError, match="out must not share memory with a"):
        matmul(a, b, out=buf[2:6, 3:8])
    assert torch.equal(buf, before)
    matmul(a, b, out=buf[4:8, 3:8])  # same storage, disjoint bytes: allowed


def test_error_leaves_out_untouched():
    out = torch.full((4, 5), float("nan"))
    with pytest.raises(ValueError):
        matmul(torch.randn(4, 3), torch.randn(3, 5), activation="nope", out=out, accumulate=True)
    assert out.isnan().all()


# ---------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(8192, 1280, 8192), (4096, 4096, 4096), (1, 4096, 4096), (3001, 2999, 1001)])
def test_gpu_against_float64(seed, dtype, shape):
    m, n, k = shape
    a = torch.randn(m, k, device="cuda", dtype=dtype) / math.sqrt(k)
    b = torch.randn(k, n, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    out = matmul(a, b, bias, "gelu")
    expected, mag = reference(a, b, bias, "gelu")
    # fp32 runs TF32 when torch allows it (as cuBLAS does): 10-bit mantissa operands.
    tol_dtype = torch.bfloat16 if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else dtype
    assert_gemm_close(out.cpu(), expected.cpu(), mag.cpu(), tol_dtype)


@pytest.mark.gpu
def test_gpu_autotune_does_not_accumulate_twice(seed):
    """The autotuner launches every configuration: accumulate must still add exactly once."""
    m, n, k = 2048 + 17, 1024 + 3, 512 + 5  # a shape no other test tunes for
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    prev = torch.randn(m, n, device="cuda", dtype=torch.float32)
    out = prev.clone()
    matmul(a, b, out=out, accumulate=True)
    expected, mag = reference(a, b)
    assert_gemm_close(
        out.cpu(), expected.cpu() + prev.double().cpu(), mag.cpu() + prev.double().abs().cpu(), torch.bfloat16
    )


@pytest.mark.gpu
def test_gpu_backward(seed):
    a = torch.randn(1000, 700, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(500, 700, device="cuda", dtype=torch.bfloat16).t().detach().requires_grad_()
    bias = torch.randn(500, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(1000, 500, device="cuda", dtype=torch.bfloat16)
    matmul(a, b, bias, "silu").backward(g)
    expected = reference_grads(a, b, bias, "silu", g)
    for got, want, mag in zip((a.grad, b.grad, bias.grad), expected, grad_magnitudes(a, b, g, "silu")):
        assert_gemm_close(got.cpu(), want.cpu(), mag.cpu(), torch.bfloat16)
