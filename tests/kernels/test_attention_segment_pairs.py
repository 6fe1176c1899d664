"""``flash_attention(segment_ids=(q_ids, kv_ids))``: queries and keys with segment ids of their own.

Query ``i`` sees key ``j`` exactly when ``q_ids[b, i] == kv_ids[b, j]`` (and, when causal, ``j ≤ i + Sk - Sq``,
within ``window``). This is how padded batches run the kernel: padding keys take an id no query has, and
queries that should see nothing (left padding under a causal mask) an id no key has. Checked through the
public function and autograd against a float64 softmax whose mask is spelled out here from the ids, for
left and right padding, queries over a cache, windows, GQA, fp32 and fp16; the reference backend and the
stand-alone backward take the pair too; bad pairs are refused naming what is wrong.
"""

import math

import pytest
import torch

from tessel.kernels.attention import flash_attention, flash_attention_backward, flash_attention_reference
from tests.kernels.test_attention import assert_close, assert_lse_close, make_qkv
from tests.kernels.test_attention_segments import kernel_with_grads


def padding_ids(sq: int, sk: int, starts, ends, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids of a padded batch: row b's real keys are ``[starts[b], ends[b])``; queries at the last ``sq`` of
    ``sk`` positions. Keys: 1 before, 2 inside, 3 after; queries: 2, or 0 (no key) where a causal query lies
    before its row's first real key."""
    pos = torch.arange(sk)
    k_ids = torch.stack([1 + (pos >= s).long() + (pos >= e).long() for s, e in zip(starts, ends)])
    qpos = pos[sk - sq :]
    q_ids = torch.stack([torch.where((qpos < s) & causal, 0, 2) for s in starts])
    return q_ids, k_ids


def visible_mask(q_ids, k_ids, causal: bool, window=None) -> torch.Tensor:
    """``[B, Sq, Sk]`` bool, the definition: equal ids, j ≤ i + Sk - Sq, i + Sk - Sq - j < window."""
    sq, sk = q_ids.shape[1], k_ids.shape[1]
    i = torch.arange(sq, device=q_ids.device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=q_ids.device)[None, :]
    visible = q_ids[:, :, None] == k_ids[:, None, :]
    if causal:
        visible = visible & (j <= i)
    if window is not None:
        visible = visible & (i - j < window)
    return visible


def masked_softmax(q, k, v, visible, grad_out):
    """float64 out, lse, dq, dk, dv of softmax attention under ``visible``."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    scores = (q64 @ k64.repeat_interleave(group, 1).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.exp(scores - lse.masked_fill(torch.isneginf(lse), 0.0)[..., None]) @ v64.repeat_interleave(group, 1)
    (out * grad_out.double()).sum().backward()
    return out.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


CASES = {
    # name: (Sq, Sk, first real key per row, one past the last)
    "left padding": (37, 37, [9, 0], [37, 37]),
    "right padding": (37, 37, [0, 0], [21, 37]),
    "both ends": (40, 40, [3, 17], [30, 40]),
    "chunk over a cache": (13, 45, [11, 0], [45, 45]),
    "decoding step": (1, 70, [33, 5], [70, 70]),
    "all but one key padded": (19, 19, [18, 0], [19, 19]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("case", list(CASES))
def test_padded_batches_match_the_masked_softmax(seed, case, causal, dtype):
    sq, sk, starts, ends = CASES[case]
    q, k, v = make_qkv("gqa", sq, 32, dtype, sk=sk)
    grad_out = torch.randn(q.shape).to(dtype)
    q_ids, k_ids = padding_ids(sq, sk, starts, ends, causal)
    if dtype == torch.float16:  # ids of any integer dtype
        q_ids, k_ids = q_ids.int(), k_ids.short()
    visible = visible_mask(q_ids, k_ids, causal)
    want = masked_softmax(q, k, v, visible, grad_out)
    got = kernel_with_grads(q, k, v, (q_ids, k_ids), causal, grad_out)
    assert_lse_close(got[1], want[1], "lse")
    for name, g, w in zip(("out", "dq", "dk", "dv"), (got[0], *got[2:]), (want[0], *want[2:])):
        assert_close(g, w, dtype, f"{case} {name}")
    # padding keys get no gradient; queries that see no key give 0 and get none
    assert (got[3][~visible.any(1)[:, None].expand(-1, k.shape[1], -1)] == 0).all()
    blind = ~visible.any(-1)[:, None].expand_as(got[1])
    assert (got[0][blind] == 0).all() and (got[2][blind] == 0).all() and torch.isneginf(got[1][blind]).all()
    if causal and starts[0] > sk - sq:
        assert blind.any(), "left padding should leave queries that see nothing"


@pytest.mark.parametrize(("sq", "sk", "window"), [(37, 37, 5), (13, 45, 16), (1, 70, 9), (30, 30, 1)])
def test_padding_within_a_window(seed, sq, sk, window):
    q, k, v = make_qkv("mha", sq, 16, torch.float32, sk=sk)
    grad_out = torch.randn(q.shape)
    q_ids, k_ids = padding_ids(sq, sk, [sk // 3, 0], [sk, sk - 4], True)
    visible = visible_mask(q_ids, k_ids, True, window)
    want = masked_softmax(q, k, v, visible, grad_out)
    got = kernel_with_grads(q, k, v, (q_ids, k_ids), True, grad_out, window=window)
    assert_lse_close(got[1], want[1], "lse")
    for name, g, w in zip(("out", "dq", "dk", "dv"), (got[0], *got[2:]), (want[0], *want[2:])):
        assert_close(g, w, torch.float32, name, floor=1.0)  # a window of one key: dq = dk = 0 exactly


def test_documents_of_a_cache_and_of_the_queries(seed):
    """Packed documents over a cache: the queries (the last 20 positions) are tokens of the cache's last
    document and of two new ones; the cache's earlier documents are seen by nobody."""
    sq, sk = 20, 64
    doc_of_key = torch.tensor([0] * 10 + [1] * 30 + [2] * 15 + [3] * 2 + [4] * 7)  # key positions 0..63
    k_ids = torch.stack([doc_of_key, doc_of_key.roll(0)])
    q_ids = k_ids[:, sk - sq :].clone()
    q, k, v = make_qkv("mqa", sq, 64, torch.float32, sk=sk)
    grad_out = torch.randn(q.shape)
    visible = visible_mask(q_ids, k_ids, True)
    want = masked_softmax(q, k, v, visible, grad_out)
    got = kernel_with_grads(q, k, v, (q_ids, k_ids), True, grad_out)
    for name, g, w in zip(("out", "dq", "dk", "dv"), (got[0], *got[2:]), (want[0], *want[2:])):
        assert_close(g, w, torch.float32, name)
    assert visible[:, :, :10].sum() == 0 and (got[3][:, :, :10] == 0).all()


def test_the_reference_and_the_backward_alone_take_the_pair(seed):
    sq, sk = 21, 50
    q, k, v = make_qkv("gqa", sq, 32, torch.float32, sk=sk)
    grad_out = torch.randn(q.shape)
    ids = padding_ids(sq, sk, [35, 2], [50, 44], True)
    want = masked_softmax(q, k, v, visible_mask(*ids, True), grad_out)
    ref_out, ref_lse = flash_attention_reference(q.double(), k.double(), v.double(), True, segment_ids=ids,
                                                 return_lse=True)  # fmt: skip
    assert_close(ref_out, want[0], torch.float32, "reference out")
    assert_lse_close(ref_lse, want[1], "reference lse")
    out, lse = flash_attention(q, k, v, True, segment_ids=ids, return_lse=True)
    grads = flash_attention_backward(q, k, v, out, lse, grad_out, True, segment_ids=ids)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want[2:]):
        assert_close(g, w, torch.float32, f"backward alone {name}")


