"""tessel.kernels.attention with query length Sq ≠ key/value length Sk: decode, chunked prefill, cross attention.

Causal masks are bottom-right aligned (query i sees keys j ≤ i + Sk - Sq); with Sq > Sk the first Sq - Sk
queries see no key and give out 0, lse -inf and zero gradients. Errors and tolerances are those of
test_attention.py (max|got - want| / max|want| per tensor against a float64 reference): sums run over at
most 130 keys or 130 queries here, as there, so the same measured bounds hold.
"""

import pytest
import torch

from tessel.kernels._dispatch import INTERPRET
from tessel.kernels.attention import flash_attention, flash_attention_reference
from tessel.kernels.attention_kernels import INTERPRETER_DKDV_BLOCKS, INTERPRETER_DQ_BLOCKS, INTERPRETER_FWD_BLOCKS
from tests.kernels.test_adam import _compiled_kernels
from tests.kernels.test_attention import (
    assert_close,
    assert_lse_close,
    check_against_reference,
    make_qkv,
    reference_with_grads,
    rel_err,
)

# Sq < Sk (decode's one row, a chunk after a cache), Sq > Sk (rows that see no key), both on either
# side of the 16/32 interpreter blocks.
LENGTHS = [(1, 37), (19, 64), (64, 19), (37, 130), (130, 37)]
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="reasons about the interpreter's fixed block sizes")


def bottom_right_mask(sq: int, sk: int) -> torch.Tensor:
    """True where query i may see key j: j ≤ i + sk - sq."""
    return torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)


# ---------------------------------------------------------------------------------------------------- sweeps
# Every (Sq, Sk) with and without the mask on one layout, then a sample of the product of the other
# axes (layout, head dim, dtype) over the same lengths: the full product takes minutes under the interpreter.


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk", LENGTHS)
def test_lengths(seed, sq, sk, causal):
    check_against_reference(*make_qkv("gqa", sq, 32, torch.float32, sk=sk), causal, torch.float32)


@pytest.mark.parametrize(
    "layout, sq, sk, d, causal, dtype",
    [
        ("mha", 1, 37, 64, True, torch.float16),  # a decode step
        ("mqa", 1, 37, 16, False, torch.float32),
        ("mha", 19, 64, 16, True, torch.float32),  # a chunk after a cache
        ("mqa", 19, 64, 64, False, torch.float16),
        ("mqa", 64, 19, 16, True, torch.float16),  # 45 rows see no key
        ("mha", 64, 19, 64, False, torch.float32),
        ("mqa", 37, 130, 64, True, torch.float32),
        ("mha", 37, 130, 16, False, torch.float16),
        ("mha", 130, 37, 16, True, torch.float32),
        ("mqa", 130, 37, 64, False, torch.float16),
        ("gqa", 19, 64, 128, True, torch.float16),
        ("gqa", 64, 19, 32, True, torch.bfloat16),  # the interpreter's bf16 casts, at bf16's tolerance
    ],
)
def test_lengths_layouts_head_dims_dtypes(seed, layout, sq, sk, d, causal, dtype):
    check_against_reference(*make_qkv(layout, sq, d, dtype, sk=sk), causal, dtype)


@pytest.mark.parametrize("sq, sk", [(19, 64), (64, 19)])
def test_gradient_through_lse(seed, sq, sk):
    check_against_reference(*make_qkv("gqa", sq, 32, torch.float32, sk=sk), True, torch.float32, with_lse_grad=True)


# ---------------------------------------------------------------------------------------------------- semantics


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rows_that_see_no_key(seed, dtype):
    """Causal with Sq > Sk: the first Sq - Sk rows give exactly 0, lse -inf, zero dq, and no NaN anywhere."""
    sq, sk = 64, 19
    q, k, v = (t.requires_grad_() for t in make_qkv("gqa", sq, 32, dtype, sk=sk))
    out, lse = flash_attention(q, k, v, True, return_lse=True)
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    ((out * grad_out).float().sum() + (lse * grad_lse).sum()).backward()
    blind = sq - sk
    assert torch.count_nonzero(out[:, :, :blind]) == 0 and torch.isneginf(lse[:, :, :blind]).all()
    assert torch.isfinite(lse[:, :, blind:]).all()
    assert torch.count_nonzero(q.grad[:, :, :blind]) == 0
    want = reference_with_grads(q, k, v, True, grad_out, grad_lse)
    for t in (out, q.grad, k.grad, v.grad, *want[:1], *want[2:]):
        assert not t.isnan().any()
    assert torch.count_nonzero(want[2][:, :, :blind]) == 0  # the reference's autograd agrees
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), (want[0], *want[2:])):
        assert_close(got, ref, dtype, name)
    assert_lse_close(lse, want[1], "lse")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk", [(5, 9), (9, 5)])
