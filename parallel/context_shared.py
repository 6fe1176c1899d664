"""Context-parallel attention over the whole sequence's keys and over keys that every rank holds whole.

DeepSeek-V4's compressed layers attend, in one softmax, to the keys of a sliding window and to keys compressed from
the whole sequence (each query seeing those whose windows its position has closed, or the indexer's top ones of
those). Under context parallelism the window's keys are split over the ranks as :func:`~.context.split_sequence` lays
them out, and the compressed keys are the same on every rank: each compresses the whole sequence, gathered in order
by :func:`sequence_from_shares`.

:func:`shared_keys_attention` gathers the split keys and values (such a model has one key-and-value head, so the
gather moves ``S·D`` elements per rank, a ``1/Hq`` of its queries' size), attends each of the rank's two chunks of
queries to the keys up to the chunk's end with flash attention (its causal mask aligned bottom-right, its sliding
window; its log-sum-exp kept), attends the queries to the shared keys under their bias in PyTorch, and merges the two
(and the attention sinks, a logit per head) through their log-sum-exps::

    lse = log(e^lse_window + Σ_n e^(s_n + bias_n) + e^sink)
    out = out_window · e^(lse_window - lse) + Σ_n e^(s_n + bias_n - lse) · v_n

Everything after the kernel is differentiable PyTorch; the kernel's log-sum-exp carries its gradient (flash
attention's ``return_lse``), and the gathers' backward sums every rank's gradient of each share into its owner's.
"""

from __future__ import annotations

import math

import torch

from ..kernels.attention import flash_attention
from ..kernels.attention_inputs import HEAD_DIMS
from ..kernels.attention_reference import wide_attention
from .comm import group_rank, group_size
from .context import sequence_from_shares

__all__ = ["sequence_from_shares", "shared_keys_attention"]

_NAME = "shared_keys_attention"


def _check(q, k, v, shared_k, shared_v, shared_bias, sinks, c: int) -> None:
    for name, t in (("q", q), ("k", k), ("v", v), ("shared_k", shared_k), ("shared_v", shared_v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_floating_point():
            got = f"{t.dtype} of {t.dim()} dims" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{_NAME}: {name} must be a 4-d floating-point tensor [B, H, S, D], received {got}")
    b, hq, length, d = q.shape
    hkv = k.shape[1]
    if k.shape != v.shape or k.shape[::2] != (b, length) or k.shape[3] != d or hq % hkv:
        raise ValueError(f"{_NAME}: k and v must be [B, Hkv, L, D] = [{b}, Hkv | {hq}, {length}, {d}], received k "
                         f"{tuple(k.shape)} and v {tuple(v.shape)}")  # fmt: skip
    if shared_k.shape != shared_v.shape or shared_k.shape[:2] != (b, hkv) or shared_k.shape[3] != d:
        raise ValueError(f"{_NAME}: shared_k and shared_v must be [B, Hkv, N, D] = [{b}, {hkv}, N, {d}], received "
                         f"{tuple(shared_k.shape)} and {tuple(shared_v.shape)}")  # fmt: skip
    n = shared_k.shape[2]
    if not isinstance(shared_bias, torch.Tensor) or shared_bias.dim() != 4 or shared_bias.shape[1] not in (1, hq) \
            or shared_bias.shape[::2] != (b, length) or shared_bias.shape[3] != n:  # fmt: skip
        got = tuple(shared_bias.shape) if isinstance(shared_bias, torch.Tensor) else type(shared_bias).__name__
        raise ValueError(f"{_NAME}: shared_bias must be [B, 1 or Hq, L, N] = [{b}, 1 | {hq}, {length}, {n}], "
                         f"received {got}")  # fmt: skip
    if c > 1 and length % 2:
        raise ValueError(f"{_NAME}: each rank holds two equal chunks of the sequence (split_sequence), so the local "
                         f"length must be even, received {length}")  # fmt: skip
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (hq,)):
        got = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"{_NAME}: sinks must be None or one logit per query head, shape ({hq},), received {got}")


def shared_keys_attention(q, k, v, shared_k, shared_v, shared_bias, group=None, *, scale=None, window=None,
                          sinks=None, deterministic=True) -> torch.Tensor:  # fmt: skip
    """Causal attention of this rank's queries over the whole sequence's keys and over keys every rank holds whole,
    in one softmax; differentiable.

    Args:
        q: ``[B, Hq, L, D]``, this rank's queries; k, v: ``[B, Hkv, L, D]``, its keys and values, laid out as
            :func:`~.context.split_sequence` lays the tokens out (``L`` even over more than one rank); query ``i``
            sees keys ``j ≤ i`` (``i - window < j`` with a ``window``).
        shared_k, shared_v: ``[B, Hkv, N, D]``, keys and values the same on every rank (GQA as ``k``'s).
        shared_bias: ``[B, 1 or Hq, L, N]`` float, added to each of this rank's queries' scores of the shared keys
            (``-inf``: not seen; a row may see none).
        group: the context-parallel group (None: the default group, a world of one without a process group).
        scale: of the scores (default ``1/sqrt(D)``); window: None or a number of keys ``W ≥ 1``; sinks: None or
            ``[Hq]`` logits joining every row's softmax and attending to nothing; deterministic: as for
            :func:`~tessel.kernels.attention.flash_attention`.

    Returns:
        ``[B, Hq, L, D]`` in q's dtype (merged in fp32).
    """
    c = group_size(group)
    _check(q, k, v, shared_k, shared_v, shared_bias, sinks, c)
    b, hq, length, d = q.shape
    hkv, n = k.shape[1], shared_k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    keys, values = sequence_from_shares(k, group, dim=2), sequence_from_shares(v, group, dim=2)
    if c == 1:
        chunks = ((slice(0, length), length),)
    else:  # rank r holds chunks r and 2c-1-r of 2c: each sees the keys up to its end
        h, r = length // 2, group_rank(group)
        chunks = ((slice(0, h), (r + 1) * h), (slice(h, length), (2 * c - r) * h))
    attend = flash_attention if d in HEAD_DIMS else wide_attention
    outs, lses = [], []
    for rows, end in chunks:
        out, lse = attend(q[:, :, rows], keys[:, :, :end], values[:, :, :end], causal=True, scale=scale,
                          window=window, deterministic=deterministic, return_lse=True)  # fmt: skip
        outs.append(out.float())
        lses.append(lse.float())
    out_w, lse_w = torch.cat(outs, dim=2), torch.cat(lses, dim=2)  # [B, Hq, L, D], [B, Hq, L]
    g = hq // hkv  # query head i reads key head i // g
    grouped = q.float().reshape(b, hkv, g, length, d)
    scores = torch.einsum("bkgld,bknd->bkgln", grouped, shared_k.float()).reshape(b, hq, length, n) * scale
    scores = scores + shared_bias.float()
    # every row's log-sum-exp with the window's (finite: each query sees itself), so no row is all -inf
    parts = [scores, lse_w.unsqueeze(-1)]
    if sinks is not None:
        parts.append(sinks.float()[None, :, None, None].expand(b, hq, length, 1))
    lse = torch.logsumexp(torch.cat(parts, dim=-1), dim=-1)
    p = torch.exp(scores - lse.unsqueeze(-1)).reshape(b, hkv, g, length, n)
    out_shared = torch.einsum("bkgln,bknd->bkgld", p, shared_v.float()).reshape(b, hq, length, d)
    return (out_w * torch.exp(lse_w - lse).unsqueeze(-1) + out_shared).to(q.dtype)
