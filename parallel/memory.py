"""The account of memory and traffic: what one rank holds between steps and what it moves per step.

Bytes held are measured on the actual tensors: the distinct storages (``untyped_storage().nbytes()``)
behind the model's parameters and gradients, the data-parallel wrapper's flat buffers and shards, and
the optimizer's master weights and moments. A storage counts once, in the first category that holds it
(params, grads, master, moments), so views and aliases (fp32 master = parameter shard) are not double
counted; a freed FSDP buffer (resized to zero bytes) counts nothing. Bytes moved are counted by
:func:`~tessel.parallel.comm.count_bytes` around the step (ring formulas, what NCCL moves for large
messages).

DESIGN.md's formulas for ``Ψ`` parameters on ``N`` data-parallel ranks, mixed-precision Adam with
2-byte parameters (ZeRO paper, Rajbhandari et al. 2020, §5, K = 12 bytes of fp32 master + m + v):

=========  =====================  ====================
stage      held per rank          moved per step
=========  =====================  ====================
DDP (0)    2Ψ + 2Ψ + 12Ψ = 16Ψ    2Ψ (all-reduce)
ZeRO-1     2Ψ + 2Ψ + 12Ψ/N        2Ψ (reduce-scatter + all-gather)
ZeRO-2     2Ψ + 14Ψ/N             2Ψ
ZeRO-3     16Ψ/N                  3Ψ (2 all-gathers + reduce-scatter)
=========  =====================  ====================

"kΨ moved" is k ring passes over all parameters, each ``(N-1)/N · Ψ · bytes`` sent (and received) by
every rank. For fp32 parameters the master is the parameter itself: K = 8. The flat buffers pad each
bucket (FSDP unit) to a multiple of N (:mod:`.flat`): at most ``N-1`` elements per bucket on top.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["MemoryAccount", "memory_account", "zero_memory_bytes", "zero_traffic_bytes"]


@dataclass
class MemoryAccount:
    """Bytes one rank holds, by category."""

    params: int = 0
    grads: int = 0
    master: int = 0
    moments: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.moments


def _optimizer_tensors(optimizer) -> dict[str, list[torch.Tensor]]:
    if optimizer is None:
        return {}
    if hasattr(optimizer, "_memory_tensors"):
        return optimizer._memory_tensors()
    # A torch optimizer: every tensor of its state but the step counters is a moment (fp32 masters,
    # when an optimizer keeps them, are in its state too; torch's own optimizers keep none).
    moments = [
        t
        for state in optimizer.state.values()
        for key, t in state.items()
        if isinstance(t, torch.Tensor) and key != "step"
    ]
    return {"moments": moments}


def memory_account(model: nn.Module, optimizer=None) -> MemoryAccount:
    """Measure the bytes this rank holds for ``model`` (plain or wrapped in DDP/FSDP) and ``optimizer``."""
    categories: dict[str, list[torch.Tensor]] = {"params": [], "grads": [], "master": [], "moments": []}
    for p in model.parameters():
        categories["params"].append(p)
        if p.grad is not None:
            categories["grads"].append(p.grad)
    for module in model.modules():
        if hasattr(module, "_memory_tensors"):
            for key, tensors in module._memory_tensors().items():
                categories[key].extend(tensors)
    for key, tensors in _optimizer_tensors(optimizer).items():
        categories[key].extend(tensors)
    seen: set[int] = set()
    account = MemoryAccount()
    for key, tensors in categories.items():
        for t in tensors:
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes and ptr not in seen:
                seen.add(ptr)
                setattr(account, key, getattr(account, key) + nbytes)
    return account


def _optimizer_bytes_per_param(param_bytes: int) -> int:
    return 8 if param_bytes >= 4 else 12  # fp32 params are their own master


def zero_memory_bytes(numel: int, world_size: int, stage: int, param_bytes: int = 2) -> float:
    """DESIGN.md's bytes per rank for ``numel`` (Ψ) parameters: stage 0 is DDP with mixed-precision Adam."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_memory_bytes: stage must be 0, 1, 2 or 3, received {stage!r}")
    psi, n, k = numel, world_size, _optimizer_bytes_per_param(param_bytes)
    params = param_bytes * psi / (n if stage == 3 else 1)
    grads = param_bytes * psi / (n if stage >= 2 else 1)
    return params + grads + k * psi / (n if stage >= 1 else 1)


def zero_traffic_bytes(numel: int, world_size: int, stage: int, param_bytes: int = 2) -> float:
    """Bytes each rank sends (and receives) per step: 2Ψ-equivalent for stages 0-2, 3Ψ for ZeRO-3."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_traffic_bytes: stage must be 0, 1, 2 or 3, received {stage!r}")
    passes = 3 if stage == 3 else 2
    return passes * (world_size - 1) / world_size * numel * param_bytes
