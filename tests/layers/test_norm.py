"""RMSNorm/LayerNorm layers against torch's dense modules, replicated and sequence-parallel on 2 and 4 ranks.

Every rank builds the same float64 dense module and data from a shared seed, converts the module with
``from_module`` and compares output, input gradient and parameter gradients with the dense float64
computation over the full sequence on the same fp32-rounded values. Under sequence parallelism each rank
sees only its sequence shard, yet its weight gradient must equal the full-sequence gradient.

Tolerances: the kernel's fp32 statistics and arithmetic differ from float64 by ~1e-6 relative at these
sizes, and the sequence-parallel weight gradient adds the ranks' partial sums in another order (a few
fp32 roundings of O(10) sums): checked at 1e-5 relative, 1e-5 absolute.
"""

import copy

import pytest
import torch
from torch import nn

from tests.multiprocess import run_ranks

B, S, H = 2, 12, 100  # S divisible by 2 and 4; H not a power of two
TOL = dict(rtol=1e-5, atol=1e-5)


def _data(shape, seed):
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _dense(kind, seed):
    """A float64 torch norm with random (not ones/zeros) parameters."""
    torch.manual_seed(seed)
    dense = nn.RMSNorm(H, eps=1e-6, dtype=torch.float64) if kind == "rms" else nn.LayerNorm(H, dtype=torch.float64)
    with torch.no_grad():
        for p in dense.parameters():
            p.copy_(1 + 0.5 * torch.randn_like(p))
    return dense


def _close(got, want, what):
    torch.testing.assert_close(got.double(), want.double(), **TOL, msg=lambda m: f"{what}: {m}")


def _check_norm(rank, t, kind, sp):
    from tessel.layers.norm import LayerNorm, RMSNorm
    from tessel.parallel.comm import count_bytes

    dense = _dense(kind, 1)
    x, dy = _data((B, S, H), 2) * 2 + 0.5, _data((B, S, H), 3)
    ref = copy.deepcopy(dense)
    xd = x.float().double().requires_grad_()
    y_ref = ref(xd)
    y_ref.backward(dy.float().double())

    cls = RMSNorm if kind == "rms" else LayerNorm
    layer = cls.from_module(copy.deepcopy(dense).float(), sequence_parallel=sp)
    seq = slice(rank * S // t, (rank + 1) * S // t) if sp else slice(None)
    x_in = x[:, seq].float().requires_grad_()
    with count_bytes() as moved:
        y = layer(x_in)
        y.backward(dy[:, seq].float())
    tag = f"{kind} tp={t} sp={sp}"
    _close(y, y_ref.detach()[:, seq], f"{tag} output")
    _close(x_in.grad, xd.grad[:, seq], f"{tag} input grad")
    for name, p in layer.named_parameters():  # the full-sequence gradient, on every rank
        _close(p.grad, getattr(ref, name).grad, f"{tag} {name} grad")
    # Sequence parallelism all-reduces each parameter's gradient once (ring: 2(t-1)/t of H fp32 values);
    # replicated activations need no communication at all.
    n_params = 1 if kind == "rms" else 2
    assert moved.sent == (n_params * 2 * (t - 1) * H * 4 // t if sp else 0), f"{tag}: sent {moved.sent} bytes"


def _norm_worker(rank, t):
    for kind in ("rms", "layer"):
        for sp in (False, True):
            _check_norm(rank, t, kind, sp)
    return "ok"


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_norms_match_dense(world):
    assert run_ranks(_norm_worker, world, timeout=120) == ["ok"] * world


# ---------------------------------------------------------------------------------------------------- one process


class _LlamaLikeRMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm, written out (transformers is not needed to test the duck typing)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class _GemmaLikeRMSNorm(_LlamaLikeRMSNorm):
    """Scales by (1 + weight): copying its weight as is would silently change the model."""

    def __init__(self, dim, eps=1e-6):
        super().__init__(dim, eps)
        del self.variance_epsilon
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)).to(x.dtype)


def _assert_same_as(layer, module, x):
    with torch.no_grad():
        torch.testing.assert_close(layer(x), module(x), rtol=1e-5, atol=1e-5)


