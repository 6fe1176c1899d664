"""The pipeline suite: bubble fraction and peak activations of every schedule, simulated on the CPU.

For p ∈ {2, 4, 8} ranks, m ∈ {p, 4p, 8p} microbatches and each schedule (GPipe, 1F1B, interleaved 1F1B
with v = 2 stages per rank, ZB-H1), the program is validated and simulated with unit costs
F = B = W per rank's share of the model (a combined backward costs B + W; a stage of an interleaved
rank holds 1/v of the rank's layers and costs 1/v) and free communication, so makespans compare
across schedules. Each row gives the simulated
bubble beside the formula of DESIGN.md "Pipeline"; the suite stops with :class:`BenchmarkError` if they
differ. These figures do not depend on the hardware: they are the same on every machine.

It also prints the ASCII grids of the p = 4, m = 8 programs and draws them as a Gantt chart,
``<out_dir>/<date>-pipeline-schedules-p4-m8.png``.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from pathlib import Path

import torch

from ..parallel.pipeline.actions import PipelineProgram
from ..parallel.pipeline.grid import format_grid
from ..parallel.pipeline.programs import gpipe_program, interleaved_program, one_f_one_b_program, zero_bubble_program
from ..parallel.pipeline.simulate import Costs, simulate
from ..parallel.pipeline.timeline import plot_timeline
from .matmul import BenchmarkError

__all__ = ["COLUMNS", "SCHEDULES", "pipeline_cases", "run_pipeline_suite"]

V = 2  # stages per rank of the interleaved schedule

# name -> (program builder (p, m), stages per rank, bubble formula (p, m) at unit costs)
SCHEDULES: dict[str, tuple[Callable[[int, int], PipelineProgram], int, Callable[[int, int], float]]] = {
    "GPipe": (gpipe_program, 1, lambda p, m: (p - 1) / (m + p - 1)),
    "1F1B": (one_f_one_b_program, 1, lambda p, m: (p - 1) / (m + p - 1)),
    f"Interleaved1F1B(v={V})": (lambda p, m: interleaved_program(p, m, V), V, lambda p, m: (p - 1) / (V * m + p - 1)),
    "ZB-H1": (zero_bubble_program, 1, lambda p, m: (p - 1) / (3 * m + p - 1)),
}
COLUMNS = (
    "schedule", "p", "m", "v", "makespan", "bubble", "formula", "bubble/1F1B", "peak_activations",
    "peak_microbatches",
)  # fmt: skip
GRID_LAYOUT = (4, 8)
_EXACT = 1e-9  # the simulation and the formula are ratios of the same small integers


def pipeline_cases(quick: bool = False) -> list[tuple[int, int]]:
    """(p, m) layouts of the suite; ``quick`` drops m = 8p."""
    return [(p, m) for p in (2, 4, 8) for m in (p, 4 * p) + (() if quick else (8 * p,))]


def _simulate(name: str, p: int, m: int):
    """Unit costs per rank's share of the model: a stage of an interleaved rank holds 1/v of it."""
    build, v, _ = SCHEDULES[name]
    return simulate(build(p, m), Costs(F=1 / v, B=1 / v, W=1 / v))


def _row(name: str, p: int, m: int) -> dict:
    _, v, formula = SCHEDULES[name]
    sim = _simulate(name, p, m)
    expected = formula(p, m)
    if not abs(sim.bubble_fraction - expected) <= _EXACT:
        raise BenchmarkError(
            f"pipeline suite: {name} with p={p}, m={m}: simulated bubble {sim.bubble_fraction:.6f} differs from "
            f"the formula's {expected:.6f}"
        )
    one_f_one_b = SCHEDULES["1F1B"][2](p, m)
    peak = max(sim.peak_activations)
    values = (name, p, m, v, sim.makespan, sim.bubble_fraction, expected, sim.bubble_fraction / one_f_one_b, peak,
              peak / v)  # fmt: skip
    return dict(zip(COLUMNS, values, strict=True))


def _draw(out_dir: str | Path) -> Path:
    p, m = GRID_LAYOUT
    panels = {}
    for name, (build, _, _) in SCHEDULES.items():
        sim = _simulate(name, p, m)
        print(f"{name}, p={p}, m={m}: bubble {sim.bubble_fraction:.3f} (one column per stage action)")
        print(format_grid(build(p, m)))
        panels[f"{name}: bubble {sim.bubble_fraction:.3f}, peak activations {max(sim.peak_activations)}"] = sim.events
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{datetime.date.today().isoformat()}-pipeline-schedules-p{p}-m{m}.png"
    plot_timeline(panels, path, unit="unit-cost time steps")
    print(f"wrote {path}")
    return path


def run_pipeline_suite(dtype: torch.dtype | None = None, quick: bool = False, out_dir: str | Path = "bench/results"):
    """Simulate every schedule × layout; returns one row per case. ``dtype`` is unused (nothing is computed
    in a dtype: the figures are counts of unit-cost actions)."""
    rows = [_row(name, p, m) for p, m in pipeline_cases(quick) for name in SCHEDULES]
    _draw(out_dir)
    return rows
