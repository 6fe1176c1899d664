"""The attention backward tile by tile: which candidate of each backward kernel is fast, which one is picked.

For each shape (causal, where a pick is in question) the backward runs first as it ships (every kernel autotuned,
the picks recorded), then once per candidate tile of one kernel, that kernel pinned to the tile and the others
as tuned: ``dkdv`` and ``dq`` (the two kernels of the deterministic backward) and ``dkdv+dq`` (the one-kernel
backward with the atomic dQ). A row holds the backward's time with the tile, against SDPA's flash backward on
the same inputs, and whether it is the autotuner's pick; the ``autotuned`` rows time the backward as it ships.
A pick much slower than the best tile of its kernel is the autotuner's error; every tile slow is the kernel's.

GPU shapes: the attention suite's ``B=4, H=32, D=128`` at ``S`` 1024 and 4096 (``quick``: 1024). On a CPU the
kernels run through Triton's interpreter at fixed blocks (no autotuner, nothing to pin): one row per backward,
and the timings are not performance numbers.
"""

from __future__ import annotations

import contextlib

import torch
from triton.runtime.errors import OutOfResources

from ..kernels import attention_kernels
from ..kernels.attention_kernels import tile_name
from .attention import ATTENTION_SHAPES_CPU, AttentionShape, attention_cases, check_case, make_inputs, sdpa_backend
from .runner import suite_device, time_fn
from .shapes import select_shapes

__all__ = ["COLUMNS", "SHAPES_GPU", "SWEPT", "pinned", "run_attention_tiles_suite"]

COLUMNS = ("case", "S", "causal", "kernel", "tile", "picked", "tessel_ms", "torch_ms", "tessel/torch")
# kernel -> (the attention suite's pass that runs it, its autotuner's name in attention_kernels._TUNED)
SWEPT = {"dkdv": ("bwd", "dkdv"), "dq": ("bwd", "dq"), "dkdv+dq": ("bwd-atomic", "dkdv+dq")}
SHAPES_GPU = (AttentionShape("seq-1k", 4, 32, 1024, 128), AttentionShape("seq-4k", 4, 32, 4096, 128, extra=True))


@contextlib.contextmanager
def pinned(tuned, config):
    """Inside the block the autotuner ``tuned`` launches ``config`` alone, without timing anything (an autotuner
    of one configuration); its candidates and its cache of picks come back afterwards."""
    if not (hasattr(tuned, "configs") and hasattr(tuned, "cache")):
        raise TypeError(f"pinned: tuned must be a triton.autotune autotuner, received {type(tuned).__name__}")
    if config not in tuned.configs:
        raise ValueError(f"pinned: config must be one of the autotuner's candidates, received {config}")
    configs, cache = tuned.configs, tuned.cache
    tuned.configs, tuned.cache = [config], {}
    try:
        yield
    finally:
        tuned.configs, tuned.cache = configs, cache


def run_attention_tiles_suite(dtype: torch.dtype | None = None, quick: bool = False) -> list[dict]:
    """One row per shape, kernel and candidate tile (see the module's docstring)."""
    cuda, device, dtype, _ = suite_device(dtype)
    backend = sdpa_backend(dtype, cuda)
    rows = []
    for shape in select_shapes(SHAPES_GPU, ATTENTION_SHAPES_CPU, cuda, quick):
        q, k, v, grad_out = make_inputs(shape, dtype, device)
        cases = attention_cases(q, k, v, grad_out, True, backend)
        base = {"case": shape.label, "S": shape.s, "causal": True}
        torch_ms, tuned_ms = {}, {}  # per pass: the deterministic backward's two kernels share one
        for kernel, (pass_, tuned_name) in SWEPT.items():
            tessel_fn, torch_fn = cases[pass_]
            if pass_ not in tuned_ms:
                check_case(f"{shape.label} {pass_} causal=True", cases[pass_], dtype, cuda)  # tunes, on CUDA
                torch_ms[pass_] = time_fn(torch_fn, cuda=cuda, reps=1 if quick else 3)
                tuned_ms[pass_] = time_fn(tessel_fn, cuda=cuda, reps=1 if quick else 3)
            tuned = attention_kernels._TUNED[tuned_name]
            pick = tile_name(tuned.best_config) if cuda else "interpreter"
            rows.append(_row(base, kernel, "autotuned: " + pick, True, tuned_ms[pass_], torch_ms[pass_]))
            if not cuda:
                continue
            for config in tuned.configs:
                with pinned(tuned, config):
                    try:
                        check_case(f"{shape.label} {pass_} {kernel} {tile_name(config)}", cases[pass_], dtype, cuda)
                    except OutOfResources:  # a tile that does not fit this dtype (the autotuner skips it too)
                        continue
                    ms = time_fn(tessel_fn, cuda=cuda, reps=1 if quick else 3)
                rows.append(_row(base, kernel, tile_name(config), tile_name(config) == pick, ms, torch_ms[pass_]))
        del q, k, v, grad_out, cases
    return rows


def _row(base: dict, kernel: str, tile: str, picked: bool, tessel_ms: float, torch_ms: float) -> dict:
    values = (*base.values(), kernel, tile, picked, tessel_ms, torch_ms, torch_ms / tessel_ms)
    return dict(zip(COLUMNS, values, strict=True))
