"""Grouped GEMM for mixtures of experts: every expert's rows times its own weight, in one launch.

Legend: ``R`` rows (tokens routed to experts, grouped by expert), ``X`` experts, ``K`` input and ``N`` output
width. ``grouped_matmul(a [R, K], b [X, K, N], offsets [X+1])`` computes ``out[offsets[e]:offsets[e+1]] =
a[offsets[e]:offsets[e+1]] @ b[e]`` for every expert ``e``, fp32 accumulation, any strides (``b`` is usually a
transposed view of an ``[X, N, K]`` parameter; nothing is copied).

The row counts stay on the device: each program finds its expert from ``offsets`` itself. The grid holds
``ceil(R / BLOCK_M) + X`` row tiles (times the column tiles, in grouped order), an upper bound on
``Σ_e ceil(m_e / BLOCK_M)``; a program computes the prefix sums of the experts' tile counts (``tl.cumsum``), takes
the expert whose tiles contain its index, and programs past the last tile return at once. So the launch needs no
host synchronisation and the autotuner may choose ``BLOCK_M``.

Backward (:class:`_GroupedMatmul`): ``dA = grouped_matmul(dOut, bᵀ)`` (the same kernel over ``[X, N, K]``
views), and ``dB[e] = a_eᵀ · dOut_e`` by a second kernel whose programs each own one ``[BLOCK_K, BLOCK_N]``
tile of one expert's gradient and loop over that expert's rows (an expert without rows gets zeros).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ._dispatch import Backend, backend_for, cdiv, next_power_of_2, opaque_to_compile, upcast_dot_operands
from ._tuned import launch_tuned
from .matmul import _dot, _input_precision  # TF32 for fp32 exactly when torch.matmul would use it

__all__ = ["grouped_matmul", "grouped_matmul_reference", "grouped_weight_grad", "grouped_weight_grad_reference"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _expert_of_tile(offsets_ptr, pid_m, X, BLOCK_X: tl.constexpr, BLOCK_M: tl.constexpr):
    """``(expert, first row of this tile, the expert's end row)``; ``expert == X`` for a tile past the last."""
    xs = tl.arange(0, BLOCK_X)
    lo = tl.load(offsets_ptr + xs, mask=xs < X, other=0)
    hi = tl.load(offsets_ptr + xs + 1, mask=xs < X, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(tiles, 0)
    expert = tl.sum((ends <= pid_m).to(tl.int32), 0)
    mine = xs == expert
    first_tile = tl.sum(tl.where(mine, ends - tiles, 0), 0)
    row0 = tl.sum(tl.where(mine, lo, 0), 0) + (pid_m - first_tile) * BLOCK_M
    return expert, row0, tl.sum(tl.where(mine, hi, 0), 0)


@triton.jit(do_not_specialize=["R"])  # the routed rows change from step to step: one kernel serves them all
def _grouped_kernel(
    a_ptr, b_ptr, out_ptr, offsets_ptr, a_scale_ptr, b_scale_ptr, R, N, K, X,
    stride_am, stride_ak, stride_bx, stride_bk, stride_bn, stride_om, stride_on,
    DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, SCALED: tl.constexpr, SPLIT_ACC: tl.constexpr,
    BLOCK_X: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """One ``BLOCK_M x BLOCK_N`` tile of one expert's rows of ``out``. SCALED (fp8 operands): the product times
    a's inverse scale and the expert's own (``b_scale_ptr[expert]``).

    The grid is flat, in the dense GEMM's grouped order: GROUP_M row tiles take every column tile in turn, so the
    programs running together read the same rows of ``a`` (and, within an expert, the same columns of its weight)
    from L2, where a column-by-column order streams all of ``a`` from memory once per column tile."""
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_m = (tl.program_id(0) // pids_per_group) * GROUP_M
    group_m = min(tl.cdiv(R, BLOCK_M) + X - first_m, GROUP_M)
    pid_m = first_m + (tl.program_id(0) % pids_per_group) % group_m
    pid_n = (tl.program_id(0) % pids_per_group) // group_m
    expert, row0, row_end = _expert_of_tile(offsets_ptr, pid_m, X, BLOCK_X, BLOCK_M)
    if expert < X:
        offs_m = row0.to(tl.int64) + tl.arange(0, BLOCK_M)
        offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        rows, cols = offs_m < row_end, offs_n < N
        a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + expert.to(tl.int64) * stride_bx + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=rows[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & cols[None, :], other=0.0)
            if DOT_FP32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = _dot(a, b, acc, INPUT_PRECISION, SPLIT_ACC)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        if SCALED:
            acc *= tl.load(a_scale_ptr) * tl.load(b_scale_ptr + expert)
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=rows[:, None] & cols[None, :])


@triton.jit
def _grouped_wgrad_kernel(
    a_ptr, g_ptr, out_ptr, offsets_ptr, a_scale_ptr, g_scale_ptr, R, K, N,
    stride_am, stride_ak, stride_gm, stride_gn, stride_ox, stride_ok, stride_on,
    DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, SCALED: tl.constexpr, SPLIT_ACC: tl.constexpr,
    ALIGN_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """One ``BLOCK_K x BLOCK_N`` tile of ``out[e] = a_eᵀ · g_e``, summed over the expert's rows (SCALED: times both
    operands' one-element inverse scales).

    The grid is flat, expert after expert, each expert's tiles in grouped order (GROUP_M row tiles of ``out[e]``
    take every column tile in turn): the programs running together stream the same rows of ``a_e`` and ``g_e``
    through L2. With the expert as the fastest axis they were spread over every expert, and each column block of
    ``g_e`` came from memory once per row tile."""
    tiles_k, tiles_n = tl.cdiv(K, BLOCK_K), tl.cdiv(N, BLOCK_N)
    expert = tl.program_id(0) // (tiles_k * tiles_n)
    tile = tl.program_id(0) % (tiles_k * tiles_n)
    pids_per_group = GROUP_M * tiles_n
    first_k = (tile // pids_per_group) * GROUP_M
    group_k = min(tiles_k - first_k, GROUP_M)
    offs_k = (first_k + (tile % pids_per_group) % group_k).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = ((tile % pids_per_group) // group_k).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    lo = tl.load(offsets_ptr + expert).to(tl.int64)
    hi = tl.load(offsets_ptr + expert + 1).to(tl.int64)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    start = lo
    if ALIGN_ROWS:  # rows are the operands' contiguous dimension: steps start on 16-row boundaries (whole vectors)
        start = (lo // 16) * 16
    for m in range(start, hi, BLOCK_M):
        if ALIGN_ROWS:
            m = tl.multiple_of(m, 16)
        offs_m = m + tl.arange(0, BLOCK_M)
        rows = offs_m < hi
        if ALIGN_ROWS:  # loads masked at the end of all rows only; another expert's rows count nothing
            rows = offs_m < R
        at = tl.load(a_ptr + offs_m[None, :] * stride_am + offs_k[:, None] * stride_ak,
                     mask=rows[None, :] & (offs_k[:, None] < K), other=0.0)  # fmt: skip
        g = tl.load(g_ptr + offs_m[:, None] * stride_gm + offs_n[None, :] * stride_gn,
                    mask=rows[:, None] & (offs_n[None, :] < N), other=0.0)  # fmt: skip
        if ALIGN_ROWS:
            g = tl.where(((offs_m >= lo) & (offs_m < hi))[:, None], g, tl.zeros_like(g))
        if DOT_FP32:
            at = at.to(tl.float32)
            g = g.to(tl.float32)
        acc = _dot(at, g, acc, INPUT_PRECISION, SPLIT_ACC)
    if SCALED:
        acc *= tl.load(a_scale_ptr) * tl.load(g_scale_ptr)
    out_ptrs = out_ptr + expert.to(tl.int64) * stride_ox + offs_k[:, None] * stride_ok + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_k[:, None] < K) & (offs_n[None, :] < N))


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): Hopper-sized tiles; which wins is the autotuner's measurement.
def _configs(shapes) -> list[triton.Config]:
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in shapes]  # fmt: skip


_CONFIGS = _configs([(128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 64, 4, 4)])
# The forward also tries the dense GEMM's widest tiles, for few experts of many rows each (Mixtral's shapes). The
# weight gradient's programs hold a BLOCK_M x BLOCK_N block of g per stage as well: those tiles overflow its shared
# memory.
_FORWARD_CONFIGS = _CONFIGS + _configs([(128, 256, 64, 8, 3), (256, 128, 64, 8, 3)])
_grouped_tuned = triton.autotune(_FORWARD_CONFIGS, key=["N", "K", "X", "SCALED", "SPLIT_ACC"])(_grouped_kernel)
# The weight gradient's output tile is BLOCK_K x BLOCK_N, summed over BLOCK_M rows per step: it also tries the
# dense GEMM's 128x256 and 256x128 output tiles over 64 rows per step, and 128x128 over 64 and 128 rows, which fit
# in sm_90's shared memory for 16-bit operands and compile without spills (tests/kernels/sm90_compile.py); for
# fp32 the largest overflow it and the autotuner skips them. Every program writes its whole tile (zeros for an
# expert without rows).
_WGRAD_CONFIGS = _CONFIGS + _configs([(64, 256, 128, 8, 3), (64, 128, 256, 8, 3), (64, 128, 128, 8, 4),
                                      (128, 128, 128, 8, 3)])  # fmt: skip
_wgrad_tuned = triton.autotune(_WGRAD_CONFIGS, key=["N", "K", "SCALED", "SPLIT_ACC"])(_grouped_wgrad_kernel)
_INTERPRETER_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}
_GROUP_M = 8  # row tiles per group of the grouped order (as the dense GEMM's)


def _flags(dtype: torch.dtype, backend: str, scales, split_acc: bool) -> dict:
    return {
        "DOT_FP32": upcast_dot_operands(backend), "INPUT_PRECISION": _input_precision(dtype, backend),
        "SCALED": scales is not None, "SPLIT_ACC": split_acc and backend == Backend.TRITON,
    }  # fmt: skip


@opaque_to_compile
def _launch(a, b, offsets, out, scales=None, split_acc=False) -> None:
    """``out = grouped(a, b)``; ``scales``: fp8 operands' inverse scales (a's one, b's one per expert)."""
    (rows, k), (experts, _, n) = a.shape, b.shape
    if rows == 0 or n == 0:
        return
    backend = backend_for(a)
    if backend == Backend.REFERENCE:
        out.copy_(_reference(a, b, offsets, scales, out.dtype))
        return
    args = (a, b, out, offsets, *(scales or (out, out)), rows, n, k, experts, *a.stride(), *b.stride(),
            *out.stride())  # fmt: skip
    meta = {**_flags(a.dtype, backend, scales, split_acc), "BLOCK_X": next_power_of_2(experts), "GROUP_M": _GROUP_M}
    grid = lambda m: ((cdiv(rows, m["BLOCK_M"]) + experts) * cdiv(n, m["BLOCK_N"]),)
    with torch.cuda.device(a.device) if a.is_cuda else contextlib.nullcontext():
        if backend == Backend.INTERPRETER:
            _grouped_kernel[grid(_INTERPRETER_BLOCKS)](*args, **meta, **_INTERPRETER_BLOCKS)
        else:
            launch_tuned(_grouped_tuned, grid, args, meta)


@opaque_to_compile
def _launch_wgrad(a, g, offsets, out, scales=None, split_acc=False) -> None:
    """``out[e] = a_eᵀ · g_e``; ``scales``: fp8 operands' one-element inverse scales."""
    experts, k, n = out.shape
    if experts == 0 or k == 0 or n == 0:
        return
    backend = backend_for(a)
    if backend == Backend.REFERENCE:
        out.copy_(_wgrad_reference(a, g, offsets, out.shape, scales, out.dtype))
        return
    args = (a, g, out, offsets, *(scales or (out, out)), a.shape[0], k, n, *a.stride(), *g.stride(), *out.stride())
    grid = lambda m: (experts * cdiv(k, m["BLOCK_K"]) * cdiv(n, m["BLOCK_N"]),)
    # fp8's transposed copies have the rows as their contiguous dimension (see the kernel's ALIGN_ROWS)
    align = a.stride(0) == 1 and g.stride(0) == 1 and a.shape[0] > 1
    flags = {**_flags(a.dtype, backend, scales, split_acc), "GROUP_M": _GROUP_M, "ALIGN_ROWS": align}
    with torch.cuda.device(a.device) if a.is_cuda else contextlib.nullcontext():
        if backend == Backend.INTERPRETER:
            _grouped_wgrad_kernel[grid(_INTERPRETER_BLOCKS)](*args, **flags, **_INTERPRETER_BLOCKS)
        else:
            launch_tuned(_wgrad_tuned, grid, args, flags)


class _GroupedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, offsets):
        ctx.save_for_backward(a, b, offsets)
        out = a.new_empty((a.shape[0], b.shape[2]))
        _launch(a, b, offsets, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        a, b, offsets = ctx.saved_tensors
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = a.new_empty(a.shape)
            _launch(grad, b.transpose(1, 2), offsets, grad_a)
        if ctx.needs_input_grad[1]:
            grad_b = b.new_empty(b.shape)
            _launch_wgrad(a, grad, offsets, grad_b)
        return grad_a, grad_b, None


def _check(a, b, offsets) -> None:
    for name, t in (("a", a), ("b", b), ("offsets", offsets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"grouped_matmul: {name} must be a torch.Tensor, received {type(t).__name__}")
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[1]:
        raise ValueError(f"grouped_matmul: expected a [R, K] and b [X, K, N], received a {tuple(a.shape)} and b "
                         f"{tuple(b.shape)}")  # fmt: skip
    if a.dtype not in _DTYPES or b.dtype != a.dtype:
        raise ValueError(f"grouped_matmul: a and b must share one dtype of {_DTYPES}, received {a.dtype} and "
                         f"{b.dtype}")  # fmt: skip
    if offsets.dim() != 1 or offsets.numel() != b.shape[0] + 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"grouped_matmul: offsets must be an int32/int64 [X+1] = [{b.shape[0] + 1}] tensor, "
                         f"received {offsets.dtype} of shape {tuple(offsets.shape)}")  # fmt: skip
    if not (a.device == b.device == offsets.device):
        raise ValueError(f"grouped_matmul: a, b and offsets must be on one device, received {a.device}, "
                         f"{b.device} and {offsets.device}")  # fmt: skip


def grouped_matmul(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out [R, N]`` with ``out[offsets[e]:offsets[e+1]] = a[offsets[e]:offsets[e+1]] @ b[e]``; differentiable
    in ``a`` and ``b``.

    Args:
        a: ``[R, K]`` rows grouped by expert, any strides, float32/float16/bfloat16.
        b: ``[X, K, N]`` one matrix per expert, a's dtype and device, any strides.
        offsets: ``[X+1]`` int32/int64 on a's device, non-decreasing, ``offsets[0] = 0`` and ``offsets[X] = R``
            (not checked: reading them would synchronise with the device).
    """
    _check(a, b, offsets)
    if torch.compiler.is_compiling():  # one graph node each way (see .library)
        return torch.ops.tessel.grouped_matmul(a, b, offsets)
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return _GroupedMatmul.apply(a, b, offsets)
    out = a.new_empty((a.shape[0], b.shape[2]))
    _launch(a, b, offsets, out)
    return out


def grouped_weight_grad(a: torch.Tensor, g: torch.Tensor, offsets: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[X, K, N]`` with ``[e] = a[offsets[e]:offsets[e+1]]ᵀ @ g[offsets[e]:offsets[e+1]]`` (zeros for an expert
    without rows): the weight gradient of :func:`grouped_matmul`, for callers that schedule it themselves."""
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        raise ValueError(f"grouped_weight_grad: num_experts must be a positive int, received {num_experts!r}")
    if not isinstance(g, torch.Tensor) or g.dim() != 2 or g.shape[0] != a.shape[0]:
        got = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
        raise ValueError(f"grouped_weight_grad: g must be [R, N] with a's R = {a.shape[0]} rows, received {got}")
    _check(a, a.new_empty((num_experts, a.shape[1], 0)), offsets)
    if g.dtype != a.dtype or g.device != a.device:
        raise ValueError(f"grouped_weight_grad: g must share a's dtype and device, received {g.dtype} on {g.device}")
    out = a.new_empty((num_experts, a.shape[1], g.shape[1]))
    _launch_wgrad(a, g, offsets, out)
    return out


def grouped_weight_grad_reference(a: torch.Tensor, g: torch.Tensor, offsets: torch.Tensor, num_experts: int):
    """Plain-PyTorch definition of :func:`grouped_weight_grad` (fp32 products, one rounding)."""
    return _wgrad_reference(a, g, offsets, (num_experts, a.shape[1], g.shape[1]))


def grouped_matmul_reference(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch definition of :func:`grouped_matmul`: fp32 products (float64 for float64 inputs), one
    rounding to ``a``'s dtype; reads ``offsets`` on the host."""
    return _reference(a, b, offsets, None, a.dtype)


def _reference(a, b, offsets, scales, dtype) -> torch.Tensor:
    """The grouped product in fp32 (float64 for float64 inputs), times fp8 operands' ``scales``, in ``dtype``."""
    bounds = offsets.tolist()
    work = torch.float64 if a.dtype == torch.float64 else torch.float32
    out = a.new_empty((a.shape[0], b.shape[2]), dtype=work)
    for e in range(b.shape[0]):
        out[bounds[e] : bounds[e + 1]] = a[bounds[e] : bounds[e + 1]].to(work) @ b[e].to(work)
        if scales is not None:
            out[bounds[e] : bounds[e + 1]] *= (scales[0][0] * scales[1][e]).to(work)
    return out.to(dtype)


def _wgrad_reference(a, g, offsets, shape, scales=None, dtype=None) -> torch.Tensor:
    bounds = offsets.tolist()
    out = torch.stack([a[bounds[e] : bounds[e + 1]].float().T @ g[bounds[e] : bounds[e + 1]].float()
                       for e in range(shape[0])])  # fmt: skip
    if scales is not None:
        out = out * (scales[0][0] * scales[1][0])
    return out.to(a.dtype if dtype is None else dtype)
