"""The adam suite: tessel's fused mixed-precision AdamW step against torch.optim.AdamW(fused=True).

One row per shard size ``n``. The shard is what a ZeRO rank owns: fp32 master param and moments,
a low-precision grad and a low-precision param copy (bf16 on a GPU by default). Three timings:

- ``tessel``: ``adam_step(param, grad, m, v, ..., param_copy=copy)``, one pass that reads grad, param,
  m, v and writes param, m, v and the copy: 24 + 2·itemsize bytes per element, 28 with bf16.
- ``torch``: ``torch.optim.AdamW(fused=True).step()`` on an fp32 parameter whose ``.grad`` is the
  same gradient upcast to fp32 once beforehand (as autocast training hands it to torch), followed by
  ``copy.copy_(param)`` to produce the same low-precision copy.
- ``copy``: a device-to-device copy moving the same 28·n bytes (14·n read, 14·n written), the
  bandwidth ceiling for a memory-bound pass.

Before timing, one step of each from the same state is compared: tessel against torch on the whole
shard, and against :func:`adam_step_reference` on a prefix; the run stops with :class:`BenchmarkError`
when they disagree. A row reports the effective bandwidth of each (``bytes_per_elem·n / time``, the
same useful byte count for all three, so torch's extra traffic shows up as a lower figure), tessel's
fraction of the copy's bandwidth and the speed-up over torch (``torch_ms / tessel_ms``).

GPU shards: 10⁸ and 10⁹ elements (``quick``: 10⁸); 10⁹ holds ~62 GB at once (16 GB for tessel,
18 GB for torch, 28 GB for the copy). CPU shards are small and odd, and their timings come from
Triton's interpreter: they are never performance numbers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..kernels.adam import adam_step, adam_step_reference
from .matmul import BenchmarkError, max_rel_error
from .runner import time_fn

__all__ = [
    "COLUMNS",
    "HYPER",
    "adam_shards",
    "bytes_per_element",
    "check_step",
    "copy_fn",
    "make_state",
    "run_adam_suite",
    "tessel_fn",
    "torch_fn",
]

COLUMNS = (
    "case", "n", "dtype", "bytes_per_elem", "max_rel_err", "ref_rel_err", "copy_rel_err",
    "tessel_ms", "torch_ms", "copy_ms", "tessel_GBps", "torch_GBps", "copy_GBps", "tessel_of_copy", "tessel/torch",
)  # fmt: skip

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)

_GPU_SHARDS = (("shard-1e8", 10**8, True), ("shard-1e9", 10**9, False))
# Odd sizes: the interpreter's 256-element blocks end in a partial block.
_CPU_SHARDS = (("shard-4k", 4099, True), ("shard-64k", 2**16 + 3, False))
_REFERENCE_PREFIX = 2**20 + 7  # the reference check runs on this many leading elements

# One step from the same state, fp32 throughout: the three implementations group the same
# operations differently (a few fp32 ulps, ~1e-7 of max|param|). The copy is rounded to the low
# precision once; a 1-ulp difference in fp32 can flip that rounding (bf16: 2^-8 relative).
_STEP_TOLERANCE = 1e-5
_COPY_TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-5}


def adam_shards(cuda: bool, quick: bool = False) -> list[tuple[str, int]]:
    """``(label, n)`` per shard: the GPU or the CPU table, only its core sizes with ``quick``."""
    return [(label, n) for label, n, core in (_GPU_SHARDS if cuda else _CPU_SHARDS) if core or not quick]


def bytes_per_element(dtype: torch.dtype) -> int:
    """Bytes one fused step moves per element: reads grad, param, m, v; writes param, m, v, copy."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return itemsize + 3 * 4 + 3 * 4 + itemsize


