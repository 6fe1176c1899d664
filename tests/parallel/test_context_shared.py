"""Context-parallel attention over the whole sequence's keys and over keys every rank holds whole (DeepSeek-V4's
compressed keys), against an independent float64 attention whose one softmax holds the window's keys, the shared keys
under their bias, and the sinks.

Each rank's output and dq, dk, dv are its rows and keys; the shared keys' and values' gradients, and the sinks', are
shares of this rank's rows that add up over the ranks to the whole gradient. Bias rows that hide every shared key
(early queries, which close no compressed window) are part of the data.
"""

import pytest
import torch

from tests.kernels.test_attention import TOL
from tests.multiprocess import REFERENCE_KERNELS, run_ranks

B, D, N = 2, 16, 6


def _whole(hq, hkv, s, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, s, D, generator=g) for h in (hq, hkv, hkv))
    shared_k, shared_v = (torch.randn(B, hkv, N, D, generator=g) for _ in range(2))
    # query i sees the shared keys whose windows of 3 it has closed (as DeepSeek-V4's heavy compression), and some
    # of those dropped at random (as its indexer's top keys)
    i, n = torch.arange(s)[:, None], torch.arange(N)[None, :]
    seen = (n < (i + 1) // 3).expand(B, 1, s, N) & (torch.rand(B, 1, s, N, generator=g) < 0.7)
    bias = torch.zeros(B, 1, s, N).masked_fill(~seen, float("-inf"))
    dout = torch.randn(B, hq, s, D, generator=g)
    sinks = torch.randn(hq, generator=g)
    return q, k, v, shared_k, shared_v, bias, dout, sinks


def _reference(q, k, v, shared_k, shared_v, bias, sinks, window):
    group = q.shape[1] // k.shape[1]
    keys = torch.cat([k, shared_k], dim=2).repeat_interleave(group, dim=1)
    values = torch.cat([v, shared_v], dim=2).repeat_interleave(group, dim=1)
    s = q.shape[2]
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    hidden = (j > i) | ((j <= i - window) if window is not None else torch.zeros(s, s, dtype=torch.bool))
    own = torch.zeros(s, s, dtype=q.dtype).masked_fill(hidden, float("-inf")).expand(q.shape[0], 1, s, s)
    scores = (q @ keys.transpose(-1, -2)) / D**0.5 + torch.cat([own, bias.to(q.dtype)], dim=-1)
    parts = [scores] if sinks is None else [scores, sinks[None, :, None, None].expand(*scores.shape[:3], 1)]
    p = torch.softmax(torch.cat(parts, dim=-1), dim=-1)[..., : keys.shape[2]]
    return p @ values


def _rank(rank, world_size, hq, hkv, s, window, with_sinks):
    from tessel.parallel.context import split_sequence
    from tessel.parallel.context_shared import shared_keys_attention

    q, k, v, shared_k, shared_v, bias, dout, sinks = _whole(hq, hkv, s)
    mine = [split_sequence(t, dim=2).requires_grad_() for t in (q, k, v)]
    shared = [t.requires_grad_() for t in (shared_k, shared_v)]
    sinks = sinks.requires_grad_() if with_sinks else None
    out = shared_keys_attention(*mine, *shared, split_sequence(bias, dim=2), window=window, sinks=sinks)
    out.backward(split_sequence(dout, dim=2))
    return out.detach(), [t.grad for t in mine], [t.grad for t in shared], None if sinks is None else sinks.grad


def _check(results, hq, hkv, s, window, with_sinks):
    from tessel.parallel.context import zigzag_positions

    q, k, v, shared_k, shared_v, bias, dout, sinks = (t.double() for t in _whole(hq, hkv, s))
    whole = [t.requires_grad_() for t in (q, k, v, shared_k, shared_v, sinks)]
    want = _reference(*whole[:5], bias, whole[5] if with_sinks else None, window)
    want.backward(dout)
    tol = TOL[torch.float32]

    def close(got, expected, what):
        err = ((got.double() - expected).abs().max() / expected.abs().max()).item()
        assert err <= tol, f"{what}: error {err:.3g} (heads {hq}:{hkv}, window={window}, sinks={with_sinks})"

    for rank, (out, grads, _, _) in enumerate(results):
        pos = zigzag_positions(s, len(results), rank)
        for name, g, w in zip(("out", "dq", "dk", "dv"), (out, *grads), (want, *(t.grad for t in whole[:3]))):
            close(g, w.detach()[:, :, pos], f"rank {rank} {name}")
    for index, name in enumerate(("dshared_k", "dshared_v")):  # each rank's share: its own rows' use of them
        close(sum(r[2][index] for r in results), whole[3 + index].grad, name)
        if len(results) > 1:
            assert not torch.allclose(results[0][2][index], whole[3 + index].grad.float(), atol=1e-4), name
    if with_sinks:
        close(sum(r[3] for r in results), whole[5].grad, "dsinks")


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world_size", "hq", "hkv", "window", "with_sinks"),
                         [(2, 4, 1, None, False), (2, 4, 1, 5, True), (4, 4, 2, 3, True), (1, 4, 1, 4, True)],
                         ids=["cp2-mqa", "cp2-window-sinks", "cp4-gqa-window-sinks", "world-of-one"])  # fmt: skip
