"""Auxiliary-loss-free balancing (DeepSeek-V3, Wang et al. 2024) for Hugging Face mixtures of experts.

About thirty Hugging Face families route with a per-expert bias, ``e_score_correction_bias`` (DeepSeek-V3,
GLM-4-MoE, MiniMax-M2, Kimi-Linear, dots1, …): added to the router's scores only to choose the experts, it is
what DeepSeek-V3 moves after each step towards balance, and Hugging Face leaves it untouched in training.
:func:`track_expert_loads` counts, in every training forward (``model.train()``, gradients enabled), the routes
that reach each expert of every mixture-of-experts block holding such a bias; :func:`~tessel.layers.moe.
update_expert_biases` then moves each bias by ``rate · sign(mean load − load)`` and starts the counts again, as it
does for tessel's :class:`~tessel.layers.moe.ParallelMoE`.

A block is a module with an ``experts`` child whose forward takes ``(hidden_states, top_k_index,
top_k_weights)`` (Hugging Face 5.x's experts interface), and with an ``e_score_correction_bias`` of one value per
expert elsewhere in the block (on its router, or on the block itself): a buffer, or a parameter that takes no
gradient (ERNIE-4.5-MoE holds it so as ``[1, X]``, one group of experts; Laguna as ``[X]``). The routes are
counted where they enter the experts, before anything tessel's parallel experts do to them (a pre-hook run
first), so the ids are global expert ids whatever the layout. The biases are kept in fp32, as DeepSeek-V3 trains
them: steps of ~1e-3 vanish in a bf16 bias.

Which ranks saw which tokens: :func:`~tessel.layers.parallelize.parallelize` tracks the blocks it splits and
notes the groups whose ranks route other tokens of the same batch inside the layer (the tensor-parallel group
under sequence parallelism, the context-parallel group); ``update_expert_biases(model, rate, group)`` adds
their counts, and ``group``'s (the data-parallel ranks), so every rank moves its copy of a bias alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..parallel.comm import group_size
from .hf_experts import _routing_names
from .routes import sorted_counts

__all__ = ["ExpertLoad", "balanced_blocks", "expert_loads", "track_expert_loads", "track_split_loads"]

BIAS_NAME = "e_score_correction_bias"
_ATTR = "_tessel_expert_load"


@dataclass(eq=False)
class ExpertLoad:
    """One tracked block: routes per expert since the last update, and the bias they move."""

    counts: torch.Tensor  # [X] int64
    owner: nn.Module  # the module whose ``e_score_correction_bias`` is the bias
    groups: tuple  # process groups whose ranks routed other tokens of this layer's batch

    @property
    def bias(self) -> torch.Tensor:
        return _bias_of(self.owner)


def _bias_of(module: nn.Module) -> torch.Tensor | None:
    """``module``'s own ``e_score_correction_bias``: a buffer, or a parameter that takes no gradient."""
    bias = module._buffers.get(BIAS_NAME)
    if bias is None and (param := module._parameters.get(BIAS_NAME)) is not None and not param.requires_grad:
        bias = param
    return bias


def _bias_owner(block: nn.Module, experts: nn.Module) -> nn.Module | None:
    """The module of ``block`` (not inside ``experts``) holding an ``e_score_correction_bias``."""
    inside = {id(m) for m in experts.modules()}
    owners = [m for m in block.modules() if id(m) not in inside and _bias_of(m) is not None]
    if len(owners) > 1:
        raise ValueError(f"track_expert_loads: {type(block).__name__} holds {len(owners)} {BIAS_NAME} tensors; "
                         "expected one per block")  # fmt: skip
    return owners[0] if owners else None


def _ids_argument(experts: nn.Module) -> str | None:
    """The name of the experts' expert-ids argument (their forward's second), or None when it takes none."""
    try:
        names = _routing_names(experts)
    except ValueError:  # not Hugging Face's experts interface (a ModuleList of experts, say)
        return None
    return names[1] if len(names) == 3 else None


