"""ZeroAdam checkpoints, whole or in shards.

:func:`zero_state_dict` / :func:`load_zero_state`: full, unsharded fp32 state, independent of the
data-parallel size (every rank holds every parameter's state while it exists).
:func:`zero_shard_views` / :func:`load_zero_shards`: this rank's shards only, as views of the live
buffers, for a checkpoint writer that stores each rank's pieces and a reader that fills them in place
(``tessel.bench.checkpoint`` with ``torch.distributed.checkpoint``): nothing is gathered.

Saving all-gathers every bucket's master, ``exp_avg`` and ``exp_avg_sq`` shards and cuts them into
per-parameter tensors (on the CPU, in the parameter's shape) keyed like torch optimizers' state: the
parameter's index in the optimizer's parameter order. Loading slices each parameter's tensors into this
rank's shards (whatever the data-parallel size the checkpoint was saved at), then writes the parameters
from the masters and all-gathers them, so the model and the optimizer agree exactly.

Expert parameters (a DDP with an ``expert_group``) are gathered over the expert-data-parallel group
only, so each rank's state holds the experts it owns: expert state is per expert-parallel rank. A
checkpoint loads into the same expert layout (the same ``ep``, each rank loading the state saved by a
rank of its own ep index); the expert-data-parallel size, like the data-parallel size, may differ. Expert
parameters that name their experts (``expert_range``, set by ``parallelize(ep_group=)``) save that range
(``"experts"``), and loading it into a rank holding other experts is refused.

Format::

    {"state": {i: {"master": fp32, "exp_avg": fp32, "exp_avg_sq": fp32}},   # param i's full tensors
     "param_groups": [{"lr", "betas", "eps", "weight_decay", ..., "params": [i, ...]}],
     "step": updates applied, "loss_scale": float | None, "growth_tracker": int,
     "zero_stage": 1 | 2 | 3, "world_size": N at save time (informational)}
"""

from __future__ import annotations

import torch

from .comm import all_gather

__all__ = ["load_zero_shards", "load_zero_state", "zero_shard_views", "zero_state_dict"]

_KEYS = ("master", "exp_avg", "exp_avg_sq")


def _bucket_tensors(opt):
    return zip(opt._owner.buckets, opt._master, opt._exp_avg, opt._exp_avg_sq)


def zero_state_dict(opt) -> dict:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for bucket, *shards in _bucket_tensors(opt):
        fulls = [all_gather(shard.float(), bucket.group)[0] for shard in shards]
        for slot in bucket.slots:
            i = opt.param_index.get(id(slot.param))
            if i is not None:
                state[i] = {k: bucket.slot_view(full, slot).cpu().clone() for k, full in zip(_KEYS, fulls)}
                if getattr(slot.param, "expert_range", None) is not None:  # which experts this rank's state holds
                    state[i]["experts"] = tuple(slot.param.expert_range)
    groups = []
    for g in opt.param_groups:
        saved = {k: v for k, v in g.items() if k != "params"}
        saved["params"] = [opt.param_index[id(p)] for p in g["params"]]
        groups.append(saved)
    return {
        "state": state,
        "param_groups": groups,
        "step": opt._applied_steps,
        "loss_scale": opt.loss_scale,
        "growth_tracker": int(opt._growth_tracker),
        "zero_stage": opt.stage,
        "world_size": opt._owner.world_size,
    }


def _check_state_dict(opt, sd) -> None:
    if not isinstance(sd, dict):
        raise TypeError(f"ZeroAdam.load_state_dict: expected a dict, received {type(sd).__name__}")
    missing = [k for k in ("state", "param_groups", "step", "loss_scale", "growth_tracker") if k not in sd]
    if missing:
        raise ValueError(f"ZeroAdam.load_state_dict: the state dict lacks {missing}")
    if len(sd["param_groups"]) != len(opt.param_groups):
        raise ValueError(f"ZeroAdam.load_state_dict: {len(sd['param_groups'])} param groups saved, "
                         f"this optimizer has {len(opt.param_groups)}")  # fmt: skip
    for gi, (saved, g) in enumerate(zip(sd["param_groups"], opt.param_groups)):
        if len(saved["params"]) != len(g["params"]):
            raise ValueError(f"ZeroAdam.load_state_dict: param group {gi} saved {len(saved['params'])} parameters, "
                             f"this optimizer's has {len(g['params'])}")  # fmt: skip
    for i, p in enumerate(opt._params):
        entry = sd["state"].get(i)
        if entry is None or any(k not in entry for k in _KEYS):
            raise ValueError(f"ZeroAdam.load_state_dict: no {'/'.join(_KEYS)} saved for parameter {i}")
        held = getattr(p, "expert_range", None)
        if held is not None and tuple(entry.get("experts", ())) != tuple(held):
            raise ValueError(f"ZeroAdam.load_state_dict: parameter {i} holds experts [{held[0]}, {held[1]}) on this "
                             f"rank, the state dict was saved for experts {entry.get('experts', 'not named')}: each "
                             "rank must load a state saved by a rank of the same expert-parallel index")  # fmt: skip
        for k in _KEYS:
            if entry[k].numel() != p.numel():
                raise ValueError(f"ZeroAdam.load_state_dict: parameter {i}'s {k} has {entry[k].numel()} elements, "
                                 f"the parameter {p.numel()} (shape {tuple(p.shape)})")  # fmt: skip
    if (sd["loss_scale"] is None) != (opt._scale is None):
        raise ValueError("ZeroAdam.load_state_dict: the checkpoint and this optimizer disagree on loss scaling "
                         f"(saved loss_scale={sd['loss_scale']}, this optimizer's {opt.loss_scale})")  # fmt: skip


