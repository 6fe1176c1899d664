"""The tensor-parallel MLP: a column-parallel up-projection, an activation, a row-parallel down-projection.

Legend: ``B`` batch, ``S`` sequence, ``E`` model width, ``F`` hidden width, ``t`` tensor-parallel size.
Rank r holds ``fc.weight [F/t (per part), E]`` and ``proj.weight [E, F/t]``: the hidden activation never
leaves the rank, so the block communicates twice per pass (Megatron-LM, Shoeybi et al. 2019, §3): the
column layer's input gradient (or its sequence all-gather) and the row layer's output reduction.
SwiGLU (Shazeer 2020) fuses gate and up into one column layer with two parts, sharing one gathered input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["MLP_ACTIVATIONS", "ParallelMLP"]

MLP_ACTIVATIONS = ("swiglu", "gelu")


class ParallelMLP(nn.Module):
    """``proj(act(fc(x)))`` with ``act`` SwiGLU (``silu(gate) · up``) or GELU (erf form).

    Input and output are ``[B, S, E]`` (``[B, S/t, E]`` under ``sequence_parallel``).
    """

    def __init__(self, n_embd: int, hidden: int, *, activation: str = "swiglu", bias: bool = False,
                 tp_group=None, sequence_parallel: bool = False, overlap="auto", device=None, dtype=None):  # fmt: skip
        super().__init__()
        if activation not in MLP_ACTIVATIONS:
            raise ValueError(f"ParallelMLP: activation must be one of {MLP_ACTIVATIONS}, received {activation!r}")
        self.activation = activation
        parts = (hidden, hidden) if activation == "swiglu" else hidden
        kw = dict(tp_group=tp_group, sequence_parallel=sequence_parallel, overlap=overlap, device=device, dtype=dtype)
        self.fc = ColumnParallelLinear(n_embd, parts, bias, **kw)
        self.proj = RowParallelLinear(hidden, n_embd, bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            gate, up = self.fc(x)
            return self.proj(F.silu(gate) * up)
        return self.proj(F.gelu(self.fc(x)))
