"""tessel.kernels.attention with ``window``: causal sliding-window (local) attention, as in Mistral and Gemma 2.

Query ``i`` attends to the ``W`` latest keys up to its own, ``i + Sk - Sq - W < j ≤ i + Sk - Sq``. The
definition is checked independently of the masked reference: every query row runs through the float64
reference alone, over exactly the keys of its window (no mask at all), the rows are stacked, and the
kernel's out, lse, dq, dk, dv must equal that. Tolerances are test_attention.py's.

Windows are placed across the interpreter's 16/32 blocks: a window of one key, windows shorter than a
block, longer than several, longer than the sequence; Sq < Sk (queries over a longer cache) and Sq > Sk
(the first queries see no key). Where a block lies outside every window of a query (key) block, its
tokens are poisoned with NaN: had a kernel read them (and multiplied them by a zero probability) the
result would be NaN, so the kernels are shown to skip them, which is what makes the work grow with
``S · W`` rather than with ``S²``.
"""

import pytest
import torch

from tessel.kernels._dispatch import INTERPRET
from tessel.kernels.attention import flash_attention, flash_attention_backward, flash_attention_reference
from tests.kernels.test_attention import B, assert_close, assert_lse_close, make_qkv
from tests.kernels.test_attention_segments import ids_from_lengths, runs

needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="reasons about the interpreter's fixed block sizes")


def window_reference(q, k, v, window, grad_out):
    """float64 out, lse, dq, dk, dv, each query row attending to the keys of its window only."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    sq, sk = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    kk, vv = k64.repeat_interleave(group, 1), v64.repeat_interleave(group, 1)
    outs, lses = [], []
    for i in range(sq):
        last = i + sk - sq  # the row's own position among the keys
        first = max(last - window + 1, 0)
        if last < 0:  # sees no key
            outs.append(torch.zeros_like(q64[:, :, i]))
            lses.append(torch.full(q64.shape[:2], float("-inf"), dtype=torch.float64))
            continue
        scores = (q64[:, :, i : i + 1] @ kk[:, :, first : last + 1].transpose(-1, -2)).squeeze(2) * q.shape[-1] ** -0.5
        lse = torch.logsumexp(scores, -1)
        outs.append((torch.softmax(scores, -1).unsqueeze(2) @ vv[:, :, first : last + 1]).squeeze(2))
        lses.append(lse)
    out, lse = torch.stack(outs, 2), torch.stack(lses, 2)
    (out * grad_out.double()).sum().backward()
    return out.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


def kernel_with_grads(q, k, v, window, grad_out, deterministic=True, segment_ids=None):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = flash_attention(q, k, v, True, return_lse=True, window=window, deterministic=deterministic,
                               segment_ids=segment_ids)  # fmt: skip
    (out.float() * grad_out.float()).sum().backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def check(got, want, dtype, tag, floor=1e-30):
    """``floor``: the smallest max|want| errors are taken relative to (a window of one key has dq = 0 exactly;
    the kernel's dP - Δ of a single key rounds to ~1e-7 instead)."""
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        if name == "lse":
            assert_lse_close(g, w, f"{tag} lse")
        else:
            assert_close(g, w, dtype, f"{tag} {name}", floor)


# (Sq, Sk, window): inside one block, shorter than a block, across several, of one key, over a longer cache,
# more queries than keys
CASES = {
    "short": (37, 37, 5),
    "one-key": (50, 50, 1),
    "block": (64, 64, 16),
    "long": (130, 130, 47),
    "cache": (19, 50, 7),
    "more-queries": (40, 25, 6),
}


# Each case in one layout (they take turns), and the long case, which spans every kind of block, in all three.
_TURNS = [(case, ("mha", "gqa", "mqa")[i % 3]) for i, case in enumerate(CASES)]
WINDOW_LAYOUTS = _TURNS + [("long", layout) for layout in ("mha", "gqa", "mqa") if ("long", layout) not in _TURNS]


@pytest.mark.parametrize(("case", "layout"), WINDOW_LAYOUTS, ids=[f"{lay}-{case}" for case, lay in WINDOW_LAYOUTS])
def test_each_query_attends_to_its_window(seed, case, layout):
    sq, sk, window = CASES[case]
    q, k, v = make_qkv(layout, sq, 32, torch.float32, sk=sk)
    grad_out = torch.randn(q.shape)
    check(kernel_with_grads(q, k, v, window, grad_out), window_reference(q, k, v, window, grad_out), torch.float32,
          f"{case} {layout}", floor=1.0 if window == 1 else 1e-30)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["dq-kernel", "atomic-dq"])
