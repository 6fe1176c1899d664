"""Modules on the meta device: a model built without memory, split by ``parallelize``, filled by ``load_pretrained``.

``parallelize`` reads shapes, not values, except where it probes what a module of another library computes (an RMS
norm's formula, whether an MLP's activation acts feature by feature). A probe of a module on the meta device runs on
:func:`probe_copy`: the module copied to the CPU with random values, since a probe checks the computation, not the
weights.

A buffer ``parallelize`` computes from a whole one that checkpoints do not hold (Falcon-H1's per-feature multipliers,
of which each rank keeps its features' share) is registered by :func:`derived_buffer`, which records how: on the meta
device it has no values yet, and ``load_pretrained`` computes the whole (by the model's own initialisation), then this
rank's share of it.
"""

from __future__ import annotations

import copy
import itertools

import torch
from torch import nn

__all__ = ["derived_buffer", "derived_buffers", "is_meta", "probe_copy"]


def is_meta(module: nn.Module) -> bool:
    """Whether any of ``module``'s parameters or buffers is on the meta device."""
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def probe_copy(module: nn.Module) -> nn.Module:
    """``module`` itself, or where it is on the meta device a copy on the CPU whose floating-point parameters and
    buffers are drawn from N(0, 1) (a fixed seed) and whose others are zeros."""
    if not is_meta(module):
        return module
    clone = copy.deepcopy(module).to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in itertools.chain(clone.parameters(), clone.buffers()):
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype) if t.is_floating_point() else torch.zeros_like(t))
    return clone


def derived_buffer(module: nn.Module, name: str, whole: torch.Tensor, local_of) -> None:
    """Register ``local_of(whole)`` as ``module``'s non-persistent buffer ``name``, recording ``whole``'s shape and
    dtype and ``local_of``, so that :func:`derived_buffers` can tell how to compute it where ``whole`` had no values."""
    module.register_buffer(name, local_of(whole).clone(), persistent=False)
    module.__dict__.setdefault("_tessel_derived", {})[name] = (tuple(whole.shape), whole.dtype, local_of)


def derived_buffers(module: nn.Module) -> dict:
    """``{buffer name: (whole shape, dtype, local_of)}`` of the buffers :func:`derived_buffer` registered on
    ``module`` itself."""
    return module.__dict__.get("_tessel_derived", {})