def test_reference_against_an_explicit_masked_softmax(seed, sq, sk, causal):
    """One row at a time: softmax over the keys the row sees (j ≤ i + sk - sq when causal), none giving 0 and -inf."""
    q, k, v = (t.double() for t in make_qkv("gqa", sq, 16, torch.float32, sk=sk))
    out, lse = flash_attention_reference(q, k, v, causal, 0.5, return_lse=True)
    want_out, want_lse = torch.zeros_like(out), torch.full_like(lse, float("-inf"))
    for h in range(q.shape[1]):
        kh, vh = k[:, h // 2], v[:, h // 2]  # 4 query heads over 2 kv heads
        for i in range(sq):
            seen = i + sk - sq + 1 if causal else sk
            if seen <= 0:
                continue
            scores = 0.5 * torch.einsum("bd,bjd->bj", q[:, h, i], kh[:, :seen])
            weights = torch.exp(scores - scores.max(-1, keepdim=True).values)
            want_out[:, h, i] = torch.einsum("bj,bjd->bd", weights / weights.sum(-1, keepdim=True), vh[:, :seen])
            want_lse[:, h, i] = scores.max(-1).values + torch.log(weights.sum(-1))
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)  # float64 both ways, a few ulps apart
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_matches_sdpa_with_a_bottom_right_mask_not_its_is_causal(seed):
    """torch's is_causal is top-left aligned for Sq ≠ Sk; an explicit bottom-right mask gives tessel's result."""
    sq, sk = 19, 64
    q, k, v = make_qkv("mha", sq, 32, torch.float32, sk=sk)
    out = flash_attention(q, k, v, causal=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q64, k64, v64 = q.double(), k.double(), v.double()
    assert_close(out, sdpa(q64, k64, v64, attn_mask=bottom_right_mask(sq, sk)), torch.float32, "bottom-right")
    assert rel_err(out, sdpa(q64, k64, v64, is_causal=True)) > 0.1  # top-left: query i sees keys j ≤ i only


def test_decode_and_chunked_prefill_match_full_causal_attention(seed):
    """A KV cache's calls: one query against the cache so far, or a chunk of queries after it, give the rows
    of the full causal attention (fp32: the block partition changes only the summation order)."""
    s = 37
    q, k, v = make_qkv("gqa", s, 32, torch.float32)
    full = flash_attention(q, k, v, True)
    for t in (0, 15, 16, 36):  # decode steps: Sq = 1 against t + 1 keys
        step = flash_attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], True)
        assert_close(step, full[:, :, t : t + 1], torch.float32, f"decode step {t}")
    for lo, hi in ((0, 16), (16, 32), (32, 37)):  # chunked prefill
        chunk = flash_attention(q[:, :, lo:hi], k[:, :, :hi], v[:, :, :hi], True)
        assert_close(chunk, full[:, :, lo:hi], torch.float32, f"chunk {lo}:{hi}")


# ---------------------------------------------------------------------------------------------------- block skipping
# A masked read of a NaN still poisons its tile (0 · NaN = NaN in the dot), so a NaN planted where a block
# must be skipped shows whether it was: outputs that block never reads stay finite and exact. Each test
# also checks the NaN does reach the blocks that read it, so a test that could not fail would fail.


@needs_interpreter
@pytest.mark.parametrize("sq, sk", [(64, 100), (100, 64)])
def test_forward_and_dq_skip_key_blocks_above_the_shifted_diagonal(seed, sq, sk):
    """The last key is seen by the last query only: query blocks ending above its key block never read it."""
    bm, bn = INTERPRETER_FWD_BLOCKS["BLOCK_M"], INTERPRETER_FWD_BLOCKS["BLOCK_N"]
    assert INTERPRETER_DQ_BLOCKS == INTERPRETER_FWD_BLOCKS  # the dQ kernel walks the same ranges
    last_key_block = (sk - 1) // bn * bn
    clean = max(m + bm for m in range(0, sq, bm) if min(m + bm, sq) + sk - sq <= last_key_block)
    q, k, v = make_qkv("gqa", sq, 32, torch.float32, sk=sk)
    v_poisoned = v.clone()
    v_poisoned[:, :, -1] = float("nan")
    q.requires_grad_()
    out, lse = flash_attention(q, k, v_poisoned, True, return_lse=True)
    grad_out = torch.randn_like(out)
    (dq,) = torch.autograd.grad(out, q, grad_out)
    want_out, want_lse, want_dq, _, _ = reference_with_grads(q, k, v, True, grad_out)
    assert out[:, :, clean:].isnan().any()  # the poison reaches the block that reads it
    assert_close(out[:, :, :clean], want_out[:, :, :clean], torch.float32, "out")
    assert_lse_close(lse[:, :, :clean], want_lse[:, :, :clean], "lse")
    assert_close(dq[:, :, :clean], want_dq[:, :, :clean], torch.float32, "dq")


