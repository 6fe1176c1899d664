"""The fused AdamW step and the gradient statistics against torch.optim.AdamW, the references and float64.

Tolerances: the kernel, the reference and torch.optim.AdamW all compute in fp32 and differ only in
how they group the same operations (torch's lerp for the first moment, addcmul for the second, the
order of the divisions), a few units in the last place per step. Over five steps on O(1) parameters
that stays below 1e-6 relative to the largest value (measured: ~1.2e-7), which is what the brief asks;
the moments' scale is at least that of the terms they sum (see _check_against_torch).
bf16/fp16 gradients upcast exactly to fp32, so they are held to the same bound against torch fed the
upcast gradient. The bf16 parameter copy is compared bit for bit with the fp32 result cast to bf16.
grad_stats accumulates squares in fp32 per block and sums the block partials in fp64: against a
float64 sum over a few thousand O(1) squares the error is ~1e-7 relative, checked at 1e-5.
"""

import pytest
import torch

from tessel.kernels.adam import adam_step, adam_step_reference, grad_stats, grad_stats_reference

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
NUMELS = [1, 1000, 4099]  # not multiples of any block; 4099 spans 17 interpreter blocks
GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
IMPLS = {"kernel": adam_step, "reference": adam_step_reference}
HYPER = dict(beta1=0.9, beta2=0.95, eps=1e-8)
LRS = [1e-2, 3e-3, 2e-2, 5e-3, 1e-2]  # a different lr each step, as a schedule would give
RTOL = 1e-6


def _close(got, want, what, rtol=RTOL, floor=0.0):
    """``|got - want| <= rtol·max(max|want|, floor)`` elementwise (moments pass through zero, so not per
    element; ``floor`` is the size of the terms a moment sums, for where they cancel)."""
    got, want = got.double(), want.double()
    atol = rtol * max(want.abs().max().item(), floor)
    torch.testing.assert_close(got, want, rtol=0, atol=atol, msg=lambda m: f"{what}: {m}")


def _state(n, device):
    """fp32 master shard and moments part-way through training (nonzero m, positive v)."""
    gen = torch.Generator().manual_seed(7)
    param = torch.randn(n, generator=gen)
    exp_avg = 0.1 * torch.randn(n, generator=gen)
    exp_avg_sq = 0.01 * torch.rand(n, generator=gen) + 1e-4
    return [t.to(device) for t in (param, exp_avg, exp_avg_sq)]


def _grads(n, dtype, device, steps=5):
    gen = torch.Generator().manual_seed(11)
    return [torch.randn(n, generator=gen).to(device=device, dtype=dtype) for _ in range(steps)]


def _torch_adamw(param, exp_avg, exp_avg_sq, grads, weight_decay, start_step=0, scale=None):
    """torch.optim.AdamW run over ``grads`` from the given state; returns (param, exp_avg, exp_avg_sq)."""
    p = torch.nn.Parameter(param.clone())
    opt = torch.optim.AdamW([p], lr=LRS[0], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=weight_decay)  # fmt: skip
    opt.state[p] = {
        "step": torch.tensor(float(start_step)),
        "exp_avg": exp_avg.clone(),
        "exp_avg_sq": exp_avg_sq.clone(),
    }
    for i, g in enumerate(grads):
        opt.param_groups[0]["lr"] = LRS[i]
        p.grad = g.float() if scale is None else g.float() * scale
        opt.step()
    return p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]


def _run(impl, param, exp_avg, exp_avg_sq, grads, weight_decay, start_step=0, **extra):
    for i, g in enumerate(grads):
        impl(param, g, exp_avg, exp_avg_sq, lr=LRS[i], weight_decay=weight_decay, step=start_step + i + 1,
             **HYPER, **extra)  # fmt: skip


