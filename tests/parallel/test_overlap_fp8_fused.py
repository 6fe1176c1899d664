"""The fp8 column ops with several weights sharing one input (Q, K, V; gate, up): one gather (or one all-reduce of the
input gradient) for all of them, the weights quantised as one.

Each op with weights ``[W_1, W_2, W_3]`` (biases ``b_1``, none, ``b_3``) equals the op on the fused weight
``[W_1; W_2; W_3]`` (biases concatenated, zeros for the missing one) cut into each weight's columns: its outputs,
input gradient, and each weight's and bias's gradient, on 2 and 4 gloo ranks, ring, plain and peer. The bytes are
the fused op's (one gather), a third of those of three ops; a zero-bubble schedule's deferral postpones every
weight's gradient and then gives the combined backward's; a frozen weight gets no gradient, the others theirs.
"""

import pytest
import torch

from tests.multiprocess import REFERENCE_KERNELS, run_ranks

M, K, SIZES = 5, 24, (8, 4, 4)  # rows per rank, input features, each weight's output features


def _operands(rank, t, op, dtype):
    """``(x, weights, biases)`` seeded alike on every rank but x (the second weight without a bias)."""
    g = torch.Generator().manual_seed(3)
    weights = [(torch.randn(n, K, generator=g) / 4).to(dtype) for n in SIZES]
    biases = [torch.randn(n, generator=g).to(dtype) for n in SIZES]
    biases[1] = None
    rows = M if op == "fp8_all_gather_matmul" else t * M + 1  # (an all-reduce's rows need not divide)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(10 + rank)).to(dtype)
    return x, weights, biases


def _leaves(*tensors):
    return [None if t is None else t.clone().requires_grad_() for t in tensors]


def _fused_against_several(rank, t, op, overlap, dtype):
    from tessel.parallel import count_bytes, overlap_fp8

    fn = getattr(overlap_fp8, op)
    x, weights, biases = _operands(rank, t, op, dtype)
    grads = [torch.randn(t * M if op == "fp8_all_gather_matmul" else t * M + 1, n,
                         generator=torch.Generator().manual_seed(20 + rank + i)).to(dtype)
             for i, n in enumerate(SIZES)]  # fmt: skip
    xs, ws, bs = _leaves(x), _leaves(*weights), _leaves(*biases)
    with count_bytes() as several_bytes:
        outs = fn(xs[0], ws, biases=bs, overlap=overlap)
        torch.autograd.backward(outs, grads)
    xf, wf = _leaves(x, torch.cat(weights))
    bf = _leaves(torch.cat([torch.zeros(n, dtype=dtype) if b is None else b for n, b in zip(SIZES, biases)]))[0]
    with count_bytes() as fused_bytes:
        fused = fn(xf, wf, biases=bf, overlap=overlap)
        fused.backward(torch.cat(grads, dim=1))
    cut = lambda tensor: tensor.split(SIZES)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=0, atol=0)
    for y, ref in zip(outs, fused.split(SIZES, dim=1), strict=True):
        torch.testing.assert_close(y, ref, **tol)
    torch.testing.assert_close(xs[0].grad, xf.grad, **tol)
    for w, ref in zip(ws, cut(wf.grad), strict=True):
        torch.testing.assert_close(w.grad, ref, **tol)
    for b, ref in zip(bs, cut(bf.grad), strict=True):
        assert (b is None) or torch.allclose(b.grad, ref, **tol), "a bias gradient"
    assert (several_bytes.sent, several_bytes.received) == (fused_bytes.sent, fused_bytes.received)
    return several_bytes.sent


def _worker(rank, t, dtypes):
    sent = {}
    for op in ("fp8_all_gather_matmul", "fp8_matmul_grad_all_reduce"):
        for overlap in (True, False, "peer"):
            for dtype in dtypes:
                sent[op, overlap, dtype] = _fused_against_several(rank, t, op, overlap, dtype)
    return sent


@pytest.mark.multiprocess
@pytest.mark.parametrize("t, kernels", [(2, "interpreter"), (4, "reference")])
def test_several_weights_are_the_fused_weight(t, kernels):
    """Ring, plain and through the device-signalled transports, fp32 (to a rounding: the fused op multiplies every
    column in one GEMM) and bf16 (bit for bit), against the fused weight: each weight's outputs and gradients are its
    columns of the fused op's."""
    if kernels == "interpreter":  # Triton's fp8 GEMM on each weight's rows of the fused fp8 data (fp32 alone: the
        # interpreter's dot of 16-bit operands is not the GPU's)
        results = run_ranks(_worker, t, (torch.float32,), timeout=600)
    else:
        results = run_ranks(_worker, t, (torch.float32, torch.bfloat16), timeout=300, env=REFERENCE_KERNELS)
    for sent in results:
        assert all(v > 0 for v in sent.values()), sent


