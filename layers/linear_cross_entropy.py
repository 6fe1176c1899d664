"""The language-model head and its cross entropy in one op, in chunks of tokens: the logits are never whole.

Legend: ``N`` tokens, ``E`` hidden size, ``V`` vocabulary, ``t`` tensor-parallel size, ``Vl = V/t`` (this
rank's rows of the head, in rank order, as a ``ColumnParallelLinear`` lm head holds them), ``n`` tokens per
chunk.

``lm_head`` followed by a cross entropy holds ``[N, Vl]`` logits, their fp32 copy inside the loss and their
gradient: for Llama 3's 128k vocabulary and 16k tokens per step, several GB per rank, more than any other
activation. :func:`linear_cross_entropy` computes the same loss and gradients holding one chunk ``[n, Vl]``
(fp32) at a time:

    per chunk of n tokens:  logits = x_c · Wᵀ (+ b)                  one GEMM, fp32 output
                            lse_r, z_r of the local shard            one read (kernels/cross_entropy.py)
                            one all-gather of (lse_r, z_r): [t, 2, n] → lse, z, loss = lse − z
                            dlogits = (exp(logits − lse) − onehot)·scale   one read, one write in x's dtype
                            dx_c = dlogits · W,  dW += dlogitsᵀ · x_c,  db += Σ dlogits   two GEMMs

With ``reduction`` ``"mean"`` or ``"sum"`` the gradient of the loss is a scalar times what the chunk loop
computes, so the gradients are computed during the forward (as Liger-Kernel's fused linear cross entropy
does) and the backward only scales them: three GEMMs in all, as unfused, and ``dx`` ``[N, E]`` and ``dW``
``[Vl, E]`` (fp32) are held from forward to backward instead of logits. With ``"none"`` the per-token
gradient of the loss is known only in backward: the forward keeps the log-sum-exp ``[N]`` and the backward
recomputes each chunk's logits (one GEMM more).

``label_smoothing``, ``z_loss`` and ``softcap`` are those of :func:`~.cross_entropy.vocab_parallel_cross_entropy`
(the sum of each chunk's logits joins the all-gather with label smoothing; the row passes apply all three).

Communication is that of the unfused head and loss: the input's all-gather (sequence parallelism) or
nothing (its gradient is all-reduced), the 2N fp32 (lse, z) all-gathered, in one collective per chunk.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..kernels.cross_entropy import check_softcap, logits_grad, row_stats
from ..kernels.matmul import matmul
from ..parallel.collectives import copy_to_tp, gather_from_sequence
from ..parallel.comm import group_rank, group_size
from .cross_entropy import check_loss_options, merged_token_loss
from .embedding import check_ids
from .linear import check_group_device

__all__ = ["default_chunk_size", "linear_cross_entropy"]

_NAME = "linear_cross_entropy"
_REDUCTIONS = ("mean", "sum", "none")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CHUNK_ALIGN = 256  # tokens: whole GEMM tiles along the chunk's rows
# Tokens per chunk at least: dW accumulates in fp32 across chunks, and each chunk's GEMM reads and writes all of
# it (8 bytes per element for 2·n flops); below ~1k tokens that traffic, not the arithmetic, bounds the GEMM.
_MIN_CHUNK = 2048


def default_chunk_size(tokens: int, vocab_local: int, hidden: int) -> int:
    """Tokens per chunk when none is given: a chunk's fp32 logits ``[n, Vl]`` about as large as the hidden states
    ``[N, E]`` (Liger-Kernel's rule) but at least 2048 tokens (so that the weight gradient's GEMMs stay bound by
    arithmetic), rounded up to a multiple of 256 rows; all the tokens when that covers them."""
    chunks = max(1, -(-vocab_local // max(hidden, 1)))
    n = max(-(-tokens // chunks), _MIN_CHUNK)
    return max(1, min(tokens, -(-n // _CHUNK_ALIGN) * _CHUNK_ALIGN))


def _validate(hidden, weight, bias, target, group, sequence_parallel, ignore_index, reduction, chunk_size) -> None:
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_NAME}: {name} must be a torch.Tensor, received {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{_NAME}: {name} must be float32, float16 or bfloat16, received {t.dtype}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{_NAME}: reduction must be one of {_REDUCTIONS}, received {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{_NAME}: ignore_index must be an int, received {type(ignore_index).__name__}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"{_NAME}: chunk_size must be None or a positive int, received {chunk_size!r}")
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"{_NAME}: sequence_parallel must be a bool, received {type(sequence_parallel).__name__}")
    if hidden.dim() < (3 if sequence_parallel else 1) or hidden.shape[-1] == 0:
        want = "[B, S/t, E]" if sequence_parallel else "[..., E]"
        raise ValueError(f"{_NAME}: hidden must be {want} with E >= 1, received shape {tuple(hidden.shape)}")
    e = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[0] == 0 or weight.shape[1] != e:
        raise ValueError(f"{_NAME}: weight must be [V/t, {e}] (this rank's rows of the head, hidden's width), "
                         f"received shape {tuple(weight.shape)}")  # fmt: skip
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(f"{_NAME}: weight must be {hidden.dtype} on {hidden.device} (hidden's), received "
                         f"{weight.dtype} on {weight.device}")  # fmt: skip
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)
                             or bias.dtype != hidden.dtype or bias.device != hidden.device):  # fmt: skip
        got = f"{tuple(bias.shape)} {bias.dtype} on {bias.device}" if isinstance(bias, torch.Tensor) else type(bias)
        raise ValueError(f"{_NAME}: bias must be None or a ({weight.shape[0]},) {hidden.dtype} tensor on "
                         f"{hidden.device}, received {got}")  # fmt: skip
    t = group_size(group)
    check_ids(_NAME, "target", target, weight.shape[0] * t, ignore=ignore_index)
    leading = list(hidden.shape[:-1])
    if sequence_parallel:
        leading[1] *= t
    if list(target.shape) != leading:
        what = "hidden's leading dims, the sequence gathered" if sequence_parallel else "hidden's leading dims"
        raise ValueError(f"{_NAME}: target must have shape {tuple(leading)} ({what}), "
                         f"received {tuple(target.shape)}")  # fmt: skip
    if target.device != hidden.device:
        raise ValueError(f"{_NAME}: target must be on hidden's device {hidden.device}, received {target.device}")
    if t > 1:
        check_group_device(_NAME, group, hidden, "hidden")


def _chunk_grads(logits, lse, local_target, scale, x, weight, grads, rows, first, options) -> None:
    """The gradient of the chunk's fp32 ``logits`` (softmax − onehot, times ``scale`` per token; with the loss
    ``options`` of :func:`~tessel.kernels.cross_entropy.logits_grad`; overwrites them), and what it adds to
    ``grads = [dx or None, dW or None, db or None]`` (``dx``'s ``rows``)."""
    g = logits_grad(logits, lse, local_target, scale, x.dtype, inplace=True, **options)
    dx, dw, db = grads
    if dx is not None:
        matmul(g, weight, out=dx[rows])
    if dw is not None:
        matmul(g.t(), x[rows], out=dw, accumulate=not first)
    if db is not None:
        db += g.sum(dim=0, dtype=torch.float32)


def _new_grads(x2, weight, needs) -> list:
    """fp32 ``[dx, dW, db]`` to fill chunk by chunk (None where no gradient is needed)."""
    dw = weight.new_empty(weight.shape, dtype=torch.float32) if needs[1] else None
    if dw is not None and x2.shape[0] == 0:
        dw.zero_()  # no chunk writes it
    return [
        x2.new_empty(x2.shape, dtype=torch.float32) if needs[0] else None,
        dw,
        weight.new_zeros(weight.shape[0], dtype=torch.float32) if needs[2] else None,
    ]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, target, group, ignore_index, reduction, chunk, needs, label_smoothing, z_loss,
                softcap):  # fmt: skip
        e, vl = x.shape[-1], weight.shape[0]
        options = dict(label_smoothing=label_smoothing, vocab=vl * group_size(group), z_loss=z_loss, softcap=softcap)
        x2, target = x.reshape(-1, e), target.reshape(-1).long()
        n_tokens = x2.shape[0]
        start = group_rank(group) * vl
        local_target = torch.where((target >= start) & (target < start + vl), target - start, -1)  # -1: elsewhere
        valid = target != ignore_index
        count = valid.sum()
        eager = reduction != "none" and any(needs)  # the gradients now; the backward scales them
        if eager:
            per_token = torch.reciprocal(count.float()) if reduction == "mean" else torch.ones((), device=x.device)
            scale = torch.where(valid, per_token, 0.0)
        grads = _new_grads(x2, weight, needs)
        loss = x2.new_empty(n_tokens, dtype=torch.float32)
        lse_all = x2.new_empty(n_tokens, dtype=torch.float32)
        buf = x2.new_empty((min(chunk, n_tokens), vl), dtype=torch.float32)
        w_t = weight.t()
        for i, lo in enumerate(range(0, n_tokens, chunk)):
            rows = slice(lo, min(lo + chunk, n_tokens))
            logits = matmul(x2[rows], w_t, bias, out=buf[: rows.stop - lo])
            stats = row_stats(logits, local_target[rows], softcap)
            token_loss, lse = merged_token_loss(stats, group, options["vocab"], label_smoothing, z_loss)
            loss[rows] = torch.where(valid[rows], token_loss, 0.0)
            lse_all[rows] = lse
            if eager:
                _chunk_grads(logits, lse, local_target[rows], scale[rows], x2, weight, grads, rows, i == 0, options)
        ctx.shapes, ctx.reduction, ctx.eager, ctx.chunk = (x.shape, weight.dtype), reduction, eager, chunk
        if eager:
            ctx.save_for_backward(*grads)
        else:
            ctx.save_for_backward(x2, weight, bias, lse_all, local_target, valid)
        ctx.needs, ctx.options = needs, options
        if reduction == "none":
            return loss.view(x.shape[:-1])
        return loss.sum() if reduction == "sum" else loss.sum() / count

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        (x_shape, w_dtype), needs = ctx.shapes, ctx.needs
        if ctx.eager:
            grads = list(ctx.saved_tensors)
            g = grad_loss.float()
        else:
            x2, weight, bias, lse, local_target, valid = ctx.saved_tensors
            g = None  # the per-token gradient of the loss is in the chunks' scale already
            grads = _new_grads(x2, weight, needs)
            scale = torch.where(valid, grad_loss.reshape(-1).float(), 0.0)
            chunk, n_tokens = ctx.chunk, x2.shape[0]
            buf = x2.new_empty((min(chunk, n_tokens), weight.shape[0]), dtype=torch.float32)
            for i, lo in enumerate(range(0, n_tokens, chunk)):
                rows = slice(lo, min(lo + chunk, n_tokens))
                logits = matmul(x2[rows], weight.t(), bias, out=buf[: rows.stop - lo])
                _chunk_grads(logits, lse[rows], local_target[rows], scale[rows], x2, weight, grads, rows, i == 0,
                             ctx.options)  # fmt: skip
        dx, dw, db = ((None if grad is None else (grad if g is None else grad * g).to(w_dtype)) for grad in grads)
        return (None if dx is None else dx.view(x_shape)), dw, db, *([None] * 9)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    *,
    bias: torch.Tensor | None = None,
    sequence_parallel: bool = False,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """``cross_entropy(hidden @ W.T + bias, target)`` for a vocab-parallel head, without ever holding the logits.

    The same loss and gradients as ``vocab_parallel_cross_entropy(ColumnParallelLinear(...)(hidden), target)``
    (more exact: the logits stay fp32), holding one chunk of ``chunk_size`` tokens' logits at a time (see the
    module's docstring for the schedule and what is held instead).

    Args:
        hidden: ``[..., E]`` the final norm's output, the same on every rank of ``tp_group``; under
            ``sequence_parallel``, ``[B, S/t, E]``, this rank's share of the sequence (gathered here, and
            its gradient reduce-scattered back, as a column-parallel layer does).
        weight: ``[V/t, E]``, this rank's rows of the head (rank order), hidden's dtype and device: the
            ``.weight`` of a ``ColumnParallelLinear`` lm head (or of ``nn.Linear`` with one rank).
        target: ``[...]`` global class ids (integer tensor), hidden's leading dims (``[B, S]`` under
            ``sequence_parallel``), the same on every rank.
        tp_group: the tensor-parallel group (None: the default group, or a world of one).
        bias: optional ``[V/t]``, this rank's share of the head's bias.
        sequence_parallel: ``hidden`` is split along dim 1 across ``tp_group``.
        ignore_index: targets equal to it contribute no loss and no gradient.
        reduction: ``"mean"`` over the non-ignored targets, ``"sum"``, or ``"none"`` (target's shape).
        chunk_size: tokens per chunk; None: :func:`default_chunk_size` (one chunk's fp32 logits about the
            size of the hidden states, and at least 2048 tokens).
        label_smoothing, z_loss, softcap: as :func:`~.cross_entropy.vocab_parallel_cross_entropy`'s.

    Returns:
        The loss in float32 (a scalar, or target's shape for ``"none"``). Differentiable with respect to
        ``hidden``, ``weight`` and ``bias``; with ``"mean"``/``"sum"`` the gradients are computed in this call
        and the backward scales them, so call it where its backward follows (a training step).
    """
    _validate(hidden, weight, bias, target, tp_group, sequence_parallel, ignore_index, reduction, chunk_size)
    check_loss_options(_NAME, label_smoothing, z_loss)
    softcap = check_softcap(_NAME, softcap)
    if group_size(tp_group) > 1 or sequence_parallel:
        hidden = gather_from_sequence(hidden, tp_group) if sequence_parallel else copy_to_tp(hidden, tp_group)
    tokens = hidden.numel() // hidden.shape[-1]
    chunk = chunk_size or default_chunk_size(tokens, weight.shape[0], hidden.shape[-1])
    tracked = (hidden, weight, bias)
    needs = tuple(torch.is_grad_enabled() and t is not None and t.requires_grad for t in tracked)
    return _LinearCrossEntropy.apply(hidden, weight, bias, target, tp_group, ignore_index, reduction, chunk, needs,
                                     float(label_smoothing), float(z_loss), softcap)  # fmt: skip
