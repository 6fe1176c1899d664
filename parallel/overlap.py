"""Overlapped tensor-parallel GEMMs with autograd: communication of one chunk hides behind the next chunk's GEMM.

Legend: ``t`` tensor-parallel size, ``T`` tokens (rows; sequence-major when sequence-parallel), ``K``
input features, ``N`` output features; ``_shard`` is this rank's 1/t of the tokens, ``_local`` this
rank's 1/t of a weight. Weights use ``nn.Linear``'s layout ``[N, K]``. Schedules: :mod:`.rings`.

=======================  ==================================  =======================================
op                       forward                             backward (dgrad ∥ wgrad)
=======================  ==================================  =======================================
all_gather_matmul        Y_i = AG(X_shard)·W_iᵀ (+b_i)       dX_shard = RS(Σ_i dY_i·W_i) (ring);
                         (column, sequence-parallel)         dW_i = dY_iᵀ·X per ring step
matmul_reduce_scatter    Y_shard = RS(X·W_localᵀ) (+b)       dX = AG(dY_shard)·W (ring);
                         (row, sequence-parallel)            dW = dYᵀ·X per ring step, db = Σ dY
matmul_all_reduce        Y = AR(X·W_localᵀ) (+b)             dX = dY·W (no communication),
                         (row)                               dW = dYᵀ·X, db = Σ dY
matmul_grad_all_reduce   Y_i = X·W_iᵀ (+b_i)                 dX = AR(Σ_i dY_i·W_i) (chunked);
                         (column)                            dW_i = dYᵀ·X while the chunks travel
=======================  ==================================  =======================================

Several weights sharing one input (fused Q/K/V, gate/up) share one ring. ``overlap=False`` takes the
plain path: one collective, then one GEMM (or the reverse). Biases that must be added once after a
reduction are added in the epilogue of exactly one GEMM, so no extra pass touches the output.

Under ``torch.compile`` with overlap on several ranks each op is its custom operator (:mod:`.overlap_ops`), one
graph node forward and one backward whose implementation runs the same ring, so a compiled tensor-parallel model
keeps its overlap. Without overlap it is its plain composition: a differentiable collective (:mod:`.collectives`,
traced as torch's functional collectives, which the compiler schedules) and matmul's graph operator. A
zero-bubble schedule's deferred weight gradients are an eager feature: a compiled backward returns them at once.
The bodies of both flavours are :mod:`.overlap_steps`.
"""

from __future__ import annotations

import torch

from ..kernels.matmul import matmul
from . import overlap_ops
from .collectives import copy_to_tp, gather_from_sequence, reduce_from_tp, reduce_scatter_to_sequence
from .comm import group_size
from .overlap_steps import (
    ALL_REDUCE_CHUNKS,
    all_gather_matmul_backward,
    all_gather_matmul_forward,
    bias_grad,
    defer_weight_grads,
    matmul_all_reduce_forward,
    matmul_grad_all_reduce_backward,
    matmul_reduce_scatter_backward,
    matmul_reduce_scatter_forward,
)

__all__ = [
    "ALL_REDUCE_CHUNKS",
    "all_gather_matmul",
    "matmul_all_reduce",
    "matmul_grad_all_reduce",
    "matmul_reduce_scatter",
]


