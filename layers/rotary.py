"""Rotary position embeddings (RoFormer, Su et al. 2021) in the rotate-half layout of GPT-NeoX and Llama.

Legend: ``B`` batch, ``H`` heads, ``S`` sequence, ``D`` head dim. Dimension ``i < D/2`` of a head is
paired with dimension ``i + D/2`` and the pair is rotated by the angle ``pos · θ^(-2i/D)``, the layout
Hugging Face's Llama-family models use, so their weights load unchanged.
"""

from __future__ import annotations

import torch

from ..kernels.attention_inputs import run_starts

__all__ = ["apply_rotary", "rotary_tables", "segment_positions"]


def rotary_tables(
    seq_len: int, head_dim: int, theta: float = 10000.0, *, offset: int = 0, positions=None, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``[S, D/2]`` in fp32 for positions ``offset .. offset+S-1``, or for the
    given ``positions``: an int tensor ``[S]`` (a context-parallel rank's tokens are not contiguous), or
    ``[B, S]`` for positions that differ by row (packed documents, :func:`segment_positions`), which
    gives tables ``[B, S, D/2]``."""
    if head_dim % 2:
        raise ValueError(f"rotary_tables: head_dim must be even, received {head_dim}")
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)
    if positions is None:
        pos = torch.arange(offset, offset + seq_len, device=device, dtype=torch.float64)
    elif (not isinstance(positions, torch.Tensor) or positions.shape[-1:] != (seq_len,) or positions.dim() > 2
          or positions.is_floating_point() or positions.dtype == torch.bool):  # fmt: skip
        got = f"{positions.dtype} {tuple(positions.shape)}" if isinstance(positions, torch.Tensor) else type(positions)
        raise ValueError(f"rotary_tables: positions must be an int tensor of shape ({seq_len},) or (B, {seq_len}), "
                         f"received {got}")  # fmt: skip
    else:
        pos = positions.to(device=device, dtype=torch.float64)
    angles = pos[..., None] * inv_freq
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x_BHSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, H, S, D]`` by the tables of :func:`rotary_tables` (``[S, D/2]``, or ``[B, S, D/2]`` per
    row); computed in fp32, returned in x's dtype."""
    if not isinstance(x_BHSD, torch.Tensor) or not isinstance(cos, torch.Tensor) or not isinstance(sin, torch.Tensor):
        raise TypeError("apply_rotary: x, cos and sin must be tensors")
    if x_BHSD.dim() != 4 or x_BHSD.shape[-1] % 2:
        raise ValueError(f"apply_rotary: x must be [B, H, S, D] with an even D, received shape {tuple(x_BHSD.shape)}")
    want = (x_BHSD.shape[2], x_BHSD.shape[-1] // 2)
    for name, table in (("cos", cos), ("sin", sin)):
        if tuple(table.shape) not in (want, (x_BHSD.shape[0], *want)):
            raise ValueError(f"apply_rotary: {name} must be [S, D/2] = {list(want)} or [B, S, D/2] = "
                             f"{[x_BHSD.shape[0], *want]} for x of shape {tuple(x_BHSD.shape)}, "
                             f"received {tuple(table.shape)}")  # fmt: skip
    if cos.dim() == 3:  # per-row tables: broadcast over the heads
        cos, sin = cos[:, None], sin[:, None]
    half = x_BHSD.shape[-1] // 2
    x = x_BHSD.float()
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x_BHSD.dtype)


def segment_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position within its run of equal ``segment_ids [B, S]``: ``0, 1, …`` from the start of
    every run (a packed document's tokens take the positions they would have alone). int64, same shape."""
    if not isinstance(segment_ids, torch.Tensor) or segment_ids.dim() != 2 or segment_ids.is_floating_point():
        ok = isinstance(segment_ids, torch.Tensor)
        got = f"{segment_ids.dtype} {tuple(segment_ids.shape)}" if ok else type(segment_ids).__name__
        raise ValueError(f"segment_positions: segment_ids must be an integer [B, S] tensor, received {got}")
    index = torch.arange(segment_ids.shape[1], device=segment_ids.device).expand_as(segment_ids)
    return index - torch.where(run_starts(segment_ids), index, 0).cummax(dim=1).values
