"""Segment masks between queries and keys that are different tokens of one packed sequence.

Ring attention runs flash attention on blocks whose queries and keys come from different places in the
sequence; with packed documents a query sees exactly the keys whose segment number equals its own. The
kernels take this as two segment tables (``_cross_segment_bounds``), and ``_block_forward`` /
``_block_backward`` run them. Checked against a float64 softmax whose mask is built here, pair by pair,
from the ids: out, lse, dq, dk, dv, with rows that share no segment with any key (out 0, lse -inf, no
gradient), causal (bottom-right) and not, GQA, fp32 and fp16, Sq above and below Sk.
"""

import math

import pytest
import torch

from tessel.kernels.attention import _block_backward, _block_forward
from tessel.kernels.attention_inputs import _cross_segment_bounds
from tests.kernels.test_attention import assert_close, assert_lse_close, make_qkv


def sorted_ids(batch: int, length: int, high: int, generator) -> torch.Tensor:
    return torch.randint(0, high, (batch, length), generator=generator).sort(dim=1).values


def masked_reference(q, k, v, q_ids, k_ids, causal, grad_out):
    """float64 out, lse, dq, dk, dv with the mask of its definition: equal ids (and j ≤ i + Sk - Sq)."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    _, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    visible = q_ids[:, :, None] == k_ids[:, None, :]
    if causal:
        i, j = torch.arange(sq, device=q.device)[:, None], torch.arange(sk, device=q.device)
        visible = visible & (j <= i + sk - sq)
    kk = k64.repeat_interleave(hq // hkv, 1)
    vv = v64.repeat_interleave(hq // hkv, 1)
    scores = (q64 @ kk.transpose(-1, -2)) / math.sqrt(d)
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse.masked_fill(torch.isneginf(lse), 0.0)[..., None])
    out = probs @ vv
    (out * grad_out.double()).sum().backward()
    return out.detach(), lse.detach(), q64.grad, k64.grad, v64.grad, visible


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("layout", "sq", "sk", "high"), [("gqa", 37, 19, 4), ("mha", 16, 64, 3), ("mqa", 33, 33, 6)])
def test_cross_segments_match_the_masked_softmax(layout, sq, sk, high, causal, dtype):
    gen = torch.Generator().manual_seed(sq * 100 + sk)
    q, k, v = make_qkv(layout, sq, 32, dtype, sk=sk)
    q_ids, k_ids = sorted_ids(2, sq, high, gen), sorted_ids(2, sk, high, gen) + 1  # some ids on one side only
    segments = _cross_segment_bounds(q_ids, k_ids)
    grad_out = torch.randn(q.shape, generator=gen).to(dtype)
    out, lse = _block_forward(q, k, v, causal, 1 / math.sqrt(32), segments)
    dq, dk, dv = _block_backward(q, k, v, out, lse, grad_out, causal, 1 / math.sqrt(32), True, segments)
    *want, visible = masked_reference(q, k, v, q_ids, k_ids, causal, grad_out)
    assert (~visible.any(-1)).any() and visible.any(-1).any(), "the ids should leave some rows without keys"
    assert_lse_close(lse, want[1], "lse")
    for name, got, w in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (want[0], *want[2:])):
        assert_close(got, w, dtype, name)
    blind = ~visible.any(-1)[:, None].expand_as(lse)  # rows that see no key: exactly 0, -inf, no gradient
    assert torch.isneginf(lse[blind]).all() and (out[blind] == 0).all() and (dq[blind] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cross_segments_in_bf16_on_cuda(causal):
    """D=128, a ring step's shapes: 700 queries over 1000 keys, a few long documents and short ones."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = make_qkv("gqa", 700, 128, torch.bfloat16, device="cuda", sk=1000)
    q_ids, k_ids = sorted_ids(2, 700, 9, gen).cuda(), sorted_ids(2, 1000, 9, gen).cuda()
    segments = _cross_segment_bounds(q_ids, k_ids)
    grad_out = torch.randn(q.shape, generator=gen).bfloat16().cuda()
    *want, _ = masked_reference(q, k, v, q_ids, k_ids, causal, grad_out)
    out, lse = _block_forward(q, k, v, causal, 1 / math.sqrt(128), segments)
    assert_lse_close(lse, want[1], "lse")
    for deterministic in (True, False):
        grads = _block_backward(q, k, v, out, lse, grad_out, causal, 1 / math.sqrt(128), deterministic, segments)
        for name, got, w in zip(("out", "dq", "dk", "dv"), (out, *grads), (want[0], *want[2:])):
            assert_close(got, w, torch.bfloat16, f"{name} deterministic={deterministic}")


def test_cross_segment_tables_give_each_token_its_partners():
    q_ids = torch.tensor([[0, 0, 2, 2, 2, 5]])
    k_ids = torch.tensor([[0, 1, 1, 2, 5, 5, 5]])
    seg_q, seg_k = _cross_segment_bounds(q_ids, k_ids)
    assert seg_q.dtype == seg_k.dtype == torch.int32
    assert seg_q.tolist() == [[[0, 0, 2, 2, 2, 5], [0, 0, 3, 3, 3, 4], [1, 1, 4, 4, 4, 7]]]
    assert seg_k.tolist() == [[[0, 1, 1, 2, 5, 5, 5], [0, 2, 2, 2, 5, 5, 5], [2, 2, 2, 5, 6, 6, 6]]]
