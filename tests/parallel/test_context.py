"""Context parallelism: the zigzag layout, and ring attention against the float64 attention of the whole sequence.

Each rank holds its zigzag share of q, k, v; its output and its dq, dk, dv must equal the rows of the
whole sequence's float64 attention (and gradients) at the positions it holds. Errors are
max|got - want| / max|want| per tensor, with test_attention.py's tolerances: the ring merges partial
outputs in fp32 from partials rounded to the input dtype, one more rounding than one flash call, well
inside them. On 4 ranks the blocks run the kernels' plain-PyTorch references (``REFERENCE_KERNELS``): the ring
is what 4 ranks add, and 2 ranks run every case through the kernels in Triton's interpreter.
"""

import pytest
import torch

from tests.kernels.test_attention import LAYOUTS, TOL, reference_with_grads
from tests.kernels.test_attention_segments import ids_from_lengths, per_segment_reference, runs
from tests.kernels.test_attention_window import window_reference
from tests.multiprocess import REFERENCE_KERNELS, run_ranks

B, D = 2, 16


def _whole(layout, s, dtype, seed=0):
    """q, k, v of the whole sequence and the gradient of the output, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv = LAYOUTS[layout]
    q = torch.randn(B, hq, s, D, generator=g).to(dtype)
    k = torch.randn(B, hkv, s, D, generator=g).to(dtype)
    v = torch.randn(B, hkv, s, D, generator=g).to(dtype)
    dout = torch.randn(B, hq, s, D, generator=g).to(dtype)
    return q, k, v, dout


def _ring_rank(rank, world_size, layout, s, causal, dtype, deterministic, ids=None, window=None, softcap=None):
    from tessel.parallel import count_bytes, record_events
    from tessel.parallel.context import ring_attention, split_sequence

    q, k, v, dout = _whole(layout, s, dtype)
    mine = [split_sequence(t, dim=2).requires_grad_() for t in (q, k, v)]
    with record_events() as fwd_log, count_bytes() as fwd_bytes:
        out = ring_attention(*mine, causal=causal, deterministic=deterministic, segment_ids=ids, window=window,
                             softcap=softcap)  # fmt: skip
    with record_events() as bwd_log, count_bytes() as bwd_bytes:
        out.backward(split_sequence(dout, dim=2))
    return dict(
        out=out.detach(), grads=[t.grad for t in mine], out_stride=out.stride(),
        fwd=fwd_log.events, bwd=bwd_log.events,
        fwd_bytes=(fwd_bytes.sent, fwd_bytes.received), bwd_bytes=(bwd_bytes.sent, bwd_bytes.received),
    )  # fmt: skip


def windowed_reference(q, k, v, window, dout, ids=None):
    """float64 out, lse, dq, dk, dv of causal sliding-window attention, each document (run of equal ids)
    on its own when ``ids`` is given."""
    if ids is None:
        return window_reference(q, k, v, window, dout)
    want = [torch.zeros(t.shape[:3] if i == 1 else t.shape, dtype=torch.float64)
            for i, t in enumerate((q, q, q, k, v))]  # fmt: skip
    for b in range(q.shape[0]):
        for start, end in runs(ids[b]):
            rows = (slice(b, b + 1), slice(None), slice(start, end))
            piece = window_reference(q[rows], k[rows], v[rows], window, dout[rows])
            for whole, part in zip(want, piece):
                whole[rows] = part
    return want


def _check_against_whole(results, layout, s, causal, dtype, ids=None, window=None):
    from tessel.parallel.context import zigzag_positions

    q, k, v, dout = _whole(layout, s, dtype)
    if window is not None:  # every query row over the keys of its window (within its document)
        want_out, _, *want_grads = windowed_reference(q, k, v, window, dout, ids)
    elif ids is None:
        want_out, _, *want_grads = reference_with_grads(q, k, v, causal, dout)
    else:  # every document run alone through the float64 reference
        want_out, _, *want_grads = per_segment_reference(q, k, v, ids, causal, dout)
    c = len(results)
    for rank, got in enumerate(results):
        pos = zigzag_positions(s, c, rank)
        pairs = [("out", got["out"], want_out)] + [
            (name, g, w) for name, g, w in zip(("dq", "dk", "dv"), got["grads"], want_grads)
        ]
        for name, g, w in pairs:
            w = w[:, :, pos]
            assert g.dtype == dtype and g.shape == w.shape, (name, g.shape, w.shape)
            # a window of one key gives dq = 0 exactly, where the kernels' dP - Δ rounds to ~1e-7
            err = ((g.double() - w).abs().max() / w.abs().max().clamp(min=1.0 if window == 1 else 1e-30)).item()
            what = f"({layout}, causal={causal}, window={window})"
            assert err <= TOL[dtype], f"rank {rank} {name}: error {err:.3g} > {TOL[dtype]} {what}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", ["gqa", "mha"])
def test_ring_attention_matches_the_whole_sequence(world_size, causal, layout):
    s = 2 * world_size * 5  # chunks of 5 tokens: odd, and not a multiple of any block
    results = run_ranks(_ring_rank, world_size, layout, s, causal, torch.float32, True,
                        env=REFERENCE_KERNELS if world_size == 4 else None)  # fmt: skip
    _check_against_whole(results, layout, s, causal, torch.float32)


@pytest.mark.multiprocess
@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_fp16_mqa(causal):
    results = run_ranks(_ring_rank, 2, "mqa", 28, causal, torch.float16, True)
    _check_against_whole(results, "mqa", 28, causal, torch.float16)


@pytest.mark.multiprocess
def test_ring_attention_atomic_backward_and_reference_backend():
    """deterministic=False (atomic dQ in each block) and the reference backend give the same result."""
    for deterministic, reference in ((False, False), (True, True)):
        results = run_ranks(_ring_rank, 2, "gqa", 20, True, torch.float32, deterministic,
                            env=REFERENCE_KERNELS if reference else None)  # fmt: skip
        _check_against_whole(results, "gqa", 20, True, torch.float32)


# segment lengths of the B = 2 rows over S = 2·c·5 tokens (chunks of 5): documents inside one chunk, across
# the two chunks of one rank, across ranks, one token long, and one over the whole row
SEGMENTS = {
    2: [[3, 9, 1, 7], [20]],
    4: [[2, 14, 1, 1, 17, 5], [11, 9, 10, 10]],
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_with_packed_documents(world_size, causal):
    """segment_ids of the whole sequence: each rank's rows equal every document run alone."""
    s = 2 * world_size * 5
    ids = ids_from_lengths(SEGMENTS[world_size])
    ids[0] = torch.tensor([7, 0, 7, 0, 7, 0][: len(SEGMENTS[world_size][0])]).repeat_interleave(
        torch.tensor(SEGMENTS[world_size][0])
    )  # ids repeat: a segment is a run of equal ids, not an id
    results = run_ranks(_ring_rank, world_size, "gqa", s, causal, torch.float32, True, ids,
                        env=REFERENCE_KERNELS if world_size == 4 else None)  # fmt: skip
    _check_against_whole(results, "gqa", s, causal, torch.float32, ids)


