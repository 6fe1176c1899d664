"""nn.Modules built from tessel's kernels and parallel ops (column/row-parallel linear, attention, MLP, GPT)."""

__all__: list[str] = []
