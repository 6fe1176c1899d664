"""Fused RMSNorm and LayerNorm over the last dimension: Triton forward and backward, fp32 statistics.

    rms_norm:    y = x·rstd·w                  rstd = 1 / sqrt(mean(x²) + eps)
    layer_norm:  y = (x − mean)·rstd·w + b     rstd = 1 / sqrt(mean((x − mean)²) + eps)

Legend: ``H`` the normalised (last) dimension, ``M`` the number of rows (the product of the leading
dimensions), ``G`` the number of programs of the backward kernel, ``x̂`` the normalised row, ``g = dy·w``.

Backward, per row (``mean_H`` averages over the row):

    rms:    dx = rstd·(g − x̂·mean_H(g·x̂))
    layer:  dx = rstd·(g − mean_H(g) − x̂·mean_H(g·x̂))
    dw = Σ_M dy·x̂        db = Σ_M dy

Statistics and arithmetic are fp32 whatever the input dtype; the output is rounded once to x's dtype.
The weight (and bias) may be fp32 with fp16/bf16 activations. The forward saves ``rstd`` (and, for
LayerNorm, ``mean``) as one fp32 per row. The backward writes dx and, per program, an fp32 partial sum
of dw (db) over the rows it handled; a torch sum over the ``G`` partials follows, so the result does not
depend on the order in which programs run (deterministic, no atomics).

Rows may be strided along the leading dimensions as long as the last dimension is contiguous: the
leading dimensions are folded into at most two (``[outer, inner]``), each with its own stride, which
covers a plain 2-D row stride and the ``[B, S, H]`` view of a token-major ``[S, B, H]`` buffer that the
tensor-parallel linear layers produce. Anything else is copied first. Outputs keep x's memory layout
when x is dense (``torch.empty_like``), so a token-major activation stays token-major.

The three tiers: ``_norm_fwd_kernel`` / ``_norm_bwd_kernel`` (Triton, one kernel for both norms, a
constexpr picks which), ``rms_norm`` / ``layer_norm`` (validating launchers, differentiable through
``_NormFunction``), and ``rms_norm_reference`` / ``layer_norm_reference`` (plain PyTorch).
"""

from __future__ import annotations

import contextlib
import math
import numbers

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._dispatch import Backend, backend_for, cdiv, next_power_of_2, opaque_to_compile

