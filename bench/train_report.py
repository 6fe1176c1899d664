"""What a training run shows and leaves behind: the progress bar, the summary table, the loss curve, the JSON.

Only rank 0 draws and writes. Throughput excludes the first step a process runs (it includes Triton's
compilation, or on a CPU the interpreter's first pass); model FLOPs utilisation is the model's training
FLOPs per token (``6·N + 12·L·E·S``, PaLM App. B) times tokens per second, over the dense peak of every
GPU in the world (``bench/runner.py``'s table), and is reported only on a GPU whose peak is known.
"""

from __future__ import annotations

import json
import resource
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .runner import print_table

__all__ = ["Progress", "StepProfiler", "StepRecord", "memory_peak_bytes", "plot_loss", "summarize", "write_json"]


@dataclass
class StepRecord:
    """One optimizer step: its index (1-based count of completed steps), mean loss over the global batch,
    wall time, tokens, and the held-out loss when the run evaluated after it (None otherwise)."""

    step: int
    loss: float
    step_s: float
    tokens: int
    eval_loss: float | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s if self.step_s > 0 else float("nan")


@dataclass
class Progress:
    """A tqdm bar on rank 0 (loss, tokens/s, step time); nothing on other ranks."""

    total: int
    initial: int = 0
    enabled: bool = True
    _bar: object = field(default=None, repr=False)
    _eval: str = ""  # the latest held-out loss, shown until the next

    def __post_init__(self):
        if self.enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total, initial=self.initial, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True
            )

    def update(self, record: StepRecord) -> None:
        if self._bar is None:
            return
        if record.eval_loss is not None:
            self._eval = f" eval={record.eval_loss:.4f}"
        self._bar.set_postfix_str(
            f"loss={record.loss:.4f}{self._eval} tok/s={record.tokens_per_s:,.0f} step={record.step_s * 1e3:.0f}ms",
            refresh=False,
        )
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class StepProfiler:
    """A Chrome trace (torch.profiler) of ``steps`` steps, from the second this process runs (the first
    compiles), of the steps ``[start, stop)`` of the run."""

    def __init__(self, path: Path, start: int, stop: int, enabled: bool, steps: int = 3):
        self.path = path
        first = start + 1 if stop - start > 1 else start
        self.steps = range(first, min(first + steps, stop)) if enabled else range(0)
        self.prof = None

    def before(self, step: int) -> None:
        if step == self.steps.start and step in self.steps:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self.prof.__enter__()

    def after(self, step: int) -> None:
        if self.prof is not None and step == self.steps[-1]:
            self.prof.__exit__(None, None, None)
            self.prof.export_chrome_trace(str(self.path))
            self.prof = None


def memory_peak_bytes(device: torch.device) -> int:
    """Peak bytes this process held: CUDA's allocator peak on a GPU, the peak resident set size on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _throughput(records: list[StepRecord]) -> tuple[float | None, float | None]:
    """Tokens per second and median step time, without the first step of this process when there are more."""
    timed = records[1:] if len(records) > 1 else records
    if not timed:
        return None, None
    seconds = sorted(r.step_s for r in timed)
    return sum(r.tokens for r in timed) / sum(seconds), seconds[len(seconds) // 2]


def summarize(
    records: list[StepRecord],
    *,
    flops_per_token: float,
    peak_tflops: float | None,
    world_size: int,
    memory_bytes: int,
    layout: str,
    num_params: int,
) -> dict:
    """The run's figures as a flat dict (None where not measured)."""
    tokens_per_s, median_step_s = _throughput(records)
    mfu = None
    if peak_tflops and tokens_per_s:
        mfu = flops_per_token * tokens_per_s / (peak_tflops * 1e12 * world_size)
    return {
        "steps": records[-1].step if records else 0,
        "first_loss": records[0].loss if records else None,
        "final_loss": records[-1].loss if records else None,
        "tokens_per_s": tokens_per_s,
        "median_step_ms": median_step_s * 1e3 if median_step_s else None,
        "model_tflops_per_s": flops_per_token * tokens_per_s / 1e12 if tokens_per_s else None,
        "mfu": mfu,
        "peak_memory_gib": memory_bytes / 2**30,
        "layout": layout,
        "parameters": num_params,
    }


def print_summary(summary: dict, caveat: str | None) -> None:
    """The summary as a two-column table on stdout, with the CPU caveat when there is one."""
    rows = [{"metric": key, "value": value} for key, value in summary.items()]
    print_table(rows, ["metric", "value"])
    if caveat:
        print(caveat)


def plot_loss(records: list[StepRecord], path: Path, title: str) -> None:
    """The loss curve as a PNG (matplotlib, imported here so the run does not need it before the end)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, losses = [r.step for r in records], [r.loss for r in records]
    smooth, ema = [], losses[0]
    for loss in losses:  # exponential moving average over ~10 steps, to show the trend through the noise
        ema = 0.9 * ema + 0.1 * loss
        smooth.append(ema)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, lw=0.8, alpha=0.45, label="loss of each step")
    ax.plot(steps, smooth, lw=1.8, label="moving average (0.9)")
    evaluated = [(r.step, r.eval_loss) for r in records if r.eval_loss is not None]
    if evaluated:
        ax.plot(*zip(*evaluated, strict=True), "o-", lw=1.2, ms=4, label="held-out loss")
    ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_json(path: Path, record: dict) -> None:
    path.write_text(json.dumps(record, indent=2) + "\n")
