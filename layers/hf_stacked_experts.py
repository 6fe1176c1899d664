"""Experts whose weights are stacked in 2-d tensors, expert after expert: DBRX's (``DbrxExperts``).

Its experts module holds an ``mlp`` whose ``w1`` (gate), ``v1`` (up) and ``w2`` (down, stored ``[I, H]`` per expert,
which its forward multiplies untransposed) are each ``[E·I, H]``; the forward views expert ``e``'s ``[I, H]`` block
out of each by the module's ``ffn_hidden_size`` ``I``. Split by intermediate features over ``t`` ranks, rank ``r``
keeps rows ``r·I/t … (r+1)·I/t`` of every expert's block in all three (``tp_dim`` 0, ``tp_parts`` ``(I,)·E``: each
expert's block a part, as :func:`~tessel.parallel.sharding.local_shard` cuts parts), and ``ffn_hidden_size`` becomes
``I/t``; the gate and up rows pair as the down rows do, so each rank computes its features of every expert and the
partial outputs are all-reduced as for every experts module split by features (:mod:`~tessel.layers.hf_experts`).
Split by whole experts (expert parallelism) they are not: refused by name.
"""

from __future__ import annotations

from torch import nn

__all__ = ["STACKED", "assign_shards", "stacked_layout", "stacked_splits"]

# the stacked parameters, by their names in the experts module
STACKED = ("mlp.w1", "mlp.v1", "mlp.w2")


def stacked_layout(module: nn.Module) -> tuple[int, int, int] | None:
    """``(E, I, H)`` of an experts module of stacked 2-d weights (DBRX's: see the module docstring); None for any
    other module."""
    mlp = getattr(module, "mlp", None)
    counts = tuple(getattr(module, a, None) for a in ("num_experts", "ffn_hidden_size", "hidden_size"))
    if not isinstance(mlp, nn.Module) or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                                 for n in counts):  # fmt: skip
        return None
    experts, inter, hidden = counts
    params = dict(mlp.named_parameters())
    if set(params) != {"w1", "v1", "w2"} or any(tuple(p.shape) != (experts * inter, hidden) for p in params.values()):
        return None
    if any(True for _ in module.parameters(recurse=False)) or getattr(mlp, "ffn_hidden_size", inter) != inter:
        return None
    return counts


def stacked_splits(module: nn.Module, t: int, by: str) -> list:
    """The split of each stacked weight over ``t`` ranks by intermediate features (``ValueError``, without the module's
    name, split by experts or when the features do not split)."""
    from .hf_experts import ExpertSplit

    experts, inter, _ = stacked_layout(module)
    if by != "features":
        raise ValueError("experts stacked in 2-d weights (DBRX's) split by 'features' only")
    if inter % t:
        raise ValueError(f"the intermediate size {inter} is not divisible by the tensor-parallel size {t}")
    return [ExpertSplit(name, 0, (inter,) * experts) for name in STACKED]


def assign_shards(module: nn.Module, shards: dict[str, nn.Parameter]) -> None:
    """Put this rank's ``shards`` (names in ``module``, dotted for a submodule's) in place of the whole parameters; a
    stacked experts module's ``ffn_hidden_size`` (its own and its ``mlp``'s) becomes this rank's share."""
    layout = stacked_layout(module)
    for name, p in shards.items():
        owner, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(owner) if owner else module, leaf, p)
    if layout is not None and shards:
        local = shards[STACKED[0]].shape[0] // layout[0]
        module.ffn_hidden_size = local
        if hasattr(module.mlp, "ffn_hidden_size"):
            module.mlp.ffn_hidden_size = local
