"""Print a pipeline program as an ASCII grid: one row per rank, one column per unit of simulated time.

A cell shows the action occupying the rank at that time: its kind and microbatch (``F3``, ``B3``,
``W3``; a combined backward ``BW3`` spans ``B + W`` columns), with a letter for the rank's stage
(``a`` its first, ``b`` its second, ...) when a rank holds several; ``.`` is idle. Example, 1F1B with
p = 2, m = 3 and unit costs::

    rank 0 | F0  F1  .   .   BW0 BW0 F2  BW1 BW1 .   BW2 BW2
    rank 1 | .   F0  BW0 BW0 F1  BW1 BW1 F2  BW2 BW2 .   .
"""

from __future__ import annotations

from .actions import PipelineProgram
from .simulate import Costs, simulate

__all__ = ["format_grid"]


def format_grid(program: PipelineProgram, costs: Costs | None = None) -> str:
    """The grid of ``program`` simulated with ``costs`` (unit F, B, W by default; all must be whole numbers)."""
    costs = costs or Costs()
    for name in ("F", "B", "W", "comm"):
        if float(getattr(costs, name)) != int(getattr(costs, name)):
            raise ValueError(f"format_grid: costs must be whole numbers of time units, received {name}={costs!r}")
    sim = simulate(program, costs)
    several = program.stages_per_rank > 1
    cells = [["."] * int(sim.makespan) for _ in range(program.num_ranks)]
    for e in sim.events:
        label = f"{e.kind}{e.microbatch}" + (chr(ord("a") + e.stage // program.num_ranks) if several else "")
        for t in range(int(e.start), int(e.end)):
            cells[e.rank][t] = label
    width = max((len(c) for row in cells for c in row), default=1)
    return "\n".join(f"rank {r} | " + " ".join(c.ljust(width) for c in row).rstrip() for r, row in enumerate(cells))
