"""Values derived from a tensor, computed once and kept on it while it is unchanged.

Every layer of a forward receives the same per-batch tensors (packed documents' ``segment_ids``, Hugging
Face's attention mask), and each would otherwise rebuild the same tables from them: segment bounds,
rotary tables, ring-step tables, a few small kernels per layer, again under activation recomputation.
:func:`kept_on` computes such a value once and stores it on the tensor it derives from, keyed by the
tensor's version counter: an in-place change of the tensor drops what was kept.

Nothing is kept for inference tensors (they have no version counter) or while inference mode is on
(its tensors cannot be saved for a later backward), and nothing outlives the tensor. Under ``torch.compile``
the value is computed where it is asked for: a graph holds no Python attributes of tensors, and computing
the value again costs a compiled graph little.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

__all__ = ["kept_on", "kept_with"]

T = TypeVar("T")
_ATTR = "_tessel_kept"


def kept_on(tensor: torch.Tensor, key: Hashable, make: Callable[[], T]) -> T:
    """``make()``, computed on the first call for ``(tensor, key)`` and returned again while ``tensor`` is not
    modified in place. ``key`` must name everything besides ``tensor``'s contents that the value depends on."""
    if torch.compiler.is_compiling() or tensor.is_inference() or torch.is_inference_mode_enabled():
        return make()
    version = tensor._version
    kept = tensor.__dict__.get(_ATTR)
    if kept is None or kept[0] != version:
        kept = (version, {})
        setattr(tensor, _ATTR, kept)
    values = kept[1]
    if key not in values:
        values[key] = make()
    return values[key]


def kept_with(tensor: torch.Tensor, other: torch.Tensor, key: Hashable, make: Callable[[], T]) -> T:
    """:func:`kept_on` for a value derived from two tensors: kept on ``tensor`` and returned again while
    ``tensor`` is unchanged and ``other`` is the same tensor object, unchanged (held weakly: keeping the
    value does not keep ``other`` alive, and a new tensor at the same address is not mistaken for it). One
    value per key: another ``other`` replaces it."""
    if (
        torch.compiler.is_compiling()
        or tensor.is_inference()
        or other.is_inference()
        or torch.is_inference_mode_enabled()
    ):
        return make()
    slot = kept_on(tensor, key, lambda: [None, None, None])  # [weak ref, version, value]: the latest other's
    ref, version, value = slot
    if ref is not None and ref() is other and version == other._version:
        return value
    value = make()
    slot[:] = [weakref.ref(other), other._version, value]
    return value
