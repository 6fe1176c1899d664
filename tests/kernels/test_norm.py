"""tessel.kernels.norm against a float64 reference: odd hidden sizes, leading shapes, strides, dtypes, autograd.

The reference runs in float64 on the values the kernel sees (inputs rounded to the tested dtype), so the
difference is the kernel's own error: fp32 statistics and arithmetic (~1e-7 relative per operation, a
few dozen operations per element) and one final rounding to the output dtype (half an ulp: 2⁻¹¹ for
fp16, 2⁻⁸ for bf16). Weight gradients sum M rows in fp32 before their rounding. Each tolerance below is
about four ulps of its dtype, applied relative to the largest magnitude of the compared tensor.
"""

import importlib

import pytest
import torch

from tessel.kernels.norm import MAX_HIDDEN, layer_norm, layer_norm_reference, rms_norm, rms_norm_reference

norm_module = importlib.import_module("tessel.kernels.norm")

TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
KINDS = ["rms", "layer", "layer_nobias"]
HIDDEN = [48, 100, 257]  # none a power of two: the masked tail of the block is always exercised
LEADING = [(2, 7), (13,), (3, 1, 5)]


def _close(got, want, dtype, what):
    """|got − want| ≤ TOL·(max|want| + |want|) elementwise, NaN counted as a failure."""
    got, want = got.double(), want.double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    allowed = TOL[dtype] * (want.abs().max() + want.abs()) + 1e-12
    bad = ~((got - want).abs() <= allowed)
    assert not bad.any(), (
        f"{what} ({dtype}): {int(bad.sum())} of {bad.numel()} elements differ, max error "
        f"{(got - want).abs().max().item():.3g}, allowed about {allowed.max().item():.3g}"
    )


def _params(kind, h, dtype, device="cpu"):
    w = (1 + 0.5 * torch.randn(h)).to(device=device, dtype=dtype)
    b = 0.5 * torch.randn(h).to(device=device, dtype=dtype) if kind == "layer" else None
    return w, b


def _run(kind, x, w, b):
    return rms_norm(x, w) if kind == "rms" else layer_norm(x, w, b)


def _reference(kind, x, w, b):
    return rms_norm_reference(x, w) if kind == "rms" else layer_norm_reference(x, w, b)


def _check(kind, x, w, b, dtype_out, grads=True):
    """Forward and (optionally) backward of the kernel against float64 on the same rounded values."""
    leaves = [t.detach().requires_grad_() for t in (x, w) + ((b,) if b is not None else ())]
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    y = _run(kind, *leaves[:2], leaves[2] if b is not None else None)
    y_ref = _reference(kind, *ref_leaves[:2], ref_leaves[2] if b is not None else None)
    assert y.dtype == dtype_out and y.shape == x.shape
    _close(y, y_ref, dtype_out, f"{kind} output")
    if not grads:
        return y
    dy = torch.randn(x.shape, dtype=torch.float64, device=x.device).to(x.dtype)
    y.backward(dy)
    y_ref.backward(dy.double())
    for name, leaf, ref in zip(("dx", "dweight", "dbias"), leaves, ref_leaves):
        assert leaf.grad.dtype == leaf.dtype, f"{name} dtype {leaf.grad.dtype} != {leaf.dtype}"
        _close(leaf.grad, ref.grad, leaf.dtype, f"{kind} {name}")
    return y


# ---------------------------------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("h", HIDDEN)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_forward_backward_against_float64(seed, kind, h, dtype):
    for leading in LEADING:
        x = (0.5 + 2 * torch.randn(*leading, h)).to(dtype)  # an offset, so LayerNorm's centring matters
        w, b = _params(kind.replace("_nobias", ""), h, dtype)
        _check(kind.replace("_nobias", ""), x, w, b, dtype)


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp32_weight_with_low_precision_x(seed, kind, dtype):
    x = torch.randn(2, 7, 100).to(dtype)
    w, b = _params(kind, 100, torch.float32)
    y = _check(kind, x, w, b, dtype)
    assert y.dtype == dtype


