"""Cross entropy over vocabulary-sharded logits that never gathers them (Megatron-LM's vocab-parallel loss).

Legend: ``N`` tokens (the product of the leading dims), ``V`` vocabulary, ``t`` tensor-parallel size, ``r``
this rank, ``Vl = V/t``. Rank ``r`` holds ``logits[..., r·Vl:(r+1)·Vl]``, in rank order (what a
``ColumnParallelLinear`` lm head without ``gather_output`` returns), and the whole ``target``.

Forward, per token, in fp32 whatever the logits dtype:

    lse_r = logsumexp of the local shard              (stable: torch.logsumexp subtracts the local max)
    z_r   = the target's logit if rank r owns the target, else 0
    one all-gather of (lse_r, z_r): [t, 2, N]
    lse = logsumexp_q lse_q      z = Σ_q z_q      loss = lse − z      (0 where target == ignore_index)

Merging per-rank log-sum-exps is exact and stable, so one all-gather of 2N fp32 values replaces
Megatron's all-reduce of the row max followed by all-reduces of the sum of exponentials and of the
target logit: one collective's latency instead of three, for (t−1)·8N bytes of per-token scalars, which
are negligible beside the N·Vl logits that are never moved.

Backward, with no communication: ``dlogits_r = (softmax_r − onehot_r)·scale``, ``softmax_r =
exp(logits_r − lse)`` recomputed from the saved logits (one fp32 per token is saved besides them, not an
fp32 softmax of N·Vl), and ``scale`` = the incoming gradient per token ("none"), the incoming scalar
("sum") or the incoming scalar over the number of non-ignored targets ("mean"); 0 for ignored targets.
Both passes are one read of the logits each (:mod:`tessel.kernels.cross_entropy`).

Options, as in ``torch.nn.functional.cross_entropy`` and PaLM:

- ``label_smoothing`` ε: the target is ``(1 − ε)·onehot + ε/V``, so ``loss = lse − (1 − ε)·z − (ε/V)·Σ_j x_j``;
  each rank also sends the sum of its logits (``[t, 3, N]``), and the gradient is ``softmax − target``.
- ``z_loss`` c: ``c·lse²`` is added to each token's loss (PaLM's auxiliary loss, which keeps the softmax's
  normaliser near 1), with gradient ``2c·lse·softmax``; nothing more is sent.
- ``softcap`` κ: the loss of the soft-capped logits ``κ·tanh(x/κ)`` (Gemma 2's), which the row passes read as they
  read each logit; nothing more is sent or saved.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..kernels.cross_entropy import check_softcap, logits_grad, row_stats
from ..parallel.comm import all_gather, group_rank, group_size
from .embedding import check_ids

__all__ = ["vocab_parallel_cross_entropy"]

_REDUCTIONS = ("mean", "sum", "none")
_NAME = "vocab_parallel_cross_entropy"


def check_loss_options(name: str, label_smoothing, z_loss, *, z_loss_name: str = "z_loss") -> None:
    """``label_smoothing`` in [0, 1] and ``z_loss`` >= 0, real numbers (raises TypeError/ValueError naming them;
    ``z_loss_name``: the caller's name for the z-loss)."""
    for arg, value in (("label_smoothing", label_smoothing), (z_loss_name, z_loss)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name}: {arg} must be a float, received {type(value).__name__}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{name}: label_smoothing must lie in [0, 1], received {label_smoothing}")
    if not 0.0 <= z_loss < float("inf"):
        raise ValueError(f"{name}: {z_loss_name} must be a finite number >= 0, received {z_loss}")


def merged_token_loss(stats, group, vocab: int, label_smoothing: float, z_loss: float):
    """Each token's loss and global log-sum-exp from this rank's ``row_stats`` (lse, z, Σx) of its vocab shard,
    merged over ``group`` with one all-gather (of the sums too only with label smoothing): ``(loss, lse)``."""
    lse, z, total = stats
    if group_size(group) > 1:
        parts = (lse, z, total) if label_smoothing else (lse, z)
        gathered, _ = all_gather(torch.stack(parts).unsqueeze(0), group)  # [t, 2 or 3, N]
        lse, z = torch.logsumexp(gathered[:, 0], dim=0), gathered[:, 1].sum(dim=0)
        total = gathered[:, 2].sum(dim=0) if label_smoothing else None
    loss = lse - z if not label_smoothing else lse - (1.0 - label_smoothing) * z - (label_smoothing / vocab) * total
    return (loss + z_loss * lse.square() if z_loss else loss), lse


def _validate(logits, target, tp_group, ignore_index, reduction) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{_NAME}: logits must be a torch.Tensor, received {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"{_NAME}: logits must be a floating-point tensor, received {logits.dtype}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{_NAME}: reduction must be one of {_REDUCTIONS}, received {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{_NAME}: ignore_index must be an int, received {type(ignore_index).__name__}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"{_NAME}: logits must be [..., V/t] with V/t >= 1, received shape {tuple(logits.shape)}")
    vocab = logits.shape[-1] * group_size(tp_group)
    check_ids(_NAME, "target", target, vocab, ignore=ignore_index)
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"{_NAME}: target must have shape {tuple(logits.shape[:-1])} (logits' leading dims), "
                         f"received {tuple(target.shape)}")  # fmt: skip
    if target.device != logits.device:
        raise ValueError(f"{_NAME}: target must be on the logits' device {logits.device}, received {target.device}")


def _rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` as ``[N, V/t]`` rows of unit column stride (a view where it can be)."""
    x = logits.reshape(-1, logits.shape[-1])
    return x if x.stride(1) == 1 or x.shape[1] == 1 else x.contiguous()


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, reduction, label_smoothing, z_loss, softcap):
        vl = logits.shape[-1]
        target = target.reshape(-1).long()
        start = group_rank(group) * vl
        local_target = torch.where((target >= start) & (target < start + vl), target - start, -1)  # -1: elsewhere
        stats = row_stats(_rows(logits), local_target, softcap)  # one read, fp32 arithmetic, no fp32 copy
        token_loss, lse = merged_token_loss(stats, group, vl * group_size(group), label_smoothing, z_loss)
        valid = target != ignore_index
        loss = torch.where(valid, token_loss, 0.0)
        count = valid.sum()
        ctx.save_for_backward(logits, lse, local_target, valid, count)
        ctx.reduction, ctx.options = reduction, dict(label_smoothing=label_smoothing, z_loss=z_loss,
                                                     vocab=vl * group_size(group), softcap=softcap)  # fmt: skip
        if reduction == "none":
            return loss.view(logits.shape[:-1])
        return loss.sum() if reduction == "sum" else loss.sum() / count

    @staticmethod
    def backward(ctx, grad_loss):
        logits, lse, local_target, valid, count = ctx.saved_tensors
        if ctx.reduction == "none":
            scale = grad_loss.reshape(-1).float()
        elif ctx.reduction == "sum":
            scale = grad_loss.float().expand(lse.shape[0])
        else:
            scale = grad_loss.float() / count
        # (this rank's softmax shard − onehot)·scale in one pass, written in the logits' dtype
        grad = logits_grad(_rows(logits), lse, local_target, torch.where(valid, scale, 0.0), logits.dtype,
                           **ctx.options)  # fmt: skip
        return grad.view(logits.shape), None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """``torch.nn.functional.cross_entropy`` of the gathered logits, computed from this rank's vocab shard.

    Args:
        logits: ``[..., V/t]``, this rank's shard of the vocabulary (rank order), any floating dtype.
        target: ``[...]`` global class ids (integer tensor), the same on every rank of ``tp_group``.
        tp_group: the tensor-parallel group (None: the default group, or a world of one).
        ignore_index: targets equal to it contribute no loss and no gradient.
        reduction: ``"mean"`` over the non-ignored targets, ``"sum"``, or ``"none"`` (shape of target).
        label_smoothing: ε in [0, 1], as ``torch.nn.functional.cross_entropy``'s: the target distribution is
            ``(1 − ε)·onehot + ε/V``.
        z_loss: c >= 0: ``c·logsumexp(logits)²`` is added to each (non-ignored) token's loss (PaLM).
        softcap: None, or κ > 0: the loss of the soft-capped logits ``κ·tanh(logits/κ)`` (Gemma 2's).

    Returns:
        The loss in float32 (a scalar, or ``[...]`` for ``"none"``). Differentiable with respect to logits;
        the backward is local (no communication).
    """
    _validate(logits, target, tp_group, ignore_index, reduction)
    check_loss_options(_NAME, label_smoothing, z_loss)
    softcap = check_softcap(_NAME, softcap)
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group, ignore_index, reduction, float(label_smoothing),
                                            float(z_loss), softcap)  # fmt: skip