def test_dtypes_and_both_backward_kernels(seed, dtype, deterministic):
    q, k, v = make_qkv("gqa", 70, 64, dtype)
    grad_out = torch.randn(q.shape).to(dtype)
    got = kernel_with_grads(q, k, v, 33, grad_out, deterministic)
    check(got, window_reference(q, k, v, 33, grad_out), dtype, f"{dtype} deterministic={deterministic}")
    ref = flash_attention_reference(q.double(), k.double(), v.double(), True, window=33)
    assert_close(got[0], ref, dtype, "the masked reference")


def test_a_window_as_long_as_the_keys_is_causal_attention_bit_for_bit(seed):
    q, k, v = make_qkv("gqa", 45, 32, torch.float32)
    grad_out = torch.randn(q.shape)
    plain = kernel_with_grads(q, k, v, None, grad_out)
    for window in (45, 46, 1000):
        for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), kernel_with_grads(q, k, v, window, grad_out), plain):
            assert torch.equal(g, w), (window, name)
    assert not torch.equal(kernel_with_grads(q, k, v, 44, grad_out)[0], plain[0])


def test_windows_within_packed_documents(seed):
    """segment_ids and a window together: each document is a sequence of its own, with the window inside it."""
    lengths = [[5, 20, 12], [1, 30, 6]]
    ids = ids_from_lengths(lengths)
    q, k, v = make_qkv("gqa", 37, 32, torch.float32)
    grad_out = torch.randn(q.shape)
    for window in (1, 4, 9):
        got = kernel_with_grads(q, k, v, window, grad_out, segment_ids=ids)
        want = [torch.zeros(t.shape, dtype=torch.float64) for t in (*got[:2], *got[2:])]
        for b in range(B):
            for s, e in runs(ids[b]):
                piece = window_reference(q[b : b + 1, :, s:e], k[b : b + 1, :, s:e], v[b : b + 1, :, s:e], window,
                                         grad_out[b : b + 1, :, s:e])  # fmt: skip
                for whole, part in zip(want, piece):
                    whole[b : b + 1, :, s:e] = part
        check(got, want, torch.float32, f"window {window}", floor=1.0 if window == 1 else 1e-30)


@needs_interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the poisoned rows compute with NaN, as they should
@pytest.mark.parametrize("deterministic", [True, False], ids=["dq-kernel", "atomic-dq"])
def test_blocks_outside_the_windows_are_never_read(seed, deterministic):
    # window 32 over 128 tokens; the interpreter's blocks are 32 query rows by 16 keys (forward, dQ) and
    # 16 query rows by 32 keys (dK/dV)
    q, k, v = make_qkv("gqa", 128, 16, torch.float32)
    grad_out = torch.randn(q.shape)
    want = window_reference(q, k, v, 32, grad_out)
    # queries 96..127 see keys 65..127: the key blocks before 64 are never read for them
    kp, vp = k.clone(), v.clone()
    kp[:, :, :64] = vp[:, :, :64] = float("nan")
    got = kernel_with_grads(q, kp, vp, 32, grad_out, deterministic)
    rows = slice(96, 128)
    for name, g, w in zip(("out", "lse", "dq"), got, want):
        assert_close(g[:, :, rows], w[:, :, rows], torch.float32, f"{name} of queries 96..127, keys 0..63 poisoned")
    # keys 0..31 are seen by queries 0..62 only: the query blocks from 64 on are never read for them
    qp, gp = q.clone(), grad_out.clone()
    qp[:, :, 64:] = gp[:, :, 64:] = float("nan")
    got = kernel_with_grads(qp, k, v, 32, gp, deterministic)
    keys = slice(0, 32)
    for name, g, w in zip(("dk", "dv"), got[3:], want[3:]):
        assert_close(g[:, :, keys], w[:, :, keys], torch.float32, f"{name} of keys 0..31, queries 64..127 poisoned")


