"""fp8_linear, Fp8Linear and convert_to_fp8 in one process.

The exact check: every GEMM of forward and backward must equal the float64 product of the quantised operands the
recipe prescribes (x and W in e4m3, dY in e5m2, each with its own per-tensor scale), up to fp32 accumulation and one
rounding of the result (two ulps of the output dtype relative to |A|·|B| + |C|, as tests/kernels/test_matmul.py).
A wrong format, scale or transposition anywhere moves a result by a whole fp8 step (2⁻⁴ to 2⁻³ relative), far
outside that bound. The loose check: against the unquantised float64 layer, within what 3 (e4m3) and 2 (e5m2)
mantissa bits allow.
"""

import pytest
import torch
from torch import nn

from tessel.kernels import quantize_fp8_reference
from tessel.layers import ColumnParallelLinear, Fp8Linear, RowParallelLinear, convert_to_fp8, fp8_linear

RTOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _deq(x, fmt):
    q = quantize_fp8_reference(x, fmt)
    return q.data.double() * q.scale_inv.double()


def _close(got, a, b, want, dtype, what):
    """|got - want| ≤ RTOL·(|a|·|b| + |want|) elementwise."""
    allowed = RTOL[dtype] * (a.abs() @ b.abs() + want.abs()) + 1e-30
    err = (got.double() - want).abs()
    assert (err <= allowed).all(), f"{what}: max error {err.max().item():.3g} ({dtype})"


def _inputs(dtype, t=2, s=9, k=40, n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, s, k, generator=g) * 2).to(dtype)
    w = (torch.randn(n, k, generator=g) / 6).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    gy = torch.randn(t, s, n, generator=g).to(dtype)
    return x, w, b, gy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_gemm_is_the_exact_product_of_its_fp8_operands(dtype):
    x, w, b, gy = _inputs(dtype)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    y = fp8_linear(xr, wr, br)
    assert y.dtype == dtype and y.shape == (2, 9, 24)
    y.backward(gy)
    x2, g2 = x.reshape(-1, 40), gy.reshape(-1, 24)
    xq, wq, gq = _deq(x2, "e4m3"), _deq(w, "e4m3"), _deq(g2, "e5m2")
    _close(y.reshape(-1, 24), xq, wq.t(), xq @ wq.t() + b.double(), dtype, "output")
    _close(xr.grad.reshape(-1, 40), gq, wq, gq @ wq, dtype, "input grad")
    _close(wr.grad, gq.t(), xq, gq.t() @ xq, dtype, "weight grad")
    torch.testing.assert_close(br.grad.double(), g2.double().sum(0), rtol=RTOL[dtype], atol=1e-6)


def test_close_to_the_unquantised_layer():
    """e4m3 rounds each operand to 2⁻⁴ relative and e5m2 to 2⁻³; over 40 random products the errors average out:
    the output comes within ~3% (Frobenius) of the float64 layer, the gradients within ~6%. Checked at 6% and 12%."""
    x, w, b, gy = _inputs(torch.float32, seed=1)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    fp8_linear(xr, wr, br).backward(gy)
    xd, wd, bd = (t.double().requires_grad_() for t in (x, w, b))
    y = nn.functional.linear(xd, wd, bd)
    y.backward(gy.double())

    def rel(got, want):
        return ((got.double() - want).norm() / want.norm()).item()

    assert rel(fp8_linear(x, w, b), y.detach()) < 0.06
    assert rel(xr.grad, xd.grad) < 0.12 and rel(wr.grad, wd.grad) < 0.12
    assert rel(br.grad, bd.grad) < 1e-6  # the bias gradient is Σ dY, unquantised


def test_only_the_gradients_asked_for_are_computed():
    x, w, b, gy = _inputs(torch.float32, seed=2)
    wr = w.clone().requires_grad_()
    y = fp8_linear(x, wr)  # x needs no gradient: its transpose is never quantised
    (dw,) = torch.autograd.grad(y, wr, gy)
    xq, gq = _deq(x.reshape(-1, 40), "e4m3"), _deq(gy.reshape(-1, 24), "e5m2")
    _close(dw, gq.t(), xq, gq.t() @ xq, torch.float32, "weight grad")
    xr = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(fp8_linear(xr, w, b), xr, gy)
    wq = _deq(w, "e4m3")
    _close(dx.reshape(-1, 40), gq, wq, gq @ wq, torch.float32, "input grad")


