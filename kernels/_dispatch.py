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

import os

import torch

__all__ = ["INTERPRET", "Backend", "backend_for", "upcast_dot_operands"]

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"


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
        return Backend.INTERPRETER if INTERPRET else Backend.REFERENCE
    raise ValueError(f"tessel kernels run on 'cuda' or 'cpu' tensors, received a tensor on {device}")


def upcast_dot_operands(backend: str) -> bool:
    """Whether ``tl.dot`` operands must be cast to fp32 first.

    Triton's interpreter multiplies fp16/bf16 ``tl.dot`` operands as raw bit patterns (results off by
    ~1e10), so under the interpreter kernels take their fp32-operand path; products of fp16/bf16
    values are exact in fp32, so this changes nothing but the accumulation order.
    """
    return backend == Backend.INTERPRETER