def test_the_backward_alone_takes_the_window(seed):
    """flash_attention_backward(window=) gives the autograd gradients of flash_attention(window=) bit for bit."""
    q, k, v = make_qkv("gqa", 37, 32, torch.float32)
    grad_out = torch.randn(q.shape)
    out, lse, *want = kernel_with_grads(q, k, v, 6, grad_out)
    got = flash_attention_backward(q, k, v, out, lse, grad_out, True, window=6)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(g, w), name
    assert not torch.allclose(flash_attention_backward(q, k, v, out, lse, grad_out, True)[0], want[0])


def test_bad_windows_are_refused(seed):
    q, k, v = make_qkv("gqa", 19, 16, torch.float32)
    bad = [
        (ValueError, r"flash_attention: window must be None or at least 1, received 0", dict(window=0)),
        (ValueError, r"window must be None or at least 1, received -3", dict(window=-3)),
        (TypeError, r"flash_attention: window must be None or an int, received float", dict(window=4.0)),
        (TypeError, r"window must be None or an int, received bool", dict(window=True)),
        (ValueError, r"a window runs the one-pass kernel; num_splits must be None or 1, received 4",
         dict(window=4, num_splits=4)),
    ]  # fmt: skip
    for error, match, kw in bad:
        with pytest.raises(error, match=match):
            flash_attention(q, k, v, True, **kw)
    with pytest.raises(ValueError, match=r"flash_attention: window=4 needs causal=True"):
        flash_attention(q, k, v, False, window=4)
    with pytest.raises(ValueError, match=r"flash_attention_reference: window=4 needs causal=True"):
        flash_attention_reference(q, k, v, window=4)
    out, lse = flash_attention(q, k, v, True, return_lse=True)
    with pytest.raises(ValueError, match=r"flash_attention_backward: window must be None or at least 1"):
        flash_attention_backward(q, k, v, out, lse, out, True, window=0)


@pytest.mark.gpu
def test_sliding_window_in_bf16_on_cuda(seed):
    # D=128, a window of 256 over 1000 tokens, against the float64 masked reference
    q, k, v = make_qkv("gqa", 1000, 128, torch.bfloat16, device="cuda")
    grad_out = torch.randn(q.shape, device="cuda").bfloat16()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = flash_attention_reference(q64, k64, v64, True, return_lse=True, window=256)
    (out * grad_out.double()).sum().backward()
    want = (out.detach(), lse.detach(), q64.grad, k64.grad, v64.grad)
    for deterministic in (True, False):
        check(kernel_with_grads(q, k, v, 256, grad_out, deterministic), want, torch.bfloat16,
              f"deterministic={deterministic}")  # fmt: skip


@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_one_query_reads_its_window_as_a_slice(seed, monkeypatch, num_splits):
    """A decoding step (one query over a cache of 70 keys, a window of 20): the kernel gets the last 20 keys
    with no window, so split-KV applies; out, lse and the gradients (zero for the keys outside) are exact."""
    import tessel.kernels.attention as attention

    seen = []
    forward = attention._forward
    monkeypatch.setattr(attention, "_forward", lambda q, k, v, *a, **kw: seen.append((k.shape[2], a[-2], a[-1]))
                        or forward(q, k, v, *a, **kw))  # fmt: skip
    q, k, v = make_qkv("gqa", 1, 32, torch.float32, sk=70)
    grad_out = torch.randn(q.shape)
    q_, k_, v_ = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = flash_attention(q_, k_, v_, True, return_lse=True, window=20, num_splits=num_splits)
    (out * grad_out).sum().backward()
    assert seen == [(20, None, None)]  # 20 keys, no segments, no window
    check((out.detach(), lse.detach(), q_.grad, k_.grad, v_.grad), window_reference(q, k, v, 20, grad_out),
          torch.float32, f"num_splits={num_splits}")  # fmt: skip
    assert torch.equal(k_.grad[:, :, :50], torch.zeros_like(k_.grad[:, :, :50]))
    # a window longer than the cache is no window at all
    assert torch.equal(flash_attention(q, k, v, True, window=500), flash_attention(q, k, v, True))
