"""Tests of the differentiable collectives against the dense computation they stand for.

Every rank regenerates every rank's input ``x_q`` and upstream gradient ``g_q`` from seeds, so it knows
what the unsharded computation implies for its own output and input-gradient (the table at the top of
tessel/parallel/collectives.py). Upstream gradients differ per rank, except after ops whose following
graph is replicated (``reduce_from_tp``, ``gather_from_tp``), where every rank receives the same one.
"""

import zlib
from collections.abc import Callable
from dataclasses import dataclass

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
from tessel.parallel.comm import count_bytes
from tests.multiprocess import run_ranks

BASE_SHAPE = (2, 7, 5)  # [batch, seq, hidden]: batch > 1, odd sizes
BLOCK = 3  # one rank's block along the split dim (odd)
DTYPES = (torch.float32, torch.float16)


# ---------------------------------------------------------------------------------------------------- dense semantics
# Each maps every rank's tensors ``ts`` to what rank ``r`` of ``t`` holds in the unsharded computation.


def _sum(ts):
    return torch.stack(ts).float().sum(0).to(ts[0].dtype)  # an fp32 sum, rounded once


def _same(ts, r, t, dim):
    return ts[r]


def _summed(ts, r, t, dim):
    return _sum(ts)


def _gathered(ts, r, t, dim):
    return torch.cat(ts, dim)


def _own_chunk(ts, r, t, dim):
    return ts[r].chunk(t, dim)[r]


def _summed_chunk(ts, r, t, dim):
    return _sum(ts).chunk(t, dim)[r]


@dataclass(frozen=True)
class _Spec:
    op: Callable
    default_dim: int | None  # None: the op takes no dim
    x_size: str  # x along dim: "shard" (BLOCK), "full" (t * BLOCK), or "base" (BASE_SHAPE, no dim)
    x_replicated: bool  # the same x on every rank
    g_replicated: bool  # the same upstream gradient on every rank
    forward: Callable  # dense output
    backward: Callable  # dense gradient of x
    comm_forward: str  # collective: "", "AR" (all-reduce), "AG" (all-gather), "RS" (reduce-scatter)
    comm_backward: str


_SPECS = [
    _Spec(copy_to_tp, None, "base", True, False, _same, _summed, "", "AR"),
    _Spec(reduce_from_tp, None, "base", False, True, _summed, _same, "AR", ""),
    _Spec(sum_over_ranks, None, "base", False, False, _summed, _summed, "AR", "AR"),
    _Spec(gather_from_sequence, 1, "shard", False, False, _gathered, _summed_chunk, "AG", "RS"),
    _Spec(reduce_scatter_to_sequence, 1, "full", False, False, _summed_chunk, _gathered, "RS", "AG"),
    _Spec(scatter_to_sequence, 1, "full", True, False, _own_chunk, _gathered, "", "AG"),
    _Spec(gather_from_tp, -1, "shard", False, True, _gathered, _own_chunk, "AG", ""),
    _Spec(split_to_tp, -1, "full", True, False, _own_chunk, _gathered, "", "AG"),
]


