"""Process-group setup: ``init_parallel(tp, pp, dp, *, cp, ep) -> ParallelDims``.

The world is laid out as a ``DeviceMesh`` of shape ``(dp, pp, tp)``, tp innermost, so the ranks of one
tensor-parallel group are adjacent (on a multi-GPU node they share NVLink). With context parallelism
(``cp > 1``, the sequence split over ranks: :mod:`.context`) the mesh is ``(dp, cp, pp, tp)`` with the
dimension names ``("dp", "cp", "pp", "tp")``. Every layer and wrapper takes its group explicitly from
the returned :class:`ParallelDims`: there is no global singleton.

Expert parallelism (``ep > 1``, mixtures of experts) runs over the data-parallel dimension: the ``dp``
ranks are cut into groups of ``ep`` consecutive ones, and the ranks of one such ep group hold different
experts (tokens travel to their expert by all-to-all within it). A rank with dp index ``d`` has ep rank
``d % ep``; the ranks with the same ep rank (every ``d // ep`` and every cp index) hold the same experts
and form the expert-data-parallel group, over which DDP reduces and ZeroAdam shards the experts::

    dp = 4, ep = 2:   dp index d         0  1  2  3
                      ep rank d % ep     0  1  0  1
                      ep groups          {0, 1}  {2, 3}
                      expert-dp groups   {0, 2}  {1, 3}
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["ParallelDims", "init_parallel", "shutdown"]


@dataclass
class ParallelDims:
    """The parallel layout of this process: sizes, mesh, groups and this rank's place in each."""

    tp: int
    pp: int
    dp: int
    world_size: int
    rank: int
    backend: str
    device: torch.device
    mesh: DeviceMesh = field(repr=False)
    cp: int = 1
    _dp_cp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    ep: int = 1
    _ep_group: dist.ProcessGroup | None = field(default=None, repr=False)
    _expert_dp_group: dist.ProcessGroup | None = field(default=None, repr=False)

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """The context-parallel group; ``None`` when ``cp == 1`` (layers then split no sequence)."""
        return self.mesh.get_group("cp") if self.cp > 1 else None

    @property
    def cp_rank(self) -> int:
        return self.mesh.get_local_rank("cp") if self.cp > 1 else 0

    @property
    def dp_cp_group(self) -> dist.ProcessGroup:
        """The ranks that hold the same parameters (same pp and tp place): dp × cp, over which gradients are
        averaged and ZeRO shards; the DP group when ``cp == 1``."""
        return self.dp_group if self.cp == 1 else self._dp_cp_group

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """The expert-parallel group: the ``ep`` ranks (same cp, pp and tp place) among which each holds
        different experts; ``None`` when ``ep == 1``."""
        return self._ep_group if self.ep > 1 else None

    @property
    def ep_rank(self) -> int:
        """This rank's index in its ep group (``dp_rank % ep``): which experts it holds."""
        return self.dp_rank % self.ep

    @property
    def expert_dp_group(self) -> dist.ProcessGroup:
        """The ranks that hold the same experts (same ep rank, pp and tp place; every cp index): DDP's
        ``expert_group``, over which expert gradients are summed and ZeRO shards them; ``dp_cp_group``
        when ``ep == 1``."""
        return self.dp_cp_group if self.ep == 1 else self._expert_dp_group

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("tp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("pp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("dp")

    @property
    def tp_rank(self) -> int:
        return self.mesh.get_local_rank("tp")

    @property
    def pp_rank(self) -> int:
        return self.mesh.get_local_rank("pp")

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")


def _check_size(name: str, value, allow_minus_one: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"init_parallel: {name} must be an int, received {type(value).__name__} {value!r}")
    if value < 1 and not (allow_minus_one and value == -1):
        expected = "a positive int or -1 (all remaining ranks)" if allow_minus_one else "a positive int"
        raise ValueError(f"init_parallel: {name} must be {expected}, received {value}")


def _resolve_dp(tp: int, pp: int, dp: int, world_size: int, cp: int = 1) -> int:
    if dp == -1:
        if world_size % (cp * tp * pp):
            names, sizes = ("cp*pp*tp", f"{cp}*{pp}*{tp}") if cp > 1 else ("tp*pp", f"{tp}*{pp}")
            raise ValueError(
                f"init_parallel: the world size {world_size} is not divisible by {names} = {sizes} = {cp * tp * pp}"
            )
        dp = world_size // (cp * tp * pp)
    if dp * cp * pp * tp != world_size:
        names, sizes = ("dp*cp*pp*tp", f"{dp}*{cp}*{pp}*{tp}") if cp > 1 else ("dp*pp*tp", f"{dp}*{pp}*{tp}")
        raise ValueError(
            f"init_parallel: {names} = {sizes} = {dp * cp * pp * tp} must equal the world size {world_size}"
        )
    return dp


def _dp_cp_group(dp: int, cp: int, pp: int, tp: int) -> dist.ProcessGroup:
    """This rank's group of the ranks with its pp and tp place (every rank creates every such group)."""
    groups = [
        [((d * cp + c) * pp + p) * tp + t for d in range(dp) for c in range(cp)] for p in range(pp) for t in range(tp)
    ]
    return dist.new_subgroups_by_enumeration(groups)[0]


def _expert_groups(dp: int, cp: int, pp: int, tp: int, ep: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's ep group and expert-data-parallel group; dp index ``d`` is replica ``d // ep``, ep rank
    ``d % ep`` (every rank creates every group, in the same order)."""

    def rank(d, c, p, t):
        return ((d * cp + c) * pp + p) * tp + t

    places = [(c, p, t) for c in range(cp) for p in range(pp) for t in range(tp)]
    ep_groups = [[rank(q * ep + e, *place) for e in range(ep)] for q in range(dp // ep) for place in places]
    expert_dp_groups = [
        [rank(q * ep + e, c, p, t) for q in range(dp // ep) for c in range(cp)]
        for e in range(ep)
        for p in range(pp)
        for t in range(tp)
    ]
    return dist.new_subgroups_by_enumeration(ep_groups)[0], dist.new_subgroups_by_enumeration(expert_dp_groups)[0]


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _check_rendezvous(world_size: int) -> None:
    """A world of several ranks needs torchrun's rendezvous address; refuse before creating any group."""
    if world_size > 1 and "MASTER_ADDR" not in os.environ:
        raise RuntimeError(
            f"init_parallel: WORLD_SIZE={world_size} is set but MASTER_ADDR is not; launch with torchrun, "
            "or unset WORLD_SIZE for a world of one"
        )


def _init_process_group(backend: str) -> None:
    """Join the torchrun world from the environment, or make a world of one without torchrun."""
    timeout = datetime.timedelta(seconds=int(os.environ.get("TESSEL_PG_TIMEOUT", "600")))
    if "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def init_parallel(
    tp: int = 1, pp: int = 1, dp: int = -1, backend: str | None = None, *, cp: int = 1, ep: int = 1
) -> ParallelDims:
    """Initialise (if needed) the default process group and build the ``("dp", "pp", "tp")`` mesh.

    Args:
        tp, pp: tensor- and pipeline-parallel sizes (positive).
        dp: data-parallel size; ``-1`` takes the world size divided by ``cp*tp*pp``.
        backend: ``"nccl"`` or ``"gloo"``; default NCCL when CUDA is available, gloo otherwise. Ignored
            when the default process group already exists.
        cp: context-parallel size (positive): ranks that split each sequence between them. With
            ``cp > 1`` the mesh is ``("dp", "cp", "pp", "tp")`` and ``dp*cp*pp*tp`` is the world size.
        ep: expert-parallel size, a positive divisor of ``dp``: groups of ``ep`` data-parallel ranks each
            hold different experts (``ep_group``, ``ep_rank``, ``expert_dp_group``). It adds no mesh
            dimension: the world size stays ``dp*cp*pp*tp``.

    Under ``torchrun`` the world comes from the environment; a single process without it is a world
    of one. Raises ``TypeError``/``ValueError`` when a size is not an int, not positive, ``dp*pp*tp``
    is not the world size or ``ep`` does not divide ``dp``, and ``RuntimeError`` when ``WORLD_SIZE`` > 1
    comes without ``MASTER_ADDR``; all of this is checked before any process group is created.
    """
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
        _check_size(name, value)
    _check_size("dp", dp, allow_minus_one=True)
    if backend is not None and backend not in ("nccl", "gloo"):
        raise ValueError(f"init_parallel: backend must be 'nccl', 'gloo' or None, received {backend!r}")
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    dp = _resolve_dp(tp, pp, dp, world_size, cp)
    if dp % ep:
        raise ValueError(f"init_parallel: ep must divide the data-parallel size dp = {dp}, received {ep}")
    if not dist.is_initialized():
        _check_rendezvous(world_size)
        _init_process_group(backend or _default_backend())
    backend = dist.get_backend()
    device_type = "cuda" if backend == "nccl" else "cpu"
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    if cp == 1:
        mesh = init_device_mesh(device_type, (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
        dp_cp = None
    else:
        mesh = init_device_mesh(device_type, (dp, cp, pp, tp), mesh_dim_names=("dp", "cp", "pp", "tp"))
        dp_cp = _dp_cp_group(dp, cp, pp, tp)
    ep_group, expert_dp = _expert_groups(dp, cp, pp, tp, ep) if ep > 1 else (None, None)
    return ParallelDims(tp, pp, dp, world_size, dist.get_rank(), backend, device, mesh, cp, dp_cp, ep, ep_group,
                        expert_dp)  # fmt: skip


def shutdown() -> None:
    """End this process's part in the world cleanly: barrier, then destroy every process group.

    With gloo, a process that exits while a ``DeviceMesh`` and its subgroups are alive can abort at
    interpreter exit; entry points call this and then exit deliberately.
    """
    if not dist.is_initialized():
        return
    dist.barrier()
    dist.destroy_process_group()
