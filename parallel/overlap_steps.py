"""The eager bodies of the overlapped ops' forward and backward passes, outside autograd.

:mod:`.overlap` wraps them in autograd Functions for eager calls, :mod:`.overlap_ops` in ``torch.library``
custom operators for compiled ones, so a compiled model runs the same rings. Legend and schedules as in
:mod:`.overlap` and :mod:`.rings`. ``defer`` (the parameters a zero-bubble schedule may postpone the weight
gradients of, or None) is only ever given by the eager Functions: a graph's backward returns its gradients.
"""

from __future__ import annotations

import torch

from ..kernels.matmul import matmul, matmul_unchecked
from .comm import all_gather, all_reduce, group_rank, group_size, record_event, reduce_scatter
from .ddp import OWNER_ATTR
from .peer import (
    peer_all_gather_matmul,
    peer_matmul_all_reduce,
    peer_matmul_reduce_scatter,
    reduce_transport_for,
    transport_for,
)
from .pipeline.weight_grad import is_deferring, submit
from .rings import chunked_all_reduce, ring_all_gather, ring_reduce_scatter

__all__ = [
    "ALL_REDUCE_CHUNKS",
    "all_gather_matmul_backward",
    "all_gather_matmul_forward",
    "bias_grad",
    "defer_weight_grads",
    "matmul_all_reduce_forward",
    "matmul_grad_all_reduce_backward",
    "matmul_reduce_scatter_backward",
    "matmul_reduce_scatter_forward",
]

ALL_REDUCE_CHUNKS = 4


def _grad_buffer(w: torch.Tensor) -> torch.Tensor:
    """Weight gradients summed over ring steps accumulate in fp32, rounded once at the end."""
    return torch.zeros(w.shape, dtype=torch.float32, device=w.device)


def _sum_dgrad(grads, weights, rows: slice, out: torch.Tensor, accumulate: bool) -> None:
    """out (+)= Σ_i grads_i[rows] · W_i  — the input gradient of several weights sharing one input (never traced:
    under compile these bodies run inside the operators' nodes)."""
    for i, (g, w) in enumerate(zip(grads, weights)):
        matmul_unchecked(g[rows], w, out=out, accumulate=accumulate or i > 0)


def defer_weight_grads(params, compute) -> bool:
    """Under a zero-bubble schedule's backward-input pass, postpone the weight-gradient GEMMs.

    ``compute()`` returns one gradient per parameter of ``params``; it is submitted to the active
    :class:`~tessel.parallel.pipeline.weight_grad.WeightGradStore` and, when the schedule's ``W``
    action runs it, accumulated into ``.grad`` (autograd does not: the Function returns ``None`` for
    those parameters). Returns whether it deferred. Parameters managed by a data-parallel wrapper are
    never deferred: their gradients must reach the wrapper's reduction hooks inside the backward that
    produced them. Nor is a tensor computed from parameters (not a leaf: a column layer's weight whose
    replicated rows' gradients are summed over the group, say): its gradient must flow on through autograd
    to them. ``params`` None: never deferred.
    """
    if params is None or not is_deferring():
        return False
    if any(not p.is_leaf or getattr(p, OWNER_ATTR, None) is not None for p in params):
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