def test_bad_pairs_are_refused(seed):
    q, k, v = make_qkv("gqa", 8, 16, torch.float32, sk=12)
    q_ids, k_ids = padding_ids(8, 12, [3, 0], [12, 10], True)
    decreasing = k_ids.clone()
    decreasing[0, 5] = 0
    bad = [
        (ValueError, r"segment_ids as a pair must be \(q_segment_ids, kv_segment_ids\), received 3 items",
         (q_ids, k_ids, k_ids)),
        (TypeError, r"segment_ids\[0\] must be None or a torch.Tensor, received list", (q_ids.tolist(), k_ids)),
        (TypeError, r"segment_ids\[1\] must be an integer tensor, received torch.float32", (q_ids, k_ids.float())),
        (ValueError, r"segment_ids\[0\] must be \[batch, Sq\] = \[2, 8\], received \(2, 12\)", (k_ids, k_ids)),
        (ValueError, r"segment_ids\[1\] must be \[batch, Sk\] = \[2, 12\], received \(2, 8\)", (q_ids, q_ids)),
        (ValueError, r"segment_ids\[1\] must be non-negative ids below 2\*\*31, non-decreasing along each row "
                     r"\(the segments numbered in order\), received 0 at \[0, 5\]", (q_ids, decreasing)),
        (ValueError, r"segment_ids\[0\] must be non-negative .* received -1 at \[1, 0\]",
         (torch.cat([q_ids[:1], q_ids[1:] - 3]), k_ids)),
        (ValueError, r"segment_ids\[0\] must be non-negative .* received 4294967296 at \[0, 7\]",
         (torch.cat([q_ids[:, :7], torch.full((2, 1), 2**32)], 1), k_ids)),
    ]  # fmt: skip
    for error, match, ids in bad:
        for fn in (flash_attention, flash_attention_reference):
            with pytest.raises(error, match=match):
                fn(q, k, v, True, segment_ids=ids)
    with pytest.raises(ValueError, match=r"segment_ids run the one-pass kernel; num_splits must be None or 1"):
        flash_attention(q, k, v, True, segment_ids=(q_ids, k_ids), num_splits=4)


