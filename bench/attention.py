"""The attention suite: tessel's flash attention against ``torch.nn.functional.scaled_dot_product_attention``.

For every shape, with and without the causal mask, and for two passes:

- ``fwd``:     ``flash_attention(q, k, v, causal)``            vs ``scaled_dot_product_attention(...)``
- ``fwd+bwd``: the same plus ``torch.autograd.grad`` of ``out`` for ``q, k, v``
- ``fwd+bwd-atomic``: the same with ``flash_attention(..., deterministic=False)``, whose backward adds
  dQ up with atomics in the dK/dV kernel instead of running a dQ kernel (torch's side is unchanged)
- ``bwd``, ``bwd-atomic``: the backward alone: the forward runs once, untimed, and each timed call is
  ``torch.autograd.grad`` of its output (the graph kept for the next call)

torch runs its FlashAttention-2 backend on CUDA (``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``, or the older
``torch.backends.cuda.sdp_kernel`` switch) where the dtype allows it, and its default choice otherwise
(fp32 on CUDA, every CPU run); the row names the backend. Each case is first checked against torch
(out, and dq, dk, dv for ``fwd+bwd``; the run stops with :class:`BenchmarkError` past the dtype's
tolerance), then both are timed. FLOPs: ``4·B·H·S²·D`` for the forward (two GEMMs of ``2·S²·D`` per
head), half of it with the causal mask, and 2.5× the forward for the backward (five GEMMs instead of
two), so ``fwd+bwd`` counts 3.5× the forward and ``bwd`` 2.5×. A row reports TFLOP/s for both, the throughput ratio
tessel/torch (above 1: tessel is faster) and tessel's fraction of the GPU's dense peak; the last rows
are geometric means of the ratios per pass.

GPU shapes: ``B=4, H=32, D=128`` at ``S`` 1024, 4096, 8192 (``quick``: 1024, 4096). CPU shapes are tiny:
there the kernels run through Triton's interpreter and the timings are not performance numbers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels.attention import flash_attention
from ..kernels.attention_kernels import tuned_programs
from .matmul import BenchmarkError, max_rel_error
from .runner import geomean_rows, suite_device, time_fn
from .shapes import select_shapes

__all__ = [
    "ATTENTION_SHAPES_CPU",
    "ATTENTION_SHAPES_GPU",
    "COLUMNS",
    "PASSES",
    "AttentionShape",
    "attention_cases",
    "attention_flops",
    "attention_shapes",
    "check_case",
    "make_inputs",
    "run_attention_suite",
    "sdpa_backend",
    "tolerance",
]

PASSES = ("fwd", "fwd+bwd", "fwd+bwd-atomic", "bwd", "bwd-atomic")
COLUMNS = (
    "case", "pass", "causal", "B", "H", "S", "D", "dtype", "torch_backend", "max_rel_err", "tessel_ms", "torch_ms",
    "tessel_tflops", "torch_tflops", "tessel/torch", "tessel_of_peak", "programs",
)  # fmt: skip
# The kernels each pass launches, whose autotuned tiles a row records.
PROGRAMS = {
    "fwd": ("fwd",),
    "fwd+bwd": ("fwd", "dkdv", "dq"),
    "fwd+bwd-atomic": ("fwd", "dkdv+dq"),
    "bwd": ("dkdv", "dq"),
    "bwd-atomic": ("dkdv+dq",),
}

# Error is max|tessel - torch| / max|torch| over out (and dq, dk, dv). Both round P (and dS) to the
# input dtype before their GEMMs and every output once, but in different block orders: a few ulps of
# the dtype apart (bf16 2⁻⁸, fp16 2⁻¹¹), more in the gradients, which sum S such terms. fp32 differs
# by the summation order only, or by TF32's 10-bit mantissa when torch allows TF32 on CUDA.
_TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}
_TF32_TOLERANCE = 1e-2


@dataclass(frozen=True)
class AttentionShape:
    """``q, k, v [B, H, S, D]``; ``extra`` shapes are left out of ``--quick``."""

    label: str
    b: int
    h: int
    s: int
    d: int
    extra: bool = False


ATTENTION_SHAPES_GPU: tuple[AttentionShape, ...] = (
    AttentionShape("seq-1k", 4, 32, 1024, 128),
    AttentionShape("seq-4k", 4, 32, 4096, 128),
    AttentionShape("seq-8k", 4, 32, 8192, 128, extra=True),
)
# Not multiples of the interpreter's 16/32 blocks in the extra shape, so tails are timed too.
ATTENTION_SHAPES_CPU: tuple[AttentionShape, ...] = (
    AttentionShape("tiny", 1, 2, 64, 32),
    AttentionShape("tiny-odd", 2, 2, 100, 64, extra=True),
)


def attention_shapes(cuda: bool, quick: bool = False) -> tuple[AttentionShape, ...]:
    """The GPU or CPU table; with ``quick`` only its core (non-extra) shapes."""
    return select_shapes(ATTENTION_SHAPES_GPU, ATTENTION_SHAPES_CPU, cuda, quick)


def attention_flops(shape: AttentionShape, causal: bool, pass_: str) -> float:
    """``4·B·H·S²·D`` forward (half when causal); the backward is 2.5× the forward (either variant)."""
    fwd = 4 * shape.b * shape.h * shape.s**2 * shape.d * (0.5 if causal else 1.0)
    return fwd if pass_ == "fwd" else (2.5 if pass_.startswith("bwd") else 3.5) * fwd


def tolerance(dtype: torch.dtype, cuda: bool) -> float:
    """Largest accepted :func:`max_rel_error` between tessel and torch for ``dtype``."""
    if dtype == torch.float32 and cuda and torch.backends.cuda.matmul.allow_tf32:
        return _TF32_TOLERANCE
    return _TOLERANCE[dtype]


def make_inputs(shape: AttentionShape, dtype: torch.dtype, device: str, seed: int = 0):
    """Seeded ``q, k, v [B, H, S, D]`` (requiring grad) and ``grad_out``, all in ``dtype``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dims = (shape.b, shape.h, shape.s, shape.d)
    q, k, v, grad_out = (torch.randn(dims, generator=gen, device=device).to(dtype) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad_out


def sdpa_backend(dtype: torch.dtype, cuda: bool) -> str:
    """The SDPA backend the torch side runs: ``flash`` on CUDA for fp16/bf16, torch's choice otherwise."""
    return "flash" if cuda and dtype in (torch.float16, torch.bfloat16) else "default"


def _flash_only():
    """Restrict SDPA to its FlashAttention-2 backend (the API moved in torch 2.3)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # pragma: no cover - older torch
        return torch.backends.cuda.sdp_kernel(enable_flash=True, enable_math=False, enable_mem_efficient=False)
    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def _sdpa_fn(backend: str) -> Callable:
    def sdpa(q, k, v, causal):
        with _flash_only() if backend == "flash" else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return sdpa


def attention_cases(q, k, v, grad_out, causal: bool, backend: str) -> dict[str, tuple[Callable, Callable]]:
    """For each pass in :data:`PASSES`: ``(tessel_fn, torch_fn)``, returning ``[out]`` or ``[out, dq, dk, dv]``."""
    sdpa = _sdpa_fn(backend)

    def forward(fn):
        def run():
            with torch.no_grad():  # inference: no graph, nothing saved for a backward
                return [fn(q, k, v, causal)]

        return run

    def forward_backward(fn, **options):
        def run():
            out = fn(q, k, v, causal, **options)
            return [out, *torch.autograd.grad(out, (q, k, v), grad_out)]

        return run

    def backward(fn, **options):
        out = fn(q, k, v, causal, **options)  # once, outside the timing

        def run():
            return list(torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True))

        return run

    return {
        "fwd": (forward(flash_attention), forward(sdpa)),
        "fwd+bwd": (forward_backward(flash_attention), forward_backward(sdpa)),
        "fwd+bwd-atomic": (forward_backward(flash_attention, deterministic=False), forward_backward(sdpa)),
        "bwd": (backward(flash_attention), backward(sdpa)),
        "bwd-atomic": (backward(flash_attention, deterministic=False), backward(sdpa)),
    }


def check_case(name: str, fns: tuple[Callable, Callable], dtype: torch.dtype, cuda: bool) -> float:
    """The largest error of tessel's tensors against torch's; raises BenchmarkError past the tolerance."""
    tessel_fn, torch_fn = fns
    got, want = tessel_fn(), torch_fn()
    err = max(max_rel_error(g, w) for g, w in zip(got, want))
    if not err <= tolerance(dtype, cuda):  # also catches NaN
        raise BenchmarkError(
            f"attention suite: {name} ({dtype}): tessel differs from torch by max relative error {err:.3g}, "
            f"above the tolerance {tolerance(dtype, cuda):.3g}"
        )
    return err


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _row(shape, pass_, causal, dtype, backend, err, tessel_ms, torch_ms, peak, programs) -> dict:
    flops = attention_flops(shape, causal, pass_)
    tessel_tflops, torch_tflops = flops / tessel_ms / 1e9, flops / torch_ms / 1e9  # flop / (ms·1e-3) / 1e12
    values = (
        shape.label, pass_, causal, shape.b, shape.h, shape.s, shape.d, _dtype_name(dtype), backend, err,
        tessel_ms, torch_ms, tessel_tflops, torch_tflops, tessel_tflops / torch_tflops,
        tessel_tflops / peak if peak else None, programs,
    )  # fmt: skip
    return dict(zip(COLUMNS, values, strict=True))


def run_attention_suite(dtype: torch.dtype | None = None, quick: bool = False) -> list[dict]:
    """Check and time every shape × mask × pass; returns one row per case plus the geometric-mean rows.

    ``dtype`` defaults to bf16 on CUDA and fp32 on a CPU. ``quick`` keeps the core shapes and, on a
    CPU, times one call instead of three.
    """
    cuda, device, dtype, peak = suite_device(dtype)
    backend = sdpa_backend(dtype, cuda)
    rows = []
    for shape in attention_shapes(cuda, quick):
        q, k, v, grad_out = make_inputs(shape, dtype, device)
        for causal in (False, True):
            for pass_, fns in attention_cases(q, k, v, grad_out, causal, backend).items():
                name = f"{shape.label} {pass_} causal={causal}"
                err = check_case(name, fns, dtype, cuda)
                tessel_ms = time_fn(fns[0], cuda=cuda, reps=1 if quick else 3)
                programs = tuned_programs(*PROGRAMS[pass_]) if cuda else "interpreter"
                torch_ms = time_fn(fns[1], cuda=cuda, reps=1 if quick else 3)
                rows.append(_row(shape, pass_, causal, dtype, backend, err, tessel_ms, torch_ms, peak, programs))
        del q, k, v, grad_out
    return rows + geomean_rows(rows, COLUMNS, "pass", PASSES, dtype=_dtype_name(dtype))
