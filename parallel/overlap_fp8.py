"""The tensor-parallel GEMMs in fp8: :mod:`.overlap`'s chunked schedules with every step an fp8 GEMM.

Each op quantises what it multiplies once (x and W in e4m3, dY in e5m2, per-tensor power-of-two scales:
:mod:`tessel.kernels.fp8`, the recipe of :func:`tessel.layers.fp8_linear`) and runs the same ring or chunks as its
higher-precision twin (:mod:`.rings`), forward and backward, with ``overlap=False`` the plain path (one
collective, one GEMM). Legend as in :mod:`.overlap`.

=========================  ====================================  ==========================================
op (layer)                 forward                               backward (dgrad ∥ wgrad)
=========================  ====================================  ==========================================
fp8_all_gather_matmul      Y = AG(X_shard)·Wᵀ + b, X's shards    dX_shard = RS(dY·W) (ring);
(column, sequence-par.)    travel in fp8                         dW = dYᵀ·X per ring step
fp8_matmul_reduce_scatter  Y_shard = RS(X·Wᵀ) + b                dX = AG(dY_shard)·W, dY's shards travel
(row, sequence-par.)                                             in fp8 (ring); dW = dYᵀ·X per ring step
fp8_matmul_all_reduce      Y = AR(X·Wᵀ) + b, chunked             dX = dY·W, dW = dYᵀ·X (no communication)
(row)
fp8_matmul_grad_all_reduce Y = X·Wᵀ + b                          dX = AR(dY·W) chunked, dW while the chunks
(column)                                                         travel
=========================  ====================================  ==========================================

A tensor gathered in fp8 is one fp8 tensor: its shards share one scale, from the largest magnitude over the group
(one all-reduce of a single number before the gather), so each rank quantises its shard exactly as the gathered
tensor would be quantised whole, and an op's result equals the same GEMMs on the gathered tensor up to the order
in which partial sums are added. The gathers move a byte per element, half of bf16's. The bytes travel as uint8
(gloo has no fp8 type). Eager only: under ``torch.compile`` the layers take their plain composition.

``overlap="peer"``: the device-signalled transports of :mod:`.peer` instead of the rings, as for the ops of
:mod:`.overlap`: the fp8 shards written into the peers' memory around one gated fp8 GEMM launch, the partials of
a reduce-scatter stored into their owners' memory by the fp8 GEMM's epilogue, the all-reduces as a reduce-scatter
then an all-gather where the rows split evenly over the group (the chunked all-reduce otherwise); the weight
gradients computed while the input gradient's partials travel.
"""

from __future__ import annotations

import torch

from ..kernels.fp8 import Fp8Tensor, absmax, fp8_matmul_unchecked, quantize_fp8
from .comm import all_gather, all_reduce, all_reduce_max, group_rank, group_size, record_event, reduce_scatter
from .overlap import _check_overlap, _overlap_arg, check_operands
from .overlap_steps import ALL_REDUCE_CHUNKS, _peer_rows, defer_weight_grads
from .peer import (
    peer_all_gather_matmul,
    peer_matmul_all_reduce,
    peer_matmul_reduce_scatter,
    reduce_transport_for,
    transport_for,
)
from .pipeline.weight_grad import is_deferring
from .rings import chunked_all_reduce, ring_all_gather, ring_reduce_scatter

__all__ = ["fp8_all_gather_matmul", "fp8_matmul_all_reduce", "fp8_matmul_grad_all_reduce", "fp8_matmul_reduce_scatter"]


def _quantize_shard(x: torch.Tensor, fmt: str, group) -> Fp8Tensor:
    """This rank's shard quantised with the scale of the whole: from the largest magnitude over the group."""
    return quantize_fp8(x, fmt, amax=all_reduce_max(absmax(x), group))


