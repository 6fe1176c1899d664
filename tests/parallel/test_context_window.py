"""Ring attention with a sliding window: the route of the blocks, the pairs run, and the result.

The plan is checked without processes: for every rank, the (query, key) pairs its calls compute, with
each call's mask laid over the global positions, must be exactly the pairs of the whole sequence's
causal window at that rank's queries, each computed once; and the blocks travel only as far as some
rank needs them. Then on gloo ranks the output and gradients must equal the float64 windowed
attention of the whole sequence (each query row over the keys of its window only), with the bytes
of that route. Beyond 2 ranks the blocks run the kernels' plain-PyTorch references: the route is what more
ranks add, and 2 ranks run the windows through the kernels in Triton's interpreter.
"""

import pytest
import torch

from tests.kernels.test_attention import LAYOUTS
from tests.multiprocess import REFERENCE_KERNELS, run_ranks
from tests.parallel.test_context import SEGMENTS, B, D, _check_against_whole, _overlapping, _ring_rank


def _coverage(c: int, rank: int, h: int, window):
    """[L, S] int: how many calls of ``rank``'s plan compute each (local query, global key) pair."""
    from tessel.parallel.context import _ring_plan, zigzag_positions

    s = 2 * c * h
    mine = zigzag_positions(s, c, rank)
    count = torch.zeros(2 * h, s, dtype=torch.int64)
    plan = _ring_plan(c, rank, True, h, window)
    for step in plan.steps:
        assert step.src == (rank - step.direction * step.hop) % c
        theirs = zigzag_positions(s, c, step.src)
        for pair in step.pairs:
            rows = torch.arange(2 * h)[pair.rows]
            keys = theirs[pair.cols]
            sq, sk = len(rows), len(keys)
            off = sk - sq if pair.offset is None else pair.offset
            i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
            keep = torch.ones(sq, sk, dtype=torch.bool)
            if pair.causal:
                keep &= j <= i + off
            if pair.window is not None:
                keep &= i + off - j < pair.window
            count[rows[:, None], keys[None, :]] += keep.long()
    want = (mine[:, None] >= torch.arange(s)[None, :]).long()
    if window is not None:
        want &= (mine[:, None] - torch.arange(s)[None, :] < window).long()
    return count, want, plan


@pytest.mark.parametrize("c", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("h", [1, 3, 5])
def test_the_calls_compute_each_pair_of_the_window_once(c, h):
    s = 2 * c * h
    for window in sorted({1, 2, h, h + 1, h + 2, 2 * h + 3, 4 * h, s - 1, s, s + 7, None} - {0}, key=str):
        hops = set()
        for rank in range(c):
            count, want, plan = _coverage(c, rank, h, window)
            assert torch.equal(count, want), (c, h, window, rank)
            hops.add(plan.hops)
        (hop,) = hops  # the same route on every rank
        assert sum(hop) <= c - 1
        if window is None or window >= s:
            assert hop == (c - 1, 0)  # round the ring
        elif window == 1:
            assert hop == (0, 0)  # the own block only: nothing travels
        elif window <= h + 1 and c >= 4:
            assert hop == (1, 1)  # one link each way, whatever c is


def test_pairs_outside_every_window_are_skipped():
    """c=8, h=4, W=5: each rank's calls cover 2h·... pairs, far fewer than the causal ring's."""
    from tessel.parallel.context import _ring_plan

    c, h = 8, 4
    for rank in range(c):
        plan = _ring_plan(c, rank, True, h, 5)
        assert plan.hops == (1, 1) and len(plan.steps) == 3
        calls = sum(len(step.pairs) for step in plan.steps)
        assert calls <= 5  # the two diagonals, the chunk pair at step 0 when adjacent, one pair per neighbour
        assert all(pair.window in (None, 5) for step in plan.steps for pair in step.pairs)


def test_pairs_inside_the_window_share_calls():
    """A window just short of the sequence: on every step but the own block's, the pairs that need no mask run
    as one call per shared chunk, as the plain ring's steps do, beside the one pair the window cuts."""
    from tessel.parallel.context import _ring_plan

    c, h = 4, 5
    for rank in range(c):
        plan = _ring_plan(c, rank, True, h, 2 * c * h - 1)
        assert plan.hops == (c - 1, 0)
        for step in plan.steps[1:]:
            unmasked = [pair for pair in step.pairs if not pair.causal]
            assert len(unmasked) == 1 and len(step.pairs) <= 2, step


def _windows_rank(rank, world_size, s, windows, ids=None, dtype=torch.float32, deterministic=True):
    return [_ring_rank(rank, world_size, "gqa", s, True, dtype, deterministic, ids, w) for w in windows]


def _busy_transfers(c: int, rank: int, h: int, window: int) -> dict:
    """{step: whether the rank computes between issuing the transfer of that step's block and waiting for it}"""
    from tessel.parallel.context import _ring_plan

    steps = _ring_plan(c, rank, True, h, window).steps
    index = {(step.direction, step.hop): i for i, step in enumerate(steps)}
    busy = {}
    for i, step in enumerate(steps[1:], 1):
        issued = index[(step.direction, step.hop - 1)] if step.hop > 1 else 0
        busy[i] = any(steps[t].pairs for t in range(issued, i))
    return busy


def _links(c: int, h: int, window: int) -> int:
    from tessel.parallel.context import _ring_plan

    return sum(_ring_plan(c, 0, True, h, window).hops)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4, 6])
