"""A training run's state as a flat dictionary of GLOBAL tensors, so a checkpoint loads under any layout.

Keys (``<fqn>`` is the parameter's name in the whole, unsplit ``GPT``):

- ``model.<fqn>``: the fp32 weight in its global shape (the fp32 master where the optimizer keeps one),
- ``optim.<fqn>.exp_avg`` / ``optim.<fqn>.exp_avg_sq``: AdamW's moments, global, fp32 (torch's AdamW keeps
  them in the parameter's dtype: bf16 → fp32 → bf16 is exact),
- ``optim.step`` (int64), and ``optim.loss_scale`` (fp32) where a loss scale is kept,
- ``train.step`` (int64): completed steps, which is also the position in the data (``bench/dataset.py``),
- ``rng.<rank>.cpu`` / ``rng.<rank>.cuda``: each rank's generator states (restored only when the world
  size is the one saved; nothing in training draws from them today, the data order depends on the step).

A tensor-parallel parameter's global tensor is gathered over the TP group on save and cut back to this
rank's shard on load (:mod:`tessel.parallel.sharding`, which handles fused QKV / gate-up parts); every
TP and DP rank then holds the same global tensor and DCP writes it once. Pipeline ranks contribute the
keys of their own stages. The cost is one full copy of each parameter at a time on every rank while
saving or loading; DTensor shards would avoid it but cannot describe fused parts with one placement.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.comm import group_rank, group_size
from ..parallel.sharding import full_tensor, is_tp_sharded, local_shard, tp_spec

__all__ = [
    "TorchAdamWState",
    "ZeroAdamState",
    "global_shape",
    "load_model_state",
    "load_rng_state",
    "model_state",
    "model_template",
    "rng_state",
]


def global_shape(p: torch.Tensor, tp_group) -> torch.Size:
    """The shape of ``p``'s global tensor (its own shape unless it is split over the TP group)."""
    if not is_tp_sharded(p):
        return p.shape
    dim, parts = tp_spec(p, group_size(tp_group))
    shape = list(p.shape)
    shape[dim] = sum(parts)
    return torch.Size(shape)


def to_global(local: torch.Tensor, p: torch.Tensor, tp_group) -> torch.Tensor:
    """``local`` (shaped like ``p``'s shard) as its global tensor, gathered over TP when ``p`` is split."""
    if not is_tp_sharded(p):
        return local.detach().clone()
    dim, parts = tp_spec(p, group_size(tp_group))
    return full_tensor(local, dim, parts, tp_group)


def to_local(full: torch.Tensor, p: torch.Tensor, tp_group) -> torch.Tensor:
    """This rank's shard of the global tensor ``full`` for parameter ``p``."""
    if not is_tp_sharded(p):
        return full
    t = group_size(tp_group)
    dim, parts = tp_spec(p, t)
    return local_shard(full, dim, parts, group_rank(tp_group), t)


def model_state(named: dict[str, nn.Parameter], tp_group) -> dict:
    """``model.<fqn>``: each parameter as a global fp32 tensor."""
    return {f"model.{name}": to_global(p.detach().float(), p, tp_group).cpu() for name, p in named.items()}


def model_template(named: dict[str, nn.Parameter], tp_group) -> dict:
    return {f"model.{n}": torch.empty(global_shape(p, tp_group), dtype=torch.float32) for n, p in named.items()}


@torch.no_grad()
def load_model_state(named: dict[str, nn.Parameter], tp_group, state: dict) -> None:
    for name, p in named.items():
        p.copy_(to_local(state[f"model.{name}"], p, tp_group))


