"""Hugging Face experts through tessel's grouped GEMM: ``experts_implementation="tessel"``.

transformers 5 runs a mixture's experts (one module of 3-d parameters; see :mod:`.hf_experts`) through the
implementation its config names (``eager``: a loop over experts, ``grouped_mm``: torch's grouped GEMM, ...).
:func:`register_hf_experts` adds tessel's: the routes sorted by expert, then each projection of every expert in one
launch of :func:`~tessel.kernels.grouped_matmul.grouped_matmul` (Triton, forward and backward), or in fp8 when the
module's ``fp8`` is set (:func:`~tessel.layers.fp8.fp8_grouped_linear`, which :func:`~tessel.layers.convert_to_fp8`
turns on). Use it with ``model.set_experts_implementation("tessel")`` or ``from_config(...,
experts_implementation="tessel")``.

It reads the module's layout as transformers' own implementations do: ``is_transposed`` (weights ``[E, in, out]``
instead of ``[E, out, in]``), ``has_gate`` (``gate_up_proj`` and the module's ``_apply_gate``, which knows whether
gate and up are halves or interleaved, or ``up_proj`` and ``act_fn``), ``has_bias``, ``has_post_expert_norm``, and
``_is_expert_parallel``: routes to experts another rank holds carry the sentinel id ``num_experts`` (weight 0),
sort to the end, belong to no expert's rows, and their rows are zeroed before and after each GEMM (the grouped
GEMM leaves rows past the last expert unwritten, forward and backward). The tensor-parallel split of
:mod:`.hf_experts` shards the same parameters, so the split module runs this implementation unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.grouped_matmul import grouped_matmul
from .fp8 import fp8_grouped_linear

__all__ = ["register_hf_experts", "tessel_experts_forward"]


def _projection(module: nn.Module, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Every expert's rows of ``x`` times its ``weight`` (``[E, out, in]``, or ``[E, in, out]`` transposed)."""
    x = x.to(weight.dtype)  # under autocast the rows may arrive in fp32 beside bf16 weights
    by_out = weight if not module.is_transposed else weight.transpose(1, 2)  # [E, out, in]
    if getattr(module, "fp8", False):
        return fp8_grouped_linear(x, by_out, offsets)
    return grouped_matmul(x, by_out.transpose(1, 2), offsets)


def tessel_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts' output ``[T, H]`` for ``hidden_states [T, H]`` routed to ``top_k_index [T, k]`` with weights
    ``top_k_weights [T, k]``: the signature of transformers' experts implementations (see the module's notes)."""
    experts, k = self.num_experts, top_k_index.shape[-1]
    tokens, hidden = hidden_states.shape[0], hidden_states.shape[-1]
    ids, order = torch.sort(top_k_index.reshape(-1), stable=True)  # routes grouped by expert, in token order within
    rows = hidden_states[order // k]
    # Each expert's first row, found in the sorted ids (no host synchronisation, as bincount has on a GPU); a
    # sentinel (id == experts) sorts past every expert's rows and belongs to none.
    offsets = torch.searchsorted(ids, torch.arange(experts + 1, device=ids.device, dtype=ids.dtype))
    skipped = (ids >= experts).unsqueeze(-1) if getattr(self, "_is_expert_parallel", False) else None
    if skipped is not None:
        rows = rows.masked_fill(skipped, 0.0)
    expert_of_row = ids.clamp(max=experts - 1)  # in range for the bias lookups; sentinel rows are zeroed anyway

    first = self.gate_up_proj if self.has_gate else self.up_proj
    h = _projection(self, rows, first, offsets)
    if self.has_bias:
        h = h + (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)[expert_of_row]
    if skipped is not None:
        h = h.masked_fill(skipped, 0.0)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    out = _projection(self, h, self.down_proj, offsets)
    if self.has_bias:
        out = out + self.down_proj_bias[expert_of_row]
    if skipped is not None:
        out = out.masked_fill(skipped, 0.0)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)  # fp32 routing weights promote, as transformers' do
    back = torch.empty_like(order)
    back[order] = torch.arange(order.shape[0], device=order.device)
    # each token's k routes summed in one reduction (fp32 inside torch.sum, one rounding), never scattered with atomics
    return out[back].view(tokens, k, hidden).sum(dim=1).to(hidden_states.dtype)


def register_hf_experts() -> str:
    """Register :func:`tessel_experts_forward` with transformers as ``experts_implementation="tessel"``.
    Idempotent; returns ``"tessel"``."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register("tessel", tessel_experts_forward)
    return "tessel"
