"""Modules on the meta device: a model built without memory, split by ``parallelize``, filled by ``load_pretrained``.

``parallelize`` reads shapes, not values, except where it probes what a module of another library computes (an RMS
norm's formula, whether an MLP's activation acts feature by feature). A probe of a module on the meta device runs on
:func:`probe_copy`: the module copied to the CPU with random values, since a probe checks the computation, not the
weights.
"""

from __future__ import annotations

import copy
import itertools

import torch
from torch import nn

__all__ = ["is_meta", "probe_copy"]


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
