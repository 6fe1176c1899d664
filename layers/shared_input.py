"""Column-parallel layers a model calls one by one on the same input (a Hugging Face attention's ``q_proj``,
``k_proj`` and ``v_proj``; its MLP's ``gate_proj`` and ``up_proj``), computed together as Megatron-LM's fused
projections are: one op for all of them, so one all-reduce of the input's gradient instead of one each (or one
all-gather ring of a sequence-parallel input), the weight-gradient GEMMs overlapping it.

:class:`SharedInput` is attached to each of its layers (``layer.shared_input``). The first of them called with a
tensor computes every layer's output for it (:func:`~tessel.layers.linear.column_outputs`) and keeps the others'
until they are called with the same tensor. Where the model turns out to feed them different tensors (a sibling
called with another tensor while others wait), or not to call every one (some still waiting at the end of their
module's forward), the group stops computing ahead and each layer runs alone from then on; the layer that ran ahead
called again with siblings waiting is a new forward after one that stopped early (a recomputation for backward
ends once it has what backward needs), which drops what they wait for. Layers in fp8 share one fp8 op (their weights
quantised as one, as a fused layer's) when all of them run in fp8; a group mixing fp8 and higher precision, and
traced forwards (``torch.compile``: the compiler sees one op per layer), run each layer alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .linear import ColumnParallelLinear, column_outputs, column_settings

__all__ = ["SharedInput", "share_inputs"]


class SharedInput:
    """One op for ``columns`` (:class:`~tessel.layers.linear.ColumnParallelLinear` of one group, input width and
    settings) when the model calls each on the same tensor: see the module. Raises ``TypeError``/``ValueError`` for
    fewer than two such layers or layers that differ."""

    def __init__(self, columns: Sequence[ColumnParallelLinear]):
        columns = list(columns)
        if len(columns) < 2 or not all(type(c) is ColumnParallelLinear for c in columns):
            raise TypeError(f"SharedInput: expected two or more ColumnParallelLinear layers, received "
                            f"{[type(c).__name__ for c in columns]}")  # fmt: skip
        if len({column_settings(c) for c in columns}) != 1:
            raise ValueError("SharedInput: the layers must share their tensor-parallel group, in_features, "
                             "sequence_parallel, overlap, regather_input, dtype and device")  # fmt: skip
        self.columns, self.alone = columns, False
        self._input: torch.Tensor | None = None
        self._leader: ColumnParallelLinear | None = None
        self._outputs: dict[int, object] = {}
        for c in columns:
            c.shared_input = self

    def output(self, column: ColumnParallelLinear, x: torch.Tensor):
        """``column``'s output for ``x``: kept from the op a sibling ran on ``x``, or computed now (with the
        siblings', kept for them)."""
        if x is self._input and id(column) in self._outputs:
            out = self._outputs.pop(id(column))
            if not self._outputs:
                self._input = None
            return out
        if self._outputs:  # siblings left waiting: the last forward stopped early (the one that ran ahead calls
            # again: a recomputation that ends once it has what backward needs), or the model feeds them other tensors
            self.alone = self.alone or column is not self._leader
            self._input, self._outputs = None, {}
        if self.alone or torch.compiler.is_compiling() or len({c.fp8 for c in self.columns}) > 1:
            return column_outputs([column], x)[0]
        outputs = column_outputs(self.columns, x)
        self._input, self._leader = x, column
        self._outputs = {id(c): y for c, y in zip(self.columns, outputs) if c is not column}
        return outputs[self.columns.index(column)]

    def clear(self) -> None:
        """Drop what the siblings have not taken (the end of their block's forward): the model does not call every
        one of them, which run alone from then on."""
        if self._outputs:
            self.alone = True
        self._input, self._outputs = None, {}


def share_inputs(model: nn.Module, columns: dict[str, nn.Module]) -> list[SharedInput]:
    """A :class:`SharedInput` for each set of two or more of ``columns`` (``{name in model: layer}``; plain
    :class:`~tessel.layers.linear.ColumnParallelLinear` over more than one rank, not gathering their output) that
    sit in one module and share their settings; that module's forward hook clears what its forward left."""
    sets: dict[tuple, list[ColumnParallelLinear]] = {}
    for name, c in columns.items():
        if type(c) is ColumnParallelLinear and not c.gather_output and c.tp_size > 1:
            sets.setdefault((name.rpartition(".")[0], column_settings(c)), []).append(c)
    groups = []
    for (parent, _), layers in sets.items():
        if len(layers) > 1:
            group = SharedInput(layers)
            model.get_submodule(parent).register_forward_hook(lambda module, args, out, group=group: group.clear())
            groups.append(group)
    return groups