def _gather(q: Fp8Tensor, group, op: str | None = None, gemm=None) -> torch.Tensor:
    """The shards' fp8 data gathered ``[t·m, K]``: by the ring, ``gemm(c, rows)`` on each shard while the next one
    travels (``op`` names the ring's events), or at once without ``gemm``."""
    dtype, data = q.data.dtype, q.data.view(torch.uint8)
    if gemm is None:
        return all_gather(data, group)[0].view(dtype)
    return ring_all_gather(data, group, op, lambda c, rows: gemm(c, rows.view(dtype))).view(dtype)


def _gemm(a, a_scale_inv, b, b_scale_inv, out, *, bias=None, accumulate=False, forward=False) -> torch.Tensor:
    """``out (+)= (a @ b)·scales + bias``; the forward's GEMMs accumulate as the tensor cores do fastest, the
    backward's sum each K block in fp32 (their long reductions over tokens need it)."""
    fp8_matmul_unchecked(a, b, a_scale_inv, b_scale_inv, bias, out=out, accumulate=accumulate,
                         split_accumulator=not forward)  # fmt: skip
    return out


def _weight_grad(g_t, x_t, g_scale_inv, x_scale_inv, dtype) -> torch.Tensor:
    """``dW = dYᵀ·X`` from the transposed fp8 copies ``g_t [N, T]`` and ``x_t [K, T]``."""
    out = torch.empty((g_t.shape[0], x_t.shape[0]), dtype=dtype, device=g_t.device)
    return _gemm(g_t, g_scale_inv, x_t.t(), x_scale_inv, out)


def _bias_grad(grad_y: torch.Tensor, dtype: torch.dtype, group=None, *, over_ranks: bool = False) -> torch.Tensor:
    """``Σ dY`` over the tokens (and, ``over_ranks``, over every rank's tokens of ``group``) in fp32, in ``dtype``."""
    total = grad_y.sum(0, dtype=torch.float32)
    return (all_reduce(total, group)[0] if over_ranks else total).to(dtype)


def _bias_grads(ctx, grad_y: torch.Tensor, needs) -> list:
    """Each bias's gradient from the outputs' gradients side by side (None where a weight has no bias or it is not
    needed)."""
    if not any(has and need for has, need in zip(ctx.has_bias, needs)):
        return [None] * len(ctx.sizes)
    return _per_weight(ctx, _bias_grad(grad_y, ctx.w_dtype), [h and n for h, n in zip(ctx.has_bias, needs)])


def _save(ctx, group, overlap, weights, biases, saved) -> None:
    ctx.save_for_backward(*saved)
    ctx.group, ctx.overlap, ctx.weight_params = group, overlap, weights
    ctx.w_dtype, ctx.has_bias, ctx.k = weights[0].dtype, [b is not None for b in biases], weights[0].shape[1]
    ctx.sizes = [w.shape[0] for w in weights]


def _quantize_weights(weights, transpose: bool) -> tuple[Fp8Tensor, list]:
    """Several weights of one input (Q, K, V; gate, up) quantised as one ``[ΣN_i, K]`` fp8 tensor with one scale, as
    the fused layer's weight would be, and each weight's rows of its data (the operands of its output's GEMMs)."""
    wq = quantize_fp8(weights[0] if len(weights) == 1 else torch.cat(weights), "e4m3", transpose=transpose)
    return wq, [rows.t() for rows in wq.data.split([w.shape[0] for w in weights])]


def _output_grads(grads) -> torch.Tensor:
    """The outputs' gradients side by side ``[T, ΣN_i]``: the fused weight's, whose dgrad is one GEMM."""
    return (grads[0] if len(grads) == 1 else torch.cat(grads, dim=1)).contiguous()


def _needs(ctx, x_at: int, n_w: int) -> tuple:
    """``(need_dx, needs_dw, needs_db)`` of an ``apply(…, x, *weights, *biases)`` with x its argument ``x_at``."""
    needs = ctx.needs_input_grad
    return needs[x_at], needs[x_at + 1 : x_at + 1 + n_w], needs[x_at + 1 + n_w :]


