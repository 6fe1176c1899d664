"""The loss suite: the language-model head and its cross entropy, tessel's chunked op against torch's two calls.

One row per shape ``N`` tokens × ``E`` hidden × ``V`` vocabulary (the head's rows on one rank: ``V/t`` of a
model's vocabulary under tensor parallelism). Forward and backward of:

- ``tessel``: :func:`~tessel.layers.linear_cross_entropy.linear_cross_entropy` with its default chunks, which
  never holds the ``[N, V]`` logits;
- ``torch``: ``F.cross_entropy(F.linear(x, W).float(), target)``, what Hugging Face's models do (the logits
  in the inputs' dtype, upcast to fp32 for the loss);
- ``logits``: ``vocab_parallel_cross_entropy(F.linear(x, W), target)``: the same logits, tessel's loss over them
  (its Triton row passes, no fp32 copy): what the row passes alone change.

Before timing, all three are compared with torch's (loss, and the gradients of ``x`` and ``W``): the run stops
with :class:`~.matmul.BenchmarkError` past the dtype's tolerance. A row reports the three times (forward and
backward, milliseconds), ``tessel/torch`` (``torch_ms / tessel_ms``, above 1: tessel is faster), and the
memory each needs beyond its inputs: on a GPU the peak allocated during the call and its backward
(``torch.cuda.max_memory_allocated``), on a CPU the largest single tensor each creates (an exact count,
the same on every machine: the logits or a chunk of them); ``torch/tessel memory`` is their ratio.

GPU shapes: Llama 3's head (E 4096, V 128256) at 8k tokens, the same at tp 8 (V/t 16032) at 16k tokens, and
GPT-2's vocabulary (50304) at E 2048 and 16k tokens (the training job's 1B preset). CPU shapes are tiny and
their timings come from Triton's interpreter: they are never performance numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ..layers.cross_entropy import vocab_parallel_cross_entropy
from ..layers.linear_cross_entropy import default_chunk_size, linear_cross_entropy
from .matmul import BenchmarkError, max_rel_error
from .runner import time_fn

__all__ = ["COLUMNS", "LOSS_SHAPES_CPU", "LOSS_SHAPES_GPU", "LargestTensor", "LossShape", "run_loss_suite"]

COLUMNS = (
    "case", "N", "E", "V", "dtype", "chunk", "loss_rel_err", "grad_rel_err", "tessel_ms", "torch_ms", "logits_ms",
    "tessel/torch", "memory", "tessel_MB", "torch_MB", "logits_MB", "torch/tessel memory",
)  # fmt: skip


@dataclass(frozen=True)
class LossShape:
    label: str
    n: int
    e: int
    v: int
    extra: bool = False  # left out of --quick
    chunk: int | None = None  # tokens per chunk (None: linear_cross_entropy's default)


LOSS_SHAPES_GPU = (
    LossShape("llama3-8k", 8192, 4096, 128256),
    LossShape("llama3-tp8-16k", 16384, 4096, 16032),
    LossShape("gpt2-vocab-16k", 16384, 2048, 50304, extra=True),
)
# Chunks of 8 tokens: the default would take these few tokens in one chunk, as large as torch's logits.
LOSS_SHAPES_CPU = (LossShape("tiny", 37, 24, 301, chunk=8), LossShape("tiny-wide", 61, 16, 517, extra=True, chunk=8))

# tessel's logits stay fp32; torch's are rounded to the inputs' dtype first, and both round the logits'
# gradient to it before the backward GEMMs: bf16 differs by a few of its ulps (2^-8) of the largest gradient.
_LOSS_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
_GRAD_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def _inputs(shape: LossShape, dtype: torch.dtype, device: str):
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape.n, shape.e, device=device, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(shape.v, shape.e, device=device, generator=gen) / shape.e**0.5).to(dtype).requires_grad_()
    target = torch.randint(0, shape.v, (shape.n,), device=device, generator=gen)
    return x, w, target


def _tessel(chunk):
    return lambda x, w, target: linear_cross_entropy(x, w, target, chunk_size=chunk)


def _torch(x, w, target):
    return F.cross_entropy(F.linear(x, w).float(), target)


def _logits(x, w, target):
    return vocab_parallel_cross_entropy(F.linear(x, w), target)


def _step(loss_fn, x, w, target):
    def step():
        x.grad = w.grad = None
        loss_fn(x, w, target).backward()

    return step


class LargestTensor(TorchDispatchMode):
    """Bytes of the largest floating-point tensor any aten operation returns while the mode is on (Triton's
    interpreter copies kernel arguments' storages as bytes: those are not the op's tensors)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def _memory_mb(step, cuda: bool) -> float:
    """MB beyond the inputs: the peak allocated during ``step`` on CUDA, the largest tensor it creates on a CPU."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    with LargestTensor() as seen:
        step()
    return seen.largest / 2**20


def _check(shape: LossShape, x, w, target) -> tuple[float, float]:
    results = []
    for loss_fn in (_torch, _tessel(shape.chunk), _logits):
        x.grad = w.grad = None
        loss = loss_fn(x, w, target)
        loss.backward()
        results.append((loss.detach(), x.grad.clone(), w.grad.clone()))
    (ref, ref_dx, ref_dw), *others = results
    loss_err = max(max_rel_error(loss, ref) for loss, _, _ in others)
    grad_err = max(max(max_rel_error(dx, ref_dx), max_rel_error(dw, ref_dw)) for _, dx, dw in others)
    if not (loss_err <= _LOSS_TOL[x.dtype] and grad_err <= _GRAD_TOL[x.dtype]):  # also catches NaN
        raise BenchmarkError(
            f"loss suite: {shape.label}: tessel differs from torch (loss {loss_err:.3g}, gradients {grad_err:.3g}; "
            f"tolerances {_LOSS_TOL[x.dtype]:.3g}, {_GRAD_TOL[x.dtype]:.3g})"
        )
    return loss_err, grad_err


def run_loss_suite(dtype: torch.dtype | None = None, quick: bool = False, device: str | None = None) -> list[dict]:
    """Check, time and measure the memory of both heads and losses on every shape; one row per shape."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    rows = []
    for shape in LOSS_SHAPES_GPU if cuda else LOSS_SHAPES_CPU:
        if quick and shape.extra:
            continue
        x, w, target = _inputs(shape, dtype, device)
        errors = _check(shape, x, w, target)
        fns = (("tessel", _tessel(shape.chunk)), ("torch", _torch), ("logits", _logits))
        steps = {name: _step(fn, x, w, target) for name, fn in fns}
        memory = {name: _memory_mb(step, cuda) for name, step in steps.items()}
        times = {name: time_fn(step, cuda=cuda, reps=1 if quick else 3) for name, step in steps.items()}
        values = (
            shape.label, shape.n, shape.e, shape.v, str(dtype).removeprefix("torch."),
            shape.chunk or default_chunk_size(shape.n, shape.v, shape.e), *errors, times["tessel"], times["torch"],
            times["logits"], times["torch"] / times["tessel"], "peak allocated" if cuda else "largest tensor",
            memory["tessel"], memory["torch"], memory["logits"], memory["torch"] / memory["tessel"],
        )  # fmt: skip
        rows.append(dict(zip(COLUMNS, values, strict=True)))
        del x, w, target, steps
    return rows
