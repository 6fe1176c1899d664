"""tessel's kernels as ``torch.library`` custom operators: what :func:`~.attention.flash_attention`,
:func:`~.norm.rms_norm`, :func:`~.norm.layer_norm`, :func:`~.matmul.matmul` and
:func:`~.grouped_matmul.grouped_matmul` call while ``torch.compile`` traces them.

Dynamo does not trace into tessel's launchers (:func:`~._dispatch.opaque_to_compile`), so without these a
compiled model would break its graph at every attention and norm. As custom operators with fake
implementations (shapes, dtypes and memory layouts, computed without running anything) and a registered
backward, each forward and each backward enters the graph as one node: a model compiles whole
(``fullgraph=True``), AOTAutograd puts the backward nodes in the backward graph, and inductor fuses what
surrounds them.

``matmul(out=...)`` is ``tessel::matmul_into``, which writes into ``out`` in place, where no input needs a
gradient (with one, the call stays opaque and breaks the graph).

Eager calls never come here: the dispatcher would add its own overhead to every call for nothing.
Packed documents enter as their segment tables (``seg_q``, ``seg_k``: see :mod:`.attention_inputs`), which the
graph computes from the ids; the ids' order is then checked on the device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .attention import _backward, _empty_in_layout_of, _forward, check_grid
from .grouped_matmul import _launch as _grouped_launch
from .grouped_matmul import _launch_wgrad as _grouped_launch_wgrad
from .matmul import _activation_grad, check_out_apart
from .matmul import _launch as _matmul_launch
from .norm import _backward as _norm_backward
from .norm import _forward as _norm_forward
from .norm import _rows_input

__all__ = [
    "flash_attention_backward_op",
    "flash_attention_op",
    "grouped_matmul_backward_op",
    "grouped_matmul_op",
    "matmul_backward_op",
    "matmul_op",
    "norm_backward_op",
    "norm_op",
]

# ---------------------------------------------------------------------------------------------------- attention


@torch.library.custom_op("tessel::flash_attention", mutates_args=())
def flash_attention_op(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, num_splits: int | None, window: int | None,
    softcap: float | None, deterministic: bool, seg_q: Tensor | None = None, seg_k: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(out, lse)`` of arguments :func:`~.attention.flash_attention` has validated (``deterministic`` is
    kept for the backward; ``seg_q``, ``seg_k``: the segment tables of packed documents, or None)."""
    backend = check_grid("flash_attention", q)
    return _forward(q, k, v, causal, scale, backend, num_splits, _segments(seg_q, seg_k), window, softcap=softcap)


def _segments(seg_q: Tensor | None, seg_k: Tensor | None) -> tuple[Tensor, Tensor] | None:
    return None if seg_q is None else (seg_q, seg_k)


@flash_attention_op.register_fake
def _(q, k, v, causal, scale, num_splits, window, softcap, deterministic, seg_q=None, seg_k=None):
    b, hq, sq, _ = q.shape
    return _empty_in_layout_of(q), q.new_empty((b, hq, sq), dtype=torch.float32)


