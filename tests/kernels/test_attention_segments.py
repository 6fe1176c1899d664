"""tessel.kernels.attention with ``segment_ids``: documents packed into one row attend within themselves only.

The definition is checked independently of the masked reference: every segment of every batch row runs
through the float64 reference alone (no segment_ids), the pieces are put back in place, and the kernel's
out, lse, dq, dk, dv must equal that. Tolerances are test_attention.py's (max|got - want| / max|want|);
the softmax sums run over at most 130 keys here, as there.

Segments are placed across the interpreter's 16/32 blocks: several segments in one query block, a
segment of one token, a block-aligned boundary, one segment for the whole row. Where boundaries fall on
block edges, tokens of the other segments are poisoned with NaN: a block of them that a kernel read
(and multiplied by a zero probability) would turn the result into NaN, so the kernels are shown to skip
the blocks outside a query block's (or key block's) segments, which is what makes the work grow with
the sum of the squared segment lengths.
"""

import itertools

import pytest
import torch

from tessel.kernels._dispatch import INTERPRET
from tessel.kernels.attention import flash_attention, flash_attention_backward, flash_attention_reference
from tests.kernels.test_attention import B, assert_close, assert_lse_close, make_qkv

needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="reasons about the interpreter's fixed block sizes")


def ids_from_lengths(lengths_per_row) -> torch.Tensor:
    """[B, S] segment ids 0, 1, 2, ... from each row's segment lengths."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in lengths_per_row])


def runs(ids_row: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of every run of equal ids in one row."""
    edges = [0] + [i for i in range(1, len(ids_row)) if ids_row[i] != ids_row[i - 1]] + [len(ids_row)]
    return list(itertools.pairwise(edges))