def test_tables_follow_the_ids(seed):
    """The tables are kept on the query ids for the key ids they were built with: an in-place change of either,
    or another key tensor, builds them again."""
    q, k, v = make_qkv("mha", 6, 16, torch.float32, sk=6)
    q_ids, k_ids = padding_ids(6, 6, [0, 0], [6, 6], False)
    first = flash_attention(q, k, v, segment_ids=(q_ids, k_ids))
    k_ids[:, 3:] = 3  # keys 3.. become padding
    second = flash_attention(q, k, v, segment_ids=(q_ids, k_ids))
    want = masked_softmax(q, k, v, visible_mask(q_ids, k_ids, False), torch.zeros(q.shape))[0]
    assert_close(second, want, torch.float32, "after the keys' ids changed")
    assert not torch.allclose(first, second)
    other = k_ids.clone()
    other[:, 1:] = 3
    third = flash_attention(q, k, v, segment_ids=(q_ids, other))
    assert_close(third, masked_softmax(q, k, v, visible_mask(q_ids, other, False), torch.zeros(q.shape))[0],
                 torch.float32, "another key tensor")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["left", "right", "cache"])
def test_padded_batches_in_bf16_on_cuda(seed, case):
    """D=128, GQA: a left-padded batch, a right-padded one, and 200 queries over a left-padded cache."""
    sq, sk = (200, 1000) if case == "cache" else (1000, 1000)
    starts, ends = ([0, 0], [1000, 611]) if case == "right" else ([377, 0], [1000, 1000])
    q, k, v = make_qkv("gqa", sq, 128, torch.bfloat16, device="cuda", sk=sk)
    grad_out = torch.randn(q.shape, device="cuda").bfloat16()
    q_ids, k_ids = (t.cuda() for t in padding_ids(sq, sk, starts, ends, True))
    want = masked_softmax(q, k, v, visible_mask(q_ids, k_ids, True), grad_out)
    for deterministic in (True, False):
        got = kernel_with_grads(q, k, v, (q_ids, k_ids), True, grad_out, deterministic)
        assert_lse_close(got[1], want[1], "lse")
        for name, g, w in zip(("out", "dq", "dk", "dv"), (got[0], *got[2:]), (want[0], *want[2:])):
            assert_close(g, w, torch.bfloat16, f"{case} {name} deterministic={deterministic}")