def test_from_module_variants(seed):
    from tessel.layers.norm import LayerNorm, RMSNorm

    x = torch.randn(3, 5, 48)
    llama = _LlamaLikeRMSNorm(48, eps=1e-5)
    nn.init.normal_(llama.weight)
    layer = RMSNorm.from_module(llama)
    assert layer.eps == 1e-5 and torch.equal(layer.weight, llama.weight)
    _assert_same_as(layer, llama, x)

    torch_rms = nn.RMSNorm(48)  # eps=None: finfo(x.dtype).eps at each call, as torch does
    nn.init.normal_(torch_rms.weight)
    _assert_same_as(RMSNorm.from_module(torch_rms), torch_rms, x)

    for bias in (True, False):
        torch_ln = nn.LayerNorm(48, eps=1e-4, bias=bias)
        nn.init.normal_(torch_ln.weight)
        layer = LayerNorm.from_module(torch_ln)
        assert (layer.bias is None) == (not bias) and layer.eps == 1e-4
        _assert_same_as(layer, torch_ln, x)
        again = LayerNorm.from_module(layer, sequence_parallel=True)  # a tessel norm, e.g. in parallelize
        assert again.sequence_parallel and again.eps == 1e-4 and (again.bias is None) == (not bias)
        _assert_same_as(again, torch_ln, x)
    again = RMSNorm.from_module(RMSNorm.from_module(llama), sequence_parallel=True)
    assert again.sequence_parallel and again.eps == 1e-5
    _assert_same_as(again, llama, x)


def test_parameters_like_torch(seed):
    from tessel.layers.norm import LayerNorm, RMSNorm

    ln, rms = LayerNorm(10, dtype=torch.float16), RMSNorm(10)
    assert torch.equal(ln.weight, torch.ones(10, dtype=torch.float16)) and torch.equal(ln.bias, torch.zeros(10).half())
    assert ln.state_dict().keys() == nn.LayerNorm(10).state_dict().keys()
    assert rms.state_dict().keys() == nn.RMSNorm(10).state_dict().keys()
    assert LayerNorm(10, bias=False).bias is None


def test_world_of_one_sequence_parallel_and_mixed_weight(seed):
    """No process group: sequence_parallel changes nothing; an fp32 weight normalises fp16 activations."""
    from tessel.layers.norm import RMSNorm

    layer = RMSNorm(48, sequence_parallel=True)
    nn.init.normal_(layer.weight)
    x = torch.randn(2, 6, 48).half().requires_grad_()
    y = layer(x)
    y.float().sum().backward()
    assert y.dtype == torch.float16 and layer.weight.grad.dtype == torch.float32
    xd, wd = x.detach().double().requires_grad_(), layer.weight.detach().double().requires_grad_()
    nn.functional.rms_norm(xd, (48,), wd, 1e-6).sum().backward()
    # fp16 output: one rounding (2⁻¹¹ relative); the fp32 weight grad sums 12 fp32 rows of O(1) terms.
    torch.testing.assert_close(y.double(), nn.functional.rms_norm(xd, (48,), wd, 1e-6), rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(layer.weight.grad.double(), wd.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda m: m.RMSNorm(0), ValueError, "RMSNorm: dim must be a positive int, received 0"),
        (lambda m: m.LayerNorm(4.0), ValueError, "LayerNorm: dim must be a positive int, received 4.0"),
        (lambda m: m.RMSNorm.from_module(nn.Linear(4, 4)), TypeError, "received Linear"),
        (lambda m: m.RMSNorm.from_module(_GemmaLikeRMSNorm(8)), ValueError, "_GemmaLikeRMSNorm does not compute"),
        (lambda m: m.RMSNorm.from_module(nn.RMSNorm(8, elementwise_affine=False)), ValueError, "has no weight"),
        (
            lambda m: m.LayerNorm.from_module(nn.RMSNorm(8)),
            TypeError,
            "expected torch.nn.LayerNorm or a tessel LayerNorm, received RMSNorm",
        ),
        (lambda m: m.LayerNorm.from_module(nn.LayerNorm((3, 8))), ValueError, r"received shape \(3, 8\)"),
        (lambda m: m.RMSNorm(8)(torch.randn(2, 7)), ValueError, r"weight must have shape \(7,\)"),
    ],
)
def test_bad_input(call, error, words):
    import tessel.layers.norm as norm

    with pytest.raises(error, match=words):
        call(norm)