def per_segment_reference(q, k, v, ids, causal, grad_out):
    """float64 out, lse, dq, dk, dv with every segment computed as a sequence of its own."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    outs, lses = [], []
    for b in range(q.shape[0]):
        pieces = [flash_attention_reference(q64[b : b + 1, :, s:e], k64[b : b + 1, :, s:e], v64[b : b + 1, :, s:e],
                                            causal, return_lse=True) for s, e in runs(ids[b])]  # fmt: skip
        outs.append(torch.cat([o for o, _ in pieces], dim=2))
        lses.append(torch.cat([lse for _, lse in pieces], dim=2))
    out, lse = torch.cat(outs), torch.cat(lses)
    (out * grad_out.double()).sum().backward()
    return out.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


def kernel_with_grads(q, k, v, ids, causal, grad_out, deterministic=True, window=None):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = flash_attention(q, k, v, causal, return_lse=True, segment_ids=ids, deterministic=deterministic,
                               window=window)  # fmt: skip
    (out.float() * grad_out.float()).sum().backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def check(q, k, v, ids, causal, dtype, deterministic=True, tag=""):
    grad_out = torch.randn(q.shape).to(dtype)
    got = kernel_with_grads(q, k, v, ids, causal, grad_out, deterministic)
    want = per_segment_reference(q, k, v, ids, causal, grad_out)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        if name == "lse":
            assert_lse_close(g, w, f"{tag} lse")
        else:
            assert_close(g, w, dtype, f"{tag} {name}")
    return got


# each case: S, then the segment lengths of the B = 2 rows
CASES = {
    "inside-blocks": (37, [[5, 20, 12], [37]]),
    "one-token-segments": (64, [[1, 1, 30, 32], [16, 16, 16, 16]]),
    "long-and-short": (130, [[33, 1, 64, 32], [100, 30]]),
    "many": (19, [[2, 3, 2, 4, 1, 7], [1] * 19]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_each_segment_attends_as_a_sequence_of_its_own(seed, case, causal):
    s, lengths = CASES[case]
    q, k, v = make_qkv("gqa", s, 16, torch.float32)
    check(q, k, v, ids_from_lengths(lengths), causal, torch.float32, tag=f"{case} causal={causal}")


# A pairwise design: every two values of layout, dtype and backward kernel meet in some case (6 cases, not 12).
@pytest.mark.parametrize(
    ("layout", "dtype", "deterministic"),
    [
        ("mha", torch.float32, True), ("mha", torch.float16, False), ("gqa", torch.float16, True),
        ("gqa", torch.float32, False), ("mqa", torch.float32, True), ("mqa", torch.float16, False),
    ],
    ids=["mha-fp32-dq-kernel", "mha-fp16-atomic-dq", "gqa-fp16-dq-kernel", "gqa-fp32-atomic-dq",
         "mqa-fp32-dq-kernel", "mqa-fp16-atomic-dq"],
)  # fmt: skip
def test_layouts_dtypes_and_both_backward_kernels(seed, layout, dtype, deterministic):
    s, lengths = CASES["long-and-short"]
    q, k, v = make_qkv(layout, s, 32, dtype)
    check(q, k, v, ids_from_lengths(lengths), True, dtype, deterministic, f"{layout} {dtype} det={deterministic}")


def test_a_segment_is_a_run_of_equal_ids(seed):
    # ids need not increase: the two runs of 3s are two segments, and so are the 7s and the -1s
    ids = torch.tensor([[3] * 9 + [7] * 12 + [3] * 16, [-1] * 20 + [0] * 17])
    q, k, v = make_qkv("mha", 37, 16, torch.float32)
    check(q, k, v, ids, True, torch.float32)
    # the reference's mask agrees with the segment-by-segment definition
    want = per_segment_reference(q, k, v, ids, True, torch.ones(q.shape))[0]
    assert_close(flash_attention_reference(q.double(), k.double(), v.double(), True, segment_ids=ids), want,
                 torch.float32, "reference")  # fmt: skip


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_one_segment_is_plain_attention_bit_for_bit(seed, causal):
    q, k, v = make_qkv("gqa", 70, 16, torch.float32)  # three blocks of keys, the last one ragged
    grad_out = torch.randn(q.shape)
    plain = kernel_with_grads(q, k, v, None, causal, grad_out)
    one = kernel_with_grads(q, k, v, torch.full((B, 70), 5), causal, grad_out)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), plain, one):
        assert torch.equal(a, b), name


@needs_interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the poisoned rows compute with NaN, as they should
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["dq-kernel", "atomic-dq"])
def test_blocks_outside_the_segments_are_never_read(seed, causal, deterministic):
    # boundaries on the 32-token edges of every interpreter block: segment 0 = [0, 32), 1 = [32, 96), 2 = [96, 128)
    lengths = [32, 64, 32]
    q, k, v = make_qkv("gqa", 128, 16, torch.float32)
    ids = ids_from_lengths([lengths, lengths])
    grad_out = torch.randn(q.shape)
    want = per_segment_reference(q, k, v, ids, causal, grad_out)
    for poisoned, kept in (((32, 128), (0, 32)), ((0, 32), (32, 96)), ((0, 96), (96, 128))):
        sl = slice(*poisoned)
        qp, kp, vp, gp = (t.clone() for t in (q, k, v, grad_out))
        for t in (qp, kp, vp, gp):
            t[:, :, sl] = float("nan")
        got = kernel_with_grads(qp, kp, vp, ids, causal, gp, deterministic)
        keep = slice(*kept)
        for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            assert_close(g[:, :, keep], w[:, :, keep], torch.float32, f"{name} of {kept} with {poisoned} poisoned")


def test_the_backward_alone_takes_the_segment_ids(seed):
    """flash_attention_backward(segment_ids=) gives the autograd gradients of flash_attention(segment_ids=),
    bit for bit (the same kernels); without the ids it gives others."""
    s, rows = CASES["inside-blocks"]
    ids = ids_from_lengths(rows)
    q, k, v = make_qkv("gqa", s, 32, torch.float32)
    grad_out = torch.randn(q.shape)
    out, lse, *want = kernel_with_grads(q, k, v, ids, True, grad_out)
    got = flash_attention_backward(q, k, v, out, lse, grad_out, True, segment_ids=ids)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(g, w), name
    assert not torch.allclose(flash_attention_backward(q, k, v, out, lse, grad_out, True)[0], want[0])
    with pytest.raises(ValueError, match=r"flash_attention_backward: segment_ids must be \[batch, seq\]"):
        flash_attention_backward(q, k, v, out, lse, grad_out, True, segment_ids=ids[:, 1:])


def test_bad_segment_ids_are_refused(seed):
    q, k, v = make_qkv("gqa", 19, 16, torch.float32)
    ids = torch.zeros(B, 19, dtype=torch.int64)
    bad = [
        (TypeError, r"segment_ids must be None or a torch.Tensor or a tuple \(q_segment_ids, kv_segment_ids\), "
         r"received list", dict(segment_ids=[[0] * 19] * B)),
        (TypeError, r"segment_ids must be an integer tensor, received torch.float32", dict(segment_ids=ids.float())),
        (TypeError, r"segment_ids must be an integer tensor, received torch.bool", dict(segment_ids=ids.bool())),
        (ValueError, r"segment_ids must be \[batch, seq\] = \[2, 19\], received \(2, 18\)",
         dict(segment_ids=ids[:, :18])),
        (ValueError, r"segment_ids must be \[batch, seq\] = \[2, 19\], received \(19,\)", dict(segment_ids=ids[0])),
        (ValueError, r"segment_ids run the one-pass kernel; num_splits must be None or 1, received 2",
         dict(segment_ids=ids, num_splits=2)),
    ]  # fmt: skip
    for error, match, kw in bad:
        with pytest.raises(error, match=match):
            flash_attention(q, k, v, True, **kw)
    with pytest.raises(ValueError, match=r"one segment_ids tensor needs queries and keys of one sequence "
                                         r"\(Sq == Sk\), received Sq=1 and Sk=19"):  # fmt: skip
        flash_attention(q[:, :, :1], k, v, True, segment_ids=ids[:, :1])
    with pytest.raises(TypeError, match="flash_attention_reference: segment_ids must be an integer tensor"):
        flash_attention_reference(q, k, v, True, segment_ids=ids.float())


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_documents_in_bf16_on_cuda(seed, causal):
    # D=128, documents of random lengths (one of a single token) packed into rows of 1000 tokens
    lengths = [[1, 300, 77, 122], [500, 100, 400]]
    lengths[0].append(1000 - sum(lengths[0]))
    q, k, v = make_qkv("gqa", 1000, 128, torch.bfloat16, device="cuda")
    ids = ids_from_lengths(lengths).cuda()
    grad_out = torch.randn(q.shape, device="cuda").bfloat16()
    want = per_segment_reference(q, k, v, ids, causal, grad_out)
    for deterministic in (True, False):
        got = kernel_with_grads(q, k, v, ids, causal, grad_out, deterministic)
        for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            if name == "lse":
                assert_lse_close(g, w, "lse")
            else:
                assert_close(g, w, torch.bfloat16, f"{name} deterministic={deterministic}")