@pytest.mark.multiprocess
def test_ring_attention_with_packed_documents_fp16_atomic_and_reference_backend():
    ids = ids_from_lengths(SEGMENTS[2])
    for dtype, deterministic, reference in ((torch.float16, False, False), (torch.float32, True, True)):
        results = run_ranks(_ring_rank, 2, "mqa", 20, True, dtype, deterministic, ids,
                            env=REFERENCE_KERNELS if reference else None)  # fmt: skip
        _check_against_whole(results, "mqa", 20, True, dtype, ids)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_attention_with_soft_capped_logits(world_size):
    """Every block capped, merged through the capped log-sum-exps: the float64 reference on the whole sequence
    (q scaled up so that the cap of 1.5 bends most scores), with packed documents and a window on 2 ranks."""
    from tessel.kernels.attention import flash_attention_reference
    from tessel.parallel.context import zigzag_positions

    s = 2 * world_size * 6
    ids, window = (ids_from_lengths([[7, 17], [24]]), 5) if world_size == 2 else (None, None)
    results = run_ranks(_ring_rank, world_size, "gqa", s, True, torch.float32, True, ids, window, 1.5,
                        env=REFERENCE_KERNELS if world_size == 4 else None)  # fmt: skip
    q, k, v, dout = _whole("gqa", s, torch.float32)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    want = flash_attention_reference(q64, k64, v64, True, softcap=1.5, segment_ids=ids, window=window)
    want.backward(dout.double())
    for rank, got in enumerate(results):
        pos = zigzag_positions(s, world_size, rank)
        for name, g, w in zip(("out", "dq", "dk", "dv"), (got["out"], *got["grads"]), (want, q64.grad, k64.grad,
                                                                                          v64.grad)):  # fmt: skip
            err = ((g.double() - w.detach()[:, :, pos]).abs().max() / w.abs().max()).item()
            assert err <= TOL[torch.float32], f"rank {rank} {name}: error {err:.3g}"


