"""One GEMM launch over rows that arrive while it runs: the consumer half of a fused all-gather GEMM.

    out[M, N] (+)= activation(a[M, K] @ b[K, N] + bias[N]),   a's rows in ``chunks`` blocks of ``m = M / chunks``

Chunk ``c`` of ``a`` (rows ``[c·m, (c+1)·m)``) is written by someone else while the kernel runs (a peer's transfer,
a copy on another stream), which then sets ``ready[c]`` (int32) to ``epoch`` (1 unless the caller counts its calls)
or more. The chunks arrive in ring
order: position ``p`` holds chunk ``(first + p·step) mod chunks``, so ``first`` is this rank's own chunk (never
waited for: it is in place when the kernel is launched) and ``step = chunks - 1`` is tessel's all-gather ring.

Why one launch: the per-chunk rings of :mod:`tessel.parallel.rings` launch one GEMM per chunk. On a GPU each launch
costs host time (tens of microseconds of Python and driver work), and a chunk of ``m`` rows fills fewer SMs than
the whole GEMM would. Where a chunk's GEMM is shorter than that, the ring waits for the host, and the chunked
schedule costs more than the transfer it hides. Here persistent programs (one per SM, less ``reserve_sms``) walk
the tiles chunk by chunk in arrival order. A program about to read a chunk it has not seen yet spins on the
chunk's flag with an acquire load, then reads the rows. So arrived chunks are multiplied while later ones are in
flight, tiles of consecutive chunks fill the SMs together, and the host launches one kernel, not ``chunks``.

Who sets the flags must not need the SMs the kernel holds: a copy engine (``Tensor.copy_`` between contiguous
tensors), or a small kernel on another stream (``ready[c].fill_(1)``), which runs on the SMs left free by
``reserve_sms``. Every producer must be enqueued without the host waiting on the device in between, since the
kernel only finishes once every flag is set, and a producer kernel must have run once before (CUDA loads a kernel
at its first launch, lazily by default, and loading one may wait for the running kernels: for this one, forever).
Between launches the flags must fall below ``epoch`` again: the caller clears them (``ready.zero_()`` on the
launching stream, ordered before the producers' writes), or, where the producers are other processes that cannot
be ordered after a clear, passes a larger ``epoch`` at each call (:mod:`tessel.parallel.peer`).

On a CPU the call waits the same way, for flags that another thread sets: Triton's interpreter runs the programs
one after another in the calling thread, each spinning on the flags in memory it shares with that thread; the
PyTorch reference multiplies chunk by chunk in arrival order, waiting on the host for each one's flag. A flag
that is never set blocks the call there too, as it would the kernel on a GPU.
"""

from __future__ import annotations

import functools
import itertools
import math
import time

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ._dispatch import Backend, backend_for, cdiv, opaque_to_compile, upcast_dot_operands
from .matmul import (
    _FP8_SHAPES,
    _INTERPRETER_BLOCKS,
    _INTERPRETER_PROGRAMS,
    _SHARED_SLACK,
    _TILE_SHAPES,
    _ensure_scratch_allocator,
    _input_precision,
    _matmul_tile,
    _needs_int64,
    _num_sms,
    _shared_bytes,
    _shared_limit,
    _tma_flags,
    _validate,
    check_out_apart,
    operand_descriptors,
)
from .matmul_reference import _reference_into

__all__ = ["gated_matmul", "gated_matmul_unchecked"]


