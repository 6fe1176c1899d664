"""Simulate a pipeline program on the CPU: makespan, bubble fraction and peak activations from action costs.

Each rank runs its list in order. A compute takes its cost (a combined backward ``BW`` costs
``B + W``); a send takes no time on its rank and its data arrive ``comm`` later; a receive waits for
them (buffered sends, blocking receives: :func:`~.validate.replay`). With ``T`` the makespan and
``busy_r`` the compute time of rank r:

- bubble of rank r: ``(T - busy_r) / T``; overall: ``1 - Σ busy_r / (p·T)`` (idle share of the machine);
- peak activations of rank r: the most (stage, microbatch) forwards it holds at once, counting from
  the start of ``F`` to the end of the backward that frees them (``BW``, or ``W`` when split, since the
  weight gradient still needs the stage's inputs). With v stages per rank each holds 1/v of the rank's
  layers, so ``peak_activations / v`` is the peak in units of a whole rank's microbatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .actions import Action, ActionKind, PipelineProgram
from .timeline import TimelineEvent
from .validate import replay, validate

__all__ = ["Costs", "Simulation", "simulate"]


@dataclass(frozen=True)
class Costs:
    """Time of each action kind, in any unit; ``comm`` is the latency of one transfer."""

    F: float = 1.0
    B: float = 1.0
    W: float = 1.0
    comm: float = 0.0

    def __post_init__(self):
        for name in ("F", "B", "W", "comm"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"Costs: {name} must be a non-negative number, received {value!r}")

    def of(self, action: Action) -> float:
        if action.is_comm:
            return self.comm if action.is_send else 0.0
        return self.B + self.W if action.kind == ActionKind.BW else getattr(self, action.kind.value)


@dataclass
class Simulation:
    """What :func:`simulate` measured; ``events`` hold every compute with its simulated start and end."""

    program: PipelineProgram
    costs: Costs
    makespan: float
    busy: list[float]
    bubble: list[float]
    bubble_fraction: float
    peak_activations: list[int]
    events: list[TimelineEvent] = field(repr=False)

    @property
    def idle(self) -> list[float]:
        """Idle time of each rank (``makespan - busy``)."""
        return [self.makespan - b for b in self.busy]


def simulate(program: PipelineProgram, costs: Costs | None = None) -> Simulation:
    """Validate ``program`` and run it against ``costs`` (unit F, B, W and free communication by default)."""
    costs = costs or Costs()
    validate(program)
    timed = replay(program, costs.of)
    events = [
        TimelineEvent(rank, a.kind.value, a.stage, a.microbatch, start, end)
        for rank, actions in enumerate(timed)
        for a, start, end in actions
        if a.is_compute
    ]
    makespan = max((e.end for e in events), default=0.0)
    busy = [sum(e.end - e.start for e in events if e.rank == r) for r in range(program.num_ranks)]
    bubble = [(makespan - b) / makespan if makespan else 0.0 for b in busy]
    overall = 1.0 - sum(busy) / (program.num_ranks * makespan) if makespan else 0.0
    peaks = [_peak_activations(actions) for actions in program.ranks]
    return Simulation(program, costs, makespan, busy, bubble, overall, peaks, events)


def _peak_activations(actions: tuple[Action, ...]) -> int:
    """The most forwards held at once by a rank running ``actions`` in order."""
    held = peak = 0
    for a in actions:
        if a.kind == ActionKind.F:
            held += 1
            peak = max(peak, held)
        elif a.kind in (ActionKind.BW, ActionKind.W):
            held -= 1
    return peak