def test_fp8_linear_refuses_bad_input():
    x, w, b, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match=r"x must end in weight's 40 in_features, received shape \(2, 9, 24\)"):
        fp8_linear(x[..., :24], w)
    with pytest.raises(ValueError, match=r"x must share weight's dtype and device \(torch\.float32, cpu\)"):
        fp8_linear(x.bfloat16(), w)
    with pytest.raises(TypeError, match=r"weight must be float32, float16 or bfloat16, received torch\.float64"):
        fp8_linear(x, w.double())
    with pytest.raises(ValueError, match=r"bias must be a \(24,\) torch\.float32 tensor, received \(23,\)"):
        fp8_linear(x, w, b[:23])
    with pytest.raises(ValueError, match=r"weight must be 2-D"):
        fp8_linear(x, w[0])


def test_fp8_linear_keeps_nn_linear_parameters_and_state():
    dense = nn.Linear(48, 32)
    layer = Fp8Linear.from_linear(dense)
    assert layer.weight is dense.weight and layer.bias is dense.bias
    assert list(layer.state_dict()) == ["weight", "bias"]
    x = torch.randn(5, 48)
    want = fp8_linear(x, dense.weight, dense.bias)
    assert torch.equal(layer(x), want)
    with pytest.raises(TypeError, match=r"expected an nn\.Linear, received ReLU"):
        Fp8Linear.from_linear(nn.ReLU())


def test_fp8_linear_keeps_the_hooks_of_the_layer_it_replaces():
    """parallelize hooks the projections of a context-parallel mixer; convert_to_fp8 after it must keep them."""
    dense, seen = nn.Linear(48, 32), []
    dense.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    dense.register_forward_hook(lambda m, args, out: seen.append(out.shape) or out + 1, always_call=True)
    dense.register_forward_pre_hook(lambda m, args, kwargs: (args, kwargs), with_kwargs=True)
    layer = Fp8Linear.from_linear(dense)
    x = torch.randn(5, 48)
    assert torch.equal(layer(x), fp8_linear(x * 2, dense.weight, dense.bias) + 1) and seen == [(5, 32)]


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.odd = nn.Linear(64, 40)  # 40 is not a multiple of 16: left in higher precision
        self.col = ColumnParallelLinear(64, 48)
        self.row = RowParallelLinear(48, 32)
        self.lm_head = nn.Linear(32, 64)


def test_convert_to_fp8_turns_on_every_eligible_layer():
    model = _Model()
    params = dict(model.named_parameters())
    assert convert_to_fp8(model) is model
    assert type(model.up) is Fp8Linear and type(model.odd) is nn.Linear and type(model.lm_head) is nn.Linear
    assert model.col.fp8 and model.row.fp8 and "fp8=True" in repr(model.col)
    assert dict(model.named_parameters()) == params  # the same parameter objects: optimizers keep working
    again = _Model()
    convert_to_fp8(again, skip=(), include=lambda name, module: name != "row")
    assert type(again.lm_head) is Fp8Linear and again.col.fp8 and not again.row.fp8
    assert type(convert_to_fp8(nn.Linear(16, 16))) is Fp8Linear
    with pytest.raises(TypeError, match="skip must be a tuple of name globs"):
        convert_to_fp8(model, skip="lm_head")
    with pytest.raises(TypeError, match=r"model must be an nn\.Module, received int"):
        convert_to_fp8(3)
    with pytest.raises(TypeError, match="fp8 must be a bool, received str"):
        ColumnParallelLinear(16, 16, fp8="yes")


