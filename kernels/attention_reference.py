"""The plain-PyTorch definition of flash attention: forward (differentiable through autograd) and backward.

What the kernels of :mod:`.attention` are tested against (in float64 for float64 inputs), and what they
dispatch to where neither CUDA nor Triton's interpreter runs them. It materialises the ``[B, Hq, Sq, Sk]``
scores and repeats key/value heads for GQA; masks as in :mod:`.attention` (bottom-right aligned causal,
sliding window, packed-document segments, segment ids of queries and keys).
"""

from __future__ import annotations

import math

import torch

from .attention_inputs import _DTYPES, _check_softcap, _check_window, _segment_bounds, _segment_mask, _validate

__all__ = ["flash_attention_reference", "wide_attention"]


def _above_diagonal(sq: int, sk: int, device, offset: int | None = None) -> torch.Tensor:
    """``[Sq, Sk]`` bool, True where the causal mask hides key j from query i (j > i + offset; the offset is
    ``Sk - Sq`` by default, the bottom-right aligned mask)."""
    offset = sk - sq if offset is None else offset
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(offset + 1)


def _outside_window(sq: int, sk: int, window: int, device, offset: int | None = None) -> torch.Tensor:
    """``[Sq, Sk]`` bool, True where key j lies ``window`` or more places before query i
    (i + offset - j ≥ window, the offset as for :func:`_above_diagonal`)."""
    offset = sk - sq if offset is None else offset
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(offset - window)


