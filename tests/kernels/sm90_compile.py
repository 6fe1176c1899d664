"""Compile every tessel kernel for Hopper (sm_90) with Triton's real compiler; no GPU needed.

Run as a script (``python tests/kernels/sm90_compile.py``) in a process where ``TRITON_INTERPRET`` is
unset: it prints one JSON object per compiled case with the shared memory the program needs and
counts of the PTX instructions that show how it runs (wgmma: Hopper's tensor cores; mma.sync: the
older tensor-core instruction, for tiles too small for wgmma; cp.async: software-pipelined copies;
cp.async.bulk.tensor: TMA copies). Each case specialises its arguments
the way a launch on real tensors does (pointers and sizes divisible by 16, unit strides as constants),
because that decides whether loads can be vectorised and pipelined.

``tests/kernels/test_sm90_compile.py`` runs it and checks the results.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import io
import itertools
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget

try:  # imported as tests.kernels.sm90_compile
    from .sm90_gemm_cases import _tile_bytes, gated_matmul_cases, grouped_matmul_cases
except ImportError:  # run as a script: its folder is on the path
    from sm90_gemm_cases import _tile_bytes, gated_matmul_cases, grouped_matmul_cases

TARGET = GPUTarget("cuda", 90, 32)
knobs.nvidia.dump_ptxas_log = True  # the compiles below print ptxas' report; compile_case reads it
PTX_COUNTS = {
    "wgmma": "wgmma.mma_async",
    "mma": "mma.sync",  # Ampere-style tensor-core instruction: tiles too small for a warpgroup
    "cp_async": "cp.async.c",  # cp.async.ca / cp.async.cg
    "tma": "cp.async.bulk.tensor",
}
# Global atomics in the SASS: REDG (fire-and-forget reductions) and ATOMG (atomics that return the old value).
# Triton 3.6 writes a relaxed atomic add whose result is unused as PTX ``atom``, which ptxas turns into REDG.
SASS_ATOMICS = {"red": re.compile(r"\bREDG?\.E\."), "atom": re.compile(r"\bATOMG?\.E\.")}
# Instructions at the start of a line, predicated or not ("red.global" alone would also match
# "cp.async.cg.shared.global").
PTX_INSTRUCTIONS = {
    "red": re.compile(r"^\s*(?:@!?%p\d+\s+)?red\.", re.M),  # atomic reductions whose result is unused
    "atom": re.compile(r"^\s*(?:@!?%p\d+\s+)?atom\.", re.M),  # atomics that return the old value
    "acquire_load": re.compile(r"^\s*(?:@!?%p\d+\s+)?ld\.[\w.:]*\.acquire\.", re.M),  # waiting for a flag
    # the same, ordered at system scope: after writes by peer GPUs and copy engines too
    "sys_acquire_load": re.compile(r"^\s*(?:@!?%p\d+\s+)?ld\.[\w.:]*\bsys\.acquire\.", re.M),
}


def compile_case(name, fn, ptrs, constants, floats=(), odd=(), num_warps=4, num_stages=3, **meta):
    """Compile ``fn`` (a JITFunction) for sm_90.

    ptrs: pointer argument -> element type ("bf16", "fp32", ...). constants: constexpr values and
    arguments specialised to constants (unit strides). floats: fp32 scalar arguments. odd: integer
    arguments not divisible by 16. Every other argument is an i32 divisible by 16.
    """
    signature, attrs = {}, {}
    for i, param in enumerate(fn.params):
        arg = param.name
        if arg in constants or param.is_constexpr:
            signature[arg] = "constexpr"
        elif arg in ptrs:
            signature[arg] = "*" + ptrs[arg]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg in floats:
            signature[arg] = "fp32"
        else:
            signature[arg] = "i32"
            if arg not in odd:
                attrs[(i,)] = [["tt.divisibility", 16]]
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in constants]
    if missing:
        raise ValueError(f"{name}: constexpr arguments without a value: {missing}")
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    start = time.perf_counter()
    log = io.StringIO()  # Triton prints the report of the ptxas it runs (knobs.nvidia.dump_ptxas_log)
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(source, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = kernel.asm["ptx"]
    usage = resource_usage(ptx, log.getvalue())
    # False: no test weighs this program's loop spills or atomics, skip the disassembly
    wanted = meta.pop("sass", True)
    # Local-memory loads and stores (LDL/STL) need a stack frame: without one the loops hold none to count. The
    # atomic dQ's reductions are counted in the SASS whatever its frame.
    local = usage["stack_bytes"] > 0
    sass = disassemble(kernel.asm["cubin"]) if wanted and (local or constants.get("ATOMIC_DQ")) else None
    return {
        "name": name,
        "ok": True,
        "seconds": round(time.perf_counter() - start, 2),
        "shared": kernel.metadata.shared,
        **{key: ptx.count(pattern) for key, pattern in PTX_COUNTS.items()},
        **{key: len(pattern.findall(ptx)) for key, pattern in PTX_INSTRUCTIONS.items()},
        **usage,
        "loop_local_ops": loop_local_ops(sass) if sass is not None else (0 if wanted and not local else None),
        **{f"sass_{k}": None if sass is None else len(p.findall(sass)) for k, p in SASS_ATOMICS.items()},
        "num_warps": num_warps,
        "num_stages": num_stages,
        **meta,
    }


def resource_usage(ptx: str, report: str = "") -> dict:
    """Registers per thread and bytes spilled to local memory, from the report of the ptxas that built the
    program: ``report`` when Triton printed it (a compile, not a cache hit), else from running Triton's
    ptxas again with the options Triton passes it (line info and register allocation change the numbers)."""
    if "Used" not in report:
        report = _ptxas_report(ptx)
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    stack = re.search(r"(\d+) bytes stack frame", report)
    if registers is None or spills is None or stack is None:
        raise RuntimeError(f"unexpected ptxas report: {report[-500:]}")
    return {
        "registers": int(registers.group(1)),
        "spill_bytes": int(spills.group(1)),
        "stack_bytes": int(stack.group(1)),  # local memory per thread: spilled registers and local arrays
        # ptxas' C7510-C7512 warnings: the warpgroup MMAs wait for one another (too few registers to keep
        # several in flight, or an operand it cannot pipeline), which costs Hopper most of its MMA rate.
        "wgmma_serialized": "wgmma.mma_async instructions are serialized" in report,
    }


def _ptxas_report(ptx: str) -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as source:
        source.write(ptx)
        source.flush()
        options = ["-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name=sm_{TARGET.arch}a"]
        proc = subprocess.run([get_ptxas(TARGET.arch).path, *options, source.name, "-o", "/dev/null"],
                              capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    return proc.stdout + proc.stderr


_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s*([^;]*);", re.M)
_BACK_BRANCH = re.compile(r"\bBRA\s+0x([0-9a-f]+)")


def disassemble(cubin: bytes) -> str:
    """The program's SASS (the machine code ptxas built), from the cuobjdump Triton ships."""
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as binary:
        binary.write(cubin)
        binary.flush()
        args = [knobs.nvidia.cuobjdump.path, "-sass", binary.name]
        return subprocess.run(args, capture_output=True, text=True, timeout=300, check=True).stdout


