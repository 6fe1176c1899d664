"""tessel.kernels.attention's split-KV forward (flash-decoding): keys cut into splits, partials merged by lse.

``num_splits=n > 1`` forces the split-KV kernel, whose tile rows are one kv head's (query head, position)
pairs; the backward is the one-pass kernels' either way, from the split forward's out and lse. Every
case is checked against a float64 reference (out, lse, dq, dk, dv) with the tolerances of
test_attention.py. Under the interpreter the key tile is 16 wide and a split a multiple of 16 keys, so
the lengths below put split edges inside, at and past the causal diagonal, and leave tails.
"""

import functools
from types import SimpleNamespace

import pytest
import torch

import tessel.kernels.attention as attention_module
import tests.kernels.test_attention as attention_tests
from tessel.kernels._dispatch import INTERPRET, Backend
from tessel.kernels.attention import MAX_SPLITS, flash_attention, flash_attention_reference
from tessel.kernels.attention_kernels import INTERPRETER_SPLIT_KV_BLOCK_N, SPLIT_KV_KEY_ALIGN
from tests.kernels.test_attention import check_against_reference, make_qkv, nan_empty  # noqa: F401 (fixture)

needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="reasons about the interpreter's fixed block sizes")


@pytest.fixture
def spy(monkeypatch):
    """Records the (BLOCK_M, keys per split, splits) plan of every split-KV forward."""
    plans = []
    real = attention_module._forward_split_kv

    def recording(q, k, v, out, lse, causal, scale, backend, block_m, keys, splits, **kwargs):
        plans.append((block_m, keys, splits))
        return real(q, k, v, out, lse, causal, scale, backend, block_m, keys, splits, **kwargs)

    monkeypatch.setattr(attention_module, "_forward_split_kv", recording)
    return plans


def split(monkeypatch, n):
    """Make test_attention's checks call flash_attention with num_splits=n."""
    monkeypatch.setattr(attention_tests, "flash_attention", functools.partial(flash_attention, num_splits=n))


# ---------------------------------------------------------------------------------------------------- sweeps
# (Sq, Sk): a decode step; a few rows whose last split holds only the final key (rows 0..3 see none of it);
# a verification chunk over a cache; one key; Sq > Sk (rows that see no key at all); Sq == Sk.
LENGTHS = [(1, 37), (5, 33), (7, 130), (1, 1), (19, 7), (37, 37)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk", LENGTHS)
def test_lengths(seed, monkeypatch, spy, sq, sk, causal):
    split(monkeypatch, 3)
    check_against_reference(*make_qkv("gqa", sq, 32, torch.float32, sk=sk), causal, torch.float32)
    assert len(spy) == 1


@pytest.mark.parametrize(
    "layout, sq, sk, d, causal, dtype, n",
    [
        ("mqa", 1, 130, 128, True, torch.float16, 4),  # four query heads in one tile, D=128
        ("mha", 1, 64, 16, False, torch.float16, 4),  # a split per 16 keys, no tail
        ("mqa", 4, 100, 64, True, torch.float32, 2),  # 16 rows: exactly one full row block
        ("mqa", 19, 37, 16, True, torch.float16, 2),  # 76 rows: two row blocks of 64
        ("gqa", 2, 37, 128, False, torch.float32, 64),  # more splits asked than 16-key splits exist
        ("gqa", 3, 50, 64, True, torch.bfloat16, 3),  # the interpreter's bf16 casts, at bf16's tolerance
    ],
)
def test_mixed_cases(seed, monkeypatch, spy, layout, sq, sk, d, causal, dtype, n):
    split(monkeypatch, n)
    check_against_reference(*make_qkv(layout, sq, d, dtype, sk=sk), causal, dtype)
    assert len(spy) == 1


def test_gradient_through_lse(seed, monkeypatch):
    split(monkeypatch, 3)
    check_against_reference(*make_qkv("gqa", 3, 32, torch.float32, sk=45), True, torch.float32, with_lse_grad=True)


def test_peaked_scores_across_splits(seed):
    """Each split's maximum differs by hundreds of logits: the merge rescales by the lse, never overflows."""
    q, k, v = make_qkv("gqa", 2, 32, torch.float32, sk=64, q_scale=30.0)
    out, lse = flash_attention(q, k, v, return_lse=True, num_splits=4)
    want, want_lse = flash_attention_reference(q.double(), k.double(), v.double(), return_lse=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=0)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_agrees_with_the_one_pass_kernel(seed, n):
    q, k, v = make_qkv("mqa", 3, 64, torch.float32, sk=77)
    for causal in (False, True):
        one, one_lse = flash_attention(q, k, v, causal, return_lse=True, num_splits=1)
        many, many_lse = flash_attention(q, k, v, causal, return_lse=True, num_splits=n)
        torch.testing.assert_close(many, one, rtol=0, atol=1e-6)
        torch.testing.assert_close(many_lse, one_lse, rtol=0, atol=1e-6)


@pytest.mark.parametrize("sq, sk", [(3, 45), (19, 7)])
def test_every_output_element_is_written(seed, nan_empty, sq, sk):  # noqa: F811 (fixture)
    """Outputs and partial buffers start as NaN: the merge reads only slots the splits wrote."""
    q, k, v = make_qkv("gqa", sq, 32, torch.float32, sk=sk)
    out, lse = flash_attention(q, k, v, True, return_lse=True, num_splits=3)
    assert not out.isnan().any() and not lse.isnan().any()


def test_strided_query_and_output_layout(seed, spy):
    """q a [B, Hq, Sq, D] view of a [B, Sq, Hq, D] projection: read in place, out laid out the same way."""
    b, sq, hq, hkv, d, sk = 2, 3, 4, 2, 32, 40
    q = torch.randn(b, sq, hq, d).transpose(1, 2)
    k, v = (torch.randn(b, sk, hkv, d).transpose(1, 2) for _ in range(2))
    out, lse = flash_attention(q, k, v, True, return_lse=True, num_splits=3)
    want, want_lse = flash_attention_reference(q.double(), k.double(), v.double(), True, return_lse=True)
    assert out.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=1e-6)
    assert spy == [(16, 16, 3)]


