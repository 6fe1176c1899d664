"""GEMM with a fused epilogue that writes into, or accumulates onto, a slice of a larger buffer.

    out[M, N] = (out if accumulate else 0) + activation(a[M, K] @ b[K, N] + bias[N])

``a`` and ``b`` may have any strides (a transposed view is read in place, never copied); products are
accumulated in fp32 whatever the input dtype; the epilogue adds the bias, applies the activation, adds
the previous contents of ``out`` when ``accumulate=True`` and rounds once. ``out`` may be a strided
view into a larger buffer (a row block of a gathered activation, say): only its own elements are
read or written. This is what the chunked communication/GEMM overlap in ``tessel.parallel`` builds
on: each chunk's GEMM writes its rows in place, and a reduce-scatter ring adds the partial received
from its peer in the epilogue.

Legend: ``M`` rows of ``a``/``out``, ``K`` the contracted dimension, ``N`` columns of ``b``/``out``.

The three tiers: ``_matmul_kernel`` (Triton), ``matmul`` (validating launcher, differentiable through
``_MatmulFunction``; the backward launches the same kernel: dA = dZ·Bᵀ, dB = Aᵀ·dZ, dbias = Σ_M dZ,
with dZ = dOut·act'(Z)), and ``matmul_reference`` (plain PyTorch, the definition tests compare to).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from ._dispatch import INTERPRET, Backend, backend_for, cdiv, memory_overlaps, opaque_to_compile, upcast_dot_operands
from ._tuned import launch_tuned
from .matmul_reference import _activation_grad, _reference_into, matmul_reference

__all__ = ["ACTIVATIONS", "matmul", "matmul_reference"]

ACTIVATIONS = (None, "relu", "gelu", "silu")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT32_MAX = 2**31 - 1


# ---- Triton kernel -----------------------------------------------------------------------------------


@triton.jit
def _apply_activation(x, ACTIVATION: tl.constexpr):
    if ACTIVATION == "relu":
        x = tl.maximum(x, 0.0)
    elif ACTIVATION == "gelu":
        # The erf form, as torch.nn.functional.gelu(approximate="none").
        x = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACTIVATION == "silu":
        x = x * tl.sigmoid(x)
    return x


@triton.jit
def _dot(a, b, acc, INPUT_PRECISION: tl.constexpr, SPLIT_ACC: tl.constexpr):
    """``acc + a @ b``. SPLIT_ACC (fp8 operands): sm_90's fp8 tensor cores add products into an accumulator of
    fewer than fp32's bits unless told otherwise; with it each K block's sum is added into the fp32 ``acc``."""
    if SPLIT_ACC:
        return tl.dot(a, b, acc, max_num_imprecise_acc=a.shape[1])
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


@triton.jit
def _matmul_tile(
    tile_id, a_ptr, b_ptr, a_desc, b_desc, a_row0, out_ptr, bias_ptr, preact_ptr, a_scale_ptr, b_scale_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on, stride_pm, stride_pn,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, ACCUMULATE: tl.constexpr, STORE_PREACT: tl.constexpr,
    DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, INDEX_64: tl.constexpr,
    SCALED: tl.constexpr, SPLIT_ACC: tl.constexpr, TMA: tl.constexpr, A_T: tl.constexpr, B_T: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """One BLOCK_M x BLOCK_N tile of out: main loop over K, then the epilogue. ``a_row0``: where a's rows start in
    ``a_desc`` (the pointers start at them)."""
    # Grouped tile order: GROUP_M row-tiles share each column of B while it is hot in L2.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_pid_m = (tile_id // pids_per_group) * GROUP_M
    group_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % pids_per_group) % group_m
    pid_n = (tile_id % pids_per_group) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if INDEX_64:
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:
        # The copy engine zero-fills blocks past every edge, so nothing is masked.
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            off_k = k * BLOCK_K
            if A_T:  # a constexpr branch: only one side is compiled
                a = a_desc.load([off_k, a_row0 + pid_m * BLOCK_M]).T
            else:
                a = a_desc.load([a_row0 + pid_m * BLOCK_M, off_k])
            if B_T:  # noqa: SIM108
                b = b_desc.load([pid_n * BLOCK_N, off_k]).T
            else:
                b = b_desc.load([off_k, pid_n * BLOCK_N])
            if DOT_FP32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = _dot(a, b, acc, INPUT_PRECISION, SPLIT_ACC)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        # Rows/columns past the edge wrap around (their results are never stored), so only K is masked.
        rows_a = offs_m % M
        cols_b = offs_n % N
        a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols_b[None, :] * stride_bn
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            if DOT_FP32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = _dot(a, b, acc, INPUT_PRECISION, SPLIT_ACC)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk

    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SCALED:  # fp8 operands: undo both operands' scaling (each a one-element fp32 tensor)
        acc *= tl.load(a_scale_ptr) * tl.load(b_scale_ptr)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if STORE_PREACT:
        p_ptrs = preact_ptr + offs_m[:, None] * stride_pm + offs_n[None, :] * stride_pn
        tl.store(p_ptrs, acc.to(preact_ptr.dtype.element_ty), mask=mask)
    acc = _apply_activation(acc, ACTIVATION)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def operand_descriptors(
    a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
    TMA: tl.constexpr, A_T: tl.constexpr, B_T: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``(a_desc, b_desc)`` for :func:`_matmul_tile`: with TMA, descriptors of ``a [M, K]`` and ``b [K, N]`` built on
    the device (A_T/B_T: read through the transpose, whose rows are contiguous); otherwise the pointers."""
    if TMA:
        if A_T:
            a_desc = tl.make_tensor_descriptor(
                a_ptr, shape=[K, M], strides=[stride_ak, 1], block_shape=[BLOCK_K, BLOCK_M]
            )
        else:
            a_desc = tl.make_tensor_descriptor(
                a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K]
            )
        if B_T:
            b_desc = tl.make_tensor_descriptor(
                b_ptr, shape=[N, K], strides=[stride_bn, 1], block_shape=[BLOCK_N, BLOCK_K]
            )
        else:
            b_desc = tl.make_tensor_descriptor(
                b_ptr, shape=[K, N], strides=[stride_bk, 1], block_shape=[BLOCK_K, BLOCK_N]
            )
    else:
        a_desc = a_ptr
        b_desc = b_ptr
    return a_desc, b_desc


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, out_ptr, bias_ptr, preact_ptr, a_scale_ptr, b_scale_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on, stride_pm, stride_pn,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, ACCUMULATE: tl.constexpr, STORE_PREACT: tl.constexpr,
    DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, INDEX_64: tl.constexpr,
    SCALED: tl.constexpr, SPLIT_ACC: tl.constexpr, TMA_OK: tl.constexpr, A_T: tl.constexpr, B_T: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """Three variants, picked by the autotuner where each measures fastest:

    - one program per output tile, operands loaded through pointers (any strides);
    - PERSISTENT: one program per SM walks the tiles pid, pid + programs, ... (no tail wave, no
      relaunch cost per tile);
    - TMA: operands copied by the tensor memory accelerator through descriptors built on the device
      (sm_90+, unit stride along one dimension, 16-byte aligned base and leading stride; the host
      says so in TMA_OK). A_T/B_T: a (b) is read through its transpose, whose rows are contiguous.

    The epilogue always stores through pointers, so ``out`` keeps any strides.
    """
    a_desc, b_desc = operand_descriptors(
        a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, TMA, A_T, B_T, BLOCK_M, BLOCK_N, BLOCK_K
    )
    pid = tl.program_id(0)
    if PERSISTENT:
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile_id in range(pid, num_tiles, tl.num_programs(0)):
            _matmul_tile(
                tile_id, a_ptr, b_ptr, a_desc, b_desc, 0, out_ptr, bias_ptr, preact_ptr, a_scale_ptr, b_scale_ptr,
                M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on, stride_pm, stride_pn,
                HAS_BIAS, ACTIVATION, ACCUMULATE, STORE_PREACT, DOT_FP32, INPUT_PRECISION, INDEX_64, SCALED, SPLIT_ACC,
                TMA, A_T, B_T, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
            )  # fmt: skip
    else:
        _matmul_tile(
            pid, a_ptr, b_ptr, a_desc, b_desc, 0, out_ptr, bias_ptr, preact_ptr, a_scale_ptr, b_scale_ptr,
            M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on, stride_pm, stride_pn,
            HAS_BIAS, ACTIVATION, ACCUMULATE, STORE_PREACT, DOT_FP32, INPUT_PRECISION, INDEX_64, SCALED, SPLIT_ACC,
            TMA, A_T, B_T, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
        )  # fmt: skip


