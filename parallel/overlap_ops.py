"""The overlapped ops as ``torch.library`` custom operators: how a compiled model keeps their rings.

A graph cannot hold the rings' point-to-point transfers, their in-place GEMM launches or their streams; a custom
operator is one opaque node whose implementation runs the eager ring (:mod:`.overlap_steps`) when the graph
runs. So under ``torch.compile`` an overlapped op (``overlap=True``, several ranks) stays overlapped, forward
and backward: each forward is one node, its registered backward another in the backward graph, and
``fullgraph=True`` holds. The process group enters by name (``ProcessGroup.group_name``, resolved when the
node runs), as torch's functional collectives name theirs; fake implementations give the shapes from the group
size. Biases enter as the list of those present and the indices of their weights (an operator's list of
optional tensors does not carry gradients).

Not here: ``overlap=False`` (the plain composition of :mod:`.overlap` traces as functional collectives, which
the compiler schedules itself), a world of one (nothing to overlap), and the eager features that need Python
objects at backward time: a zero-bubble schedule's deferred weight gradients (a compiled backward returns
them at once).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from ..kernels.library import matmul_op
from ..kernels.matmul import matmul_unchecked
from .overlap_steps import (
    all_gather_matmul_backward,
    all_gather_matmul_forward,
    bias_grad,
    matmul_all_reduce_forward,
    matmul_grad_all_reduce_backward,
    matmul_reduce_scatter_backward,
    matmul_reduce_scatter_forward,
)

__all__ = ["all_gather_matmul", "matmul_all_reduce", "matmul_grad_all_reduce", "matmul_reduce_scatter"]

# The nodes that communicate run ring steps driven from the host (point-to-point batches, waits, side streams on
# CUDA). Their capture in a CUDA graph is unproven, so inductor's CUDA graphs ("reduce-overhead") leave them out:
# they run eagerly between the captured parts. Older torch has no such tag.
_COMMUNICATES = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def _name(group: dist.ProcessGroup | None) -> str:
    return (dist.group.WORLD if group is None else group).group_name


def _present(biases) -> tuple[list[Tensor], list[int]]:
    """The biases that are there, and the index of each one's weight."""
    index = [i for i, b in enumerate(biases) if b is not None]
    return [biases[i] for i in index], index


def _placed(biases: list[Tensor], index: list[int], n: int) -> list[Tensor | None]:
    """One bias (or None) per weight again."""
    placed = [None] * n
    for i, b in zip(index, biases):
        placed[i] = b
    return placed


def _dense_grads(grads, rows: int, weights) -> list[Tensor]:
    """The output gradients, contiguous, with zeros for an output the loss never reached."""
    return [
        g.contiguous() if g is not None else w.new_zeros((rows, w.shape[0])) for g, w in zip(grads, weights)
    ]  # fmt: skip


def _or_empty(dws, weights) -> list[Tensor]:
    """Weight gradients as an operator returns them: an empty tensor for one not computed (None)."""
    return [w.new_empty(0) if dw is None else dw for dw, w in zip(dws, weights)]


def _weight_grads_like(weights, need_dw) -> list[Tensor]:
    return [w.new_empty(w.shape) if need else w.new_empty(0) for w, need in zip(weights, need_dw)]


def _or_none(dws, need_dw) -> list[Tensor | None]:
    """The weight gradients for autograd: None for each weight that needs none."""
    return [dw if need else None for dw, need in zip(dws, need_dw)]


def _bias_grads(grads, weights, index) -> tuple[list[Tensor], list | None]:
    """The gradients of the biases present, and the "gradient" of ``index``: an operator's backward returns the
    structure of its inputs, where a list that holds a non-tensor is one leaf (None) and an empty list a list."""
    return [bias_grad(grads[i], weights[i]) for i in index], None if index else []


# ---------------------------------------------------------------------------------------------------- AG + GEMM


@torch.library.custom_op("tessel::all_gather_matmul", mutates_args=(), tags=_COMMUNICATES)
def all_gather_matmul_op(
    x_shard: Tensor, weights: list[Tensor], biases: list[Tensor], bias_index: list[int], group_name: str,
    group_size: int, keep_input: bool,
) -> list[Tensor]:  # fmt: skip
    """``[AG(x_shard)·W_iᵀ + b_i ...]`` by the all-gather ring, then the gathered input when ``keep_input``."""
    with torch.no_grad():
        outs, x_full = all_gather_matmul_forward(
            _resolve_process_group(group_name), True, x_shard, weights, _placed(biases, bias_index, len(weights))
        )
    return [*outs, x_full] if keep_input else outs


@all_gather_matmul_op.register_fake
def _(x_shard, weights, biases, bias_index, group_name, group_size, keep_input):
    rows = group_size * x_shard.shape[0]
    outs = [x_shard.new_empty((rows, w.shape[0])) for w in weights]
    return [*outs, x_shard.new_empty((rows, x_shard.shape[1]))] if keep_input else outs


