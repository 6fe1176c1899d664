"""The attention kernels with the causal diagonal placed anywhere (``offset``): blocks of a longer sequence.

A caller that assembles attention from blocks (ring attention under context parallelism) runs the
kernels on a block of queries that starts ``o`` places after its block of keys: query ``i`` then sees
key ``j`` when ``j ≤ i + o`` (causal) and ``i + o - j < W`` (a window). ``_block_forward`` and
``_block_backward`` take that ``offset``; by default it is ``Sk - Sq`` (the bottom-right aligned mask).

Checked against a float64 softmax whose mask spells the conditions out over the block's indices, with
gradients through autograd; rows that see no key give 0 and ``lse = -inf``. A bf16 case at D=128 runs
on CUDA (``-m gpu``).
"""

import math

import pytest
import torch

import tessel.kernels.attention as attention
from tessel.kernels.attention import _block_backward, _block_forward
from tessel.kernels.attention_inputs import _cross_segment_bounds
from tests.kernels.test_attention import assert_close, assert_lse_close, make_qkv


def offset_reference(q, k, v, causal, window, offset, grad_out, q_ids=None, k_ids=None):
    """float64 out, lse, dq, dk, dv with the mask of ``offset`` (and of equal segment numbers) spelled out:
    query i sees key j when j ≤ i + offset (causal), i + offset - j < window, and their ids are equal."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    sq, sk, d = q.shape[2], k.shape[2], q.shape[3]
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        keep &= j <= i + offset
    if window is not None:
        keep &= i + offset - j < window
    keep = keep.expand(q.shape[0], 1, sq, sk)
    if q_ids is not None:
        keep = keep & (q_ids[:, None, :, None] == k_ids[:, None, None, :])
    group = q.shape[1] // k.shape[1]
    kk, vv = k64.repeat_interleave(group, 1), v64.repeat_interleave(group, 1)
    scores = (q64 @ kk.transpose(-1, -2) / math.sqrt(d)).masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    seen = keep.any(-1)
    p = torch.exp(scores - lse.masked_fill(~seen, 0.0).unsqueeze(-1))
    out = p @ vv
    (out * grad_out.double()).sum().backward()
    return out.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


def block_with_grads(q, k, v, causal, window, offset, grad_out, deterministic=True, segments=None):
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = _block_forward(q, k, v, causal, scale, segments, window, offset)
    grads = _block_backward(q, k, v, out, lse, grad_out, causal, scale, deterministic, segments, window, offset)
    return out, lse, *grads


# (Sq, Sk, offset, window): the query block after the key block with the window over part of it; far
# enough that the last queries see no key; the window edge crossing a block edge;
# a negative offset (the first queries see no key) with the causal mask alone; a window of one key
CASES = {
    "next-chunk": (20, 20, 20, 25),
    "far": (19, 33, 60, 45),
    "cross-block": (37, 40, 33, 17),
    "negative": (37, 21, -5, None),
    "one-key": (16, 16, 0, 1),
    "inside": (24, 24, 3, 7),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("deterministic", [True, False], ids=["dq-kernel", "atomic-dq"])
def test_blocks_with_an_offset_diagonal(seed, case, deterministic):
    sq, sk, offset, window = CASES[case]
    q, k, v = make_qkv("gqa", sq, 16, torch.float32, sk=sk)
    grad_out = torch.randn(q.shape)
    got = block_with_grads(q, k, v, True, window, offset, grad_out, deterministic)
    want = offset_reference(q, k, v, True, window, offset, grad_out)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        if name == "lse":
            assert_lse_close(g, w, f"{case} lse")
        else:
            assert_close(g, w, torch.float32, f"{case} {name}", 1.0 if window == 1 else 1e-30)


def test_the_reference_backend_takes_the_offset(seed, monkeypatch):
    sq, sk, offset, window = CASES["cross-block"]
    q, k, v = make_qkv("mqa", sq, 16, torch.float32, sk=sk)
    grad_out = torch.randn(q.shape)
    monkeypatch.setattr(attention, "backend_for", lambda *t: attention.Backend.REFERENCE)
    got = block_with_grads(q, k, v, True, window, offset, grad_out)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, offset_reference(q, k, v, True, window, offset,
                                                                                grad_out)):  # fmt: skip
        (assert_lse_close if name == "lse" else lambda a, b, t: assert_close(a, b, torch.float32, t))(g, w, name)


def test_the_default_offset_is_the_bottom_right_diagonal_bit_for_bit(seed):
    q, k, v = make_qkv("gqa", 19, 16, torch.float32, sk=30)
    grad_out = torch.randn(q.shape)
    for window in (None, 6):
        default = block_with_grads(q, k, v, True, window, None, grad_out)
        explicit = block_with_grads(q, k, v, True, window, 30 - 19, grad_out)
        for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), explicit, default):
            assert torch.equal(g, w), (window, name)
        shifted = block_with_grads(q, k, v, True, window, 30 - 19 - 1, grad_out)
        assert not torch.equal(shifted[0], default[0])


@pytest.mark.parametrize("deterministic", [True, False], ids=["dq-kernel", "atomic-dq"])
def test_offsets_with_the_segments_of_two_blocks(seed, deterministic):
    """Documents numbered over the whole sequence, as ring attention's blocks see them: queries whose
    document has no key in the block (before it, after it) see nothing, others part of their window."""
    q_ids = torch.tensor([[3] * 6 + [4] * 20 + [6] * 11, [1] * 37])
    k_ids = torch.tensor([[2] * 9 + [3] * 14 + [4] * 17, [0] * 40])
    q, k, v = make_qkv("gqa", 37, 16, torch.float32, sk=40)
    grad_out = torch.randn(q.shape)
    for offset, window in ((40, 30), (30, 12), (20, None)):
        got = block_with_grads(q, k, v, True, window, offset, grad_out, deterministic,
                               _cross_segment_bounds(q_ids, k_ids))  # fmt: skip
        want = offset_reference(q, k, v, True, window, offset, grad_out, q_ids, k_ids)
        for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            if name == "lse":
                assert_lse_close(g, w, f"offset {offset} window {window} lse")
            else:
                assert_close(g, w, torch.float32, f"offset {offset} window {window} {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [True, False], ids=["dq-kernel", "atomic-dq"])
def test_offsets_in_bf16_on_cuda(seed, deterministic):
    """D=128 over blocks of ring-attention size: a query block 512 tokens after its key block, windows across
    it, and the documents of two blocks, against the float64 reference."""
    q, k, v = make_qkv("gqa", 300, 128, torch.bfloat16, device="cuda", sk=280)
    grad_out = torch.randn(q.shape, device="cuda").bfloat16()
    q_ids = torch.repeat_interleave(torch.tensor([[4, 5, 6], [2, 2, 2]]), torch.tensor([100, 150, 50]), dim=1)
    k_ids = torch.repeat_interleave(torch.tensor([[3, 4, 5], [2, 2, 2]]), torch.tensor([60, 120, 100]), dim=1)
    for offset, window, ids in ((512, 700, None), (300, 400, (q_ids, k_ids)), (0, 64, None)):
        segments = None if ids is None else _cross_segment_bounds(*(t.cuda() for t in ids))
        got = block_with_grads(q, k, v, True, window, offset, grad_out, deterministic, segments)
        want = offset_reference(q.cpu(), k.cpu(), v.cpu(), True, window, offset, grad_out.cpu(), *(ids or ()))
        for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            if name == "lse":
                assert_lse_close(g.cpu(), w, f"offset {offset} lse")
            else:
                assert_close(g.cpu(), w, torch.bfloat16, f"offset {offset} window {window} {name}")