# Tile shapes for sm_90 (H100/H200): 128-256 wide tiles, deep software pipelines.
# BLOCK_M, BLOCK_N, BLOCK_K, stages, warps
_TILE_SHAPES = [
    (128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 256, 64, 4, 8), (128, 128, 64, 4, 8), (128, 128, 64, 3, 4),
    (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 256, 32, 4, 4), (128, 128, 32, 4, 4), (64, 64, 64, 5, 4),
    (32, 64, 64, 5, 2),
]  # fmt: skip
# The large tiles again as persistent and TMA programs: where they win is the autotuner's measurement.
_VARIANT_SHAPES = _TILE_SHAPES[:5]
_VARIANTS = [(False, False), (True, False), (False, True), (True, True)]  # (PERSISTENT, TMA)
# For fp8 operands only: K blocks twice as deep, as many bytes per pipeline stage as 16-bit tiles with BLOCK_K 64.
_FP8_SHAPES = [(128, 256, 128, 3, 8), (256, 128, 128, 3, 8), (128, 128, 128, 4, 8), (64, 128, 128, 4, 4)]


def _hopper_configs() -> list[triton.Config]:
    configs = []
    for persistent, tma in _VARIANTS:
        plain = (persistent, tma) == (False, False)
        for bm, bn, bk, s, w in _FP8_SHAPES + _TILE_SHAPES if plain else _FP8_SHAPES[:2] + _VARIANT_SHAPES:
            meta = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "PERSISTENT": persistent, "TMA": tma}
            configs.append(triton.Config(meta, num_stages=s, num_warps=w))
    return configs