def test_shared_keys_join_the_whole_sequences_softmax(world_size, hq, hkv, window, with_sinks):
    s = 2 * max(world_size, 2) * 5
    results = run_ranks(_rank, world_size, hq, hkv, s, window, with_sinks, env=REFERENCE_KERNELS)
    _check(results, hq, hkv, s, window, with_sinks)


def test_the_shares_gather_back_into_the_sequence_with_their_gradients():
    """In a world of one the share is the sequence; the check of shapes names the argument."""
    from tessel.parallel.context_shared import sequence_from_shares, shared_keys_attention

    x = torch.randn(2, 6, 3)
    assert sequence_from_shares(x, None) is x
    q = torch.randn(1, 2, 4, D)
    k = torch.randn(1, 1, 4, D)
    with pytest.raises(ValueError, match=r"shared_bias must be \[B, 1 or Hq, L, N\] = \[1, 1 \| 2, 4, 3\]"):
        shared_keys_attention(q, k, k, torch.randn(1, 1, 3, D), torch.randn(1, 1, 3, D), torch.zeros(1, 1, 5, 3))
    with pytest.raises(ValueError, match=r"shared_k and shared_v must be \[B, Hkv, N, D\]"):
        shared_keys_attention(q, k, k, torch.randn(1, 2, 3, D), torch.randn(1, 2, 3, D), torch.zeros(1, 1, 4, 3))
    with pytest.raises(ValueError, match=r"sinks must be None or one logit per query head, shape \(2,\)"):
        shared_keys_attention(q, k, k, torch.randn(1, 1, 3, D), torch.randn(1, 1, 3, D), torch.zeros(1, 1, 4, 3),
                              sinks=torch.zeros(3))  # fmt: skip


def _gather_rank(rank, world_size):
    from tessel.parallel.context import split_sequence
    from tessel.parallel.context_shared import sequence_from_shares

    x = torch.randn(2, 12, 3, generator=torch.Generator().manual_seed(1))
    share = split_sequence(x, dim=1).requires_grad_()
    whole = sequence_from_shares(share, None, dim=1)
    weight = torch.arange(12.0).view(1, 12, 1) * (rank + 1)  # each rank uses the whole sequence its own way
    (whole * weight).sum().backward()
    return whole.detach(), share.grad


@pytest.mark.multiprocess
def test_sequence_from_shares_is_the_sequence_in_order_and_sums_the_gradients():
    from tessel.parallel.context import zigzag_positions

    results = run_ranks(_gather_rank, 2)
    x = torch.randn(2, 12, 3, generator=torch.Generator().manual_seed(1))
    total = (torch.arange(12.0).view(1, 12, 1) * 3).expand(2, 12, 3)  # ranks 1 and 2 times the position
    for rank, (whole, grad) in enumerate(results):
        assert torch.equal(whole, x)
        assert torch.equal(grad, total[:, zigzag_positions(12, 2, rank)])
