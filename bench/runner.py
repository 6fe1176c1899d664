"""What every benchmark suite shares: timing, the environment record, peak throughput, result files.

A suite returns a list of rows (flat dicts with the same keys in the same order); this module prints
them as an aligned table and writes ``<out>/<date>-<device>-<suite>.json`` plus a markdown table
beside it. GPU timings use ``triton.testing.do_bench`` (median, L2 flushed between runs). On a CPU
the kernels run through Triton's interpreter, and every output says plainly that those timings are
not performance numbers.

Triton is imported inside the functions that need it, so importing this module does not fix the
``TRITON_INTERPRET`` flag before the CLI has set it.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

__all__ = [
    "PEAK_TFLOPS",
    "capture_graph",
    "caveat",
    "environment",
    "geomean",
    "geomean_rows",
    "graph_time",
    "host_time",
    "peak_tflops",
    "print_table",
    "report",
    "suite_device",
    "synced",
    "time_fn",
    "write_results",
]

# Dense (no sparsity) tensor-core peaks from the vendor datasheets, in TFLOP/s. Matched in order
# against torch.cuda.get_device_name(); PCIe/NVL variants run at lower clocks and are left unknown.
_UNKNOWN_VARIANTS = ("H100 PCIe", "H100 NVL", "H200 NVL")
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100": {"fp8": 1978.9, "bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H200": {"fp8": 1978.9, "bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
}

_DTYPE_NAMES = {torch.float8_e4m3fn: "fp8", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _check_fn(name: str, fn) -> None:
    if not callable(fn):
        raise TypeError(f"{name}: fn must be a callable taking no arguments, received {type(fn).__name__}")


def _check_count(name: str, arg: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: {arg} must be a positive int, received {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: {arg} must be a positive int, received {value}")


def time_fn(fn: Callable[[], object], *, cuda: bool | None = None, reps: int = 3) -> float:
    """Median wall time of ``fn()`` in milliseconds.

    CUDA: ``triton.testing.do_bench`` (25 ms warm-up, 100 ms of runs, L2 flushed before each run).
    CPU: one warm-up call, then ``reps`` timed calls with ``time.perf_counter``.
    """
    _check_fn("time_fn", fn)
    _check_count("time_fn", "reps", reps)
    if cuda is not None and not isinstance(cuda, bool):
        raise TypeError(f"time_fn: cuda must be a bool or None, received {type(cuda).__name__}")
    if torch.cuda.is_available() if cuda is None else cuda:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def host_time(fn: Callable[[], object], *, calls: int = 50) -> float | None:
    """Milliseconds of host time per ``fn()`` on CUDA: ``calls`` calls issued back to back without waiting
    for the GPU, after a warm-up call. When it is as long as the device time, the GPU waits for the host
    (launch and Python overhead) and a faster kernel would not show. None on a CPU, where the work itself
    runs on the host."""
    _check_fn("host_time", fn)
    _check_count("host_time", "calls", calls)
    if not torch.cuda.is_available():
        return None
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e3


def capture_graph(fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
    """``fn`` captured in a CUDA graph, and what the captured call returned (the tensors each replay rewrites).

    ``fn`` runs a few times on a side stream first, as torch's graph capture asks: autotuners time their
    candidates there, outside the capture, and lazy initialisations happen before it."""
    _check_fn("capture_graph", fn)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


def graph_time(fn: Callable[[], object], *, label: str = "fn") -> float | None:
    """Median milliseconds of one replay of ``fn`` captured in a CUDA graph (:func:`capture_graph`; ``do_bench``
    as :func:`time_fn`): the device time of its work without the host's launch overhead, as a training or
    decode loop captured in a graph would run it. None on a CPU; None, with the reason printed, when the
    capture fails."""
    _check_fn("graph_time", fn)
    if not isinstance(label, str):
        raise TypeError(f"graph_time: label must be a str, received {type(label).__name__}")
    if not torch.cuda.is_available():
        return None
    import triton.testing

    try:
        graph, _ = capture_graph(fn)
    except RuntimeError as exc:
        print(f"graph_time: the capture of {label} failed: {exc}", file=sys.stderr)
        return None
    try:
        return float(triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median"))
    finally:
        graph.reset()


def synced(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` followed, on CUDA, by a device synchronisation, so that a wall clock (pytest-benchmark's)
    covers the kernels it launched; ``fn`` itself on a CPU."""
    if not torch.cuda.is_available():
        return fn

    def run():
        fn()
        torch.cuda.synchronize()

    return run


