"""The experts suite: tessel's grouped GEMM against one ``torch.matmul`` per expert.

A mixture-of-experts layer multiplies each expert's rows by its own weight. One row per shape
``(R routed rows, X experts, K, N)`` and pass:

- ``fwd``: ``out = grouped_matmul(a [R, K], w.transpose(1, 2), offsets)`` with ``w [X, N, K]`` as a layer stores it;
- ``wgrad``: the weight gradient ``a_eᵀ · g_e`` of every expert (the backward's other GEMM, ``dA``, is ``fwd``'s
  kernel over the other operand).

The baseline (``torch``) runs one ``torch.matmul`` per expert on slices cut with host-side offsets, what a layer
without a grouped kernel does (its row counts read on the host beforehand, not timed). ``grouped_mm`` is torch's own
grouped GEMM (``torch._grouped_mm``; what transformers' ``grouped_mm`` experts call), where this torch takes the
operands (None where it refuses them: on a CPU, strides that are not multiples of 16 bytes). The rows are spread over
the experts by a seeded multinomial draw, as a router with a load-balancing loss spreads them: uneven,
none empty at these sizes. Both are checked against :func:`grouped_matmul_reference` (fp32 products) before
timing; a disagreement stops the suite with :class:`BenchmarkError`. TFLOP/s count ``2·R·K·N``.

GPU shapes: Mixtral-like (8 experts, width 4096, expert width 14336 split over 8 tensor-parallel ranks) and
DeepSeek-like fine-grained ones (64 experts of width 1408 at hidden 2048; 160 of 1536 at 5120 over 4 ranks).
CPU shapes are small and odd, timed through Triton's interpreter: never performance numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..kernels.grouped_matmul import (
    grouped_matmul,
    grouped_matmul_reference,
    grouped_weight_grad,
    grouped_weight_grad_reference,
)
from .matmul import BenchmarkError, max_rel_error
from .runner import geomean, suite_device, time_fn

__all__ = ["COLUMNS", "ExpertShape", "check_pass", "expert_cases", "expert_shapes", "make_inputs", "references",
           "run_experts_suite"]  # fmt: skip

COLUMNS = ("case", "pass", "rows", "experts", "k", "n", "dtype", "max_rel_err", "tessel_ms", "torch_ms",
           "tessel_TFLOPs", "torch_TFLOPs", "tessel/torch", "grouped_mm_ms", "tessel/grouped_mm")  # fmt: skip
_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@dataclass(frozen=True)
class ExpertShape:
    label: str
    rows: int
    experts: int
    k: int
    n: int
    core: bool = True


_GPU_SHAPES = (
    ExpertShape("mixtral-up", 16384, 8, 4096, 3584),
    ExpertShape("mixtral-down", 16384, 8, 1792, 4096),
    ExpertShape("deepseek-v2-lite", 24576, 64, 2048, 1408),
    ExpertShape("deepseek-v2-up", 32768, 160, 5120, 768, core=False),
)
_CPU_SHAPES = (ExpertShape("odd-4", 150, 4, 40, 24), ExpertShape("odd-9", 301, 9, 33, 20, core=False))


def expert_shapes(cuda: bool, quick: bool = False) -> list[ExpertShape]:
    return [s for s in (_GPU_SHAPES if cuda else _CPU_SHAPES) if s.core or not quick]


def make_inputs(shape: ExpertShape, dtype: torch.dtype, device: str, seed: int = 0):
    """``(a [R, K], w [X, N, K], g [R, N], offsets [X+1], bounds)``: rows spread over the experts at random."""
    gen = torch.Generator().manual_seed(seed)
    choice = torch.multinomial(torch.ones(shape.experts), shape.rows, replacement=True, generator=gen)
    counts = torch.bincount(choice, minlength=shape.experts)
    bounds = [0, *counts.cumsum(0).tolist()]
    a = torch.randn(shape.rows, shape.k, generator=gen).to(device, dtype)
    w = (torch.randn(shape.experts, shape.n, shape.k, generator=gen) / shape.k**0.5).to(device, dtype)
    g = torch.randn(shape.rows, shape.n, generator=gen).to(device, dtype)
    return a, w, g, torch.tensor(bounds, device=device), bounds


def expert_cases(a, w, g, offsets, bounds) -> dict[str, dict[str, Callable[[], torch.Tensor]]]:
    """``{pass: {"tessel": fn, "torch": fn}}`` on the inputs of :func:`make_inputs`."""
    b = w.transpose(1, 2)
    slices = [slice(bounds[e], bounds[e + 1]) for e in range(w.shape[0])]

    def loop_fwd():
        return torch.cat([a[s] @ b[e] for e, s in enumerate(slices)])

    def loop_wgrad():
        return torch.stack([a[s].T @ g[s] for s in slices])

    return {
        "fwd": {"tessel": lambda: grouped_matmul(a, b, offsets), "torch": loop_fwd},
        "wgrad": {"tessel": lambda: grouped_weight_grad(a, g, offsets, w.shape[0]), "torch": loop_wgrad},
    }


def grouped_mm_cases(a, w, g, offsets) -> dict[str, Callable[[], torch.Tensor]]:
    """``{pass: fn}`` running torch's grouped GEMM, for the passes this torch takes these operands for: ``fwd`` as
    2-d rows times 3-d weights, ``wgrad`` as 2-d times 2-d grouped along the tokens (a's transpose made once,
    untimed, as that layout asks)."""
    grouped = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if grouped is None:
        return {}
    ends, b, at = offsets[1:].to(torch.int32), w.transpose(1, 2), a.t().contiguous()
    cases = {"fwd": lambda: grouped(a, b, offs=ends), "wgrad": lambda: grouped(at, g, offs=ends)}
    usable = {}
    for name, fn in cases.items():
        try:
            fn()
        except RuntimeError:  # a dtype, device or layout this torch's grouped GEMM does not take
            continue
        usable[name] = fn
    return usable


def references(a, w, g, offsets) -> dict[str, torch.Tensor]:
    """Each pass's result by the kernels' plain-PyTorch definitions (fp32 products)."""
    return {"fwd": grouped_matmul_reference(a, w.transpose(1, 2), offsets),
            "wgrad": grouped_weight_grad_reference(a, g, offsets, w.shape[0])}  # fmt: skip


def check_pass(label: str, name: str, impls: dict[str, Callable], want: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest relative error of the pass's implementations; :class:`BenchmarkError` above the tolerance."""
    err = max(max_rel_error(fn(), want) for fn in impls.values())
    if not err <= _TOLERANCE[dtype]:  # also catches NaN
        raise BenchmarkError(f"experts suite: {label} {name}: a result differs from the reference (relative "
                             f"error {err:.3g}, above {_TOLERANCE[dtype]:.3g})")  # fmt: skip
    return err


