"""The decode suite: attention of one new token per sequence over a KV cache, the step that generation repeats.

A decode step reads the whole cache once and does almost no arithmetic, so it is measured in bytes per
second: ``bytes = K + V + q + out`` (``2·B·Hkv·Sk·D + 2·B·Hq·D`` elements), what any implementation
must move at least. Three timings per shape:

- ``tessel``: ``flash_attention(q, k, v)`` with its own choice, which on CUDA is the split-KV kernel
  (each kv head's query heads in one tile, the keys cut into splits that fill the GPU, the partials
  merged by their log-sum-exp). Triton's interpreter never chooses split-KV, so on a CPU the suite
  asks for :data:`CPU_SPLITS` splits to run the same kernels.
- ``one_pass``: ``flash_attention(..., num_splits=1)``, the prefill kernel: one program per
  (query tile, query head), each walking the whole cache: what split-KV is there to beat.
- ``torch``: ``scaled_dot_product_attention(q, k, v, enable_gqa=True)`` with torch's own backend choice.

Each is first checked against torch (max relative error of ``out``, the run stops with
:class:`BenchmarkError` past the dtype's tolerance). A row reports the three times in microseconds,
the effective bandwidth of tessel and torch, the number of key splits tessel used, and the speed-ups
``tessel/torch`` and ``split/one_pass`` (above 1: tessel's choice is faster); the last row holds the
geometric means of both.

GPU shapes: Llama-3-8B's attention (32 query heads, 8 kv heads, D=128) at batch 1 over 4k and 32k
tokens, batch 8 over 8k, and batch 64 over 4k (one split: the grid is already full); and
multi-head (32 kv heads) at batch 1 over 8k. ``quick`` keeps the first two. CPU shapes are tiny and
the timings come from the interpreter: they are never performance numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels._dispatch import backend_for
from ..kernels.attention import _split_kv_plan, flash_attention
from .attention import tolerance
from .matmul import BenchmarkError, max_rel_error
from .runner import geomean, graph_time, host_time, suite_device, time_fn
from .shapes import select_shapes

__all__ = [
    "COLUMNS",
    "CPU_SPLITS",
    "DECODE_SHAPES_CPU",
    "DECODE_SHAPES_GPU",
    "DecodeShape",
    "check_case",
    "decode_bytes",
    "decode_cases",
    "decode_shapes",
    "make_inputs",
    "run_decode_suite",
]

COLUMNS = (
    "case", "B", "Hq", "Hkv", "Sk", "D", "dtype", "splits", "max_rel_err", "tessel_us", "one_pass_us", "torch_us",
    "tessel_GBps", "torch_GBps", "tessel/torch", "split/one_pass", "tessel_host_us", "tessel_graph_us",
    "torch_graph_us", "graph tessel/torch",
)  # fmt: skip
CPU_SPLITS = 4


@dataclass(frozen=True)
class DecodeShape:
    """``q [B, Hq, 1, D]``, ``k, v [B, Hkv, Sk, D]``; ``extra`` shapes are left out of ``--quick``."""

    label: str
    b: int
    hq: int
    hkv: int
    sk: int
    d: int
    extra: bool = False


DECODE_SHAPES_GPU: tuple[DecodeShape, ...] = (
    DecodeShape("gqa-b1-4k", 1, 32, 8, 4096, 128),
    DecodeShape("gqa-b1-32k", 1, 32, 8, 32768, 128),
    DecodeShape("gqa-b8-8k", 8, 32, 8, 8192, 128, extra=True),
    DecodeShape("gqa-b64-4k", 64, 32, 8, 4096, 128, extra=True),
    DecodeShape("mha-b1-8k", 1, 32, 32, 8192, 128, extra=True),
)
# Cache lengths that leave a tail in the interpreter's 16-key tiles.
DECODE_SHAPES_CPU: tuple[DecodeShape, ...] = (
    DecodeShape("tiny-gqa", 1, 4, 2, 100, 32),
    DecodeShape("tiny-mha", 2, 2, 2, 70, 64, extra=True),
)


def decode_shapes(cuda: bool, quick: bool = False) -> tuple[DecodeShape, ...]:
    """The GPU or CPU table; with ``quick`` only its core (non-extra) shapes."""
    return select_shapes(DECODE_SHAPES_GPU, DECODE_SHAPES_CPU, cuda, quick)


def decode_bytes(shape: DecodeShape, dtype: torch.dtype) -> int:
    """Bytes a decode step must move at least: the cache's keys and values once, the query and the output."""
    size = torch.empty((), dtype=dtype).element_size()
    return size * (2 * shape.b * shape.hkv * shape.sk * shape.d + 2 * shape.b * shape.hq * shape.d)