def _per_weight(ctx, grad, needs) -> list:
    """A fused ``[ΣN_i, …]`` gradient (or None) cut into each weight's (None where ``needs`` is False)."""
    if grad is None:
        return [None] * len(ctx.sizes)
    return [g if n else None for g, n in zip(grad.split(ctx.sizes), needs)]


# ------------------------------------------------------------------------------------------------------ AG + GEMM


class _Fp8AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, overlap, regather, n_w, x_shard, *params):
        weights, biases = params[:n_w], params[n_w:]
        t, m = group_size(group), x_shard.shape[0]
        xq = _quantize_shard(x_shard, "e4m3", group)
        wq, w_rows = _quantize_weights(weights, transpose=ctx.needs_input_grad[4])
        ys = [x_shard.new_empty((t * m, w.shape[0])) for w in weights]

        def gemm(c, rows):
            for w, b, y in zip(w_rows, biases, ys):
                _gemm(rows, xq.scale_inv, w, wq.scale_inv, y[c * m : (c + 1) * m], bias=b, forward=True)

        if overlap == "peer":  # the shards into the peers' memory, one gated fp8 GEMM per weight as they arrive
            result = peer_all_gather_matmul(
                xq.data, [w.t() for w in w_rows], transport_for(group, xq.data), biases=biases,
                keep_input=not regather, scales=[(xq.scale_inv, wq.scale_inv)] * n_w, out_dtype=x_shard.dtype,
            )  # fmt: skip
            ys, x_full = (result, None) if regather else result  # (regather keeps no gathered copy)
        else:
            x_full = _gather(xq, group, "all_gather_matmul", gemm if overlap else None)
        for w, b, y in zip(w_rows, biases, ys) if not overlap else ():
            _gemm(x_full, xq.scale_inv, w, wq.scale_inv, y, bias=b, forward=True)
        _save(ctx, group, overlap, weights, biases, (xq.data if regather else x_full, xq.scale_inv, wq.data_t,
                                                              wq.scale_inv))  # fmt: skip
        ctx.regather, ctx.m = regather, m
        return tuple(ys)

    @staticmethod
    def backward(ctx, *grads):
        saved_x, x_scale_inv, w_t, w_scale_inv = ctx.saved_tensors
        group, m, w_dtype, n_w = ctx.group, ctx.m, ctx.w_dtype, len(grads)
        need_dx, needs_dw, needs_db = _needs(ctx, 4, n_w)
        need_dw = any(needs_dw)
        grad_y = _output_grads(grads)
        gq = quantize_fp8(grad_y, "e5m2", transpose=need_dw)
        dbs = _bias_grads(ctx, grad_y, needs_db)
        x_t = None
        if need_dw:  # dW's operand read along the tokens: the gathered input's transpose, in fp8
            x_full = _gather(Fp8Tensor(saved_x, x_scale_inv), group) if ctx.regather else saved_x
            x_t = x_full.t().contiguous()
        weight_grad = lambda: _per_weight(
            ctx, _weight_grad(gq.data_t, x_t, gq.scale_inv, x_scale_inv, w_dtype), needs_dw
        )
        deferred = need_dw and defer_weight_grads(ctx.weight_params, weight_grad)
        now = need_dw and not deferred and not (need_dx and ctx.overlap)
        dws = weight_grad() if now else _per_weight(ctx, None, needs_dw)
        if not need_dx:
            return None, None, None, None, None, *dws, *dbs
        dgrad = (w_t.t(), w_scale_inv)
        if ctx.overlap == "peer":  # one fp8 GEMM storing dX's partials into their owners' memory, dW meanwhile
            computed = []
            between = (lambda: computed.append(weight_grad())) if need_dw and not deferred else None
            dx = peer_matmul_reduce_scatter(
                gq.data, w_t, reduce_transport_for(group, m, ctx.k, grad_y), between=between,
                scales=(gq.scale_inv, w_scale_inv), split_accumulator=True,
            )  # fmt: skip
            return None, None, None, None, dx, *(computed[0] if computed else dws), *dbs
        if not ctx.overlap or not need_dw or deferred:  # the plain path: dX whole, then its reduce-scatter
            dx_full = _gemm(gq.data, gq.scale_inv, *dgrad, grad_y.new_empty((grad_y.shape[0], ctx.k)))
            return None, None, None, None, reduce_scatter(dx_full, group)[0], *dws, *dbs
        buffer = torch.zeros((grad_y.shape[1], ctx.k), dtype=torch.float32, device=grad_y.device)

        def gemm(c, lo, hi, out, accumulate, last):
            _gemm(gq.data[c * m + lo : c * m + hi], gq.scale_inv, *dgrad, out, accumulate=accumulate)

        def wgrad(c, lo, hi):  # dW += dY[rows]ᵀ · X[rows] while those rows' accumulator travels
            record_event("wgrad", "all_gather_matmul.backward", c)
            rows = slice(c * m + lo, c * m + hi)
            _gemm(gq.data_t[:, rows], gq.scale_inv, x_t[:, rows].t(), x_scale_inv, buffer, accumulate=True)

        dx = ring_reduce_scatter(m, ctx.k, grad_y, group, "all_gather_matmul.backward", gemm, wgrad)
        return None, None, None, None, dx, *_per_weight(ctx, buffer.to(w_dtype), needs_dw), *dbs