def bias_grad(g: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Σ over tokens in fp32, in the parameters' dtype."""
    return g.sum(0, dtype=torch.float32).to(like.dtype)


# ---------------------------------------------------------------------------------------------------- AG + GEMM


def all_gather_matmul_forward(group, overlap: bool | str, x_shard, weights, biases, keep_input: bool = True):
    """``(outs, x_full)``: ``outs[i] = AG(x_shard)·W_iᵀ + b_i``, and the gathered input (with ``overlap="peer"``, a
    copy of the transport's buffer taken before the peers may write it again, or None without ``keep_input``)."""
    if overlap == "peer":
        transport = transport_for(group, x_shard)
        result = peer_all_gather_matmul(x_shard.contiguous(), weights, transport, biases=biases, keep_input=keep_input)
        return result if keep_input else (result, None)
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
            matmul_unchecked(x_full, w.t(), b, out=y)
    return outs, x_full


def all_gather_matmul_backward(group, overlap: bool, saved_x, regather: bool, weights, grads, defer=None, need_dw=None):
    """``(dx_shard, dws)`` from the output gradients ``grads`` (contiguous). ``saved_x`` is the gathered input,
    or with ``regather`` this rank's shard, gathered again here (in flight during the first dgrad GEMM). ``dws``
    holds None for each weight whose gradient was deferred or is not needed (``need_dw``, one bool per weight;
    None: all): a frozen weight costs no GEMM, and with none needed X is not gathered again."""
    need = [True] * len(weights) if need_dw is None else list(need_dw)
    wanted = [i for i, n in enumerate(need) if n]
    m = saved_x.shape[0] if regather else saved_x.shape[0] // group_size(group)
    rows_x = saved_x.shape[0] * (group_size(group) if regather else 1), saved_x.shape[1]
    if regather and wanted:
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
    dws = [None] * len(weights)
    params = None if defer is None else [defer[i] for i in wanted]
    deferred = bool(wanted) and defer_weight_grads(params, lambda: [matmul(grads[i].t(), gathered()) for i in wanted])
    if overlap == "peer" and not deferred:  # the weight gradients hide the partials' transfers

        def wgrads():
            record_event("wgrad", "all_gather_matmul.backward", -1)
            for i in wanted:
                dws[i] = matmul(grads[i].t(), gathered())

        return _peer_dgrad_reduce_scatter(group, grads, weights, m, wgrads), dws
    if deferred or not wanted or not overlap:  # the plain path: dX whole, then its reduce-scatter
        dx_full = saved_x.new_empty(rows_x)
        _sum_dgrad(grads, weights, slice(None), dx_full, False)
        dx, _ = reduce_scatter(dx_full, group)
        for i in () if deferred else wanted:
            dws[i] = matmul(grads[i].t(), gathered())
        return dx, dws
    buffers = {i: _grad_buffer(weights[i]) for i in wanted}

    def gemm(c, lo, hi, out, accumulate, last):
        _sum_dgrad(grads, weights, slice(c * m + lo, c * m + hi), out, accumulate)

    def wgrad(c, lo, hi):  # dW_i += dY_i[rows]ᵀ · X[rows] while those rows' accumulator travels
        record_event("wgrad", "all_gather_matmul.backward", c)
        rows = slice(c * m + lo, c * m + hi)
        for i, dw in buffers.items():
            matmul_unchecked(grads[i][rows].t(), gathered()[rows], out=dw, accumulate=True)

    dx = ring_reduce_scatter(m, rows_x[1], x_full, group, "all_gather_matmul.backward", gemm, wgrad)
    for i, dw in buffers.items():
        dws[i] = dw.to(weights[i].dtype)
    return dx, dws


# ---------------------------------------------------------------------------------------------------- GEMM + RS


def matmul_reduce_scatter_forward(group, overlap: bool | str, x, weight, bias):
    """``RS(x·Wᵀ) + bias`` (the whole bias, added once): this rank's rows."""
    t, r = group_size(group), group_rank(group)
    m, n = x.shape[0] // t, weight.shape[0]
    if overlap == "peer":
        transport = reduce_transport_for(group, m, n, x)
        return peer_matmul_reduce_scatter(x.contiguous(), weight, transport, bias=bias)
    if not overlap:
        return reduce_scatter(matmul(x, weight.t(), bias if r == 0 else None), group)[0]

    def gemm(c, lo, hi, out, accumulate, last):
        rows = x[c * m + lo : c * m + hi]
        matmul_unchecked(rows, weight.t(), bias if last else None, out=out, accumulate=accumulate)

    return ring_reduce_scatter(m, n, x, group, "matmul_reduce_scatter", gemm)


def _peer_dgrad_reduce_scatter(group, grads, weights, m: int, between) -> torch.Tensor:
    """``RS(Σ_i dY_i·W_i)`` through the device-signalled transport, as one GEMM over ``[dY_1 | dY_2 …]`` and
    ``[W_1; W_2 …]``; ``between()`` runs while the partials travel."""
    g, w = _concatenated(grads, weights)
    transport = reduce_transport_for(group, m, w.shape[1], g)
    return peer_matmul_reduce_scatter(g, w.t(), transport, between=between)


def _concatenated(grads, weights) -> tuple[torch.Tensor, torch.Tensor]:
    """``([dY_1 | dY_2 …], [W_1; W_2 …])``: ``Σ_i dY_i·W_i`` as one GEMM."""
    if len(grads) == 1:
        return grads[0], weights[0]
    return torch.cat(grads, dim=1), torch.cat(weights, dim=0)


def matmul_reduce_scatter_backward(group, overlap: bool | str, x, weight, grad_y, defer=None, need_dw=True):
    """``(dx, dw, g_full)``: ``g_full = AG(grad_y)`` (whose column sums are the bias gradient); ``dw`` is None
    when deferred or not needed (``need_dw`` False: a frozen weight costs no GEMM)."""
    m = grad_y.shape[0]
    if overlap == "peer" and not (need_dw and defer is not None and is_deferring()):
        (dx,), g_full = peer_all_gather_matmul(grad_y, [weight.t()], transport_for(group, grad_y), keep_input=True)
        return dx, matmul(g_full.t(), x) if need_dw else None, g_full
    if not overlap or (need_dw and defer is not None and is_deferring()):
        g_full, _ = all_gather(grad_y, group)
        dx = matmul(g_full, weight)
        compute = lambda: [matmul(g_full.t(), x)]
        if not need_dw or defer_weight_grads(defer, compute):
            return dx, None, g_full
        return dx, compute()[0], g_full
    dx = torch.empty_like(x)
    dw = _grad_buffer(weight) if need_dw else None

    def gemm(c, rows_g):
        rows = slice(c * m, (c + 1) * m)
        matmul_unchecked(rows_g, weight, out=dx[rows])
        if dw is not None:
            record_event("wgrad", "matmul_reduce_scatter.backward", c)
            matmul_unchecked(rows_g.t(), x[rows], out=dw, accumulate=True)

    g_full = ring_all_gather(grad_y, group, "matmul_reduce_scatter.backward", gemm)
    return dx, None if dw is None else dw.to(weight.dtype), g_full


# ---------------------------------------------------------------------------------------------------- GEMM + AR


def _peer_rows(overlap, group, rows: int) -> bool:
    """Whether an all-reduce op takes the device-signalled transports: ``overlap="peer"`` and rows that split evenly
    over the group (a reduce-scatter's shares; otherwise the chunked ring)."""
    return overlap == "peer" and rows % group_size(group) == 0


def matmul_all_reduce_forward(group, overlap: bool | str, x, weight, bias):
    """``AR(x·Wᵀ) + bias`` (the whole bias, added once, by rank 0's GEMM)."""
    if _peer_rows(overlap, group, x.shape[0]):
        return peer_matmul_all_reduce(x.contiguous(), weight, group, bias=bias)
    once = bias if group_rank(group) == 0 else None  # the bias is summed t times otherwise
    if not overlap:
        return all_reduce(matmul(x, weight.t(), once), group)[0]
    return chunked_all_reduce(
        x.shape[0], weight.shape[0], x, group, "matmul_all_reduce", ALL_REDUCE_CHUNKS,
        lambda lo, hi, out: matmul_unchecked(x[lo:hi], weight.t(), once, out=out),
    )  # fmt: skip


def matmul_grad_all_reduce_backward(group, overlap: bool, x, weights, grads, defer=None, need_dw=None):
    """``(dx, dws)``: ``dx = AR(Σ_i dY_i·W_i)`` chunked, the weight gradients computed while the chunks travel;
    ``dws`` holds None for each weight deferred or not needed (``need_dw`` as for all_gather_matmul_backward)."""
    need = [True] * len(weights) if need_dw is None else list(need_dw)
    wanted = [i for i, n in enumerate(need) if n]
    dws = [None] * len(weights)
    params = None if defer is None else [defer[i] for i in wanted]
    if not wanted or defer_weight_grads(params, lambda: [matmul(grads[i].t(), x) for i in wanted]):
        compute_wgrad = lambda: None
    else:

        def compute_wgrad():
            record_event("wgrad", "matmul_grad_all_reduce.backward", 0)
            for i in wanted:
                dws[i] = matmul(grads[i].t(), x)

    if _peer_rows(overlap, group, x.shape[0]):  # the weight gradients while the partials travel
        g, w = _concatenated(grads, weights)
        dx = peer_matmul_all_reduce(g, w.t(), group, between=compute_wgrad)
    elif overlap:
        dx = chunked_all_reduce(
            x.shape[0], x.shape[1], x, group, "matmul_grad_all_reduce.backward", ALL_REDUCE_CHUNKS,
            lambda lo, hi, out: _sum_dgrad(grads, weights, slice(lo, hi), out, False),
            after_issue=compute_wgrad,
        )  # fmt: skip
    else:
        dx = torch.empty_like(x)
        _sum_dgrad(grads, weights, slice(None), dx, False)
        all_reduce(dx, group)
        compute_wgrad()
    return dx, dws
