"""FP8 matrix multiplication: per-tensor scaled quantisation to 8-bit floats and the scaled GEMM.

Two formats (OCP FP8, what sm_89+ tensor cores multiply): ``"e4m3"`` (``torch.float8_e4m3fn``: 3 mantissa bits,
largest value 448) for weights and activations, ``"e5m2"`` (``torch.float8_e5m2``: 2 mantissa bits, largest
57344) for gradients, whose range matters more than their precision.

Quantisation (:func:`quantize_fp8`) scales a whole tensor so that its largest magnitude ``amax`` lands near the
format's largest value, as Transformer Engine's current scaling does::

    scale = 2 ** floor(log2(fp8_max / amax))        q = fp8(clamp(x * scale, -fp8_max, fp8_max))

The scale is a power of two, so ``x * scale`` is exact and a value's only error is its rounding to 8 bits; the
scale and its inverse are computed on the device from ``amax`` (no host synchronisation). ``amax == 0`` gives
scale 1. A non-finite input stays non-finite: a NaN is quantised to NaN, an infinity makes ``amax`` infinite
and the scale 0, so the tensor dequantises to NaN, and a dynamic loss scale sees the overflow.

The quantising kernel can also write the transposed copy: fp8 tensor cores read both operands along the
contracted dimension (K-major), so a linear layer's backward multiplies the transposes of what its forward did,
and each is written once, in the pass that quantises.

The GEMM (:func:`fp8_matmul`) is tessel's matmul kernel with the two inverse scales applied in its epilogue,
before the bias: ``out (+)= (a @ b) * a_scale_inv * b_scale_inv + bias``, accumulated in fp32, written in
bf16, fp16 or fp32.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._dispatch import Backend, backend_for, cdiv, opaque_to_compile
from .matmul import _launch, check_operands_agree, check_out_apart

__all__ = [
    "FP8_FORMATS",
    "Fp8Tensor",
    "absmax",
    "fp8_matmul",
    "fp8_matmul_reference",
    "fp8_matmul_unchecked",
    "quantize_fp8",
    "quantize_fp8_reference",
]

FP8_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
# Mantissa bits and smallest normal value of each format: its grid of representable values.
_GRID = {"e4m3": (3, 2.0**-6), "e5m2": (2, 2.0**-14)}
_SOURCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The largest scale: its inverse, 2**-126, is fp32's smallest normal number.
_MAX_SCALE = 2.0**126
_EXPONENT_BITS = 0x7F800000


class Fp8Tensor(NamedTuple):
    """A quantised 2-D tensor: ``x ≈ data * scale_inv``.

    data: ``[M, N]`` fp8, row-major. scale_inv: a one-element fp32 tensor on data's device. data_t: ``[N, M]``
    fp8, row-major, data's transpose (the same values), or None when it was not asked for.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    data_t: torch.Tensor | None = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values the fp8 tensor stands for, in ``dtype``."""
        return (self.data.to(torch.float32) * self.scale_inv).to(dtype)


# ---- Triton kernel -----------------------------------------------------------------------------------


