"""tessel.kernels.attention against a float64 reference: out, lse, dq, dk, dv; causal, GQA/MQA, odd lengths.

Errors are measured as max|got - want| / max|want| per tensor (attention outputs and gradients are sums
of many terms of mixed sign, so an elementwise relative bound means nothing near their zeros). TOL:

- fp32: the kernel differs from float64 by fp32 accumulation over at most 130 keys and the exp2/log2 of
  the online softmax, a few ulps (2⁻²⁴ ≈ 6e-8) each: measured ≤ 1.5e-6 here, checked at 2e-5.
- fp16: inputs are exact in both, but P and dS are rounded to fp16 (2⁻¹¹ ≈ 4.9e-4 relative) before
  their products, as on tensor cores, and every output is rounded once more: measured ≤ 1.1e-3,
  checked at 4e-3.
- bf16: the same roundings with an 8-bit mantissa (2⁻⁸ ≈ 3.9e-3): measured 7.5e-3 on the one
  interpreter case, checked at 3e-2 (the other bf16 tests need a GPU).

The interpreter runs the Triton kernels with fp32 dot operands (see kernels/_dispatch.py), so on the CPU
fp16 differs from the GPU only by the summation order of the dots.
"""

import importlib
import math

import pytest
import torch

from tessel.kernels.attention import HEAD_DIMS, flash_attention, flash_attention_reference

attention_module = importlib.import_module("tessel.kernels.attention")

TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
LAYOUTS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}  # (query heads, key/value heads)
B = 2


def rel_err(got: torch.Tensor, want: torch.Tensor, floor: float = 1e-30) -> float:
    """max|got - want| / max(max|want|, floor)."""
    got, want = got.double(), want.double()
    assert got.shape == want.shape, (got.shape, want.shape)
    return ((got - want).abs().max() / want.abs().max().clamp_min(floor)).item()


def assert_close(got, want, dtype, what, floor=1e-30):
    err = rel_err(got, want, floor)
    assert err <= TOL[dtype], f"{what}: max error {err:.3g} of max|want|, above {TOL[dtype]:.3g} ({dtype})"  # NaN fails


def assert_lse_close(got, want, what):
    """lse in fp32 (computed from exact products whatever the input dtype); rows that see no key are -inf in both."""
    no_key = torch.isneginf(want)
    assert torch.equal(torch.isneginf(got), no_key), f"{what}: -inf rows differ"
    assert_close(got[~no_key], want[~no_key], torch.float32, what)


def make_qkv(layout, s, d, dtype, device="cpu", q_scale=1.0, sk=None):
    """q [B, Hq, s, d]; k, v [B, Hkv, sk, d] (sk = s by default)."""
    hq, hkv = LAYOUTS[layout]
    sk = s if sk is None else sk
    q = (torch.randn(B, hq, s, d, device=device) * q_scale).to(dtype)
    k = torch.randn(B, hkv, sk, d, device=device).to(dtype)
    v = torch.randn(B, hkv, sk, d, device=device).to(dtype)
    return q, k, v


def reference_with_grads(q, k, v, causal, grad_out, grad_lse=None, scale=None, compute=torch.float64):
    """out, lse (in `compute`, float64 by default) and the gradients of <out, grad_out> (+ <lse, grad_lse>)."""
    q64, k64, v64 = (t.detach().to(compute).requires_grad_() for t in (q, k, v))
    out, lse = flash_attention_reference(q64, k64, v64, causal, scale, return_lse=True)
    loss = (out * grad_out.to(compute)).sum()
    if grad_lse is not None:
        loss = loss + (lse * grad_lse.to(compute)).sum()
    loss.backward()
    return out.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


def check_against_reference(
    q, k, v, causal, dtype, scale=None, with_lse_grad=False, compute=torch.float64, deterministic=True
):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = flash_attention(q, k, v, causal, scale, return_lse=True, deterministic=deterministic)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    grad_out = torch.randn_like(out)
    grad_lse = torch.randn_like(lse) if with_lse_grad else None
    loss = (out * grad_out).float().sum() + ((lse * grad_lse).sum() if with_lse_grad else 0)
    loss.backward()
    want = reference_with_grads(q, k, v, causal, grad_out, grad_lse, scale, compute)
    # With one key the softmax is constant: dq and dk are exactly 0, so their error is measured against
    # the O(1) scale of the random inputs instead.
    floor = 1.0 if k.shape[2] == 1 else 1e-30
    for name, got, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, q.grad, k.grad, v.grad), want):
        assert got.dtype == (torch.float32 if name == "lse" else dtype)
        what = f"{name} (causal={causal}, shape {tuple(q.shape)}, kv {tuple(k.shape)})"
        if name == "lse":
            assert_lse_close(got, ref, what)
        else:
            assert_close(got, ref, dtype, what, floor)


