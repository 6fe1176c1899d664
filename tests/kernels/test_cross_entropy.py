"""The cross-entropy row passes (row_stats, logits_grad) against float64 PyTorch, on odd shapes.

Rows are longer than the interpreter's 64-column blocks and end in partial blocks; logits spread over ±80
(exp overflows fp32 without the running max); some rows hold -inf logits (a masked vocabulary) and some
targets are -1 (another rank's columns). Rows are strided: ``x`` is a column slice of a wider buffer.
Tolerances: the log-sum-exp is an fp32 sum of ~V terms: 1e-6 relative. The gradient is exp of the fp32
difference x − lse, whose rounding (half an ulp of |x| ≤ ~200: up to 8e-6) is an absolute error of the
exponent, a relative one of its value: 2e-5 relative; fp16/bf16 round that once more (their eps).
"""

import pytest
import torch

from tessel.kernels.cross_entropy import logits_grad, logits_grad_reference, row_stats, row_stats_reference

SHAPES = [(1, 1), (7, 37), (5, 130), (3, 64)]


def _inputs(n, v, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    wide = torch.full((n, v + 5), float("nan"))
    wide[:, :v] = 40 * torch.randn(n, v, generator=g)
    x = wide[:, :v]
    if v > 2:
        x[0, 1] = float("-inf")
        x[n - 1, :2] = float("-inf")
    target = torch.randint(0, v, (n,), generator=g)
    target[n // 2] = -1
    if v > 2:
        target[n - 1] = 2  # a row whose first logits are -inf
    scale = torch.rand(n, generator=g) + 0.5
    return x.to(device), target.to(device), scale.to(device)


def _expected(x, target, scale, label_smoothing=0.0, vocab=None, z_loss=0.0):
    """float64 (lse, z, Σx, gradient): the gradient of lse − (1 − ε)·z − (ε/Vg)·Σx + c·lse², times scale."""
    xd = x.double()
    lse = torch.logsumexp(xd, dim=1)
    z = torch.where(target >= 0, xd.gather(1, target.clamp(min=0)[:, None])[:, 0], 0.0)
    onehot = torch.zeros_like(xd).scatter_(1, target.clamp(min=0)[:, None], (target >= 0).double()[:, None])
    p = torch.exp(xd - lse[:, None])
    smooth = label_smoothing / vocab if label_smoothing else 0.0
    grad = p * (1 + 2 * z_loss * lse[:, None]) - (1 - label_smoothing) * onehot - smooth
    return lse, z, xd.sum(dim=1), grad * scale.double()[:, None]


@pytest.mark.parametrize("n, v", SHAPES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_row_stats(n, v, x_dtype):
    x, target, scale = _inputs(n, v)
    x = x if x_dtype == torch.float32 else (x / 40).to(x_dtype)  # fp16's range; read as they are, fp32 arithmetic
    lse, z, total = row_stats(x, target)
    want_lse, want_z, want_total, _ = _expected(x, target, scale)
    assert lse.dtype == z.dtype == total.dtype == torch.float32
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(z.double(), want_z, rtol=0, atol=0)
    torch.testing.assert_close(total.double(), want_total, rtol=1e-6, atol=1e-4)  # -inf where a row holds -inf
    torch.testing.assert_close(row_stats_reference(x, target), (lse, z, total), rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("n, v", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inplace", [False, True])
def test_logits_grad(n, v, dtype, inplace):
    x, target, scale = _inputs(n, v)
    if dtype != torch.float32:
        x = (x / 40).to(dtype)  # logits of the gradient's dtype (fp16's range)
    want_lse, _, _, want = _expected(x, target, scale)
    lse = want_lse.float()
    before = x.clone()
    reference = logits_grad_reference(x.clone(), lse, target, scale, dtype)
    g = logits_grad(x, lse, target, scale, dtype, inplace=inplace)
    assert g.dtype == dtype and g.shape == x.shape
    assert (g.data_ptr() == x.data_ptr()) == inplace  # written over the logits only when asked
    if not inplace:
        torch.testing.assert_close(x, before, rtol=0, atol=0, equal_nan=True)
    tol = dict(rtol=2e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=torch.finfo(dtype).eps, atol=1e-7)
    torch.testing.assert_close(g.double(), want, **tol)
    torch.testing.assert_close(g, reference, **tol)


@pytest.mark.parametrize("label_smoothing, z_loss", [(0.1, 0.0), (0.0, 1e-2), (0.25, 1e-3)])
def test_logits_grad_of_smoothed_targets_and_z_loss(label_smoothing, z_loss):
    x, target, scale = _inputs(7, 130)
    x = x / 40  # finite lse² terms of a sensible size
    options = dict(label_smoothing=label_smoothing, vocab=300, z_loss=z_loss)  # 300: the whole vocabulary
    want_lse, _, _, want = _expected(x, target, scale, **options)
    lse = want_lse.float()
    g = logits_grad(x.clone(), lse, target, scale, torch.float32, **options)
    torch.testing.assert_close(g.double(), want, rtol=2e-5, atol=1e-7)
    reference = logits_grad_reference(x.clone(), lse, target, scale, torch.float32, **options)
    torch.testing.assert_close(g, reference, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("label_smoothing, z_loss", [(0.0, 0.0), (0.1, 1e-3)])
def test_soft_capped_logits(dtype, label_smoothing, z_loss):
    """softcap κ: both passes read each logit as κ·tanh(x/κ) (the -inf logits of a masked vocabulary as -κ), and the
    gradient is the capped logits' times the cap's derivative, against float64 autograd through the cap."""
    x, target, scale = _inputs(7, 130)
    x = x.to(dtype)
    cap = 30.0
    options = dict(label_smoothing=label_smoothing, vocab=300, z_loss=z_loss)
    capped = x.double().requires_grad_()
    y = torch.tanh(capped / cap) * cap
    want_lse, want_z, want_total, grad_y = _expected(y.detach(), target, scale, **options)
    (want,) = torch.autograd.grad(y, capped, grad_y)  # through the cap: grad_y · (1 - tanh²)
    lse, z, total = row_stats(x, target, softcap=cap)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(z.double(), want_z, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(total.double(), want_total, rtol=1e-6, atol=1e-3)
    torch.testing.assert_close(row_stats_reference(x, target, cap), (lse, z, total), rtol=1e-6, atol=1e-3)
    g = logits_grad(x.clone(), lse, target, scale, dtype, inplace=True, softcap=cap, **options)
    tol = dict(rtol=2e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=torch.finfo(dtype).eps, atol=1e-7)
    torch.testing.assert_close(g.double(), want, **tol)
    reference = logits_grad_reference(x.clone(), lse, target, scale, dtype, softcap=cap, **options)
    torch.testing.assert_close(g, reference, **tol)
    with pytest.raises(ValueError, match="row_stats: softcap must be None or a finite number above 0, received 0"):
        row_stats(x, target, softcap=0)
    with pytest.raises(TypeError, match="logits_grad: softcap must be None or a float, received str"):
        logits_grad(x, lse, target, scale, dtype, softcap="30")


def test_float64_rows_take_the_pytorch_passes_in_fp32():
    """float64 logits (a model kept in float64 for checking) are taken, in fp32 as every dtype is."""
    x, target, scale = _inputs(5, 11)
    for got, want in zip(row_stats(x.double(), target), row_stats_reference(x, target), strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want)
    lse = row_stats_reference(x, target)[0]
    g = logits_grad(x.double(), lse, target, scale, torch.float64)
    assert g.dtype == torch.float64
    torch.testing.assert_close(g.float(), logits_grad_reference(x.clone(), lse, target, scale, torch.float32))


def test_bad_input_is_refused():
    x, target, scale = _inputs(4, 9)
    with pytest.raises(ValueError, match=r"row_stats: x must be a float32, float16, bfloat16 or float64 \[n, V\]"):
        row_stats(x.int(), target)
    with pytest.raises(ValueError, match=r"x must be a float32, float16, bfloat16 or float64 \[n, V\] tensor"):
        row_stats(x[None], target)
    with pytest.raises(ValueError, match="with unit column stride"):
        row_stats(x.t().contiguous().t(), target)
    with pytest.raises(ValueError, match=r"logits_grad: target must be int64 \[4\]"):
        logits_grad(x, x[:, 0], target.int(), scale, torch.float32)
    with pytest.raises(ValueError, match="label_smoothing needs vocab, the whole vocabulary's size; received None"):
        logits_grad(x, x[:, 0], target, scale, torch.float32, label_smoothing=0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_a_llama_sized_vocabulary(dtype):
    x, target, scale = _inputs(33, 128256, "cuda")
    lse, z, _ = row_stats(x, target)
    want_lse, want_z, _, want = _expected(x, target, scale)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(z.double(), want_z, rtol=0, atol=0)
    g = logits_grad(x, want_lse.float(), target, scale, dtype)
    tol = dict(rtol=2e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=torch.finfo(dtype).eps, atol=1e-7)
    torch.testing.assert_close(g.double(), want, **tol)