# EPOCH changes at every call of a caller counting its calls: one compiled kernel serves them all (a new
# specialisation would compile and load a kernel mid-run, and loading may wait for a gated kernel still spinning).
@triton.jit(do_not_specialize=["EPOCH"])
def _gated_matmul_kernel(
    a_ptr, b_ptr, out_ptr, bias_ptr, ready_ptr, done_ptr, count_ptr, table_ptr, a_scale_ptr, b_scale_ptr,
    CHUNK_ROWS, N, K, CHUNKS, FIRST, STEP, EPOCH,
    stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on,
    WAIT: tl.constexpr, SIGNAL: tl.constexpr, PUSH: tl.constexpr, PUSH_ALIGN: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    ACCUMULATE: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, INDEX_64: tl.constexpr,
    SCALED: tl.constexpr, SPLIT_ACC: tl.constexpr,
    TMA: tl.constexpr, B_T: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """Persistent programs walk the tiles position by position (each chunk's tiles in the plain kernel's grouped
    order), so a program's positions never decrease: ``seen`` (the next position it has not waited for) spares
    it the flag of a chunk it already read.

    SIGNAL: after storing a tile, a program counts it in ``count[chunk]`` (zeros at launch; after a barrier, so
    the count follows every thread's stores); the program whose tile completes the chunk sets ``done[chunk]`` to
    EPOCH, with release semantics at system scope. The count's acquire-release chains the other tiles' stores
    into that release.

    PUSH: each chunk has a destination and flags of its own, anywhere in the address space (a peer's memory):
    ``table`` (int64 ``[3, CHUNKS]``) holds, per chunk, the offset of its destination's first row from ``out_ptr``
    (in elements, a multiple of PUSH_ALIGN), of the flag SIGNAL raises from ``done_ptr``, and of a flag there that
    must reach EPOCH - 1 before the chunk's rows are stored (the destination's owner has read the previous call's
    rows; ``freed``, like ``seen``, spares a program the flag of a chunk it already stored into).

    TMA (a row-major): one descriptor over all of ``a``, each tile reading from its chunk's first row. A tile
    that ends past its chunk reads the next chunk's first rows, ready or not, into rows it never stores (each
    output row depends on its own row of ``a`` alone); past the last row the copy engine fills zeros."""
    a_desc, b_desc = operand_descriptors(
        a_ptr, b_ptr, CHUNKS * CHUNK_ROWS, N, K, stride_am, stride_ak, stride_bk, stride_bn, TMA, False, B_T,
        BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    tiles_per_chunk = tl.cdiv(CHUNK_ROWS, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    seen = 1  # position 0, the caller's own chunk, is in place at launch
    freed = 0
    for tile in range(tl.program_id(0), CHUNKS * tiles_per_chunk, tl.num_programs(0)):
        position = tile // tiles_per_chunk
        chunk = (FIRST + position * STEP) % CHUNKS
        if WAIT and position >= seen:
            # acquire at system scope: the rows written before the flag (by this GPU, a peer GPU or a copy
            # engine) are visible to the loads below
            while tl.atomic_add(ready_ptr + chunk, 0, sem="acquire", scope="sys") < EPOCH:
                pass
            seen = position + 1
        first_row = chunk * CHUNK_ROWS  # int32: a descriptor's coordinate
        row0 = first_row
        if INDEX_64:
            row0 = row0.to(tl.int64)
        if PUSH:
            if position >= freed:  # acquire: the owner's reads of the previous call's rows come before our stores
                while tl.atomic_add(done_ptr + tl.load(table_ptr + 2 * CHUNKS + chunk), 0, sem="acquire",
                                    scope="sys") < EPOCH - 1:  # fmt: skip
                    pass
                freed = position + 1
            dest = out_ptr + tl.multiple_of(tl.load(table_ptr + chunk), PUSH_ALIGN)
        else:
            dest = out_ptr + row0 * stride_om
        # The chunk is a GEMM of its own (M = CHUNK_ROWS): through pointers, rows past it wrap around inside it.
        _matmul_tile(
            tile % tiles_per_chunk, a_ptr + row0 * stride_am, b_ptr, a_desc, b_desc, first_row,
            dest, bias_ptr, out_ptr, a_scale_ptr, b_scale_ptr, CHUNK_ROWS, N, K,
            stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on, stride_om, stride_on,
            HAS_BIAS, ACTIVATION, ACCUMULATE, False, DOT_FP32, INPUT_PRECISION, INDEX_64, SCALED, SPLIT_ACC,
            TMA, False, B_T, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
        )  # fmt: skip
        if SIGNAL:
            tl.debug_barrier()  # every thread's stores of this tile come before its count
            counted = tl.atomic_add(count_ptr + chunk, 1, sem="acq_rel", scope="sys")
            if counted == tiles_per_chunk - 1:
                signal = done_ptr + chunk
                if PUSH:
                    signal = done_ptr + tl.load(table_ptr + CHUNKS + chunk)
                tl.atomic_xchg(signal, EPOCH, sem="release", scope="sys")


# Candidate tiles on sm_90, timed once per problem (see _tuned_config): the plain GEMM's largest tiles whose pipeline
# fits in shared memory for the operands' dtype, this many, each through pointers and through descriptors (eight
# compiles per dtype at the first call).
_CANDIDATES = 4
# The interpreter runs the pointer variant unless a test picks the descriptor one.
_INTERPRETER_TMA = False
# Tuning launches neither wait nor signal.
_SILENT = {"WAIT": False, "SIGNAL": False, "PUSH": False, "PUSH_ALIGN": 1}
# How often the PyTorch reference looks at a flag that is not set yet.
_REFERENCE_POLL_S = 1e-4


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"gated_matmul: {name} must be an int, received {type(value).__name__}")
    if value < low:
        raise ValueError(f"gated_matmul: {name} must be at least {low}, received {value}")


def _check_flags(name: str, flags, a, chunks) -> None:
    if not isinstance(flags, torch.Tensor):
        raise TypeError(f"gated_matmul: {name} must be a torch.Tensor, received {type(flags).__name__}")
    if flags.dtype != torch.int32 or tuple(flags.shape) != (chunks,) or flags.stride() != (1,):
        raise ValueError(
            f"gated_matmul: {name} must be a contiguous ({chunks},) int32 tensor (one flag per chunk), received "
            f"{tuple(flags.shape)} {flags.dtype} with strides {flags.stride()}"
        )
    if flags.device != a.device:
        raise ValueError(f"gated_matmul: {name} must be on a's device {a.device}, received {flags.device}")


def _validate_gating(a, ready, done, chunks, first, step, reserve_sms, epoch, free=None) -> None:
    _check_int("chunks", chunks, 1)
    if a.shape[0] % chunks:
        raise ValueError(
            f"gated_matmul: a's rows must split into chunks={chunks} equal blocks, received {a.shape[0]} rows"
        )
    _check_int("first", first, 0)
    if first >= chunks:
        raise ValueError(f"gated_matmul: first must be a chunk index below chunks={chunks}, received {first}")
    _check_int("step", step, 1)
    if math.gcd(step, chunks) != 1:
        raise ValueError(
            f"gated_matmul: step must be coprime with chunks={chunks} (so the order visits every chunk once), "
            f"received {step}"
        )
    _check_int("reserve_sms", reserve_sms, 0)
    _check_int("epoch", epoch, 1)
    if epoch >= 2**31:
        raise ValueError(f"gated_matmul: epoch must fit an int32 flag (below 2**31), received {epoch}")
    if ready is not None:
        _check_flags("ready", ready, a, chunks)
    for name, flags in (("done", done), ("free", free)):
        if isinstance(flags, (list, tuple)):
            _check_flag_list(name, flags, a, chunks)
        elif flags is not None:
            _check_flags(name, flags, a, chunks)


def _check_flag_list(name: str, flags, a, chunks) -> None:
    if len(flags) != chunks:
        raise ValueError(f"gated_matmul: {name} must hold one flag per chunk ({chunks}), received {len(flags)}")
    for c, flag in enumerate(flags):
        if not isinstance(flag, torch.Tensor):
            raise TypeError(f"gated_matmul: {name}[{c}] must be a torch.Tensor, received {type(flag).__name__}")
        if flag.dtype != torch.int32 or flag.numel() != 1 or flag.device != a.device:
            raise ValueError(
                f"gated_matmul: {name}[{c}] must be a one-element int32 tensor on a's device {a.device}, received "
                f"{tuple(flag.shape)} {flag.dtype} on {flag.device}"
            )


def _validate_destinations(a, b, out, chunks, fn: str = "gated_matmul") -> None:
    """``out`` as one destination per chunk: ``[M / chunks, N]`` tensors of one dtype and one layout."""
    if len(out) != chunks:
        raise ValueError(f"{fn}: out must hold one destination per chunk ({chunks}), received {len(out)}")
    rows = a.shape[0] // chunks
    first = out[0]
    for c, dest in enumerate(out):
        if not isinstance(dest, torch.Tensor):
            raise TypeError(f"{fn}: out[{c}] must be a torch.Tensor, received {type(dest).__name__}")
        want = ((rows, b.shape[1]), first.dtype, first.stride(), a.device)
        got = (tuple(dest.shape), dest.dtype, dest.stride(), dest.device)
        if got != want or dest.dtype not in (a.dtype, torch.float32):
            raise ValueError(
                f"{fn}: out[{c}] must be a {want[0]} tensor of a's dtype (or float32) on {a.device}, with out[0]'s "
                f"dtype {first.dtype} and strides {first.stride()}, received {got[0]} {got[1]} with strides "
                f"{got[2]} on {got[3]}"
            )
        check_out_apart(a, b, dest, fn)


def _wait_on_host(flag: torch.Tensor, value: int) -> None:
    while int(flag) < value:
        time.sleep(_REFERENCE_POLL_S)


def _reference_gated(a, b, ready, chunks, first, step, dests, signals, frees, bias, activation, accumulate,
                     epoch, scales=None) -> None:  # fmt: skip
    """The kernel's contract in PyTorch: chunk by chunk in arrival order, each once its flag is set (by another
    thread or process: a CPU tensor's flags are read from the memory they write), stored once its ``free`` flag
    allows, and its ``done`` flag set once its rows are written (per-chunk lists here)."""
    rows = a.shape[0] // chunks
    for position in range(chunks):
        c = (first + position * step) % chunks
        if ready is not None and position:
            _wait_on_host(ready[c], epoch)
        if frees is not None:
            _wait_on_host(frees[c], epoch - 1)
        _reference_into(a[c * rows : (c + 1) * rows], b, bias, activation, dests[c], accumulate, None, scales)
        if signals is not None:
            signals[c].fill_(epoch)


@functools.cache
def _programs_for(device: torch.device, reserve_sms: int) -> int:
    return max(1, _num_sms(device) - reserve_sms)


def _flags(a, b, bias, activation, accumulate, out, backend: str, scaled=False, split_acc=False) -> tuple[dict, bool]:
    """The kernel's flags, and whether its descriptor variant can read the operands (a row-major; see
    :func:`~tessel.kernels.matmul._tma_flags`). ``scaled``: fp8 operands with inverse scales; ``split_acc``: their
    products summed into fp32 once per K block (as :func:`~tessel.kernels.fp8.fp8_matmul` does)."""
    tma = _tma_flags(a, b, backend)
    flags = {
        "HAS_BIAS": bias is not None,
        "ACTIVATION": activation or "none",
        "ACCUMULATE": accumulate,
        "DOT_FP32": upcast_dot_operands(backend),
        "INPUT_PRECISION": _input_precision(a.dtype, backend),
        "INDEX_64": _needs_int64(a, b, out),
        "B_T": tma["B_T"],
        "SCALED": scaled,
        "SPLIT_ACC": split_acc and backend == Backend.TRITON,
    }
    return flags, tma["TMA_OK"] and not tma["A_T"]


def _args(a, b, out, bias, ready, done, count, chunks, first, step, epoch, table=None, scales=None) -> tuple:
    unused = ready if ready is not None else (done if done is not None else a)  # any tensor: never read
    return (
        a, b, out, bias if bias is not None else out, ready if ready is not None else unused,
        done if done is not None else unused, count if count is not None else unused,
        table if table is not None else unused, *(scales if scales is not None else (out, out)), a.shape[0] // chunks,
        b.shape[1], a.shape[1], chunks, first, step, epoch, *a.stride(), *b.stride(), *out.stride(),
    )  # fmt: skip


_tuned: dict[tuple, triton.Config] = {}


def _tuning_key(a, b, chunks, flags, tma_ok, programs) -> tuple:
    unit = lambda t: tuple(s == 1 for s in t.stride())
    return (a.shape[0] // chunks, chunks, b.shape[1], a.shape[1], a.dtype, b.dtype, unit(a), unit(b), tma_ok, programs,
            *sorted(flags.items()))  # fmt: skip


def _candidates(element_size: int, shared_limit: int, tma_ok: bool) -> list[triton.Config]:
    """The ``_CANDIDATES`` largest of the plain GEMM's tiles whose pipeline fits in ``shared_limit`` bytes for
    operands of ``element_size``, each through pointers and, where ``tma_ok``, through descriptors."""
    fits = lambda bm, bn, bk, st: _shared_bytes({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, st, element_size)
    tiles = (_FP8_SHAPES if element_size == 1 else []) + _TILE_SHAPES  # fp8's deep K blocks first
    shapes = [shape for shape in tiles if fits(*shape[:4]) + _SHARED_SLACK <= shared_limit][:_CANDIDATES]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "TMA": tma}, num_stages=st,
                      num_warps=w)
        for (bm, bn, bk, st, w), tma in itertools.product(shapes, (False, True) if tma_ok else (False,))
    ]  # fmt: skip


