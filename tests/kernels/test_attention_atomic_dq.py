"""The one-kernel backward, ``flash_attention(..., deterministic=False)``: dQ added up with atomics.

The dK/dV kernel (``ATOMIC_DQ``) adds ``dS·K`` of every (query block, key block) pair into a zeroed
fp32 buffer instead of leaving dQ to a second kernel that recomputes the scores. Checked here against
the float64 reference (same tolerances as tests/kernels/test_attention.py) over the axes that change
which blocks add into which rows (lengths and their tails, Sq ≠ Sk with rows that see no key, GQA
groups whose query heads share one program, the causal band), against the deterministic backward,
and for when it is (not) taken.
"""

import pytest
import torch

from tessel.kernels._dispatch import INTERPRET
from tessel.kernels.attention import flash_attention
from tests.kernels.test_attention import (  # noqa: F401 (nan_empty is a fixture)
    TOL,
    assert_close,
    check_against_reference,
    make_qkv,
    nan_empty,
    rel_err,
)

pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs the Triton kernels")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s", [1, 19, 37, 64, 130])
def test_sequence_lengths(seed, s, causal):
    check_against_reference(*make_qkv("gqa", s, 32, torch.float32), causal, torch.float32, deterministic=False)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [16, 64, 128])
def test_head_dims(seed, d, causal):
    check_against_reference(*make_qkv("gqa", 37, d, torch.float32), causal, torch.float32, deterministic=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["mha", "mqa"])
def test_head_layouts(seed, layout, causal, dtype):
    check_against_reference(*make_qkv(layout, 37, 32, dtype), causal, dtype, deterministic=False)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk", [(19, 64), (64, 19), (1, 50), (33, 130)])  # a cache; Sq > Sk; decode; chunk
def test_query_and_key_lengths_differ(seed, sq, sk, causal):
    check_against_reference(
        *make_qkv("mqa", sq, 32, torch.float32, sk=sk), causal, torch.float32, with_lse_grad=True, deterministic=False
    )


@pytest.mark.usefixtures("nan_empty")
@pytest.mark.parametrize("sq, sk", [(37, 37), (64, 19)])
def test_every_output_element_is_written(seed, sq, sk):
    """NaN-filled allocations everywhere but the zeroed accumulator: every gradient element is written,
    rows that see no key get 0."""
    check_against_reference(
        *make_qkv("gqa", sq, 16, torch.float32, sk=sk), True, torch.float32, with_lse_grad=True, deterministic=False
    )


@pytest.mark.parametrize("causal", [False, True])
def test_agrees_with_the_deterministic_backward(seed, causal):
    """dK and dV come from the same arithmetic in the same order; dQ only sums its terms in another order."""
    q, k, v = make_qkv("gqa", 70, 32, torch.float32, sk=90)
    grad_out = torch.randn(q.shape)
    grads = {}
    for deterministic in (True, False):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = flash_attention(*leaves, causal, deterministic=deterministic)
        grads[deterministic] = torch.autograd.grad(out, leaves, grad_out)
    (dq, dk, dv), (dq_atomic, dk_atomic, dv_atomic) = grads[True], grads[False]
    assert rel_err(dq_atomic, dq) <= 1e-6
    if INTERPRET:  # one program at a time: the same operations in the same order
        assert torch.equal(dk_atomic, dk) and torch.equal(dv_atomic, dv)
    else:
        assert rel_err(dk_atomic, dk) <= 1e-6 and rel_err(dv_atomic, dv) <= 1e-6


def test_strided_query_gets_its_gradient_in_its_own_layout(seed):
    """A [B, S, H, D] query view: dq has its layout and the right values (the accumulator is dense)."""
    q = torch.randn(2, 45, 4, 32).transpose(1, 2)
    k, v = torch.randn(2, 2, 45, 32), torch.randn(2, 2, 45, 32)
    check_against_reference(q, k, v, True, torch.float32, deterministic=False)
    leaf = q.detach().requires_grad_()
    flash_attention(leaf, k, v, deterministic=False).sum().backward()
    assert leaf.grad.stride() == q.stride()


DKDV, DQ, FWD = "_flash_attention_bwd_dkdv_kernel", "_flash_attention_bwd_dq_kernel", "_flash_attention_fwd_kernel"


@pytest.mark.parametrize(
    "deterministic, needs, expected",
    [
        (True, "qkv", [(DKDV, False), (DQ, None)]),
        (False, "qkv", [(DKDV, True)]),  # one kernel for the three gradients
        (False, "q", [(DQ, None)]),  # dQ alone: the dQ kernel, no wasted dK/dV
        (False, "kv", [(DKDV, False)]),  # dK/dV alone: no accumulator
        (False, "qv", [(DKDV, True)]),
    ],
)
def test_which_kernels_run(seed, attention_launches, deterministic, needs, expected):
    q, k, v = make_qkv("gqa", 19, 16, torch.float32)
    leaves = {"q": q, "k": k, "v": v}
    for name in needs:
        leaves[name].requires_grad_()
    out = flash_attention(q, k, v, True, deterministic=deterministic)
    attention_launches.clear()
    grads = torch.autograd.grad(out.sum(), [leaves[n] for n in needs])
    assert attention_launches == expected
    want = torch.autograd.grad(flash_attention(q, k, v, True, deterministic=True).sum(), [leaves[n] for n in needs])
    for got, ref in zip(grads, want):
        assert_close(got, ref, torch.float32, f"{needs} gradients")


def test_torch_deterministic_mode_wins(seed, attention_launches):
    q, k, v = (t.requires_grad_() for t in make_qkv("gqa", 19, 16, torch.float32))
    out = flash_attention(q, k, v, deterministic=False)
    attention_launches.clear()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        out.sum().backward()
    finally:
        torch.use_deterministic_algorithms(previous)
    assert attention_launches == [(DKDV, False), (DQ, None)]


@pytest.mark.parametrize("bad", [None, 0, 1, "no"])
def test_deterministic_must_be_a_bool(bad):
    q, k, v = make_qkv("gqa", 4, 16, torch.float32)
    with pytest.raises(TypeError, match=f"deterministic must be a bool, received {type(bad).__name__}"):
        flash_attention(q, k, v, deterministic=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_atomic_backward_against_float64(seed, causal, dtype):
    """The compiled one-kernel backward (autotuned, so its accumulator is zeroed after every timed
    launch) at an odd length with GQA and a lse gradient, against float64; then again, now tuned."""
    q, k, v = (t.cuda() for t in make_qkv("gqa", 1000, 128, dtype))
    for _ in range(2):
        check_against_reference(q, k, v, causal, dtype, with_lse_grad=True, deterministic=False)
