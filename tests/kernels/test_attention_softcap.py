"""``flash_attention(softcap=c)``: soft-capped logits ``c·tanh(s/c)`` (Gemma 2, Grok) in every kernel.

Checked against a float64 softmax written out here (the capped scores, the masks spelled out over the
indices) through the public function and autograd: out, lse, dq, dk, dv, with the causal mask and
without, GQA, windows, packed documents and padded batches (ids of queries and keys), queries over a
cache, the split-KV forward and both backward kernels (deterministic and atomic dQ), fp32 and fp16; the
reference and the stand-alone backward take the cap too; a cap so large that tanh is the identity
gives the uncapped result, and bad caps are refused naming what is wrong.
"""

import math

import pytest
import torch

from tessel.kernels.attention import flash_attention, flash_attention_backward, flash_attention_reference
from tests.kernels.test_attention import assert_close, assert_lse_close, make_qkv


def capped_reference(q, k, v, cap, grad_out, causal=False, window=None, visible=None, grad_lse=None):
    """float64 out, lse, dq, dk, dv of softmax(c·tanh(s/c)) under the masks (``visible [B, Sq, Sk]`` besides)."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    sq, sk = q.shape[2], k.shape[2]
    scores = (q64 @ k64.repeat_interleave(group, 1).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = cap * torch.tanh(scores / cap)
    i, j = torch.arange(sq)[:, None] + (sk - sq), torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= i - j < window
    keep = keep[None, None] if visible is None else keep & visible[:, None]
    scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.exp(scores - lse.masked_fill(torch.isneginf(lse), 0.0)[..., None]) @ v64.repeat_interleave(group, 1)
    loss = (out * grad_out.double()).sum()
    if grad_lse is not None:
        loss = loss + (lse.masked_fill(torch.isneginf(lse), 0.0) * grad_lse.double()).sum()
    loss.backward()
    return out.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


def kernel(q, k, v, grad_out, grad_lse=None, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = flash_attention(q, k, v, return_lse=True, **kw)
    loss = (out.float() * grad_out.float()).sum()
    if grad_lse is not None:
        loss = loss + (lse.masked_fill(torch.isneginf(lse), 0.0) * grad_lse).sum()
    loss.backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def check(got, want, dtype, tag):
    assert_lse_close(got[1], want[1], f"{tag} lse")
    for name, g, w in zip(("out", "dq", "dk", "dv"), (got[0], *got[2:]), (want[0], *want[2:])):
        assert_close(g, w, dtype, f"{tag} {name}")


# A pairwise design: every two values of shape (with its layout), mask and dtype meet in some case (6, not 12).
@pytest.mark.parametrize(
    ("layout", "sq", "sk", "d", "causal", "dtype"),
    [
        ("gqa", 37, 37, 32, True, torch.float32), ("gqa", 37, 37, 32, False, torch.float16),
        ("mha", 19, 45, 16, True, torch.float16), ("mha", 19, 45, 16, False, torch.float32),
        ("mqa", 64, 64, 64, True, torch.float32), ("mqa", 64, 64, 64, False, torch.float16),
    ],
    ids=["gqa-causal-fp32", "gqa-full-fp16", "mha-causal-fp16", "mha-full-fp32", "mqa-causal-fp32", "mqa-full-fp16"],
)  # fmt: skip
def test_capped_logits_match_the_float64_softmax(seed, layout, sq, sk, d, causal, dtype):
    # q scaled up so that many scores lie beyond the cap, where tanh bends
    q, k, v = make_qkv(layout, sq, d, dtype, q_scale=4.0, sk=sk)
    grad_out, grad_lse = torch.randn(q.shape).to(dtype), torch.randn(q.shape[:3])
    want = capped_reference(q, k, v, 2.0, grad_out, causal, grad_lse=grad_lse)
    for deterministic in (True, False):
        got = kernel(q, k, v, grad_out, grad_lse, causal=causal, softcap=2.0, deterministic=deterministic)
        check(got, want, dtype, f"deterministic={deterministic}")
    uncapped = flash_attention(q, k, v, causal, return_lse=True)[1]
    assert (want[1] - uncapped.double()).abs().max() > 0.1, "the cap should change the result"


def test_the_cap_with_windows_documents_and_padding(seed):
    sq, sk = 30, 30
    q, k, v = make_qkv("gqa", sq, 32, torch.float32, q_scale=3.0, sk=sk)
    grad_out = torch.randn(q.shape)
    ids = torch.tensor([[0] * 11 + [1] * 19, [0] * 4 + [1] * 20 + [2] * 6])
    same = ids[:, :, None] == ids[:, None, :]
    check(kernel(q, k, v, grad_out, causal=True, window=7, softcap=5.0),
          capped_reference(q, k, v, 5.0, grad_out, True, window=7), torch.float32, "window")  # fmt: skip
    check(kernel(q, k, v, grad_out, causal=True, segment_ids=ids, softcap=5.0),
          capped_reference(q, k, v, 5.0, grad_out, True, visible=same), torch.float32, "documents")  # fmt: skip
    # left padding: 6 padding keys, whose queries see nothing
    k_ids = torch.tensor([[1] * 6 + [2] * 24, [2] * 30])
    q_ids = torch.where(k_ids == 1, 0, 2)
    visible = q_ids[:, :, None] == k_ids[:, None, :]
    got = kernel(q, k, v, grad_out, causal=True, segment_ids=(q_ids, k_ids), softcap=5.0)
    check(got, capped_reference(q, k, v, 5.0, grad_out, True, visible=visible), torch.float32, "padding")
    assert (got[0][0, :, :6] == 0).all() and torch.isneginf(got[1][0, :, :6]).all()


def test_split_kv_decoding_with_a_cap(seed):
    """One query over a cache, forced through the split-KV forward (4 splits) and through the one-pass one."""
    q, k, v = make_qkv("gqa", 1, 64, torch.float32, q_scale=4.0, sk=300)
    want = capped_reference(q, k, v, 3.0, torch.zeros(q.shape), causal=True)
    for splits in (4, 1):
        out, lse = flash_attention(q, k, v, True, return_lse=True, num_splits=splits, softcap=3.0)
        assert_close(out, want[0], torch.float32, f"out, {splits} splits")
        assert_lse_close(lse, want[1], f"lse, {splits} splits")


def test_the_reference_and_the_backward_alone_take_the_cap(seed):
    q, k, v = make_qkv("mha", 21, 32, torch.float32, q_scale=4.0, sk=33)
    grad_out = torch.randn(q.shape)
    want = capped_reference(q, k, v, 1.5, grad_out, causal=True)
    ref_out, ref_lse = flash_attention_reference(q.double(), k.double(), v.double(), True, return_lse=True,
                                                 softcap=1.5)  # fmt: skip
    assert_close(ref_out, want[0], torch.float32, "reference out")
    assert_lse_close(ref_lse, want[1], "reference lse")
    out, lse = flash_attention(q, k, v, True, return_lse=True, softcap=1.5)
    for deterministic in (True, False):
        grads = flash_attention_backward(q, k, v, out, lse, grad_out, True, softcap=1.5, deterministic=deterministic)
        for name, g, w in zip(("dq", "dk", "dv"), grads, want[2:]):
            assert_close(g, w, torch.float32, f"backward alone {name}")
    # the reference's own backward (autograd through tanh) agrees
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    (flash_attention_reference(q64, k64, v64, True, softcap=1.5) * grad_out.double()).sum().backward()
    for name, g, w in zip(("dq", "dk", "dv"), (q64.grad, k64.grad, v64.grad), want[2:]):
        assert_close(g, w, torch.float32, f"reference autograd {name}")


def test_a_cap_far_above_the_scores_changes_nothing(seed):
    q, k, v = make_qkv("gqa", 19, 16, torch.float32)
    grad_out = torch.randn(q.shape)
    capped = kernel(q, k, v, grad_out, causal=True, softcap=1e6)
    plain = kernel(q, k, v, grad_out, causal=True)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), capped, plain):
        assert_close(g, w, torch.float32, name)


def test_bad_caps_are_refused(seed):
    q, k, v = make_qkv("mha", 4, 16, torch.float32)
    out, lse = flash_attention(q, k, v, return_lse=True)
    for bad, error, match in (
        (0.0, ValueError, r"softcap must be None or a finite number above 0, received 0.0"),
        (-3, ValueError, r"above 0, received -3"),
        (float("inf"), ValueError, r"above 0, received inf"),
        (float("nan"), ValueError, r"above 0, received nan"),
        (True, TypeError, r"softcap must be None or a number, received bool"),
        ("50", TypeError, r"softcap must be None or a number, received str"),
    ):
        with pytest.raises(error, match="flash_attention: .*" + match):
            flash_attention(q, k, v, softcap=bad)
        with pytest.raises(error, match="flash_attention_reference: .*" + match):
            flash_attention_reference(q, k, v, softcap=bad)
        with pytest.raises(error, match="flash_attention_backward: .*" + match):
            flash_attention_backward(q, k, v, out, lse, out, softcap=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_capped_logits_in_bf16_on_cuda(seed, causal):
    """D=128, GQA, Gemma 2's cap of 50 on scores scaled up to reach it; split-KV decoding too."""
    q, k, v = make_qkv("gqa", 1000, 128, torch.bfloat16, device="cuda", q_scale=8.0)
    grad_out = torch.randn(q.shape, device="cuda").bfloat16()
    want = capped_reference(q.cpu(), k.cpu(), v.cpu(), 50.0, grad_out.cpu(), causal)
    for deterministic in (True, False):
        got = kernel(q, k, v, grad_out, causal=causal, softcap=50.0, deterministic=deterministic)
        check(tuple(t.cpu() for t in got), want, torch.bfloat16, f"deterministic={deterministic}")
    step = flash_attention(q[:, :, -1:], k, v, causal, softcap=50.0, num_splits=8)
    assert_close(step.cpu(), want[0][:, :, -1:], torch.bfloat16, "split-KV decoding step")