def make_inputs(shape: DecodeShape, dtype: torch.dtype, device: str, seed: int = 0):
    """Seeded ``q [B, Hq, 1, D]`` and the cache ``k, v [B, Hkv, Sk, D]`` in ``dtype``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn((shape.b, shape.hq, 1, shape.d), generator=gen, device=device).to(dtype)
    k, v = (torch.randn((shape.b, shape.hkv, shape.sk, shape.d), generator=gen, device=device).to(dtype) for _ in "kv")
    return q, k, v


def decode_cases(q, k, v, cuda: bool) -> dict[str, Callable[[], torch.Tensor]]:
    """``tessel``, ``one_pass`` and ``torch``: each a closure returning the step's output."""
    splits = None if cuda else CPU_SPLITS
    return {
        "tessel": lambda: flash_attention(q, k, v, num_splits=splits),
        "one_pass": lambda: flash_attention(q, k, v, num_splits=1),
        "torch": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    }


def check_case(name: str, cases: dict[str, Callable], dtype: torch.dtype, cuda: bool) -> float:
    """The larger error of tessel's two outputs against torch's; raises BenchmarkError past the tolerance."""
    want = cases["torch"]()
    err = max(max_rel_error(cases[impl](), want) for impl in ("tessel", "one_pass"))
    if not err <= tolerance(dtype, cuda):  # also catches NaN
        raise BenchmarkError(
            f"decode suite: {name} ({dtype}): tessel differs from torch by max relative error {err:.3g}, "
            f"above the tolerance {tolerance(dtype, cuda):.3g}"
        )
    return err


def _splits(q, k, cuda: bool) -> int:
    plan = _split_kv_plan(q, k, None if cuda else CPU_SPLITS, backend_for(q))
    return 1 if plan is None else plan[2]


def _us(ms: float | None) -> float | None:
    return None if ms is None else ms * 1e3


def run_decode_suite(dtype: torch.dtype | None = None, quick: bool = False) -> list[dict]:
    """Check and time every shape; returns one row per shape plus the geometric-mean row.

    ``dtype`` defaults to bf16 on CUDA and fp32 on a CPU. ``quick`` keeps the core shapes and, on a
    CPU, times one call instead of three.
    """
    cuda, device, dtype, _ = suite_device(dtype)
    rows = []
    for shape in decode_shapes(cuda, quick):
        q, k, v = make_inputs(shape, dtype, device)
        cases = decode_cases(q, k, v, cuda)
        err = check_case(shape.label, cases, dtype, cuda)
        ms = {impl: time_fn(fn, cuda=cuda, reps=1 if quick else 3) for impl, fn in cases.items()}
        moved = decode_bytes(shape, dtype)
        host = host_time(cases["tessel"])
        graphed = {impl: graph_time(cases[impl], label=f"{impl} {shape.label}") for impl in ("tessel", "torch")}
        values = (
            shape.label, shape.b, shape.hq, shape.hkv, shape.sk, shape.d, str(dtype).removeprefix("torch."),
            _splits(q, k, cuda), err, ms["tessel"] * 1e3, ms["one_pass"] * 1e3, ms["torch"] * 1e3,
            moved / ms["tessel"] / 1e6, moved / ms["torch"] / 1e6, ms["torch"] / ms["tessel"],
            ms["one_pass"] / ms["tessel"], _us(host), _us(graphed["tessel"]), _us(graphed["torch"]),
            graphed["torch"] / graphed["tessel"] if None not in graphed.values() else None,
        )  # fmt: skip
        rows.append(dict(zip(COLUMNS, values, strict=True)))
        del q, k, v, cases
    summary = {
        **dict.fromkeys(COLUMNS), "case": "geomean", "dtype": str(dtype).removeprefix("torch."),
        "tessel/torch": geomean([r["tessel/torch"] for r in rows]),
        "split/one_pass": geomean([r["split/one_pass"] for r in rows]),
        "graph tessel/torch": geomean([r["graph tessel/torch"] for r in rows]),
    }  # fmt: skip
    return [*rows, summary]
