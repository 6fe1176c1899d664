"""The sliding-window suite: ``flash_attention(..., causal=True, window=W)`` against torch's sliding window.

Each query sees the ``W`` latest keys up to its own (Mistral's ``sliding_window``). tessel's kernels read
only the key blocks inside each query block's windows, so their work grows with ``S·W``, not ``S²``.
The torch side is FlexAttention (``torch.nn.attention.flex_attention``, compiled, with a sliding-window
block mask, which skips the blocks outside the windows too) on CUDA where torch has it, and otherwise
``scaled_dot_product_attention`` with the window as a boolean mask (which computes every score: every
CPU run); the row names it. Two passes, ``fwd`` and ``fwd+bwd`` (``torch.autograd.grad`` for q, k, v).
Each case is first checked against torch (out, and dq, dk, dv; :class:`BenchmarkError` past the
dtype's tolerance), then both are timed, and so is tessel's full causal attention on the same inputs:
``window_speedup`` is its time over the windowed one's.

FLOPs count the (query, key) pairs inside the windows: ``P = Σ_i min(i+1, W)``; ``4·B·H·D·P`` forward,
3.5× that forward and backward (as in the attention suite). GPU shapes: ``B=4, H=32, D=128``, ``S`` 4096
and 8192 with ``W`` 1024 and 4096 (``quick``: S=4096, W=1024). CPU shapes are tiny: there the kernels run
through Triton's interpreter and the timings are not performance numbers.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels.attention import flash_attention
from .attention import check_case, make_inputs
from .runner import geomean_rows, suite_device, time_fn
from .shapes import select_shapes

__all__ = [
    "COLUMNS",
    "PASSES",
    "WINDOW_SHAPES_CPU",
    "WINDOW_SHAPES_GPU",
    "WindowShape",
    "run_window_suite",
    "torch_window_attention",
    "window_cases",
    "window_flops",
    "window_pairs",
    "window_shapes",
]

PASSES = ("fwd", "fwd+bwd")
COLUMNS = (
    "case", "pass", "B", "H", "S", "D", "window", "dtype", "torch_impl", "max_rel_err", "tessel_ms", "torch_ms",
    "causal_ms", "tessel_tflops", "torch_tflops", "tessel/torch", "window_speedup", "tessel_of_peak",
)  # fmt: skip


@dataclass(frozen=True)
class WindowShape:
    """``q, k, v [B, H, S, D]``, a window of ``window`` keys; ``extra`` shapes are left out of ``--quick``."""

    label: str
    b: int
    h: int
    s: int
    d: int
    window: int
    extra: bool = False


WINDOW_SHAPES_GPU: tuple[WindowShape, ...] = (
    WindowShape("seq-4k-w1k", 4, 32, 4096, 128, 1024),
    WindowShape("seq-8k-w1k", 4, 32, 8192, 128, 1024, extra=True),
    WindowShape("seq-8k-w4k", 4, 32, 8192, 128, 4096, extra=True),
)
# A window that is not a multiple of the interpreter's 16/32 blocks in the extra shape.
WINDOW_SHAPES_CPU: tuple[WindowShape, ...] = (
    WindowShape("tiny-w16", 1, 2, 64, 32, 16),
    WindowShape("tiny-odd-w23", 2, 2, 100, 64, 23, extra=True),
)


def window_shapes(cuda: bool, quick: bool = False) -> tuple[WindowShape, ...]:
    """The GPU or CPU table; with ``quick`` only its core (non-extra) shapes."""
    return select_shapes(WINDOW_SHAPES_GPU, WINDOW_SHAPES_CPU, cuda, quick)


def window_pairs(s: int, window: int) -> int:
    """``Σ_i min(i+1, W)`` over the ``s`` queries: the (query, key) pairs inside the causal windows."""
    w = min(s, window)
    return w * (w + 1) // 2 + (s - w) * w


def window_flops(shape: WindowShape, pass_: str) -> float:
    """``4·B·H·D`` per pair forward; the backward is 2.5× the forward."""
    fwd = 4 * shape.b * shape.h * shape.d * window_pairs(shape.s, shape.window)
    return fwd if pass_ == "fwd" else 3.5 * fwd


def _flex_fn(shape: WindowShape, device: str) -> Callable | None:
    """FlexAttention with a compiled sliding-window block mask, or None where torch lacks it."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:  # torch < 2.5
        return None
    w = shape.window

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < w)

    block_mask = create_block_mask(sliding, None, None, shape.s, shape.s, device=device)
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


