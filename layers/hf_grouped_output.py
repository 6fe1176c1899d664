"""DeepSeek-V4's attention split by heads over the tensor-parallel ranks.

Its attention has one key-and-value head every query head reads (``kv_proj``, then ``kv_norm``), queries from a
latent (``q_a_proj`` → ``q_a_norm`` → ``q_b_proj``), a sink per head, and a grouped low-rank output projection: the
heads' outputs cut into ``o_groups`` groups of whole heads, each group projected on its own (``o_a_proj``, a
block-diagonal ``DeepseekV4GroupedLinear``), then mixed by one linear layer (``o_b_proj``). Its compressed layers add a
compressor (with an indexer choosing which compressed entries each query sees) whose output joins the keys.

Over ``t`` ranks (``t`` dividing the heads and ``o_groups``) rank ``r`` keeps the ``r``-th share of the heads, which
are whole groups:

- ``q_b_proj`` column-parallel (its input, the query latent, is replicated: its gradient is summed over the group);
- ``o_a_proj`` keeps its groups' rows (``colwise_grouped``): it reads this rank's heads alone, so nothing travels;
- ``o_b_proj`` row-parallel over the groups' outputs (one all-reduce of the layer's output);
- the sinks follow their heads;
- ``kv_norm`` and the compressor stay whole, every rank computing them, and their outputs' gradients, which each
  rank's heads give a share of, are summed over the group (``shared_output``: ``copy_to_tp`` on the output), so
  that everything before them (``kv_proj``, the compressor's and the query latent's parameters) gets its whole
  gradient on every rank: a ``[tokens, head_dim]`` all-reduce where a column-parallel ``kv_proj`` would all-reduce
  the ``[tokens, hidden]`` input's gradient;
- the attention reads ``num_heads / t`` heads, and its config view ``o_groups / t`` groups.

Under sequence parallelism its projections of the block's input (``q_a_proj``, ``kv_proj``, and the compressor's and
its indexer's: :data:`GROUPED_OUTPUT_LATENTS`) multiply this rank's tokens and gather their narrow outputs, as
multi-head latent attention's latents are gathered (:class:`~tessel.layers.hf.RingLatentLinear`); what follows runs
over the whole sequence, and ``o_b_proj`` reduce-scatters its output along it.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .linear import _mark_sharded

__all__ = [
    "GROUPED_OUTPUT_CHILDREN",
    "GROUPED_OUTPUT_LATENTS",
    "grouped_output_styles",
    "grouped_output_updates",
    "split_grouped_linear",
]

# the children of such an attention module that learn, and the styles that split it
GROUPED_OUTPUT_CHILDREN = ("q_a_proj", "q_a_norm", "q_b_proj", "kv_proj", "kv_norm", "o_a_proj", "o_b_proj",
                           "compressor")  # fmt: skip
# under sequence parallelism: its projections of the block's input, which multiply this rank's tokens and gather their
# narrow outputs (the latents), as multi-head latent attention's do
GROUPED_OUTPUT_LATENTS = ("q_a_proj", "kv_proj", "compressor.kv_proj", "compressor.gate_proj",
                          "compressor.indexer.kv_proj", "compressor.indexer.gate_proj",
                          "compressor.indexer.scorer.weights_proj")  # fmt: skip


def is_grouped_output_attention(m: nn.Module) -> bool:
    """Whether ``m`` is attention with a grouped output projection (DeepSeek-V4's): the children above, a sink per
    head, ``num_heads`` and a config with ``o_groups``."""
    children = dict(m.named_children())
    linear = ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj")
    grouped = children.get("o_a_proj")
    return (all(isinstance(children.get(n), nn.Linear) for n in linear) and isinstance(grouped, nn.Linear)
            and isinstance(getattr(grouped, "n_groups", None), int) and isinstance(getattr(m, "num_heads", None), int)
            and isinstance(getattr(getattr(m, "config", None), "o_groups", None), int)
            and isinstance(getattr(m, "sinks", None), nn.Parameter) and "kv_norm" in children
            and all(n in GROUPED_OUTPUT_CHILDREN or not any(True for _ in c.parameters())
                    for n, c in children.items()))  # fmt: skip


def _splits(m: nn.Module, t: int) -> bool:
    heads, groups = m.num_heads, m.o_a_proj.n_groups
    return heads % t == 0 and groups % t == 0 and heads % groups == 0 and m.o_a_proj.out_features % groups == 0


def grouped_output_styles(m: nn.Module, t: int) -> dict[str, str] | None:
    """The styles that split such attention over ``t`` ranks (see the module), None for another module or one whose
    heads or groups do not split."""
    if not is_grouped_output_attention(m) or not _splits(m, t):
        return None
    styles = {"q_b_proj": "colwise", "o_a_proj": "colwise_grouped", "o_b_proj": "rowwise", "kv_norm": "shared_output"}
    if isinstance(getattr(m, "compressor", None), nn.Module):
        styles["compressor"] = "shared_output"
    return styles


def grouped_output_updates(m: nn.Module, t: int) -> dict | None:
    """The attributes such attention's forward reads, on each of ``t`` ranks: its heads, the query heads each key
    head serves (all of this rank's), and a config view with its groups; None for another module. Raises
    ``ValueError`` when its heads or groups do not split."""
    from .hf_plans import LocalHeadsConfig  # (hf_plans finds such attention through grouped_output_styles)

    if not is_grouped_output_attention(m):
        return None
    if not _splits(m, t):
        raise ValueError(f"its {m.num_heads} heads in {m.o_a_proj.n_groups} output groups do not split over {t} "
                         "tensor-parallel ranks (each rank keeps whole groups)")  # fmt: skip
    local = {"num_attention_heads": m.num_heads // t, "o_groups": m.config.o_groups // t}
    updates = {"num_heads": m.num_heads // t, "config": LocalHeadsConfig(m.config, **local)}
    if getattr(m, "num_key_value_groups", None) == m.num_heads:  # one key-and-value head for every query head
        updates["num_key_value_groups"] = m.num_heads // t
    return updates


def split_grouped_linear(module: nn.Linear, rank: int, t: int, name: str = "o_a_proj") -> nn.Linear:
    """A copy of the block-diagonal grouped projection ``module`` (``n_groups`` groups, each ``out_features /
    n_groups`` rows of the weight) holding rank ``rank``'s ``n_groups / t`` groups, tagged as split along its rows
    (checkpoints, clipping and ``load_pretrained`` read it so). ``module`` (``name`` in the model) is left as it is;
    raises ``ValueError`` naming it when its groups do not split."""
    n, groups = module.out_features, getattr(module, "n_groups", None)
    if not isinstance(groups, int) or groups % t or n % groups:
        raise ValueError(f"parallelize: {name} (style 'colwise_grouped'): expected a grouped projection whose n_groups "
                         f"split over {t} tensor-parallel ranks, each of whole rows; received {n} rows in {groups!r} "
                         "groups")  # fmt: skip
    local = copy.copy(module)
    local._parameters = dict(module._parameters)
    local._buffers, local._modules = dict(module._buffers), dict(module._modules)
    rows = slice(rank * n // t, (rank + 1) * n // t)
    with torch.no_grad():
        local.weight = nn.Parameter(module.weight[rows].clone(), requires_grad=module.weight.requires_grad)
        if module.bias is not None:
            local.bias = nn.Parameter(module.bias[rows].clone(), requires_grad=module.bias.requires_grad)
    local.out_features, local.n_groups = n // t, groups // t
    for p in (local.weight, local.bias):
        _mark_sharded(p, dim=0, parts=(n,))
    return local
