"""Timelines of pipeline schedules: recorded from a real run or simulated; Chrome trace JSON and a PNG Gantt chart.

An event is one action on one rank with its start and end. Real runs record host time
(``time.perf_counter``: CLOCK_MONOTONIC, shared by every process on a Linux host, so the ranks of one
machine line up; clocks of different hosts are not synchronised); on CUDA the compute spans are CUDA
events resolved after the step, so recording never blocks the host. Simulated timelines are in the
simulator's cost units. matplotlib is imported only when a chart is drawn.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from .actions import Action

__all__ = ["TimelineEvent", "TimelineRecorder", "gather_timeline", "plot_timeline", "write_chrome_trace"]

_COLORS = {"F": "#4c78a8", "B": "#59a14f", "W": "#f28e2b", "BW": "#2a9d8f"}


@dataclass(frozen=True)
class TimelineEvent:
    """``kind`` of ``stage`` on ``microbatch`` ran on ``rank`` from ``start`` to ``end`` (seconds or cost units)."""

    rank: int
    kind: str
    stage: int
    microbatch: int
    start: float
    end: float

    @property
    def is_compute(self) -> bool:
        return self.kind in _COLORS


class TimelineRecorder:
    """Records the span of each action one rank runs; :meth:`events` returns them in seconds."""

    def __init__(self, rank: int, device: torch.device):
        self.rank = rank
        self._cuda = device.type == "cuda"
        self._spans: list[tuple[Action, object, object]] = []
        self._origin_host = time.perf_counter()
        self._origin = None
        if self._cuda:
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()

    @contextlib.contextmanager
    def span(self, *actions: Action):
        """Time the block as the span of ``actions`` (several: a batch of transfers posted and waited together)."""
        timed_on_device = self._cuda and all(a.is_compute for a in actions)
        start = self._stamp(timed_on_device)
        try:
            yield
        finally:
            end = self._stamp(timed_on_device)
            self._spans += [(a, start, end) for a in actions]

    def _stamp(self, on_device: bool):
        if not on_device:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _seconds(self, stamp) -> float:
        if isinstance(stamp, float):
            return stamp
        stamp.synchronize()
        return self._origin_host + self._origin.elapsed_time(stamp) / 1e3

    def events(self) -> list[TimelineEvent]:
        return [
            TimelineEvent(self.rank, a.kind.value, a.stage, a.microbatch, self._seconds(s), self._seconds(e))
            for a, s, e in self._spans
        ]


def gather_timeline(events: Sequence[TimelineEvent], group: dist.ProcessGroup | None = None) -> list[TimelineEvent]:
    """Every rank's events of ``group`` on every rank (a collective), times shifted to start at 0."""
    if dist.is_initialized():
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, [asdict(e) for e in events], group=group)
        events = [TimelineEvent(**e) for rank_events in gathered for e in rank_events]
    origin = min((e.start for e in events), default=0.0)
    return [TimelineEvent(e.rank, e.kind, e.stage, e.microbatch, e.start - origin, e.end - origin) for e in events]


def write_chrome_trace(
    events: Sequence[TimelineEvent], path: str | os.PathLike, *, seconds_per_unit: float = 1.0
) -> None:
    """Write ``events`` as Chrome trace JSON (chrome://tracing, Perfetto): one process row per rank.

    ``seconds_per_unit`` converts the events' time unit (1 for a recorded run; e.g. 1e-3 to show a
    simulation's cost units as milliseconds).
    """
    scale = seconds_per_unit * 1e6  # the trace format counts microseconds
    trace = [
        {
            "name": f"{e.kind}{e.microbatch}",
            "cat": e.kind,
            "ph": "X",
            "ts": e.start * scale,
            "dur": (e.end - e.start) * scale,
            "pid": e.rank,
            "tid": e.stage,
            "args": {"stage": e.stage, "microbatch": e.microbatch},
        }
        for e in events
    ]
    trace += [
        {"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"pp rank {r}"}}
        for r in sorted({e.rank for e in events})
    ]
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)


def plot_timeline(
    panels: Sequence[TimelineEvent] | Mapping[str, Sequence[TimelineEvent]],
    path: str | os.PathLike,
    *,
    unit: str = "s",
) -> None:
    """Draw a Gantt chart (one row per rank, one bar per compute action) of one or several timelines as PNG.

    ``panels`` is a list of events, or a mapping from a title to a list of events (one chart each,
    stacked, on one time axis). Bars are coloured by kind and labelled with the microbatch (and a letter
    for the stage, as in :func:`~.grid.format_grid`, when a rank holds several); idle time is blank.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not isinstance(panels, Mapping):
        panels = {"": panels}
    heights = [max(1, len({e.rank for e in events})) * 0.4 + 0.9 for events in panels.values()]
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})  # fmt: skip
    span = max((e.end for events in panels.values() for e in events), default=1.0) or 1.0  # one time axis
    for ax, (title, events) in zip(axes[:, 0], panels.items()):
        _draw(ax, [e for e in events if e.is_compute], title, unit, span)
    handles = [Patch(color=c, label=k) for k, c in _COLORS.items()]
    fig.legend(handles=handles, loc="upper right", ncol=len(handles))
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw(ax, events: Sequence[TimelineEvent], title: str, unit: str, span: float) -> None:
    ranks = sorted({e.rank for e in events})
    chunk = {}  # (rank, stage) -> a, b, ... when a rank holds several stages
    for r in ranks:
        stages = sorted({e.stage for e in events if e.rank == r})
        chunk.update({(r, s): chr(ord("a") + k) for k, s in enumerate(stages)} if len(stages) > 1 else {})
    for e in events:
        ax.barh(e.rank, e.end - e.start, left=e.start, height=0.8, color=_COLORS[e.kind], edgecolor="white")
        if (e.end - e.start) / span > 0.012:  # label bars wide enough to hold a number
            label = f"{e.microbatch}{chunk.get((e.rank, e.stage), '')}"
            ax.text((e.start + e.end) / 2, e.rank, label, ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlim(0, span)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title, fontsize=9, loc="left")
