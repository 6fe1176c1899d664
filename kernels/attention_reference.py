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

__all__ = ["flash_attention_reference"]


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


def _reference(q, k, v, causal: bool, scale: float, segments, window=None, offset=None, softcap=None):
    """``(out, lse)`` of :func:`flash_attention_reference` for validated arguments; ``segments``,
    ``window`` and ``offset`` as for :func:`_forward`."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = q.shape[1] // k.shape[1]
    k = k.to(compute).repeat_interleave(group, dim=1)
    v = v.to(compute).repeat_interleave(group, dim=1)
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
                        softcap=None):  # fmt: skip
    """dq, dk, dv of :func:`flash_attention_backward` in plain PyTorch (fp32, float64 for float64 inputs)."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv
    qc, doc = q.to(compute), dout.to(compute)
    kc = k.to(compute).repeat_interleave(group, dim=1)
    vc = v.to(compute).repeat_interleave(group, dim=1)
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
    ds = p * (doc @ vc.transpose(-1, -2) - delta) * through_cap
    dq = (ds @ kc) * scale
    dk = ((ds.transpose(-1, -2) @ qc) * scale).view(b, hkv, group, sk, d).sum(2)
    dv = (p.transpose(-1, -2) @ doc).view(b, hkv, group, sk, d).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