def _tuned_config(a, b, out_dtype, bias, chunks, flags, tma_ok, programs, scales=None) -> triton.Config:
    """The fastest candidate tile and variant (pointers, or descriptors where ``tma_ok``) for this problem, timed
    once without waiting or signalling and into a scratch output, so tuning neither waits for the caller's
    producers nor touches the caller's ``out`` and flags."""
    key = _tuning_key(a, b, chunks, flags, tma_ok, programs)
    config = _tuned.get(key)
    if config is not None:
        return config
    candidates = _candidates(a.element_size(), _shared_limit(a.device), tma_ok)
    scratch = torch.zeros((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    args = _args(a, b, scratch, bias, None, None, None, chunks, 0, 1, 1, None, scales)
    best, best_ms = None, float("inf")
    for config in candidates:
        grid = (min(programs, chunks * cdiv(a.shape[0] // chunks, config.kwargs["BLOCK_M"])
                    * cdiv(b.shape[1], config.kwargs["BLOCK_N"])),)  # fmt: skip
        launch = lambda c=config, g=grid: _gated_matmul_kernel[g](*args, **flags, **_SILENT, **c.all_kwargs())
        try:
            ms = triton.testing.do_bench(launch, warmup=5, rep=20)
        except OutOfResources:  # more registers or shared memory than this device has: as Triton's autotuner does
            continue
        if ms < best_ms:
            best, best_ms = config, ms
    if best is None:
        raise RuntimeError(f"gated_matmul: no candidate tile fits this device for a {a.dtype} problem")
    _tuned[key] = best
    return best


@opaque_to_compile
def gated_matmul(
    a, b, ready, *, chunks, first=0, step=1, bias=None, activation=None, out=None, accumulate=False, reserve_sms=2,
    epoch=1, done=None, free=None,
) -> torch.Tensor | list[torch.Tensor]:  # fmt: skip
    """``out (+)= activation(a @ b + bias)`` in one launch, each chunk of ``a``'s rows read once ``ready`` says so.

    Args:
        a: ``[M, K]``, any strides, float32/float16/bfloat16; ``M`` a multiple of ``chunks``.
        b: ``[K, N]``, a's dtype and device, any strides.
        ready: a contiguous ``[chunks]`` int32 tensor on a's device: ``ready[c] >= epoch`` once chunk ``c`` is
            written. Chunk ``first`` is not waited for. Set by another stream or a copy engine while the kernel
            runs (see the module's notes on what may set it); on a CPU, by another thread. ``None``: every chunk is
            in place at launch (nothing is waited for).
        chunks: how many row blocks ``a`` has.
        first, step: the arrival order, position ``p`` being chunk ``(first + p·step) mod chunks``; ``step``
            coprime with ``chunks``. ``first=r, step=chunks-1`` is tessel's all-gather ring on rank ``r``.
        bias, activation, accumulate: as for :func:`tessel.kernels.matmul.matmul` (no autograd here).
        out: as for :func:`~tessel.kernels.matmul.matmul`, or a list of ``chunks`` destinations, one ``[M / chunks,
            N]`` tensor per chunk (of one dtype and layout; anywhere in memory: a peer's buffer, where a fused
            reduce-scatter sends each chunk's partial to its owner from the epilogue).
        reserve_sms: SMs the persistent programs leave free for what sets the flags (a kernel needs one).
        epoch: the flag value (or more) that marks a chunk written, ``1 <= epoch < 2**31``.
        done: ``None``, or a contiguous ``[chunks]`` int32 tensor on a's device that the kernel sets to ``epoch``
            for chunk ``c`` once all of ``out``'s rows of ``c`` are written (release ordered at system scope: a
            stream or a peer that sees the flag with an acquire load sees the rows). Chunks finish roughly in
            the order above. Or a list of ``chunks`` one-element int32 tensors (a peer's flags, say).
        free: ``None``, or flags as ``done`` takes them: chunk ``c``'s rows are stored only once ``free[c] >=
            epoch - 1`` (acquire at system scope), so a destination's owner can hold back the next call's rows
            until it has read the last call's.

    Returns:
        ``out`` when given, otherwise a new ``[M, N]`` tensor of a's dtype. On a GPU the call returns at once and
        the kernel finishes when the last chunk has arrived and been multiplied; on a CPU the call returns then.
    """
    listed = isinstance(out, (list, tuple))
    if listed and not isinstance(accumulate, bool):
        raise TypeError(f"gated_matmul: accumulate must be a bool, received {type(accumulate).__name__}")
    _validate(a, b, bias, activation, None if listed else out, False if listed else accumulate, "gated_matmul")
    _validate_gating(a, ready, done, chunks, first, step, reserve_sms, epoch, free)
    if listed:
        _validate_destinations(a, b, out, chunks)
    elif out is None:
        out = torch.empty((a.shape[0], b.shape[1]), device=a.device, dtype=a.dtype)
    gated_matmul_unchecked(
        a, b, ready, chunks, first, step, out, bias, activation, accumulate, reserve_sms, epoch, done, free
    )  # fmt: skip
    return out


def _per_chunk(x, chunks: int) -> list[torch.Tensor] | None:
    """A tensor split into its chunks' views (rows, or one flag each), or a list as given."""
    if x is None or isinstance(x, (list, tuple)):
        return x
    return list(x.chunk(chunks))


@functools.cache
def _always_free(device: torch.device) -> torch.Tensor:
    """A flag above every epoch: the ``free`` flag of chunks that wait for nothing."""
    return torch.full((1,), 2**31 - 1, dtype=torch.int32, device=device)


def _table(dests, signals, frees, chunks: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The kernel's per-chunk offsets (PUSH): ``[3, chunks]`` int64 (destinations from ``dests[0]`` in elements,
    flags from the flag base in int32 elements), the flag base, and the destinations' alignment in elements."""
    device = dests[0].device
    frees = frees or [_always_free(device)] * chunks
    base = (signals or frees)[0]
    elem = dests[0].element_size()
    offsets = [(d.data_ptr() - dests[0].data_ptr()) // elem for d in dests]
    offsets += [(f.data_ptr() - base.data_ptr()) // 4 for f in (signals or [base] * chunks)]
    offsets += [(f.data_ptr() - base.data_ptr()) // 4 for f in frees]
    align = max(1, 16 // elem)
    while any(offset % align for offset in offsets[:chunks]):
        align //= 2
    table, copied = _table_on(device, tuple(offsets))
    if copied is not None:  # a table copied on another stream, and freed (evicted) after this launch has read it
        stream = torch.cuda.current_stream(device)
        stream.wait_event(copied)
        table.record_stream(stream)
    return table.view(3, chunks), base, align


@functools.lru_cache(maxsize=256)
def _table_on(device: torch.device, offsets: tuple[int, ...]) -> tuple[torch.Tensor, object]:
    """``offsets`` as an int64 tensor on ``device``, kept for the next launch with the same layout (a transport's,
    call after call); on CUDA copied without the host waiting, with the event that marks the copy done."""
    host = torch.tensor(offsets, dtype=torch.int64)
    if device.type != "cuda":
        return host, None
    table = host.pin_memory().to(device, non_blocking=True)
    return table, torch.cuda.current_stream(device).record_event()


def gated_matmul_unchecked(
    a, b, ready, chunks, first, step, out, bias=None, activation=None, accumulate=False, reserve_sms=2, epoch=1,
    done=None, free=None, scales=None, split_accumulator=True,
) -> None:  # fmt: skip
    """:func:`gated_matmul` into ``out`` without its argument checks: for callers that checked their operands once
    and launch it at every step of a training run, where the checks' tens of microseconds of host time would show
    beside a short GEMM.

    ``scales``: fp8 operands (e4m3/e5m2, as :func:`~tessel.kernels.fp8.fp8_matmul` takes them): their inverse scales,
    two one-element fp32 tensors multiplying ``a @ b``; ``split_accumulator`` as there."""
    if a.shape[0] == 0 or b.shape[1] == 0:
        return
    backend = backend_for(a)
    push = isinstance(out, (list, tuple)) or isinstance(done, (list, tuple)) or free is not None
    if backend == Backend.REFERENCE:
        lists = (_per_chunk(x, chunks) for x in (out, done, free))
        _reference_gated(a, b, ready, chunks, first, step, *lists, bias, activation, accumulate, epoch, scales)
        return
    table, align, signal = None, 1, done is not None
    if push:
        dests = _per_chunk(out, chunks)
        table, done, align = _table(dests, _per_chunk(done, chunks), _per_chunk(free, chunks), chunks)
        out = dests[0]
    flags, tma_ok = _flags(a, b, bias, activation, accumulate, out, backend, scales is not None, split_accumulator)
    # each chunk's count of stored tiles, a new one per launch (launches on other streams may run meanwhile)
    count = torch.zeros(chunks, dtype=torch.int32, device=a.device) if signal else None
    args = _args(a, b, out, bias, ready, done, count, chunks, first, step, epoch, table, scales)
    gating = {"WAIT": ready is not None, "SIGNAL": signal, "PUSH": push, "PUSH_ALIGN": align}
    rows = a.shape[0] // chunks
    if backend == Backend.INTERPRETER:
        meta = {**_INTERPRETER_BLOCKS, "TMA": _INTERPRETER_TMA and tma_ok}
        tiles = chunks * cdiv(rows, meta["BLOCK_M"]) * cdiv(b.shape[1], meta["BLOCK_N"])
        _gated_matmul_kernel[(min(tiles, _INTERPRETER_PROGRAMS),)](*args, **flags, **gating, **meta)
        return
    _ensure_scratch_allocator()  # device-built descriptors (see matmul)
    with torch.cuda.device(a.device):
        programs = _programs_for(a.device, reserve_sms)
        config = _tuned_config(a, b, out.dtype, bias, chunks, flags, tma_ok, programs, scales)
        meta = config.kwargs
        tiles = chunks * cdiv(rows, meta["BLOCK_M"]) * cdiv(b.shape[1], meta["BLOCK_N"])
        _gated_matmul_kernel[(min(tiles, programs),)](*args, **flags, **gating, **config.all_kwargs())
