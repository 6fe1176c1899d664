"""Frozen weights cost no weight-gradient GEMM in the overlapped ops' backward, eagerly and compiled.

Fine-tuning a tensor-parallel model with its base weights frozen (adapters, a frozen embedding or head) must not
pay for gradients nobody reads. Each op runs with every weight trainable and again with some or all frozen, on
the same inputs: the input gradient and the trainable weights' gradients must equal the trainable run's, a
frozen weight must get no gradient, the backward must log no weight-gradient step when all are frozen, and an
all-gather whose only use was the weight gradients (``regather``) must not run.
"""

import pytest
import torch
import torch.distributed as dist

from tests.multiprocess import REFERENCE_KERNELS, run_ranks

M, K, N = 3, 7, 4  # rows per rank, input and output features


def _ops(group, regather):
    from tessel.parallel import all_gather_matmul, matmul_all_reduce, matmul_grad_all_reduce, matmul_reduce_scatter

    return {
        "all_gather_matmul": lambda x, w, w2: all_gather_matmul(x, [w, w2], group, overlap=True, regather=regather),
        "matmul_reduce_scatter": lambda x, w, w2: [matmul_reduce_scatter(x, w, group, overlap=True)],
        "matmul_all_reduce": lambda x, w, w2: [matmul_all_reduce(x, w, group, overlap=True)],
        "matmul_grad_all_reduce": lambda x, w, w2: matmul_grad_all_reduce(x, [w, w2], group, overlap=True),
    }


def _run(fn, x, w, w2, train):
    """Gradients of x and of the weights whose flag in ``train`` is set, and the backward's events and bytes."""
    from tessel.parallel import count_bytes, record_events

    x = x.clone().requires_grad_()
    w, w2 = (t.clone().requires_grad_(flag) for t, flag in zip((w, w2), train))
    outs = fn(x, w, w2)
    with record_events() as log, count_bytes() as moved:
        sum((o * o).sum() for o in outs).backward()
    return x.grad, w.grad, w2.grad, log.events, moved.received


def _check(rank, world_size, compiled, regather):
    group = dist.group.WORLD
    torch.manual_seed(0)  # weights replicated
    w, w2 = torch.randn(N, K), torch.randn(N + 1, K)
    gen = torch.Generator().manual_seed(10 + rank)
    x_shard, x_full = torch.randn(M, K, generator=gen), torch.randn(world_size * M, K, generator=gen)
    for op, fn in _ops(group, regather).items():
        if compiled:
            torch._dynamo.reset()
            fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
        x = x_shard if op == "all_gather_matmul" else x_full
        want = _run(fn, x, w, w2, (True, True))
        for train in ((False, True), (False, False)):
            got, what = _run(fn, x, w, w2, train), f"{op} {train}"
            torch.testing.assert_close(got[0], want[0], msg=lambda m, what=what: f"{what}: input gradient: {m}")
            assert got[1] is None, f"{what}: the frozen weight got a gradient"
            if train[1] and op in ("all_gather_matmul", "matmul_grad_all_reduce"):  # the ops with a second weight
                torch.testing.assert_close(got[2], want[2], msg=lambda m, op=op: f"{op}: trainable weight: {m}")
            if not any(train):
                assert not [e for e in got[3] if e[0] == "wgrad"], f"{op}: weight-gradient steps ran: {got[3]}"
                if op == "all_gather_matmul" and regather:  # only the reduce-scatter of dX moves bytes
                    assert got[4] < want[4], f"{op}: X was gathered again for no weight gradient"
    dist.barrier()


@pytest.mark.multiprocess
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("regather", [False, True], ids=["saved", "regather"])
def test_frozen_weights_cost_no_weight_gradient(compiled, regather):
    run_ranks(_check, 2, compiled, regather, timeout=300, env=REFERENCE_KERNELS)