def test_one_element_rows_and_empty_input(seed):
    x = torch.randn(5, 1)
    w = torch.randn(1)
    _check("layer", x, w, torch.randn(1), torch.float32)
    # With H = 1, RMSNorm's dx = rstd·g·eps/(x² + eps) is ~1e-6 of its terms: the fp32 cancellation in
    # it is measured against rstd·g, not against dx itself.
    _check("rms", x, w, None, torch.float32, grads=False)
    xr, xd = x.clone().requires_grad_(), x.double().requires_grad_()
    rms_norm(xr, w).backward(torch.ones_like(x))
    rms_norm_reference(xd, w.double()).backward(torch.ones_like(xd))
    assert ((xr.grad - xd.grad).abs() <= TOL[torch.float32] * w.abs() / x.abs()).all()
    empty = torch.randn(0, 3, 8, requires_grad=True)
    w8 = torch.randn(8, requires_grad=True)
    y = rms_norm(empty, w8)
    y.sum().backward()
    assert y.shape == (0, 3, 8) and torch.equal(w8.grad, torch.zeros(8))


def test_leading_dims_match_flat_rows(seed):
    """The same rows give the same bits whatever the leading shape."""
    x, w = torch.randn(6, 35), torch.randn(35)
    assert torch.equal(rms_norm(x.view(2, 3, 35), w).view(6, 35), rms_norm(x, w))


# ---------------------------------------------------------------------------------------------------- layout


def _spy_forward(monkeypatch):
    seen = []
    forward = norm_module._forward

    def spy(x, *args):
        out = forward(x, *args)
        seen.append(out[1].data_ptr())
        return out

    monkeypatch.setattr(norm_module, "_forward", spy)
    return seen


def test_strided_rows_are_read_in_place(seed, monkeypatch):
    seen = _spy_forward(monkeypatch)
    base = torch.randn(4, 9, 64)
    x = base[:, ::2, :48]  # rows strided along two leading dims, the last dim sliced: no copy needed
    w, b = _params("layer", 48, torch.float32)
    _check("layer", x, w, b, torch.float32)
    assert seen[0] == x.data_ptr()


def test_token_major_view_keeps_its_layout(seed, monkeypatch):
    """A [B, S, H] view of an [S, B, H] buffer (what the parallel linear layers return) is not copied,
    and the output and input gradient have the same layout."""
    seen = _spy_forward(monkeypatch)
    x = torch.randn(7, 2, 100).transpose(0, 1)
    w, _ = _params("rms", 100, torch.float32)
    xr = x.detach().requires_grad_()
    y = rms_norm(xr, w)
    y.backward(torch.randn(7, 2, 100).transpose(0, 1))
    assert seen[0] == x.data_ptr()
    assert y.stride() == x.stride() and xr.grad.stride() == x.stride()
    _check("rms", x, w, None, torch.float32)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(100, 2, 7).permute(1, 2, 0),  # last dim strided: copied first
        lambda: torch.randn(3, 8, 5, 2, 100)[:, ::2, :, ::2],  # three leading runs: copied first
        lambda: torch.randn(1, 100).expand(6, 100),  # broadcast rows (stride 0) are read in place
    ],
)
def test_layouts_that_need_or_skip_a_copy_are_correct(seed, make):
    x = make()
    w, b = _params("layer", 100, torch.float32)
    _check("layer", x, w, b, torch.float32)
    _check("rms", x, w, None, torch.float32)


def test_broadcast_gradient(seed):
    """``y.sum().backward()`` hands the backward an expanded (stride 0) gradient."""
    x = torch.randn(3, 5, 48, requires_grad=True)
    w = torch.randn(48, requires_grad=True)
    layer_norm(x, w).sum().backward()
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    layer_norm_reference(xd, wd).sum().backward()
    _close(x.grad, xd.grad, torch.float32, "dx")
    _close(w.grad, wd.grad, torch.float32, "dweight")


# ---------------------------------------------------------------------------------------------------- robustness


def test_no_nan_for_constant_zero_and_large_rows(seed):
    """A row of zeros (variance 0), a constant row, and fp16 values whose squares overflow fp16."""
    x = torch.randn(4, 100).half()
    x[0] = 0
    x[1] = 3
    x[2] = 6e4 * torch.sign(torch.randn(100)).half()
    w = torch.randn(100).half()
    for kind, b in (("rms", None), ("layer", torch.randn(100).half())):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = _run(kind, xr, wr, b)
        y.backward(torch.randn(4, 100).half())
        assert torch.isfinite(y).all() and torch.isfinite(xr.grad).all() and torch.isfinite(wr.grad).all(), kind
    _check("rms", x[2:], w, None, torch.float16)


def test_backward_is_deterministic(seed):
    x = torch.randn(3, 11, 100)
    w, b = _params("layer", 100, torch.float32)
    dy = torch.randn(3, 11, 100)
    grads = []
    for _ in range(2):
        ws = w.clone().requires_grad_()
        layer_norm(x, ws, b).backward(dy)
        grads.append(ws.grad)
    assert torch.equal(*grads)