def loop_local_ops(sass: str) -> int:
    """Local-memory loads and stores (LDL/STL: spilled registers going out and coming back) in the most
    crowded innermost loop of the program's SASS. Spills outside the loops cost once per program; these
    cost at every step of a main loop. Loops are read from backward branches; innermost ones contain
    no other."""
    code = [(int(addr, 16), op) for addr, op in _SASS_LINE.findall(sass)]
    branches = ((addr, _BACK_BRANCH.search(op)) for addr, op in code)
    loops = [(int(b.group(1), 16), addr) for addr, b in branches if b and int(b.group(1), 16) < addr]
    inner = [(lo, hi) for lo, hi in loops if not any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in loops)]
    counts = [sum(_opcode(op).startswith(("LDL", "STL")) for at, op in code if lo <= at <= hi) for lo, hi in inner]
    return max(counts, default=0)


def _opcode(instruction: str) -> str:
    """'@!P0 LDL.64 R2, [R1+0x8]' -> 'LDL.64'."""
    words = instruction.split()
    return words[1] if words[0].startswith("@") else words[0]


def matmul_cases():
    mm = importlib.import_module("tessel.kernels.matmul")
    fn = mm._matmul_kernel
    flags = dict(
        HAS_BIAS=False, ACTIVATION="none", ACCUMULATE=False, STORE_PREACT=False, DOT_FP32=False,
        INPUT_PRECISION="tf32", INDEX_64=False, GROUP_M=8, SCALED=False, SPLIT_ACC=False,
    )  # fmt: skip
    ptr_names = ("a_ptr", "b_ptr", "out_ptr", "bias_ptr", "preact_ptr")
    fp8 = dict(SCALED=True, BLOCK_K=128)  # b read through its transpose: K-major, as fp8 tensor cores read it
    tile = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64)
    cases = []
    for dtype, persistent, tma, a_t, b_t, extra in [
        ("bf16", False, False, False, False, {}),
        ("bf16", True, False, False, False, {}),
        ("bf16", False, True, False, False, {}),
        ("bf16", True, True, False, False, {}),
        ("bf16", True, True, True, False, {}),  # dB = Aᵀ·dZ
        ("bf16", True, True, False, True, {}),  # dA = dZ·Bᵀ
        ("fp16", False, False, False, False, dict(HAS_BIAS=True, ACTIVATION="gelu", STORE_PREACT=True)),
        ("fp32", True, True, False, False, dict(ACCUMULATE=True, BLOCK_N=128, BLOCK_K=32)),
        ("fp8e4nv", False, False, False, True, fp8),
        ("fp8e4nv", False, False, False, True, dict(fp8, SPLIT_ACC=True, HAS_BIAS=True)),
        ("fp8e5", False, True, False, True, dict(fp8, SPLIT_ACC=True, ACCUMULATE=True)),
        ("fp8e4nv", True, True, False, True, fp8),
    ]:
        # Unit strides are specialised to constants: along K for a, along N for b (or the transposes).
        units = {"stride_am" if a_t else "stride_ak": 1, "stride_bk" if b_t else "stride_bn": 1}
        shape = {**tile, **{k: v for k, v in extra.items() if k.startswith("BLOCK")}}
        constants = {
            **flags, **tile, **extra, **units, "stride_on": 1, "stride_pn": 1,
            "TMA_OK": tma, "A_T": a_t, "B_T": b_t, "PERSISTENT": persistent, "TMA": tma,
        }  # fmt: skip
        variant = "+".join(v for v, on in (("persistent", persistent), ("tma", tma)) if on) or "tiles"
        name = f"matmul {dtype} {variant}" + (" A_T" if a_t else "") + (" B_T" if b_t else "")
        name += " split-acc" if extra.get("SPLIT_ACC") else ""
        ptrs = dict.fromkeys(ptr_names, dtype)
        if extra.get("SCALED"):  # fp8 operands write bf16 and read fp32 scales
            ptrs.update(out_ptr="bf16", bias_ptr="bf16", preact_ptr="bf16", a_scale_ptr="fp32", b_scale_ptr="fp32")
        else:
            ptrs.update(a_scale_ptr=dtype, b_scale_ptr=dtype)
        meta = {
            "kernel": "matmul", "dtype": dtype, "stages": 3, "tile_bytes": _tile_bytes(dtype, **shape),
            "epilogue": bool(extra.get("ACTIVATION", "none") != "none" or extra.get("STORE_PREACT")),
        }  # fmt: skip
        cases.append((name, fn, ptrs, constants, (), (), 8, 3, meta))
    return cases