def _overlapping(events, op):
    """Per transfer (op, step): was it issued before some GEMM and waited for only after that GEMM started?"""
    found = {}
    for i, (kind, name, step) in enumerate(events):
        if kind == "send" and name == op:
            wait = events.index(("wait", op, step), i)
            found[step] = any(kind2 == "gemm" for kind2, _, _ in events[i + 1 : wait])
    return found


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_overlaps_every_transfer_and_moves_the_ring_bytes(world_size):
    s = 2 * world_size * 3
    results = run_ranks(_ring_rank, world_size, "gqa", s, True, torch.float16, True)
    hkv = LAYOUTS["gqa"][1]
    kv_bytes = 2 * B * hkv * (s // world_size) * D * 2  # keys and values of one rank, fp16
    for got in results:
        # forward: the keys and values of step s+1 travel during step s's attention
        assert _overlapping(got["fwd"], "ring_attention") == {step: True for step in range(1, world_size)}
        assert got["fwd_bytes"] == ((world_size - 1) * kv_bytes,) * 2
        # backward: the same for the keys and values, and each dK/dV accumulator of another rank's block
        # travels during the next step's attention (the last one goes home at the end, with nothing left to
        # hide behind); the own block's stays home
        assert _overlapping(got["bwd"], "ring_attention") == {step: True for step in range(1, world_size)}
        dkv = _overlapping(got["bwd"], "ring_attention.dkv")
        assert dkv == {step: step < world_size - 1 for step in range(1, world_size)}
        dkv_bytes = kv_bytes * 2  # fp32 accumulators
        assert got["bwd_bytes"] == ((world_size - 1) * (kv_bytes + dkv_bytes),) * 2
        assert got["out_stride"][1] == D  # [B, L, Hq, D] in memory: heads merge without a copy


def _layout_rank(rank, world_size, s):
    from tessel.parallel.context import gather_sequence, split_sequence, zigzag_positions

    x = torch.arange(3 * s * 2, dtype=torch.float32).view(3, s, 2)
    mine = split_sequence(x)
    assert torch.equal(mine, x[:, zigzag_positions(s, world_size, rank)])
    return gather_sequence(mine), gather_sequence(mine.transpose(0, 1).contiguous(), dim=0)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4])
def test_split_and_gather_are_inverse(world_size):
    s = 2 * world_size * 3
    x = torch.arange(3 * s * 2, dtype=torch.float32).view(3, s, 2)
    for whole, whole_t in run_ranks(_layout_rank, world_size, s):
        assert torch.equal(whole, x)
        assert torch.equal(whole_t, x.transpose(0, 1))