def _masked_sdpa_fn(shape: WindowShape, device: str) -> Callable:
    i = torch.arange(shape.s, device=device)
    keep = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < shape.window)
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def window_cases(q, k, v, grad_out, shape: WindowShape, torch_attention: Callable) -> dict[str, tuple[Callable, ...]]:
    """For each pass: ``(tessel_fn, torch_fn, tessel_causal_fn)``, returning ``[out]`` or ``[out, dq, dk, dv]``."""

    def windowed(q, k, v):
        return flash_attention(q, k, v, causal=True, window=shape.window)

    def causal(q, k, v):
        return flash_attention(q, k, v, causal=True)

    def forward(fn):
        def run():
            with torch.no_grad():
                return [fn(q, k, v)]

        return run

    def forward_backward(fn):
        def run():
            out = fn(q, k, v)
            return [out, *torch.autograd.grad(out, (q, k, v), grad_out)]

        return run

    return {
        "fwd": (forward(windowed), forward(torch_attention), forward(causal)),
        "fwd+bwd": (forward_backward(windowed), forward_backward(torch_attention), forward_backward(causal)),
    }


def torch_window_attention(shape: WindowShape, cuda: bool, device: str, probe=None) -> tuple[str, Callable]:
    """``(name, fn(q, k, v))`` of torch's side: FlexAttention on CUDA where torch has it, masked SDPA otherwise.

    ``probe``: ``(q, k, v, grad_out)`` to run FlexAttention's forward and backward on once first (its
    compilation); if that fails, the row says so and torch's side is masked SDPA.
    """
    flex = _flex_fn(shape, device) if cuda else None
    if flex is not None and probe is not None:
        q, k, v, grad_out = probe
        try:
            torch.autograd.grad(flex(q, k, v), (q, k, v), grad_out)
        except Exception as exc:  # any compiler failure: time torch's other sliding window instead
            print(f"window suite: FlexAttention failed ({type(exc).__name__}: {exc}); timing masked SDPA instead",
                  file=sys.stderr)  # fmt: skip
            return "sdpa-mask (flex failed)", _masked_sdpa_fn(shape, device)
    return ("flex", flex) if flex is not None else ("sdpa-mask", _masked_sdpa_fn(shape, device))


def run_window_suite(dtype: torch.dtype | None = None, quick: bool = False) -> list[dict]:
    """Check and time every shape × pass; returns one row per case plus the geometric-mean rows.

    ``dtype`` defaults to bf16 on CUDA and fp32 on a CPU. ``quick`` keeps the core shapes and, on a
    CPU, times one call instead of three.
    """
    cuda, device, dtype, peak = suite_device(dtype)
    dtype_name = str(dtype).removeprefix("torch.")
    reps = 1 if quick else 3
    rows = []
    for shape in window_shapes(cuda, quick):
        q, k, v, grad_out = make_inputs(shape, dtype, device)
        impl, torch_attention = torch_window_attention(shape, cuda, device, (q, k, v, grad_out))
        for pass_, (tessel_fn, torch_fn, causal_fn) in window_cases(q, k, v, grad_out, shape, torch_attention).items():
            name = f"{shape.label} {pass_} window={shape.window}"
            err = check_case(name, (tessel_fn, torch_fn), dtype, cuda)
            tessel_ms, torch_ms, causal_ms = (time_fn(fn, cuda=cuda, reps=reps) for fn in (tessel_fn, torch_fn,
                                                                                            causal_fn))  # fmt: skip
            flops = window_flops(shape, pass_)
            tessel_tflops, torch_tflops = flops / tessel_ms / 1e9, flops / torch_ms / 1e9
            values = (
                shape.label, pass_, shape.b, shape.h, shape.s, shape.d, shape.window, dtype_name, impl, err,
                tessel_ms, torch_ms, causal_ms, tessel_tflops, torch_tflops, tessel_tflops / torch_tflops,
                causal_ms / tessel_ms, tessel_tflops / peak if peak else None,
            )  # fmt: skip
            rows.append(dict(zip(COLUMNS, values, strict=True)))
        del q, k, v, grad_out
    return rows + geomean_rows(rows, COLUMNS, "pass", PASSES, dtype=dtype_name)