def test_windowed_ring_matches_the_whole_sequence_and_moves_only_the_route(world_size):
    h = 5
    s = 2 * world_size * h
    windows = (1, 4, 7, 13)
    results = run_ranks(_windows_rank, world_size, s, windows, env=REFERENCE_KERNELS if world_size > 2 else None)
    hkv = LAYOUTS["gqa"][1]
    kv_bytes = 2 * B * hkv * (s // world_size) * D * 4  # keys and values of one rank, fp32
    for i, window in enumerate(windows):
        per_rank = [got[i] for got in results]
        _check_against_whole(per_rank, "gqa", s, True, torch.float32, window=window)
        links = _links(world_size, h, window)
        if world_size > 2:  # 6 ranks, W=7: two links each way, each block relayed once on its way
            assert links == {4: {1: 0, 4: 2, 7: 3, 13: 3}, 6: {1: 0, 4: 2, 7: 4, 13: 5}}[world_size][window]
        for rank, got in enumerate(per_rank):
            assert got["fwd_bytes"] == (links * kv_bytes,) * 2
            assert got["bwd_bytes"] == (links * 2 * kv_bytes,) * 2  # keys and values, and their accumulators
            # each block travels while the rank computes, unless it has nothing to compute meanwhile (the
            # blocks that only pass through it)
            busy = _busy_transfers(world_size, rank, h, window)
            assert len(busy) == links and _overlapping(got["fwd"], "ring_attention") == busy
            if window in (1, 4) or (world_size, window) == (6, 7):  # the two-stream routes: every rank computes
                # on every block it receives
                assert all(busy.values())


@pytest.mark.multiprocess
def test_windowed_ring_within_packed_documents_on_4_ranks():
    from tests.kernels.test_attention_segments import ids_from_lengths

    ids = ids_from_lengths(SEGMENTS[4])
    results = run_ranks(_windows_rank, 4, 40, (3, 9), ids, env=REFERENCE_KERNELS)
    for i, window in enumerate((3, 9)):
        _check_against_whole([got[i] for got in results], "gqa", 40, True, torch.float32, ids, window)


@pytest.mark.multiprocess
def test_windowed_ring_fp16_with_the_atomic_backward():
    results = run_ranks(_windows_rank, 2, 28, (6,), None, torch.float16, False)
    _check_against_whole([got[0] for got in results], "gqa", 28, True, torch.float16, window=6)


def test_world_of_one_is_flash_attention_with_the_window(seed):
    from tessel.kernels.attention import flash_attention
    from tessel.parallel.context import ring_attention

    q, k, v = (torch.randn(2, 4, 23, 16) for _ in range(3))
    assert torch.equal(ring_attention(q, k, v, causal=True, window=5), flash_attention(q, k, v, True, window=5))


@pytest.mark.parametrize(
    "kw, error, words",
    [
        (dict(window=4), ValueError, r"ring_attention: window=4 needs causal=True"),
        (dict(causal=True, window=0), ValueError, r"ring_attention: window must be None or at least 1, received 0"),
        (dict(causal=True, window=2.0), TypeError, r"ring_attention: window must be None or an int, received float"),
    ],
)
def test_bad_windows_are_refused(kw, error, words):
    from tessel.parallel.context import ring_attention

    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(error, match=words):
        ring_attention(q, q, q, **kw)
