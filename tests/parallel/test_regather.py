"""``all_gather_matmul(..., regather=True)``: the same results from 1/t of the saved activation.

On 2 and 4 gloo ranks the op runs with and without re-gathering: outputs, input gradients and weight
gradients must be identical (the same GEMMs on the same gathered values), the tensors saved for backward
must hold the input shard instead of the gathered input, and backward must move one extra all-gather:
(t-1)/t·|X| more than the reduce-scatter ring's (t-1)/t·|X|.
"""

import pytest
import torch
import torch.distributed as dist

from tessel.layers.linear import ColumnParallelLinear
from tessel.parallel.comm import count_bytes
from tessel.parallel.overlap import all_gather_matmul
from tessel.parallel.pipeline.weight_grad import defer_weight_grads
from tests.multiprocess import run_ranks

M, K, N = 5, 12, 7  # rows per rank, features in, features out


def _saved_numel(fn):
    total = [0]

    def pack(t):
        total[0] += t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


def _run(rank, t, overlap, regather, defer):
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(M, K, generator=gen, requires_grad=True)
    torch.manual_seed(0)  # the same weights on every rank
    w1, w2 = torch.randn(N, K, requires_grad=True), torch.randn(3, K, requires_grad=True)
    outs, saved = _saved_numel(lambda: all_gather_matmul(x, [w1, w2], overlap=overlap, regather=regather))
    grads = [torch.randn(o.shape, generator=gen) for o in outs]
    with count_bytes() as moved:
        if defer:
            with defer_weight_grads() as store:
                torch.autograd.backward(outs, grads)
            store.run()
        else:
            torch.autograd.backward(outs, grads)
    return [o.detach() for o in outs], x.grad, w1.grad, w2.grad, saved, moved.sent


def _compare(rank, t):
    results = {}
    for overlap in (True, False):
        for defer in (False, True):
            base = _run(rank, t, overlap, False, defer)
            again = _run(rank, t, overlap, True, defer)
            for got, want in zip(again[:4], base[:4]):
                for g, w in zip(got if isinstance(got, list) else [got], want if isinstance(want, list) else [want]):
                    torch.testing.assert_close(g, w, rtol=0, atol=0)
            assert base[4] - again[4] == (t - 1) * M * K  # the shard [M, K] is saved instead of [t·M, K]
            assert again[5] - base[5] == (t - 1) * M * K * 4  # one more all-gather of X (fp32)
            results[(overlap, defer)] = again[5]
    return results


@pytest.mark.multiprocess
@pytest.mark.parametrize("t", [2, 4])
def test_regather_matches_and_saves_the_shard(t):
    run_ranks(_compare, t)


def _layer(rank, t):
    torch.manual_seed(0)
    a = ColumnParallelLinear(K, 8, sequence_parallel=True, overlap=True)
    torch.manual_seed(0)
    b = ColumnParallelLinear(K, 8, sequence_parallel=True, overlap=True, regather_input=True)
    x = torch.randn(2, 4 // t * 2, K, generator=torch.Generator().manual_seed(rank))
    for layer in (a, b):
        xi = x.clone().requires_grad_()
        layer(xi).square().sum().backward()
        layer.x_grad = xi.grad
    torch.testing.assert_close(b.x_grad, a.x_grad, rtol=0, atol=0)
    torch.testing.assert_close(b.weight.grad, a.weight.grad, rtol=0, atol=0)
    solo = [dist.new_group([r]) for r in range(t)][rank]
    dense = ColumnParallelLinear(K, 8, tp_group=solo, sequence_parallel=True, regather_input=True)
    assert ColumnParallelLinear.from_linear(dense).regather_input  # kept when resharded


@pytest.mark.multiprocess
def test_column_layer_regathers_its_input():
    run_ranks(_layer, 2)