def make_state(n: int, dtype: torch.dtype, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """A shard before its first step: random fp32 param, random grad in ``dtype``, zero moments."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return {
        "param": torch.randn(n, generator=gen, device=device),
        "grad": torch.randn(n, generator=gen, device=device).to(dtype),
        "exp_avg": torch.zeros(n, device=device),
        "exp_avg_sq": torch.zeros(n, device=device),
        "param_copy": torch.full((n,), float("nan"), device=device, dtype=dtype),
    }


def tessel_fn(state: dict[str, torch.Tensor], step: int = 1) -> Callable[[], None]:
    """The fused step on ``state`` (timed repeatedly at a fixed step count: same work every call)."""
    s = state
    return lambda: adam_step(s["param"], s["grad"], s["exp_avg"], s["exp_avg_sq"], step=step, **HYPER,
                             param_copy=s["param_copy"])  # fmt: skip


def torch_fn(state: dict[str, torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    """torch's fused AdamW on an fp32 copy of ``state`` plus the cast; returns (step, param, param_copy)."""
    param = torch.nn.Parameter(state["param"].clone())
    param.grad = state["grad"].float()
    param_copy = torch.empty_like(state["param_copy"])
    betas = (HYPER["beta1"], HYPER["beta2"])
    opt = torch.optim.AdamW([param], lr=HYPER["lr"], betas=betas, eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"], fused=True)  # fmt: skip

    @torch.no_grad()
    def step():
        opt.step()
        param_copy.copy_(param)

    return step, param.detach(), param_copy


def copy_fn(nbytes: int, device: str) -> Callable[[], None]:
    """A device-to-device copy that reads ``nbytes / 2`` and writes ``nbytes / 2``."""
    src = torch.ones(nbytes // 2, device=device, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def check_step(state: dict[str, torch.Tensor], torch_step, torch_param, torch_copy) -> dict[str, float]:
    """Run step 1 of tessel, torch and the reference from the same state; raise when they disagree."""
    k = min(_REFERENCE_PREFIX, state["param"].numel())
    before = {name: t[:k].clone() for name, t in state.items()}
    tessel_fn(state)()
    torch_step()
    adam_step_reference(before["param"], before["grad"], before["exp_avg"], before["exp_avg_sq"], step=1, **HYPER,
                        param_copy=before["param_copy"])  # fmt: skip
    errors = {
        "max_rel_err": max_rel_error(state["param"], torch_param),
        "ref_rel_err": max_rel_error(state["param"][:k], before["param"]),
        "copy_rel_err": max_rel_error(state["param_copy"], torch_copy),
    }
    copy_limit = _COPY_TOLERANCE[state["param_copy"].dtype]
    limits = {"max_rel_err": _STEP_TOLERANCE, "ref_rel_err": _STEP_TOLERANCE, "copy_rel_err": copy_limit}
    for name, err in errors.items():
        if not err <= limits[name]:  # also catches NaN
            raise BenchmarkError(
                f"adam suite: n={state['param'].numel()}: tessel's step differs ({name} {err:.3g}, above "
                f"the tolerance {limits[name]:.3g})"
            )
    return errors


def _row(label: str, n: int, dtype: torch.dtype, errors: dict, times: dict) -> dict:
    nbytes = bytes_per_element(dtype) * n
    gbps = {impl: nbytes / ms / 1e6 for impl, ms in times.items()}  # bytes / (ms·1e-3) / 1e9
    values = (
        label, n, str(dtype).removeprefix("torch."), bytes_per_element(dtype), errors["max_rel_err"],
        errors["ref_rel_err"], errors["copy_rel_err"], times["tessel"], times["torch"], times["copy"],
        gbps["tessel"], gbps["torch"], gbps["copy"], gbps["tessel"] / gbps["copy"], times["torch"] / times["tessel"],
    )  # fmt: skip
    return dict(zip(COLUMNS, values, strict=True))


def _measure(n: int, dtype: torch.dtype, device: str, reps: int) -> tuple[dict, dict]:
    cuda = device == "cuda"
    state = make_state(n, dtype, device)
    torch_step, torch_param, torch_copy = torch_fn(state)
    errors = check_step(state, torch_step, torch_param, torch_copy)
    times = {"tessel": time_fn(tessel_fn(state, step=2), cuda=cuda, reps=reps)}
    times["torch"] = time_fn(torch_step, cuda=cuda, reps=reps)
    del state, torch_step, torch_param, torch_copy  # free the shards before the copy buffers arrive
    times["copy"] = time_fn(copy_fn(bytes_per_element(dtype) * n, device), cuda=cuda, reps=reps)
    return errors, times


def run_adam_suite(dtype: torch.dtype | None = None, quick: bool = False, device: str | None = None) -> list[dict]:
    """Check and time the fused step, torch's fused AdamW and a copy on every shard; one row per shard.

    ``dtype`` is the grad and param-copy dtype: bf16 by default on CUDA, fp32 on a CPU. ``device``
    defaults to CUDA when present. ``quick`` keeps the smaller shard and, on a CPU, times one call.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    rows = []
    for label, n in adam_shards(cuda, quick):
        errors, times = _measure(n, dtype, device, reps=1 if quick else 3)
        rows.append(_row(label, n, dtype, errors, times))
    return rows
