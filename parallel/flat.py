"""Flat, shard-aligned parameter and gradient buffers shared by DDP, ZeroAdam and FSDP.

Legend: ``N`` data-parallel size, ``r`` this rank's index in the data-parallel group, ``P`` a bucket's
padded numel (a multiple of ``N``), ``s = P/N`` the numel of one rank's shard of a bucket.

Trainable parameters are taken in the order backward produces their gradients (reverse registration
order, the usual approximation: the last layer's gradients are ready first) and cut into buckets of about
``bucket_numel`` elements without splitting a parameter; a bucket holds one dtype on one device. Each
bucket is padded with zeros to a multiple of ``N``, so that rank r's shard is the contiguous slice
``[r·s, (r+1)·s)`` of the bucket and reduce-scatter and all-gather run in place on views::

    params (backward order):  p5 p4 p3 | p2 p1 p0
    flat buffer:              | p5 p4 p3 pad | p2 p1 p0 pad |      one buffer per (dtype, device)
    shards, N = 2:            |  r0  |  r1   |  r0   |  r1  |      a shard may cut through a parameter

Padding costs at most ``N-1`` elements per bucket (per FSDP unit, which is one bucket): with 25 MB
buckets that is below 1e-5 of the buffer; every byte-count formula in tessel adds it explicitly. Padding
is zero in the parameters, gradients, master weights and moments and stays zero: AdamW maps a zero
parameter with zero gradient and zero moments to zero.

Each parameter's ``.data`` becomes a view of its slot in the flat buffer (``p.data = view``), so modules
keep their parameters and every update of the buffer is seen by the module without a copy.

Expert parameters (``p.expert_parallel = True``: different values on the ranks of an expert-parallel
group) are reduced and sharded over another group than the dense ones (the ranks holding the same
experts), so they never share a bucket with dense parameters: each bucket carries its own ``group``,
and for an expert bucket ``N`` and ``r`` are that group's size and this rank's index in it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "Bucket",
    "Slot",
    "backward_order",
    "flatten_into_buffers",
    "is_expert",
    "make_buckets",
    "padded_numel",
    "shard_tensors",
]


def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``world_size`` (the shard arithmetic of one bucket)."""
    return -(-numel // world_size) * world_size


def is_expert(t: torch.Tensor) -> bool:
    """Whether ``t`` is marked ``expert_parallel = True``: its values differ across an expert-parallel group."""
    return bool(getattr(t, "expert_parallel", False))


def backward_order(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, param)`` of the trainable parameters of ``module`` in the order backward produces their grads.

    Reverse registration order; a parameter registered twice (tied weights) appears once, under its first name.
    """
    return [(name, p) for name, p in reversed(list(module.named_parameters())) if p.requires_grad]


@dataclass(eq=False)
class Slot:
    """Where one parameter lives in its bucket: elements ``[offset, offset + numel)``."""

    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size


class Bucket:
    """Consecutive parameters of one dtype and device, padded to a multiple of the size of ``group``.

    ``group`` (``None``: the default group, or a world of one) is the group every collective of the bucket
    runs over, ``world_size`` and ``rank`` its size and this rank's index in it; ``expert`` says whether the
    bucket holds expert parameters (then ``group`` is the expert-data-parallel group). The owner (DDP or
    FSDP) sets the tensors:

    - ``params``: the full bucket ``[P]`` of parameters (a view into the flat buffer for DDP; FSDP's own
      storage, resized to zero bytes while the unit is sharded);
    - ``param_shard``: this rank's ``[s]`` parameters (a view into ``params`` for DDP, FSDP's own tensor);
    - ``grad``: the full ``[P]`` gradient while one is held, else ``None``;
    - ``grad_shard``: this rank's ``[s]`` reduced gradient (ZeroAdam reads it), else ``None``.
    """

    def __init__(self, slots: list[Slot], world_size: int, rank: int, group=None):
        assert slots, "a bucket holds at least one parameter"
        first = slots[0].param
        self.slots = slots
        self.dtype, self.device, self.expert = first.dtype, first.device, is_expert(first)
        self.group = group
        self.numel = sum(slot.numel for slot in slots)
        self.padded = padded_numel(self.numel, world_size)
        self.world_size, self.rank = world_size, rank
        self.shard_numel = self.padded // world_size
        self.shard_offset = rank * self.shard_numel
        self.params: torch.Tensor | None = None
        self.param_shard: torch.Tensor | None = None
        self.grad: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's ``[s]`` slice of a ``[P]`` tensor laid out like the bucket."""
        return full.narrow(0, self.shard_offset, self.shard_numel)

    def slot_view(self, full: torch.Tensor, slot: Slot) -> torch.Tensor:
        """``slot``'s parameter-shaped view of a ``[P]`` tensor laid out like the bucket."""
        return full.narrow(0, slot.offset, slot.numel).view(slot.shape)

    def shard_slices(self) -> list[tuple[Slot, int, int]]:
        """``(slot, lo, hi)`` for each parameter overlapping this rank's shard, in shard coordinates.

        The parameter's flattened elements ``[lo + shard_offset - slot.offset, hi + shard_offset -
        slot.offset)`` sit at ``[lo, hi)`` of the shard.
        """
        out = []
        for slot in self.slots:
            lo = max(slot.offset, self.shard_offset) - self.shard_offset
            hi = min(slot.offset + slot.numel, self.shard_offset + self.shard_numel) - self.shard_offset
            if hi > lo:
                out.append((slot, lo, hi))
        return out

    def shard_segments(self, key: Callable[[nn.Parameter], Hashable | None]) -> list[tuple[int, int, Hashable]]:
        """Maximal runs ``(lo, hi, k)`` of this rank's shard whose parameters share ``key(param) = k``.

        Parameters whose key is ``None`` (not optimised) and the padding belong to no run. One fused
        kernel launch per run applies one set of hyperparameters (a param group) to a contiguous slice.
        """
        runs: list[tuple[int, int, Hashable]] = []
        for slot, lo, hi in self.shard_slices():
            k = key(slot.param)
            if k is None:
                continue
            if runs and runs[-1][2] == k and runs[-1][1] == lo:
                runs[-1] = (runs[-1][0], hi, k)
            else:
                runs.append((lo, hi, k))
        return runs

    def __repr__(self) -> str:
        return (f"Bucket({len(self.slots)} {'expert ' if self.expert else ''}params, {self.dtype}, "
                f"numel={self.numel}, padded={self.padded}, "
                f"shard=[{self.shard_offset}, {self.shard_offset + self.shard_numel}))")  # fmt: skip


