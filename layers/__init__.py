"""nn.Modules built from tessel's kernels and parallel ops."""

from .linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]