def run_experts_suite(dtype: torch.dtype | None = None, quick: bool = False) -> list[dict]:
    """Check and time every shape's two passes; one row each, then the geometric-mean row."""
    cuda, device, dtype, _ = suite_device(dtype)
    rows = []
    for shape in expert_shapes(cuda, quick):
        a, w, g, offsets, bounds = make_inputs(shape, dtype, device)
        want = references(a, w, g, offsets)
        baselines = grouped_mm_cases(a, w, g, offsets)
        for name, impls in expert_cases(a, w, g, offsets, bounds).items():
            if name in baselines:
                impls = {**impls, "grouped_mm": baselines[name]}
            err = check_pass(shape.label, name, impls, want[name], dtype)
            ms = {impl: time_fn(fn, cuda=cuda, reps=1 if quick else 3) for impl, fn in impls.items()}
            grouped_ms = ms.get("grouped_mm")
            flops = 2 * shape.rows * shape.k * shape.n
            values = (
                shape.label, name, shape.rows, shape.experts, shape.k, shape.n, str(dtype).removeprefix("torch."),
                err, ms["tessel"], ms["torch"], flops / ms["tessel"] / 1e9, flops / ms["torch"] / 1e9,
                ms["torch"] / ms["tessel"], grouped_ms, None if grouped_ms is None else grouped_ms / ms["tessel"],
            )  # fmt: skip
            rows.append(dict(zip(COLUMNS, values, strict=True)))
        del a, w, g, want
    grouped = [r["tessel/grouped_mm"] for r in rows if r["tessel/grouped_mm"] is not None]
    summary = {**dict.fromkeys(COLUMNS), "case": "geomean", "dtype": str(dtype).removeprefix("torch."),
               "tessel/torch": geomean([r["tessel/torch"] for r in rows]),
               "tessel/grouped_mm": geomean(grouped) if grouped else None}  # fmt: skip
    return [*rows, summary]
