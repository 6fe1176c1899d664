"""Where a kernel runs: compiled Triton on CUDA, Triton's interpreter on CPU, or the PyTorch reference.

The one place that makes this decision, so no kernel file repeats it:

- CUDA tensors run the compiled Triton kernel.
- CPU tensors run the same Triton kernel through the interpreter when ``TRITON_INTERPRET=1`` was set
  before Triton was imported (that is how CI proves every kernel on a CPU), and the plain-PyTorch
  reference otherwise.

Triton reads ``TRITON_INTERPRET`` when a ``@triton.jit`` function is defined, so the flag is sampled
once, at import, and a later change of the environment cannot make kernels disagree with it.
"""

from __future__ import annotations

import functools
import os

import numpy
import torch
import triton

__all__ = [
    "INTERPRET",
    "Backend",
    "backend_for",
    "byte_span",
    "cdiv",
    "check_interpreter",
    "memory_overlaps",
    "next_power_of_2",
    "opaque_to_compile",
    "upcast_dot_operands",
]

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the launchers' host arithmetic (grids, tile counts). ``triton.cdiv`` computes the
    same but is a ``constexpr_function`` since Triton 3.5: a few microseconds per host call, several of which
    every launch makes."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two at least ``n`` (0 for ``n <= 0``), as ``triton.next_power_of_2`` without its
    per-call cost on the host (see :func:`cdiv`)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def opaque_to_compile(fn):
    """``fn`` (a function that launches Triton kernels or talks to ``torch.distributed``), hidden from
    ``torch.compile``: Dynamo never traces into it, so a compiled model breaks its graph around the call and
    runs it as it runs without compile, and compiles the rest. Tracing into a launcher would walk through
    Triton's host code (under the interpreter, its NumPy emulation of every program) and through the
    launchers' pointer and stride checks, which fake tensors cannot answer."""
    return torch.compiler.disable(fn)


class Backend:
    TRITON = "triton"
    INTERPRETER = "interpreter"
    REFERENCE = "reference"


def backend_for(*tensors: torch.Tensor) -> str:
    """The backend for tensors that already share one device (launchers check that first)."""
    device = tensors[0].device
    if device.type == "cuda":
        return Backend.TRITON
    if device.type == "cpu":
        if not INTERPRET:
            return Backend.REFERENCE
        if not torch.compiler.is_compiling():  # the launchers, opaque to compile, check when they run
            check_interpreter(triton.__version__, numpy.__version__)
        return Backend.INTERPRETER
    raise ValueError(f"tessel kernels run on 'cuda' or 'cpu' tensors, received a tensor on {device}")


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


@functools.cache
def check_interpreter(triton_version: str, numpy_version: str) -> None:
    """Refuse a Triton interpreter that cannot run tessel's kernels, with the fix in the message.

    Triton 3.6's interpreter turns loop bounds into Python integers with ``int()`` of a one-element
    array, which NumPy 2.4 rejects; every kernel with a loop would fail deep inside Triton with "only
    0-dimensional arrays can be converted to Python scalars". Triton 3.7 fixed it.
    """
    if _release(triton_version) < (3, 7) and _release(numpy_version) >= (2, 4):
        raise RuntimeError(
            f"Triton {triton_version}'s interpreter (TRITON_INTERPRET=1) cannot run with NumPy {numpy_version}: "
            "it needs NumPy < 2.4 or Triton >= 3.7 (pip install 'numpy<2.4', or upgrade triton)"
        )


def upcast_dot_operands(backend: str) -> bool:
    """Whether ``tl.dot`` operands must be cast to fp32 first.

    Triton's interpreter multiplies fp16/bf16 ``tl.dot`` operands as raw bit patterns (results off by
    ~1e10), so under the interpreter kernels take their fp32-operand path; products of fp16/bf16
    values are exact in fp32, so this changes nothing but the accumulation order.
    """
    return backend == Backend.INTERPRETER


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range [lo, hi) that a tensor's elements can touch (any strides, negative ones included)."""
    lo = t.data_ptr() + t.element_size() * sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if st < 0)
    hi = t.data_ptr() + t.element_size() * (1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if st > 0))
    return lo, hi


def memory_overlaps(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the byte ranges of two non-empty tensors intersect."""
    if x.numel() == 0 or y.numel() == 0:
        return False
    (x_lo, x_hi), (y_lo, y_hi) = byte_span(x), byte_span(y)
    return x_lo < y_hi and y_lo < x_hi