def _BACKWARD_AND_FORWARD(att):
    """(label, autotuned kernel, constants beyond the configuration) of the one-pass forward and the backward."""
    return (
        ("fwd", att.fwd_kernel_tuned, {}),
        ("dkdv", att.dkdv_kernel_tuned, {"ATOMIC_DQ": False}),
        ("dkdv atomic-dq", att.dkdv_atomic_dq_kernel_tuned, {"ATOMIC_DQ": True}),
        ("dq", att.dq_kernel_tuned, {}),
    )


def _attention_ptrs(fn, dtype: str) -> dict:
    ptrs = {p.name: dtype for p in fn.params if p.name.endswith("_ptr")}
    fp32 = ("lse_ptr", "delta_ptr", "part_out_ptr", "part_lse_ptr", "dq_acc_ptr")
    ptrs.update({n: "fp32" for n in fp32 if n in ptrs})
    ptrs.update({n: "i32" for n in ("seg_q_ptr", "seg_k_ptr") if n in ptrs})
    return ptrs


def attention_cases():
    """Every autotuning configuration of the attention kernels at D=128 with the causal mask (how models train),
    the first and the last without it (the shapes the benchmark measures): forward, split-KV forward (at 16 and 64
    rows), dK/dV, dK/dV with the atomic dQ, and dQ; the split-KV merge and the backward's preprocessing."""
    att = importlib.import_module("tessel.kernels.attention_kernels")
    common = dict(HEAD_DIM=128, DOT_FP32=False, INPUT_PRECISION="tf32", CAUSAL=True, SEGMENTS=False, WINDOWED=False,
                  SOFTCAPPED=False)  # fmt: skip
    odd = ("HQ", "GROUP", "SQ", "SK", "SK_BUCKET", "WINDOW", "OFF")
    cases = []
    for label, tuned, extra in _BACKWARD_AND_FORWARD(att):
        fn = tuned.fn
        ptrs = _attention_ptrs(fn, "bf16")
        floats = _floats(fn)
        for causal, config in [(True, c) for c in tuned.configs] + [(False, c) for c in ends(tuned.configs)]:
            bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
            mask = "causal" if causal else "full"
            name = f"attention {label} bf16 D=128 {mask} {bm}x{bn} w{config.num_warps} s{config.num_stages}"
            meta = {"kernel": f"attention {label}", "dtype": "bf16", "head_dim": 128, "causal": causal}
            constants = {**common, **config.kwargs, **extra, "CAUSAL": causal}
            cases.append((name, fn, ptrs, constants, floats, odd, config.num_warps, config.num_stages, meta))
    split = att.split_kv_kernel_tuned.fn  # decode: 16 rows (one kv head's query heads), or the widest 64
    split_ptrs = _attention_ptrs(split, "bf16")
    for block_m in (16, 64):
        for config in att.split_kv_kernel_tuned.configs:
            bn = config.kwargs["BLOCK_N"]
            cases.append((
                f"attention split-kv bf16 D=128 causal {block_m}x{bn} w{config.num_warps} s{config.num_stages}",
                split, split_ptrs, {**_no_segments(common), **config.kwargs, "BLOCK_M": block_m, "FINAL": False},
                ("qk_scale", "SOFTCAP"), ("HKV", "GROUP", "SQ", "SK", "SK_BUCKET", "NSPLIT"), config.num_warps,
                config.num_stages,
                {"kernel": "attention split-kv", "dtype": "bf16", "head_dim": 128, "causal": True},
            ))  # fmt: skip
    cases.append((
        "attention combine bf16 D=128 64 splits", att._flash_attention_split_kv_combine_kernel,
        {"part_out_ptr": "fp32", "part_lse_ptr": "fp32", "out_ptr": "bf16", "lse_ptr": "fp32"},
        {"HEAD_DIM": 128, "SPLITS": 64}, (), ("HQ", "SQ", "NSPLIT"), 4, 1,
        {"kernel": "attention combine", "dtype": "bf16", "head_dim": 128},
    ))  # fmt: skip
    pre = att._flash_attention_bwd_preprocess_kernel
    cases.append((
        "attention preprocess bf16 D=128", pre,
        {"out_ptr": "bf16", "dout_ptr": "bf16", "dlse_ptr": "fp32", "delta_ptr": "fp32"},
        {"HAS_DLSE": True, "HEAD_DIM": 128, "BLOCK_M": att.PREPROCESS_BLOCK_M}, (), ("HQ", "SQ"), 4, 1,
        {"kernel": "attention preprocess", "dtype": "bf16"},
    ))  # fmt: skip
    return cases