def check_operands(op: str, x_name: str, x, weights, biases) -> None:
    """ValueError/TypeError naming the argument, before any communication starts."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {x_name} must be a torch.Tensor, received {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{op}: {x_name} must be a 2-D [tokens, features] matrix, received shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):  # the ring steps run matmul unchecked
        raise TypeError(f"{op}: {x_name} must be float32, float16 or bfloat16, received {x.dtype}")
    if biases is not None and len(biases) != len(weights):
        raise ValueError(f"{op}: expected one bias (or None) per weight, received {len(biases)} for {len(weights)}")
    for i, w in enumerate(weights):
        name = "weight" if len(weights) == 1 else f"weights[{i}]"
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, received {type(w).__name__}")
        if w.dim() != 2 or w.shape[1] != x.shape[1]:
            raise ValueError(
                f"{op}: {name} must be [out_features, {x.shape[1]}] (nn.Linear layout, matching {x_name}'s "
                f"{x.shape[1]} features), received shape {tuple(w.shape)}"
            )
        if w.dtype != x.dtype or w.device != x.device:
            raise ValueError(
                f"{op}: {name} must share {x_name}'s dtype and device ({x.dtype}, {x.device}), "
                f"received {w.dtype} on {w.device}"
            )
        b = biases[i] if biases is not None else None
        if b is not None and (not isinstance(b, torch.Tensor) or tuple(b.shape) != (w.shape[0],)):
            got = tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
            raise ValueError(f"{op}: the bias of {name} must have shape ({w.shape[0]},), received {got}")
        if b is not None and (b.dtype != x.dtype or b.device != x.device):
            raise ValueError(
                f"{op}: the bias of {name} must share {x_name}'s dtype and device ({x.dtype}, {x.device}), "
                f"received {b.dtype} on {b.device}"
            )


def _check_overlap(op: str, overlap) -> None:
    if overlap not in (True, False, "peer"):
        raise ValueError(f"{op}: overlap must be True, False or 'peer', received {overlap!r}")


def _overlap_arg(overlap, group) -> bool | str:
    """What the eager op runs: ``"peer"`` on more than one rank, else whether to chunk."""
    return "peer" if overlap == "peer" and group_size(group) > 1 else bool(overlap)


def _ring_in_graph(overlap, group) -> bool:
    """Under compile: whether the op enters the graph as its custom operator (:mod:`.overlap_ops`), whose node runs
    the ring, rather than as its plain composition."""
    return bool(overlap) and group_size(group) > 1


# ---------------------------------------------------------------------------------------------------- AG + GEMM


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, overlap, regather, n_w, x_shard, *params):
        weights, biases = params[:n_w], params[n_w:]
        ctx.regather = regather and group_size(group) > 1
        keep = not ctx.regather and any(ctx.needs_input_grad[5 : 5 + n_w])  # (the weights' gradients read X)
        outs, x_full = all_gather_matmul_forward(group, overlap, x_shard, weights, biases, keep_input=keep)
        ctx.save_for_backward(x_shard if ctx.regather else x_full, *weights)
        ctx.group, ctx.overlap, ctx.has_bias = group, overlap, [b is not None for b in biases]
        ctx.weight_params = weights
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        saved_x, *weights = ctx.saved_tensors
        grads = [g.contiguous() for g in grads]
        need_dw = ctx.needs_input_grad[5 : 5 + len(weights)]
        dx, dws = all_gather_matmul_backward(
            ctx.group, ctx.overlap, saved_x, ctx.regather, weights, grads, defer=ctx.weight_params, need_dw=need_dw
        )
        dbs = [bias_grad(g, w) if hb else None for g, w, hb in zip(grads, weights, ctx.has_bias)]
        return (None, None, None, None, dx, *dws, *dbs)


def all_gather_matmul(x_shard, weights, group=None, *, biases=None, overlap=True, regather=False):
    """``[AG(x_shard) @ W_iᵀ + b_i for each W_i]``: column-parallel GEMMs on a sequence-parallel input.

    Args:
        x_shard: ``[m, K]``, this rank's rows (rank r holds rows ``[r·m, (r+1)·m)`` of the gathered input).
        weights: a ``[N_i, K]`` weight or a list of them (fused QKV, gate/up) sharing one gather.
        biases: ``None`` or one (optional) ``[N_i]`` bias per weight.
        overlap: ``True`` for the ring, ``False`` for one all-gather then the GEMMs, ``"peer"`` for the
            device-signalled transport (:mod:`.peer`: the shards written into the peers' memory, one GEMM launch per
            weight whose tiles wait on the device for their chunk; the backward's reduce-scatter too, the weight
            gradients computed while its partials travel). ``"peer"`` keeps one buffer per input shape and group
            until :func:`~tessel.parallel.peer.release_transports`, and needs every rank of the group to make the
            same calls in the same order (as tensor parallelism does).

        regather: save only ``x_shard`` for backward and all-gather ``X`` again there (Megatron's
            sequence-parallel default; Korthikanti et al. 2022, §4.2.2): ``1/t`` of the activation
            memory for ``(t-1)/t·|X|`` more traffic, the gather in flight during the first dgrad GEMM.

    Returns a list of ``[t·m, N_i]`` outputs (a single tensor when ``weights`` is a tensor).
    Backward: ``dX_shard = RS(Σ_i dY_i·W_i)`` by the reduce-scatter ring, ``dW_i = dY_iᵀ·X`` by slices
    inside the ring steps.
    """
    single = isinstance(weights, torch.Tensor)
    weights = [weights] if single else list(weights)
    biases = [None] * len(weights) if biases is None else ([biases] if single else list(biases))
    check_operands("all_gather_matmul", "x_shard", x_shard, weights, biases)
    _check_overlap("all_gather_matmul", overlap)
    if torch.compiler.is_compiling():
        if _ring_in_graph(overlap, group):
            outs = overlap_ops.all_gather_matmul(x_shard, weights, biases, group, bool(regather))
        else:
            x_full = gather_from_sequence(x_shard, group, dim=0)
            outs = [matmul(x_full, w.t(), b) for w, b in zip(weights, biases)]
        return outs[0] if single else outs
    outs = _AllGatherMatmul.apply(
        group, _overlap_arg(overlap, group), bool(regather), len(weights), x_shard, *weights, *biases
    )  # fmt: skip
    return outs[0] if single else list(outs)


# ---------------------------------------------------------------------------------------------------- GEMM + RS


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, overlap, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.overlap, ctx.has_bias, ctx.weight_param = group, overlap, bias is not None, weight
        return matmul_reduce_scatter_forward(group, overlap, x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        dx, dw, g_full = matmul_reduce_scatter_backward(
            ctx.group, ctx.overlap, x, weight, grad_y.contiguous(), [ctx.weight_param], ctx.needs_input_grad[3]
        )
        db = bias_grad(g_full, weight) if ctx.has_bias else None  # the bias is whole: Σ over every token
        return None, None, dx, dw, db


def matmul_reduce_scatter(x, weight, group=None, *, bias=None, overlap=True):
    """``RS(x @ W_localᵀ) + bias``: a row-parallel GEMM whose output is sequence-parallel.

    ``x [t·m, K_local]`` (all tokens, this rank's input features), ``weight [N, K_local]``, ``bias [N]``
    (whole, added once). Returns this rank's rows ``[m, N]``. Backward: ``dX = AG(dY_shard)·W`` by the
    all-gather ring with ``dW = dYᵀ·X`` slices inside its steps; ``db = Σ dY`` over all tokens.
    ``overlap``: ``True`` (the ring), ``False`` (one GEMM, one reduce-scatter) or ``"peer"`` (the device-signalled
    transport: :func:`~tessel.parallel.peer.peer_matmul_reduce_scatter` forward, the output gradient's gather
    backward; see :func:`all_gather_matmul`).
    """
    check_operands("matmul_reduce_scatter", "x", x, [weight], [bias])
    _check_overlap("matmul_reduce_scatter", overlap)
    t = group_size(group)
    if x.shape[0] % t:
        raise ValueError(f"matmul_reduce_scatter: {x.shape[0]} rows of x are not divisible by the group size {t}")
    if torch.compiler.is_compiling() and _ring_in_graph(overlap, group):
        return overlap_ops.matmul_reduce_scatter(x, weight, bias, group)
    if torch.compiler.is_compiling():  # the whole bias, added once; its gradient summed over every rank's tokens
        y = reduce_scatter_to_sequence(matmul(x, weight.t()), group, dim=0)
        return y if bias is None else y + copy_to_tp(bias, group)
    return _MatmulReduceScatter.apply(group, _overlap_arg(overlap, group), x, weight, bias)


# ---------------------------------------------------------------------------------------------------- GEMM + AR


class _MatmulAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, overlap, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.weight_param = bias is not None, weight
        return matmul_all_reduce_forward(group, overlap, x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        need_dw = ctx.needs_input_grad[3]
        deferred = need_dw and defer_weight_grads([ctx.weight_param], lambda: [matmul(grad_y.t(), x)])
        dx, dw = matmul(grad_y, weight), matmul(grad_y.t(), x) if need_dw and not deferred else None
        return None, None, dx, dw, bias_grad(grad_y, weight) if ctx.has_bias else None


def matmul_all_reduce(x, weight, group=None, *, bias=None, overlap=True):
    """``AR(x @ W_localᵀ) + bias``: a row-parallel GEMM chunked along tokens, each chunk all-reduced in flight.

    ``x [T, K_local]``, ``weight [N, K_local]``, ``bias [N]`` (whole, added once). Returns ``[T, N]``,
    the same on every rank. Backward: ``dX = dY·W``, ``dW = dYᵀ·X`` (dY is replicated: no communication).
    ``overlap="peer"``: a reduce-scatter then an all-gather through the device-signalled transports
    (:func:`~tessel.parallel.peer.peer_matmul_all_reduce`), where the rows split evenly over the group.
    """
    check_operands("matmul_all_reduce", "x", x, [weight], [bias])
    _check_overlap("matmul_all_reduce", overlap)
    if torch.compiler.is_compiling() and _ring_in_graph(overlap, group):
        return overlap_ops.matmul_all_reduce(x, weight, bias, group)
    if torch.compiler.is_compiling():
        y = reduce_from_tp(matmul(x, weight.t()), group)
        return y if bias is None else y + bias
    return _MatmulAllReduce.apply(group, _overlap_arg(overlap, group), x, weight, bias)


class _MatmulGradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, overlap, n_w, x, *params):
        weights, biases = params[:n_w], params[n_w:]
        ctx.save_for_backward(x, *weights)
        ctx.group, ctx.overlap, ctx.has_bias = group, overlap, [b is not None for b in biases]
        ctx.weight_params = weights
        return tuple(matmul(x, w.t(), b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        grads = [g.contiguous() for g in grads]
        need_dw = ctx.needs_input_grad[4 : 4 + len(weights)]
        dx, dws = matmul_grad_all_reduce_backward(ctx.group, ctx.overlap, x, weights, grads, ctx.weight_params, need_dw)
        dbs = [bias_grad(g, w) if hb else None for g, w, hb in zip(grads, weights, ctx.has_bias)]
        return (None, None, None, dx, *dws, *dbs)


def matmul_grad_all_reduce(x, weights, group=None, *, biases=None, overlap=True):
    """``[x @ W_iᵀ + b_i]`` whose input gradient is all-reduced: column-parallel GEMMs on a replicated input.

    Forward has no communication (Megatron's "f" is the identity). Backward: ``dX = AR(Σ_i dY_i·W_i)``
    chunked along tokens, each chunk's all-reduce in flight during the next chunk's GEMM, and the
    weight gradients computed while the chunks travel (``overlap="peer"``: through the device-signalled transports,
    as :func:`matmul_all_reduce`).
    """
    single = isinstance(weights, torch.Tensor)
    weights = [weights] if single else list(weights)
    biases = [None] * len(weights) if biases is None else ([biases] if single else list(biases))
    check_operands("matmul_grad_all_reduce", "x", x, weights, biases)
    _check_overlap("matmul_grad_all_reduce", overlap)
    if torch.compiler.is_compiling():
        if _ring_in_graph(overlap, group):
            outs = overlap_ops.matmul_grad_all_reduce(x, weights, biases, group)
        else:
            x = copy_to_tp(x, group)
            outs = [matmul(x, w.t(), b) for w, b in zip(weights, biases)]
        return outs[0] if single else outs
    outs = _MatmulGradAllReduce.apply(group, _overlap_arg(overlap, group), len(weights), x, *weights, *biases)
    return outs[0] if single else list(outs)