# Shared memory one block may use on sm_90 (H100/H200: 227 KiB), when the device does not say.
_SM90_SHARED_BYTES = 232448
# Besides the pipeline's A and B blocks a program holds a few barriers (TMA) and scratch: this much.
_SHARED_SLACK = 1024


def _shared_bytes(meta: dict, num_stages: int, element_size: int) -> int:
    """Shared memory a GEMM program holds: one A block and one B block per pipeline stage (this is
    what the compiler allocates for sm_90; tests/kernels/sm90_compile.py checks it)."""
    return num_stages * (meta["BLOCK_M"] * meta["BLOCK_K"] + meta["BLOCK_K"] * meta["BLOCK_N"]) * element_size


def fits_element(meta: dict, element_size: int) -> bool:
    """Whether a configuration is one for operands of this many bytes (fp8's deep K blocks are for fp8 alone)."""
    return meta["BLOCK_K"] <= 64 or element_size == 1


def _prune_configs(configs, named_args, **kwargs) -> list[triton.Config]:
    """Drop configurations that cannot help: TMA ones the operands cannot use, persistent ones that
    would fill no more than one wave (there they only add a loop), fp8's deep K blocks for wider operands,
    and ones whose pipeline does not fit in shared memory (they would fail to launch after compiling).
    Never drops all of them."""
    args = {**named_args, **kwargs}
    a = args["a_ptr"]
    sms, limit = _num_sms(a.device), _shared_limit(a.device)
    kept = []
    for config in configs:
        meta = config.kwargs
        if meta["TMA"] and not args["TMA_OK"]:
            continue
        tiles = cdiv(args["M"], meta["BLOCK_M"]) * cdiv(args["N"], meta["BLOCK_N"])
        if meta["PERSISTENT"] and tiles <= sms:
            continue
        if not fits_element(meta, a.element_size()):
            continue
        if _shared_bytes(meta, config.num_stages, a.element_size()) + _SHARED_SLACK > limit:
            continue
        kept.append(config)
    return kept or [c for c in configs if not c.kwargs["TMA"] and not c.kwargs["PERSISTENT"]][-1:]


