"""vocab_parallel_cross_entropy against F.cross_entropy on the gathered logits, on 2 and 4 ranks.

Each rank holds its vocab shard of the same random logits; the reference is float64 cross entropy of
the full logits (rounded to the tested dtype first, so both sides see the same values).

Tolerances: the loss is computed in fp32 (log-sum-exp of O(10) values, merged across ranks): ~1e-7
relative per operation, checked at 1e-5. Logit gradients are softmax − onehot times the scale, fp32
then rounded to the logits' dtype: 1e-6 absolute for fp32; fp16 adds half an ulp (2⁻¹¹ relative):
2e-3 relative plus 1e-5 absolute on values below 1/N.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.layers.test_linear_cross_entropy import reference_loss
from tests.multiprocess import run_ranks

LEADING, V = (2, 7), 36  # V divisible by 2 and 4; 14 tokens
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float16: dict(rtol=2e-3, atol=1e-5)}
GRAD_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float16: dict(rtol=2e-3, atol=1e-5)}


def _data(ignore_index):
    g = torch.Generator().manual_seed(5)
    logits = 3 * torch.randn(*LEADING, V, dtype=torch.float64, generator=g)
    target = torch.randint(0, V, LEADING, generator=g)
    target[0, :3] = ignore_index
    target[1, 0], target[1, 1] = 0, V - 1  # the first and last vocab entries, owned by the first and last rank
    return logits, target


def _check(rank, t, dtype, reduction, ignore_index=-100, **options):
    from tessel.layers.cross_entropy import vocab_parallel_cross_entropy
    from tessel.parallel.comm import count_bytes

    logits, target = _data(ignore_index)
    full = logits.to(dtype).double().requires_grad_()
    loss_ref = reference_loss(full, target, reduction, ignore_index, **options)
    grad_loss = torch.rand(LEADING, dtype=torch.float64) + 0.5 if reduction == "none" else torch.tensor(1.7).double()
    loss_ref.backward(grad_loss)

    cols = slice(rank * V // t, (rank + 1) * V // t)
    shard = logits[..., cols].to(dtype).requires_grad_()
    with count_bytes() as forward_bytes:
        loss = vocab_parallel_cross_entropy(shard, target, ignore_index=ignore_index, reduction=reduction, **options)
    with count_bytes() as backward_bytes:
        loss.backward(grad_loss.float())
    tag = f"tp={t} {dtype} reduction={reduction} ignore_index={ignore_index} {options}"
    assert loss.dtype == torch.float32 and loss.shape == loss_ref.shape, tag
    torch.testing.assert_close(loss.double(), loss_ref.detach(), **TOL[dtype], msg=lambda m: f"{tag} loss: {m}")
    assert shard.grad.dtype == dtype, tag
    torch.testing.assert_close(shard.grad.double(), full.grad[..., cols], **GRAD_TOL[dtype],
                               msg=lambda m: f"{tag} logits grad: {m}")  # fmt: skip
    # One all-gather of two fp32 per token forward ((t-1)/t of the [t, 2, N] result; three with label smoothing:
    # the sum of the logits too); nothing backward.
    n_tokens, per_token = target.numel(), 3 if options.get("label_smoothing") else 2
    assert forward_bytes.sent == (t - 1) * per_token * n_tokens * 4 and backward_bytes.sent == 0, tag


def _cross_entropy_worker(rank, t):
    from tessel.layers.cross_entropy import vocab_parallel_cross_entropy

    for reduction in ("mean", "sum", "none"):
        _check(rank, t, torch.float32, reduction)
    _check(rank, t, torch.float16, "mean")
    _check(rank, t, torch.float32, "mean", ignore_index=V // 2 + 1)  # a real vocab id, owned by one rank
    _check(rank, t, torch.float32, "mean", label_smoothing=0.1, z_loss=1e-2)
    _check(rank, t, torch.float32, "none", label_smoothing=0.2)
    _check(rank, t, torch.float16, "sum", z_loss=1e-3)
    _check(rank, t, torch.float32, "none", label_smoothing=0.1, softcap=2.0)  # Gemma 2's capped logits
    # Every target ignored: "mean" is 0/0 = nan, as in torch, and the gradient is zero.
    logits = torch.randn(3, V // t, requires_grad=True)
    loss = vocab_parallel_cross_entropy(logits, torch.full((3,), -100))
    loss.backward()
    assert torch.isnan(loss) and torch.equal(logits.grad, torch.zeros_like(logits))
    return "ok"


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_cross_entropy_matches_gathered(world):
    assert run_ranks(_cross_entropy_worker, world, timeout=120) == ["ok"] * world


# ---------------------------------------------------------------------------------------------------- one process


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_world_of_one_is_f_cross_entropy(seed, dtype):
    from tessel.layers.cross_entropy import vocab_parallel_cross_entropy

    logits = (3 * torch.randn(2, 3, 5, 17)).to(dtype).requires_grad_()
    target = torch.randint(0, 17, (2, 3, 5), dtype=torch.int32)
    loss = vocab_parallel_cross_entropy(logits, target)
    loss.backward()
    full = logits.detach().double().requires_grad_()
    ref = F.cross_entropy(full.view(-1, 17), target.view(-1).long())
    ref.backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    # bf16 gradients: one rounding, half an ulp (2⁻⁸) relative, on values below 1/N.
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(logits.grad.double(), full.grad, rtol=tol, atol=1e-5)


def test_extreme_logits_stay_finite():
    """Logits of ±1e4 (fp16-representable, exp overflows anything) give torch's finite answer."""
    from tessel.layers.cross_entropy import vocab_parallel_cross_entropy

    logits = torch.tensor([[1e4, -1e4, 0.0], [-1e4, -1e4, 1e4]]).half().requires_grad_()
    target = torch.tensor([1, 2])
    loss = vocab_parallel_cross_entropy(logits, target, reduction="none")
    loss.sum().backward()
    ref = F.cross_entropy(logits.detach().double(), target, reduction="none")
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(logits.grad).all()