def attention_specialisation_cases():
    """The attention kernels for the other dtypes and head dims a launch can specialise to, in the first and
    the last autotuning configuration (:func:`ends`): fp32 at D=128 (TF32 dots, twice the bytes per tile: the
    case most likely to overflow shared memory or spill), fp16 at D=64 without the mask and bf16 at D=16.
    The autotuner skips a configuration that does not fit, so each (kernel,
    dtype, head dim) needs at least one that does (the test checks)."""
    att = importlib.import_module("tessel.kernels.attention_kernels")
    odd = ("HQ", "HKV", "GROUP", "SQ", "SK", "SK_BUCKET", "NSPLIT")
    kernels = (*_BACKWARD_AND_FORWARD(att), ("split-kv", att.split_kv_kernel_tuned, {"BLOCK_M": 16, "FINAL": False}))
    cases = []
    for dtype, head_dim, causal in (("fp32", 128, True), ("fp16", 64, False), ("bf16", 16, True)):
        common = dict(HEAD_DIM=head_dim, DOT_FP32=False, INPUT_PRECISION="tf32", CAUSAL=causal, SOFTCAPPED=False)
        for label, tuned, extra in kernels:
            fn = tuned.fn
            ptrs = _attention_ptrs(fn, dtype)
            floats = _floats(fn)
            configs = ends(tuned.configs)
            for config in configs:
                blocks = {**config.kwargs, **extra}
                tile = f"{blocks['BLOCK_M']}x{blocks['BLOCK_N']} w{config.num_warps} s{config.num_stages}"
                name = f"attention {label} {dtype} D={head_dim} {'causal' if causal else 'full'} {tile}"
                meta = {"kernel": f"attention {label}", "dtype": dtype, "head_dim": head_dim, "coverage": True,
                        "sass": extra.get("ATOMIC_DQ", False)}  # fmt: skip
                constants = {**common, **blocks}
                if "SEGMENTS" in fn.arg_names:
                    constants["SEGMENTS"] = constants["WINDOWED"] = False
                cases.append((name, fn, ptrs, constants, floats, odd, config.num_warps, config.num_stages, meta))
    return cases