def _check_against_torch(got, want, tag, grads=()):
    """The state after the steps against torch's. Each step's moment is the sum of ``β·m`` and
    ``(1−β)·g`` (``g²``): where the two nearly cancel (an element of a one-element shard, measured
    on an H200: 5.7e-6 of the result, 48 units in its last place), the rounding is that of the terms,
    so the moments' scale is at least theirs."""
    g_max = max((g.double().abs().max().item() for g in grads), default=0.0)
    floors = (0.0, (1 - HYPER["beta1"]) * g_max, (1 - HYPER["beta2"]) * g_max**2)
    for name, g, w, floor in zip(("param", "exp_avg", "exp_avg_sq"), got, want, floors):
        _close(g, w, f"{tag} {name}", floor=floor)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("n", NUMELS)
def test_matches_torch_adamw_with_fp32_grads(device, impl, weight_decay, n):
    state, grads = _state(n, device), _grads(n, torch.float32, device)
    want = _torch_adamw(*state, grads, weight_decay, start_step=3)
    _run(IMPLS[impl], *state, grads, weight_decay, start_step=3)
    _check_against_torch(state, want, f"{impl} n={n} wd={weight_decay}", grads)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("grad_dtype", ["bf16", "fp16"])
def test_low_precision_grads_and_bf16_copy_into_a_poisoned_buffer(device, impl, grad_dtype):
    n, pad = 4099, 5
    state, grads = _state(n, device), _grads(n, GRAD_DTYPES[grad_dtype], device)
    want = _torch_adamw(*state, grads, 0.1)
    buffer = torch.full((n + 2 * pad,), float("nan"), device=device, dtype=torch.bfloat16)
    param_copy = buffer[pad : pad + n]
    _run(IMPLS[impl], *state, grads, 0.1, param_copy=param_copy)
    _check_against_torch(state, want, f"{impl} {grad_dtype} grads", grads)
    assert torch.equal(param_copy, state[0].to(torch.bfloat16)), "param_copy is not the updated param in bf16"
    assert buffer[:pad].isnan().all() and buffer[pad + n :].isnan().all(), "neighbours of param_copy were written"


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_copy_rounds_to_nearest_even(device):
    # With lr = 0 the step leaves param as it is, so the copy is exactly the cast of these values:
    # ties (1 + 2^-8 rounds down to even, 1 + 3·2^-8 up), a carry into the exponent, fp32's largest
    # value (rounds to inf), infinities, NaN and a negative zero.
    values = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2 - 2**-23, 3.4028234663852886e38, float("inf"), float("-inf"),
              float("nan"), -0.0, 0.1, -123.456]  # fmt: skip
    param = torch.tensor(values, device=device)
    n = param.numel()
    exp_avg, exp_avg_sq = torch.ones(n, device=device), torch.ones(n, device=device)
    param_copy = torch.zeros(n, device=device, dtype=torch.bfloat16)
    adam_step(param, torch.ones(n, device=device), exp_avg, exp_avg_sq, **HYPER, lr=0.0, weight_decay=0.0, step=1,
              param_copy=param_copy)  # fmt: skip
    want = torch.tensor(values, device=device).to(torch.bfloat16)
    assert torch.equal(param_copy.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(_bits(param_copy[finite]), _bits(want[finite])), (param_copy, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("copy_dtype", [torch.float16, torch.float32])
def test_param_copy_in_fp16_and_fp32(device, copy_dtype):
    n = 1000
    state, grads = _state(n, device), _grads(n, torch.bfloat16, device, steps=2)
    param_copy = torch.full((n,), float("nan"), device=device, dtype=copy_dtype)
    _run(adam_step, *state, grads, 0.1, param_copy=param_copy)
    assert torch.equal(param_copy, state[0].to(copy_dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_param_copy_may_be_param_itself(device):
    n = 1000
    state, grads = _state(n, device), _grads(n, torch.float32, device, steps=2)
    want = _torch_adamw(*state, grads, 0.1)
    _run(adam_step, *state, grads, 0.1, param_copy=state[0])
    _check_against_torch(state, want, "param_copy=param", grads)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", [1, 4099])
def test_grad_scale_multiplies_the_grad(device, impl, n):
    state, grads = _state(n, device), _grads(n, torch.bfloat16, device, steps=3)
    scale = torch.tensor([0.37 / 1024], device=device)  # a clip coefficient times an inverse loss scale
    want = _torch_adamw(*state, grads, 0.1, scale=scale)
    _run(IMPLS[impl], *state, grads, 0.1, grad_scale=scale)
    _check_against_torch(state, want, f"{impl} grad_scale")


def _bits(t):
    """A view whose equality is bitwise (NaN payloads included)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


FLAGS = {
    "one": (1.0, torch.float32),
    "nan": (float("nan"), torch.float32),
    "inf": (float("inf"), torch.float32),
    "int": (3, torch.int32),
    "bool": (True, torch.bool),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("flag", FLAGS)
def test_found_inf_set_leaves_everything_bit_for_bit_unchanged(device, impl, flag):
    n = 4099
    state, (g,) = _state(n, device), _grads(n, torch.bfloat16, device, steps=1)
    g[17], g[4000] = float("inf"), float("nan")
    param_copy = torch.full((n,), float("nan"), device=device, dtype=torch.bfloat16)
    value, dtype = FLAGS[flag]
    found_inf = torch.tensor([value], device=device, dtype=dtype)
    before = [t.clone() for t in (*state, param_copy)]
    IMPLS[impl](state[0], g, *state[1:], **HYPER, lr=1e-2, weight_decay=0.1, step=4, found_inf=found_inf,
                grad_scale=torch.tensor([0.5], device=device), param_copy=param_copy)  # fmt: skip
    for name, b, a in zip(("param", "exp_avg", "exp_avg_sq", "param_copy"), before, (*state, param_copy)):
        assert torch.equal(_bits(b), _bits(a)), f"{name} changed although found_inf={value}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.bool])
def test_found_inf_zero_updates(device, impl, dtype):
    n = 1000
    state, grads = _state(n, device), _grads(n, torch.bfloat16, device, steps=2)
    want = _torch_adamw(*state, grads, 0.1)
    found_inf = torch.zeros(1, device=device, dtype=dtype)
    _run(IMPLS[impl], *state, grads, 0.1, found_inf=found_inf)
    _check_against_torch(state, want, f"{impl} found_inf=0 {dtype}", grads)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_shard_is_a_no_op(device):
    empty = [torch.empty(0, device=device) for _ in range(4)]
    adam_step(*empty, **HYPER, lr=1e-2, weight_decay=0.1, step=1)
    assert torch.equal(grad_stats(empty[1]), torch.zeros(2, device=device))


# ----------------------------------------------------------------------------------------------------
# grad_stats
# ----------------------------------------------------------------------------------------------------

STATS = {"kernel": grad_stats, "reference": grad_stats_reference}


def _float64_stats(g):
    g = g.double()
    return g.square().sum().item(), (~torch.isfinite(g)).sum().item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", STATS)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("n", NUMELS)
def test_grad_stats_matches_float64(device, impl, grad_dtype, n):
    (g,) = _grads(n, GRAD_DTYPES[grad_dtype], device, steps=1)
    stats = STATS[impl](g)
    assert stats.dtype == torch.float32 and stats.shape == (2,) and stats.device == g.device
    sumsq, count = _float64_stats(g)
    assert stats[0].item() == pytest.approx(sumsq, rel=1e-5)
    assert stats[1].item() == count == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", STATS)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
def test_grad_stats_counts_inf_and_nan(device, impl, grad_dtype):
    (g,) = _grads(4099, GRAD_DTYPES[grad_dtype], device, steps=1)
    g[0], g[300], g[4098] = float("inf"), float("-inf"), float("nan")  # in the first, a middle and the last block
    stats = STATS[impl](g)
    assert stats[1].item() == 3
    assert not torch.isfinite(stats[0]), "a non-finite element must make the sum of squares non-finite"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", STATS)
def test_grad_stats_accumulates_into_out(device, impl):
    buckets = _grads(1000, torch.bfloat16, device, steps=2) + _grads(4099, torch.float32, device, steps=1)
    buckets[1][5] = float("nan")
    out = torch.tensor([2.5, 1.0], device=device)  # already holds another bucket's numbers
    for g in buckets:
        assert STATS[impl](g, out) is out
    assert out[0].isnan() and out[1].item() == 2.0  # the NaN reaches the sum; one more non-finite counted
    clean = [_float64_stats(g) for g in (buckets[0], buckets[2])]
    out = torch.tensor([2.5, 1.0], device=device)
    for g in (buckets[0], buckets[2]):
        STATS[impl](g, out)
    assert out[0].item() == pytest.approx(2.5 + sum(s for s, _ in clean), rel=1e-5)
    assert out[1].item() == 1.0


# ----------------------------------------------------------------------------------------------------
# Bad input: ValueError/TypeError naming the argument, nothing modified
# ----------------------------------------------------------------------------------------------------


def _valid_args(n=10):
    gen = torch.Generator().manual_seed(3)
    tensors = {
        "param": torch.randn(n, generator=gen),
        "grad": torch.randn(n, generator=gen).bfloat16(),
        "exp_avg": torch.randn(n, generator=gen),
        "exp_avg_sq": torch.rand(n, generator=gen),
    }
    kwargs = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=1)
    return tensors, kwargs


def _bad_tensor(name, make):
    return lambda t, k: (t.__setitem__(name, make(t[name])), k)


def _bad_kwarg(name, value):
    return lambda t, k: (t, k.__setitem__(name, value))


BAD_ADAM = {
    "param not a tensor": (_bad_tensor("param", lambda p: p.tolist()), TypeError, "param must be a torch.Tensor"),
    "param bf16": (_bad_tensor("param", lambda p: p.bfloat16()), TypeError, "param must be float32"),
    "exp_avg fp16": (_bad_tensor("exp_avg", lambda t: t.half()), TypeError, "exp_avg must be float32"),
    "exp_avg_sq fp64": (_bad_tensor("exp_avg_sq", lambda t: t.double()), TypeError, "exp_avg_sq must be float32"),
    "grad int": (_bad_tensor("grad", lambda t: t.int()), TypeError, "grad must be float32/bfloat16/float16"),
    "grad fp64": (_bad_tensor("grad", lambda t: t.double()), TypeError, "grad must be float32/bfloat16/float16"),
    "grad numel": (_bad_tensor("grad", lambda t: t[:9]), ValueError, "grad must have param's numel 10, received 9"),
    "exp_avg numel": (_bad_tensor("exp_avg", lambda t: torch.cat([t, t])), ValueError, "exp_avg must have param's"),
    "param 2-D": (_bad_tensor("param", lambda t: t.view(2, 5)), ValueError, "param must be 1-D"),
    "grad not contiguous": (
        _bad_tensor("grad", lambda t: torch.stack([t, t], 1)[:, 0]),
        ValueError,
        "grad must be contiguous",
    ),
    "exp_avg_sq not contiguous": (
        _bad_tensor("exp_avg_sq", lambda t: torch.cat([t, t])[::2]),
        ValueError,
        "exp_avg_sq must be contiguous",
    ),
    "grad on meta": (_bad_tensor("grad", lambda t: t.to("meta")), ValueError, "grad must be on param's device"),
    "param_copy int8": (
        _bad_kwarg("param_copy", torch.zeros(10, dtype=torch.int8)),
        TypeError,
        "param_copy must be bfloat16/float16/float32",
    ),
    "param_copy numel": (_bad_kwarg("param_copy", torch.zeros(11)), ValueError, "param_copy must have param's numel"),
    "param_copy 2-D": (_bad_kwarg("param_copy", torch.zeros(2, 5)), ValueError, "param_copy must be 1-D"),
    "param_copy on meta": (
        _bad_kwarg("param_copy", torch.zeros(10, device="meta")),
        ValueError,
        "param_copy must be on param's device",
    ),
    "grad_scale two elements": (
        _bad_kwarg("grad_scale", torch.ones(2)),
        ValueError,
        "grad_scale must have exactly 1 element",
    ),
    "grad_scale float": (_bad_kwarg("grad_scale", 0.5), TypeError, "grad_scale must be None or a 1-element"),
    "grad_scale bf16": (_bad_kwarg("grad_scale", torch.ones(1).bfloat16()), TypeError, "grad_scale must be float32"),
    "found_inf empty": (_bad_kwarg("found_inf", torch.ones(0)), ValueError, "found_inf must have exactly 1 element"),
    "found_inf on meta": (
        _bad_kwarg("found_inf", torch.ones(1, device="meta")),
        ValueError,
        "found_inf must be on param's device",
    ),
    "lr negative": (_bad_kwarg("lr", -1e-3), ValueError, "lr must be >= 0, received -0.001"),
    "lr nan": (_bad_kwarg("lr", float("nan")), ValueError, "lr must be >= 0"),
    "lr string": (_bad_kwarg("lr", "1e-3"), TypeError, "lr must be a real number, received str"),
    "beta1 one": (_bad_kwarg("beta1", 1.0), ValueError, r"beta1 must be in \[0, 1\), received 1.0"),
    "beta1 negative": (_bad_kwarg("beta1", -0.1), ValueError, r"beta1 must be in \[0, 1\)"),
    "beta2 above one": (_bad_kwarg("beta2", 1.5), ValueError, r"beta2 must be in \[0, 1\), received 1.5"),
    "eps zero": (_bad_kwarg("eps", 0.0), ValueError, "eps must be > 0, received 0.0"),
    "weight_decay negative": (_bad_kwarg("weight_decay", -0.1), ValueError, "weight_decay must be >= 0"),
    "step zero": (_bad_kwarg("step", 0), ValueError, "step must be >= 1, received 0"),
    "step float": (_bad_kwarg("step", 1.0), TypeError, "step must be an int, received float"),
    "step bool": (_bad_kwarg("step", True), TypeError, "step must be an int, received bool"),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", BAD_ADAM)
def test_bad_input_raises_and_modifies_nothing(impl, case):
    tensors, kwargs = _valid_args()
    corrupt, error, match = BAD_ADAM[case]
    corrupt(tensors, kwargs)
    snapshot = {k: v.clone() for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(error, match=match):
        IMPLS[impl](**tensors, **kwargs)
    for name, before in snapshot.items():
        if before.device.type != "meta":
            assert torch.equal(tensors[name], before), f"{name} was modified before the error"


def test_overlapping_buffers_are_rejected():
    flat = torch.randn(20)
    tensors, kwargs = _valid_args()
    with pytest.raises(ValueError, match="exp_avg and exp_avg_sq must not share memory"):
        adam_step(tensors["param"], tensors["grad"], flat[:10], flat[5:15], **kwargs)
    with pytest.raises(ValueError, match="param_copy must not share memory with exp_avg"):
        adam_step(**tensors, **kwargs, param_copy=tensors["exp_avg"])
    with pytest.raises(ValueError, match="param_copy must not share memory with param"):
        adam_step(**tensors, **kwargs, param_copy=tensors["param"].view(torch.bfloat16)[:10])


BAD_STATS = {
    "grad not a tensor": (lambda g: ([1.0, 2.0], None), TypeError, "grad must be a torch.Tensor"),
    "grad int": (lambda g: (g.int(), None), TypeError, "grad must be float32/bfloat16/float16"),
    "grad 2-D": (lambda g: (g.view(2, 5), None), ValueError, "grad must be 1-D"),
    "grad not contiguous": (lambda g: (torch.cat([g, g])[::2], None), ValueError, "grad must be contiguous"),
    "out fp64": (lambda g: (g, torch.zeros(2, dtype=torch.float64)), TypeError, "out must be float32"),
    "out shape": (lambda g: (g, torch.zeros(3)), ValueError, r"out must have shape \(2,\), received \(3,\)"),
    "out list": (lambda g: (g, [0.0, 0.0]), TypeError, "out must be None or a torch.Tensor"),
    "out on meta": (lambda g: (g, torch.zeros(2, device="meta")), ValueError, "out must be on grad's device"),
}


@pytest.mark.parametrize("impl", STATS)
@pytest.mark.parametrize("case", BAD_STATS)
def test_grad_stats_bad_input(impl, case):
    make, error, match = BAD_STATS[case]
    grad, out = make(torch.randn(10))
    with pytest.raises(error, match=match):
        STATS[impl](grad, out)


# ----------------------------------------------------------------------------------------------------
# CUDA only: compilation count, 64-bit offsets
# ----------------------------------------------------------------------------------------------------


def _compiled_kernels(jit_fn) -> int:
    """How many binaries a @triton.jit function holds, across Triton 3.x's cache layouts."""
    device_caches = getattr(jit_fn, "device_caches", None)  # Triton >= 3.1: device -> (kernel_cache, ...)
    if device_caches is not None:
        return sum(len(entry[0]) for entry in device_caches.values())
    cache = getattr(jit_fn, "cache", None)  # Triton 3.0: device -> {key: kernel}
    if isinstance(cache, dict):
        return sum(len(kernels) for kernels in cache.values())
    # Failing, not skipping: a Triton whose cache layout is unknown here must not pass the check silently.
    raise AssertionError("this Triton exposes neither JITFunction.device_caches nor .cache to count compilations")


@pytest.mark.gpu
def test_new_step_and_lr_do_not_recompile():
    from tessel.kernels.adam import _adam_step_kernel

    n = 4099
    state, grads = _state(n, "cuda"), _grads(n, torch.bfloat16, "cuda")
    param_copy = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    extra = dict(
        param_copy=param_copy, grad_scale=torch.ones(1, device="cuda"), found_inf=torch.zeros(1, device="cuda")
    )
    _run(adam_step, *state, grads[:1], 0.1, **extra)  # step 1 compiles (or finds) the variant
    compiled = _compiled_kernels(_adam_step_kernel)
    for step in range(2, 6):
        adam_step(*state[:1], grads[step - 1], *state[1:], **HYPER, lr=LRS[step - 1] * step, weight_decay=0.1,
                  step=step, **extra)  # fmt: skip
    torch.cuda.synchronize()
    assert _compiled_kernels(_adam_step_kernel) == compiled, "a new step or lr compiled a new kernel"


@pytest.mark.gpu
@pytest.mark.slow
def test_grad_stats_indexes_past_2_to_the_31():
    n = 2**31 + 4099  # ~4.3 GB of bf16: int32 offsets would wrap before the last blocks
    g = torch.full((n,), 0.5, device="cuda", dtype=torch.bfloat16)
    g[-1] = 3.0
    stats = grad_stats(g)
    # 0.25 per element; each block's fp32 partial is exact, the fp64 sum of partials is exact.
    assert stats[0].item() == pytest.approx((n - 1) * 0.25 + 9.0, rel=1e-6)
    assert stats[1].item() == 0
    g[2**31 + 1], g[-2] = float("inf"), float("nan")
    assert grad_stats(g)[1].item() == 2


@pytest.mark.gpu
@pytest.mark.slow
def test_adam_step_indexes_past_2_to_the_31():
    n, tail = 2**31 + 1027, 4099  # ~34 GB in all; int32 offsets would wrap before the tail blocks
    param = torch.full((n,), 1.5, device="cuda")
    grad = torch.full((n,), 0.5, device="cuda", dtype=torch.bfloat16)
    grad[-tail:] = torch.randn(tail, device="cuda", dtype=torch.bfloat16)
    exp_avg, exp_avg_sq = torch.full((n,), 0.01, device="cuda"), torch.full((n,), 1e-3, device="cuda")
    param_copy = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    want = [t[-tail:].clone() for t in (param, grad, exp_avg, exp_avg_sq, param_copy)]
    head = [t[:tail].clone() for t in (param, grad, exp_avg, exp_avg_sq, param_copy)]
    kwargs = dict(**HYPER, lr=1e-2, weight_decay=0.1, step=3)
    adam_step(param, grad, exp_avg, exp_avg_sq, **kwargs, param_copy=param_copy)
    for ref, sl in ((want, slice(n - tail, n)), (head, slice(0, tail))):
        adam_step_reference(*ref[:4], **kwargs, param_copy=ref[4])
        _check_against_torch([param[sl], exp_avg[sl], exp_avg_sq[sl]], ref[:1] + ref[2:4], "past 2**31")
        assert torch.equal(param_copy[sl], param[sl].to(torch.bfloat16))