def test_float64_logits_are_taken():
    """A float64 model's logits (as its docstring promises, any floating dtype): the loss in fp32, the gradient in
    float64, both torch's."""
    from tessel.layers.cross_entropy import vocab_parallel_cross_entropy

    logits = (3 * torch.randn(4, 5, 13, dtype=torch.float64)).requires_grad_()
    target = torch.randint(13, (4, 5))
    target[0, 0] = -100
    loss = vocab_parallel_cross_entropy(logits, target, label_smoothing=0.1)
    loss.backward()
    full = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(full.flatten(0, 1), target.flatten(), label_smoothing=0.1)
    ref.backward()
    assert loss.dtype == torch.float32 and logits.grad.dtype == torch.float64
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits.grad, full.grad, rtol=1e-5, atol=1e-7)


LOGITS = torch.randn(2, 3, 8)
TARGET = torch.zeros(2, 3, dtype=torch.long)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda f: f(LOGITS, TARGET, reduction="avg"), ValueError, r"reduction must be one of .* received 'avg'"),
        (lambda f: f(LOGITS, TARGET[:, :2]), ValueError, r"target must have shape \(2, 3\) .* received \(2, 2\)"),
        (lambda f: f(LOGITS, TARGET.float()), TypeError, "target must be an integer tensor .* received torch.float32"),
        (lambda f: f(LOGITS, TARGET + 8), ValueError, r"target must lie in \[0, 8\), received 8"),
        (lambda f: f(LOGITS.long(), TARGET), TypeError, "logits must be a floating-point tensor"),
        (lambda f: f(LOGITS, TARGET, ignore_index=None), TypeError, "ignore_index must be an int"),
        (lambda f: f(torch.randn(2, 0), TARGET[0, :2]), ValueError, r"V/t >= 1, received shape \(2, 0\)"),
        (lambda f: f(LOGITS, TARGET.to("meta")), ValueError, "target must be on the logits' device cpu"),
        (lambda f: f(LOGITS, TARGET, label_smoothing=-0.1), ValueError, r"label_smoothing must lie in \[0, 1\]"),
        (lambda f: f(LOGITS, TARGET, z_loss=None), TypeError, "z_loss must be a float, received NoneType"),
        (lambda f: f(LOGITS, TARGET, z_loss=float("inf")), ValueError, "z_loss must be a finite number >= 0"),
        (lambda f: f(LOGITS, TARGET, softcap=-1.0), ValueError, "softcap must be None or a finite number above 0"),
    ],
)
def test_bad_input(call, error, words):
    from tessel.layers.cross_entropy import vocab_parallel_cross_entropy

    with pytest.raises(error, match=words):
        call(vocab_parallel_cross_entropy)