def attention_wide_head_cases():
    """The attention kernels at D=256 (Gemma 2/3; DeepSeek-V3's 192 widened), bf16, causal, in their two smallest
    autotuning configurations: the larger tiles overflow shared memory at this width (the autotuner skips them),
    and some tile of each kernel must fit and keep its main loop (nearly) free of local-memory traffic."""
    return _causal_bf16_cases("", 256, lambda configs: configs[-2:], softcapped=False, meta={"wide": True})


def _causal_bf16_cases(what: str, head_dim: int, pick, softcapped: bool, meta: dict) -> list:
    """The one-pass forward, the backward and the split-KV forward, bf16 and causal at ``head_dim``, in the
    autotuning configurations ``pick(configs)`` chooses; ``what`` joins their names, ``meta`` their records."""
    att = importlib.import_module("tessel.kernels.attention_kernels")
    odd = ("HQ", "HKV", "GROUP", "SQ", "SK", "SK_BUCKET", "WINDOW", "OFF", "NSPLIT")
    kernels = (*_BACKWARD_AND_FORWARD(att), ("split-kv", att.split_kv_kernel_tuned, {"BLOCK_M": 16, "FINAL": False}))
    cases = []
    for label, tuned, extra in kernels:
        fn = tuned.fn
        for config in pick(tuned.configs):
            blocks = {**config.kwargs, **extra}
            tile = f"{blocks['BLOCK_M']}x{blocks['BLOCK_N']} w{config.num_warps} s{config.num_stages}"
            record = {"kernel": f"attention {label}", "dtype": "bf16", "head_dim": head_dim, "coverage": True, **meta}
            if softcapped:  # no test weighs their loops' registers: the SASS only for the atomic dQ's reductions
                record["sass"] = extra.get("ATOMIC_DQ", False)
            constants = dict(HEAD_DIM=head_dim, DOT_FP32=False, INPUT_PRECISION="tf32", CAUSAL=True,
                             SOFTCAPPED=softcapped, **blocks)  # fmt: skip
            if "SEGMENTS" in fn.arg_names:
                constants["SEGMENTS"] = constants["WINDOWED"] = False
            cases.append((f"attention {label}{what} bf16 D={head_dim} causal {tile}", fn, _attention_ptrs(fn, "bf16"),
                          constants, _floats(fn), odd, config.num_warps, config.num_stages, record))  # fmt: skip
    return cases


