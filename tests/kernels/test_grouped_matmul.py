"""The experts' grouped GEMM (kernels/grouped_matmul.py) against float64: output, dA and dB, with experts of
every size (none, fewer rows than a tile, several tiles), odd widths, transposed weight views, every dtype."""

from __future__ import annotations

import itertools

import pytest
import torch

from tessel.kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _offsets(counts, device="cpu"):
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int64, device=device)


def _float64(a, b, offsets):
    bounds = offsets.tolist()
    return torch.cat([a[bounds[e] : bounds[e + 1]] @ b[e] for e in range(b.shape[0])])


def _check(counts, k, n, dtype, transposed_b=True, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(counts)
    a = torch.randn(rows, k, generator=gen).to(device, dtype).requires_grad_()
    weight = (
        torch.randn(len(counts), n, k, generator=gen) if transposed_b else torch.randn(len(counts), k, n, generator=gen)
    )
    weight = weight.to(device, dtype).requires_grad_()
    b = weight.transpose(1, 2) if transposed_b else weight
    offsets = _offsets(counts, device)
    out = grouped_matmul(a, b, offsets)
    assert out.shape == (rows, n) and out.dtype == dtype
    a64, w64 = a.detach().cpu().double().requires_grad_(), weight.detach().cpu().double().requires_grad_()
    want = _float64(a64, w64.transpose(1, 2) if transposed_b else w64, offsets.cpu())
    dout = torch.randn(rows, n, generator=gen).to(device, dtype)
    out.backward(dout)
    want.backward(dout.cpu().double())
    for name, got, ref in (("out", out, want), ("da", a.grad, a64.grad), ("db", weight.grad, w64.grad)):
        err = ((got.detach().cpu().double() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()
        assert err <= TOL[dtype], f"{name}: relative error {err:.3g} ({counts}, k={k}, n={n}, {dtype})"
    return weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "counts, k, n",
    [([5, 0, 17, 3], 24, 19), ([0, 0, 33], 16, 8), ([1], 37, 5), ([16, 16], 16, 16), ([9, 2, 0, 0, 21, 4, 1], 10, 33)],
)
def test_grouped_matmul_matches_float64(counts, k, n, dtype):
    _check(counts, k, n, dtype)


def test_grouped_matmul_takes_row_major_weights_too():
    _check([7, 0, 12], 20, 11, torch.float32, transposed_b=False)


def test_an_expert_without_rows_gets_a_zero_weight_gradient():
    grad = _check([6, 0, 9, 0], 12, 8, torch.float32)
    assert grad[1].abs().sum() == 0 and grad[3].abs().sum() == 0 and grad[0].abs().sum() > 0


def test_no_rows_at_all():
    a = torch.zeros(0, 8, requires_grad=True)
    w = torch.randn(3, 8, 4, requires_grad=True)
    out = grouped_matmul(a, w, _offsets([0, 0, 0]))
    assert out.shape == (0, 4)
    out.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w)) and a.grad.shape == (0, 8)


def test_weight_grad_alone_matches_float64_and_refuses_bad_input():
    from tessel.kernels.grouped_matmul import grouped_weight_grad

    a, g = torch.randn(13, 7), torch.randn(13, 5)
    offsets = _offsets([3, 0, 10])
    got = grouped_weight_grad(a, g, offsets, 3)
    bounds = offsets.tolist()
    want = torch.stack(
        [a[bounds[e] : bounds[e + 1]].double().T @ g[bounds[e] : bounds[e + 1]].double() for e in range(3)]
    )
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="num_experts must be a positive int, received 0"):
        grouped_weight_grad(a, g, offsets, 0)
    with pytest.raises(ValueError, match=r"g must be \[R, N\] with a's R = 13 rows, received \(12, 5\)"):
        grouped_weight_grad(a, g[:12], offsets, 3)
    with pytest.raises(ValueError, match="offsets must be an int32/int64"):
        grouped_weight_grad(a, g, offsets, 2)


@pytest.mark.parametrize("counts", [[19, 0, 30, 5, 17], [40], [0, 3, 0]])
def test_weight_grad_of_row_contiguous_operands_counts_each_experts_rows_only(counts):
    """Operands whose rows are contiguous (fp8's transposed copies) are read from 16-row boundaries, so a step also
    loads rows of the expert before: they must count nothing, and rows past the last must not be read."""
    from tessel.kernels.grouped_matmul import grouped_weight_grad

    rows = sum(counts)
    a = torch.randn(7, rows).t()  # [R, K] with unit stride along the rows
    g = torch.randn(9, rows).t()
    assert a.stride(0) == 1 and g.stride(0) == 1
    offsets = _offsets(counts)
    got = grouped_weight_grad(a, g, offsets, len(counts))
    bounds = offsets.tolist()
    want = torch.stack([a[lo:hi].double().T @ g[lo:hi].double() for lo, hi in itertools.pairwise(bounds)])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_reference_is_the_definition():
    a, b = torch.randn(10, 6, dtype=torch.float64), torch.randn(3, 6, 5, dtype=torch.float64)
    offsets = _offsets([4, 0, 6])
    torch.testing.assert_close(grouped_matmul_reference(a, b, offsets), _float64(a, b, offsets))


@pytest.mark.parametrize(
    "args, error, match",
    [
        (
            (torch.randn(4, 3), torch.randn(2, 4, 5), _offsets([2, 2])),
            ValueError,
            r"expected a \[R, K\] and b \[X, K, N\]",
        ),
        ((torch.randn(4, 3), torch.randn(2, 3, 5).half(), _offsets([2, 2])), ValueError, "must share one dtype"),
        (
            (torch.randn(4, 3), torch.randn(2, 3, 5), _offsets([4])),
            ValueError,
            r"offsets must be an int32/int64 \[X\+1\] = \[3\]",
        ),
        ((torch.randn(4, 3), torch.randn(2, 3, 5), _offsets([2, 2]).float()), ValueError, "received torch.float32"),
        ((torch.randn(4, 3), [1.0], _offsets([2, 2])), TypeError, "b must be a torch.Tensor, received list"),
    ],
)
def test_bad_input_is_refused(args, error, match):
    with pytest.raises(error, match=match):
        grouped_matmul(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matmul_on_cuda_matches_float64(dtype):
    """The autotuned compiled kernels, Llama-MoE-like widths and ragged experts (some empty)."""
    counts = [300, 0, 1, 129, 64, 0, 517, 7]
    _check(counts, 512, 384, dtype, device="cuda")
    _check(counts, 384, 512, dtype, device="cuda", transposed_b=False)
