"""``torch.compile`` over tessel's collectives and overlapped ops on several gloo ranks.

Under compile the raw collectives of a group of several ranks are torch's functional collectives, which a
graph holds; each overlapped op is, with overlap, its custom operator (``parallel/overlap_ops.py``), whose node
runs the eager ring, and without, its plain composition (a differentiable collective, then matmul's graph
operator). So a compiled function made of them compiles whole (``fullgraph=True``: any graph break fails the
test), forward and backward, and its outputs and gradients must equal the eager ones, computed by tessel's own
transports and rings on the same ranks. Without the traced transport every collective is opaque to Dynamo and
``fullgraph=True`` refuses the function. That the compiled rings overlap, and move the ring's bytes, is
tests/parallel/test_overlap.py's.
"""

import pytest
import torch
import torch.distributed as dist

from tessel.parallel.collectives import (
    copy_to_tp,
    exchange_rows,
    gather_from_sequence,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
    split_to_tp,
    sum_over_ranks,
)
from tessel.parallel.overlap import (
    all_gather_matmul,
    matmul_all_reduce,
    matmul_grad_all_reduce,
    matmul_reduce_scatter,
)
from tests.multiprocess import REFERENCE_KERNELS, run_ranks

pytestmark = pytest.mark.multiprocess
TOL = dict(rtol=1e-5, atol=1e-5)


def _eager_and_compiled(fn, inputs, weights, backend="aot_eager"):
    """Outputs and input gradients of ``fn(*inputs)`` eagerly and compiled whole; the loss weights every output
    element by a fixed random ``weights`` tensor, so each gradient element differs."""

    def run(f):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        outs = f(*leaves)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        sum((o * w[: o.numel()].view_as(o)).sum() for o, w in zip(outs, weights)).backward()
        return [o.detach() for o in outs], [x.grad for x in leaves]

    want = run(fn)
    torch._dynamo.reset()
    got = run(torch.compile(fn, backend=backend, fullgraph=True))
    return want, got


def _assert_same(want, got, what):
    for i, (w, g) in enumerate(zip(want[0], got[0])):
        torch.testing.assert_close(g, w, **TOL, msg=lambda m, i=i: f"{what}: output {i}: {m}")
    for i, (w, g) in enumerate(zip(want[1], got[1])):
        torch.testing.assert_close(g, w, **TOL, msg=lambda m, i=i: f"{what}: gradient of input {i}: {m}")


def _weights(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(4096, generator=gen) for _ in range(n)]


def _collectives(rank, world_size):
    t, group = world_size, dist.group.WORLD
    gen = torch.Generator().manual_seed(10 + rank)  # every rank holds other values
    x = torch.randn(2, 3 * t, 5, generator=gen)
    cases = {
        "copy_to_tp": lambda x: copy_to_tp(x, group) * 2,
        "reduce_from_tp": lambda x: reduce_from_tp(x, group),
        "sum_over_ranks": lambda x: sum_over_ranks(x, group),
        "gather_from_sequence": lambda x: gather_from_sequence(x, group, dim=1),
        "reduce_scatter_to_sequence": lambda x: reduce_scatter_to_sequence(x, group, dim=1),
        "scatter_to_sequence": lambda x: scatter_to_sequence(x, group, dim=1),
        "gather_from_tp": lambda x: gather_from_tp(x, group, dim=-1),
        "split_to_tp": lambda x: split_to_tp(x, group, dim=1),
        "chain": lambda x: reduce_scatter_to_sequence(gather_from_sequence(x, group, dim=1).sin(), group, dim=1),
    }
    for i, (name, fn) in enumerate(cases.items()):
        want, got = _eager_and_compiled(fn, [x], _weights(1, 100 + i))  # the same loss weights on every rank
        _assert_same(want, got, name)
    # expert dispatch: rank r sends r+1 rows to each peer and keeps 2; counts fixed, as the graph specialises them
    send = [2 if q == rank else rank + 1 for q in range(t)]
    recv = [2 if q == rank else q + 1 for q in range(t)]
    rows = torch.randn(sum(send), 3, generator=gen)
    want, got = _eager_and_compiled(lambda r: exchange_rows(r, group, send, recv) * 3, [rows], _weights(1, 7))
    _assert_same(want, got, "exchange_rows")
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 3])
def test_differentiable_collectives_compile_whole_and_match_eager(world_size):
    run_ranks(_collectives, world_size, timeout=240)