def rng_state(device: torch.device) -> dict:
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = {f"rng.{rank}.cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out[f"rng.{rank}.cuda"] = torch.cuda.get_rng_state(device)
    return out


def load_rng_state(state: dict, device: torch.device) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.set_rng_state(state[f"rng.{rank}.cpu"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state[f"rng.{rank}.cuda"], device)


class TorchAdamWState:
    """Global moments and step of a ``torch.optim.AdamW`` over the named parameters."""

    owns_params = False  # the parameters are saved and loaded beside this state
    MOMENTS = ("exp_avg", "exp_avg_sq")

    def __init__(self, optimizer: torch.optim.Optimizer, named: dict[str, nn.Parameter], tp_group):
        self.optimizer, self.named, self.tp_group = optimizer, named, tp_group

    def state(self) -> dict:
        out = {}
        for name, p in self.named.items():
            st = self.optimizer.state[p]
            for moment in self.MOMENTS:
                out[f"optim.{name}.{moment}"] = to_global(st[moment].float(), p, self.tp_group).cpu()
            out["optim.step"] = torch.tensor(int(st["step"]), dtype=torch.int64)
        return out

    def template(self) -> dict:
        out = {"optim.step": torch.zeros((), dtype=torch.int64)}
        for name, p in self.named.items():
            for moment in self.MOMENTS:
                out[f"optim.{name}.{moment}"] = torch.empty(global_shape(p, self.tp_group), dtype=torch.float32)
        return out

    def load(self, state: dict) -> None:
        """Rebuild the optimizer's state through ``load_state_dict`` (which puts each tensor where torch
        wants it: the step on the host, or on the device for the fused and capturable variants)."""
        index = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        step = float(state["optim.step"])
        per_param = {}
        for name, p in self.named.items():
            moments = {m: to_local(state[f"optim.{name}.{m}"], p, self.tp_group).to(p.dtype) for m in self.MOMENTS}
            per_param[index[id(p)]] = {"step": torch.tensor(step, dtype=torch.float32), **moments}
        self.optimizer.load_state_dict(
            {"state": per_param, "param_groups": self.optimizer.state_dict()["param_groups"]}
        )


class ZeroAdamState:
    """Global master weights, moments, step (and loss scale) of a ``ZeroAdam``.

    ``ZeroAdam.state_dict()`` is already whole over the data-parallel group (per parameter, fp32, on the
    CPU); this gathers each parameter over TP as well. The fp32 masters are the model's weights
    (``model.<fqn>``): loading them sets the parameters too (``ZeroAdam.load_state_dict`` writes the
    parameters from the masters).
    """

    owns_params = True
    MOMENTS = ("exp_avg", "exp_avg_sq")

    def __init__(self, optimizer, named: dict[str, nn.Parameter], tp_group):
        self.optimizer, self.named, self.tp_group = optimizer, named, tp_group

    def _key(self, name: str, what: str) -> str:
        return f"model.{name}" if what == "master" else f"optim.{name}.{what}"

    def state(self) -> dict:
        sd = self.optimizer.state_dict()  # a collective over DP
        out = {"optim.step": torch.tensor(int(sd["step"]), dtype=torch.int64)}
        if sd["loss_scale"] is not None:
            out["optim.loss_scale"] = torch.tensor(float(sd["loss_scale"]), dtype=torch.float32)
            out["optim.growth_tracker"] = torch.tensor(int(sd["growth_tracker"]), dtype=torch.int64)
        for name, p in self.named.items():
            entry = sd["state"][self.optimizer.param_index[id(p)]]
            for what in ("master", *self.MOMENTS):
                local = entry[what].reshape(p.shape).to(p.device)
                out[self._key(name, what)] = to_global(local, p, self.tp_group).cpu()
        return out

    def template(self) -> dict:
        out = {"optim.step": torch.zeros((), dtype=torch.int64)}
        if self.optimizer.loss_scale is not None:
            out["optim.loss_scale"] = torch.zeros((), dtype=torch.float32)
            out["optim.growth_tracker"] = torch.zeros((), dtype=torch.int64)
        for name, p in self.named.items():
            for what in ("master", *self.MOMENTS):
                out[self._key(name, what)] = torch.empty(global_shape(p, self.tp_group), dtype=torch.float32)
        return out

    def load(self, state: dict) -> None:
        opt = self.optimizer
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [opt.param_index[id(q)] for q in g["params"]]}
            for g in opt.param_groups
        ]
        per_param = {
            opt.param_index[id(p)]: {
                w: to_local(state[self._key(n, w)], p, self.tp_group) for w in ("master", *self.MOMENTS)
            }
            for n, p in self.named.items()
        }
        scaled = "optim.loss_scale" in state
        opt.load_state_dict(
            {
                "state": per_param,
                "param_groups": groups,
                "step": int(state["optim.step"]),
                "loss_scale": float(state["optim.loss_scale"]) if scaled else None,
                "growth_tracker": int(state["optim.growth_tracker"]) if scaled else 0,
            }
        )