__all__ = ["MAX_HIDDEN", "layer_norm", "layer_norm_reference", "rms_norm", "rms_norm_reference"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# One program holds a whole row in registers (one read of x in the forward, one of x and dy in the
# backward); 64Ki elements is the widest block that still compiles to 32 warps without the row spilling
# out of reach.
MAX_HIDDEN = 65536


# ----------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _row_offsets(rows, INNER, stride_outer, stride_inner):
    """Element offset of each row's first element; rows fold as ``row = outer·INNER + inner``."""
    rows = rows.to(tl.int64)
    return (rows // INNER) * stride_outer + (rows % INNER) * stride_inner


@triton.jit
def _norm_fwd_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr,
    M, H, INNER, stride_x0, stride_x1, stride_y0, stride_y1, eps,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_H)
    row_ok = rows < M
    col_ok = cols < H
    mask = row_ok[:, None] & col_ok[None, :]
    x_ptrs = x_ptr + _row_offsets(rows, INNER, stride_x0, stride_x1)[:, None] + cols[None, :]
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / H
        xc = tl.where(mask, x - mean[:, None], 0.0)  # the masked tail must not count in the variance
        tl.store(mean_ptr + rows, mean, mask=row_ok)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / H + eps)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + _row_offsets(rows, INNER, stride_y0, stride_y1)[:, None] + cols[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_kernel(
    x_ptr, w_ptr, dy_ptr, dx_ptr, mean_ptr, rstd_ptr, dw_partial_ptr, db_partial_ptr,
    M, H, INNER, stride_x0, stride_x1, stride_dy0, stride_dy1, stride_dx0, stride_dx1,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    # Program p handles row blocks p, p + G, p + 2G, ... and keeps fp32 running sums of dw (db) in registers.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < H
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for block in range(pid, tl.cdiv(M, BLOCK_ROWS), tl.num_programs(0)):
        rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        x_ptrs = x_ptr + _row_offsets(rows, INNER, stride_x0, stride_x1)[:, None] + cols[None, :]
        dy_ptrs = dy_ptr + _row_offsets(rows, INNER, stride_dy0, stride_dy1)[:, None] + cols[None, :]
        x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptrs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        if IS_RMS:
            x_hat = x * rstd[:, None]
        else:
            mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
            x_hat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        g = dy * w[None, :]
        c_gx = tl.sum(g * x_hat, axis=1) / H
        if IS_RMS:
            dx = (g - x_hat * c_gx[:, None]) * rstd[:, None]
        else:
            c_g = tl.sum(g, axis=1) / H
            dx = (g - c_g[:, None] - x_hat * c_gx[:, None]) * rstd[:, None]
        dx_ptrs = dx_ptr + _row_offsets(rows, INNER, stride_dx0, stride_dx1)[:, None] + cols[None, :]
        tl.store(dx_ptrs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += tl.sum(dy * x_hat, axis=0)
        if HAS_BIAS:
            db_acc += tl.sum(dy, axis=0)
    tl.store(dw_partial_ptr + pid * H + cols, dw_acc, mask=col_ok)
    if HAS_BIAS:
        tl.store(db_partial_ptr + pid * H + cols, db_acc, mask=col_ok)


# Under the interpreter each block operation costs milliseconds of numpy work: few rows per block, and
# two backward programs, so that tests with a handful of rows still run several blocks, the row tail, a
# loop of more than one iteration and a reduction over more than one partial.
_INTERPRETER_BLOCK_ROWS = 4
_INTERPRETER_BWD_PROGRAMS = 2


def _launch_config(backend: str, block_h: int) -> tuple[int, int]:
    """(BLOCK_ROWS, num_warps): on CUDA several short rows per program, one long row spread over more warps."""
    if backend == Backend.INTERPRETER:
        return _INTERPRETER_BLOCK_ROWS, 4
    block_rows = max(1, min(16, 2048 // block_h))
    numel = block_rows * block_h
    num_warps = 32 if numel >= 32768 else 16 if numel >= 8192 else 8 if numel >= 2048 else 4
    return block_rows, num_warps


# ----------------------------------------------------------------------------------------------------
# Host side: validation, row layout, dispatch, launch
# ----------------------------------------------------------------------------------------------------


def _check_param(op: str, name: str, p, x: torch.Tensor) -> None:
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, received {type(p).__name__}")
    h = x.shape[-1]
    if p.dim() != 1 or p.shape[0] != h:
        raise ValueError(f"{op}: {name} must have shape ({h},) (x's last dimension), received {tuple(p.shape)}")
    if p.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"{op}: {name} must be {x.dtype} (x's dtype) or torch.float32, received {p.dtype}")
    if p.device != x.device:
        raise ValueError(f"{op}: {name} must be on x's device {x.device}, received {p.device}")


def _validate(op: str, x, weight, bias, eps) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, received {type(x).__name__}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{op}: x must be float32, float16 or bfloat16, received {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have at least one dimension (the normalised one), received a 0-d tensor")
    if not 1 <= x.shape[-1] <= MAX_HIDDEN:
        raise ValueError(f"{op}: x's last dimension must be in [1, {MAX_HIDDEN}], received shape {tuple(x.shape)}")
    backend_for(x)  # raises for devices other than cuda and cpu
    _check_param(op, "weight", weight, x)
    if bias is not None:
        _check_param(op, "bias", bias, x)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{op}: eps must be a real number, received {type(eps).__name__} {eps!r}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{op}: eps must be finite and non-negative, received {eps!r}")


def _row_shape(x: torch.Tensor) -> tuple[int, int, int] | None:
    """``(outer, inner, H)`` such that ``x.view`` of it addresses every row with two strides, else None."""
    groups: list[tuple[int, int]] = []  # (size, stride) of runs of leading dims that fold into one
    for size, stride in zip(x.shape[:-1], x.stride()[:-1]):
        if size == 1:
            continue
        if groups and groups[-1][1] == size * stride:
            groups[-1] = (groups[-1][0] * size, stride)
        else:
            groups.append((size, stride))
    if len(groups) > 2:
        return None
    sizes = [1] * (2 - len(groups)) + [size for size, _ in groups]
    return sizes[0], sizes[1], x.shape[-1]


def _rows_input(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``t`` (or a contiguous copy when its rows cannot be addressed in place) and its ``[outer, inner, H]`` shape."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        t = t.contiguous()
    shape3 = _row_shape(t)
    if shape3 is None:
        t = t.contiguous()
        shape3 = _row_shape(t)
    return t, shape3


def _as_rows(t: torch.Tensor, shape3: tuple[int, int, int]) -> torch.Tensor:
    """``t`` viewed as ``shape3`` with a unit-stride last dim, copying only when no such view exists."""
    if t.stride(-1) == 1 or t.shape[-1] == 1:
        with contextlib.suppress(RuntimeError):
            return t.view(shape3)
    return t.contiguous().view(shape3)


def _strides(t3: torch.Tensor) -> tuple[int, int]:
    return t3.stride(0), t3.stride(1)


@opaque_to_compile
def _forward(x, weight, bias, eps, is_rms):
    """Launch the forward on the right backend; returns ``(y, x, mean, rstd)`` (x as read, maybe a copy)."""
    x, shape3 = _rows_input(x)
    x3 = x.view(shape3)
    y = torch.empty_like(x)  # x's strides when x is dense, so a token-major activation stays token-major
    y3 = y.view(shape3)
    m, inner, h = shape3[0] * shape3[1], shape3[1], shape3[2]
    mean = torch.empty(0 if is_rms else m, device=x.device, dtype=torch.float32)
    rstd = torch.empty(m, device=x.device, dtype=torch.float32)
    if m == 0:
        return y, x, mean, rstd
    backend = backend_for(x)
    if backend == Backend.REFERENCE:
        _forward_reference_into(x3, weight, bias, eps, is_rms, y3, mean, rstd)
        return y, x, mean, rstd
    block_h = next_power_of_2(h)
    block_rows, num_warps = _launch_config(backend, block_h)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _norm_fwd_kernel[(cdiv(m, block_rows),)](
            x3, weight, bias if bias is not None else weight, y3, mean if not is_rms else rstd, rstd,
            m, h, inner, *_strides(x3), *_strides(y3), eps,
            IS_RMS=is_rms, HAS_BIAS=bias is not None, BLOCK_ROWS=block_rows, BLOCK_H=block_h, num_warps=num_warps,
        )  # fmt: skip
    return y, x, mean, rstd


@opaque_to_compile
def _backward(dy, x, weight, has_bias, mean, rstd, is_rms):
    """Launch the backward; returns ``(dx, dw, db)`` with dw/db in the weight's dtype (db None without bias)."""
    _, shape3 = _rows_input(x)  # x was saved as read by the forward: it views as shape3 without a copy
    x3, dy3 = x.view(shape3), _as_rows(dy, shape3)
    dx = torch.empty_like(x)
    dx3 = dx.view(shape3)
    m, inner, h = shape3[0] * shape3[1], shape3[1], shape3[2]
    backend = backend_for(x)
    if m == 0:
        zeros = torch.zeros_like(weight)
        return dx, zeros, zeros.clone() if has_bias else None
    if backend == Backend.REFERENCE:
        dw, db = _backward_reference_into(dy3, x3, weight, mean, rstd, is_rms, dx3)
        return dx, dw.to(weight.dtype), db.to(weight.dtype) if has_bias else None
    block_h = next_power_of_2(h)
    block_rows, num_warps = _launch_config(backend, block_h)
    if backend == Backend.INTERPRETER:
        programs = min(cdiv(m, block_rows), _INTERPRETER_BWD_PROGRAMS)
    else:
        # Two programs per SM keep every SM busy while the [G, H] partials stay a small fraction of the
        # traffic (G·H·4 bytes against M·H·(2 reads + 1 write) of activations).
        sm_count = torch.cuda.get_device_properties(x.device).multi_processor_count
        programs = min(cdiv(m, block_rows), 2 * sm_count)
    dw_partial = torch.empty((programs, h), device=x.device, dtype=torch.float32)
    db_partial = torch.empty((programs, h), device=x.device, dtype=torch.float32) if has_bias else dw_partial
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _norm_bwd_kernel[(programs,)](
            x3, weight, dy3, dx3, mean if not is_rms else rstd, rstd, dw_partial, db_partial,
            m, h, inner, *_strides(x3), *_strides(dy3), *_strides(dx3),
            IS_RMS=is_rms, HAS_BIAS=has_bias, BLOCK_ROWS=block_rows, BLOCK_H=block_h, num_warps=num_warps,
        )  # fmt: skip
    dw = dw_partial.sum(dim=0).to(weight.dtype)
    db = db_partial.sum(dim=0).to(weight.dtype) if has_bias else None
    return dx, dw, db


# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------


def _statistics(xf: torch.Tensor, eps: float, is_rms: bool):
    """(centred x, mean or None, rstd) of the rows of xf, in xf's dtype."""
    mean = None if is_rms else xf.mean(dim=-1)
    xc = xf if is_rms else xf - mean.unsqueeze(-1)
    rstd = torch.rsqrt(xc.square().mean(dim=-1) + eps)
    return xc, mean, rstd


def _forward_reference_into(x3, weight, bias, eps, is_rms, y3, mean, rstd) -> None:
    """The CPU fallback of the forward kernel: the same fp32 arithmetic, written into the same buffers."""
    xc, mean_f, rstd_f = _statistics(x3.float(), eps, is_rms)
    y = xc * rstd_f.unsqueeze(-1) * weight.float()
    if bias is not None:
        y = y + bias.float()
    y3.copy_(y)
    rstd.copy_(rstd_f.reshape(-1))
    if not is_rms:
        mean.copy_(mean_f.reshape(-1))


def _backward_reference_into(dy3, x3, weight, mean, rstd, is_rms, dx3):
    """The CPU fallback of the backward kernel; returns fp32 (dw, db)."""
    h = x3.shape[-1]
    rstd = rstd.view(x3.shape[:-1]).unsqueeze(-1)
    xf, dy = x3.float(), dy3.float()
    x_hat = xf * rstd if is_rms else (xf - mean.view(x3.shape[:-1]).unsqueeze(-1)) * rstd
    g = dy * weight.float()
    dx = g - x_hat * (g * x_hat).sum(dim=-1, keepdim=True) / h
    if not is_rms:
        dx = dx - g.sum(dim=-1, keepdim=True) / h
    dx3.copy_(dx * rstd)
    return (dy * x_hat).sum(dim=(0, 1)), dy.sum(dim=(0, 1))


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Plain-PyTorch :func:`rms_norm`: ``torch.nn.functional.rms_norm`` computed in fp32 (float64 for
    float64 input, which is how tests build their exact reference), rounded once to x's dtype."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = F.rms_norm(x.to(compute), (x.shape[-1],), weight.to(compute), eps)
    return y.to(x.dtype)


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """Plain-PyTorch :func:`layer_norm`: ``torch.nn.functional.layer_norm`` computed in fp32 (float64 for
    float64 input), rounded once to x's dtype."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    b = None if bias is None else bias.to(compute)
    y = F.layer_norm(x.to(compute), (x.shape[-1],), weight.to(compute), b, eps)
    return y.to(x.dtype)


# ----------------------------------------------------------------------------------------------------
# Autograd and public launchers
# ----------------------------------------------------------------------------------------------------


class _NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, is_rms):
        y, x_read, mean, rstd = _forward(x, weight, bias, eps, is_rms)
        ctx.save_for_backward(x_read, weight, mean, rstd)
        ctx.is_rms, ctx.has_bias = is_rms, bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = _backward(dy, x, weight, ctx.has_bias, mean, rstd, ctx.is_rms)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        return dx if need_x else None, dw if need_w else None, db if need_b else None, None, None


def _apply(x, weight, bias, eps, is_rms) -> torch.Tensor:
    if torch.compiler.is_compiling():  # one graph node each way (see .library)
        return torch.ops.tessel.norm(x, weight, bias, float(eps), is_rms)[0]
    tracked = (x, weight, bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tracked):
        return _NormFunction.apply(x, weight, bias, float(eps), is_rms)
    return _forward(x, weight, bias, float(eps), is_rms)[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension in one Triton pass per direction; differentiable.

    Args:
        x: ``[..., H]`` float32/float16/bfloat16, ``1 <= H <= MAX_HIDDEN``; rows may be strided along
            the leading dims (the last dim must be contiguous, or x is copied).
        weight: ``[H]``, x's dtype or float32.
        eps: added to the mean square before the reciprocal square root.

    Returns:
        ``x·rstd·weight`` in x's dtype and, when x is dense, x's memory layout.
    """
    _validate("rms_norm", x, weight, None, eps)
    return _apply(x, weight, None, eps, True)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm over the last dimension in one Triton pass per direction; differentiable.

    Args as :func:`rms_norm`, plus ``bias``: optional ``[H]``, x's dtype or float32.

    Returns:
        ``(x − mean)·rstd·weight + bias`` in x's dtype and, when x is dense, x's memory layout.
    """
    _validate("layer_norm", x, weight, bias, eps)
    return _apply(x, weight, bias, eps, False)