def _overlapped_ops(rank, world_size):
    t, group = world_size, dist.group.WORLD
    torch.manual_seed(0)  # weights replicated
    k, n0, n1, n = 7, 5, 3, 6
    w0, w1, b0, b1 = torch.randn(n0, k), torch.randn(n1, k), torch.randn(n0), torch.randn(n1)
    w_row, b_row = torch.randn(n, k), torch.randn(n)
    gen = torch.Generator().manual_seed(20 + rank)
    m = 3  # rows per rank: odd, and t·m is not a multiple of any block
    x_shard, x_full = torch.randn(m, k, generator=gen), torch.randn(t * m, k, generator=gen)
    cases = {
        "all_gather_matmul": (
            lambda x, a, b, c, d: all_gather_matmul(x, [a, b], group, biases=[c, d], overlap=True),
            [x_shard, w0, w1, b0, b1],
        ),
        "matmul_reduce_scatter": (
            lambda x, w, b: matmul_reduce_scatter(x, w, group, bias=b, overlap=True),
            [x_full, w_row, b_row],
        ),
        "matmul_all_reduce": (
            lambda x, w, b: matmul_all_reduce(x, w, group, bias=b, overlap=True),
            [x_full, w_row, b_row],
        ),
        "matmul_grad_all_reduce": (
            lambda x, a, b, c, d: matmul_grad_all_reduce(x, [a, b], group, biases=[c, d], overlap=True),
            [x_full, w0, w1, b0, b1],
        ),
        # one bias of two, X gathered again in backward
        "all_gather_matmul regather": (
            lambda x, a, b, c: all_gather_matmul(x, [a, b], group, biases=[None, c], overlap=True, regather=True),
            [x_shard, w0, w1, b1],
        ),
        "matmul_grad_all_reduce one bias": (
            lambda x, a, b, c: matmul_grad_all_reduce(x, [a, b], group, biases=[c, None], overlap=True),
            [x_full, w0, w1, b0],
        ),
        "matmul_reduce_scatter no bias": (
            lambda x, w: matmul_reduce_scatter(x, w, group, overlap=True),
            [x_full, w_row],
        ),
        "matmul_all_reduce no bias": (lambda x, w: matmul_all_reduce(x, w, group, overlap=True), [x_full, w_row]),
        "all_gather_matmul plain": (
            lambda x, a, c: all_gather_matmul(x, a, group, biases=c, overlap=False),
            [x_shard, w0, b0],
        ),
    }
    for i, (name, (fn, inputs)) in enumerate(cases.items()):
        want, got = _eager_and_compiled(fn, inputs, _weights(2, 200 + i))
        _assert_same(want, got, name)
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_overlapped_ops_compile_whole_and_match_their_rings(world_size):
    """Both sides run the rings (overlap=True), the compiled one from its operators' nodes; biases on every
    weight, on some and on none, and X gathered again in backward (regather). Weight and bias gradients
    included: the row-parallel bias under sequence parallelism gets every rank's tokens' sum. One case without
    overlap: the plain composition against the eager plain path."""
    run_ranks(_overlapped_ops, world_size, timeout=240, env=REFERENCE_KERNELS)