def ends(configs: list) -> list:
    """The first and the last autotuning configuration (the lists run from the largest tile to the smallest):
    the variants below compile these. Their code is the main loops' (compiled in every causal configuration
    above) plus a feature or another dtype, and whether a tile at either end of the range keeps its registers
    and fits is what the tests ask of them; compiling each in every configuration would double the test's
    minutes."""
    return [configs[0], configs[-1]]


def largest(configs: list) -> list:
    """The first autotuning configuration, the largest tile: the features below (segments, windows, soft-capping)
    add elementwise work to the main loops, the same at every tile; whether it compiles for Hopper, with tensor
    cores and without stray atomics, one tile shows. What the tiles cost in registers is asked of the main loops
    (every causal tile above) and of the dtypes and head dims (:func:`ends`)."""
    return configs[:1]


def _no_segments(constants: dict) -> dict:
    """The constants without those the split-KV kernel lacks (no segments, no window)."""
    return {k: v for k, v in constants.items() if k not in ("SEGMENTS", "WINDOWED")}


def attention_segment_cases():
    """The one-pass forward and the backward with segment_ids (packed documents), bf16 at D=128: causal (how
    packed documents train) and without the mask, in the first autotuning configuration (:func:`largest`):
    they compile and use tensor cores, and only the atomic dQ uses atomics."""
    att = importlib.import_module("tessel.kernels.attention_kernels")
    odd = ("HQ", "GROUP", "SQ", "SK", "SK_BUCKET", "OFF")
    cases = []
    for label, tuned, extra in _BACKWARD_AND_FORWARD(att):
        fn = tuned.fn
        floats = _floats(fn)
        for causal, config in itertools.product((True, False), largest(tuned.configs)):
            bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
            mask = "causal" if causal else "full"
            name = f"attention {label} segments bf16 D=128 {mask} {bm}x{bn} w{config.num_warps} s{config.num_stages}"
            meta = {"kernel": f"attention {label}", "dtype": "bf16", "head_dim": 128, "causal": causal,
                    "segments": True, "coverage": True, "sass": extra.get("ATOMIC_DQ", False)}  # fmt: skip
            constants = dict(HEAD_DIM=128, DOT_FP32=False, INPUT_PRECISION="tf32", CAUSAL=causal, SEGMENTS=True,
                             WINDOWED=False, SOFTCAPPED=False, **config.kwargs, **extra)  # fmt: skip
            cases.append((name, fn, _attention_ptrs(fn, "bf16"), constants, floats, odd, config.num_warps,
                          config.num_stages, meta))  # fmt: skip
    return cases


def _floats(fn) -> tuple[str, ...]:
    """The fp32 scalar arguments of an attention kernel."""
    return tuple(n for n in ("qk_scale", "scale", "SOFTCAP") if n in fn.arg_names)


def attention_softcap_cases():
    """The one-pass forward, the backward and the split-KV forward with soft-capped logits (Gemma 2), bf16 at
    D=128, causal, in the first autotuning configuration (:func:`largest`)."""
    return _causal_bf16_cases(" softcap", 128, largest, softcapped=True, meta={"causal": True, "softcap": True})