def fp8_all_gather_matmul(x_shard, weights, group=None, *, biases=None, overlap=True, regather=False):
    """``[AG(x_shard) @ W_iᵀ + b_i]`` in fp8 (column-parallel GEMMs under sequence parallelism), as
    :func:`~tessel.parallel.overlap.all_gather_matmul`: ``x_shard [m, K]`` (rank r holds rows ``[r·m, (r+1)·m)``), a
    ``[N_i, K]`` weight or a list of them sharing the gather (quantised as one, the fused layer's weight, and their
    dgrad one GEMM), one (optional) ``[N_i]`` bias each; returns ``[t·m, N_i]`` outputs (a single tensor for a
    single weight). ``regather`` keeps only the fp8 shard for backward and gathers it again there. See the module's
    docstring.
    """
    single, weights, biases = _weights_and_biases("fp8_all_gather_matmul", "x_shard", x_shard, weights, biases)
    _check_overlap("fp8_all_gather_matmul", overlap)
    outs = _Fp8AllGatherMatmul.apply(
        group, _overlap_arg(overlap, group), bool(regather), len(weights), x_shard, *weights, *biases
    )  # fmt: skip
    return outs[0] if single else list(outs)


# ------------------------------------------------------------------------------------------------------ GEMM + RS


class _Fp8MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, overlap, x, weight, bias):
        t = group_size(group)
        m, n = x.shape[0] // t, weight.shape[0]
        xq = quantize_fp8(x, "e4m3", transpose=ctx.needs_input_grad[3])
        wq = quantize_fp8(weight, "e4m3", transpose=ctx.needs_input_grad[2])
        args = (wq.data.t(), wq.scale_inv)
        if overlap == "peer":  # the fp8 GEMM's epilogue stores each chunk's partial into its owner's memory
            y = peer_matmul_reduce_scatter(xq.data, wq.data, reduce_transport_for(group, m, n, x), bias=bias,
                                           scales=(xq.scale_inv, wq.scale_inv))  # fmt: skip
        elif overlap:

            def gemm(c, lo, hi, out, accumulate, last):
                rows = xq.data[c * m + lo : c * m + hi]
                _gemm(rows, xq.scale_inv, *args, out, bias=bias if last else None, accumulate=accumulate, forward=True)

            y = ring_reduce_scatter(m, n, x, group, "matmul_reduce_scatter", gemm)
        else:
            once = bias if group_rank(group) == 0 else None  # the whole bias, added once to the sum
            y = reduce_scatter(_gemm(xq.data, xq.scale_inv, *args, x.new_empty((t * m, n)), bias=once, forward=True),
                               group)[0]  # fmt: skip
        _save(ctx, group, overlap, [weight], [bias], (xq.data_t, xq.scale_inv, wq.data_t, wq.scale_inv))
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x_t, x_scale_inv, w_t, w_scale_inv = ctx.saved_tensors
        group, w_dtype = ctx.group, ctx.w_dtype
        need_dx, need_dw, need_db = ctx.needs_input_grad[2:5]
        grad_y = grad_y.contiguous()
        m = grad_y.shape[0]
        db = _bias_grad(grad_y, w_dtype, group, over_ranks=True) if ctx.has_bias[0] and need_db else None
        if not (need_dx or need_dw):
            return None, None, None, None, db
        gq = _quantize_shard(grad_y, "e5m2", group)
        dgrad = (w_t.t(), w_scale_inv) if need_dx else None
        if ctx.overlap == "peer" and need_dx and not (need_dw and is_deferring()):
            # dY's fp8 shards into the peers' memory, one gated fp8 GEMM for dX; dW from the gathered copy
            (dx,), g_full = peer_all_gather_matmul(
                gq.data, [w_t], transport_for(group, gq.data), keep_input=True, scales=[(gq.scale_inv, w_scale_inv)],
                out_dtype=grad_y.dtype, split_accumulator=True,
            )  # fmt: skip
            dw = _weight_grad(g_full.t().contiguous(), x_t, gq.scale_inv, x_scale_inv, w_dtype) if need_dw else None
            return None, None, dx, dw, db
        if not ctx.overlap or ctx.overlap == "peer" or (need_dw and is_deferring()):  # dY gathered, then the GEMMs
            g_full = _gather(gq, group)
            dx = _gemm(g_full, gq.scale_inv, *dgrad, grad_y.new_empty((g_full.shape[0], ctx.k))) if need_dx else None
            weight_grad = lambda: [_weight_grad(g_full.t().contiguous(), x_t, gq.scale_inv, x_scale_inv, w_dtype)]
            deferred = need_dw and defer_weight_grads(ctx.weight_params, weight_grad)
            return None, None, dx, weight_grad()[0] if need_dw and not deferred else None, db
        t = group_size(group)
        dx = grad_y.new_empty((t * m, ctx.k)) if need_dx else None
        buffer = torch.zeros((grad_y.shape[1], ctx.k), dtype=torch.float32, device=grad_y.device) if need_dw else None

        def gemm(c, rows):  # this step's fp8 dY shard [m, N]
            if need_dx:
                _gemm(rows, gq.scale_inv, *dgrad, dx[c * m : (c + 1) * m])
            if need_dw:
                record_event("wgrad", "matmul_reduce_scatter.backward", c)
                x_rows = x_t[:, c * m : (c + 1) * m].t()
                _gemm(rows.t().contiguous(), gq.scale_inv, x_rows, x_scale_inv, buffer, accumulate=True)

        _gather(gq, group, "matmul_reduce_scatter.backward", gemm)
        return None, None, dx, None if buffer is None else buffer.to(w_dtype), db