def _mlp_under_inductor(rank, world_size):
    from torch.nn.functional import gelu

    group = dist.group.WORLD
    torch.manual_seed(0)
    k, h = 8, 12
    w_up, b_up, w_down, b_down = (
        torch.randn(h // world_size, k),
        torch.randn(h // world_size),
        torch.randn(k, h // world_size),
        torch.randn(k),
    )
    x_shard = torch.randn(5, k, generator=torch.Generator().manual_seed(30 + rank))

    def mlp(x, w1, b1, w2, b2):  # a sequence-parallel MLP: column (AG + GEMM), GELU, row (GEMM + RS)
        hidden = gelu(all_gather_matmul(x, w1, group, biases=b1, overlap=True))
        return matmul_reduce_scatter(hidden, w2, group, bias=b2, overlap=True)

    want, got = _eager_and_compiled(mlp, [x_shard, w_up, b_up, w_down, b_down], _weights(1, 300), backend="inductor")
    _assert_same(want, got, "mlp")
    dist.barrier()


def test_overlapped_ops_compile_under_inductor():
    """Inductor generates the code around the ops' nodes (GELU, its backward, the loss) and calls the nodes, which
    run their rings."""
    run_ranks(_mlp_under_inductor, 2, timeout=400, env=REFERENCE_KERNELS)


def _uneven_rows(rank, world_size):
    w = torch.randn(4, 6)
    compiled = torch.compile(lambda x: matmul_reduce_scatter(x, w, dist.group.WORLD))
    with pytest.raises(ValueError, match="matmul_reduce_scatter: 5 rows of x are not divisible by the group size 2"):
        compiled(torch.randn(5, 6))
    dist.barrier()


def test_compiled_reduce_scatter_refuses_rows_that_do_not_split():
    run_ranks(_uneven_rows, 2, timeout=120, env=REFERENCE_KERNELS)


def _ring_attention(rank, world_size):
    from tessel.parallel.context import ring_attention

    group, length, s = dist.group.WORLD, 6, 6 * world_size
    gen = torch.Generator().manual_seed(30 + rank)
    q, k, v = (
        torch.randn(2, 4, length, 16, generator=gen),
        *(torch.randn(2, 2, length, 16, generator=gen) for _ in "kv"),
    )
    docs = torch.tensor([[0] * 5 + [1] * (s - 9) + [0] * 4, [2] * s])  # runs of equal ids; one id used twice
    cases = {
        "full": {},
        "causal": {"causal": True},
        "window": {"causal": True, "window": 4},
        "causal documents": {"causal": True, "segment_ids": docs},
        "documents": {"segment_ids": docs},
        "softcap": {"causal": True, "softcap": 3.0},
    }
    for i, (name, kw) in enumerate(cases.items()):
        fn = lambda q, k, v, kw=kw: ring_attention(q, k, v, group, **kw)
        want, got = _eager_and_compiled(fn, [q, k, v], _weights(1, 300 + i))
        _assert_same(want, got, name)
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_attention_compiles_whole_in_its_all_gather_form(world_size):
    """Context parallelism under compile: the keys and values gathered whole instead of passed round the ring,
    for every mask the ring takes (causal over the zigzag layout, a window, packed documents, soft-capping); the
    same outputs and gradients as the eager ring."""
    run_ranks(_ring_attention, world_size, timeout=240, env=REFERENCE_KERNELS)


def _operators_pass_torchs_checks(rank, world_size):
    from tessel.parallel import overlap_ops as ops

    name, t = dist.group.WORLD.group_name, world_size
    gen = torch.Generator().manual_seed(40 + rank)
    rand = lambda *shape, grad=True: torch.randn(*shape, generator=gen).requires_grad_(grad)
    torch.manual_seed(0)  # weights replicated
    w0, w1, b1, w_row, b_row = (torch.randn(*s).requires_grad_() for s in [(5, 7), (3, 7), (3,), (6, 7), (6,)])
    cases = {
        "all_gather_matmul": (ops.all_gather_matmul_op, (rand(3, 7), [w0, w1], [b1], [1], name, t, True)),
        "all_gather_matmul regather": (ops.all_gather_matmul_op, (rand(3, 7), [w0, w1], [], [], name, t, False)),
        "matmul_reduce_scatter": (ops.matmul_reduce_scatter_op, (rand(3 * t, 7), w_row, b_row, name, t)),
        "matmul_all_reduce": (ops.matmul_all_reduce_op, (rand(5, 7), w_row, None, name)),
        "matmul_grad_all_reduce": (ops.matmul_grad_all_reduce_op, (rand(5, 7), [w0, w1], [b1], [1], name)),
        "all_gather_matmul_backward": (
            ops.all_gather_matmul_backward_op,
            (
                [rand(3 * t, 5, grad=False), rand(3 * t, 3, grad=False)],
                rand(3 * t, 7, grad=False),
                [w0.detach(), w1.detach()],
                name,
                t,
                False,
                [True, True],
            ),
        ),
        "all_gather_matmul_backward regather": (
            ops.all_gather_matmul_backward_op,
            (
                [rand(3 * t, 5, grad=False), rand(3 * t, 3, grad=False)],
                rand(3, 7, grad=False),
                [w0.detach(), w1.detach()],
                name,
                t,
                True,
                [False, True],  # the first weight frozen: no gradient computed for it
            ),
        ),
        "matmul_reduce_scatter_backward": (
            ops.matmul_reduce_scatter_backward_op,
            (rand(3, 6, grad=False), rand(3 * t, 7, grad=False), w_row.detach(), name, True, True),
        ),
        "matmul_grad_all_reduce_backward": (
            ops.matmul_grad_all_reduce_backward_op,
            (
                [rand(5, 5, grad=False), rand(5, 3, grad=False)],
                rand(5, 7, grad=False),
                [w0.detach(), w1.detach()],
                name,
                [True, False],
            ),
        ),
        "matmul_reduce_scatter_backward frozen": (
            ops.matmul_reduce_scatter_backward_op,
            (rand(3, 6, grad=False), rand(3 * t, 7, grad=False), w_row.detach(), name, False, False),
        ),
    }
    for what, (op, args) in cases.items():
        if op is not ops.matmul_grad_all_reduce_op:  # the nodes that communicate stay out of CUDA graphs
            assert torch.Tag.cudagraph_unsafe in op._opoverload.tags, what
        try:
            torch.library.opcheck(op, args)
        except Exception as error:
            raise AssertionError(f"{what}: {error}") from error
    dist.barrier()


def test_overlapped_operators_pass_torchs_checks():
    """``torch.library.opcheck`` on two ranks (every rank runs the same checks, so the rings meet): the schema,
    the fake implementations against the real outputs (shapes, dtypes, strides: inductor trusts them), the
    registered backwards, and AOTAutograd with dynamic shapes. The backward operators take no gradient
    themselves (as in a backward graph)."""
    run_ranks(_operators_pass_torchs_checks, 2, timeout=300, env=REFERENCE_KERNELS)