@torch.library.custom_op("tessel::all_gather_matmul_backward", mutates_args=(), tags=_COMMUNICATES)
def all_gather_matmul_backward_op(
    grads: list[Tensor], saved_x: Tensor, weights: list[Tensor], group_name: str, group_size: int, regather: bool,
    need_dw: list[bool],
) -> list[Tensor]:  # fmt: skip
    """``[dx_shard, dW_0, ...]`` by the reduce-scatter ring, the weight gradients inside its steps (empty for a
    weight whose gradient is not needed)."""
    with torch.no_grad():
        group = _resolve_process_group(group_name)
        dx, dws = all_gather_matmul_backward(group, True, saved_x, regather, weights, grads, need_dw=need_dw)
    return [dx, *_or_empty(dws, weights)]


@all_gather_matmul_backward_op.register_fake
def _(grads, saved_x, weights, group_name, group_size, regather, need_dw):
    m = saved_x.shape[0] if regather else saved_x.shape[0] // group_size
    return [saved_x.new_empty((m, saved_x.shape[1])), *_weight_grads_like(weights, need_dw)]


def _all_gather_matmul_setup(ctx, inputs, output):
    x_shard, weights, _, bias_index, group_name, group_size, keep_input = inputs
    ctx.regather = not keep_input
    ctx.save_for_backward(x_shard if ctx.regather else output[-1], *weights)
    ctx.bias_index, ctx.group_name, ctx.group_size = bias_index, group_name, group_size


def _all_gather_matmul_grad(ctx, grads):
    saved_x, *weights = ctx.saved_tensors
    rows = saved_x.shape[0] * (ctx.group_size if ctx.regather else 1)
    grads = _dense_grads(grads[: len(weights)], rows, weights)
    need_dw = ctx.needs_input_grad[1]
    dx, *dws = all_gather_matmul_backward_op(
        grads, saved_x, weights, ctx.group_name, ctx.group_size, ctx.regather, need_dw
    )
    return dx, _or_none(dws, need_dw), *_bias_grads(grads, weights, ctx.bias_index), None, None, None


all_gather_matmul_op.register_autograd(_all_gather_matmul_grad, setup_context=_all_gather_matmul_setup)


def all_gather_matmul(x_shard, weights, biases, group, regather: bool) -> list[Tensor]:
    """What :func:`~.overlap.all_gather_matmul` computes under compile with ``overlap=True`` on several ranks."""
    present, index = _present(biases)
    t = dist.get_world_size(group)
    outs = all_gather_matmul_op(x_shard, weights, present, index, _name(group), t, not regather)
    return outs[: len(weights)]


# ---------------------------------------------------------------------------------------------------- GEMM + RS


@torch.library.custom_op("tessel::matmul_reduce_scatter", mutates_args=(), tags=_COMMUNICATES)
def matmul_reduce_scatter_op(
    x: Tensor, weight: Tensor, bias: Tensor | None, group_name: str, group_size: int
) -> Tensor:
    """``RS(x·Wᵀ) + bias`` by the reduce-scatter ring."""
    with torch.no_grad():
        return matmul_reduce_scatter_forward(_resolve_process_group(group_name), True, x, weight, bias)


