"""The load-balancing loss of Hugging Face's mixtures of experts, from sums that add over layers and stages.

Mixtral, Qwen2-MoE and Qwen3-MoE add ``router_aux_loss_coef`` times the Switch Transformer's balancing loss to
their language-model loss when a forward asks for its router logits (``output_router_logits``). Over every
router of the model, with ``R`` the rows (tokens × layers; with a ``[B, S]`` attention mask, its weight ×
layers), ``c_e`` the top-k routes choosing expert ``e`` and ``p_e`` the router probability of ``e`` summed over
the rows::

    loss = E · Σ_e (c_e / R) · (p_e / R)

Both ``c`` and ``p`` are sums, which add over layers: :func:`router_sums` gives them for some of the layers as one
``[2E + 2]`` fp32 tensor ``(c, p, z, R)``, with ``z`` the rows' ``logsumexp(logits)²`` summed (only ``p`` and ``z``
carry a gradient). The sums of several groups of layers add up (the pipeline stages of
:func:`~.hf_pipeline.hf_pipeline_stage` carry them from stage to stage), :func:`balancing_loss` turns the total
into the loss, and :func:`router_z_loss` into ST-MoE's router z-loss ``z / R`` (the mean over every layer's rows,
as tessel's :class:`~.moe.ParallelMoE` takes it; Hugging Face's mixtures have none). Routers pick their experts from
the softmax in the logits' dtype, and the counts and probabilities are summed in fp32, as Hugging Face's
``load_balancing_loss_func`` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["balancing_config", "balancing_loss", "router_sums", "router_z_loss"]


def balancing_config(model: nn.Module) -> tuple[int, int, float]:
    """``(experts, top_k, coefficient)`` of a Hugging Face mixture of experts: its number of experts, experts per
    token and ``router_aux_loss_coef``. Raises ``ValueError`` for a model that names them not."""
    config = getattr(model, "config", None)
    experts = getattr(model, "num_experts", None) or getattr(config, "num_local_experts", None)
    experts = experts or getattr(config, "num_experts", None)
    top_k = getattr(model, "num_experts_per_tok", None) or getattr(config, "num_experts_per_tok", None)
    coef = getattr(model, "router_aux_loss_coef", getattr(config, "router_aux_loss_coef", None))
    if not experts or not top_k or coef is None:
        raise ValueError(f"{type(model).__name__} names no number of experts, experts per token and "
                         f"router_aux_loss_coef (received {experts}, {top_k}, {coef})")  # fmt: skip
    return int(experts), int(top_k), float(coef)


def router_sums(router_logits, num_experts: int, top_k: int, attention_mask: torch.Tensor | None = None
                ) -> torch.Tensor:  # fmt: skip
    """``[2E + 2]`` fp32: the routes to each expert, each expert's router probability summed over the rows, the rows'
    squared log-sum-exps summed, and the rows, over every layer's ``[rows, E]`` logits in ``router_logits`` (a
    tuple, one per layer; empty: zeros).

    ``attention_mask``: None, or ``[B, S]`` with ``B·S`` the rows of every layer: each row weighted by its value
    (0 for padding), as Hugging Face weighs them."""
    if not isinstance(router_logits, tuple | list):
        raise TypeError(
            f"router_sums: router_logits must be a tuple of tensors, received {type(router_logits).__name__}"
        )
    if not router_logits:
        return torch.zeros(2 * num_experts + 2)
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros(1, dtype=torch.float32, device=device)
    squares = torch.zeros(1, dtype=torch.float32, device=device)
    weight = None
    if attention_mask is not None:
        weight = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer, logits in enumerate(router_logits):
        if logits.dim() != 2 or logits.shape[-1] != num_experts:
            raise ValueError(f"router_sums: router_logits[{layer}] must be [rows, {num_experts}], received "
                             f"{tuple(logits.shape)}")  # fmt: skip
        if weight is not None and weight.numel() != logits.shape[0]:
            raise ValueError(f"router_sums: attention_mask holds {weight.numel()} tokens, but router_logits[{layer}] "
                             f"holds {logits.shape[0]} rows")  # fmt: skip
        routing = F.softmax(logits.to(device), dim=-1)
        chosen = torch.topk(routing, top_k, dim=-1).indices.reshape(-1)
        square = torch.logsumexp(logits.to(device).float(), dim=-1).square()
        if weight is None:
            counts = counts.index_add(0, chosen, torch.ones_like(chosen, dtype=torch.float32))
            probs = probs + routing.float().sum(0)
            squares = squares + square.sum()
            rows = rows + logits.shape[0]
        else:
            counts = counts.index_add(0, chosen, weight.repeat_interleave(top_k))
            probs = probs + (routing.float() * weight[:, None]).sum(0)
            squares = squares + (square * weight).sum()
            rows = rows + weight.sum()
    return torch.cat([counts.detach(), probs, squares, rows.detach()])


def balancing_loss(sums: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``E · Σ_e (c_e / R) · (p_e / R)`` from the :func:`router_sums` of every layer (a scalar, fp32)."""
    _check_sums("balancing_loss", sums, num_experts)
    counts, probs, rows = sums[:num_experts].detach(), sums[num_experts : 2 * num_experts], sums[-1].detach()
    return torch.sum((counts / rows) * (probs / rows)) * num_experts


def router_z_loss(sums: torch.Tensor, num_experts: int) -> torch.Tensor:
    """ST-MoE's router z-loss, the mean ``logsumexp(logits)²`` over every layer's rows, from their
    :func:`router_sums` (a scalar, fp32)."""
    _check_sums("router_z_loss", sums, num_experts)
    return sums[-2] / sums[-1].detach()


def _check_sums(name: str, sums: torch.Tensor, num_experts: int) -> None:
    if sums.shape != (2 * num_experts + 2,):
        raise ValueError(f"{name}: sums must be [{2 * num_experts + 2}] (2 · experts + 2), received "
                         f"{tuple(sums.shape)}")  # fmt: skip