# ---------------------------------------------------------------------------------------------------- sweeps
# The full product (3 layouts × 5 lengths × 4 head dims × 2 masks × 2 dtypes) takes far too long under
# the interpreter; each sweep varies one axis over all its values with the others fixed, so every value
# of every axis is covered, each with and without the causal mask.

SEQ_LENS = [1, 19, 37, 64, 130]  # one row; tails of the 16/32 interpreter blocks; an exact multiple


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s", SEQ_LENS)
def test_sequence_lengths(seed, s, causal):
    check_against_reference(*make_qkv("gqa", s, 32, torch.float32), causal, torch.float32)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_head_dims(seed, d, causal):
    check_against_reference(*make_qkv("gqa", 37, d, torch.float16), causal, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["mha", "mqa"])  # gqa runs in the sweeps above
def test_head_layouts(seed, layout, causal, dtype):
    check_against_reference(*make_qkv(layout, 37, 32, dtype), causal, dtype)


@pytest.mark.parametrize(
    "layout, s, d, causal, dtype",
    [
        ("mqa", 64, 64, True, torch.float16),  # four query heads summed into each dK/dV, causal
        ("mha", 64, 16, False, torch.float16),
        ("gqa", 1, 128, True, torch.float16),
        ("mqa", 19, 128, False, torch.float32),
        ("gqa", 37, 32, True, torch.bfloat16),  # the interpreter's bf16 casts, at bf16's tolerance
    ],
)
def test_mixed_cases(seed, layout, s, d, causal, dtype):
    check_against_reference(*make_qkv(layout, s, d, dtype), causal, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_peaked_softmax(seed, dtype):
    """Scores with a spread of ±15: the running maximum moves between key blocks and rescales the sums."""
    check_against_reference(*make_qkv("gqa", 37, 64, dtype, q_scale=5.0), True, dtype)


# ---------------------------------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("causal", [False, True])
def test_scale_argument(seed, causal):
    check_against_reference(*make_qkv("gqa", 37, 32, torch.float32), causal, torch.float32, scale=0.3)


def test_default_scale_is_inverse_sqrt_head_dim(seed):
    q, k, v = make_qkv("gqa", 19, 64, torch.float32)
    want = flash_attention_reference(q.double(), k.double(), v.double(), scale=1 / math.sqrt(64))
    assert_close(flash_attention(q, k, v), want, torch.float32, "out")


def test_lse_is_the_natural_log_sum_exp(seed):
    q, k, v = make_qkv("mqa", 37, 16, torch.float32)
    _, lse = flash_attention(q, k, v, True, 0.5, return_lse=True)
    scores = 0.5 * q.double() @ k.double().transpose(-1, -2)  # one kv head: broadcasts over the 4 query heads
    scores = scores.masked_fill(torch.ones(37, 37, dtype=torch.bool).triu(1), float("-inf"))
    assert_close(lse, torch.logsumexp(scores, dim=-1), torch.float32, "lse")


# ---------------------------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("causal", [False, True])
def test_gradient_through_lse(seed, causal):
    """A loss on both out and lse (what merging context-parallel partials does): Δ = rowsum(dO∘O) - dlse."""
    check_against_reference(*make_qkv("gqa", 37, 32, torch.float32), causal, torch.float32, with_lse_grad=True)


def test_gradient_through_lse_alone(seed):
    q, k, v = (t.requires_grad_() for t in make_qkv("mqa", 19, 16, torch.float32))
    _, lse = flash_attention(q, k, v, True, return_lse=True)
    grad_lse = torch.randn_like(lse)
    lse.backward(grad_lse)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    flash_attention_reference(q64, k64, v64, True, return_lse=True)[1].backward(grad_lse.double())
    for name, got, want in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        if name == "dv":  # lse does not depend on v
            assert torch.count_nonzero(got) == 0
        else:
            assert_close(got, want, torch.float32, name)


def test_broadcast_gradients(seed):
    """(out·w).sum() + lse.sum(): dO and dlse arrive as stride-0 views, read through their strides."""
    q, k, v = (t.requires_grad_() for t in make_qkv("gqa", 19, 16, torch.float32))
    w = torch.randn(16)
    out, lse = flash_attention(q, k, v, True, return_lse=True)
    ((out * w).sum() + lse.sum()).backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, lse64 = flash_attention_reference(q64, k64, v64, True, return_lse=True)
    ((out64 * w.double()).sum() + lse64.sum()).backward()
    for name, got, want in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        assert_close(got, want, torch.float32, name)


@pytest.mark.parametrize("needs", ["q", "k", "v", "kv", "qv"])
def test_gradients_when_only_some_inputs_require_them(seed, monkeypatch, needs):
    launched = []
    for name in ("_flash_attention_bwd_dkdv_kernel", "_flash_attention_bwd_dq_kernel"):
        kernel = getattr(attention_module, name)
        spy = type("Spy", (), {"__getitem__": lambda self, grid, k=kernel, n=name: launched.append(n) or k[grid]})()
        monkeypatch.setattr(attention_module, name, spy)
    q, k, v = make_qkv("gqa", 19, 32, torch.float32)
    inputs = dict(q=q, k=k, v=v)
    for name in needs:
        inputs[name].requires_grad_()
    out = flash_attention(q, k, v, causal=True)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    want = dict(zip("qkv", reference_with_grads(q, k, v, True, grad_out)[2:]))
    for name, t in inputs.items():
        if name in needs:
            assert_close(t.grad, want[name], torch.float32, f"d{name}")
        else:
            assert t.grad is None
    expected = (["_flash_attention_bwd_dkdv_kernel"] if set(needs) & {"k", "v"} else []) + (
        ["_flash_attention_bwd_dq_kernel"] if "q" in needs else []
    )
    assert launched == expected  # a gradient nobody asked for is not computed


def test_second_derivatives_are_refused(seed):
    q, k, v = make_qkv("gqa", 19, 16, torch.float32)
    q.requires_grad_()
    (dq,) = torch.autograd.grad(flash_attention(q, k, v).square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dq.sum().backward()


def test_no_graph_without_requires_grad(seed):
    q, k, v = make_qkv("gqa", 19, 16, torch.float32)
    assert flash_attention(q, k, v).grad_fn is None
    with torch.no_grad():
        assert flash_attention(q.requires_grad_(), k, v).grad_fn is None


# ---------------------------------------------------------------------------------------------------- layouts


def test_strided_inputs_are_read_in_place(seed, monkeypatch):
    """q is a [B, S, H, D] buffer seen as [B, H, S, D]; k and v are slices of one fused KV buffer."""
    s, d, hq, hkv = 37, 32, 4, 2
    q = torch.randn(B, s, hq, d).transpose(1, 2)
    kv = torch.randn(B, s, 2 * hkv + 1, d)  # a spare head: k and v are not dense
    k, v = kv[:, :, :hkv].transpose(1, 2), kv[:, :, hkv : 2 * hkv].transpose(1, 2)
    seen = []
    forward = attention_module._forward

    def spy(q_, k_, v_, *args, **kwargs):
        seen.append([(t.data_ptr(), t.stride()) for t in (q_, k_, v_)])
        return forward(q_, k_, v_, *args, **kwargs)

    monkeypatch.setattr(attention_module, "_forward", spy)
    check_against_reference(q, k, v, True, torch.float32)
    assert seen == [[(t.data_ptr(), t.stride()) for t in (q, k, v)]]


def test_non_contiguous_head_dim_is_copied(seed):
    q, _, v = make_qkv("gqa", 19, 32, torch.float32)
    k_strided = torch.randn(B, 2, 19, 64)[..., ::2]  # stride 2 along head_dim
    assert k_strided.stride(-1) == 2
    check_against_reference(q, k_strided, v, False, torch.float32)


@pytest.mark.parametrize("order", ["bhsd", "bshd", "sbhd"])
def test_outputs_follow_the_input_layout(seed, order):
    """out (and dq, dk, dv) keep q's (k's, v's) memory order: the layer's head merge copies nothing."""
    s, d = 19, 32
    shape = {"b": B, "h": 4, "s": s, "d": d}
    base = torch.randn([shape[c] for c in order])
    q = base.permute([order.index(c) for c in "bhsd"]).requires_grad_()
    k, v = (torch.randn(B, 2, s, d, requires_grad=True) for _ in range(2))
    out = flash_attention(q, k, v)
    assert out.stride() == q.stride()
    if order == "bshd":
        assert out.transpose(1, 2).reshape(B, s, 4 * d).data_ptr() == out.data_ptr()  # a view, not a copy
    out.backward(torch.randn_like(out))
    assert q.grad.stride() == q.stride() and k.grad.is_contiguous() and v.grad.is_contiguous()


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty{,_like} return NaN-filled tensors for the whole test."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def nan_empty_like(*args, **kwargs):
        t = empty_like(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(attention_module.torch, "empty", nan_empty)
    monkeypatch.setattr(attention_module.torch, "empty_like", nan_empty_like)


@pytest.mark.parametrize("sq, sk", [(37, 37), (64, 19), (19, 64)])  # Sq > Sk: rows that see no key
def test_every_output_element_is_written(seed, nan_empty, sq, sk):
    """With NaN-filled allocations, out, lse, Δ, dq, dk, dv are all written."""
    check_against_reference(*make_qkv("mqa", sq, 16, torch.float32, sk=sk), True, torch.float32, with_lse_grad=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "shape, sk", [((0, 4, 19, 16), 19), ((2, 4, 0, 16), 0), ((2, 4, 19, 16), 0), ((2, 4, 0, 16), 19)]
)
def test_empty_batch_or_sequence(nan_empty, shape, sk, causal):
    """No query or no key: out is 0 (no key to average), lse -inf, and every gradient 0; nothing is left unwritten."""
    q = torch.randn(shape, requires_grad=True)
    k = torch.randn(shape[0], 2, sk, 16, requires_grad=True)
    out, lse = flash_attention(q, k, k, causal, return_lse=True)
    assert out.shape == shape and lse.shape == shape[:3]
    assert torch.count_nonzero(out) == 0 and torch.isneginf(lse).all()
    (out.sum() + lse.sum()).backward()  # a loss of -inf, but its gradient is 1 everywhere
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    assert torch.count_nonzero(q.grad) == 0 and torch.count_nonzero(k.grad) == 0


def test_reference_backend_without_the_interpreter(seed, monkeypatch):
    """CPU tensors without TRITON_INTERPRET run the reference, with the same result and autograd."""
    monkeypatch.setattr(attention_module, "backend_for", lambda *t: attention_module.Backend.REFERENCE)
    q, k, v = make_qkv("gqa", 19, 16, torch.float32)
    out, lse = flash_attention(q, k, v, True, return_lse=True)
    want_out, want_lse = flash_attention_reference(q, k, v, True, return_lse=True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


# ---------------------------------------------------------------------------------------------------- bad input


def _t(*shape, dtype=torch.float32, device="cpu"):
    return (
        torch.randn(shape, dtype=torch.float32, device=device).to(dtype)
        if device != "meta"
        else torch.empty(shape, dtype=dtype, device=device)
    )


GOOD = dict(q=(2, 4, 5, 16), k=(2, 2, 5, 16), v=(2, 2, 5, 16))


@pytest.mark.parametrize(
    "change, error, words",
    [
        (dict(q=_t(4, 5, 16)), ValueError, ["q must be 4-D", "(4, 5, 16)"]),
        (dict(k=_t(2, 2, 5, 16, 1)), ValueError, ["k must be 4-D"]),
        (dict(v=[[1.0]]), TypeError, ["v must be a torch.Tensor", "list"]),
        (dict(v=_t(2, 2, 6, 16)), ValueError, ["k and v must have the same sequence length", "(2, 2, 6, 16)"]),
        (dict(v=_t(2, 1, 5, 16)), ValueError, ["k and v must have the same shape", "(2, 1, 5, 16)"]),
        (dict(k=_t(3, 2, 5, 16), v=_t(3, 2, 5, 16)), ValueError, ["batch sizes differ", "(3, 2, 5, 16)"]),
        (dict(k=_t(2, 2, 5, 32), v=_t(2, 2, 5, 32)), ValueError, ["head-dim sizes differ", "(2, 2, 5, 32)"]),
        (dict(k=_t(2, 3, 5, 16), v=_t(2, 3, 5, 16)), ValueError, ["head count 4", "multiple", "head count 3"]),
        (dict(k=_t(2, 0, 5, 16), v=_t(2, 0, 5, 16)), ValueError, ["positive multiple", "head count 0"]),
        (
            dict(q=_t(2, 4, 5, 48), k=_t(2, 2, 5, 48), v=_t(2, 2, 5, 48)),
            ValueError,
            ["head_dim must be one of (16, 32, 64, 128, 256)", "48"],
        ),
        (dict(v=_t(2, 2, 5, 16, dtype=torch.float16)), TypeError, ["v must have q's dtype torch.float32", "float16"]),
        (
            dict(q=_t(2, 4, 5, 16, dtype=torch.float64), k=_t(2, 2, 5, 16, dtype=torch.float64)),
            TypeError,
            ["q must be float32, float16, bfloat16", "float64"],
        ),
        (dict(q=torch.ones(2, 4, 5, 16, dtype=torch.int32)), TypeError, ["q must be float32", "int32"]),
        (dict(k=_t(2, 2, 5, 16, device="meta")), ValueError, ["k must be on q's device cpu", "meta"]),
        (dict(causal=1), TypeError, ["causal must be a bool", "int"]),
        (dict(scale="0.5"), TypeError, ["scale must be a number or None", "str"]),
        (dict(scale=float("inf")), ValueError, ["scale must be finite", "inf"]),
    ],
)
def test_bad_input(change, error, words):
    args = {name: _t(*shape) for name, shape in GOOD.items()} | change
    with pytest.raises(error) as info:
        flash_attention(**args)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_offsets_past_int32_within_a_head_are_refused(monkeypatch):
    """Row offsets inside one head are int32 in the kernels (batch/head offsets are int64): refuse, not wrap."""
    _, k, v = make_qkv("gqa", 37, 16, torch.float32)
    q = torch.randn(B, 37, 4, 16).transpose(1, 2)  # rows 4·16 apart
    monkeypatch.setattr(attention_module, "_INT32_MAX", 36 * 16 + 16)  # k's and v's rows (16 apart) just fit
    with pytest.raises(ValueError, match="sequence length 37 times the row stride 64"):
        flash_attention(q, k, v)
    flash_attention(q.contiguous(), k, v)


def test_reference_validates_too_and_accepts_float64():
    with pytest.raises(ValueError, match="flash_attention_reference: head_dim must be one of"):
        flash_attention_reference(_t(1, 1, 3, 8), _t(1, 1, 3, 8), _t(1, 1, 3, 8))
    out = flash_attention_reference(*(_t(*GOOD[n], dtype=torch.float64) for n in "qkv"))
    assert out.dtype == torch.float64


# ---------------------------------------------------------------------------------------------------- GPU


def _sdpa(q, k, v, causal):
    """torch's attention on the same inputs, with the kv heads repeated for GQA."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s, d", [(128, 128), (1000, 128), (4096, 128), (1000, 256)])
def test_gpu_against_sdpa(seed, s, d, causal, dtype):
    """Out and gradients against torch's SDPA on the same low-precision inputs, and both against fp32.

    Both round P (and dS) to the input dtype, so they differ from each other by a few ulps of it; and
    tessel's error against an fp32 SDPA on the same inputs must be of the same order as torch's own.
    """
    b, hq, hkv = 2, 8, 2
    q = torch.randn(b, hq, s, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, hkv, s, d, device="cuda", dtype=dtype, requires_grad=True)
    grad_out = torch.randn(b, hq, s, d, device="cuda", dtype=dtype)
    results = {}
    for name, fn, cast in (
        ("tessel", flash_attention, dtype),
        ("torch", _sdpa, dtype),
        ("fp32", _sdpa, torch.float32),
    ):
        leaves = [t.detach().to(cast).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, causal)
        out.backward(grad_out.to(cast))
        results[name] = [out.detach(), *(t.grad for t in leaves)]
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        tessel, torch_, exact = results["tessel"][i], results["torch"][i], results["fp32"][i]
        assert_close(tessel, torch_, torch.bfloat16, f"{what} vs SDPA (S={s}, causal={causal}, {dtype})")
        assert rel_err(tessel, exact) <= 2 * rel_err(torch_, exact) + TOL[dtype] / 10, what


@pytest.mark.gpu
def test_gpu_grid_limit_is_refused():
    q = torch.randn(65536, 1, 1, 16, device="cuda")
    with pytest.raises(ValueError, match="batch · query heads = 65536 exceeds the CUDA grid limit 65535"):
        flash_attention(q, q, q)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_gqa_lse_and_strides_against_float64(seed, causal):
    """Odd length, MQA, a [B, S, H, D] query view, lse: the compiled kernels against the float64 reference."""
    s, d = 1000, 64
    q = torch.randn(2, s, 8, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(2, 1, s, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 1, s, d, device="cuda", dtype=torch.bfloat16)
    check_against_reference(q, k, v, causal, torch.bfloat16, with_lse_grad=True)
