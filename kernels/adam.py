"""Fused mixed-precision AdamW step over a ZeRO shard, and the gradient statistics that gate it.

One pass per shard of ``n`` elements (all 1-D, contiguous, on one device)::

    g  = grad · grad_scale                         (grad fp32/bf16/fp16, upcast to fp32)
    p  = p · (1 - lr·weight_decay)                 (decoupled weight decay)
    m  = β1·m + (1 - β1)·g
    v  = β2·v + (1 - β2)·g²
    p  = p - lr / (1 - β1^step) · m / (sqrt(v) / sqrt(1 - β2^step) + eps)
    param_copy = p  (cast to its dtype: bf16/fp16/fp32)

exactly torch.optim.AdamW's arithmetic. It reads grad, param, m, v and two 1-element device scalars
and writes param, m, v and the low-precision copy: 28 bytes per element with bf16 grads and a bf16
copy, instead of the ~50 of an unfused upcast + AdamW + cast. ``grad_scale`` (inverse loss scale ×
clip coefficient) and ``found_inf`` (skip flag) are read by the kernel from memory, so nothing in the
step synchronises with the host; when ``found_inf`` is nonzero every program returns before it loads
anything, leaving all outputs bit for bit unchanged. The bias corrections are computed on the host and
passed as fp32 runtime arguments, so a new step (or a new lr) never recompiles the kernel.

``grad_stats`` is the read-only pass that precedes the step: the fp32 sum of squares of a gradient
shard and its count of non-finite elements, optionally added into an fp32 ``[2]`` accumulator so
that several buckets share one all-reduce. Per-program partials are summed by ``torch.sum``
(deterministic, no atomics).

Legend: ``n`` elements in the shard.

The three tiers: ``_adam_step_kernel`` / ``_grad_stats_kernel`` (Triton), ``adam_step`` /
``grad_stats`` (validating launchers), ``adam_step_reference`` / ``grad_stats_reference`` (plain
PyTorch, the definitions tests compare to).
"""

from __future__ import annotations

import contextlib
import numbers

import torch
import triton
import triton.language as tl

from ._dispatch import Backend, backend_for, byte_span, cdiv, memory_overlaps, opaque_to_compile

__all__ = ["adam_step", "adam_step_reference", "grad_stats", "grad_stats_reference"]

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_COPY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FP32_MAX = 3.4028234663852886e38

# CUDA: 4096 elements per program (16 per thread at 8 warps, four 128-bit loads per fp32 stream).
# The interpreter pays milliseconds per block operation, so tests with odd sizes span several blocks.
_CUDA_BLOCKS = {"adam": (4096, 8), "stats": (4096, 8)}
_INTERPRETER_BLOCKS = {"adam": (256, 4), "stats": (256, 4)}


