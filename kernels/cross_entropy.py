"""The two row passes of a cross entropy over a block of logits, each one read of the rows, fp32 arithmetic.

Legend: ``n`` rows (tokens), ``V`` columns (this rank's share of the vocabulary), ``t`` a row's target column
(``-1``: the target is not among these columns, e.g. another rank's), ``lse`` a row's natural-log log-sum-exp
over the whole vocabulary of ``Vg`` entries (merged over ranks by the caller), ``ε`` label smoothing, ``c`` the
z-loss coefficient.

    row_stats:   lse = log Σ_j exp(x_j)   z = x_t (0 when t = -1)   Σ_j x_j       one read of x
    logits_grad: g_j = (p_j·(1 + 2c·lse) − (1 − ε)·[j = t] − ε/Vg)·scale         one read of x, one write of g
                 with p_j = exp(x_j − lse): the gradient of lse − (1 − ε)·z − (ε/Vg)·Σ_j x_j + c·lse², which is
                 cross entropy against the smoothed target (1 − ε)·onehot + ε/Vg, plus the z-loss c·lse²

With a ``softcap`` κ (Gemma 2's soft-capped logits) both passes read each logit as ``x ← κ·tanh(x/κ)``, and
``logits_grad`` multiplies each gradient by that map's derivative ``1 − (x/κ)²`` (of the capped ``x``): the
same loss and gradient as capping the logits first, without a capped copy of them.

:func:`~tessel.layers.linear_cross_entropy.linear_cross_entropy` runs them on each chunk of logits, with
``lse`` merged over the tensor-parallel ranks in between. Written with PyTorch the same work takes a
log-sum-exp, a gather, and a subtract, exp, scatter, multiply and cast over the chunk, each its own pass
over ``n·V`` fp32 values, after an fp32 copy of fp16/bf16 logits. ``logits_grad`` may write over the logits
themselves (``inplace=True``, for a gradient of their dtype).
:func:`~tessel.layers.cross_entropy.vocab_parallel_cross_entropy` runs them on whole logits.

The three tiers: ``_row_stats_kernel`` / ``_logits_grad_kernel`` (Triton, one program per row, the row in
blocks of ``BLOCK`` columns), :func:`row_stats` / :func:`logits_grad` (launchers: Triton on CUDA, the
interpreter under ``TRITON_INTERPRET=1``, and PyTorch otherwise or while ``torch.compile`` traces), and
:func:`row_stats_reference` / :func:`logits_grad_reference` (plain PyTorch).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ._dispatch import Backend, backend_for, opaque_to_compile
from .attention_forward import _tanh

__all__ = ["check_softcap", "logits_grad", "logits_grad_reference", "row_stats", "row_stats_reference"]

_BLOCK = {Backend.TRITON: 2048, Backend.INTERPRETER: 64}
_WARPS = 8


@triton.jit
def _capped(x, cap, SOFTCAP: tl.constexpr):
    """``cap·tanh(x/cap)`` with SOFTCAP, ``x`` otherwise (fp32)."""
    if SOFTCAP:
        x = cap * _tanh(x / cap)
    return x


@triton.jit
def _row_stats_kernel(x_ptr, target_ptr, lse_ptr, z_ptr, sum_ptr, n_cols, stride_row, cap, SOFTCAP: tl.constexpr,
                      BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_row
    cols = tl.arange(0, BLOCK)
    m = tl.full((BLOCK,), float("-inf"), tl.float32)  # each lane's running max and sum of exp(x - max)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)  # each lane's sum of x
    for start in range(0, n_cols, BLOCK):
        inside = start + cols < n_cols
        x = tl.load(base + start + cols, mask=inside, other=0.0).to(tl.float32)
        x = tl.where(inside, _capped(x, cap, SOFTCAP), float("-inf"))
        acc += tl.where(inside, x, 0.0)
        m_new = tl.maximum(m, x)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane that has seen only -inf: exp(-inf) = 0
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = m_new
    row_max = tl.max(m, axis=0)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - row_max)), axis=0)
    tl.store(lse_ptr + row, row_max + tl.log(total))
    t = tl.load(target_ptr + row)
    z = _capped(tl.load(base + tl.maximum(t, 0)).to(tl.float32), cap, SOFTCAP)
    tl.store(z_ptr + row, tl.where(t >= 0, z, 0.0))
    tl.store(sum_ptr + row, tl.sum(acc, axis=0))


@triton.jit
def _logits_grad_kernel(x_ptr, g_ptr, lse_ptr, target_ptr, a_ptr, b_ptr, c_ptr, n_cols, stride_x, stride_g, cap,
                        SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """g = p·a − [j = t]·b − c, with a row's a, b, c as :func:`_row_factors` gives them (with SOFTCAP, of the
    capped logits, times the cap's derivative)."""
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    t = tl.load(target_ptr + row)
    a, b, c = tl.load(a_ptr + row), tl.load(b_ptr + row), tl.load(c_ptr + row)
    cols = tl.arange(0, BLOCK)
    for start in range(0, n_cols, BLOCK):
        j = start + cols
        x = _capped(tl.load(x_ptr + row * stride_x + j, mask=j < n_cols, other=0.0).to(tl.float32), cap, SOFTCAP)
        g = tl.exp(x - lse) * a - tl.where(j == t, b, 0.0) - c
        if SOFTCAP:
            g = g * (1.0 - (x / cap) * (x / cap))
        tl.store(g_ptr + row * stride_g + j, g.to(g_ptr.dtype.element_ty), mask=j < n_cols)


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _capped_reference(x: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return x if softcap is None else torch.tanh(x / softcap) * softcap


def row_stats_reference(x: torch.Tensor, target: torch.Tensor, softcap: float | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(lse, z, Σx)`` (fp32) of the rows of ``x [n, V]`` (capped with ``softcap``) for targets ``target [n]``
    (``-1``: not in these columns)."""
    x = _capped_reference(x.float(), softcap)
    lse = torch.logsumexp(x, dim=-1)
    z = x.gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1)
    return lse, torch.where(target >= 0, z, 0.0), x.sum(dim=-1)


def _row_factors(lse, scale, label_smoothing: float, vocab: int | None, z_loss: float):
    """Per row ``(a, b, c)`` of ``g = p·a − [j = t]·b − c`` (see the module docstring), each fp32 ``[n]``."""
    a = scale * (1.0 + 2.0 * z_loss * lse) if z_loss else scale
    b = scale * (1.0 - label_smoothing) if label_smoothing else scale
    c = scale * (label_smoothing / vocab) if label_smoothing else torch.zeros_like(scale)
    return a, b, c


def logits_grad_reference(
    x, lse, target, scale, dtype: torch.dtype, inplace: bool = False, *, label_smoothing: float = 0.0,
    vocab: int | None = None, z_loss: float = 0.0, softcap: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """:func:`logits_grad` in PyTorch: computed in ``x`` itself with ``inplace`` when ``x`` is fp32 (and no
    ``softcap``), otherwise in an fp32 copy."""
    derivative = None
    if softcap is not None:
        x = _capped_reference(x.float(), softcap)
        derivative = 1.0 - (x / softcap).square()
    elif not (inplace and x.dtype == torch.float32):
        x = x.float() if x.dtype != torch.float32 else x.clone()
    a, b, c = _row_factors(lse, scale, label_smoothing, vocab, z_loss)
    x.sub_(lse.unsqueeze(1)).exp_().mul_(a.unsqueeze(1)).sub_(c.unsqueeze(1))
    owned = target >= 0
    x.scatter_add_(1, target.clamp(min=0).unsqueeze(1), -(owned * b).to(x.dtype).unsqueeze(1))
    return (x if derivative is None else x.mul_(derivative)).to(dtype)


def _check(name: str, x, target) -> str:
    """The backend for ``x``, after checking the arguments every pass shares (float64 rows: the PyTorch passes,
    in fp32 as for the others)."""
    if x.dtype not in (*_KERNEL_DTYPES, torch.float64) or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{name}: x must be a float32, float16, bfloat16 or float64 [n, V] tensor with unit column "
                         f"stride, received {x.dtype} {tuple(x.shape)} strides {x.stride()}")  # fmt: skip
    if target.shape != x.shape[:1] or target.dtype != torch.int64 or target.device != x.device:
        raise ValueError(f"{name}: target must be int64 [{x.shape[0]}] on {x.device}, received {target.dtype} "
                         f"{tuple(target.shape)} on {target.device}")  # fmt: skip
    backend = backend_for(x)
    return Backend.REFERENCE if torch.compiler.is_compiling() or x.dtype not in _KERNEL_DTYPES else backend


@opaque_to_compile
def _launch_stats(x, target, lse, z, total, backend, softcap) -> None:
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _row_stats_kernel[(x.shape[0],)](x, target.contiguous(), lse, z, total, x.shape[1], x.stride(0),
                                         softcap or 1.0, SOFTCAP=softcap is not None, BLOCK=_BLOCK[backend],
                                         num_warps=_WARPS)  # fmt: skip


@opaque_to_compile
def _launch_grad(x, g, lse, target, factors, backend, softcap) -> None:
    a, b, c = (f.contiguous() for f in factors)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _logits_grad_kernel[(x.shape[0],)](x, g, lse.contiguous(), target.contiguous(), a, b, c, x.shape[1],
                                           x.stride(0), g.stride(0), softcap or 1.0, SOFTCAP=softcap is not None,
                                           BLOCK=_BLOCK[backend], num_warps=_WARPS)  # fmt: skip


def check_softcap(name: str, softcap) -> float | None:
    """``softcap``: None, or a finite number above 0 (raises TypeError/ValueError naming it); as a float."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"{name}: softcap must be None or a float, received {type(softcap).__name__}")
    if not 0.0 < softcap < float("inf"):
        raise ValueError(f"{name}: softcap must be None or a finite number above 0, received {softcap}")
    return float(softcap)


def row_stats(x: torch.Tensor, target: torch.Tensor, softcap: float | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(lse, z, Σx)``, fp32 ``[n]`` each: the natural-log log-sum-exp of each row of ``x [n, V]`` (fp32, fp16 or
    bf16, unit column stride), its logit at ``target [n]`` (int64 column, ``-1`` for none: ``z = 0``) and the sum of
    its logits; with ``softcap`` κ, of the capped logits ``κ·tanh(x/κ)``."""
    backend = _check("row_stats", x, target)
    softcap = check_softcap("row_stats", softcap)
    if backend == Backend.REFERENCE or x.shape[0] == 0 or x.shape[1] == 0:
        return row_stats_reference(x, target, softcap)
    lse, z, total = (torch.empty(x.shape[0], device=x.device, dtype=torch.float32) for _ in range(3))
    _launch_stats(x, target, lse, z, total, backend, softcap)
    return lse, z, total


def logits_grad(x: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, scale: torch.Tensor,
                dtype: torch.dtype, *, inplace: bool = False, label_smoothing: float = 0.0, vocab: int | None = None,
                z_loss: float = 0.0, softcap: float | None = None) -> torch.Tensor:  # fmt: skip
    """The gradient of each row's loss (see the module docstring; without smoothing and z-loss ``(softmax(x) −
    onehot(target))·scale``) for the rows of ``x [n, V]`` (as :func:`row_stats`), with each row's ``lse`` and
    ``scale`` (fp32 ``[n]``), in ``dtype``; with ``softcap``, with respect to the logits before the cap (``lse``
    that of the capped ones). ``label_smoothing`` needs ``vocab``, the whole vocabulary's size.
    With ``inplace`` the logits are scratch: a gradient of their dtype is written over them (and returned),
    otherwise their values afterwards are unspecified; without it ``x`` is left as it is."""
    backend = _check("logits_grad", x, target)
    softcap = check_softcap("logits_grad", softcap)
    if label_smoothing and not vocab:
        raise ValueError(f"logits_grad: label_smoothing needs vocab, the whole vocabulary's size; received {vocab}")
    if backend == Backend.REFERENCE or x.shape[0] == 0 or x.shape[1] == 0:
        return logits_grad_reference(x, lse, target, scale, dtype, inplace, label_smoothing=label_smoothing,
                                     vocab=vocab, z_loss=z_loss, softcap=softcap)  # fmt: skip
    g = x if inplace and dtype == x.dtype else torch.empty(x.shape, device=x.device, dtype=dtype)
    _launch_grad(x, g, lse, target, _row_factors(lse, scale, label_smoothing, vocab, z_loss), backend, softcap)
    return g