@needs_interpreter
@pytest.mark.parametrize("sq, sk", [(64, 100), (100, 64)])
def test_dkdv_skips_query_blocks_above_the_shifted_diagonal(seed, sq, sk):
    """Query row r0, the first that sees a key, sees only keys ≤ r0 + Sk - Sq: key blocks that start on a
    query block past it never read it, so a NaN in its output gradient cannot reach their dK and dV."""
    bm, bn = INTERPRETER_DKDV_BLOCKS["BLOCK_M"], INTERPRETER_DKDV_BLOCKS["BLOCK_N"]
    off = sk - sq
    r0 = max(0, -off)
    clean = min(n for n in range(0, sk, bn) if max(n - off, 0) // bm * bm > r0)
    q, k, v = make_qkv("gqa", sq, 32, torch.float32, sk=sk)
    k.requires_grad_()
    v.requires_grad_()
    out = flash_attention(q, k, v, True)
    grad_out = torch.randn_like(out)
    grad_poisoned = grad_out.clone()
    grad_poisoned[:, :, r0] = float("nan")
    dk, dv = torch.autograd.grad(out, (k, v), grad_poisoned)
    _, _, _, want_dk, want_dv = reference_with_grads(q, k, v, True, grad_out)
    assert dv[:, :, :clean].isnan().any()  # the poison reaches the key blocks that read row r0
    assert_close(dk[:, :, clean:], want_dk[:, :, clean:], torch.float32, "dk")
    assert_close(dv[:, :, clean:], want_dv[:, :, clean:], torch.float32, "dv")


# ---------------------------------------------------------------------------------------------------- bad input


def test_key_and_value_lengths_must_match():
    q, k, v = make_qkv("gqa", 5, 16, torch.float32, sk=7)
    with pytest.raises(
        ValueError, match=r"k and v must have the same sequence length.*\(2, 2, 7, 16\).*\(2, 2, 6, 16\)"
    ):
        flash_attention(q, k, v[:, :, :6])
    with pytest.raises(ValueError, match=r"flash_attention_reference: k and v must have the same sequence length"):
        flash_attention_reference(q, k[:, :, :6], v)


# ---------------------------------------------------------------------------------------------------- GPU
# bf16 inputs against the reference computed in fp32 from the same inputs: P and dS are rounded to bf16
# before their products (2⁻⁸ relative), as on tensor cores, so the bf16 tolerance applies.


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])  # one decode query sees every key either way
def test_gpu_bf16_decode(seed, causal):
    q, k, v = make_qkv("gqa", 1, 128, torch.bfloat16, device="cuda", sk=4096)
    check_against_reference(q, k, v, causal, torch.bfloat16, with_lse_grad=True, compute=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_bf16_chunked_prefill(seed, causal):
    q, k, v = make_qkv("gqa", 256, 128, torch.bfloat16, device="cuda", sk=1024)
    check_against_reference(q, k, v, causal, torch.bfloat16, with_lse_grad=True, compute=torch.float32)


@pytest.mark.gpu
def test_gpu_bf16_more_queries_than_keys(seed):
    q, k, v = make_qkv("mqa", 1000, 64, torch.bfloat16, device="cuda", sk=300)
    check_against_reference(q, k, v, True, torch.bfloat16, compute=torch.float32)


@pytest.mark.gpu
def test_gpu_decode_steps_neither_retune_nor_recompile(seed):
    """Sk - Sq is a runtime int and the autotuner keys on Sk's power-of-two bucket: a decode step one key
    longer than the last reuses the tuned config and one of its compiled kernels (Sk % 16 == 0 or not)."""
    from tessel.kernels.attention_kernels import _flash_attention_fwd_kernel, fwd_kernel_tuned

    q, k, v = make_qkv("gqa", 1, 64, torch.bfloat16, device="cuda", sk=1100)
    for sk in (1030, 1040):  # tunes the bucket 2048 once, compiles both divisibility variants
        flash_attention(q, k[:, :, :sk], v[:, :, :sk], True)
    tuned, compiled = len(fwd_kernel_tuned.cache), _compiled_kernels(_flash_attention_fwd_kernel)
    for sk in range(1041, 1100):
        out = flash_attention(q, k[:, :, :sk], v[:, :, :sk], True)
    torch.cuda.synchronize()
    assert len(fwd_kernel_tuned.cache) == tuned, "a decode step re-ran the autotuner"
    assert _compiled_kernels(_flash_attention_fwd_kernel) == compiled, "a decode step compiled a new kernel"
    want = flash_attention_reference(q.float(), k[:, :, :1099].float(), v[:, :, :1099].float(), True)
    assert_close(out, want, torch.bfloat16, "last decode step")