# ----------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _bf16_round_to_nearest_even(x):
    """fp32 -> bf16 rounded to nearest even by integer arithmetic on the bits (NaN stays a quiet NaN).

    Triton's interpreter truncates fp32 -> bf16 casts (and its "rtne" mode rounds ties up and drops
    the carry into the exponent), so under the interpreter the copy is rounded here, as the GPU's
    cvt.rn.bf16.f32 and torch's ``.to(torch.bfloat16)`` do.
    """
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    bits = tl.where(x != x, (bits >> 16) | 0x40, rounded)
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _adam_step_kernel(
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, param_copy_ptr, grad_scale_ptr, found_inf_ptr,
    n, decay, beta1, beta2, step_size, bias_correction2_sqrt, eps,
    HAS_GRAD_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr, HAS_PARAM_COPY: tl.constexpr,
    BF16_COPY_BY_BITS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    if HAS_FOUND_INF:  # noqa: SIM102 (constexpr guard: without it found_inf_ptr aliases param)
        # Decided on the device: with the flag set (nonzero or NaN) every program returns unwritten.
        if tl.load(found_inf_ptr) != 0:
            return
    pid = tl.program_id(0).to(tl.int64)  # int64 before the multiply: shards may pass 2**31 elements
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(param_ptr + offs, mask=mask, other=0.0)
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)
    if HAS_GRAD_SCALE:
        g = g * tl.load(grad_scale_ptr)
    p = p * decay
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    # IEEE square root and division, as torch computes them (tl.sqrt is the approximate one on CUDA).
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)
    tl.store(param_ptr + offs, p, mask=mask)
    tl.store(exp_avg_ptr + offs, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
    if BF16_COPY_BY_BITS:
        tl.store(param_copy_ptr + offs, _bf16_round_to_nearest_even(p), mask=mask)
    elif HAS_PARAM_COPY:
        tl.store(param_copy_ptr + offs, p.to(param_copy_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grad_stats_kernel(grad_ptr, partials_ptr, n, FP32_MAX: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(grad_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    sumsq = tl.sum(g * g, axis=0)
    nonfinite = tl.sum(((g != g) | (tl.abs(g) > FP32_MAX)).to(tl.float32), axis=0)
    tl.store(partials_ptr + 2 * pid, sumsq)
    tl.store(partials_ptr + 2 * pid + 1, nonfinite)


# ----------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------


def _names(dtypes) -> str:
    return "/".join(str(d).removeprefix("torch.") for d in dtypes)


def _check_vector(op: str, name: str, t, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, received {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{op}: {name} must be {_names(dtypes)}, received {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{op}: {name} must be 1-D, received shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous, received stride {t.stride()}")


def _check_like(op: str, name: str, t: torch.Tensor, param: torch.Tensor) -> None:
    if t.numel() != param.numel():
        raise ValueError(f"{op}: {name} must have param's numel {param.numel()}, received {t.numel()}")
    if t.device != param.device:
        raise ValueError(f"{op}: {name} must be on param's device {param.device}, received {t.device}")


def _check_scalar_tensor(op: str, name: str, t, param: torch.Tensor, dtypes=None) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be None or a 1-element torch.Tensor, received {type(t).__name__}")
    if t.numel() != 1:
        raise ValueError(f"{op}: {name} must have exactly 1 element, received shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{op}: {name} must be {_names(dtypes)}, received {t.dtype}")
    if t.device != param.device:
        raise ValueError(f"{op}: {name} must be on param's device {param.device}, received {t.device}")


def _check_number(op: str, name: str, value, ok, expected: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{op}: {name} must be a real number, received {type(value).__name__}")
    if not ok(float(value)):
        raise ValueError(f"{op}: {name} must be {expected}, received {value}")


def _validate_adam(op, param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step,
                   grad_scale, found_inf, param_copy) -> None:  # fmt: skip
    fp32 = (torch.float32,)
    _check_vector(op, "param", param, fp32)
    _check_vector(op, "grad", grad, _GRAD_DTYPES)
    _check_vector(op, "exp_avg", exp_avg, fp32)
    _check_vector(op, "exp_avg_sq", exp_avg_sq, fp32)
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _check_like(op, name, t, param)
    if param_copy is not None:
        _check_vector(op, "param_copy", param_copy, _COPY_DTYPES)
        _check_like(op, "param_copy", param_copy, param)
    _check_scalar_tensor(op, "grad_scale", grad_scale, param, fp32)
    _check_scalar_tensor(op, "found_inf", found_inf, param)
    _check_number(op, "lr", lr, lambda x: x >= 0, ">= 0")
    _check_number(op, "beta1", beta1, lambda x: 0 <= x < 1, "in [0, 1)")
    _check_number(op, "beta2", beta2, lambda x: 0 <= x < 1, "in [0, 1)")
    _check_number(op, "eps", eps, lambda x: x > 0, "> 0")
    _check_number(op, "weight_decay", weight_decay, lambda x: x >= 0, ">= 0")
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"{op}: step must be an int, received {type(step).__name__}")
    if step < 1:
        raise ValueError(f"{op}: step must be >= 1, received {step}")
    buffers = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    items = list(buffers.items())
    for i, (name_a, a) in enumerate(items):
        for name_b, b in items[i + 1 :]:
            if memory_overlaps(a, b):
                raise ValueError(f"{op}: {name_a} and {name_b} must not share memory")
    if param_copy is not None:
        for name, t in items:
            # The copy may be param itself (an fp32 master that is also the model's parameter).
            same = name == "param" and byte_span(t) == byte_span(param_copy) and param_copy.dtype == t.dtype
            if memory_overlaps(param_copy, t) and not same:
                raise ValueError(f"{op}: param_copy must not share memory with {name}")


def _validate_stats(op, grad, out) -> None:
    _check_vector(op, "grad", grad, _GRAD_DTYPES)
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{op}: out must be None or a torch.Tensor, received {type(out).__name__}")
    if out.dtype != torch.float32:
        raise TypeError(f"{op}: out must be float32, received {out.dtype}")
    if tuple(out.shape) != (2,):
        raise ValueError(f"{op}: out must have shape (2,), received {tuple(out.shape)}")
    if out.device != grad.device:
        raise ValueError(f"{op}: out must be on grad's device {grad.device}, received {out.device}")


def _step_scalars(lr, beta1, beta2, weight_decay, step) -> dict[str, float]:
    """Host-side fp64 arithmetic; the kernel receives the results as fp32 runtime arguments."""
    return {
        "decay": 1.0 - lr * weight_decay,
        "step_size": lr / (1.0 - beta1**step),
        "bias_correction2_sqrt": (1.0 - beta2**step) ** 0.5,
    }


# ----------------------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------------------


def _adam_reference_into(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step,
                         grad_scale, found_inf, param_copy) -> None:  # fmt: skip
    s = _step_scalars(lr, beta1, beta2, weight_decay, step)
    g = grad.float()
    if grad_scale is not None:
        g = g * grad_scale.reshape(1)
    p = param * s["decay"]
    m = exp_avg * beta1 + g * (1.0 - beta1)
    v = exp_avg_sq * beta2 + g * g * (1.0 - beta2)
    p = p - s["step_size"] * (m / (v.sqrt() / s["bias_correction2_sqrt"] + eps))
    new = [(param, p), (exp_avg, m), (exp_avg_sq, v)]
    if param_copy is not None:
        new.append((param_copy, p.to(param_copy.dtype)))
    if found_inf is not None:  # torch.where keeps the device-side decision: no host synchronisation
        skip = found_inf.reshape(()) != 0
        new = [(dst, torch.where(skip, dst, val)) for dst, val in new]
    for dst, val in new:
        dst.copy_(val)


def adam_step_reference(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
                        grad_scale=None, found_inf=None, param_copy=None) -> None:  # fmt: skip
    """Plain-PyTorch definition of :func:`adam_step` (same arguments, same in-place updates)."""
    args = (param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step)
    _validate_adam("adam_step_reference", *args, grad_scale, found_inf, param_copy)
    with torch.no_grad():
        _adam_reference_into(*args, grad_scale, found_inf, param_copy)


def _grad_stats_reference_into(grad, out) -> torch.Tensor:
    g = grad.float()
    stats = torch.stack([(g * g).sum(), (~torch.isfinite(g)).sum().float()])
    if out is None:
        return stats
    return out.add_(stats)


def grad_stats_reference(grad, out=None) -> torch.Tensor:
    """Plain-PyTorch definition of :func:`grad_stats`."""
    _validate_stats("grad_stats_reference", grad, out)
    with torch.no_grad():
        return _grad_stats_reference_into(grad, out)


# ----------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------


def _blocks(backend: str, op: str) -> tuple[int, int]:
    return (_INTERPRETER_BLOCKS if backend == Backend.INTERPRETER else _CUDA_BLOCKS)[op]


def _device_context(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@opaque_to_compile
def adam_step(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
              grad_scale=None, found_inf=None, param_copy=None) -> None:  # fmt: skip
    """One fused AdamW step over a shard, in place; see the module docstring for the arithmetic.

    Args:
        param: fp32 master shard, 1-D contiguous; updated in place.
        grad: same numel, fp32/bf16/fp16, 1-D contiguous; read only (upcast to fp32 in registers).
        exp_avg, exp_avg_sq: fp32 first and second moments, same numel; updated in place.
        lr, beta1, beta2, eps, weight_decay: host numbers, as torch.optim.AdamW's.
        step: the step count after this update (1 on the first step), a host int.
        grad_scale: None or a 1-element fp32 device tensor multiplied onto grad (inverse loss scale
            × clip coefficient), read by the kernel.
        found_inf: None or a 1-element device tensor; nonzero makes the step write nothing.
        param_copy: None or a 1-D contiguous bf16/fp16/fp32 tensor (a view into an all-gather buffer,
            say) that receives the updated param in its dtype.

    Raises ValueError/TypeError naming the argument before anything is modified.
    """
    args = (param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step)
    _validate_adam("adam_step", *args, grad_scale, found_inf, param_copy)
    n = param.numel()
    if n == 0:
        return
    backend = backend_for(param)
    if backend == Backend.REFERENCE:
        with torch.no_grad():
            _adam_reference_into(*args, grad_scale, found_inf, param_copy)
        return
    if found_inf is not None and found_inf.dtype == torch.bool:
        found_inf = found_inf.view(torch.uint8)
    s = _step_scalars(lr, beta1, beta2, weight_decay, step)
    block, warps = _blocks(backend, "adam")
    bf16_by_bits = backend == Backend.INTERPRETER and param_copy is not None and param_copy.dtype == torch.bfloat16
    with _device_context(param):
        _adam_step_kernel[(cdiv(n, block),)](
            param, grad, exp_avg, exp_avg_sq,
            param_copy if param_copy is not None else param,
            grad_scale if grad_scale is not None else param,
            found_inf if found_inf is not None else param,
            n, float(s["decay"]), float(beta1), float(beta2), float(s["step_size"]),
            float(s["bias_correction2_sqrt"]), float(eps),
            HAS_GRAD_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None,
            HAS_PARAM_COPY=param_copy is not None, BF16_COPY_BY_BITS=bf16_by_bits, BLOCK=block, num_warps=warps,
        )  # fmt: skip


@opaque_to_compile
def grad_stats(grad, out=None) -> torch.Tensor:
    """``[sum of squares, count of non-finite elements]`` of a gradient shard, fp32, one read-only pass.

    Squares are accumulated in fp32 (so a non-finite element makes the sum inf/nan, and squares past
    fp32's range overflow to inf). With ``out`` (fp32 ``[2]``, grad's device) the two numbers are
    added into it and ``out`` is returned, so several buckets accumulate before one all-reduce.
    """
    _validate_stats("grad_stats", grad, out)
    backend = backend_for(grad)
    if backend == Backend.REFERENCE:
        with torch.no_grad():
            return _grad_stats_reference_into(grad, out)
    n = grad.numel()
    block, warps = _blocks(backend, "stats")
    programs = cdiv(n, block)
    partials = torch.zeros((max(programs, 1), 2), device=grad.device, dtype=torch.float32)
    if programs:
        with _device_context(grad):
            _grad_stats_kernel[(programs,)](grad, partials, n, FP32_MAX=_FP32_MAX, BLOCK=block, num_warps=warps)
    # fp64 over the partials: counts stay exact past 2**24 and the sum is rounded to fp32 once.
    stats = partials.sum(dim=0, dtype=torch.float64).float()
    if out is None:
        return stats
    return out.add_(stats)
