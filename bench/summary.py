"""The whole suite's record: one JSON and one markdown file per run, and a PNG of tessel's ratios.

``python -m tessel.bench`` (every suite) writes, besides each suite's own files,
``<out>/<date>-<device>.json`` with every suite's rows and the environment, ``.md`` with every table, and
``.png`` with one panel per suite that has a ratio column: tessel against the baseline measured in the
same run (``tessel/torch``; ``ring/gemm`` for the emulated overlap, lower is better there), one bar per
row. On a CPU the PNG's title says that the timings come from the interpreter and mean nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from .runner import _device_slug, _markdown, caveat

__all__ = ["RATIO_COLUMNS", "plot_ratios", "write_summary"]

RATIO_COLUMNS = ("tessel/torch", "ring/gemm", "speedup_vs_plain")


def _label(row: Mapping) -> str:
    keys = ("case", "op", "pass", "shape", "numel", "kernel", "tile")
    parts = [str(row[k]) for k in keys if row.get(k) not in (None, "")]
    if row.get("tp") is not None:
        parts.append(f"tp={row['tp']}")
    if isinstance(row.get("causal"), bool):
        parts.append("causal" if row["causal"] else "non-causal")
    return " ".join(parts)


def plot_ratios(results: Mapping[str, Sequence[dict]], env: dict, path: Path) -> Path | None:
    """One horizontal bar chart per suite with a ratio column; None when matplotlib is missing or none has one."""
    panels = []
    for suite, rows in results.items():
        column = next((c for c in RATIO_COLUMNS if any(isinstance(r.get(c), float) for r in rows)), None)
        if column is not None:
            points = [(_label(r), r[column]) for r in rows if isinstance(r.get(column), float)]
            panels.append((suite, column, points))
    if not panels:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the ``bench`` extra brings it
        print("tessel.bench: matplotlib is not installed; no plot written")
        return None
    heights = [max(1.5, 0.3 * len(points) + 0.8) for _, _, points in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, sum(heights)), gridspec_kw={"height_ratios": heights})
    axes = [axes] if len(panels) == 1 else list(axes)
    for ax, (suite, column, points) in zip(axes, panels):
        labels, values = zip(*points)
        ax.barh(range(len(values)), values, color="tab:blue")
        ax.set_yticks(range(len(values)), labels, fontsize=7)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.invert_yaxis()
        ax.set_title(f"{suite}: {column}", fontsize=9)
    title = f"tessel on {env['device']} ({env['date'][:10]})"
    if caveat(env):
        title += "\nno GPU: interpreter timings, not performance numbers"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_summary(results: Mapping[str, Sequence[dict]], env: dict, out_dir: str | os.PathLike) -> list[Path]:
    """Write ``<out_dir>/<date>-<device>.json``, ``.md`` and (when there is something to plot) ``.png``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{env['date'][:10]}-{_device_slug(env)}"
    record = {**env, "caveat": caveat(env), "suites": {name: list(rows) for name, rows in results.items()}}
    json_path, md_path = stem.with_suffix(".json"), stem.with_suffix(".md")
    json_path.write_text(json.dumps(record, indent=2) + "\n")
    md_path.write_text("\n".join(_markdown(name, rows, env) for name, rows in results.items()))
    written = [json_path, md_path]
    png = plot_ratios(results, env, stem.with_suffix(".png"))
    return written + ([png] if png else [])