def fp8_matmul_reduce_scatter(x, weight, group=None, *, bias=None, overlap=True):
    """``RS(x @ weightᵀ) + bias`` in fp8 (a row-parallel layer under sequence parallelism): ``x [t·m, K_local]``,
    ``weight [N, K_local]``, ``bias [N]`` whole and added once; returns this rank's rows ``[m, N]``."""
    check_operands("fp8_matmul_reduce_scatter", "x", x, [weight], [bias])
    t = group_size(group)
    if x.shape[0] % t:
        raise ValueError(f"fp8_matmul_reduce_scatter: {x.shape[0]} rows of x are not divisible by the group size {t}")
    _check_overlap("fp8_matmul_reduce_scatter", overlap)
    return _Fp8MatmulReduceScatter.apply(group, _overlap_arg(overlap, group), x, weight, bias)


# ------------------------------------------------------------------------------------------------------ GEMM + AR


def _replicated_grads(ctx, grads, group=None, overlap=False, op="", reduce_dx=False) -> tuple:
    """``(dx, *dws, *dbs)`` of ``Y_i = X·W_iᵀ + b_i`` in fp8 from the saved transposes (``apply``'s arguments ``(group,
    overlap, n_w, x, *weights, *biases)``); with ``reduce_dx``, ``dX`` all-reduced over ``group`` (chunked while the
    weight gradients are computed, with ``overlap``)."""
    x_t, x_scale_inv, w_t, w_scale_inv = ctx.saved_tensors
    n_w, w_dtype = len(grads), ctx.w_dtype
    need_dx, needs_dw, needs_db = _needs(ctx, 3, n_w)
    need_dw = any(needs_dw)
    grad_y = _output_grads(grads)
    gq = quantize_fp8(grad_y, "e5m2", transpose=need_dw)
    dbs = _bias_grads(ctx, grad_y, needs_db)
    weight_grad = lambda: _per_weight(ctx, _weight_grad(gq.data_t, x_t, gq.scale_inv, x_scale_inv, w_dtype), needs_dw)
    deferred = need_dw and defer_weight_grads(ctx.weight_params, weight_grad)
    dws = []

    def compute_wgrad():
        if need_dw and not deferred:
            record_event("wgrad", f"{op}.backward", 0)
            dws.append(weight_grad())

    dx = None
    if need_dx:
        dgrad = (w_t.t(), w_scale_inv)
        if not reduce_dx:
            dx = _gemm(gq.data, gq.scale_inv, *dgrad, grad_y.new_empty((grad_y.shape[0], ctx.k)))
        elif _peer_rows(overlap, group, grad_y.shape[0]):  # a reduce-scatter then an all-gather, dW meanwhile
            dx = peer_matmul_all_reduce(gq.data, w_t, group, between=compute_wgrad, scales=(gq.scale_inv, w_scale_inv),
                                        out_dtype=grad_y.dtype, split_accumulator=True)  # fmt: skip
        elif overlap:
            dx = chunked_all_reduce(
                grad_y.shape[0], ctx.k, grad_y, group, f"{op}.backward", ALL_REDUCE_CHUNKS,
                lambda lo, hi, out: _gemm(gq.data[lo:hi], gq.scale_inv, *dgrad, out), after_issue=compute_wgrad,
            )  # fmt: skip
        else:
            dx = all_reduce(_gemm(gq.data, gq.scale_inv, *dgrad, grad_y.new_empty((grad_y.shape[0], ctx.k))), group)[0]
    if not dws:
        compute_wgrad()
    return dx, *(dws[0] if dws else _per_weight(ctx, None, needs_dw)), *dbs