def attention_window_cases():
    """The one-pass forward and the backward with a causal window (sliding-window attention), bf16 at D=128,
    in the first autotuning configuration (:func:`largest`)."""
    att = importlib.import_module("tessel.kernels.attention_kernels")
    odd = ("HQ", "GROUP", "SQ", "SK", "SK_BUCKET", "WINDOW", "OFF")
    cases = []
    for label, tuned, extra in _BACKWARD_AND_FORWARD(att):
        fn = tuned.fn
        floats = _floats(fn)
        for config in largest(tuned.configs):
            bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
            name = f"attention {label} window bf16 D=128 causal {bm}x{bn} w{config.num_warps} s{config.num_stages}"
            meta = {"kernel": f"attention {label}", "dtype": "bf16", "head_dim": 128, "causal": True,
                    "window": True, "coverage": True, "sass": extra.get("ATOMIC_DQ", False)}  # fmt: skip
            constants = dict(HEAD_DIM=128, DOT_FP32=False, INPUT_PRECISION="tf32", CAUSAL=True, SEGMENTS=False,
                             WINDOWED=True, SOFTCAPPED=False, **config.kwargs, **extra)  # fmt: skip
            cases.append((name, fn, _attention_ptrs(fn, "bf16"), constants, floats, odd, config.num_warps,
                          config.num_stages, meta))  # fmt: skip
    return cases


def adam_cases():
    adam = importlib.import_module("tessel.kernels.adam")
    block, warps = adam._CUDA_BLOCKS["adam"]
    step = adam._adam_step_kernel
    ptrs = {
        "param_ptr": "fp32", "grad_ptr": "bf16", "exp_avg_ptr": "fp32", "exp_avg_sq_ptr": "fp32",
        "param_copy_ptr": "bf16", "grad_scale_ptr": "fp32", "found_inf_ptr": "fp32",
    }  # fmt: skip
    floats = ("decay", "beta1", "beta2", "step_size", "bias_correction2_sqrt", "eps")
    constants = dict(HAS_GRAD_SCALE=True, HAS_FOUND_INF=True, HAS_PARAM_COPY=True, BF16_COPY_BY_BITS=False, BLOCK=block)
    stats_block, stats_warps = adam._CUDA_BLOCKS["stats"]
    return [
        ("adam step bf16 grad", step, ptrs, constants, floats, (), warps, 1, {"kernel": "adam", "dtype": "bf16"}),
        (
            "adam grad stats bf16", adam._grad_stats_kernel, {"grad_ptr": "bf16", "partials_ptr": "fp32"},
            {"FP32_MAX": adam._FP32_MAX, "BLOCK": stats_block}, (), (), stats_warps, 1,
            {"kernel": "adam stats", "dtype": "bf16"},
        ),
    ]  # fmt: skip


def fp8_quantize_cases():
    fp8 = importlib.import_module("tessel.kernels.fp8")
    block_m, block_n = fp8._BLOCKS["triton"]
    cases = []
    for fmt, source, dtype in (("e4m3", "bf16", "fp8e4nv"), ("e5m2", "fp32", "fp8e5")):
        ptrs = {"x_ptr": source, "amax_ptr": "fp32", "q_ptr": dtype, "qt_ptr": dtype, "scale_inv_ptr": "fp32"}
        constants = {
            "FP8_MAX": fp8._FP8_MAX[fmt], "MANTISSA_BITS": fp8._GRID[fmt][0], "MIN_NORMAL": fp8._GRID[fmt][1],
            "TRANSPOSE": True, "BLOCK_M": block_m, "BLOCK_N": block_n, "stride_xn": 1,
        }  # fmt: skip
        meta = {"kernel": "fp8 quantize", "dtype": source, "sass": False}
        cases.append((f"fp8 quantize {source}->{fmt}", fp8._quantize_kernel, ptrs, constants, (), (), 4, 1, meta))
    return cases