def _bytes_of(rank, t, op, several):
    """The bytes one op over the three weights (``several``), or three ops of one weight each, sent forward and
    backward."""
    from tessel.parallel import count_bytes, overlap_fp8

    fn = getattr(overlap_fp8, op)
    x, weights, biases = _operands(rank, t, op, torch.float32)
    x = x.requires_grad_()
    weights = [w.requires_grad_() for w in weights]
    with count_bytes() as counted:
        outs = fn(x, weights, biases=biases) if several else [fn(x, w, biases=b) for w, b in zip(weights, biases)]
        torch.autograd.backward(outs, [torch.ones_like(y) for y in outs])
    return counted.sent


def _bytes_worker(rank, t):
    ops = ("fp8_all_gather_matmul", "fp8_matmul_grad_all_reduce")
    return {op: (_bytes_of(rank, t, op, True), _bytes_of(rank, t, op, False)) for op in ops}


@pytest.mark.multiprocess
def test_one_gather_for_every_weight():
    """Three weights in one op move a third of three ops' bytes: one gather of the fp8 input (with its scale's
    all-reduce) and one reduce-scatter of the summed input gradient, or one all-reduce of it."""
    t = 2
    ring = lambda nbytes: (t - 1) * nbytes // t
    amax = 2 * (t - 1) * 4 // t
    expected = {
        "fp8_all_gather_matmul": ring(t * M * K) + amax + ring(t * M * K * 4),
        "fp8_matmul_grad_all_reduce": 2 * ring((t * M + 1) * K * 4),
    }
    for result in run_ranks(_bytes_worker, t):
        for op, (one_op, three_ops) in result.items():
            assert one_op == expected[op] and three_ops == 3 * expected[op], (op, one_op, three_ops, expected[op])


def _deferred(rank, t, op):
    """Under a zero-bubble schedule's deferral every weight's gradient waits for W, then equals the combined
    backward's."""
    from tessel.parallel import overlap_fp8
    from tessel.parallel.pipeline.weight_grad import defer_weight_grads

    fn = getattr(overlap_fp8, op)
    x, weights, biases = _operands(rank, t, op, torch.float32)
    runs = []
    for defer in (False, True):
        xs, ws, bs = _leaves(x), _leaves(*weights), _leaves(*biases)
        outs = fn(xs[0], ws, biases=bs)
        loss = sum((y * y).sum() for y in outs)
        if defer:
            with defer_weight_grads() as store:
                loss.backward()
            assert len(store) == 1 and all(w.grad is None for w in ws), "the weight gradients must wait for W"
            store.run()
        else:
            loss.backward()
        runs.append([xs[0].grad, *(w.grad for w in ws), bs[0].grad, bs[2].grad])
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.multiprocess
@pytest.mark.parametrize("op", ["fp8_all_gather_matmul", "fp8_matmul_grad_all_reduce"])
def test_every_weight_gradient_is_deferred_together(op):
    run_ranks(_deferred, 2, op)


def _frozen(rank, t, op):
    """The middle weight and the last bias frozen: no gradient for them, the others' as when all learn."""
    from tessel.parallel import overlap_fp8

    fn = getattr(overlap_fp8, op)
    x, weights, biases = _operands(rank, t, op, torch.float32)
    runs = []
    for frozen in (False, True):
        xs, ws, bs = _leaves(x), _leaves(*weights), _leaves(*biases)
        if frozen:
            ws[1].requires_grad_(False)
            bs[2].requires_grad_(False)
        sum((y * y).sum() for y in fn(xs[0], ws, biases=bs)).backward()
        runs.append([xs[0].grad, ws[0].grad, ws[1].grad, ws[2].grad, bs[0].grad, bs[2].grad])
    learning, frozen = runs
    assert frozen[2] is None and frozen[5] is None
    for i in (0, 1, 3, 4):
        torch.testing.assert_close(frozen[i], learning[i])


@pytest.mark.multiprocess
@pytest.mark.parametrize("op", ["fp8_all_gather_matmul", "fp8_matmul_grad_all_reduce"])
def test_a_frozen_weight_gets_no_gradient(op):
    run_ranks(_frozen, 2, op)