def _ring_bytes(kind: str, tensor: torch.Tensor, t: int) -> int:
    """Bytes each way for the collective applied to ``tensor`` (its input): the ring formulas."""
    nbytes = tensor.numel() * tensor.element_size()
    return {"": 0, "AR": 2 * (t - 1) * nbytes // t, "AG": (t - 1) * nbytes, "RS": (t - 1) * nbytes // t}[kind]


def _tolerance(dtype, kind: str) -> dict:
    if kind not in ("AR", "RS"):
        return {"rtol": 0, "atol": 0}  # pure data movement is bit-exact
    # gloo sums the t addends in ring order, rounding after each addition; the reference rounds once after
    # an fp32 sum. |partial sums| < 16 here: fp32 differs by a few 1e-6, fp16 by up to t half-ulps (2^-8).
    return {"rtol": 1e-3, "atol": 2e-2} if dtype == torch.float16 else {"rtol": 1.3e-6, "atol": 1e-5}


# ---------------------------------------------------------------------------------------------------- per rank


def _draw(key: tuple, shape, dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    return torch.randn(shape, generator=generator).to(dtype)


def _strided(x: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous (transposed) layout."""
    return x.transpose(0, -1).contiguous().transpose(0, -1)


def _shape(spec: _Spec, dim: int, t: int) -> tuple[int, ...]:
    shape = list(BASE_SHAPE)
    if spec.x_size != "base":
        shape[dim] = BLOCK * (t if spec.x_size == "full" else 1)
    return tuple(shape)


def _check_case(spec: _Spec, dim: int | None, rank: int, t: int, dtype) -> tuple[tuple, int]:
    """Run forward and backward on this rank, compare with the dense values; return (bytes, expected bytes)."""
    name, d = spec.op.__name__, spec.default_dim if dim is None else dim
    case = (name, dim, str(dtype))
    xs = [_draw((case, "x", 0 if spec.x_replicated else q), _shape(spec, d, t), dtype) for q in range(t)]
    y_dense = spec.forward(xs, rank, t, d)
    gs = [_draw((case, "g", 0 if spec.g_replicated else q), y_dense.shape, dtype) for q in range(t)]
    x, g = _strided(xs[rank]).requires_grad_(), _strided(gs[rank])
    with count_bytes() as counter:
        y = spec.op(x, None) if dim is None else spec.op(x, None, dim)
        (dx,) = torch.autograd.grad(y, x, g)
    message = lambda m: f"{case}: {m}"
    torch.testing.assert_close(y, y_dense, **_tolerance(dtype, spec.comm_forward), msg=message)
    dx_dense = spec.backward(gs, rank, t, d)
    torch.testing.assert_close(dx, dx_dense, **_tolerance(dtype, spec.comm_backward), msg=message)
    for original, passed in ((xs[rank], x.detach()), (gs[rank], g)):  # inputs are never modified in place
        torch.testing.assert_close(passed, original, rtol=0, atol=0, msg=message)
    expected = _ring_bytes(spec.comm_forward, x, t) + _ring_bytes(spec.comm_backward, g, t)
    if dim is not None:  # the split and gathered results own their memory: a model may add onto them in place
        z = spec.op(x, None, dim)
        z.add_(g)  # raises for the view of an input, or of a tensor made inside the op
        (dx_inplace,) = torch.autograd.grad(z, x, g)
        torch.testing.assert_close(dx_inplace, dx, rtol=0, atol=0, msg=message)
    return (counter.sent, counter.received), (expected, expected)


def _dims(spec: _Spec) -> tuple:
    return (None,) if spec.default_dim is None else (None, 0, 1, -1)  # None: the op's default


def _indivisible_messages(t: int) -> dict[str, str]:
    messages = {}
    for op in (reduce_scatter_to_sequence, scatter_to_sequence, split_to_tp):
        with pytest.raises(ValueError) as info:
            op(torch.ones(2, t * BLOCK + 1, 5), None, dim=1)
        messages[op.__name__] = str(info.value)
    return messages


def _check_all(rank, world_size):
    counts = {}
    for dtype in DTYPES:
        for spec in _SPECS:
            for dim in _dims(spec):
                counts[(spec.op.__name__, dim, str(dtype))] = _check_case(spec, dim, rank, world_size, dtype)
    return counts, _indivisible_messages(world_size)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4])
def test_forward_backward_and_bytes_match_the_dense_computation(world_size):
    for counts, messages in run_ranks(_check_all, world_size):
        assert {case: moved for case, (moved, _) in counts.items()} == {case: exp for case, (_, exp) in counts.items()}
        assert len(counts) == len(DTYPES) * sum(len(_dims(spec)) for spec in _SPECS)
        for name, message in messages.items():
            size = world_size * BLOCK + 1
            expected = f"{name}: size {size} of dim 1 (shape (2, {size}, 5)) is not divisible by the group size "
            assert message == expected + str(world_size)


# ---------------------------------------------------------------------------------------------------- world of one


@pytest.mark.parametrize("spec", _SPECS, ids=lambda spec: spec.op.__name__)
def test_world_of_one_is_identity_and_passes_gradcheck(spec):
    assert not dist.is_initialized()  # group=None without a process group: a world of one
    for dim in _dims(spec):
        x = _strided(_draw(("gradcheck", dim), _shape(spec, 1 if dim is None else dim, 1), torch.float64))
        fn = (lambda x: spec.op(x, None)) if dim is None else (lambda x, dim=dim: spec.op(x, None, dim))
        with count_bytes() as counter:
            torch.testing.assert_close(fn(x), x, rtol=0, atol=0)
            assert torch.autograd.gradcheck(fn, (x.requires_grad_(),))
        assert (counter.sent, counter.received) == (0, 0)


def _exchange(rank, world_size):
    """Rank q sends ``q + j`` rows to rank j (none when that is 0): the rows arrive rank after rank, their
    gradients go back to where they came from, and only the rows that leave a rank count as traffic."""
    t, h = world_size, 3
    counts = [[q + j for j in range(t)] for q in range(t)]  # counts[q][j]: rows rank q sends to rank j
    rows = [_draw(("x", q), (sum(counts[q]), h), torch.float32) for q in range(t)]
    grads = [_draw(("g", q), (sum(c[q] for c in counts), h), torch.float32) for q in range(t)]

    def block(q, j):  # the rows rank q sends to rank j
        start = sum(counts[q][:j])
        return slice(start, start + counts[q][j])

    x = rows[rank].clone().requires_grad_()
    with count_bytes() as counter:
        y = exchange_rows(x, None, counts[rank], [counts[q][rank] for q in range(t)])
        y.backward(grads[rank])
    torch.testing.assert_close(y, torch.cat([rows[q][block(q, rank)] for q in range(t)]))
    # rank j's gradient rows, rank after rank: those of rank q are the ones rank q received from this rank
    offsets = [sum(counts[p][j] for p in range(rank)) for j in range(t)]
    want = torch.cat([grads[j][offsets[j] : offsets[j] + counts[rank][j]] for j in range(t)])
    torch.testing.assert_close(x.grad, want)
    row = h * 4
    sent = sum(counts[rank]) - counts[rank][rank] + sum(c[rank] for c in counts) - counts[rank][rank]
    assert (counter.sent, counter.received) == (sent * row, sent * row)
    # the counts as tensors (as the experts' dispatch passes them, read on the host once): the same exchange
    recv = torch.tensor([counts[q][rank] for q in range(t)])
    again = exchange_rows(x.detach(), None, torch.tensor(counts[rank]), recv, rows=y.shape[0])
    assert torch.equal(again, y.detach())
    return "ok"


@pytest.mark.multiprocess
def test_exchange_rows_sends_rows_and_their_gradients_back():
    assert run_ranks(_exchange, 3, timeout=120) == ["ok"] * 3


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: copy_to_tp([1.0], None), TypeError, "copy_to_tp: x must be a torch.Tensor, received list"),
        (lambda: reduce_from_tp(3.0, None), TypeError, "reduce_from_tp: x must be a torch.Tensor, received float"),
        (lambda: gather_from_tp(torch.ones(2, 3), None, dim=2), ValueError, "dim must be in [-2, 2) for a 2-d"),
        (lambda: split_to_tp(torch.ones(2, 3), None, dim=-3), ValueError, "split_to_tp: dim must be in [-2, 2)"),
        (lambda: gather_from_sequence(torch.ones(2, 3), None, dim="1"), TypeError, "dim must be an int, received str"),
        (lambda: scatter_to_sequence(torch.ones(2, 3), None, dim=True), TypeError, "received bool True"),
        (lambda: exchange_rows("rows", None, [1], [1]), TypeError, "exchange_rows: x must be a torch.Tensor"),
        (
            lambda: exchange_rows(torch.ones(3, 2), None, [2], [3]),
            ValueError,
            "send_counts must sum to the 3 rows of x, received [2] and [3]",
        ),
        (
            lambda: exchange_rows(torch.ones(3, 2), None, torch.tensor([3]), [3]),
            TypeError,
            "send_counts and recv_counts must both be lists or both tensors, received Tensor and list",
        ),
        (
            lambda: exchange_rows(torch.ones(3, 2), None, torch.tensor([3]), torch.tensor([3]), rows=2),
            ValueError,
            "exchange_rows: recv_counts [3] must sum to rows=2",
        ),
    ],
)
def test_bad_arguments_are_rejected(call, error, message):
    with pytest.raises(error) as info:
        call()
    assert message in str(info.value)