# Everything that changes which configuration is fastest (the operands' dtypes join the key by themselves).
_TUNING_KEY = ["M", "N", "K", "HAS_BIAS", "ACTIVATION", "ACCUMULATE", "STORE_PREACT", "INDEX_64", "SCALED", "SPLIT_ACC",
               "TMA_OK", "A_T", "B_T"]  # fmt: skip
_matmul_kernel_tuned = triton.autotune(
    configs=_hopper_configs(),
    key=_TUNING_KEY,
    prune_configs_by={"early_config_prune": _prune_configs},
    # Tuning launches the kernel once per configuration: with accumulate=True each launch would add
    # onto ``out`` again, so the autotuner restores it between trials.
    restore_value=["out_ptr"],
)(_matmul_kernel)


def describe_program(meta: dict, num_warps: int | None = None, num_stages: int | None = None) -> str:
    """``"128x256x64 persistent+tma w8 s3"``: a program's tile, variant and launch shape."""
    variant = "+".join(name for name in ("persistent", "tma") if meta.get(name.upper())) or "tiles"
    text = f"{meta['BLOCK_M']}x{meta['BLOCK_N']}x{meta['BLOCK_K']} {variant}"
    if num_warps is not None:
        text += f" w{num_warps} s{num_stages}"
    return text


def last_program() -> str | None:
    """The program the autotuner ran for the latest CUDA launch (None before any)."""
    if INTERPRET and _interpreter_program:
        return describe_program(_interpreter_program) + " (interpreter)"
    config = getattr(_matmul_kernel_tuned, "best_config", None)
    if config is None:
        return None
    return describe_program(config.kwargs, config.num_warps, config.num_stages)


# Under the interpreter each block operation costs milliseconds of numpy work, so blocks are small
# enough that tests with odd shapes exercise several tiles, tile groups and K iterations.
_INTERPRETER_BLOCKS = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2}
# The interpreter runs one variant, the plain one unless a test picks another; a persistent launch
# there uses this many programs, fewer than the tiles of most test shapes.
_INTERPRETER_VARIANT = {"PERSISTENT": False, "TMA": False}
_INTERPRETER_PROGRAMS = 3
_interpreter_program: dict = {}


# ---- Host side: validation, dispatch, launch ---------------------------------------------------------