def geomean(values: Sequence[float]) -> float | None:
    """Geometric mean of positive values; None for an empty sequence."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def geomean_rows(rows: Sequence[dict], columns: Sequence[str], key: str, groups: Sequence, **fixed) -> list[dict]:
    """One row per value of ``rows[i][key]`` in ``groups`` whose only figure is the geometric mean of its
    ``tessel/torch`` ratios (``fixed`` fills other cells, e.g. the dtype)."""
    return [
        {**dict.fromkeys(columns), "case": "geomean", key: group, **fixed,
         "tessel/torch": geomean([r["tessel/torch"] for r in rows if r[key] == group])}
        for group in groups
    ]  # fmt: skip


def suite_device(dtype: torch.dtype | None) -> tuple[bool, str, torch.dtype, float | None]:
    """``(cuda, device, dtype, peak)`` of a suite's run: the GPU when there is one, ``dtype`` defaulting to
    bf16 there and to fp32 on a CPU (the interpreter computes dots in fp32 anyway), and the dense peak
    TFLOP/s of that dtype on that GPU (None on a CPU or an unknown GPU)."""
    cuda = torch.cuda.is_available()
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    return cuda, "cuda" if cuda else "cpu", dtype, peak_tflops(torch.cuda.get_device_name(), dtype) if cuda else None


def peak_tflops(device: str, dtype: torch.dtype) -> float | None:
    """Dense tensor-core peak for ``dtype`` on ``device`` (a CUDA device name); None when unknown.

    fp32 counts as TF32 when torch lets cuBLAS use it (the kernels follow the same setting).
    """
    if any(variant in device for variant in _UNKNOWN_VARIANTS):
        return None
    name = _DTYPE_NAMES.get(dtype)
    if name == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        name = "tf32"
    for gpu, peaks in PEAK_TFLOPS.items():
        if gpu in device:
            return peaks.get(name)
    return None


def _driver_version() -> str | None:
    """The NVIDIA driver version from ``nvidia-smi``, or None where it is missing or fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    cmd = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    try:
        lines = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return lines[0] if lines else None


def environment() -> dict:
    """Date, device, driver and software versions, and whether Triton's interpreter ran the kernels."""
    import triton

    cuda = torch.cuda.is_available()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "driver": _driver_version() if cuda else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "interpreter": not cuda and os.environ.get("TRITON_INTERPRET") == "1",
    }


def caveat(env: dict) -> str | None:
    """The warning that CPU timings are not performance numbers; None on a GPU."""
    if env["device"] != "cpu":
        return None
    runner = "Triton's interpreter" if env["interpreter"] else "tessel's plain-PyTorch reference"
    return (
        f"NOTE: no GPU: these timings come from {runner} on a CPU and are not performance numbers; "
        "the rows only show that every case runs and matches torch."
    )


def _device_slug(env: dict) -> str:
    if env["device"] == "cpu":
        return "cpu-interpreter" if env["interpreter"] else "cpu-reference"
    name = env["device"].lower().removeprefix("nvidia").strip()
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _grid(rows: Sequence[dict], columns: Sequence[str] | None) -> tuple[list[str], list[list[str]]]:
    columns = list(columns if columns is not None else (rows[0] if rows else ()))
    return columns, [[_cell(row.get(c)) for c in columns] for row in rows]


def print_table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> None:
    """Print rows as an aligned plain-text table (all keys of the first row unless ``columns``)."""
    columns, cells = _grid(rows, columns)
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    right = [all(_is_number(row.get(c)) for row in rows) for c in columns]
    for line in [columns, None, *cells]:
        if line is None:
            print("  ".join("-" * w for w in widths))
            continue
        print("  ".join(s.rjust(w) if r else s.ljust(w) for s, w, r in zip(line, widths, right)).rstrip())


def _is_number(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _markdown(suite: str, rows: Sequence[dict], env: dict) -> str:
    lines = [
        f"# tessel benchmark: {suite}",
        "",
        f"- date: {env['date']}",
        f"- GPU: {env['device'] if env['device'] != 'cpu' else 'none (cpu)'}",
        f"- driver: {env['driver'] or '-'}",
        f"- CUDA: {env['cuda'] or '-'}",
        f"- torch: {env['torch']}",
        f"- triton: {env['triton']}",
        "",
    ]
    if caveat(env):
        lines += [f"**{caveat(env)}**", ""]
    columns, cells = _grid(rows, None)
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(r) + " |" for r in cells]
    return "\n".join(lines) + "\n"


def write_results(
    suite: str, rows: Sequence[dict], env: dict, out_dir: str | os.PathLike, timed: bool = True
) -> tuple[Path, Path]:
    """Write ``<out_dir>/<YYYY-MM-DD>-<device>-<suite>.json`` and the ``.md`` table beside it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{env['date'][:10]}-{_device_slug(env)}-{suite}"
    record = {"suite": suite, **env, "caveat": caveat(env) if timed else None, "rows": list(rows)}
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps(record, indent=2) + "\n")
    md_path.write_text(_markdown(suite, rows, env))
    return json_path, md_path


def report(
    suite: str, rows: Sequence[dict], env: dict, out_dir: str | os.PathLike, timed: bool = True
) -> tuple[Path, Path]:
    """Print the table (between two copies of the CPU caveat when its rows are timings), write the files."""
    warning = caveat(env) if timed else None
    if warning:
        print(warning)
    print_table(rows)
    if warning:
        print(warning)
    paths = write_results(suite, rows, env, out_dir, timed)
    print(f"wrote {paths[0]} and {paths[1]}")
    return paths
