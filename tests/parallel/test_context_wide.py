"""Heads wider than the attention kernels take (Gemma 4's 512): ``wide_attention`` and the ring over them.

``wide_attention`` computes flash attention's result in PyTorch by tiles of query rows; the ring runs its blocks
that way where ``D`` is above the kernels' largest head dim (on 2 ranks here under Triton's interpreter, which the
kernels would run: the wide blocks must not reach them). Both against a float64 attention of the whole sequence
written out here (masked softmax with autograd), for the masks the ring takes: causal, a sliding window within
packed documents, soft-capped logits, attention sinks. ``TILE_SCORES`` is lowered so that every call is cut into
several tiles of rows, whose offsets, segment tables and summed dK/dV must come out as one call's.
"""

import pytest
import torch

from tests.multiprocess import run_ranks

B, HQ, HKV = 1, 4, 2
TOL = 1e-5  # fp32 against float64, relative to each tensor's largest entry


def naive(q, k, v, causal=False, ids=None, window=None, softcap=None, sinks=None, scale=None):
    """float64 attention of the whole sequence: the output and its log-sum-exp, differentiable by autograd."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    i, j = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
    hidden = torch.zeros(q.shape[2], k.shape[2], dtype=torch.bool)
    if causal:
        hidden |= j > i
    if window is not None:
        hidden |= i - j >= window
    hidden = hidden.expand(q.shape[0], 1, -1, -1)
    if ids is not None:
        hidden = hidden | (ids[:, None, :, None] != ids[:, None, None, :])
    scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.exp(scores - lse[..., None]) @ v
    if sinks is not None:
        with_sink = torch.logaddexp(lse, sinks.double()[None, :, None])
        out, lse = out * torch.exp(lse - with_sink)[..., None], with_sink
    return out, lse


def _inputs(s, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, s, d, generator=g)
    k, v = torch.randn(B, HKV, s, d, generator=g), torch.randn(B, HKV, s, d, generator=g)
    return q, k, v, torch.randn(B, HQ, s, d, generator=g), torch.randn(HQ, generator=g)


def _error(got, want):
    return ((got.double() - want).abs().max() / want.abs().max()).item()


CASES = {
    "full": {},
    "causal": dict(causal=True),
    "window in documents": dict(causal=True, window=3, ids=True),
    "documents, not causal": dict(ids=True),
    "soft-capped": dict(causal=True, softcap=2.0),
    "sinks": dict(causal=True, sinks=True),
}


def _ids(s):
    return torch.tensor([[0] * 3 + [1] * (s - 7) + [2] * 4])  # documents across the chunks and the ranks


def _keep_wide_blocks_off_the_kernels():
    """The Triton interpreter would run a kernel at D = 512 (a GPU's registers and shared memory would not hold its
    tiles): make reaching one an error."""
    import tessel.kernels.attention as kernels

    def guard(name, run):
        def guarded(q, *args, **kwargs):
            assert q.shape[-1] <= 256, f"a block of head dim {q.shape[-1]} reached the kernels' {name}"
            return run(q, *args, **kwargs)

        return guarded

    for name in ("_forward", "_backward"):
        setattr(kernels, name, guard(name, getattr(kernels, name)))


def _ring_rank(rank, world_size, s, d, case):
    import tessel.kernels.attention_reference as reference
    from tessel.parallel import record_events
    from tessel.parallel.context import ring_attention, split_sequence

    reference.TILE_SCORES = B * HQ * (s // world_size) * 3  # each block cut into tiles of 3 rows (and a rest)
    _keep_wide_blocks_off_the_kernels()
    q, k, v, dout, sinks = _inputs(s, d)
    kw = dict(CASES[case])
    kw["segment_ids"] = _ids(s) if kw.pop("ids", False) else None
    mine = [split_sequence(t, dim=2).requires_grad_() for t in (q, k, v)]
    theirs = sinks.clone().requires_grad_() if kw.pop("sinks", False) else None
    with record_events() as log:
        out = ring_attention(*mine, sinks=theirs, **kw)
        out.backward(split_sequence(dout, dim=2))
    sends = [e for e in log.events if e[:2] == ("send", "ring_attention")]
    return dict(out=out.detach(), grads=[t.grad for t in mine], dsinks=None if theirs is None else theirs.grad,
                sends=len(sends))  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.parametrize("d", [512, 320])
@pytest.mark.parametrize("case", list(CASES))
def test_ring_attention_over_heads_wider_than_the_kernels(case, d):
    from tessel.parallel.context import zigzag_positions

    s = 20  # chunks of 5 tokens on each of the 2 ranks
    results = run_ranks(_ring_rank, 2, s, d, case, timeout=300)
    q, k, v, dout, sinks = _inputs(s, d)
    kw = dict(CASES[case])
    ids = _ids(s) if kw.pop("ids", False) else None
    leaves = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    out, _ = naive(*leaves[:3], ids=ids, sinks=leaves[3] if kw.pop("sinks", False) else None, **kw)
    out.backward(dout.double())
    for rank, got in enumerate(results):
        pos = zigzag_positions(s, 2, rank)
        assert got["sends"] >= 1  # the ring ran
        for name, g, w in zip(("out", "dq", "dk", "dv"), (got["out"], *got["grads"]), (out.detach(), *leaves)):
            w = w if name == "out" else w.grad
            assert _error(g, w[:, :, pos]) <= TOL, f"{case} D={d} rank {rank} {name}: {_error(g, w[:, :, pos]):.3g}"
    if results[0]["dsinks"] is not None:  # each rank's share of the sinks' gradient, from its own rows
        assert _error(results[0]["dsinks"] + results[1]["dsinks"], leaves[3].grad) <= TOL


@pytest.mark.parametrize("case", list(CASES))
def test_wide_attention_by_tiles_of_rows_matches_the_whole_and_one_tile(case, monkeypatch):
    """In one process: the output, the log-sum-exp (its gradient too) and dq, dk, dv over several tiles of rows
    equal the float64 attention's, and one tile's within rounding; queries fewer than keys (over a cache)."""
    import tessel.kernels.attention_reference as reference
    from tessel.kernels.attention_reference import wide_attention

    q, k, v, dout, _ = _inputs(13, 384, seed=1)
    kw = dict(CASES[case])
    kw.pop("sinks", None)
    ids = _ids(13) if kw.pop("ids", False) else None
    q = q[:, :, 4:]  # the last 9 queries over the 13 keys (bottom-right aligned causal mask)
    dlse = torch.randn(q.shape[:3], generator=torch.Generator().manual_seed(2))

    def run(tile_rows):
        monkeypatch.setattr(reference, "TILE_SCORES", B * HQ * 13 * tile_rows)
        assert len(reference._row_tiles(q, k)) == -(-9 // tile_rows)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        segment_ids = None if ids is None else (ids[:, 4:], ids)
        out, lse = wide_attention(*leaves, return_lse=True, segment_ids=segment_ids, **kw)
        ((out * dout[:, :, 4:]).sum() + (lse * dlse).sum()).backward()
        return [out.detach(), lse.detach(), *(t.grad for t in leaves)]

    tiled, whole = run(2), run(1000)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out, lse = _naive_rows(leaves, ids, **kw)
    ((out * dout[:, :, 4:].double()).sum() + (lse * dlse.double()).sum()).backward()
    for name, t, w, one in zip(("out", "lse", "dq", "dk", "dv"), tiled, [out, lse, *(x.grad for x in leaves)], whole):
        assert _error(t, w.detach()) <= TOL, f"{case} {name}: {_error(t, w.detach()):.3g}"
        assert _error(t, one.double()) <= 1e-6, f"{case} {name}: tiled against one tile {_error(t, one.double()):.3g}"


def _naive_rows(leaves, ids, causal=False, window=None, softcap=None):
    """:func:`naive` for the last queries over all the keys: run on the whole sequence with zero-padded leading
    queries, which are then dropped (the masks bottom-right aligned, as the kernels' are)."""
    q, k, v = leaves
    pad = k.shape[2] - q.shape[2]
    full_q = torch.cat([q.new_zeros(B, HQ, pad, q.shape[-1]), q], 2)
    out, lse = naive(full_q, k, v, causal, ids, window, softcap)
    return out[:, :, pad:], lse[:, :, pad:]


def test_a_world_of_one_runs_wide_attention_and_bad_head_dims_are_refused():
    from tessel.kernels.attention import flash_attention
    from tessel.kernels.attention_reference import wide_attention
    from tessel.parallel.context import ring_attention

    q, k, v, dout, sinks = _inputs(12, 512)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = ring_attention(*leaves[:3], causal=True, sinks=leaves[3])
    out.backward(dout)
    exact = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    want, _ = naive(*exact[:3], causal=True, sinks=exact[3])
    want.backward(dout.double())
    assert _error(out, want.detach()) <= TOL
    for got, w in zip(leaves, exact):
        assert _error(got.grad, w.grad) <= TOL
    narrow = torch.randn(1, 2, 4, 100)
    for call in (wide_attention, ring_attention):
        with pytest.raises(ValueError, match=r"head_dim must be one of \(16, 32, 64, 128, 256\) or above 256, "
                                             r"received 100"):  # fmt: skip
            call(narrow, narrow, narrow)
    with pytest.raises(ValueError, match=r"head_dim must be one of \(16, 32, 64, 128, 256\), received 512"):
        flash_attention(q, k, v)  # the kernels' own contract is unchanged
