"""FSDP units: which modules are sharded together (the wrap policy) and one unit's gather/free life cycle.

A unit is a set of parameters gathered and freed together: one flat bucket (:mod:`.flat`) of ``P``
elements, padded to a multiple of the data-parallel size ``N``, of which this rank keeps the ``[s]``
shard (``s = P/N``). The default policy makes each child of an ``nn.ModuleList``/``nn.Sequential`` with
parameters a unit (the transformer blocks of a GPT), without descending into a unit; the root unit
holds the parameters left over (embeddings, final norm, head).

Freeing resizes the unit's flat storage to zero bytes; its parameters stay views of that storage (with
their shapes), and gathering resizes it back and all-gathers into it, so every reference to a parameter
(modules, autograd's saved tensors) sees the gathered values without being rewired.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .comm import all_gather
from .flat import Bucket, Slot

__all__ = ["Unit", "assign_params", "choose_units"]


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _policy(wrap) -> Callable[[nn.Module], bool] | None:
    if wrap is None:
        return None
    if isinstance(wrap, type) and issubclass(wrap, nn.Module):
        wrap = {wrap}
    if isinstance(wrap, set | frozenset | tuple | list):
        classes = tuple(wrap)
        if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise TypeError(f"FSDP: wrap must be None, a set of nn.Module classes or a callable, received {wrap!r}")
        return lambda m: isinstance(m, classes)
    if callable(wrap):
        return wrap
    raise TypeError(f"FSDP: wrap must be None, a set of nn.Module classes or a callable, received {wrap!r}")


def choose_units(module: nn.Module, wrap) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of the units, outermost first, in registration order (not the root)."""
    policy = _policy(wrap)
    units: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, mod: nn.Module) -> None:
        container = isinstance(mod, nn.ModuleList | nn.Sequential)
        for name, child in mod.named_children():
            qualified = f"{prefix}{name}"
            chosen = container if policy is None else policy(child)
            if chosen and _has_params(child):
                units.append((qualified, child))
            else:
                visit(qualified + ".", child)

    visit("", module)
    return units


def assign_params(module: nn.Module, units: list[tuple[str, nn.Module]]) -> list[list[tuple[str, nn.Parameter]]]:
    """Each unit's ``(name, param)`` (then the root's, last, possibly empty); raises if a unit cannot be sharded.

    A parameter registered under two units (tied across units) cannot live in one unit's shard and be
    gathered by the other's, and a unit's flat buffer has one dtype and one device.
    """
    prefixes = [name + "." for name, _ in units]
    owner: dict[int, int] = {}
    names: dict[int, str] = {}
    assigned: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(len(units) + 1)]
    for name, p in module.named_parameters(remove_duplicate=False):
        u = next((i for i, prefix in enumerate(prefixes) if name.startswith(prefix)), len(units))
        if id(p) in owner and owner[id(p)] != u:
            where = [units[i][0] if i < len(units) else "the root" for i in (owner[id(p)], u)]
            raise ValueError(
                f"FSDP: parameter {names[id(p)]!r} is shared by unit {where[0]!r} and unit {where[1]!r} (as "
                f"{name!r}); a parameter must belong to one unit: wrap the modules that share it in one unit"
            )
        if id(p) not in owner:
            owner[id(p)], names[id(p)] = u, name
            assigned[u].append((name, p))
    for i, params in enumerate(assigned):
        kinds = {(p.dtype, p.device) for _, p in params}
        if len(kinds) > 1:
            unit = units[i][0] if i < len(units) else "the root"
            found = ", ".join(sorted(f"{d} on {dev}" for d, dev in kinds))
            raise ValueError(
                f"FSDP: unit {unit!r} mixes parameter dtypes/devices ({found}); a unit's flat shard needs one "
                "dtype on one device"
            )
    return assigned


class Unit:
    """One unit's flat buffer ``full [P]`` (own storage, zero bytes while sharded) and its ``[s]`` shards."""

    def __init__(self, name: str, module: nn.Module | None, named: list[tuple[str, nn.Parameter]], group,
                 world_size: int, rank: int, live: dict[int, Unit]):  # fmt: skip
        slots, offset = [], 0
        for pname, p in named:
            slots.append(Slot(pname, p, offset, p.numel(), p.shape))
            offset += p.numel()
        self.name, self.module, self.group = name, module, group
        self.bucket = Bucket(slots, world_size, rank, group)  # its collectives (and checkpoints) run over group
        self.trainable = sum(p.requires_grad for _, p in named)
        self.full = torch.zeros(self.bucket.padded, dtype=self.bucket.dtype, device=self.bucket.device)
        self.bucket.params = self.full
        self._work = None
        self._live = live  # storage address -> unit, for every unit whose parameters hold storage
        self.state = "gathered"  # "free" | "gathering" | "gathered"
        live[self.storage_ptr] = self
        self.ready = 0  # trainable parameters whose gradient arrived in this backward
        self.accumulated = False  # grad_shard holds reduced gradients not yet zeroed

    @property
    def storage_ptr(self) -> int:
        return self.full.untyped_storage().data_ptr()

    def adopt_params(self) -> None:
        """Copy the parameters into the (gathered) flat buffer and point each ``p.data`` at its slot."""
        with torch.no_grad():
            for slot in self.bucket.slots:
                view = self.bucket.slot_view(self.full, slot)
                view.copy_(slot.param.detach())
                slot.param.data = view

    def gather_async(self) -> None:
        if self.state != "free":
            return
        self.full.untyped_storage().resize_(self.bucket.padded * self.full.element_size())
        self._live[self.storage_ptr] = self
        _, self._work = all_gather(self.bucket.param_shard, self.group, out=self.full, async_op=True)
        self.state = "gathering"

    def wait(self) -> None:
        if self.state == "gathering":
            self._work.wait()
            self._work, self.state = None, "gathered"

    def gather(self) -> None:
        self.gather_async()
        self.wait()

    def free(self) -> None:
        if self.state == "free":
            return
        self.wait()
        del self._live[self.storage_ptr]
        self.full.untyped_storage().resize_(0)
        self.state = "free"
