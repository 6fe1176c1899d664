"""The test suite's one-patch-per-launch interpreter (tests/_interpreter.py) computes what Triton's own does."""

import pytest
import torch
import triton

from tessel.kernels import flash_attention
from tessel.kernels._dispatch import INTERPRET
from tests import _interpreter

pytestmark = [
    pytest.mark.skipif(not INTERPRET, reason="runs Triton's interpreter (no GPU, TRITON_INTERPRET=1)"),
    # A Triton whose interpreter is built otherwise runs the suite as it ships, only slower: these tests say so
    # (skipped, with this reason) instead of failing the run, and tests/_interpreter.py needs a look.
    pytest.mark.skipif(
        INTERPRET and not _interpreter.install(),
        reason=f"Triton {triton.__version__}'s interpreter differs from the one tests/_interpreter.py patches",
    ),
]


def _attention_and_grads(seed):
    """Forward and backward with segments, GQA and tails: kernels whose inner loops call jit helpers."""
    torch.manual_seed(seed)
    q = torch.randn(2, 4, 37, 16, requires_grad=True)
    k = torch.randn(2, 2, 37, 16, requires_grad=True)
    v = torch.randn(2, 2, 37, 16, requires_grad=True)
    segment_ids = torch.tensor([[0] * 20 + [1] * 17, [0] * 5 + [1] * 32])
    out = flash_attention(q, k, v, causal=True, segment_ids=segment_ids)
    out.backward(torch.randn_like(out))
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.fixture
def shipped_interpreter():
    """Triton's interpreter as it ships for the test (the patch is put back afterwards)."""
    _interpreter.uninstall()
    yield
    assert _interpreter.install()


def test_installed_for_this_triton():
    assert _interpreter.install() and _interpreter._originals


def test_kernels_compute_the_same_bits_and_restore_the_language(seed):
    import triton.language as tl

    dot = tl.dot
    patched = _attention_and_grads(seed)
    assert tl.dot is dot  # each launch puts the language back
    _interpreter.uninstall()
    try:
        shipped = _attention_and_grads(seed)
    finally:
        assert _interpreter.install()
    for a, b in zip(patched, shipped, strict=True):
        assert torch.equal(a, b)


def test_a_launch_patches_each_language_module_once(monkeypatch, shipped_interpreter, seed):
    """Triton's own ``_patch_lang`` runs at every call of a jit helper; under the patch, once per launch and
    language module (the kernel's ``triton.language``, the standard library's ``triton.language.core``)."""
    from triton.runtime import interpreter

    calls = []
    original = interpreter._patch_lang

    def counting(fn):
        calls.append(fn.__name__)
        return original(fn)

    monkeypatch.setattr(interpreter, "_patch_lang", counting)
    _attention_and_grads(seed)
    shipped = len(calls)
    calls.clear()
    assert _interpreter.install()  # wraps the counting _patch_lang
    try:
        _attention_and_grads(seed)
    finally:
        _interpreter.uninstall()
    launches = 4  # forward, the backward's preprocessing, dK/dV, dQ
    assert launches <= len(calls) <= 2 * launches < shipped / 20, (len(calls), shipped)


def _rank_has_the_patch(rank, world_size):
    return bool(_interpreter._originals)


@pytest.mark.multiprocess
def test_ranks_run_with_the_patch():
    from tests.multiprocess import run_ranks

    assert run_ranks(_rank_has_the_patch, 2, init_process_group=False) == [True, True]