def test_no_key_at_all(seed, nan_empty):  # noqa: F811 (fixture)
    q, k, v = make_qkv("gqa", 2, 32, torch.float32, sk=0)
    out, lse = flash_attention(q, k, v, True, return_lse=True, num_splits=4)
    assert (out == 0).all() and torch.isneginf(lse).all()


# ---------------------------------------------------------------------------------------------------- plans


def _plan(shape_q, shape_k, num_splits, backend, monkeypatch=None, sms=132):
    if monkeypatch is not None:
        props = SimpleNamespace(multi_processor_count=sms)
        monkeypatch.setattr(attention_module.torch.cuda, "get_device_properties", lambda device: props)
    q, k = torch.empty(shape_q), torch.empty(shape_k)
    attention_module._sm_count.cache_clear()  # the SM count is cached per device: never keep the mocked one
    try:
        return attention_module._split_kv_plan(q, k, num_splits, backend)
    finally:
        attention_module._sm_count.cache_clear()


@needs_interpreter
def test_interpreter_plans():
    align = INTERPRETER_SPLIT_KV_BLOCK_N
    assert _plan((2, 4, 1, 32), (2, 2, 37, 32), None, Backend.INTERPRETER) is None  # automatic: one pass
    assert _plan((2, 4, 1, 32), (2, 2, 37, 32), 1, Backend.INTERPRETER) is None
    assert _plan((2, 4, 1, 32), (2, 2, 37, 32), 3, Backend.INTERPRETER) == (16, align, 3)
    assert _plan((2, 4, 1, 32), (2, 2, 37, 32), 2, Backend.INTERPRETER) == (16, 2 * align, 2)
    assert _plan((2, 4, 19, 32), (2, 1, 37, 32), 2, Backend.INTERPRETER) == (64, 2 * align, 2)  # 76 rows
    assert _plan((2, 4, 1, 32), (2, 2, 37, 32), 1000, Backend.INTERPRETER) == (16, align, 3)  # 3 tiles of keys
    # More splits than MAX_SPLITS are never made.
    _, keys, splits = _plan((1, 1, 1, 32), (1, 1, 4000, 32), 1000, Backend.INTERPRETER)
    assert splits <= MAX_SPLITS and keys * splits >= 4000 and keys % align == 0


def test_cuda_automatic_plans(monkeypatch):
    """On CUDA the automatic choice fills the SMs twice over, with at least 256 keys per split."""
    align = SPLIT_KV_KEY_ALIGN
    # Llama-3-8B decode: 32 query heads over 8 kv heads, batch 1, an 8k cache: 8 programs before splitting.
    assert _plan((1, 32, 1, 128), (1, 8, 8192, 128), None, Backend.TRITON, monkeypatch) == (16, 256, 32)
    # Batch 64: 512 programs already fill 132 SMs twice; one split, stored directly.
    assert _plan((64, 32, 1, 128), (64, 8, 8192, 128), None, Backend.TRITON, monkeypatch) == (16, 8192, 1)
    # A short cache: at least 256 keys per split, rounded to the widest key tile.
    assert _plan((1, 32, 1, 128), (1, 8, 600, 128), None, Backend.TRITON, monkeypatch) == (16, 3 * align, 2)
    # MHA, a 4-token verification chunk: 4 rows per kv head.
    assert _plan((2, 16, 4, 64), (2, 16, 4096, 64), None, Backend.TRITON, monkeypatch) == (16, 512, 8)
    # Prefill (more than 64 rows per kv head) stays on the one-pass kernel; so does num_splits=1.
    assert _plan((1, 32, 128, 128), (1, 8, 128, 128), None, Backend.TRITON, monkeypatch) is None
    assert _plan((1, 32, 1, 128), (1, 8, 8192, 128), 1, Backend.TRITON, monkeypatch) is None
    # An explicit count is obeyed on CUDA too, with splits of whole 128-key tiles.
    assert _plan((1, 32, 1, 128), (1, 8, 1000, 128), 3, Backend.TRITON, monkeypatch) == (16, 384, 3)


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-2, ValueError), (True, TypeError), (2.0, TypeError)])
def test_bad_num_splits(bad, error):
    q, k, v = make_qkv("gqa", 1, 32, torch.float32, sk=8)
    with pytest.raises(error, match="num_splits"):
        flash_attention(q, k, v, num_splits=bad)


# ---------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sq, sk", [(1, 8191), (4, 3000), (1, 100)])
def test_gpu_automatic_split_kv_against_float64(seed, dtype, sq, sk):
    """Decode shapes take the split-KV path by default on CUDA, forward and backward against float64."""
    q = torch.randn(2, 32, sq, 128, device="cuda", dtype=dtype)
    k, v = (torch.randn(2, 8, sk, 128, device="cuda", dtype=dtype) for _ in range(2))
    assert attention_module._split_kv_plan(q, k, None, Backend.TRITON) is not None
    check_against_reference(q, k, v, True, dtype)