class _Fp8MatmulAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, overlap, n_w, x, weight, bias):
        xq = quantize_fp8(x, "e4m3", transpose=ctx.needs_input_grad[4])
        wq = quantize_fp8(weight, "e4m3", transpose=ctx.needs_input_grad[3])
        once = bias if group_rank(group) == 0 else None  # the whole bias, added once to the sum
        args = (wq.data.t(), wq.scale_inv)
        if _peer_rows(overlap, group, x.shape[0]):  # a reduce-scatter then an all-gather through the transports
            y = peer_matmul_all_reduce(xq.data, wq.data, group, bias=bias, scales=(xq.scale_inv, wq.scale_inv),
                                       out_dtype=x.dtype)  # fmt: skip
        elif overlap:
            y = chunked_all_reduce(
                x.shape[0], weight.shape[0], x, group, "matmul_all_reduce", ALL_REDUCE_CHUNKS,
                lambda lo, hi, out: _gemm(xq.data[lo:hi], xq.scale_inv, *args, out, bias=once, forward=True),
            )  # fmt: skip
        else:
            out = x.new_empty((x.shape[0], weight.shape[0]))
            y = all_reduce(_gemm(xq.data, xq.scale_inv, *args, out, bias=once, forward=True), group)[0]
        _save(ctx, group, overlap, [weight], [bias], (xq.data_t, xq.scale_inv, wq.data_t, wq.scale_inv))
        return y

    @staticmethod
    def backward(ctx, grad_y):  # dY is replicated: dX = dY·W and dW = dYᵀ·X need no communication
        return None, None, None, *_replicated_grads(ctx, [grad_y], op="matmul_all_reduce")