@torch.library.custom_op("tessel::flash_attention_backward", mutates_args=())
def flash_attention_backward_op(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor | None, causal: bool,
    scale: float, window: int | None, softcap: float | None, deterministic: bool, seg_q: Tensor | None = None,
    seg_k: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(dq, dk, dv)``; ``dlse`` None when nothing used the log-sum-exp."""
    backend = check_grid("flash_attention", q)
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    return _backward(
        q, k, v, out, lse, dout, dlse, causal, scale, backend, True, True, deterministic, _segments(seg_q, seg_k),
        window, softcap=softcap,
    )  # fmt: skip


@flash_attention_backward_op.register_fake
def _(q, k, v, out, lse, dout, dlse, causal, scale, window, softcap, deterministic, seg_q=None, seg_k=None):
    return _empty_in_layout_of(q), _empty_in_layout_of(k), _empty_in_layout_of(v)


def _attention_setup_context(ctx, inputs, output):
    q, k, v, causal, scale, _, window, softcap, deterministic, *tables = inputs
    ctx.save_for_backward(q, k, v, *output, *tables)
    ctx.options = (causal, scale, window, softcap, deterministic)


def _attention_backward_of_forward(ctx, dout, dlse):
    q, k, v, out, lse, *tables = ctx.saved_tensors
    if dout is None:  # only lse was used: Δ = -dlse and dO = 0
        dout = torch.zeros_like(out)
    dq, dk, dv = flash_attention_backward_op(q, k, v, out, lse, dout, dlse, *ctx.options, *tables)
    return dq, dk, dv, None, None, None, None, None, None, None, None


flash_attention_op.register_autograd(_attention_backward_of_forward, setup_context=_attention_setup_context)


# ---------------------------------------------------------------------------------------------------- norms


@torch.library.custom_op("tessel::norm", mutates_args=())
def norm_op(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, is_rms: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, mean, rstd)`` of RMSNorm (``is_rms``; mean is empty) or LayerNorm over the last dimension."""
    y, _, mean, rstd = _norm_forward(x, weight, bias, eps, is_rms)
    return y, mean, rstd


@norm_op.register_fake
def _(x, weight, bias, eps, is_rms):
    x, (outer, inner, _) = _rows_input(x)
    rows = outer * inner
    return (
        torch.empty_like(x),
        x.new_empty(0 if is_rms else rows, dtype=torch.float32),
        x.new_empty(rows, dtype=torch.float32),
    )


@torch.library.custom_op("tessel::norm_backward", mutates_args=())
def norm_backward_op(
    dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor, has_bias: bool, is_rms: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dweight, dbias)``; dbias is empty without a bias."""
    dx, dw, db = _norm_backward(dy, _rows_input(x)[0], weight, has_bias, mean, rstd, is_rms)
    return dx, dw, db if has_bias else weight.new_empty(0)


@norm_backward_op.register_fake
def _(dy, x, weight, mean, rstd, has_bias, is_rms):
    return (
        torch.empty_like(_rows_input(x)[0]),
        torch.empty_like(weight),
        weight.new_empty(weight.shape if has_bias else 0),
    )


def _norm_setup_context(ctx, inputs, output):
    x, weight, bias, _, is_rms = inputs
    ctx.save_for_backward(x, weight, *output[1:])
    ctx.has_bias, ctx.is_rms = bias is not None, is_rms


def _norm_backward_of_forward(ctx, dy, dmean, drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = norm_backward_op(dy, x, weight, mean, rstd, ctx.has_bias, ctx.is_rms)
    return dx, dw, db if ctx.has_bias else None, None, None


norm_op.register_autograd(_norm_backward_of_forward, setup_context=_norm_setup_context)


# ---------------------------------------------------------------------------------------------------- matmul


@torch.library.custom_op("tessel::matmul", mutates_args=())
def matmul_op(a: Tensor, b: Tensor, bias: Tensor | None, activation: str | None, save_preact: bool) -> tuple[
    Tensor, Tensor
]:  # fmt: skip
    """``(activation(a @ b + bias), a @ b + bias)``; the second (the backward's input to the activation's
    derivative) is empty unless ``save_preact``."""
    out = a.new_empty((a.shape[0], b.shape[1]))
    preact = torch.empty_like(out) if save_preact else out.new_empty(0)
    _matmul_launch(a, b, bias, activation, out, False, preact if save_preact else None)
    return out, preact


@matmul_op.register_fake
def _(a, b, bias, activation, save_preact):
    out = a.new_empty((a.shape[0], b.shape[1]))
    return out, torch.empty_like(out) if save_preact else out.new_empty(0)


@torch.library.custom_op("tessel::matmul_backward", mutates_args=())
def matmul_backward_op(
    grad_out: Tensor, a: Tensor, b: Tensor, preact: Tensor, activation: str | None, need_a: bool, need_b: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_a, grad_b, grad_bias)`` (grad_bias in a's dtype, summed in fp32), as :func:`~.matmul.matmul`'s
    backward computes them; grad_a (grad_b) is empty unless ``need_a`` (``need_b``): a frozen weight costs
    no GEMM."""
    if activation is None:
        grad_z = grad_out.to(a.dtype)
    else:
        grad_z = (grad_out.float() * _activation_grad(preact.float(), activation)).to(a.dtype)
    grad_a, grad_b = _matmul_grads_like(a, b, need_a, need_b)
    if need_a:  # dA = dZ · Bᵀ
        _matmul_launch(grad_z, b.t(), None, None, grad_a, False)
    if need_b:  # dB = Aᵀ · dZ
        _matmul_launch(a.t(), grad_z, None, None, grad_b, False)
    return grad_a, grad_b, grad_z.sum(dim=0, dtype=torch.float32).to(a.dtype)


def _matmul_grads_like(a, b, need_a, need_b):
    dense = dict(memory_format=torch.contiguous_format)
    return (torch.empty_like(a, **dense) if need_a else a.new_empty(0), torch.empty_like(b, **dense) if need_b
            else b.new_empty(0))  # fmt: skip


@matmul_backward_op.register_fake
def _(grad_out, a, b, preact, activation, need_a, need_b):
    return *_matmul_grads_like(a, b, need_a, need_b), a.new_empty(b.shape[1])


def _matmul_setup_context(ctx, inputs, output):
    a, b, bias, activation, _ = inputs
    ctx.save_for_backward(a, b, output[1])
    ctx.activation, ctx.has_bias = activation, bias is not None


def _matmul_backward_of_forward(ctx, grad_out, grad_preact):
    a, b, preact = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[:2]
    grad_a, grad_b, grad_bias = matmul_backward_op(grad_out, a, b, preact, ctx.activation, need_a, need_b)
    return grad_a if need_a else None, grad_b if need_b else None, grad_bias if ctx.has_bias else None, None, None


matmul_op.register_autograd(_matmul_backward_of_forward, setup_context=_matmul_setup_context)


@torch.library.custom_op("tessel::matmul_into", mutates_args=("out",))
def matmul_into_op(
    a: Tensor, b: Tensor, bias: Tensor | None, activation: str | None, out: Tensor, accumulate: bool
) -> None:
    """``out (+)= activation(a @ b + bias)`` in place: :func:`~.matmul.matmul` with ``out`` under compile, where no
    input needs a gradient (a graph cannot differentiate through a custom operator's in-place write). ``out`` may
    be a view of a larger buffer. Its memory must not overlap a's or b's, checked here, when the graph runs: the
    compiler may have turned the graph's functional write back into this one in place."""
    check_out_apart(a, b, out)
    _matmul_launch(a, b, bias, activation, out, accumulate)


@matmul_into_op.register_fake
def _(a, b, bias, activation, out, accumulate):
    return None


# ---------------------------------------------------------------------------------------------------- grouped matmul


@torch.library.custom_op("tessel::grouped_matmul", mutates_args=())
def grouped_matmul_op(a: Tensor, b: Tensor, offsets: Tensor) -> Tensor:
    """``out [R, N]``: each expert's rows of ``a`` times that expert's matrix in ``b`` (see
    :func:`~.grouped_matmul.grouped_matmul`)."""
    out = a.new_empty((a.shape[0], b.shape[2]))
    _grouped_launch(a, b, offsets, out)
    return out


@grouped_matmul_op.register_fake
def _(a, b, offsets):
    return a.new_empty((a.shape[0], b.shape[2]))


@torch.library.custom_op("tessel::grouped_matmul_backward", mutates_args=())
def grouped_matmul_backward_op(
    grad: Tensor, a: Tensor, b: Tensor, offsets: Tensor, need_a: bool, need_b: bool
) -> tuple[Tensor, Tensor]:
    """``(grad_a, grad_b)``; each empty unless needed (a frozen expert costs no GEMM)."""
    grad_a = a.new_empty(a.shape) if need_a else a.new_empty(0)
    grad_b = b.new_empty(b.shape) if need_b else b.new_empty(0)
    if need_a:
        _grouped_launch(grad, b.transpose(1, 2), offsets, grad_a)
    if need_b:
        _grouped_launch_wgrad(a, grad, offsets, grad_b)
    return grad_a, grad_b


@grouped_matmul_backward_op.register_fake
def _(grad, a, b, offsets, need_a, need_b):
    return a.new_empty(a.shape) if need_a else a.new_empty(0), b.new_empty(b.shape) if need_b else b.new_empty(0)


def _grouped_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _grouped_backward_of_forward(ctx, grad):
    a, b, offsets = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[:2]
    grad_a, grad_b = grouped_matmul_backward_op(grad.contiguous(), a, b, offsets, need_a, need_b)
    return grad_a if need_a else None, grad_b if need_b else None, None


grouped_matmul_op.register_autograd(_grouped_backward_of_forward, setup_context=_grouped_setup_context)