def test_parallel_layers_of_one_rank_run_fp8_linear():
    """At tp=1 a layer with fp8=True computes exactly fp8_linear on its weight, forward and backward; from_linear
    of an Fp8Linear keeps fp8 on."""
    dense = nn.Linear(40, 32)
    col = ColumnParallelLinear.from_linear(Fp8Linear.from_linear(dense))
    row = RowParallelLinear.from_linear(dense, fp8=True)
    assert col.fp8 and row.fp8
    x = torch.randn(2, 6, 40)
    for layer in (col, row):
        xr = x.clone().requires_grad_()
        y = layer(xr)
        assert torch.equal(y, fp8_linear(x, dense.weight, dense.bias))
        y.sum().backward()
        xw = x.clone().requires_grad_()
        fp8_linear(xw, dense.weight, dense.bias).sum().backward()
        assert torch.equal(xr.grad, xw.grad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_linear_on_the_gpu():
    """The compiled kernels (quantising, the three autotuned fp8 GEMMs) against float64 on the same fp8 operands:
    the backward's split accumulator keeps bf16's two-ulp bound; the forward accumulates as sm_90's fp8 tensor cores
    do fastest (~14 bits), checked at 3% of |A|·|B|."""
    x, w, b, gy = (t.cuda() for t in _inputs(torch.bfloat16, t=4, s=500, k=1024, n=768, seed=3))
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    y = fp8_linear(xr, wr, br)
    y.backward(gy)
    x2, g2 = x.reshape(-1, 1024).cpu(), gy.reshape(-1, 768).cpu()
    xq, wq, gq = _deq(x2, "e4m3"), _deq(w.cpu(), "e4m3"), _deq(g2, "e5m2")
    out = xq @ wq.t() + b.cpu().double()
    allowed = 3e-2 * (xq.abs() @ wq.abs().t() + out.abs())
    assert ((y.reshape(-1, 768).cpu().double() - out).abs() <= allowed).all()
    _close(xr.grad.reshape(-1, 1024).cpu(), gq, wq, gq @ wq, torch.bfloat16, "input grad")
    _close(wr.grad.cpu(), gq.t(), xq, gq.t() @ xq, torch.bfloat16, "weight grad")


# ------------------------------------------------------------------------------------------------ experts in fp8


def _grouped_case(counts, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = sum(counts)
    x = (torch.randn(rows, k, generator=g) * 2).to(dtype)
    # The experts' magnitudes far apart: each expert's own scale must be the one applied to its rows.
    w = (torch.randn(len(counts), n, k, generator=g) * torch.logspace(-3, 2, len(counts)).view(-1, 1, 1)).to(dtype)
    gy = torch.randn(rows, n, generator=g).to(dtype)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    return x, w, gy, offsets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts, k, n", [([5, 0, 17, 3], 24, 19), ([1], 37, 5), ([9, 2, 0, 21, 4, 1], 33, 16)])
def test_fp8_grouped_linear_is_the_exact_product_of_its_fp8_operands(dtype, counts, k, n):
    """Every expert's rows (none, fewer than a tile, several tiles) times its own weight: x and each expert's weight
    in e4m3 (one scale per expert), dY in e5m2, each GEMM the float64 product of those values to fp32 rounding;
    an expert without rows gets a zero weight gradient."""
    from tessel.layers import fp8_grouped_linear

    x, w, gy, offsets = _grouped_case(counts, k, n, dtype, seed=len(counts) + k)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_grouped_linear(xr, wr, offsets)
    assert y.shape == (sum(counts), n) and y.dtype == dtype
    y.backward(gy)
    xq, gq = _deq(x, "e4m3"), _deq(gy, "e5m2")
    q = quantize_fp8_reference(w, "e4m3")
    wq = q.data.double() * q.scale_inv.double().view(-1, 1, 1)
    for e, (lo, hi) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)):
        xe, ge = xq[lo:hi], gq[lo:hi]
        _close(y[lo:hi], xe, wq[e].t(), xe @ wq[e].t(), dtype, f"expert {e} output")
        _close(xr.grad[lo:hi], ge, wq[e], ge @ wq[e], dtype, f"expert {e} input grad")
        _close(wr.grad[e], ge.t(), xe, ge.t() @ xe, dtype, f"expert {e} weight grad")


def test_fp8_grouped_linear_refuses_bad_input():
    from tessel.layers import fp8_grouped_linear

    x, w, _, offsets = _grouped_case([3, 4], 16, 8, torch.float32)
    with pytest.raises(
        ValueError, match=r"weight must be \[X, N, K\] \(one nn\.Linear layout per expert\), received \(8, 16\)"
    ):
        fp8_grouped_linear(x, w[0], offsets)
    with pytest.raises(ValueError, match=r"expected a \[R, K\] and b \[X, K, N\]"):
        fp8_grouped_linear(x[:, :8], w, offsets)


def test_convert_to_fp8_turns_on_the_experts_of_a_mixture():
    """A ParallelMoE's experts run fp8_grouped_linear once converted (the router stays in the model's dtype), and
    from_module keeps the setting."""
    from tessel.layers.moe import ParallelMoE

    torch.manual_seed(0)
    moe = ParallelMoE(32, 48, 4, 2)
    assert not moe.fp8
    convert_to_fp8(moe)
    assert moe.fp8 and "fp8=True" in repr(moe) and ParallelMoE.from_module(moe).fp8
    x = torch.randn(2, 5, 32, requires_grad=True)
    y = moe(x)
    y.sum().backward()
    dense = ParallelMoE.from_module(moe)
    dense.fp8 = False
    xd = x.detach().clone().requires_grad_()
    yd = dense(xd)
    rel = ((y - yd).norm() / yd.norm()).item()
    assert 1e-4 < rel < 0.1, rel  # fp8's rounding (a few %), but not the higher-precision result
    assert moe.fc.grad is not None and moe.proj.grad is not None and moe.router.grad is not None
    odd = ParallelMoE(32, 40, 4, 2)  # 40 hidden features: not a multiple of 16, left as it is
    assert not convert_to_fp8(odd).fp8
