"""flash_attention_backward: the backward on its own, applied block by block with the whole softmax's out and lse.

The keys are cut into blocks; each block's backward gets the out and lse of the attention over every
key (what context-parallel attention has), and the shares must add up to the float64 gradients of the
whole attention: dq summed over blocks, dk and dv concatenated. Tolerances as in test_attention.py.
"""

import importlib

import pytest
import torch

from tessel.kernels.attention import flash_attention, flash_attention_backward

from .test_attention import assert_close, make_qkv, reference_with_grads

attention_module = importlib.import_module("tessel.kernels.attention")


def _blockwise_grads(q, k, v, causal, dout, cut, deterministic=True):
    """dq, dk, dv of the whole attention from the backward of two key blocks, [0, cut) and [cut, S)."""
    out, lse = flash_attention(q, k, v, causal, return_lse=True)
    s = q.shape[2]
    first, second = slice(0, cut), slice(cut, None)
    if not causal:
        dq1, dk1, dv1 = flash_attention_backward(q, k[:, :, first], v[:, :, first], out, lse, dout,
                                                 deterministic=deterministic)  # fmt: skip
        dq2, dk2, dv2 = flash_attention_backward(q, k[:, :, second], v[:, :, second], out, lse, dout,
                                                 deterministic=deterministic)  # fmt: skip
        return dq1 + dq2, torch.cat((dk1, dk2), 2), torch.cat((dv1, dv2), 2)
    # Causal: the last key block is bottom-right aligned with all queries (key cut + j ≤ i); the first
    # block is causal for the queries [0, cut) and fully visible to the others.
    dq2, dk2, dv2 = flash_attention_backward(q, k[:, :, second], v[:, :, second], out, lse, dout, True,
                                             deterministic=deterministic)  # fmt: skip
    dqa, dka, dva = flash_attention_backward(q[:, :, first], k[:, :, first], v[:, :, first], out[:, :, first],
                                             lse[:, :, first], dout[:, :, first], True,
                                             deterministic=deterministic)  # fmt: skip
    dqb, dkb, dvb = flash_attention_backward(q[:, :, second], k[:, :, first], v[:, :, first], out[:, :, second],
                                             lse[:, :, second], dout[:, :, second], False,
                                             deterministic=deterministic)  # fmt: skip
    dq = dq2.clone()
    dq[:, :, first] += dqa
    dq[:, :, second] += dqb
    assert s > cut
    return dq, torch.cat((dka + dkb, dk2), 2), torch.cat((dva + dvb, dv2), 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["mha", "gqa", "mqa"])
def test_block_shares_add_up_to_the_whole_gradient(seed, layout, causal, dtype):
    q, k, v = make_qkv(layout, 23, 32, dtype)
    dout = torch.randn_like(q)
    want = reference_with_grads(q, k, v, causal, dout)
    got = _blockwise_grads(q, k, v, causal, dout, cut=9)
    for name, g, ref, like in zip(("dq", "dk", "dv"), got, want[2:], (q, k, v)):
        assert g.dtype == dtype and g.shape == like.shape
        # the shares are rounded to the dtype before they are added: one more rounding than one call
        assert_close(g, ref, dtype, f"{name} ({layout}, causal={causal})")


def test_one_block_equals_the_autograd_backward(seed):
    q, k, v = (t.requires_grad_() for t in make_qkv("gqa", 19, 16, torch.float32))
    out, lse = flash_attention(q, k, v, True, return_lse=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    got = flash_attention_backward(q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), dout, True)
    for g, want in zip(got, (q.grad, k.grad, v.grad)):
        assert torch.equal(g, want)


def test_atomic_dq_and_reference_backend_agree(seed, monkeypatch):
    q, k, v = make_qkv("gqa", 21, 16, torch.float32)
    dout = torch.randn_like(q)
    want = reference_with_grads(q, k, v, True, dout)[2:]
    atomic = _blockwise_grads(q, k, v, True, dout, cut=8, deterministic=False)
    monkeypatch.setattr(attention_module, "backend_for", lambda *t: attention_module.Backend.REFERENCE)
    reference = _blockwise_grads(q, k, v, True, dout, cut=8)
    for name, a, r, w in zip(("dq", "dk", "dv"), atomic, reference, want):
        assert_close(a, w, torch.float32, f"{name} atomic")
        assert_close(r, w, torch.float32, f"{name} reference backend")


def test_rows_that_see_no_key_get_no_gradient(seed):
    """Causal with Sq > Sk: the first Sq - Sk queries see no key (lse -inf) and pass back exact zeros."""
    q, k, v = make_qkv("mha", 7, 16, torch.float32, sk=4)
    out, lse = flash_attention(q, k, v, True, return_lse=True)
    dout = torch.randn_like(q)
    dq, dk, dv = flash_attention_backward(q, k, v, out, lse, dout, True)
    want = reference_with_grads(q, k, v, True, dout)[2:]
    assert torch.equal(dq[:, :, :3], torch.zeros_like(dq[:, :, :3]))
    for g, w in zip((dq, dk, dv), want):
        assert torch.isfinite(g).all()
        assert_close(g, w, torch.float32, "no-key rows")


def _args(**change):
    q, k, v = make_qkv("gqa", 5, 16, torch.float32)
    out, lse = flash_attention(q, k, v, return_lse=True)
    args = dict(q=q, k=k, v=v, out=out, lse=lse, dout=torch.randn_like(q))
    for name, value in change.items():
        args[name] = value(args) if callable(value) else value
    return args


@pytest.mark.parametrize(
    "change, error, words",
    [
        (dict(out=lambda a: a["out"][:, :, :4]), ValueError, "out must have shape"),
        (dict(dout=lambda a: a["dout"][:1]), ValueError, "dout must have shape"),
        (dict(lse=lambda a: a["lse"][..., None]), ValueError, "lse must have shape"),
        (dict(lse=lambda a: a["lse"].double()), TypeError, "lse must be float32"),
        (dict(out=lambda a: a["out"].half()), TypeError, "out must have q's dtype"),
        (dict(dout=lambda a: a["dout"].long()), TypeError, "dout must be a floating tensor"),
        (dict(out=[1.0]), TypeError, "out must be a torch.Tensor"),
        (dict(k=lambda a: a["k"][..., :8]), ValueError, "k and v must have the same shape"),
    ],
)
def test_bad_input(change, error, words):
    with pytest.raises(error, match=words):
        flash_attention_backward(**_args(**change))


def test_deterministic_must_be_a_bool():
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        flash_attention_backward(**_args(), deterministic=1)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_bf16_block_shares_add_up(seed, causal):
    """The compiled kernels (bf16, D=128, a length that is no multiple of any tile) block by block."""
    q, k, v = make_qkv("gqa", 1000, 128, torch.bfloat16, device="cuda")
    dout = torch.randn_like(q)
    want = reference_with_grads(q, k, v, causal, dout)
    for deterministic in (True, False):
        got = _blockwise_grads(q, k, v, causal, dout, cut=389, deterministic=deterministic)
        for name, g, ref in zip(("dq", "dk", "dv"), got, want[2:]):
            assert_close(g, ref, torch.bfloat16, f"{name} (causal={causal}, deterministic={deterministic})")