def test_zigzag_positions_balance_the_causal_work():
    from tessel.parallel.context import zigzag_positions

    for c in (1, 2, 3, 4):
        s = 2 * c * 4
        held = [zigzag_positions(s, c, r) for r in range(c)]
        assert torch.equal(torch.cat(held).sort().values, torch.arange(s))  # every token exactly once
        # causal (query, key) pairs per rank: Σ (position + 1) over the tokens it holds, equal on every rank
        assert len({int((p + 1).sum()) for p in held}) == 1
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]


def test_zigzag_order_lays_the_shares_end_to_end():
    from tessel.parallel.context import zigzag_order

    assert zigzag_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert zigzag_order(12, 3).tolist() == [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7]
    assert zigzag_order(6, 1).tolist() == list(range(6))
    x = torch.randn(2, 24, 3)
    order = zigzag_order(24, 3)
    assert torch.equal(x[:, order].index_select(1, torch.argsort(order)), x)  # argsort undoes it


def test_world_of_one_is_flash_attention(seed):
    from tessel.kernels.attention import flash_attention
    from tessel.parallel.context import gather_sequence, ring_attention, split_sequence

    q, k, v, _ = _whole("gqa", 9, torch.float32, seed=1)
    assert torch.equal(ring_attention(q, k, v, causal=True), flash_attention(q, k, v, causal=True))
    ids = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2, 2]] * B)
    assert torch.equal(ring_attention(q, k, v, causal=True, segment_ids=ids),
                       flash_attention(q, k, v, causal=True, segment_ids=ids))  # fmt: skip
    assert split_sequence(q, dim=2) is q and gather_sequence(q, dim=2) is q


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda f, t: f.zigzag_positions(10, 2, 0), ValueError, "divisible by 2·cp = 4"),
        (lambda f, t: f.zigzag_positions(8, 2, 2), ValueError, "cp_rank < cp_size"),
        (lambda f, t: f.zigzag_positions(8.0, 2, 0), TypeError, "seq_len must be an int"),
        (lambda f, t: f.split_sequence(t, dim=4), ValueError, "dim must be an int in"),
        (lambda f, t: f.split_sequence([1, 2]), TypeError, "x must be a torch.Tensor"),
        (lambda f, t: f.ring_attention(t, t[:, :, :3], t[:, :, :3]), ValueError, "same tokens"),
        (lambda f, t: f.ring_attention(t, t[:, :1], t[:, :1], deterministic=None), TypeError, "deterministic"),
        (lambda f, t: f.ring_attention(t[..., :3], t[..., :3], t[..., :3]), ValueError, "ring_attention: head_dim"),
        (lambda f, t: f.ring_attention(t, t.half(), t), TypeError, "ring_attention: k must have q's dtype"),
        (lambda f, t: f.ring_attention(t, t, t, segment_ids=torch.zeros(1, 6)), TypeError, "integer tensor"),
        (lambda f, t: f.ring_attention(t, t, t, segment_ids=[0] * 6), TypeError, "segment_ids must be None or"),
        (
            lambda f, t: f.ring_attention(t, t, t, segment_ids=torch.zeros(1, 5, dtype=torch.int64)),
            ValueError,
            r"segment_ids must be \[batch, whole sequence\] = \[1, 6\]",
        ),
    ],
)
def test_bad_input(call, error, words):
    import tessel.parallel.context as context

    with pytest.raises(error, match=words):
        call(context, torch.randn(1, 2, 6, 16))


def _odd_rank(rank, world_size):
    from tessel.parallel.context import ring_attention, split_sequence

    t = torch.randn(1, 2, 6, 16)
    try:
        ring_attention(t[:, :, :5], t[:, :, :5], t[:, :, :5], causal=True)
    except ValueError as e:
        message = str(e)
    with pytest.raises(ValueError, match="divisible by 2·cp = 4"):
        split_sequence(t, dim=2)
    return message


@pytest.mark.multiprocess
def test_odd_local_length_is_refused_under_the_causal_mask():
    for message in run_ranks(_odd_rank, 2):
        assert "local length must be even, received 5" in message
