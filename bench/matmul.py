"""The matmul suite: tessel's Triton GEMM against cuBLAS (``torch.matmul``) measured in the same run.

For every shape of :mod:`tessel.bench.shapes` and two ops:

- ``matmul``:    ``matmul(a, b)``               vs ``torch.matmul(a, b)``
- ``bias+gelu``: ``matmul(a, b, bias, "gelu")`` vs ``gelu(torch.addmm(bias, a, b))`` (unfused baseline)

each case is first checked against its baseline (the run stops if the error passes the dtype's
tolerance), then both are timed; a row reports TFLOP/s (``2·M·N·K / time``) for both, the throughput
ratio tessel/torch (above 1: tessel is faster) and tessel's fraction of the GPU's dense peak. The
last rows are the geometric means of the ratios, one per op. :func:`make_inputs` and
:func:`matmul_cases` are shared with ``pytest bench`` (``bench_matmul.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..kernels.matmul import last_program, matmul
from .runner import geomean_rows, suite_device, time_fn
from .shapes import MatmulShape, matmul_shapes

try:  # progress bars come with the ``bench`` extra; the suite runs the same without them
    from tqdm import tqdm
except ImportError:  # pragma: no cover - depends on the environment
    tqdm = None

__all__ = [
    "COLUMNS",
    "OPS",
    "BenchmarkError",
    "make_inputs",
    "matmul_cases",
    "max_rel_error",
    "run_matmul_suite",
    "tolerance",
]

OPS = ("matmul", "bias+gelu")
COLUMNS = (
    "case", "op", "M", "N", "K", "dtype", "max_rel_err", "tessel_ms", "torch_ms",
    "tessel_tflops", "torch_tflops", "tessel/torch", "tessel_of_peak", "program",
)  # fmt: skip

# Error is max|tessel - torch| / max|torch|. Both sides accumulate in fp32 and round once to the
# output dtype, so they differ by a few units in the last place at most: bf16 keeps 8 significant
# bits (1 ulp is 0.4-0.8% of the value), fp16 11 bits (0.05-0.1%). The unfused baseline of
# bias+gelu rounds twice (after addmm, after gelu), hence room for ~4 ulp. fp32 differs only in the
# summation order over K (≈ sqrt(K)·2⁻²⁴), or by TF32's 10-bit mantissa when torch allows TF32.
_TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}
_TF32_TOLERANCE = 1e-2


class BenchmarkError(RuntimeError):
    """A benchmarked kernel disagreed with its baseline: its timings would be meaningless."""


def tolerance(dtype: torch.dtype, cuda: bool) -> float:
    """Largest accepted :func:`max_rel_error` between tessel and torch for ``dtype``."""
    if dtype == torch.float32 and cuda and torch.backends.cuda.matmul.allow_tf32:
        return _TF32_TOLERANCE
    return _TOLERANCE[dtype]


def make_inputs(shape: MatmulShape, dtype: torch.dtype, device: str, seed: int = 0):
    """Seeded ``a [M, K]``, ``b [K, N]``, ``bias [N]``; ``a`` is scaled by K^-½ so outputs are O(1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(shape.m, shape.k, generator=gen, device=device) * shape.k**-0.5
    b = torch.randn(shape.k, shape.n, generator=gen, device=device)
    bias = torch.randn(shape.n, generator=gen, device=device)
    return a.to(dtype), b.to(dtype), bias.to(dtype)


def matmul_cases(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor) -> dict[str, tuple[Callable, Callable]]:
    """For each op in :data:`OPS`: ``(tessel_fn, torch_fn)``, two closures computing the same result."""
    return {
        "matmul": (lambda: matmul(a, b), lambda: torch.matmul(a, b)),
        "bias+gelu": (
            lambda: matmul(a, b, bias, "gelu"),
            lambda: torch.nn.functional.gelu(torch.addmm(bias, a, b)),
        ),
    }


def max_rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max|got - want| / max|want|``: robust to entries of ``want`` near zero."""
    got, want = got.float(), want.float()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _check(shape: MatmulShape, op: str, fns: tuple[Callable, Callable], dtype: torch.dtype, cuda: bool) -> float:
    tessel_fn, torch_fn = fns
    err = max_rel_error(tessel_fn(), torch_fn())
    if not err <= tolerance(dtype, cuda):  # also catches NaN
        raise BenchmarkError(
            f"matmul suite: {op} on {shape.name} ({dtype}): tessel differs from torch by max relative "
            f"error {err:.3g}, above the tolerance {tolerance(dtype, cuda):.3g}"
        )
    return err


def _row(
    shape: MatmulShape,
    op: str,
    dtype: torch.dtype,
    err: float,
    tessel_ms: float,
    torch_ms: float,
    peak: float | None,
    program: str | None = None,
) -> dict:
    """One measured case; throughput ratio tessel/torch above 1 means tessel is faster. ``program``:
    the tile shape and variant (plain, persistent, TMA) the autotuner picked."""
    tessel_tflops = shape.flops / tessel_ms / 1e9  # flop / (ms·1e-3) / 1e12
    torch_tflops = shape.flops / torch_ms / 1e9
    values = (
        shape.label, op, shape.m, shape.n, shape.k, _dtype_name(dtype), err, tessel_ms, torch_ms,
        tessel_tflops, torch_tflops, tessel_tflops / torch_tflops, tessel_tflops / peak if peak else None, program,
    )  # fmt: skip
    return dict(zip(COLUMNS, values, strict=True))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _progress(items: list, desc: str):
    return tqdm(items, desc=desc, leave=False) if tqdm is not None else items


def run_matmul_suite(dtype: torch.dtype | None = None, quick: bool = False) -> list[dict]:
    """Check and time every shape × op; returns one row per case plus the geometric-mean rows.

    ``dtype`` defaults to bf16 on CUDA and fp32 on a CPU (the interpreter computes dots in fp32
    anyway). ``quick`` keeps only the core shapes and, on a CPU, times one call instead of three.
    """
    cuda, device, dtype, peak = suite_device(dtype)
    rows = []
    for shape in _progress(list(matmul_shapes(cuda, quick)), "matmul"):
        cases = matmul_cases(*make_inputs(shape, dtype, device))
        for op, fns in cases.items():
            err = _check(shape, op, fns, dtype, cuda)
            tessel_ms = time_fn(fns[0], cuda=cuda, reps=1 if quick else 3)
            program = last_program()
            torch_ms = time_fn(fns[1], cuda=cuda, reps=1 if quick else 3)
            rows.append(_row(shape, op, dtype, err, tessel_ms, torch_ms, peak, program))
    return rows + geomean_rows(rows, COLUMNS, "op", OPS, dtype=_dtype_name(dtype))
