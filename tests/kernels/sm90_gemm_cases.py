"""The GEMM-family cases of tests/kernels/sm90_compile.py: the experts' grouped GEMM and the gated GEMM (each a
name, a kernel, its pointer types, constants, float and non-specialised arguments, warps, stages, and a record)."""

from __future__ import annotations

import importlib


def _tile_bytes(dtype, BLOCK_M, BLOCK_N, BLOCK_K):
    """Shared memory one pipeline stage of a GEMM tile holds: an A block and a B block."""
    size = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8e4nv": 1, "fp8e5": 1}[dtype]
    return (BLOCK_M * BLOCK_K + BLOCK_K * BLOCK_N) * size


def grouped_matmul_cases():
    """Every autotuner configuration of the experts' grouped GEMM (bf16): the forward with ``b`` a transposed
    view of ``[X, N, K]`` weights (unit stride along K), and the weight gradient ``a_eᵀ · g_e`` (its own list)."""
    gm = importlib.import_module("tessel.kernels.grouped_matmul")
    flags = dict(DOT_FP32=False, INPUT_PRECISION="tf32", SCALED=False, SPLIT_ACC=False)
    scales = {"a_scale_ptr": "fp32", "b_scale_ptr": "fp32", "g_scale_ptr": "fp32"}
    cases = []
    wgrad_only = [c for c in gm._WGRAD_CONFIGS if c not in gm._FORWARD_CONFIGS]
    for config in gm._FORWARD_CONFIGS + wgrad_only:
        tile = {k: config.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
        label = "x".join(str(v) for v in tile.values()) + f" w{config.num_warps} s{config.num_stages}"
        meta = {"dtype": "bf16", "stages": config.num_stages, "tile_bytes": _tile_bytes("bf16", **tile)}
        if config in gm._FORWARD_CONFIGS:
            cases.append((
                f"grouped matmul bf16 {label}", gm._grouped_kernel,
                {"a_ptr": "bf16", "b_ptr": "bf16", "out_ptr": "bf16", "offsets_ptr": "i64", **scales},
                {**flags, **tile, "BLOCK_X": 64, "GROUP_M": 8, "stride_ak": 1, "stride_bk": 1, "stride_on": 1}, (), (),
                config.num_warps, config.num_stages, {**meta, "kernel": "grouped matmul"},
            ))  # fmt: skip
        if config in gm._WGRAD_CONFIGS:
            cases.append((
                f"grouped matmul wgrad bf16 {label}", gm._grouped_wgrad_kernel,
                {"a_ptr": "bf16", "g_ptr": "bf16", "out_ptr": "bf16", "offsets_ptr": "i64", **scales},
                {**flags, **tile, "GROUP_M": 8, "ALIGN_ROWS": False, "stride_ak": 1, "stride_gn": 1,
                 "stride_on": 1}, (), (), config.num_warps, config.num_stages, {**meta,
                "kernel": "grouped matmul wgrad",  # its rows are the reduction: tile bytes with BLOCK_M as K
                "tile_bytes": _tile_bytes("bf16", tile["BLOCK_K"], tile["BLOCK_N"], tile["BLOCK_M"])},
            ))  # fmt: skip
    # fp8 (the largest tile): the forward's operands K-major; the backward's, split-accumulated, read along tokens
    # (the weight gradient's operands are transposed copies, unit stride along the rows).
    config = gm._CONFIGS[0]
    tile = {k: config.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
    fp8 = {**flags, **tile, "SCALED": True}
    meta = {"dtype": "fp8e4nv", "stages": config.num_stages, "tile_bytes": _tile_bytes("fp8e4nv", **tile)}
    cases.append((
        "grouped matmul fp8", gm._grouped_kernel,
        {"a_ptr": "fp8e4nv", "b_ptr": "fp8e4nv", "out_ptr": "bf16", "offsets_ptr": "i64", **scales},
        {**fp8, "BLOCK_X": 64, "GROUP_M": 8, "stride_ak": 1, "stride_bk": 1, "stride_on": 1}, (), (),
        config.num_warps, config.num_stages, {**meta, "kernel": "grouped matmul"},
    ))  # fmt: skip
    cases.append((
        "grouped matmul wgrad fp8 split-acc", gm._grouped_wgrad_kernel,
        {"a_ptr": "fp8e5", "g_ptr": "fp8e4nv", "out_ptr": "bf16", "offsets_ptr": "i64", **scales},
        {**fp8, "SPLIT_ACC": True, "GROUP_M": 8, "ALIGN_ROWS": True, "stride_am": 1, "stride_gm": 1,
         "stride_on": 1}, (), (), config.num_warps, config.num_stages, {**meta, "kernel": "grouped matmul wgrad",
         "tile_bytes": _tile_bytes("fp8e4nv", tile["BLOCK_K"], tile["BLOCK_N"], tile["BLOCK_M"])},
    ))  # fmt: skip
    return cases


def gated_matmul_cases():
    """The one-launch GEMM over arriving chunks: pointers, descriptors, signalling, pushing (bf16); fp8 pushing."""
    gm = importlib.import_module("tessel.kernels.gated_matmul")
    flags = dict(HAS_BIAS=True, ACTIVATION="none", ACCUMULATE=False, DOT_FP32=False, INPUT_PRECISION="tf32",
                 INDEX_64=False, BLOCK_M=128, GROUP_M=8, stride_ak=1, stride_on=1, PUSH_ALIGN=8)  # fmt: skip
    ptrs = {**{f"{n}_ptr": "i32" for n in ("ready", "done", "count")}, "table_ptr": "i64", "out_ptr": "bf16",
            "bias_ptr": "bf16", "a_scale_ptr": "fp32", "b_scale_ptr": "fp32"}  # fmt: skip
    cases = []  # fp8: e5m2 · e4m3 (a backward's dX), 128x128x128 tiles, products summed per K block
    for tma, signal, push, fp8 in ((0, 0, 0, 0), (1, 0, 0, 0), (0, 1, 0, 0), (0, 1, 1, 0), (0, 1, 1, 1)):
        a, b, bn, bk = ("fp8e5", "fp8e4nv", 128, 128) if fp8 else ("bf16", "bf16", 256, 64)
        name = f"gated matmul {'fp8' if fp8 else 'bf16'} 128x{bn}x{bk}" + " tma B_T" * tma + " signal" * signal
        constants = {**flags, "TMA": bool(tma), "B_T": bool(tma or fp8), "stride_bk" if tma or fp8 else "stride_bn": 1,
                     "WAIT": not push, "SIGNAL": bool(signal), "PUSH": bool(push), "SCALED": bool(fp8),
                     "SPLIT_ACC": bool(fp8), "BLOCK_N": bn, "BLOCK_K": bk}  # fmt: skip
        cases.append((name + " push" * push, gm._gated_matmul_kernel, {**ptrs, "a_ptr": a, "b_ptr": b}, constants, (),
                      ("FIRST", "STEP", "CHUNKS", "EPOCH"), 8, 3, {"kernel": "gated matmul", "dtype": a, "stages": 3,
                      "tile_bytes": _tile_bytes(a, 128, bn, bk)}))  # fmt: skip
    return cases
