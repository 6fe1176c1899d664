"""The fp8 suite: tessel's fp8 GEMM against cuBLAS's (``torch._scaled_mm``), and the fp8 linear layer against bf16.

For every shape of :mod:`tessel.bench.shapes` (``out[M, N] = a[M, K] @ b[K, N]``), with operands quantised once
by :func:`~tessel.kernels.quantize_fp8` (e4m3, per-tensor scales; ``b`` K-major, as both read it):

- ``gemm``:        ``fp8_matmul(a, b, split_accumulator=False)``  vs ``_scaled_mm(a, b, use_fast_accum=True)``
- ``gemm split``:  ``fp8_matmul(a, b)`` (fp32 sums per K block)    vs ``_scaled_mm(a, b, use_fast_accum=False)``
- ``linear``:      ``fp8_linear`` forward and backward (quantising x, W and dY included) vs ``F.linear`` in bf16
  (cuBLAS) forward and backward, on ``x [M, K]`` and ``W [N, K]``: what a layer gains end to end.

and for every shape of the experts suite (``M`` rows routed at random over the experts, each expert ``[N, K]``):

- ``experts``:     ``fp8_grouped_linear`` forward and backward vs tessel's bf16 grouped GEMM forward and backward
  (torch has no grouped fp8 GEMM to compare with; the experts suite compares the bf16 one with torch).

Each case is first checked against its baseline (the GEMMs multiply the same fp8 values, so they agree to the
output's rounding and the accumulators' order; the linear layer agrees with bf16 to fp8's precision), then both
are timed. A row reports TFLOP/s for both (the linear rows count their three GEMMs: ``6·M·N·K``), the ratio
tessel/torch (above 1: tessel is faster) and tessel's fraction of the GPU's dense fp8 peak. The last rows are
the geometric means of the ratios, one per op. On a CPU the kernels run in Triton's interpreter and the baseline
is the float64 product of the same fp8 values: the rows show the check, not speed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..kernels.fp8 import fp8_matmul, quantize_fp8
from ..kernels.grouped_matmul import grouped_matmul
from ..kernels.matmul import last_program
from ..layers.fp8 import fp8_grouped_linear, fp8_linear
from .experts import ExpertShape, expert_shapes
from .experts import make_inputs as make_expert_inputs
from .matmul import BenchmarkError, make_inputs, max_rel_error
from .runner import geomean_rows, peak_tflops, time_fn
from .shapes import MatmulShape, matmul_shapes

__all__ = ["COLUMNS", "OPS", "fp8_cases", "run_fp8_suite"]

OPS = ("gemm", "gemm split", "linear", "experts")
COLUMNS = (
    "case", "op", "M", "N", "K", "max_rel_err", "tessel_ms", "torch_ms", "tessel_tflops", "torch_tflops",
    "tessel/torch", "tessel_of_peak", "program",
)  # fmt: skip
# The GEMMs round the same fp32-accumulated products to bf16 once (~2 ulps apart: 1.6%); cuBLAS's fast
# accumulation and the split one add in different orders and precisions, hence 3%. The linear layer against bf16:
# e4m3 keeps 3 mantissa bits (6% per value), e5m2 2; over K products the errors average to a few percent of the
# largest output, checked at 15%.
_TOLERANCE = {"gemm": 3e-2, "gemm split": 3e-2, "linear": 0.15, "experts": 0.15}


def _scaled_mm(a, b, a_scale_inv, b_scale_inv, fast: bool) -> torch.Tensor:
    """cuBLAS's fp8 GEMM on a GPU; the float64 product of the same values (in bf16) on a CPU."""
    if a.is_cuda:
        return torch._scaled_mm(a, b, a_scale_inv, b_scale_inv, out_dtype=torch.bfloat16, use_fast_accum=fast)
    return ((a.double() @ b.double()) * (a_scale_inv.double() * b_scale_inv.double())).to(torch.bfloat16)


class _LinearStep:
    """One forward and backward of ``fn(x, w)`` (what is timed); :meth:`results` gives the output and both
    gradients, each checked on its own scale."""

    def __init__(self, fn: Callable, x, w, grad):
        self.fn, self.x, self.w, self.grad = fn, x, w, grad

    def __call__(self):
        self.x.grad = self.w.grad = None
        y = self.fn(self.x, self.w)
        y.backward(self.grad)
        return y

    def results(self) -> list[torch.Tensor]:
        return [self().detach(), self.x.grad.clone(), self.w.grad.clone()]