def flash_attention_reference(q, k, v, causal=False, scale=None, *, return_lse=False, segment_ids=None, window=None,
                              softcap=None):  # fmt: skip
    """Plain-PyTorch definition of :func:`flash_attention` (differentiable through autograd).

    Computes in fp32 (in float64 when the inputs are float64, which is how tests build their exact
    reference), materialising the ``[B, Hq, Sq, Sk]`` scores and repeating key/value heads for GQA, and
    rounds the output once to the input dtype. ``lse`` is returned in the compute dtype. The causal mask
    is bottom-right aligned (``j ≤ i + Sk - Sq``); rows that see no key give 0 and ``lse = -inf``, and
    autograd through them gives zero gradients, never NaN. ``segment_ids`` and ``window`` as for
    :func:`flash_attention`, and ``softcap``: the logits ``c·tanh(s/c)``.
    """
    _validate("flash_attention_reference", q, k, v, causal, scale, (*_DTYPES, torch.float64))
    _check_window("flash_attention_reference", window, causal)
    _check_softcap("flash_attention_reference", softcap)
    segments = _segment_bounds("flash_attention_reference", segment_ids, q, k)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out, lse = _reference(q, k, v, causal, scale, segments, window, softcap=softcap)
    return (out, lse) if return_lse else out


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _query_heads(t: torch.Tensor, q: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    """Keys or values ``t`` in ``compute``, each head repeated for the query heads it serves (GQA); as they are where
    they already are (a caller that expanded them once for several tiles)."""
    group = q.shape[1] // t.shape[1]
    t = t.to(compute)
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _reference(q, k, v, causal: bool, scale: float, segments, window=None, offset=None, softcap=None):
    """``(out, lse)`` of :func:`flash_attention_reference` for validated arguments; ``segments``,
    ``window`` and ``offset`` as for :func:`_forward`."""
    compute = _compute_dtype(q)
    k, v = (_query_heads(t, q, compute) for t in (k, v))
    scores = (q.to(compute) @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if causal:
        scores = scores.masked_fill(_above_diagonal(q.shape[2], k.shape[2], q.device, offset), float("-inf"))
    if window is not None:
        scores = scores.masked_fill(_outside_window(q.shape[2], k.shape[2], window, q.device, offset), float("-inf"))
    if segments is not None:
        scores = scores.masked_fill(_segment_mask(segments, q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # A row that sees no key has lse = -inf: subtracting 0 instead makes its probabilities exp(-inf) = 0
    # (not NaN), and masked_fill's backward gives its scores a zero gradient.
    lse_finite = lse.masked_fill(torch.isneginf(lse), 0.0)
    out = (torch.exp(scores - lse_finite.unsqueeze(-1)) @ v).to(q.dtype)
    return out, lse


def _backward_reference(q, k, v, out, lse, dout, causal: bool, scale: float, segments=None, window=None, offset=None,
                        softcap=None, rounded: bool = True, dlse=None):  # fmt: skip
    """dq, dk, dv of :func:`flash_attention_backward` in plain PyTorch (fp32, float64 for float64 inputs), rounded to
    the inputs' dtypes (or with ``rounded=False`` left in the compute dtype); ``dlse``: a gradient of the returned
    log-sum-exp too (each score's share of it is its probability)."""
    compute = _compute_dtype(q)
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv
    qc, doc = q.to(compute), dout.to(compute)
    kc, vc = (_query_heads(t, q, compute) for t in (k, v))
    scores = (qc @ kc.transpose(-1, -2)) * scale
    through_cap = 1.0
    if softcap is not None:
        tanh = torch.tanh(scores / softcap)
        scores, through_cap = softcap * tanh, 1.0 - tanh * tanh  # d(c·tanh(s/c))/ds
    lse = lse.to(compute).unsqueeze(-1)
    p = torch.exp(scores - lse.masked_fill(torch.isneginf(lse), 0.0))
    if causal:
        p = p.masked_fill(_above_diagonal(sq, sk, q.device, offset), 0.0)
    if window is not None:
        p = p.masked_fill(_outside_window(sq, sk, window, q.device, offset), 0.0)
    if segments is not None:
        p = p.masked_fill(_segment_mask(segments, q.device), 0.0)
    p = p.masked_fill(torch.isneginf(lse), 0.0)  # rows that see no key
    delta = (doc * out.to(compute)).sum(-1, keepdim=True)
    if dlse is not None:
        delta = delta - dlse.to(compute).unsqueeze(-1)
    ds = p * (doc @ vc.transpose(-1, -2) - delta) * through_cap
    dq = (ds @ kc) * scale
    dk = ((ds.transpose(-1, -2) @ qc) * scale).view(b, hkv, group, sk, d).sum(2)
    dv = (p.transpose(-1, -2) @ doc).view(b, hkv, group, sk, d).sum(2)
    if not rounded:
        return dq, dk, dv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ------------------------------------------------------------------------------------- by tiles of query rows

TILE_SCORES = 1 << 26  # the scores one tile of rows holds at most (256 MiB in fp32), as far as one row allows


def _row_tiles(q: torch.Tensor, k: torch.Tensor) -> list[tuple[int, int]]:
    """``(first, end)`` query rows of each tile: ``[B, Hq, rows, Sk]`` scores of at most :data:`TILE_SCORES`."""
    b, hq, sq, _ = q.shape
    rows = max(1, TILE_SCORES // max(1, b * hq * k.shape[2]))
    return [(a, min(a + rows, sq)) for a in range(0, sq, rows)] or [(0, 0)]


def _tile(segments, offset, q, k, a: int, z: int):
    """The segment tables and the causal offset of query rows ``[a, z)``."""
    rows = None if segments is None else (segments[0][..., a:z], *segments[1:])
    return rows, (k.shape[2] - q.shape[2] if offset is None else offset) + a


def _reference_rows(q, k, v, causal: bool, scale: float, segments, window=None, offset=None, softcap=None):
    """:func:`_reference` computed by tiles of query rows (:func:`_row_tiles`): the same ``(out, lse)`` with a bounded
    ``[B, Hq, rows, Sk]`` of scores at a time. What runs heads wider than the kernels take."""
    parts, tiles = [], _row_tiles(q, k)
    if len(tiles) > 1:  # the keys and values in the compute dtype, one per query head, once for every tile
        k, v = (_query_heads(t, q, _compute_dtype(q)) for t in (k, v))
    for a, z in tiles:
        rows, at = _tile(segments, offset, q, k, a, z)
        parts.append(_reference(q[:, :, a:z], k, v, causal, scale, rows, window, at, softcap))
    out, lse = zip(*parts)
    return torch.cat(out, 2), torch.cat(lse, 2)


def _backward_reference_rows(q, k, v, out, lse, dout, causal: bool, scale: float, segments=None, window=None,
                             offset=None, softcap=None, dlse=None):  # fmt: skip
    """:func:`_backward_reference` by tiles of query rows: ``dq`` row by row, ``dk`` and ``dv`` summed over the
    tiles in the compute dtype, rounded once."""
    dqs, dk, dv, tiles = [], 0, 0, _row_tiles(q, k)
    kx, vx = (_query_heads(t, q, _compute_dtype(q)) for t in (k, v)) if len(tiles) > 1 else (k, v)  # once for all
    for a, z in tiles:
        rows, at = _tile(segments, offset, q, k, a, z)
        tile_dlse = None if dlse is None else dlse[:, :, a:z]
        dq_t, dk_t, dv_t = _backward_reference(q[:, :, a:z], kx, vx, out[:, :, a:z], lse[:, :, a:z],
                                               dout[:, :, a:z], causal, scale, rows, window, at, softcap, False,
                                               tile_dlse)  # fmt: skip
        dqs.append(dq_t)
        dk, dv = dk + dk_t, dv + dv_t
    if kx is not k:  # each key head's gradient: the sum over the query heads it serves
        b, hkv, sk, d = k.shape
        dk, dv = (t.view(b, hkv, -1, sk, d).sum(2) for t in (dk, dv))
    return torch.cat(dqs, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _WideAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, segments, window, softcap):
        out, lse = _reference_rows(q, k, v, causal, scale, segments, window, softcap=softcap)
        ctx.save_for_backward(q, k, v, out, lse, *(segments or ()))
        ctx.args = causal, scale, window, softcap
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *segments = ctx.saved_tensors
        causal, scale, window, softcap = ctx.args
        dout = torch.zeros_like(out) if dout is None else dout  # only lse was used
        dq, dk, dv = _backward_reference_rows(q, k, v, out, lse, dout, causal, scale, tuple(segments) or None, window,
                                              softcap=softcap, dlse=dlse)  # fmt: skip
        return dq, dk, dv, None, None, None, None, None


def wide_attention(q, k, v, causal=False, scale=None, *, return_lse=False, segment_ids=None, window=None,
                   softcap=None, deterministic=True):  # fmt: skip
    """:func:`flash_attention` for head dims above the kernels' largest (Gemma 4's 512): the same arguments and
    result, computed in PyTorch by tiles of query rows (a bounded block of scores at a time; the backward recomputes
    them from the saved log-sum-exp, as the kernel's does). Differentiable, in the log-sum-exp too; ``deterministic`` is
    accepted for the kernel's signature (this is always deterministic)."""
    _validate("wide_attention", q, k, v, causal, scale, (*_DTYPES, torch.float64), wide=True)
    _check_window("wide_attention", window, causal)
    _check_softcap("wide_attention", softcap)
    segments = _segment_bounds("wide_attention", segment_ids, q, k)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _WideAttention.apply(q, k, v, causal, scale, segments, window, softcap)
    else:
        out, lse = _reference_rows(q, k, v, causal, scale, segments, window, softcap=softcap)
    return (out, lse) if return_lse else out
