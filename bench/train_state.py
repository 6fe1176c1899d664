"""A training run's state as a flat dictionary keyed by GLOBAL tensors, so a checkpoint loads under any layout.

Keys (``<fqn>`` is the parameter's name in the whole, unsplit ``GPT``; every tensor has its global shape):

- ``model.<fqn>``: the fp32 weight (the fp32 master where the optimizer keeps one),
- ``optim.<fqn>.exp_avg`` / ``optim.<fqn>.exp_avg_sq``: AdamW's moments, fp32 (torch's AdamW keeps them
  in the parameter's dtype: bf16 → fp32 → bf16 is exact),
- ``optim.step`` (int64), and ``optim.loss_scale`` (fp32) / ``optim.growth_tracker`` (int64) where a loss
  scale is kept,
- ``train.step`` (int64): completed steps, which is also the position in the data (``bench/dataset.py``),
- ``rng.<rank>.cpu`` / ``rng.<rank>.cuda``: each rank's generator states (restored only when the world
  size is the one saved; nothing in training draws from them today, the data order depends on the step).

Nothing is gathered. Each rank offers what it holds as :class:`~tessel.bench.checkpoint.Pieces` of the
global tensors (:func:`tessel.parallel.sharding.global_pieces`): its TP shard of a split parameter (each
fused Q/K/V or gate/up part in its place), or with ZeroAdam its DP shard's flat ranges of each
parameter, cut into blocks. One replica writes what several ranks hold alike (DP rank 0 for a TP shard
under torch's AdamW, TP rank 0 for a ZeRO shard of a replicated parameter); a parameter replicated on
every rank is a whole tensor, which DCP writes once. Loading offers the blocks this rank needs, as views
of its buffers (ZeroAdam's shards themselves), and DCP reads the overlapping parts of whatever blocks
were saved: a checkpoint written under one tp/dp/pp layout and ZeRO stage loads under another.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.comm import group_rank, group_size
from ..parallel.flat import is_expert
from ..parallel.sharding import expert_spec, global_pieces, global_shape, is_tp_sharded
from .checkpoint import Pieces

__all__ = ["ModelState", "TorchAdamWState", "ZeroAdamState", "load_rng_state", "rng_state"]


def _value(p: nn.Parameter, local: torch.Tensor, tp_group, *, write: bool) -> torch.Tensor | Pieces:
    """``local`` (shaped like ``p``'s TP shard) as a checkpoint value: itself when ``p`` is neither TP-split nor some
    of the experts, else its blocks of the global tensor (none when ``write`` is False: another replica writes them)."""
    if not is_tp_sharded(p) and expert_spec(p) is None:
        return local
    t, r = group_size(tp_group), group_rank(tp_group)
    blocks = global_pieces(p, local.reshape(-1), 0, t, r, shape=local.shape) if write else []
    return Pieces(global_shape(p, t, local.shape), local.dtype, blocks)


def _writers(dp_group, expert_dp_group) -> tuple[bool, bool]:
    """Whether this rank writes a parameter (its TP shard) that is not / is an expert's: data-parallel replicas
    hold the same values, one writes them; an expert-parallel rank's experts are its expert-dp group's."""
    return group_rank(dp_group) == 0, group_rank(dp_group if expert_dp_group is None else expert_dp_group) == 0


class ModelState:
    """``model.<fqn>``: each parameter in fp32, for optimizers that keep no master weights."""

    def __init__(self, named: dict[str, nn.Parameter], tp_group, dp_group, expert_dp_group=None):
        self.named, self.tp_group = named, tp_group
        self.writers = _writers(dp_group, expert_dp_group)
        self._buffers: dict[str, torch.Tensor] = {}

    def state(self) -> dict:
        return {f"model.{n}": _value(p, p.detach().float(), self.tp_group, write=self.writers[is_expert(p)])
                for n, p in self.named.items()}  # fmt: skip

    def template(self) -> dict:
        self._buffers = {n: torch.empty(p.shape, dtype=torch.float32, device=p.device) for n, p in self.named.items()}
        return {f"model.{n}": _value(p, self._buffers[n], self.tp_group, write=True) for n, p in self.named.items()}

    @torch.no_grad()
    def load(self, state: dict) -> None:
        for name, p in self.named.items():
            p.copy_(self._buffers[name])
        self._buffers = {}


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
    """The moments and step of a ``torch.optim.AdamW`` over the named parameters (saved beside the model)."""

    owns_params = False  # the parameters are saved and loaded beside this state (ModelState)
    MOMENTS = ("exp_avg", "exp_avg_sq")

    def __init__(self, optimizer: torch.optim.Optimizer, named: dict[str, nn.Parameter], tp_group, dp_group,
                 expert_dp_group=None):  # fmt: skip
        self.optimizer, self.named, self.tp_group = optimizer, named, tp_group
        self.writers = _writers(dp_group, expert_dp_group)
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}

    def state(self) -> dict:
        """The moments of every parameter (zeros for one that has had no gradient yet, as AdamW would start it: a
        sparse attention's indexer, which its model runs without gradients) and the step."""
        out, steps = {}, [0]
        for name, p in self.named.items():
            st = self.optimizer.state[p]
            for moment in self.MOMENTS:
                value = st[moment].float() if moment in st else torch.zeros(p.shape, device=p.device)
                out[f"optim.{name}.{moment}"] = _value(p, value, self.tp_group, write=self.writers[is_expert(p)])
            steps.append(int(st.get("step", 0)))
        out["optim.step"] = torch.tensor(max(steps), dtype=torch.int64)
        return out

    def template(self) -> dict:
        out = {"optim.step": torch.zeros((), dtype=torch.int64)}
        for name, p in self.named.items():
            for moment in self.MOMENTS:
                buf = self._buffers[name, moment] = torch.empty(p.shape, dtype=torch.float32, device=p.device)
                out[f"optim.{name}.{moment}"] = _value(p, buf, self.tp_group, write=True)
        return out

    def load(self, state: dict) -> None:
        """Rebuild the optimizer's state through ``load_state_dict`` (which puts each tensor where torch
        wants it: the step on the host, or on the device for the fused and capturable variants)."""
        index = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        step = float(state["optim.step"])
        per_param = {}
        for name, p in self.named.items():
            moments = {m: self._buffers[name, m].to(p.dtype) for m in self.MOMENTS}
            per_param[index[id(p)]] = {"step": torch.tensor(step, dtype=torch.float32), **moments}
        self.optimizer.load_state_dict(
            {"state": per_param, "param_groups": self.optimizer.state_dict()["param_groups"]}
        )
        self._buffers = {}


class ZeroAdamState:
    """The fp32 master weights, moments, step (and loss scale) of a ``ZeroAdam``, straight from its shards.

    :meth:`ZeroAdam.sharded_state <tessel.parallel.zero.ZeroAdam.sharded_state>` gives each parameter's
    flat ranges held by this rank as views of the optimizer's buffers; they are saved as blocks of the
    global tensors and loaded back into the same views, after which ``load_sharded_state`` sets the
    parameters from the masters. The masters are the model's weights (``model.<fqn>``).
    """

    owns_params = True
    WHAT = (("master", "model.{}"), ("exp_avg", "optim.{}.exp_avg"), ("exp_avg_sq", "optim.{}.exp_avg_sq"))

    def __init__(self, optimizer, named: dict[str, nn.Parameter], tp_group):
        self.optimizer, self.named, self.tp_group = optimizer, named, tp_group
        self.tp_writer = group_rank(tp_group) == 0  # TP ranks hold the same shard of a replicated parameter

    def _pieces(self, sd: dict, *, every: bool) -> dict:
        """Each key's blocks from this rank's shard views; ``every``: also those another TP rank writes."""
        t, r = group_size(self.tp_group), group_rank(self.tp_group)
        out = {}
        for name, p in self.named.items():
            ranges = sd["shards"].get(self.optimizer.param_index[id(p)], [])
            mine = every or is_tp_sharded(p) or self.tp_writer
            for what, key in self.WHAT:
                blocks = [b for start, v in ranges for b in global_pieces(p, v[what], start, t, r)] if mine else []
                out[key.format(name)] = Pieces(global_shape(p, t), torch.float32, blocks)
        return out

    def _scalars(self, sd: dict) -> dict:
        out = {"optim.step": torch.tensor(sd["step"], dtype=torch.int64)}
        if sd["loss_scale"] is not None:
            out["optim.loss_scale"] = torch.tensor(sd["loss_scale"], dtype=torch.float32)
            out["optim.growth_tracker"] = torch.tensor(sd["growth_tracker"], dtype=torch.int64)
        return out

    def state(self) -> dict:
        sd = self.optimizer.sharded_state()
        return {**self._scalars(sd), **self._pieces(sd, every=False)}

    def template(self) -> dict:
        """The state's keys, with every range of this rank's shard views as blocks, to be filled in place."""
        sd = self.optimizer.sharded_state()
        return {**self._scalars(sd), **self._pieces(sd, every=True)}

    def load(self, state: dict) -> None:
        scaled = "optim.loss_scale" in state
        self.optimizer.load_sharded_state(
            int(state["optim.step"]),
            float(state["optim.loss_scale"]) if scaled else None,
            int(state["optim.growth_tracker"]) if scaled else 0,
        )