def _error(tessel_fn, baseline_fn) -> float:
    """The largest :func:`max_rel_error` of the results (the linear step's output and gradients each alone)."""
    if isinstance(tessel_fn, _LinearStep):
        pairs = zip(tessel_fn.results(), baseline_fn.results(), strict=True)
        return max(max_rel_error(got, want) for got, want in pairs)
    return max_rel_error(tessel_fn(), baseline_fn())


def fp8_cases(shape: MatmulShape, device: str) -> dict[str, tuple[Callable, Callable]]:
    """For each op in :data:`OPS`: ``(tessel_fn, baseline_fn)``, two closures computing the same result."""
    a, b, _ = make_inputs(shape, torch.bfloat16, device)
    aq, bq = quantize_fp8(a), quantize_fp8(b.t())  # b K-major: the transpose of a row-major [N, K]
    operands = (aq.data, bq.data.t(), aq.scale_inv, bq.scale_inv)
    x, w = a.clone().requires_grad_(), b.t().contiguous().requires_grad_()
    grad = torch.randn(shape.m, shape.n, device=device, dtype=torch.bfloat16)
    return {
        "gemm": (lambda: fp8_matmul(*operands, split_accumulator=False), lambda: _scaled_mm(*operands, fast=True)),
        "gemm split": (lambda: fp8_matmul(*operands), lambda: _scaled_mm(*operands, fast=False)),
        "linear": (_LinearStep(fp8_linear, x, w, grad), _LinearStep(torch.nn.functional.linear, x, w, grad)),
    }


def _expert_cases(shape: ExpertShape, device: str) -> dict[str, tuple[Callable, Callable]]:
    a, w, g, offsets, _ = make_expert_inputs(shape, torch.bfloat16, device)
    x, w = a.requires_grad_(), w.requires_grad_()
    fp8 = lambda x, w: fp8_grouped_linear(x, w, offsets)
    bf16 = lambda x, w: grouped_matmul(x, w.transpose(1, 2), offsets)
    return {"experts": (_LinearStep(fp8, x, w, g), _LinearStep(bf16, x, w, g))}


def _row(shape, op, err, tessel_ms, baseline_ms, peak, program) -> dict:
    """One measured case; the linear and experts rows count their three GEMMs."""
    m = shape.rows if isinstance(shape, ExpertShape) else shape.m
    flops = 2 * m * shape.n * shape.k * (3 if op in ("linear", "experts") else 1)
    tessel_tflops, baseline_tflops = flops / tessel_ms / 1e9, flops / baseline_ms / 1e9
    values = (
        shape.label, op, m, shape.n, shape.k, err, tessel_ms, baseline_ms, tessel_tflops, baseline_tflops,
        tessel_tflops / baseline_tflops, tessel_tflops / peak if peak else None, program,
    )  # fmt: skip
    return dict(zip(COLUMNS, values, strict=True))


def run_fp8_suite(dtype: torch.dtype | None = None, quick: bool = False) -> list[dict]:
    """Check and time every shape × op; one row per case plus the geometric-mean rows. ``dtype`` is not used
    (the operands are e4m3, the outputs bf16); it is accepted as every suite's is."""
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    peak = peak_tflops(torch.cuda.get_device_name(), torch.float8_e4m3fn) if cuda else None
    rows = []
    gemms = [(s, fp8_cases) for s in matmul_shapes(cuda, quick) if s.m >= 16]  # cuBLAS's fp8 GEMM needs 16 rows
    for shape, cases in gemms + [(s, _expert_cases) for s in expert_shapes(cuda, quick)]:
        for op, (tessel_fn, baseline_fn) in cases(shape, device).items():
            err = _error(tessel_fn, baseline_fn)
            if not err <= _TOLERANCE[op]:  # also catches NaN
                raise BenchmarkError(
                    f"fp8 suite: {op} on {shape.name}: tessel differs from the baseline by max relative error "
                    f"{err:.3g}, above the tolerance {_TOLERANCE[op]:.3g}"
                )
            tessel_ms = time_fn(tessel_fn, cuda=cuda, reps=1 if quick else 3)
            program = last_program() if op.startswith("gemm") else None
            baseline_ms = time_fn(baseline_fn, cuda=cuda, reps=1 if quick else 3)
            rows.append(_row(shape, op, err, tessel_ms, baseline_ms, peak, program))
    return rows + geomean_rows(rows, COLUMNS, "op", OPS)
