"""ZeroAdam: mixed-precision AdamW on ZeRO shards (ZeRO-1/2 with DDP, ZeRO-3 with FSDP).

Legend: ``N`` data-parallel size, ``Ψ`` parameter count, ``s`` one rank's shard of a bucket (``P/N``).

Each rank owns one ``[s]`` shard of every bucket (DDP) or unit (FSDP): the fp32 master weights (for fp32
parameters the parameter shard itself), the Adam moments ``m`` and ``v``, and the reduced gradient
(produced by the wrapper's reduce-scatter during backward). A step (DESIGN.md, "ZeRO and the fused
mixed-precision Adam"; Rajbhandari et al. 2020):

1. ``grad_stats`` over the owned gradient shard: sum of squares and count of non-finite elements;
   one all-reduce of those numbers over the data-parallel group (with a ``tp_group``, the part that
   belongs to tensor-parallel parameters is also summed over TP; replicated parameters count once);
2. on the device: ``grad_scale = (1 / loss_scale) · min(1, max_grad_norm / (‖g‖ + 1e-6))`` and
   ``found_inf = count > 0``;
3. ``adam_step`` per contiguous run of the shard sharing a param group: unscales and clips through
   ``grad_scale``, writes master, m, v and the low-precision parameter copy straight into the
   parameter shard, and writes nothing at all when ``found_inf`` is set (decided on the device);
4. DDP all-gathers the updated buckets in place; FSDP gathers each unit before its next forward;
5. dynamic loss scaling on the device: ×``backoff_factor`` on a non-finite step, ×``growth_factor``
   after ``growth_interval`` good steps in a row.

Expert parameters (DDP's ``expert_group``, :mod:`.ddp`) sit in buckets sharded over the
expert-data-parallel group of size ``N/ep``, so each element of each expert is owned by exactly one
rank of that group; the statistics of step 1 are still all-reduced over the whole data-parallel group:
every element of every expert is then counted once, ``‖g‖`` is the norm of the whole model, and a
non-finite expert gradient on one rank skips the step on every rank. ``state_dict`` holds this rank's
own experts (:mod:`.zero_state`).

Host synchronisation: none inside the step. A skipped step must not count towards Adam's bias
correction, and whether it was skipped is known only on the device: the flag is copied
asynchronously to the host and read at the start of the *next* step (or by ``state_dict``), long
after it was produced. Memory per rank for bf16 parameters (K = 12): ZeRO-1 ``4Ψ + 12Ψ/N``, ZeRO-2
``2Ψ + 14Ψ/N``, ZeRO-3 ``16Ψ/N`` bytes, plus the padding of :mod:`.flat` (measured by
:mod:`.memory`).
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.distributed as dist

from ..kernels.adam import adam_step, grad_stats
from .comm import all_reduce, group_rank, group_size
from .ddp import OWNER_ATTR, _ranks
from .flat import shard_tensors
from .sharding import uncounted_ranges
from .zero_state import load_zero_shards, load_zero_state, zero_shard_views, zero_state_dict

__all__ = ["ZeroAdam"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HYPER = ("lr", "betas", "eps", "weight_decay")
DYNAMIC_INITIAL_SCALE = 2.0**16  # torch.amp.GradScaler's default


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"ZeroAdam: {name} must be a real number, received {type(value).__name__} {value!r}")
    return float(value)


def _check_hyper(group: dict) -> None:
    if not _number("lr", group["lr"]) >= 0:
        raise ValueError(f"ZeroAdam: lr must be >= 0, received {group['lr']}")
    betas = group["betas"]
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise TypeError(f"ZeroAdam: betas must be a pair of numbers, received {betas!r}")
    for i, beta in enumerate(betas):
        if not 0.0 <= _number(f"betas[{i}]", beta) < 1.0:
            raise ValueError(f"ZeroAdam: betas[{i}] must be in [0, 1), received {beta}")
    if not _number("eps", group["eps"]) > 0:
        raise ValueError(f"ZeroAdam: eps must be > 0, received {group['eps']}")
    if not _number("weight_decay", group["weight_decay"]) >= 0:
        raise ValueError(f"ZeroAdam: weight_decay must be >= 0, received {group['weight_decay']}")


def _check_scaling(loss_scale, max_grad_norm, growth_interval, growth_factor, backoff_factor) -> None:
    if loss_scale is not None and loss_scale != "dynamic":
        if isinstance(loss_scale, str):
            raise ValueError(f"ZeroAdam: loss_scale must be None, a number or 'dynamic', received {loss_scale!r}")
        if not (math.isfinite(_number("loss_scale", loss_scale)) and loss_scale > 0):
            raise ValueError(f"ZeroAdam: loss_scale must be a positive finite number, received {loss_scale}")
    if max_grad_norm is not None and not _number("max_grad_norm", max_grad_norm) > 0:
        raise ValueError(f"ZeroAdam: max_grad_norm must be None or > 0, received {max_grad_norm}")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int):
        raise TypeError(f"ZeroAdam: growth_interval must be an int, received {type(growth_interval).__name__}")
    if growth_interval < 1:
        raise ValueError(f"ZeroAdam: growth_interval must be >= 1, received {growth_interval}")
    if not _number("growth_factor", growth_factor) > 1:
        raise ValueError(f"ZeroAdam: growth_factor must be > 1, received {growth_factor}")
    if not 0 < _number("backoff_factor", backoff_factor) < 1:
        raise ValueError(f"ZeroAdam: backoff_factor must be in (0, 1), received {backoff_factor}")


def _check_params(params: list) -> None:
    for i, p in enumerate(params):
        if p.dtype not in _DTYPES:
            raise TypeError(f"ZeroAdam: parameter {i} must be float32, bfloat16 or float16, received {p.dtype}")
        if p.device != params[0].device:
            raise ValueError(
                f"ZeroAdam: all parameters must be on one device; parameter 0 is on {params[0].device}, "
                f"parameter {i} on {p.device}"
            )


def _owner_of(params: list):
    owners = {id(getattr(p, OWNER_ATTR, None)): getattr(p, OWNER_ATTR, None) for p in params}
    if id(None) in owners:
        i = next(i for i, p in enumerate(params) if getattr(p, OWNER_ATTR, None) is None)
        raise ValueError(
            f"ZeroAdam: parameter {i} is not managed by a DDP or FSDP wrapper; pass the wrapper's parameters, "
            "e.g. ZeroAdam(DDP(model).parameters()) (a world of one runs the same code without collectives)"
        )
    if len(owners) > 1:
        raise ValueError(f"ZeroAdam: the parameters belong to {len(owners)} different wrappers; expected one")
    owner = next(iter(owners.values()))
    if owner.zero_stage:
        raise ValueError(f"ZeroAdam: this {type(owner).__name__} already has a ZeroAdam attached")
    return owner


def _resolve_stage(owner, stage) -> int:
    allowed = (3,) if type(owner).__name__ == "FSDP" else (1, 2)
    if stage is None:
        return allowed[-1]
    if stage not in allowed:
        raise ValueError(f"ZeroAdam: stage must be one of {allowed} with {type(owner).__name__}, received {stage!r}")
    return stage


def _check_groups(owner, group, tp_group) -> None:
    for name, g in (("group", group), ("tp_group", tp_group)):
        if g is not None and not isinstance(g, dist.ProcessGroup):
            raise TypeError(f"ZeroAdam: {name} must be None or a ProcessGroup, received {type(g).__name__}")
    if group is not None and _ranks(group) != _ranks(owner.group):
        raise ValueError(
            f"ZeroAdam: group (ranks {_ranks(group)}) must be the {type(owner).__name__} wrapper's data-parallel "
            f"group (ranks {_ranks(owner.group)})"
        )


class ZeroAdam(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, exactly torch.optim.AdamW's update) on this rank's ZeRO shard.

    Args:
        params: the parameters (or param groups) of a :class:`~tessel.parallel.DDP` (ZeRO-1/2) or
            :class:`~tessel.parallel.FSDP` (ZeRO-3) wrapper; float32, bfloat16 or float16, on one device.
        lr, betas, eps, weight_decay: as torch.optim.AdamW (per param group).
        group: the data-parallel group; ``None`` takes the wrapper's (a different one is an error).
        loss_scale: ``None``, a positive number, or ``"dynamic"`` (starts at 2**16).
        max_grad_norm: clip the global gradient norm (over dp, and over tp with ``tp_group``) to this.
        stage: 1 or 2 with DDP (default 2: only the gradient shard is kept between steps), 3 with FSDP.
        tp_group: the tensor-parallel group; parameters with ``tensor_parallel = True`` are sharded
            over it and their squares summed across it (a chunk several ranks hold, ``tp_max_chunks``, from
            one of them), the others are replicated and counted once.
        growth_interval, growth_factor, backoff_factor: the dynamic loss scale's schedule.

    All arguments are checked before anything changes. ``step()`` never synchronises with the host;
    ``state_dict()``/``load_state_dict()`` are collectives (every rank calls them).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *, group=None,
                 loss_scale=None, max_grad_norm=None, stage=None, tp_group=None, growth_interval=2000,
                 growth_factor=2.0, backoff_factor=0.5):  # fmt: skip
        defaults = {"lr": lr, "betas": tuple(betas) if isinstance(betas, list) else betas, "eps": eps,
                    "weight_decay": weight_decay}  # fmt: skip
        _check_hyper(defaults)
        _check_scaling(loss_scale, max_grad_norm, growth_interval, growth_factor, backoff_factor)
        super().__init__(params, defaults)
        for g in self.param_groups:
            _check_hyper(g)
        self._params = [p for g in self.param_groups for p in g["params"]]
        _check_params(self._params)
        owner = _owner_of(self._params)
        self.stage = _resolve_stage(owner, stage)
        _check_groups(owner, group, tp_group)
        # Everything is valid: from here on the wrapper and the optimizer state change.
        self._owner, self.group, self.tp_group = owner, owner.group, tp_group
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.growth_interval, self.growth_factor, self.backoff_factor = growth_interval, growth_factor, backoff_factor
        owner._use_zero(self.stage)
        self._build_state()
        device = self._params[0].device
        self._dynamic = loss_scale == "dynamic"
        initial = DYNAMIC_INITIAL_SCALE if self._dynamic else loss_scale
        self._scale = None if initial is None else torch.tensor(float(initial), dtype=torch.float32, device=device)
        self._growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self._applied_steps, self._skipped_steps = 0, 0
        self._last_found_inf: tuple[torch.Tensor, object] | None = None
        self.grad_norm: torch.Tensor | None = None  # the last step's global gradient norm, before clipping

    def _build_state(self) -> None:
        buckets = self._owner.buckets
        self.param_index = {id(p): i for i, p in enumerate(self._params)}
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        tp = self.tp_group is not None

        def key(p):
            gi = group_of.get(id(p))
            return None if gi is None else (gi, tp and bool(getattr(p, "tensor_parallel", False)))

        self._segments = [b.shard_segments(key) for b in buckets]
        # runs of each bucket's shard that the TP norm leaves out: chunks of a parameter replicated over TP ranks,
        # counted on the first rank holding them (tessel.parallel.sharding.uncounted_rows)
        t, r = (group_size(self.tp_group), group_rank(self.tp_group)) if tp else (1, 0)
        self._uncounted = [
            [(lo + a, lo + z) for slot, lo, hi in b.shard_slices() if key(slot.param) is not None
             for a, z in uncounted_ranges(slot.param, lo + b.shard_offset - slot.offset,
                                          hi + b.shard_offset - slot.offset, t, r)]
            for b in buckets
        ]  # fmt: skip
        low = [b for b in buckets if b.dtype != torch.float32]
        low_masters = dict(zip(map(id, low), shard_tensors(low, lambda b: torch.float32)))
        # For fp32 parameters the master is the parameter shard itself: no second copy.
        self._master = [low_masters.get(id(b), b.param_shard) for b in buckets]
        with torch.no_grad():
            for b, master in zip(buckets, self._master):
                if master is not b.param_shard:
                    master.copy_(b.param_shard)
        self._exp_avg = shard_tensors(buckets, lambda b: torch.float32)
        self._exp_avg_sq = shard_tensors(buckets, lambda b: torch.float32)

    # ------------------------------------------------------------------------------------------------ scaling

    @property
    def loss_scale(self) -> float | None:
        """The current loss scale (reads it from the device), ``None`` without scaling."""
        return None if self._scale is None else float(self._scale)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale; ``loss`` itself when there is no scaling."""
        return loss if self._scale is None else loss * self._scale

    @property
    def steps_taken(self) -> int:
        """Updates applied so far (skipped steps excluded); reads the last step's skip flag."""
        self._settle_skip()
        return self._applied_steps

    @property
    def steps_skipped(self) -> int:
        self._settle_skip()
        return self._skipped_steps

    def _settle_skip(self) -> None:
        if self._last_found_inf is None:
            return
        flag, event = self._last_found_inf
        if event is not None:
            event.synchronize()
        if float(flag) == 0:
            self._applied_steps += 1
        else:
            self._skipped_steps += 1
        self._last_found_inf = None

    def _remember_skip(self, found_inf: torch.Tensor) -> None:
        if found_inf.is_cuda:
            host = torch.empty(1, dtype=found_inf.dtype, pin_memory=True)
            host.copy_(found_inf, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._last_found_inf = (host, event)
        else:
            self._last_found_inf = (found_inf.clone(), None)

    def _grad_scale_and_found_inf(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Steps 1-2: statistics of the owned gradient shards, reduced, turned into the kernel's scalars."""
        tp = self.tp_group is not None
        device = self._params[0].device
        stats = torch.zeros(4 if tp else 2, dtype=torch.float32, device=device)  # [sumsq, count] (TP, replicated)
        for b, segments, uncounted in zip(self._owner.buckets, self._segments, self._uncounted):
            for lo, hi, (_, is_tp) in segments:
                grad_stats(b.grad_shard[lo:hi], out=stats[2:4] if tp and not is_tp else stats[0:2])
            for lo, hi in uncounted:  # another TP rank counts these (a non-finite value still counts here)
                stats[0] -= b.grad_shard[lo:hi].float().pow(2).sum()
        all_reduce(stats, self.group)
        if tp and group_size(self.tp_group) > 1:
            all_reduce(stats[0:2], self.tp_group)
        sumsq, count = (stats[0] + stats[2], stats[1] + stats[3]) if tp else (stats[0], stats[1])
        found_inf = (count > 0).to(torch.float32).reshape(1)
        inv_scale = None if self._scale is None else (1.0 / self._scale).reshape(1)
        norm = sumsq.sqrt().reshape(1)
        if inv_scale is not None:
            norm = norm * inv_scale
        self.grad_norm = norm  # a device tensor: reading it (for logging) is the caller's synchronisation
        if self.max_grad_norm is None:
            return inv_scale, found_inf
        coef = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)  # torch.nn.utils.clip_grad_norm_'s rule
        return (coef if inv_scale is None else coef * inv_scale), found_inf

    def _update_scale(self, found_inf: torch.Tensor) -> None:
        found = found_inf.reshape(()) > 0
        self._growth_tracker.copy_(torch.where(found, 0, self._growth_tracker + 1))
        grow = self._growth_tracker >= self.growth_interval
        self._scale.mul_(torch.where(found, self.backoff_factor, torch.where(grow, self.growth_factor, 1.0)))
        self._growth_tracker.masked_fill_(grow, 0)

    # ------------------------------------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):
        """Unscale, clip, update every owned shard (or skip on every rank), refresh the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if getattr(self._owner, "has_unsynced_gradients", False):
            raise RuntimeError(
                "ZeroAdam.step: gradients accumulated under no_sync() are not reduced yet; run a backward outside "
                "no_sync() or call the wrapper's sync_gradients() first"
            )
        self._settle_skip()
        grad_scale, found_inf = self._grad_scale_and_found_inf()
        step = self._applied_steps + 1
        for b, segments, master, m, v in zip(self._owner.buckets, self._segments, self._master, self._exp_avg,
                                             self._exp_avg_sq):  # fmt: skip
            low_precision = master is not b.param_shard
            for lo, hi, (gi, _) in segments:
                g = self.param_groups[gi]
                beta1, beta2 = g["betas"]
                adam_step(master[lo:hi], b.grad_shard[lo:hi], m[lo:hi], v[lo:hi], lr=g["lr"], beta1=beta1,
                          beta2=beta2, eps=g["eps"], weight_decay=g["weight_decay"], step=step,
                          grad_scale=grad_scale, found_inf=found_inf,
                          param_copy=b.param_shard[lo:hi] if low_precision else None)  # fmt: skip
        self._owner._gather_params()
        if self._dynamic:
            self._update_scale(found_inf)
        self._remember_skip(found_inf)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient: the wrapper's shards and buffers and each ``p.grad``."""
        self._owner._zero_grads()

    # ------------------------------------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Full, unsharded fp32 master weights and moments per parameter index, step and scale (a collective).

        Expert parameters' state is this rank's own experts, gathered over the expert-data-parallel group.
        """
        self._settle_skip()
        return zero_state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a :meth:`state_dict` saved at any data-parallel size; sets the parameters from the masters.

        With expert parameters the expert layout must be the same (the same ``ep``, each rank loading a
        state saved by a rank of its ep index); the expert-data-parallel size may differ.
        """
        self._settle_skip()
        load_zero_state(self, state_dict)

    def sharded_state(self) -> dict:
        """This rank's shards as live views (no copy, no communication), for sharded checkpoints.

        ``{"shards": {param index: [(start, {"master", "exp_avg", "exp_avg_sq": 1-D fp32 view})]}, "step",
        "loss_scale", "growth_tracker", "zero_stage"}``: each view holds the parameter's flattened (TP-local)
        elements ``[start, start + numel)``. To load, fill the views in place and call
        :meth:`load_sharded_state` with the saved scalars.
        """
        self._settle_skip()
        return zero_shard_views(self)

    def load_sharded_state(self, step: int, loss_scale: float | None = None, growth_tracker: int = 0) -> None:
        """Finish a load into the views of :meth:`sharded_state`: restore the step and loss scale and set the
        parameters from the masters (a collective over the data-parallel group)."""
        self._settle_skip()
        load_zero_shards(self, step, loss_scale, growth_tracker)

    def _memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        masters = [m for b, m in zip(self._owner.buckets, self._master) if m is not b.param_shard]
        return {"master": masters, "moments": [*self._exp_avg, *self._exp_avg_sq]}
