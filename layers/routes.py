"""Counting a mixture of experts' routes per expert, on the device alone."""

from __future__ import annotations

import torch

__all__ = ["sorted_counts"]


def sorted_counts(ids: torch.Tensor, n: int) -> torch.Tensor:
    """How many of the non-decreasing ``ids`` equal each of ``0 … n-1`` (ids of ``n`` and above count for none), as
    int64: ``torch.bincount`` without its host synchronisation (on a GPU it reads the ids' minimum and maximum on
    the host to size its output), by binary search of each value's first position."""
    return torch.searchsorted(ids, torch.arange(n + 1, device=ids.device, dtype=ids.dtype)).diff()
