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

Under ``torch.compile`` each op is the plain composition of a differentiable collective
(:mod:`.collectives`, traced as torch's functional collectives) and matmul's graph operator, so a compiled
tensor-parallel model keeps one graph: the rings' point-to-point transfers have no traced form, and the
compiler schedules the collectives itself. ``regather`` and a zero-bubble schedule's deferred weight
gradients are eager features: under compile X is saved whole and the weight gradients are computed at once.
"""

from __future__ import annotations

import torch

from ..kernels.matmul import matmul, matmul_unchecked
from .collectives import copy_to_tp, gather_from_sequence, reduce_from_tp, reduce_scatter_to_sequence
from .comm import all_gather, all_reduce, group_rank, group_size, record_event, reduce_scatter
from .ddp import OWNER_ATTR
from .pipeline.weight_grad import is_deferring, submit
from .rings import chunked_all_reduce, ring_all_gather, ring_reduce_scatter

__all__ = ["all_gather_matmul", "matmul_all_reduce", "matmul_grad_all_reduce", "matmul_reduce_scatter"]

ALL_REDUCE_CHUNKS = 4


def _grad_buffer(w: torch.Tensor) -> torch.Tensor:
    """Weight gradients summed over ring steps accumulate in fp32, rounded once at the end."""
    return torch.zeros(w.shape, dtype=torch.float32, device=w.device)


def _sum_dgrad(grads, weights, rows: slice, out: torch.Tensor, accumulate: bool) -> None:
    """out (+)= Σ_i grads_i[rows] · W_i  — the input gradient of several weights sharing one input.

    Under torch.compile the products are matmul's graph operators, summed after their rounding to out's dtype
    (eagerly each is added in fp32 in the GEMM's epilogue): a graph cannot hold the in-place launches."""
    if torch.compiler.is_compiling():
        total = sum(matmul(g[rows], w) for g, w in zip(grads, weights))
        out.add_(total) if accumulate else out.copy_(total)
        return
    for i, (g, w) in enumerate(zip(grads, weights)):
        matmul_unchecked(g[rows], w, out=out, accumulate=accumulate or i > 0)


def _defer(params, compute) -> bool:
    """Under a zero-bubble schedule's backward-input pass, postpone the weight-gradient GEMMs.

    ``compute()`` returns one gradient per parameter of ``params``; it is submitted to the active
    :class:`~tessel.parallel.pipeline.weight_grad.WeightGradStore` and, when the schedule's ``W``
    action runs it, accumulated into ``.grad`` (autograd does not: the Function returns ``None`` for
    those parameters). Returns whether it deferred. Parameters managed by a data-parallel wrapper are
    never deferred: their gradients must reach the wrapper's reduction hooks inside the backward that
    produced them.
    """
    if not is_deferring() or any(getattr(p, OWNER_ATTR, None) is not None for p in params):
        return False

    @torch.no_grad()
    def accumulate():
        for p, g in zip(params, compute()):
            g = g.to(p.dtype)
            if p.grad is None:
                p.grad = g
            else:
                p.grad += g

    submit(accumulate)
    return True


def _check_operands(op: str, x_name: str, x, weights, biases) -> None:
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


def _bias_grad(g: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Σ over tokens in fp32, in the parameters' dtype."""
    return g.sum(0, dtype=torch.float32).to(like.dtype)


# ---------------------------------------------------------------------------------------------------- AG + GEMM


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, overlap, regather, n_w, x_shard, *params):
        weights, biases = params[:n_w], params[n_w:]
        t, m = group_size(group), x_shard.shape[0]
        outs = [x_shard.new_empty((t * m, w.shape[0])) for w in weights]

        def gemm(c, rows):
            for w, b, y in zip(weights, biases, outs):
                matmul_unchecked(rows, w.t(), b, out=y[c * m : (c + 1) * m])

        if overlap:
            x_full = ring_all_gather(x_shard.contiguous(), group, "all_gather_matmul", gemm)
        else:
            x_full, _ = all_gather(x_shard, group)
            for w, b, y in zip(weights, biases, outs):
                matmul(x_full, w.t(), b, out=y)
        ctx.regather = regather and t > 1
        ctx.save_for_backward(x_shard if ctx.regather else x_full, *weights)
        ctx.group, ctx.overlap, ctx.m, ctx.has_bias = group, overlap, m, [b is not None for b in biases]
        ctx.weight_params = weights
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        saved_x, *weights = ctx.saved_tensors
        group, m = ctx.group, ctx.m
        grads = [g.contiguous() for g in grads]
        if ctx.regather:  # gather X again, in flight during the first dgrad GEMM; waited for at its first use
            x_full, work = all_gather(saved_x, group, async_op=True)
            record_event("send", "all_gather_matmul.backward.regather", -1)
            pending = [work]

            def gathered():
                if pending:
                    pending.pop().wait()
                    record_event("wait", "all_gather_matmul.backward.regather", -1)
                return x_full
        else:
            x_full, gathered = saved_x, lambda: saved_x
        deferred = _defer(ctx.weight_params, lambda: [matmul(g.t(), gathered()) for g in grads])
        if deferred:
            dx_full = torch.empty_like(x_full)
            _sum_dgrad(grads, weights, slice(None), dx_full, False)
            dx, _ = reduce_scatter(dx_full, group)
            dws = [None] * len(weights)
        elif ctx.overlap:
            dws = [_grad_buffer(w) for w in weights]

            def gemm(c, lo, hi, out, accumulate, last):
                _sum_dgrad(grads, weights, slice(c * m + lo, c * m + hi), out, accumulate)

            def wgrad(c, lo, hi):  # dW_i += dY_i[rows]ᵀ · X[rows] while those rows' accumulator travels
                record_event("wgrad", "all_gather_matmul.backward", c)
                rows = slice(c * m + lo, c * m + hi)
                for g, dw in zip(grads, dws):
                    matmul_unchecked(g[rows].t(), gathered()[rows], out=dw, accumulate=True)

            dx = ring_reduce_scatter(m, x_full.shape[1], x_full, group, "all_gather_matmul.backward", gemm, wgrad)
            dws = [dw.to(w.dtype) for dw, w in zip(dws, weights)]
        else:
            dx_full = torch.empty_like(x_full)
            _sum_dgrad(grads, weights, slice(None), dx_full, False)
            dx, _ = reduce_scatter(dx_full, group)
            dws = [matmul(g.t(), gathered()) for g in grads]
        dbs = [_bias_grad(g, w) if hb else None for g, w, hb in zip(grads, weights, ctx.has_bias)]
        return (None, None, None, None, dx, *dws, *dbs)


def all_gather_matmul(x_shard, weights, group=None, *, biases=None, overlap=True, regather=False):
    """``[AG(x_shard) @ W_iᵀ + b_i for each W_i]``: column-parallel GEMMs on a sequence-parallel input.

    Args:
        x_shard: ``[m, K]``, this rank's rows (rank r holds rows ``[r·m, (r+1)·m)`` of the gathered input).
        weights: a ``[N_i, K]`` weight or a list of them (fused QKV, gate/up) sharing one gather.
        biases: ``None`` or one (optional) ``[N_i]`` bias per weight.
        overlap: ``True`` for the ring, ``False`` for one all-gather then the GEMMs.

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
    _check_operands("all_gather_matmul", "x_shard", x_shard, weights, biases)
    if torch.compiler.is_compiling():
        x_full = gather_from_sequence(x_shard, group, dim=0)
        outs = [matmul(x_full, w.t(), b) for w, b in zip(weights, biases)]
        return outs[0] if single else outs
    outs = _AllGatherMatmul.apply(group, bool(overlap), bool(regather), len(weights), x_shard, *weights, *biases)
    return outs[0] if single else list(outs)


# ---------------------------------------------------------------------------------------------------- GEMM + RS


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, overlap, x, weight, bias):
        t, r = group_size(group), group_rank(group)
        m, n = x.shape[0] // t, weight.shape[0]
        if overlap:

            def gemm(c, lo, hi, out, accumulate, last):
                rows = x[c * m + lo : c * m + hi]
                matmul_unchecked(rows, weight.t(), bias if last else None, out=out, accumulate=accumulate)

            y = ring_reduce_scatter(m, n, x, group, "matmul_reduce_scatter", gemm)
        else:
            y, _ = reduce_scatter(matmul(x, weight.t(), bias if r == 0 else None), group)
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.overlap, ctx.has_bias, ctx.weight_param = group, overlap, bias is not None, weight
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        group, grad_y = ctx.group, grad_y.contiguous()
        m = grad_y.shape[0]
        if is_deferring():
            g_full, _ = all_gather(grad_y, group)
            dx, dw = matmul(g_full, weight), None
            _defer([ctx.weight_param], lambda: [matmul(g_full.t(), x)])
        elif ctx.overlap:
            dx = torch.empty_like(x)
            dw = _grad_buffer(weight)

            def gemm(c, rows_g):
                rows = slice(c * m, (c + 1) * m)
                matmul_unchecked(rows_g, weight, out=dx[rows])
                record_event("wgrad", "matmul_reduce_scatter.backward", c)
                matmul_unchecked(rows_g.t(), x[rows], out=dw, accumulate=True)

            g_full = ring_all_gather(grad_y, group, "matmul_reduce_scatter.backward", gemm)
            dw = dw.to(weight.dtype)
        else:
            g_full, _ = all_gather(grad_y, group)
            dx, dw = matmul(g_full, weight), matmul(g_full.t(), x)
        db = _bias_grad(g_full, weight) if ctx.has_bias else None  # the bias is whole: Σ over every token
        return None, None, dx, dw, db


def matmul_reduce_scatter(x, weight, group=None, *, bias=None, overlap=True):
    """``RS(x @ W_localᵀ) + bias``: a row-parallel GEMM whose output is sequence-parallel.

    ``x [t·m, K_local]`` (all tokens, this rank's input features), ``weight [N, K_local]``, ``bias [N]``
    (whole, added once). Returns this rank's rows ``[m, N]``. Backward: ``dX = AG(dY_shard)·W`` by the
    all-gather ring with ``dW = dYᵀ·X`` slices inside its steps; ``db = Σ dY`` over all tokens.
    """
    _check_operands("matmul_reduce_scatter", "x", x, [weight], [bias])
    t = group_size(group)
    if x.shape[0] % t:
        raise ValueError(f"matmul_reduce_scatter: {x.shape[0]} rows of x are not divisible by the group size {t}")
    if torch.compiler.is_compiling():  # the whole bias, added once; its gradient summed over every rank's tokens
        y = reduce_scatter_to_sequence(matmul(x, weight.t()), group, dim=0)
        return y if bias is None else y + copy_to_tp(bias, group)
    return _MatmulReduceScatter.apply(group, bool(overlap), x, weight, bias)


# ---------------------------------------------------------------------------------------------------- GEMM + AR


class _MatmulAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, overlap, x, weight, bias):
        once = bias if group_rank(group) == 0 else None  # the bias is summed t times otherwise
        if overlap:
            y = chunked_all_reduce(
                x.shape[0], weight.shape[0], x, group, "matmul_all_reduce", ALL_REDUCE_CHUNKS,
                lambda lo, hi, out: matmul_unchecked(x[lo:hi], weight.t(), once, out=out),
            )  # fmt: skip
        else:
            y, _ = all_reduce(matmul(x, weight.t(), once), group)
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.weight_param = bias is not None, weight
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        deferred = _defer([ctx.weight_param], lambda: [matmul(grad_y.t(), x)])
        dx, dw = matmul(grad_y, weight), None if deferred else matmul(grad_y.t(), x)
        return None, None, dx, dw, _bias_grad(grad_y, weight) if ctx.has_bias else None


def matmul_all_reduce(x, weight, group=None, *, bias=None, overlap=True):
    """``AR(x @ W_localᵀ) + bias``: a row-parallel GEMM chunked along tokens, each chunk all-reduced in flight.

    ``x [T, K_local]``, ``weight [N, K_local]``, ``bias [N]`` (whole, added once). Returns ``[T, N]``,
    the same on every rank. Backward: ``dX = dY·W``, ``dW = dYᵀ·X`` (dY is replicated: no communication).
    """
    _check_operands("matmul_all_reduce", "x", x, [weight], [bias])
    if torch.compiler.is_compiling():
        y = reduce_from_tp(matmul(x, weight.t()), group)
        return y if bias is None else y + bias
    return _MatmulAllReduce.apply(group, bool(overlap), x, weight, bias)


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
        dws = []
        if _defer(ctx.weight_params, lambda: [matmul(g.t(), x) for g in grads]):
            dws = [None] * len(weights)
            compute_wgrad = lambda: None
        else:
            compute_wgrad = lambda: dws.extend(matmul(g.t(), x) for g in grads)
        if ctx.overlap:
            dx = chunked_all_reduce(
                x.shape[0], x.shape[1], x, ctx.group, "matmul_grad_all_reduce.backward", ALL_REDUCE_CHUNKS,
                lambda lo, hi, out: _sum_dgrad(grads, weights, slice(lo, hi), out, False),
                after_issue=lambda: (record_event("wgrad", "matmul_grad_all_reduce.backward", 0), compute_wgrad()),
            )  # fmt: skip
        else:
            dx = torch.empty_like(x)
            _sum_dgrad(grads, weights, slice(None), dx, False)
            all_reduce(dx, ctx.group)
            compute_wgrad()
        dbs = [_bias_grad(g, w) if hb else None for g, w, hb in zip(grads, weights, ctx.has_bias)]
        return (None, None, None, dx, *dws, *dbs)


def matmul_grad_all_reduce(x, weights, group=None, *, biases=None, overlap=True):
    """``[x @ W_iᵀ + b_i]`` whose input gradient is all-reduced: column-parallel GEMMs on a replicated input.

    Forward has no communication (Megatron's "f" is the identity). Backward: ``dX = AR(Σ_i dY_i·W_i)``
    chunked along tokens, each chunk's all-reduce in flight during the next chunk's GEMM, and the
    weight gradients computed while the chunks travel.
    """
    single = isinstance(weights, torch.Tensor)
    weights = [weights] if single else list(weights)
    biases = [None] * len(weights) if biases is None else ([biases] if single else list(biases))
    _check_operands("matmul_grad_all_reduce", "x", x, weights, biases)
    if torch.compiler.is_compiling():
        x = copy_to_tp(x, group)
        outs = [matmul(x, w.t(), b) for w, b in zip(weights, biases)]
        return outs[0] if single else outs
    outs = _MatmulGradAllReduce.apply(group, bool(overlap), len(weights), x, *weights, *biases)
    return outs[0] if single else list(outs)
