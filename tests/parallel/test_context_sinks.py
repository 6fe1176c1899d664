"""Ring attention with attention sinks (GPT-OSS's: one learned logit per query head in every row's softmax) against an
independent float64 attention of the whole sequence, the sink a column of the softmax that attends to nothing.

Each rank's output and dq, dk, dv are the rows and keys it holds; the sinks' gradient is a share of this rank's rows,
and the ranks' shares add up to the whole gradient. The ring's result, its all-gather form (what a compiled model
runs) and a world of one (flash attention) all carry the sinks.
"""

import pytest
import torch

from tests.kernels.test_attention import LAYOUTS, TOL
from tests.kernels.test_attention_segments import ids_from_lengths
from tests.multiprocess import REFERENCE_KERNELS, run_ranks

B, D = 2, 16


def _whole(layout, s, seed=0):
    g = torch.Generator().manual_seed(seed)
    hq, hkv = LAYOUTS[layout]
    q, k, v = (torch.randn(B, h, s, D, generator=g) for h in (hq, hkv, hkv))
    dout = torch.randn(B, hq, s, D, generator=g)
    sinks = torch.randn(hq, generator=g) * 2.0  # some rows mostly sink, others barely
    return q, k, v, dout, sinks


def sink_reference(q, k, v, sinks, causal, window=None, ids=None):
    """float64 attention whose softmax holds each head's sink beside the keys (a logit with no value)."""
    group = q.shape[1] // k.shape[1]
    keys, values = (t.repeat_interleave(group, dim=1) for t in (k, v))
    scores = (q @ keys.transpose(-1, -2)) / D**0.5
    s = q.shape[2]
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    hidden = torch.zeros(s, s, dtype=torch.bool)
    if causal:
        hidden |= j > i
    if window is not None:
        hidden |= j <= i - window
    hidden = hidden.expand(q.shape[0], 1, s, s)
    if ids is not None:
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        run = starts.cumsum(1)
        hidden = hidden | (run[:, None, :, None] != run[:, None, None, :])
    scores = scores.masked_fill(hidden, float("-inf"))
    sink = sinks[None, :, None, None].expand(*scores.shape[:3], 1)
    p = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return p @ values


def _rank(rank, world_size, layout, s, causal, window, ids, gathered):
    from tessel.parallel.context import _gathered_attention, ring_attention, split_sequence

    q, k, v, dout, sinks = _whole(layout, s)
    mine = [split_sequence(t, dim=2).requires_grad_() for t in (q, k, v)]
    sinks.requires_grad_()
    if gathered:  # the all-gather form a compiled model runs, called eagerly
        out = _gathered_attention(*mine, None, causal, D**-0.5, True, ids, window, None, sinks)
    else:
        out = ring_attention(*mine, causal=causal, segment_ids=ids, window=window, sinks=sinks)
    out.backward(split_sequence(dout, dim=2))
    return out.detach(), [t.grad for t in mine], sinks.grad


def _check(results, layout, s, causal, window=None, ids=None):
    from tessel.parallel.context import zigzag_positions

    q, k, v, dout, sinks = (t.double() for t in _whole(layout, s))
    whole = [t.requires_grad_() for t in (q, k, v, sinks)]
    want = sink_reference(*whole[:3], whole[3], causal, window, ids)
    want.backward(dout)
    tol = TOL[torch.float32]
    for rank, (out, grads, _) in enumerate(results):
        pos = zigzag_positions(s, len(results), rank)
        for name, g, w in zip(("out", "dq", "dk", "dv"), (out, *grads), (want, *(t.grad for t in whole[:3]))):
            w = w.detach()[:, :, pos]
            err = ((g.double() - w).abs().max() / w.abs().max()).item()
            assert err <= tol, f"rank {rank} {name}: error {err:.3g} ({layout}, causal={causal}, window={window})"
    dsinks = sum(r[2].double() for r in results)  # each rank's share: its own rows
    err = ((dsinks - whole[3].grad).abs().max() / whole[3].grad.abs().max()).item()
    assert err <= tol, f"dsinks: error {err:.3g}"
    assert not any(torch.equal(r[2], dsinks.float()) for r in results)  # a share each, not the whole


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_with_sinks_matches_the_whole_sequence(world_size, causal):
    s = 2 * world_size * 5
    results = run_ranks(_rank, world_size, "gqa", s, causal, None, None, False,
                        env=REFERENCE_KERNELS if world_size == 4 else None)  # fmt: skip
    _check(results, "gqa", s, causal)


@pytest.mark.multiprocess
def test_sinks_with_a_window_and_packed_documents():
    """GPT-OSS's sliding layers: a window of 5 keys over packed documents, on the ring's two streams."""
    ids = ids_from_lengths([[7, 17], [24]])
    results = run_ranks(_rank, 2, "mqa", 24, True, 5, ids, False)
    _check(results, "mqa", 24, True, 5, ids)


@pytest.mark.multiprocess
@pytest.mark.parametrize("causal", [True, False])
def test_the_all_gather_form_carries_the_sinks(causal):
    results = run_ranks(_rank, 2, "gqa", 20, causal, 3 if causal else None, None, True, env=REFERENCE_KERNELS)
    _check(results, "gqa", 20, causal, 3 if causal else None)


def test_a_world_of_one_is_flash_attention_with_sinks():
    from tessel.parallel.context import ring_attention

    q, k, v, dout, sinks = _whole("gqa", 13)
    whole = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = ring_attention(*whole[:3], causal=True, sinks=whole[3])
    out.backward(dout)
    ref = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    want = sink_reference(*ref[:3], ref[3], True)
    want.backward(dout.double())
    for g, w in zip((out, *(t.grad for t in whole)), (want, *(t.grad for t in ref))):
        assert ((g.double() - w.detach()).abs().max() / w.abs().max()).item() <= TOL[torch.float32]


@pytest.mark.parametrize(
    "sinks, error, words",
    [
        ([0.0, 1.0], TypeError, "sinks must be None or a floating-point torch.Tensor, received list"),
        (torch.zeros(4, dtype=torch.int64), TypeError, "received torch.int64"),
        (torch.zeros(3), ValueError, r"one logit per query head, shape \(4,\), received \(3,\)"),
    ],
)
def test_bad_sinks_are_refused(sinks, error, words):
    from tessel.parallel.context import ring_attention

    q, k, v, _, _ = _whole("gqa", 8)
    with pytest.raises(error, match=words):
        ring_attention(q, k, v, causal=True, sinks=sinks)