def _check_tensor(name: str, t, ndim: int, fn: str = "matmul") -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, received {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{fn}: {name} must be {ndim}-D, received shape {tuple(t.shape)}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{fn}: {name} must be float32, float16 or bfloat16, received {t.dtype}")


def check_operands_agree(fn: str, a, b) -> None:
    """a [M, K] and b [K, N] share K and a device (ValueError naming both shapes otherwise)."""
    if a.shape[1] != b.shape[0]:
        raise ValueError(
            f"{fn}: inner dimensions differ: a is {tuple(a.shape)} and b is {tuple(b.shape)}; "
            f"expected b.shape[0] == a.shape[1] == {a.shape[1]}"
        )
    if b.device != a.device:
        raise ValueError(f"{fn}: b must be on a's device {a.device}, received {b.device}")


def _validate(a, b, bias, activation, out, accumulate, fn: str = "matmul") -> None:
    """matmul's arguments (and those of the GEMMs that take the same ones: ``fn`` names the caller)."""
    _check_tensor("a", a, 2, fn)
    _check_tensor("b", b, 2, fn)
    check_operands_agree(fn, a, b)
    if b.dtype != a.dtype:
        raise TypeError(f"{fn}: b must have a's dtype {a.dtype}, received {b.dtype}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{fn}: activation must be one of {ACTIVATIONS}, received {activation!r}")
    if not isinstance(accumulate, bool):
        raise TypeError(f"{fn}: accumulate must be a bool, received {type(accumulate).__name__}")
    n = b.shape[1]
    if bias is not None:
        _check_tensor("bias", bias, 1, fn)
        if bias.shape[0] != n or bias.dtype != a.dtype or bias.device != a.device:
            raise ValueError(
                f"{fn}: bias must be a ({n},) {a.dtype} tensor on {a.device}, received "
                f"{tuple(bias.shape)} {bias.dtype} on {bias.device}"
            )
    if out is None:
        if accumulate:
            raise ValueError(f"{fn}: accumulate=True needs out= (the tensor to add onto), received out=None")
        return
    _validate_out(a, b, out, fn)


def _validate_out(a, b, out, fn: str = "matmul") -> None:
    _check_tensor("out", out, 2, fn)
    expected = (a.shape[0], b.shape[1])
    if tuple(out.shape) != expected:
        raise ValueError(f"{fn}: out must have shape {expected}, received {tuple(out.shape)}")
    if out.dtype not in (a.dtype, torch.float32):
        raise TypeError(f"{fn}: out must be {a.dtype} (the inputs' dtype) or float32, received {out.dtype}")
    if out.device != a.device:
        raise ValueError(f"{fn}: out must be on the inputs' device {a.device}, received {out.device}")
    # A graph has no addresses: under compile the node checks the overlap when it runs.
    compiling = torch.compiler.is_compiling()
    check_out_apart(None if compiling else a, None if compiling else b, out, fn)


def check_out_apart(a, b, out, fn: str = "matmul") -> None:
    """``out`` is no broadcast view and shares no memory with ``a`` or ``b`` (None: not checked), which the
    kernel's stores would corrupt."""
    if any(st == 0 and s > 1 for s, st in zip(out.shape, out.stride())):
        raise ValueError(f"{fn}: out must not be a broadcast view (stride 0), received strides {out.stride()}")
    for name, t in (("a", a), ("b", b)):
        if t is not None and memory_overlaps(out, t):
            raise ValueError(f"{fn}: out must not share memory with {name}")


def _input_precision(dtype: torch.dtype, backend: str) -> str:
    # Match torch.matmul on the same machine: TF32 for fp32 only when torch allows it on CUDA.
    if dtype == torch.float32 and (backend != Backend.TRITON or not torch.backends.cuda.matmul.allow_tf32):
        return "ieee"
    return "tf32"


def _needs_int64(*tensors: torch.Tensor) -> bool:
    """Whether an element offset within any operand (2-D) can pass 2**31 - 1 (int32 would wrap)."""
    for t in tensors:  # written out: every launch asks, and a generator per operand costs a microsecond
        (rows, cols), (row_stride, col_stride) = t.shape, t.stride()
        if (rows - 1) * abs(row_stride) + (cols - 1) * abs(col_stride) > _INT32_MAX:
            return True
    return False


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _shared_limit(device: torch.device) -> int:
    if device.type != "cuda":
        return _SM90_SHARED_BYTES
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", _SM90_SHARED_BYTES)


def _tma_layout(t: torch.Tensor) -> bool | None:
    """How the copy engine can read a 2-D operand: False row by row (unit column stride), True
    through its transpose (unit row stride), None not at all. A descriptor needs a 16-byte aligned
    base and a 16-byte multiple leading stride."""
    if t.data_ptr() % 16:
        return None
    (row_stride, col_stride), size = t.stride(), t.element_size()
    if col_stride == 1 and row_stride >= 1 and (row_stride * size) % 16 == 0:
        return False
    if row_stride == 1 and col_stride >= 1 and (col_stride * size) % 16 == 0:
        return True
    return None


def _tma_flags(a: torch.Tensor, b: torch.Tensor, backend: str) -> dict:
    """TMA_OK, A_T, B_T for the launch: TMA needs sm_90+ (the interpreter emulates it)."""
    capable = backend == Backend.INTERPRETER or (
        backend == Backend.TRITON and torch.cuda.get_device_capability(a.device) >= (9, 0)
    )
    a_t, b_t = _tma_layout(a), _tma_layout(b)
    ok = capable and a_t is not None and b_t is not None
    # B_T: b is read through b.t() ([N, K], rows contiguous along K).
    return {"TMA_OK": ok, "A_T": bool(a_t), "B_T": bool(b_t)}


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory for the tensor descriptors that TMA programs build on the device."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_scratch_allocator() -> None:
    """Device-built descriptors need a scratch allocator. Triton keeps it per thread (a context
    variable), and the autograd engine runs backward on its own threads, so this runs before every
    launch and only fills in when nothing (ours or the user's) is set there."""
    try:
        from triton.runtime._allocation import NullAllocator, _allocator
    except ImportError:  # pragma: no cover - an older Triton without descriptors' allocator
        return
    if isinstance(_allocator.get(), NullAllocator):
        triton.set_allocator(_scratch)


@opaque_to_compile
def _launch(a, b, bias, activation, out, accumulate, preact=None, scales=None, split_acc=False) -> None:
    """Run ``out (+)= activation(a @ b + bias)`` on the right backend; optionally store the pre-activation.
    ``scales``: two one-element fp32 tensors multiplying ``a @ b`` (fp8 operands' inverse scales); ``split_acc``:
    fp8 products summed into fp32 once per K block (see ``_dot``)."""
    (m, k), n = a.shape, b.shape[1]
    if m == 0 or n == 0:
        return
    backend = backend_for(a)
    if backend == Backend.REFERENCE:
        _reference_into(a, b, bias, activation, out, accumulate, preact, scales)
        return
    with torch.cuda.device(a.device) if a.is_cuda else contextlib.nullcontext():
        args = (
            a, b, out, bias if bias is not None else out, preact if preact is not None else out,
            *(scales if scales is not None else (out, out)),
            m, n, k, *a.stride(), *b.stride(), *out.stride(), *(preact if preact is not None else out).stride(),
        )  # fmt: skip
        flags = {
            "HAS_BIAS": bias is not None,
            "ACTIVATION": activation or "none",
            "ACCUMULATE": accumulate,
            "STORE_PREACT": preact is not None,
            "DOT_FP32": upcast_dot_operands(backend),
            "INPUT_PRECISION": _input_precision(a.dtype, backend),
            "INDEX_64": _needs_int64(a, b, out, *(() if preact is None else (preact,))),
            "SCALED": scales is not None,
            "SPLIT_ACC": split_acc and backend == Backend.TRITON,
            **_tma_flags(a, b, backend),
        }
        tiles = lambda meta: cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"])
        grid = lambda meta: (min(tiles(meta), _num_sms(a.device)) if meta["PERSISTENT"] else tiles(meta),)
        if backend == Backend.INTERPRETER:
            variant = {**_INTERPRETER_VARIANT, "TMA": _INTERPRETER_VARIANT["TMA"] and flags["TMA_OK"]}
            meta = {**_INTERPRETER_BLOCKS, **variant}
            _matmul_kernel[grid(meta)](*args, **flags, **meta)
            _interpreter_program.update(meta)
        else:
            _ensure_scratch_allocator()
            launch_tuned(_matmul_kernel_tuned, grid, args, flags)


# ---- Autograd ----------------------------------------------------------------------------------------


class _MatmulFunction(torch.autograd.Function):
    @staticmethod
    # ``out`` comes first: when it is a view written in place, autograd's CopySlices routes the
    # gradient of the Function's first input to the view's previous contents.
    def forward(ctx, out, a, b, bias, activation, accumulate):
        if out is None:
            out = torch.empty((a.shape[0], b.shape[1]), device=a.device, dtype=a.dtype)
        else:
            ctx.mark_dirty(out)
        preact = None
        if activation is not None and any(ctx.needs_input_grad[1:4]):
            preact = torch.empty_like(out, memory_format=torch.contiguous_format)
        _launch(a, b, bias, activation, out, accumulate, preact)
        ctx.save_for_backward(a, b, preact)
        ctx.activation, ctx.accumulate, ctx.has_bias = activation, accumulate, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        a, b, preact = ctx.saved_tensors
        if ctx.activation is None:
            grad_z = grad_out.to(a.dtype)
        else:
            grad_z = (grad_out.float() * _activation_grad(preact.float(), ctx.activation)).to(a.dtype)
        need_out, need_a, need_b, need_bias = ctx.needs_input_grad[:4]
        grad_a = grad_b = grad_bias = grad_prev = None
        if need_a:  # dA = dZ · Bᵀ  (Bᵀ is a view: the kernel reads b's strides swapped)
            grad_a = torch.empty_like(a, memory_format=torch.contiguous_format)
            _launch(grad_z, b.t(), None, None, grad_a, False)
        if need_b:  # dB = Aᵀ · dZ
            grad_b = torch.empty_like(b, memory_format=torch.contiguous_format)
            _launch(a.t(), grad_z, None, None, grad_b, False)
        if need_bias and ctx.has_bias:
            grad_bias = grad_z.sum(dim=0, dtype=torch.float32).to(a.dtype)
        if need_out:  # overwritten values get zero gradient (None would cut the rest of out's base off)
            grad_prev = grad_out if ctx.accumulate else torch.zeros_like(grad_out)
        return grad_prev, grad_a, grad_b, grad_bias, None, None


def matmul_unchecked(a, b, bias=None, *, out, accumulate=False) -> None:
    """``out (+)= a @ b + bias`` as :func:`matmul`, without its argument checks and outside autograd: for the steps
    of tessel's rings, whose operands are views of tensors the overlapped op checked once, and whose GEMMs can be
    short enough on a GPU that the checks (tens of microseconds of Python per call) show."""
    _launch(a, b, bias, None, out, accumulate)


def matmul(a, b, bias=None, activation=None, out=None, accumulate=False) -> torch.Tensor:
    """``out (+)= activation(a @ b + bias)`` in one Triton kernel; differentiable.

    Args:
        a: ``[M, K]``, any strides, float32/float16/bfloat16.
        b: ``[K, N]``, any strides, a's dtype and device.
        bias: optional ``[N]``, a's dtype, added in fp32 before the activation.
        activation: ``None``, ``"relu"``, ``"gelu"`` (erf form) or ``"silu"``.
        out: optional ``[M, N]`` tensor of a's dtype (or float32) to write into; it may be a strided
            view of a larger buffer, whose other elements are never touched. It must not overlap a or b.
        accumulate: add the result onto ``out`` (fp32 addition in the epilogue, one rounding).

    Returns:
        ``out`` when given, otherwise a new ``[M, N]`` tensor of a's dtype.

    Backward: dZ = dOut·act'(Z) with Z = a@b + bias saved by the forward kernel (only when an input
    needs a gradient and there is an activation), then dA = dZ·Bᵀ and dB = Aᵀ·dZ through the same
    kernel, dbias = Σ_M dZ; with ``accumulate=True`` the previous contents of ``out`` receive dOut.
    """
    _validate(a, b, bias, activation, out, accumulate)
    tracked = (a, b, bias, out)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tracked)
    if torch.compiler.is_compiling() and (out is None or not grad):  # one graph node each way (see .library)
        if out is None:
            return torch.ops.tessel.matmul(a, b, bias, activation, grad and activation is not None)[0]
        return torch.ops.tessel.matmul_into(a, b, bias, activation, out, accumulate) or out
    if grad:
        return _MatmulFunction.apply(out, a, b, bias, activation, accumulate)
    if out is None:
        out = torch.empty((a.shape[0], b.shape[1]), device=a.device, dtype=a.dtype)
    _launch(a, b, bias, activation, out, accumulate)
    return out