def fp8_matmul_all_reduce(x, weight, group=None, *, bias=None, overlap=True):
    """``AR(x @ weightᵀ) + bias`` in fp8 (a row-parallel layer), chunked along tokens, each chunk all-reduced in
    flight: ``x [T, K_local]``, ``weight [N, K_local]``, ``bias [N]`` whole and added once; returns ``[T, N]``."""
    check_operands("fp8_matmul_all_reduce", "x", x, [weight], [bias])
    _check_overlap("fp8_matmul_all_reduce", overlap)
    return _Fp8MatmulAllReduce.apply(group, _overlap_arg(overlap, group), 1, x, weight, bias)


class Fp8LinearFunction(torch.autograd.Function):
    """``Y_i = X·W_iᵀ + b_i`` in fp8 on one rank (:func:`tessel.layers.fp8_linear`): no communication either way.
    ``apply(group, overlap, n_w, x, *weights, *biases)`` (the group and overlap unused) returns one output per weight;
    weights sharing the input are quantised as one (as the fused layer's weight would be)."""

    @staticmethod
    def forward(ctx, group, overlap, n_w, x, *params):
        weights, biases = params[:n_w], params[n_w:]
        xq = quantize_fp8(x, "e4m3", transpose=any(ctx.needs_input_grad[4 : 4 + n_w]))
        wq, w_rows = _quantize_weights(weights, transpose=ctx.needs_input_grad[3])
        ys = tuple(
            _gemm(xq.data, xq.scale_inv, w, wq.scale_inv, x.new_empty((x.shape[0], w.shape[1])), bias=b, forward=True)
            for w, b in zip(w_rows, biases)
        )  # fmt: skip
        _save(ctx, group, overlap, weights, biases, (xq.data_t, xq.scale_inv, wq.data_t, wq.scale_inv))
        return ys

    @staticmethod
    def backward(ctx, *grads):
        return None, None, None, *_replicated_grads(ctx, grads, op="fp8_linear")


class _Fp8MatmulGradAllReduce(Fp8LinearFunction):
    @staticmethod
    def backward(ctx, *grads):
        grads = _replicated_grads(ctx, grads, ctx.group, ctx.overlap, "matmul_grad_all_reduce", reduce_dx=True)
        return None, None, None, *grads


def _weights_and_biases(op: str, x_name: str, x, weights, biases) -> tuple[bool, list, list]:
    """``(single, weights, biases)`` of an op taking one weight or several sharing its input, checked."""
    single = isinstance(weights, torch.Tensor)
    weights = [weights] if single else list(weights)
    biases = [None] * len(weights) if biases is None else ([biases] if single else list(biases))
    check_operands(op, x_name, x, weights, biases)
    if not weights:
        raise ValueError(f"{op}: weights must be a tensor or a non-empty list of them, received an empty list")
    return single, weights, biases


def fp8_matmul_grad_all_reduce(x, weights, group=None, *, biases=None, overlap=True):
    """``[x @ W_iᵀ + b_i]`` in fp8 whose input gradient is all-reduced (column-parallel GEMMs on a replicated
    input): no communication forward; backward ``dX = AR(Σ_i dY_i·W_i)`` chunked, the weight gradients computed while
    the chunks travel. Several weights are quantised as one (the fused layer's) and their dgrad is one GEMM. Returns
    one output per weight (a single tensor for a single weight)."""
    single, weights, biases = _weights_and_biases("fp8_matmul_grad_all_reduce", "x", x, weights, biases)
    _check_overlap("fp8_matmul_grad_all_reduce", overlap)
    outs = _Fp8MatmulGradAllReduce.apply(group, _overlap_arg(overlap, group), len(weights), x, *weights, *biases)
    return outs[0] if single else list(outs)