@matmul_reduce_scatter_op.register_fake
def _(x, weight, bias, group_name, group_size):
    return x.new_empty((x.shape[0] // group_size, weight.shape[0]))


@torch.library.custom_op("tessel::matmul_reduce_scatter_backward", mutates_args=(), tags=_COMMUNICATES)
def matmul_reduce_scatter_backward_op(
    grad_y: Tensor, x: Tensor, weight: Tensor, group_name: str, has_bias: bool, need_dw: bool
) -> list[Tensor]:
    """``[dx, dW]`` (dW empty unless ``need_dw``; and ``db``, Σ of the gathered gradient, with ``has_bias``) by the
    all-gather ring."""
    with torch.no_grad():
        group = _resolve_process_group(group_name)
        dx, dw, g_full = matmul_reduce_scatter_backward(group, True, x, weight, grad_y, need_dw=need_dw)
        grads = [dx, *_or_empty([dw], [weight])]
        return [*grads, bias_grad(g_full, weight)] if has_bias else grads


@matmul_reduce_scatter_backward_op.register_fake
def _(grad_y, x, weight, group_name, has_bias, need_dw):
    grads = [torch.empty_like(x), *_weight_grads_like([weight], [need_dw])]
    return [*grads, weight.new_empty(weight.shape[0])] if has_bias else grads


def _matmul_reduce_scatter_setup(ctx, inputs, output):
    x, weight, bias, group_name, _ = inputs
    ctx.save_for_backward(x, weight)
    ctx.group_name, ctx.has_bias = group_name, bias is not None


def _matmul_reduce_scatter_grad(ctx, grad_y):
    x, weight = ctx.saved_tensors
    need_dw = ctx.needs_input_grad[1]
    dx, dw, *db = matmul_reduce_scatter_backward_op(
        grad_y.contiguous(), x, weight, ctx.group_name, ctx.has_bias, need_dw
    )
    return dx, dw if need_dw else None, db[0] if ctx.has_bias else None, None, None


matmul_reduce_scatter_op.register_autograd(_matmul_reduce_scatter_grad, setup_context=_matmul_reduce_scatter_setup)


def matmul_reduce_scatter(x, weight, bias, group) -> Tensor:
    """What :func:`~.overlap.matmul_reduce_scatter` computes under compile with ``overlap=True``."""
    return matmul_reduce_scatter_op(x, weight, bias, _name(group), dist.get_world_size(group))


# ---------------------------------------------------------------------------------------------------- GEMM + AR


@torch.library.custom_op("tessel::matmul_all_reduce", mutates_args=(), tags=_COMMUNICATES)
def matmul_all_reduce_op(x: Tensor, weight: Tensor, bias: Tensor | None, group_name: str) -> Tensor:
    """``AR(x·Wᵀ) + bias``, chunked along tokens, each chunk all-reduced during the next chunk's GEMM."""
    with torch.no_grad():
        return matmul_all_reduce_forward(_resolve_process_group(group_name), True, x, weight, bias)


@matmul_all_reduce_op.register_fake
def _(x, weight, bias, group_name):
    return x.new_empty((x.shape[0], weight.shape[0]))


def _matmul_all_reduce_setup(ctx, inputs, output):
    x, weight, bias, _ = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _matmul_all_reduce_grad(ctx, grad_y):
    """No communication (dY is the same on every rank): matmul's graph operators."""
    x, weight = ctx.saved_tensors
    dx = matmul_op(grad_y, weight, None, None, False)[0] if ctx.needs_input_grad[0] else None
    dw = matmul_op(grad_y.t(), x, None, None, False)[0] if ctx.needs_input_grad[1] else None
    return dx, dw, bias_grad(grad_y, weight) if ctx.has_bias else None, None


matmul_all_reduce_op.register_autograd(_matmul_all_reduce_grad, setup_context=_matmul_all_reduce_setup)


def matmul_all_reduce(x, weight, bias, group) -> Tensor:
    """What :func:`~.overlap.matmul_all_reduce` computes under compile with ``overlap=True``."""
    return matmul_all_reduce_op(x, weight, bias, _name(group))


# ---------------------------------------------------------------------------------------------------- GEMM, AR of dX


@torch.library.custom_op("tessel::matmul_grad_all_reduce", mutates_args=())
def matmul_grad_all_reduce_op(
    x: Tensor, weights: list[Tensor], biases: list[Tensor], bias_index: list[int], group_name: str
) -> list[Tensor]:
    """``[x·W_iᵀ + b_i ...]``: no communication forward; the node exists for its backward's chunked ring."""
    outs = [x.new_empty((x.shape[0], w.shape[0])) for w in weights]
    for w, b, y in zip(weights, _placed(biases, bias_index, len(weights)), outs):
        matmul_unchecked(x, w.t(), b, out=y)
    return outs


@matmul_grad_all_reduce_op.register_fake
def _(x, weights, biases, bias_index, group_name):
    return [x.new_empty((x.shape[0], w.shape[0])) for w in weights]


@torch.library.custom_op("tessel::matmul_grad_all_reduce_backward", mutates_args=(), tags=_COMMUNICATES)
def matmul_grad_all_reduce_backward_op(
    grads: list[Tensor], x: Tensor, weights: list[Tensor], group_name: str, need_dw: list[bool]
) -> list[Tensor]:
    """``[dx, dW_0, ...]``: dX all-reduced in chunks, the weight gradients (empty where not needed) computed while
    they travel."""
    with torch.no_grad():
        group = _resolve_process_group(group_name)
        dx, dws = matmul_grad_all_reduce_backward(group, True, x, weights, grads, need_dw=need_dw)
    return [dx, *_or_empty(dws, weights)]


@matmul_grad_all_reduce_backward_op.register_fake
def _(grads, x, weights, group_name, need_dw):
    return [x.new_empty(x.shape), *_weight_grads_like(weights, need_dw)]


def _matmul_grad_all_reduce_setup(ctx, inputs, output):
    x, weights, _, bias_index, group_name = inputs
    ctx.save_for_backward(x, *weights)
    ctx.bias_index, ctx.group_name = bias_index, group_name


def _matmul_grad_all_reduce_grad(ctx, grads):
    x, *weights = ctx.saved_tensors
    grads = _dense_grads(grads, x.shape[0], weights)
    need_dw = ctx.needs_input_grad[1]
    dx, *dws = matmul_grad_all_reduce_backward_op(grads, x, weights, ctx.group_name, need_dw)
    return dx, _or_none(dws, need_dw), *_bias_grads(grads, weights, ctx.bias_index), None


matmul_grad_all_reduce_op.register_autograd(_matmul_grad_all_reduce_grad, setup_context=_matmul_grad_all_reduce_setup)


def matmul_grad_all_reduce(x, weights, biases, group) -> list[Tensor]:
    """What :func:`~.overlap.matmul_grad_all_reduce` computes under compile with ``overlap=True``."""
    present, index = _present(biases)
    return matmul_grad_all_reduce_op(x, weights, present, index, _name(group))
