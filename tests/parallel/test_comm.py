"""Tests of the raw collectives of tessel.parallel.comm: results, async handles, byte counts, event logs.

Data are random integers stored as floats: every sum of a few of them is exact in fp32 and fp16 whatever
order gloo adds them in, so every comparison is exact (rtol=atol=0).
"""

import threading

import pytest
import torch
import torch.distributed as dist

from tessel.parallel.comm import (
    all_gather,
    all_reduce,
    all_to_all,
    count_bytes,
    record_event,
    record_events,
    reduce_scatter,
    ring_exchange,
)
from tests.multiprocess import run_ranks

AR_SHAPE, AG_SHAPE, RS_SHAPE, RING_SHAPE = (5, 7), (3, 7), (3, 5), (2, 9)  # odd; RS_SHAPE is the output
SHIFTS = (1, -1, 2, 4)


def _data(rank: int, shape, dtype=torch.float32, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s tensor: any rank can regenerate any other rank's data from the seed."""
    generator = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randint(-64, 65, shape, generator=generator).to(dtype)


def _exact(actual, expected) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def _counted(counter) -> tuple[int, int]:
    return counter.sent, counter.received


# ---------------------------------------------------------------------------------------------------- per rank


def _check_all_reduce(rank, members, group, counts) -> None:
    for dtype in (torch.float32, torch.float16):
        for async_op in (False, True):
            x = _data(rank, AR_SHAPE, dtype, salt=1)
            with count_bytes() as counter:
                out, work = all_reduce(x, group, async_op=async_op)
                work.wait()
            assert out is x  # in place
            _exact(out, sum(_data(q, AR_SHAPE, dtype, salt=1) for q in members))
            counts[f"all_reduce {dtype} async={async_op}"] = _counted(counter)


def _check_all_gather(rank, members, group, counts) -> None:
    expected = torch.cat([_data(q, AG_SHAPE, salt=2) for q in members])
    for async_op in (False, True):
        with count_bytes() as counter:
            out, work = all_gather(_data(rank, AG_SHAPE, salt=2), group, async_op=async_op)
            work.wait()
        _exact(out, expected)
        counts[f"all_gather async={async_op}"] = _counted(counter)
    into = torch.full_like(expected, float("nan"))
    transposed = _data(rank, AG_SHAPE, salt=2).t().contiguous().t()  # same values, non-contiguous
    out, _ = all_gather(transposed, group, out=into)
    assert out is into
    _exact(out, expected)


def _check_reduce_scatter(rank, members, group, counts) -> str:
    t, r = len(members), members.index(rank)
    full_shape = (t * RS_SHAPE[0], *RS_SHAPE[1:])
    expected = sum(_data(q, full_shape, salt=3) for q in members)[r * RS_SHAPE[0] : (r + 1) * RS_SHAPE[0]]
    for async_op in (False, True):
        with count_bytes() as counter:
            out, work = reduce_scatter(_data(rank, full_shape, salt=3), group, async_op=async_op)
            work.wait()
        _exact(out, expected)
        counts[f"reduce_scatter async={async_op}"] = _counted(counter)
    into = torch.full(RS_SHAPE, float("nan"))
    out, _ = reduce_scatter(_data(rank, full_shape, salt=3), group, out=into)
    assert out is into
    _exact(out, expected)
    if t == 1:
        return ""
    with pytest.raises(ValueError) as info:
        reduce_scatter(torch.ones(t * RS_SHAPE[0] + 1, 2), group)
    return str(info.value)


def _check_ring_exchange(rank, members, group, counts) -> None:
    t, r = len(members), members.index(rank)
    for shift in SHIFTS:
        recv = torch.full(RING_SHAPE, float("nan"))
        with count_bytes() as counter:
            ring_exchange(_data(rank, RING_SHAPE, salt=4), recv, group, shift=shift).wait()
        _exact(recv, _data(members[(r - shift) % t], RING_SHAPE, salt=4))
        counts[f"ring_exchange shift={shift}"] = _counted(counter)


def _check_counters(rank, counts) -> None:
    x = _data(rank, AR_SHAPE, salt=1)
    with count_bytes() as outer:
        all_reduce(x, None)
        with count_bytes() as inner:
            all_gather(_data(rank, AG_SHAPE), None)
        all_reduce(x, None)
    all_reduce(x, None)  # outside both blocks
    counts["nested outer"], counts["nested inner"] = _counted(outer), _counted(inner)
    with pytest.raises(RuntimeError), count_bytes() as aborted:
        raise RuntimeError("leave the block by an exception")
    all_reduce(x, None)
    counts["after an exception"] = _counted(aborted)
    # On CUDA the backward of an autograd Function runs on an autograd worker thread: a counter around
    # backward() must see collectives issued from other threads.
    with count_bytes() as threaded:
        worker = threading.Thread(target=all_reduce, args=(x, None))
        worker.start()
        worker.join()
    counts["other thread"] = _counted(threaded)


def _check_comm(rank, world_size):
    counts, messages = {}, {}
    members = list(range(world_size))
    for check in (_check_all_reduce, _check_all_gather, _check_ring_exchange):
        check(rank, members, None, counts)
    messages["world"] = _check_reduce_scatter(rank, members, None, counts)
    # Strided subgroups (even and odd ranks): group ranks differ from global ranks; of size 1 on 2 ranks.
    subgroup, _ = dist.new_subgroups_by_enumeration([list(range(p, world_size, 2)) for p in (0, 1)])
    sub_counts, sub_members = {}, list(range(rank % 2, world_size, 2))
    for check in (_check_all_reduce, _check_all_gather, _check_ring_exchange):
        check(rank, sub_members, subgroup, sub_counts)
    messages["subgroup"] = _check_reduce_scatter(rank, sub_members, subgroup, sub_counts)
    _check_counters(rank, counts)
    return counts, sub_counts, messages


# ---------------------------------------------------------------------------------------------------- expected


def _nbytes(shape, dtype=torch.float32) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def _expected_counts(t: int) -> dict[str, tuple[int, int]]:
    """Ring formulas, each way: AR 2(t-1)/t·|X|, AG (t-1)/t·|gathered X|, RS (t-1)/t·|input X|."""
    expected = {}
    for dtype in (torch.float32, torch.float16):
        for async_op in (False, True):
            expected[f"all_reduce {dtype} async={async_op}"] = 2 * (t - 1) * _nbytes(AR_SHAPE, dtype) // t
    for async_op in (False, True):
        expected[f"all_gather async={async_op}"] = (t - 1) * _nbytes((t * AG_SHAPE[0], *AG_SHAPE[1:])) // t
        expected[f"reduce_scatter async={async_op}"] = (t - 1) * _nbytes((t * RS_SHAPE[0], *RS_SHAPE[1:])) // t
    for shift in SHIFTS:  # exactly the tensors sent and received, nothing when a rank exchanges with itself
        expected[f"ring_exchange shift={shift}"] = 0 if shift % t == 0 else _nbytes(RING_SHAPE)
    return {name: (moved, moved) for name, moved in expected.items()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_results_and_bytes(world_size):
    all_reduce_bytes = 2 * (world_size - 1) * _nbytes(AR_SHAPE) // world_size
    all_gather_bytes = (world_size - 1) * _nbytes(AG_SHAPE)
    for counts, sub_counts, messages in run_ranks(_check_comm, world_size):
        assert counts.pop("nested outer") == (2 * all_reduce_bytes + all_gather_bytes,) * 2
        assert counts.pop("nested inner") == (all_gather_bytes,) * 2
        assert counts.pop("after an exception") == (0, 0)
        assert counts.pop("other thread") == (all_reduce_bytes,) * 2
        assert counts == _expected_counts(world_size)
        assert sub_counts == _expected_counts(world_size // 2)
        rows = world_size * RS_SHAPE[0] + 1
        expected = f"reduce_scatter: dim 0 of x ({rows}) is not divisible by the group size {world_size}"
        assert messages["world"] == expected
        if world_size > 2:
            rows = world_size // 2 * RS_SHAPE[0] + 1
            assert messages["subgroup"].endswith(f"({rows}) is not divisible by the group size {world_size // 2}")


# ---------------------------------------------------------------------------------------------------- world of one


def test_world_of_one_copies_and_moves_nothing():
    assert not dist.is_initialized()
    x, send, recv = _data(0, AR_SHAPE), _data(0, RING_SHAPE, salt=1), torch.full(RING_SHAPE, float("nan"))
    with count_bytes() as counter:
        reduced, work = all_reduce(x.clone(), None, async_op=True)
        assert work.wait()
        gathered, _ = all_gather(x, None, out=torch.full_like(x, float("nan")))
        scattered, _ = reduce_scatter(x, None, async_op=True)
        assert ring_exchange(send, recv, None, shift=1).wait()
        exchanged, work = all_to_all(x, None, [x.shape[0]], [x.shape[0]])
        assert work.wait()
    for out in (reduced, gathered, scattered, exchanged):
        _exact(out, x)
    _exact(recv, send)
    assert _counted(counter) == (0, 0)


def test_all_to_all_refuses_counts_that_do_not_fit():
    x = _data(0, AR_SHAPE)
    with pytest.raises(ValueError, match=r"all_to_all: send_counts and recv_counts need 1 entries .* received \[4\]"):
        all_to_all(x, None, [4], [4])
    with pytest.raises(ValueError, match=r"recv_counts must equal send_counts \[5\], received \[3\]"):
        all_to_all(x, None, [5], [3])


def test_record_events_keeps_order_and_nests():
    record_event("send", "op", 0)  # no log active: dropped
    with record_events() as outer:
        record_event("send", "op", 1)
        with record_events() as inner:
            record_event("gemm", "op", 0)
            worker = threading.Thread(target=record_event, args=("wait", "op", 1))  # logs see every thread
            worker.start()
            worker.join()
        record_event("gemm", "op", 1)
    record_event("send", "op", 2)  # after the block: dropped
    assert outer.events == [("send", "op", 1), ("gemm", "op", 0), ("wait", "op", 1), ("gemm", "op", 1)]
    assert inner.events == [("gemm", "op", 0), ("wait", "op", 1)]
    assert outer.index("send", "op", 1) < outer.index("wait", "op", 1) < outer.index("gemm", "op", 1)
    with pytest.raises(ValueError):
        outer.index("send", "op", 2)