def balanced_blocks(model: nn.Module) -> list[tuple[nn.Module, nn.Module, str]]:
    """``(experts, bias owner, name of the experts' ids argument)`` of every block of ``model``
    routing with an ``e_score_correction_bias``. Raises ``ValueError`` when a block holds several such biases, or
    a bias does not hold one value per expert."""
    found = []
    for name, block in model.named_modules():
        experts = block._modules.get("experts")
        if experts is None:
            continue
        owner = _bias_owner(block, experts)
        routed = _ids_argument(experts)
        if owner is None or routed is None:
            continue
        bias = _bias_of(owner)
        if bias.dim() == 0 or bias.numel() != bias.shape[-1]:  # [X], or [1, X]: one group of X experts
            raise ValueError(f"track_expert_loads: {name}'s {BIAS_NAME} must hold one value per expert, received "
                             f"shape {tuple(bias.shape)}")  # fmt: skip
        found.append((experts, owner, routed))
    return found


def track_expert_loads(model: nn.Module, *, groups_of=None) -> int:
    """Count the routes reaching each expert of every block of ``model`` with an ``e_score_correction_bias``.

    Returns the number of blocks tracked (tracking again changes nothing). Converts each bias to fp32 in place.
    ``groups_of`` (used by ``parallelize``): ``experts module -> tuple of process groups`` whose ranks route
    other tokens of the same batch inside that layer. Raises ``ValueError`` before changing anything when a
    block holds several such biases, or a bias does not hold one value per expert.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"track_expert_loads: model must be an nn.Module, received {type(model).__name__}")
    found = balanced_blocks(model)
    for experts, owner, ids_name in found:
        groups = tuple(groups_of(experts)) if groups_of is not None else ()
        load = getattr(experts, _ATTR, None)
        if load is not None:
            load.groups = groups or load.groups
            continue
        bias = _bias_of(owner)
        if BIAS_NAME in owner._buffers:
            owner._buffers[BIAS_NAME] = bias = bias.float()
        else:  # the parameter object stays (optimizers and state dicts refer to it), its values turn fp32
            bias.data = bias.data.float()
        load = ExpertLoad(torch.zeros(bias.numel(), dtype=torch.int64, device=bias.device), owner, groups)
        setattr(experts, _ATTR, load)
        experts.register_forward_pre_hook(_counter(ids_name, load), with_kwargs=True, prepend=True)
    return len(found)


def track_split_loads(model: nn.Module, sharded: list[nn.Module], tp_group, cp_group) -> int:
    """:func:`track_expert_loads` for a model ``parallelize`` split: the experts modules in ``sharded`` receive
    their rank's shard of the sequence (their counts are summed over ``tp_group``), and under context
    parallelism every layer routes this rank's share of it (summed over ``cp_group``)."""
    split = {id(m) for m in sharded} if group_size(tp_group) > 1 else set()
    cp = (cp_group,) if cp_group is not None and group_size(cp_group) > 1 else ()
    return track_expert_loads(model, groups_of=lambda m: ((tp_group,) if id(m) in split else ()) + cp)


def _counter(ids_name: str, load: ExpertLoad):
    def count(module, args, kwargs):
        if not (module.training and torch.is_grad_enabled()):
            return None
        ids = args[1] if len(args) > 1 else kwargs[ids_name]  # the forward's second argument
        n = load.counts.numel()
        flat = ids.reshape(-1).long()
        if ids.is_cuda or torch.compiler.is_compiling():  # counted and checked on the device: no host sync
            torch._assert_async(flat.max() < n, f"a route chose an expert beyond the {n} values of its {BIAS_NAME}")
            load.counts += sorted_counts(torch.sort(flat).values, n)
            return None
        routes = torch.bincount(flat, minlength=n)
        if routes.numel() != n:
            raise ValueError(f"{type(module).__name__}: a route chose expert {routes.numel() - 1}, beyond the "
                             f"{n} values of its {BIAS_NAME}")  # fmt: skip
        load.counts += routes
        return None

    return count


def expert_loads(model: nn.Module) -> list[ExpertLoad]:
    """The blocks of ``model`` that :func:`track_expert_loads` tracks, in module order."""
    return [load for m in model.modules() if (load := getattr(m, _ATTR, None)) is not None]