def make_buckets(
    named_params: Iterable[tuple[str, nn.Parameter]],
    world_size: int,
    rank: int,
    bucket_bytes: int | None,
    *,
    group=None,
    expert_layout: tuple[object, int, int] | None = None,
) -> list[Bucket]:
    """Cut parameters (already in backward order) into buckets of at most ``bucket_bytes`` bytes.

    A parameter larger than a bucket gets a bucket of its own; a change of dtype, device or of expert
    versus dense (:func:`is_expert`) starts a new bucket. ``bucket_bytes=None`` puts everything of one
    such run into a single bucket. Dense buckets are laid out over ``group`` (``world_size`` ranks, this
    one ``rank``), expert buckets over ``expert_layout = (group, world_size, rank)`` (default: as dense).
    """
    dense_layout = (group, world_size, rank)
    expert_layout = expert_layout or dense_layout
    buckets: list[Bucket] = []
    current: list[Slot] = []
    size = 0

    def close():
        nonlocal current, size
        if current:
            g, n, r = expert_layout if is_expert(current[0].param) else dense_layout
            buckets.append(Bucket(current, n, r, g))
        current, size = [], 0

    def kind(p):
        return p.dtype, p.device, is_expert(p)

    for name, p in named_params:
        nbytes = p.numel() * p.element_size()
        if current and (
            kind(p) != kind(current[0].param) or (bucket_bytes is not None and size + nbytes > bucket_bytes)
        ):
            close()
        offset = sum(slot.numel for slot in current)
        current.append(Slot(name, p, offset, p.numel(), p.shape))
        size += nbytes
    close()
    return buckets


def flatten_into_buffers(buckets: list[Bucket]) -> dict[tuple[torch.dtype, torch.device], torch.Tensor]:
    """Pack the buckets' parameters into one zero-padded flat buffer per (dtype, device).

    Sets each bucket's ``params`` (a ``[P]`` view of its buffer) and ``param_shard``, copies every
    parameter's values into its slot and points ``p.data`` at the slot. Returns the buffers.
    """
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    starts = []
    for bucket in buckets:
        key = (bucket.dtype, bucket.device)
        starts.append(sizes.get(key, 0))
        sizes[key] = starts[-1] + bucket.padded
    buffers = {key: torch.zeros(n, dtype=key[0], device=key[1]) for key, n in sizes.items()}
    with torch.no_grad():
        for bucket, start in zip(buckets, starts):
            bucket.params = buffers[(bucket.dtype, bucket.device)].narrow(0, start, bucket.padded)
            bucket.param_shard = bucket.shard_of(bucket.params)
            for slot in bucket.slots:
                view = bucket.slot_view(bucket.params, slot)
                view.copy_(slot.param.detach())
                slot.param.data = view
    return buffers


def shard_tensors(buckets: list[Bucket], dtype_of: Callable[[Bucket], torch.dtype]) -> list[torch.Tensor]:
    """One zeroed ``[s]`` shard per bucket, cut from a single contiguous tensor per (dtype, device).

    Used for ZeRO-2 gradient shards (``dtype_of`` the bucket's dtype) and for fp32 master weights and
    moments (``dtype_of`` fp32): few storages, so the memory account and a checkpoint see flat tensors.
    """
    totals: dict[tuple[torch.dtype, torch.device], int] = {}
    for bucket in buckets:
        key = (dtype_of(bucket), bucket.device)
        totals[key] = totals.get(key, 0) + bucket.shard_numel
    flats = {key: torch.zeros(n, dtype=key[0], device=key[1]) for key, n in totals.items()}
    offsets = dict.fromkeys(totals, 0)
    out = []
    for bucket in buckets:
        key = (dtype_of(bucket), bucket.device)
        out.append(flats[key].narrow(0, offsets[key], bucket.shard_numel))
        offsets[key] += bucket.shard_numel
    return out