def norm_cases():
    norm = importlib.import_module("tessel.kernels.norm")
    block_h = 4096
    block_rows, warps = norm._launch_config("triton", block_h)
    fwd_ptrs = {
        "x_ptr": "bf16",
        "w_ptr": "bf16",
        "b_ptr": "bf16",
        "y_ptr": "bf16",
        "mean_ptr": "fp32",
        "rstd_ptr": "fp32",
    }
    bwd_ptrs = {
        "x_ptr": "bf16", "w_ptr": "bf16", "dy_ptr": "bf16", "dx_ptr": "bf16", "mean_ptr": "fp32", "rstd_ptr": "fp32",
        "dw_partial_ptr": "fp32", "db_partial_ptr": "fp32",
    }  # fmt: skip
    constants = {"IS_RMS": True, "HAS_BIAS": False, "BLOCK_ROWS": block_rows, "BLOCK_H": block_h}
    units = {"stride_x1": 1}
    return [
        (
            "rmsnorm fwd bf16 H=4096", norm._norm_fwd_kernel, fwd_ptrs, {**constants, **units, "stride_y1": 1},
            ("eps",), (), warps, 1, {"kernel": "norm fwd", "dtype": "bf16"},
        ),
        (
            "rmsnorm bwd bf16 H=4096", norm._norm_bwd_kernel, bwd_ptrs,
            {**constants, **units, "stride_dy1": 1, "stride_dx1": 1}, (), (), warps, 1,
            {"kernel": "norm bwd", "dtype": "bf16"},
        ),
    ]  # fmt: skip


def cross_entropy_cases():
    """The loss's two row passes over bf16 logits, with and without soft-capped logits."""
    ce = importlib.import_module("tessel.kernels.cross_entropy")
    block = ce._BLOCK[importlib.import_module("tessel.kernels._dispatch").Backend.TRITON]
    cases = []
    for capped in (False, True):
        meta = {"dtype": "bf16", "softcapped": capped, "sass": False}
        stats = {"x_ptr": "bf16", "target_ptr": "i64", "lse_ptr": "fp32", "z_ptr": "fp32", "sum_ptr": "fp32"}
        grad = {"x_ptr": "bf16", "g_ptr": "bf16", "lse_ptr": "fp32", "target_ptr": "i64", "a_ptr": "fp32",
                "b_ptr": "fp32", "c_ptr": "fp32"}  # fmt: skip
        constants = {"SOFTCAP": capped, "BLOCK": block}
        cases += [
            (f"cross entropy stats bf16 softcap={capped}", ce._row_stats_kernel, stats, constants, ("cap",), (),
             ce._WARPS, 1, {**meta, "kernel": "cross entropy stats"}),
            (f"cross entropy grad bf16 softcap={capped}", ce._logits_grad_kernel, grad, constants, ("cap",), (),
             ce._WARPS, 1, {**meta, "kernel": "cross entropy grad"}),
        ]  # fmt: skip
    return cases


def all_cases():
    return (matmul_cases() + attention_cases() + attention_specialisation_cases() + attention_wide_head_cases()
            + attention_segment_cases() + attention_window_cases() + attention_softcap_cases() + adam_cases()
            + norm_cases() + grouped_matmul_cases() + fp8_quantize_cases() + gated_matmul_cases()
            + cross_entropy_cases())  # fmt: skip


_CASES = None  # built once per worker process


def compile_indexed(index: int) -> dict:
    """Compile case ``index`` of :func:`all_cases` (in a worker process, which builds the list once)."""
    global _CASES
    _CASES = _CASES or all_cases()
    name, fn, ptrs, constants, floats, odd, warps, stages, meta = _CASES[index]
    try:
        return compile_case(name, fn, ptrs, constants, floats, odd, warps, stages, **meta)
    except Exception as exc:  # every case reports, so one failure does not hide the others
        return {"name": name, "ok": False, "error": "".join(traceback.format_exception(exc))[-3000:]}


def main() -> int:
    """Compile every case on all cores (each compile is single-threaded) and print one JSON line each."""
    count = len(all_cases())
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited Triton state
    with concurrent.futures.ProcessPoolExecutor(max_workers=os.cpu_count() or 1, mp_context=context) as pool:
        records = list(pool.map(compile_indexed, range(count)))
    for record in records:
        if not record["ok"]:
            print(record["error"], file=sys.stderr)
        print(json.dumps(record), flush=True)
    return 1 if any(not r["ok"] for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