@triton.jit
def _power_of_two_scale(amax, FP8_MAX: tl.constexpr):
    """2 ** floor(log2(FP8_MAX / amax)), exactly: the exponent bits of the ratio."""
    ratio = tl.where(amax > 0.0, FP8_MAX / amax, 1.0)  # amax 0 (or NaN): 1; infinite amax: 0
    ratio = tl.minimum(ratio, 2.0**126)
    return (ratio.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_grid(y, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """y rounded to the nearest fp8 value (ties to even), in fp32 arithmetic, so the cast that follows is exact.

    Triton's interpreter rounds fp32 to fp8 wrongly where the rounding carries into the exponent (127.7 becomes
    64 in e4m3), so the rounding is done here on every backend: adding and subtracting 2**23 units of the value's
    fp8 spacing leaves it rounded to that spacing by fp32's own round-to-nearest-even."""
    magnitude = tl.abs(y)
    binade = (magnitude.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    spacing = tl.maximum(binade, MIN_NORMAL) * (2.0**-MANTISSA_BITS)  # subnormals share the smallest spacing
    shift = spacing * 8388608.0  # 2**23
    rounded = (magnitude + shift) - shift
    sign = y.to(tl.int32, bitcast=True) & -2147483648  # y's sign bit: -0.0 stays -0.0, as PyTorch's cast keeps it
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_kernel(
    x_ptr, amax_ptr, q_ptr, qt_ptr, scale_inv_ptr, M, N, stride_xb, stride_xm, stride_xn,
    FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, TRANSPOSE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One BLOCK_M x BLOCK_N block of matrix ``program_id(2)`` of x: scale (by that matrix's amax), saturate, round
    to fp8; store it and, with TRANSPOSE, its transpose."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_b = tl.program_id(2)
    x_ptr += pid_b.to(tl.int64) * stride_xb
    q_ptr += pid_b.to(tl.int64) * M * N
    qt_ptr += pid_b.to(tl.int64) * M * N
    scale = _power_of_two_scale(tl.load(amax_ptr + pid_b), FP8_MAX)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn, mask=mask, other=0.0)
    y = x.to(tl.float32) * scale
    # Saturate: values past the largest finite one become it (a NaN compares false and stays NaN).
    y = tl.where(y > FP8_MAX, FP8_MAX, tl.where(y < -FP8_MAX, -FP8_MAX, y))
    q = _round_to_grid(y, MANTISSA_BITS, MIN_NORMAL).to(q_ptr.dtype.element_ty)
    # NaN is 0x7F in both formats, written out: the interpreter's cast turns NaN into a number.
    q = tl.where(y != y, 0x7F, q.to(tl.uint8, bitcast=True)).to(tl.uint8).to(q_ptr.dtype.element_ty, bitcast=True)
    tl.store(q_ptr + offs_m[:, None] * N + offs_n[None, :], q, mask=mask)
    if TRANSPOSE:
        tl.store(qt_ptr + offs_n[:, None] * M + offs_m[None, :], tl.trans(q), mask=tl.trans(mask))
    if (pid_m == 0) & (pid_n == 0):
        tl.store(scale_inv_ptr + pid_b, 1.0 / scale)


# ---- Host side ---------------------------------------------------------------------------------------

# 64 x 64 blocks on a GPU (4 KiB of fp8 each way); small ones under the interpreter, so tests cross block edges.
_BLOCKS = {Backend.TRITON: (64, 64), Backend.INTERPRETER: (32, 64)}


def _check_format(fn: str, fmt) -> None:
    if fmt not in FP8_FORMATS:
        raise ValueError(f"{fn}: fmt must be one of {tuple(FP8_FORMATS)}, received {fmt!r}")


def _check_source(fn: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, received {type(x).__name__}")
    if x.dim() not in (2, 3):
        raise ValueError(f"{fn}: x must be 2-D (or 3-D: a batch of matrices), received shape {tuple(x.shape)}")
    if x.dtype not in _SOURCE_DTYPES:
        raise TypeError(f"{fn}: x must be float32, float16 or bfloat16, received {x.dtype}")


def _batch(x: torch.Tensor) -> int:
    """How many matrices ``x`` holds (and so how many scales): its first dimension when 3-D, else one."""
    return x.shape[0] if x.dim() == 3 else 1


def absmax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a one-element fp32 tensor on x's device (NaN when x holds one; 0 for an empty x), of each matrix
    for a 3-D x (``[B]``): what :func:`quantize_fp8` scales by, to be reduced over ranks (a maximum) when shards
    must share one scale."""
    batch = _batch(x)
    if x.numel() == 0:
        return torch.zeros(batch, dtype=torch.float32, device=x.device)
    dims = (1, 2) if x.dim() == 3 else None
    return torch.linalg.vector_norm(x, float("inf"), dim=dims, dtype=torch.float32).reshape(batch)


def _check_amax(fn: str, amax, x: torch.Tensor) -> None:
    batch = _batch(x)
    if amax is not None and (
        not isinstance(amax, torch.Tensor)
        or amax.numel() != batch
        or amax.dtype != torch.float32
        or amax.device != x.device
    ):
        got = f"{tuple(amax.shape)} {amax.dtype} on {amax.device}" if isinstance(amax, torch.Tensor) else type(amax)
        raise ValueError(
            f"{fn}: amax must be None or a {batch}-element float32 tensor on {x.device} (one per matrix of x), "
            f"received {got}"
        )


def quantize_fp8_reference(x: torch.Tensor, fmt: str = "e4m3", *, transpose: bool = False, amax=None) -> Fp8Tensor:
    """Plain-PyTorch definition of :func:`quantize_fp8`."""
    _check_format("quantize_fp8_reference", fmt)
    _check_source("quantize_fp8_reference", x)
    _check_amax("quantize_fp8_reference", amax, x)
    fp8_max = _FP8_MAX[fmt]
    batch = _batch(x)
    amax = absmax(x) if amax is None else amax.reshape(batch)
    ratio = torch.where(amax > 0, fp8_max / amax, torch.ones_like(amax)).clamp(max=_MAX_SCALE)
    scale = (ratio.view(torch.int32) & _EXPONENT_BITS).view(torch.float32)
    per_matrix = scale.view(batch, 1, 1) if x.dim() == 3 else scale
    data = (x.float() * per_matrix).clamp(-fp8_max, fp8_max).to(FP8_FORMATS[fmt])
    return Fp8Tensor(data, 1.0 / scale, data.transpose(-1, -2).contiguous() if transpose else None)


@opaque_to_compile
def quantize_fp8(x: torch.Tensor, fmt: str = "e4m3", *, transpose: bool = False, amax=None) -> Fp8Tensor:
    """``x`` (2-D, any strides, fp32/fp16/bf16) scaled and rounded to fp8 (see the module's docstring).

    Args:
        x: the tensor to quantise; a 3-D ``x`` is a batch of matrices (experts' weights), each with its own scale.
        fmt: ``"e4m3"`` or ``"e5m2"``.
        transpose: also write ``data_t``, the quantised transpose (for the GEMMs that contract x's rows).
        amax: the magnitude to scale by instead of x's own :func:`absmax` (a one-element fp32 tensor, one per
            matrix for a 3-D x): the largest over several ranks' shards, so that each quantises its shard as the
            whole would be.

    Returns:
        An :class:`Fp8Tensor` with row-major ``data`` (and ``data_t``, each matrix transposed) and ``scale_inv``:
        one element, or one per matrix.
    """
    _check_format("quantize_fp8", fmt)
    _check_source("quantize_fp8", x)
    _check_amax("quantize_fp8", amax, x)
    if not isinstance(transpose, bool):
        raise TypeError(f"quantize_fp8: transpose must be a bool, received {type(transpose).__name__}")
    backend = backend_for(x)
    if backend == Backend.REFERENCE:
        return quantize_fp8_reference(x, fmt, transpose=transpose, amax=amax)
    *lead, m, n = x.shape
    batch = _batch(x)
    dtype = FP8_FORMATS[fmt]
    data = torch.empty((*lead, m, n), dtype=dtype, device=x.device)
    data_t = torch.empty((*lead, n, m), dtype=dtype, device=x.device) if transpose else None
    scale_inv = torch.ones(batch, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return Fp8Tensor(data, scale_inv, data_t)
    amax = absmax(x) if amax is None else amax
    block_m, block_n = _BLOCKS[backend]
    strides = x.stride() if lead else (0, *x.stride())
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _quantize_kernel[(cdiv(m, block_m), cdiv(n, block_n), batch)](
            x, amax, data, data_t if transpose else data, scale_inv, m, n, *strides,
            FP8_MAX=_FP8_MAX[fmt], MANTISSA_BITS=_GRID[fmt][0], MIN_NORMAL=_GRID[fmt][1], TRANSPOSE=transpose,
            BLOCK_M=block_m, BLOCK_N=block_n,
        )  # fmt: skip
    return Fp8Tensor(data, scale_inv, data_t)


def _check_fp8_operand(name: str, t, k_dim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"fp8_matmul: {name} must be a torch.Tensor, received {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"fp8_matmul: {name} must be 2-D, received shape {tuple(t.shape)}")
    if t.dtype not in FP8_FORMATS.values():
        raise TypeError(f"fp8_matmul: {name} must be float8_e4m3fn or float8_e5m2, received {t.dtype}")
    if t.stride(k_dim) != 1 and t.shape[k_dim] > 1:
        layout = "row-major ([M, K], unit stride along K)" if k_dim == 1 else "K-major (w.t() of a row-major w)"
        raise ValueError(
            f"fp8_matmul: {name} must be {layout}, as fp8 tensor cores read it; received strides {t.stride()}"
        )


def _check_scale(name: str, s, device: torch.device) -> None:
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"fp8_matmul: {name} must be a torch.Tensor, received {type(s).__name__}")
    if s.numel() != 1 or s.dtype != torch.float32 or s.device != device:
        raise ValueError(
            f"fp8_matmul: {name} must be a one-element float32 tensor on {device}, received shape "
            f"{tuple(s.shape)} {s.dtype} on {s.device}"
        )


def _validate(a, b, a_scale_inv, b_scale_inv, bias, out, accumulate, out_dtype, split_accumulator) -> None:
    _check_fp8_operand("a", a, 1)
    _check_fp8_operand("b", b, 0)
    check_operands_agree("fp8_matmul", a, b)
    _check_scale("a_scale_inv", a_scale_inv, a.device)
    _check_scale("b_scale_inv", b_scale_inv, a.device)
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"fp8_matmul: out_dtype must be bfloat16, float16 or float32, received {out_dtype}")
    for flag, value in (("accumulate", accumulate), ("split_accumulator", split_accumulator)):
        if not isinstance(value, bool):
            raise TypeError(f"fp8_matmul: {flag} must be a bool, received {type(value).__name__}")
    m, n = a.shape[0], b.shape[1]
    if bias is not None and (
        not isinstance(bias, torch.Tensor) or bias.shape != (n,) or bias.dtype != out_dtype or bias.device != a.device
    ):
        got = f"{tuple(bias.shape)} {bias.dtype} on {bias.device}" if isinstance(bias, torch.Tensor) else type(bias)
        raise ValueError(f"fp8_matmul: bias must be a ({n},) {out_dtype} tensor on {a.device}, received {got}")
    if out is None:
        if accumulate:
            raise ValueError("fp8_matmul: accumulate=True needs out= (the tensor to add onto), received out=None")
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"fp8_matmul: out must be a torch.Tensor, received {type(out).__name__}")
    if tuple(out.shape) != (m, n) or out.dtype != out_dtype or out.device != a.device:
        raise ValueError(
            f"fp8_matmul: out must be a ({m}, {n}) {out_dtype} tensor on {a.device}, received "
            f"{tuple(out.shape)} {out.dtype} on {out.device}"
        )
    check_out_apart(a, b, out, "fp8_matmul")


def fp8_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    split_accumulator: bool = True,
) -> torch.Tensor:
    """``out (+)= (a @ b) * a_scale_inv * b_scale_inv + bias`` with fp8 operands, in one Triton kernel.

    Args:
        a: ``[M, K]`` fp8 (either format), row-major along K (``a.stride(1) == 1``).
        b: ``[K, N]`` fp8, K-major (``b.stride(0) == 1``): ``w.t()`` of a row-major ``[N, K]`` weight, or
            ``data_t.t()`` of an :class:`Fp8Tensor`.
        a_scale_inv, b_scale_inv: one-element fp32 tensors (an :class:`Fp8Tensor`'s ``scale_inv``).
        bias: optional ``[N]`` tensor of ``out_dtype``, added in fp32 after the scaling.
        out: optional ``[M, N]`` tensor of ``out_dtype`` to write into; any strides, as :func:`matmul`'s.
        accumulate: add the result onto ``out`` (in fp32, one rounding).
        out_dtype: bfloat16 (default), float16 or float32.
        split_accumulator: on sm_90, sum each K block's products in full fp32 (the tensor cores' fp8
            accumulation keeps fewer bits; without it the error grows with K). False is faster.

    Returns:
        ``out`` when given, otherwise a new ``[M, N]`` tensor of ``out_dtype``. Not differentiable (fp8 operands
        have no gradient): :func:`tessel.layers.fp8_linear` is the differentiable layer.
    """
    _validate(a, b, a_scale_inv, b_scale_inv, bias, out, accumulate, out_dtype, split_accumulator)
    if out is None:
        out = torch.empty((a.shape[0], b.shape[1]), device=a.device, dtype=out_dtype)
    fp8_matmul_unchecked(a, b, a_scale_inv, b_scale_inv, bias, out=out, accumulate=accumulate,
                         split_accumulator=split_accumulator)  # fmt: skip
    return out


def fp8_matmul_unchecked(a, b, a_scale_inv, b_scale_inv, bias=None, *, out, accumulate=False, split_accumulator=True):
    """:func:`fp8_matmul` into ``out`` without its argument checks: for the steps of tessel's rings, whose operands
    are views of tensors the overlapped op quantised and checked once."""
    _launch(a, b, bias, None, out, accumulate, scales=(a_scale_inv, b_scale_inv), split_acc=split_accumulator)


def fp8_matmul_reference(a, b, a_scale_inv, b_scale_inv, bias=None, out=None, accumulate=False, *,
                         out_dtype=torch.bfloat16) -> torch.Tensor:  # fmt: skip
    """Plain-PyTorch definition of :func:`fp8_matmul`, in float64 (the exact product of the fp8 values)."""
    z = (a.double() @ b.double()) * (a_scale_inv.double() * b_scale_inv.double())
    if bias is not None:
        z = z + bias.double()
    if out is None:
        return z.to(out_dtype)
    if accumulate:
        z = z + out.double()
    with torch.no_grad():
        out.copy_(z)
    return out