def _shard_slices(opt):
    """``(param index, slot, start, lo, hi, shards)``: this rank's shard ``[lo, hi)`` holds the parameter's
    flattened elements ``[start, start + hi - lo)``."""
    for bucket, *shards in _bucket_tensors(opt):
        for slot, lo, hi in bucket.shard_slices():
            i = opt.param_index.get(id(slot.param))
            if i is not None:
                yield i, slot, bucket.shard_offset + lo - slot.offset, lo, hi, shards


def _set_scalars(opt, step: int, loss_scale: float | None, growth_tracker: int) -> None:
    opt._applied_steps, opt._last_found_inf = int(step), None
    if opt._scale is not None:
        opt._scale.fill_(loss_scale)
    opt._growth_tracker.fill_(int(growth_tracker))


def _params_from_masters(opt) -> None:
    """Write each low-precision parameter shard from its master, then all-gather the parameters."""
    for (bucket, master, *_), segments in zip(_bucket_tensors(opt), opt._segments):
        if master is not bucket.param_shard:
            for lo, hi, _ in segments:
                bucket.param_shard[lo:hi].copy_(master[lo:hi])
    opt._owner._gather_params()


@torch.no_grad()
def load_zero_state(opt, sd: dict) -> None:
    _check_state_dict(opt, sd)
    for g, saved in zip(opt.param_groups, sd["param_groups"]):
        g.update({k: v for k, v in saved.items() if k != "params"})
    _set_scalars(opt, sd["step"], sd["loss_scale"], sd["growth_tracker"])
    for i, _, start, lo, hi, shards in _shard_slices(opt):
        for k, shard in zip(_KEYS, shards):
            shard[lo:hi].copy_(sd["state"][i][k].reshape(-1)[start : start + hi - lo])
    _params_from_masters(opt)


def zero_shard_views(opt) -> dict:
    """This rank's state without copies: ``{"shards": {i: [(start, {"master", "exp_avg", "exp_avg_sq": view})]},
    "step", "loss_scale", "growth_tracker", "zero_stage"}``.

    Each view is a 1-D fp32 slice of this rank's live shard buffers holding parameter ``i``'s flattened
    (local) elements ``[start, start + view.numel())``; a parameter this rank holds nothing of is absent.
    Writing into the views changes the optimizer's state: fill them, then call :func:`load_zero_shards`.
    """
    shards: dict[int, list] = {}
    for i, _, start, lo, hi, bufs in _shard_slices(opt):
        shards.setdefault(i, []).append((start, {k: buf[lo:hi] for k, buf in zip(_KEYS, bufs)}))
    return {"shards": shards, "step": opt._applied_steps, "loss_scale": opt.loss_scale,
            "growth_tracker": int(opt._growth_tracker), "zero_stage": opt.stage}  # fmt: skip


@torch.no_grad()
def load_zero_shards(opt, step: int, loss_scale: float | None, growth_tracker: int) -> None:
    """After the views of :func:`zero_shard_views` were filled: set the step and loss scale, write the
    parameters from the masters and all-gather them (a collective over the data-parallel group)."""
    if (loss_scale is None) != (opt._scale is None):
        raise ValueError("ZeroAdam.load_sharded_state: the checkpoint and this optimizer disagree on loss scaling "
                         f"(saved loss_scale={loss_scale}, this optimizer's {opt.loss_scale})")  # fmt: skip
    _set_scalars(opt, step, loss_scale, growth_tracker)
    _params_from_masters(opt)