def test_no_grad_and_frozen_weight(seed):
    x, w = torch.randn(2, 5, 48), torch.randn(48)
    with torch.no_grad():
        assert not rms_norm(x.requires_grad_(), w).requires_grad
    xr = torch.randn(2, 5, 48, requires_grad=True)
    rms_norm(xr, w).sum().backward()  # weight without requires_grad: only dx
    assert xr.grad is not None and w.grad is None


def test_reference_backend_matches(seed, monkeypatch):
    """The CPU fallback (no interpreter) runs the same formulas through PyTorch."""
    monkeypatch.setattr(norm_module, "backend_for", lambda *t: norm_module.Backend.REFERENCE)
    for kind in ("rms", "layer"):
        x = torch.randn(2, 7, 100)
        w, b = _params(kind, 100, torch.float32)
        _check(kind, x, w, b, torch.float32)
        _check(kind, x.half(), w, None if b is None else b, torch.float16)


# ---------------------------------------------------------------------------------------------------- errors

X = torch.randn(2, 8)
W = torch.randn(8)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: rms_norm([1.0], W), TypeError, "x must be a torch.Tensor, received list"),
        (lambda: rms_norm(X.double(), W), TypeError, "x must be float32, float16 or bfloat16, received torch.float64"),
        (lambda: rms_norm(torch.ones(2, 8, dtype=torch.int32), W), TypeError, "received torch.int32"),
        (lambda: rms_norm(torch.tensor(1.0), W[:1]), ValueError, "at least one dimension"),
        (lambda: rms_norm(torch.randn(2, 0), W[:0]), ValueError, r"last dimension must be in \[1, 65536\]"),
        (lambda: rms_norm(torch.randn(1, MAX_HIDDEN + 1), W), ValueError, "received shape"),
        (lambda: rms_norm(X, W[:7]), ValueError, r"weight must have shape \(8,\).*received \(7,\)"),
        (lambda: rms_norm(X, W.view(2, 4)), ValueError, r"received \(2, 4\)"),
        (lambda: rms_norm(X, W.half()), TypeError, "weight must be torch.float32.*received torch.float16"),
        (lambda: rms_norm(X.half(), W.bfloat16()), TypeError, "weight must be torch.float16 .* or torch.float32"),
        (lambda: rms_norm(X, "w"), TypeError, "weight must be a torch.Tensor"),
        (lambda: rms_norm(X, W.to("meta")), ValueError, "weight must be on x's device cpu, received meta"),
        (lambda: rms_norm(X.to("meta"), W.to("meta")), ValueError, "run on 'cuda' or 'cpu'"),
        (lambda: rms_norm(X, W, eps=-1e-6), ValueError, "eps must be finite and non-negative, received -1e-06"),
        (lambda: rms_norm(X, W, eps=float("nan")), ValueError, "eps must be finite"),
        (lambda: rms_norm(X, W, eps=True), TypeError, "eps must be a real number, received bool"),
        (lambda: rms_norm(X, W, eps="1e-6"), TypeError, "eps must be a real number, received str"),
        (lambda: layer_norm(X, W, W[:3]), ValueError, r"bias must have shape \(8,\)"),
        (lambda: layer_norm(X.half(), W.half(), W.bfloat16()), TypeError, "bias must be torch.float16"),
    ],
)
def test_bad_input(call, error, words):
    with pytest.raises(error, match=words):
        call()


# ---------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("h", [100, 1024, 4096, 8192, 12288])
def test_gpu_against_float64(seed, kind, dtype, h):
    x = (0.5 + torch.randn(4, 257, h)).to("cuda", dtype)
    w, b = _params(kind, h, dtype, "cuda")
    _check(kind, x, w, b, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_gpu_mixed_weight_and_token_major_layout(seed, kind):
    x = torch.randn(300, 3, 2048, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
    w, b = _params(kind, 2048, torch.float32, "cuda")
    y = _check(kind, x, w, b, torch.bfloat16)
    assert y.stride() == x.stride()


@pytest.mark.gpu
def test_gpu_backward_is_deterministic(seed):
    x = torch.randn(8192, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, device="cuda", dtype=torch.float32)
    dy = torch.randn_like(x)
    grads = []
    for _ in range(2):
        ws = w.clone().requires_grad_()
        rms_norm(x, ws).backward(dy)
        grads.append(ws.grad)
    assert torch.equal(*grads)
