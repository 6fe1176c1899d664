"""The backward Triton kernels of flash attention: the Δ preprocess, dK/dV (optionally with the atomic dQ), dQ.

Legend, numerics and masks as in :mod:`.attention_kernels` (block sizes and autotuning) and
:mod:`.attention` (the host side); the block ranges come from :mod:`.attention_forward`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attention_forward import (
    _batch_and_head,
    _block_keep,
    _query_block_key_ranges,
    _query_block_segments,
    _segment_ranges,
    _tanh,
    _window_key_ranges,
)

__all__ = [
    "_flash_attention_bwd_dkdv_kernel",
    "_flash_attention_bwd_dq_kernel",
    "_flash_attention_bwd_preprocess_kernel",
]


@triton.jit
def _flash_attention_bwd_preprocess_kernel(
    out_ptr, dout_ptr, dlse_ptr, delta_ptr,
    stride_ob, stride_oh, stride_os, stride_db, stride_dh, stride_ds,
    HQ, SQ,
    HAS_DLSE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Δ = rowsum(dO ∘ O) - dlse: the term dS = P ∘ (dP - Δ) subtracts in every block of the backward."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b, off_h = _batch_and_head(pid_bh, HQ)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < SQ
    o = tl.load(
        out_ptr + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    do = tl.load(
        dout_ptr + off_b * stride_db + off_h * stride_dh + offs_m[:, None] * stride_ds + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row_base = pid_bh.to(tl.int64) * SQ
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + row_base + offs_m, mask=row_ok, other=0.0)
    tl.store(delta_ptr + row_base + offs_m, delta, mask=row_ok)


@triton.jit
def _load_rows(ptr, offs, offs_d, stride, ok, DOT_FP32: tl.constexpr):
    """Rows ``offs`` (those with ``ok``; zeros elsewhere) of a head's ``[rows, HEAD_DIM]`` block at ``ptr``,
    widened to fp32 for the interpreter's dots under DOT_FP32."""
    x = tl.load(ptr + offs[:, None] * stride + offs_d[None, :], mask=ok[:, None], other=0.0)
    if DOT_FP32:
        x = x.to(tl.float32)
    return x


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, dq_acc_ptr, stride_qs, stride_ds, offs_n, col_ok, offs_d, SQ,
    OFF, qk_scale, SOFTCAP, lo, hi, seg_k, seg_ptr, WINDOW,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr, WINDOWED: tl.constexpr,
    SOFTCAPPED: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
):  # fmt: skip
    """dK, dV of one key block from the query blocks starting in [lo, hi), in transposed form (Sᵀ, Pᵀ).

    ATOMIC_DQ: also add this key block's share of dQ, dS·K (unscaled), onto the fp32 accumulator
    dq_acc_ptr ([SQ, HEAD_DIM], contiguous) with atomic adds, reusing dS instead of recomputing it.
    """
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        qT_ptrs = q_ptr + offs_m[None, :] * stride_qs + offs_d[:, None]
        do_ptrs = do_ptr + offs_m[:, None] * stride_ds + offs_d[None, :]
        row_ok = offs_m < SQ
        if MASK:
            qT = tl.load(qT_ptrs, mask=row_ok[None, :], other=0.0)
            do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
            lse = tl.load(lse_ptr + offs_m, mask=row_ok, other=0.0)
            delta = tl.load(delta_ptr + offs_m, mask=row_ok, other=0.0)
        else:
            qT = tl.load(qT_ptrs)
            do = tl.load(do_ptrs)
            lse = tl.load(lse_ptr + offs_m)
            delta = tl.load(delta_ptr + offs_m)
        if DOT_FP32:
            qT = qT.to(tl.float32)
            do = do.to(tl.float32)
        qkT = tl.dot(k, qT, input_precision=INPUT_PRECISION)
        if SOFTCAPPED:  # the capped logits c·tanh(s/c), and tanh kept for the chain rule below
            thT = _tanh(qkT * qk_scale / SOFTCAP)
            pT = tl.math.exp2(SOFTCAP * thT - (lse * 1.4426950408889634)[None, :])
        else:
            pT = tl.math.exp2(qkT * qk_scale - (lse * 1.4426950408889634)[None, :])
        if MASK:  # rows that see no key (lse = -inf, so pT = +inf) are among the masked ones
            # the key tail too: with OFF > SK - SQ a row's window can reach past the last key, and the zero
            # keys there would give such a row pT = +inf, dSᵀ = NaN and (ATOMIC_DQ) a NaN dQ
            keep = row_ok[None, :] & col_ok[:, None]
            if CAUSAL:
                keep = keep & (offs_m[None, :] + OFF >= offs_n[:, None])
            if WINDOWED:
                keep = keep & (offs_m[None, :] + OFF - offs_n[:, None] < WINDOW)
            if SEGMENTS:
                seg_q = tl.load(seg_ptr + offs_m, mask=row_ok, other=-2)
                keep = keep & (seg_k[:, None] == seg_q[None, :])
            pT = tl.where(keep, pT, 0.0)
        dpT = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        dsT = pT * (dpT - delta[None, :])  # dSᵀ = Pᵀ ∘ (dPᵀ - Δ); scale is applied once at the end
        if SOFTCAPPED:  # through the cap: d(c·tanh(s/c))/ds = 1 - tanh²
            dsT = dsT * (1.0 - thT * thT)
        # Pᵀ and dSᵀ are rounded to the input dtype for the tensor cores (and back to fp32 for the
        # interpreter's dots), as in FlashAttention-2.
        pT = pT.to(q_ptr.dtype.element_ty)
        dsT = dsT.to(q_ptr.dtype.element_ty)
        if DOT_FP32:
            pT = pT.to(tl.float32)
            dsT = dsT.to(tl.float32)
        dv = tl.dot(pT, do, dv, input_precision=INPUT_PRECISION)  # dV += Pᵀ dO
        dk = tl.dot(dsT, tl.trans(qT), dk, input_precision=INPUT_PRECISION)  # dK += dSᵀ Q
        if ATOMIC_DQ:
            dq = tl.dot(tl.trans(dsT), k, input_precision=INPUT_PRECISION)  # dQ += dS K, from every key block
            dq_ptrs = dq_acc_ptr + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
            if MASK:
                tl.atomic_add(dq_ptrs, dq, mask=row_ok[:, None], sem="relaxed")
            else:
                tl.atomic_add(dq_ptrs, dq, sem="relaxed")
    return dk, dv


@triton.jit
def _flash_attention_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dq_acc_ptr, seg_q_ptr, seg_k_ptr,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_db, stride_dh, stride_ds, stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs,
    HQ, GROUP, SQ, SK, SK_BUCKET, qk_scale, scale, SOFTCAP, WINDOW, OFF,
    CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAPPED: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """SK_BUCKET is read by the autotuner only (see _TUNE). OFF, SEGMENTS, WINDOWED and SOFTCAPPED as in the
    forward kernel.

    ATOMIC_DQ: the one-kernel backward. dQ (unscaled, fp32, [B, HQ, SQ, HEAD_DIM] contiguous and zeroed
    by the caller) is accumulated into dq_acc_ptr with atomic adds as each key block's dS is formed,
    so the backward runs five GEMMs per block pair instead of seven (the dQ kernel recomputes QKᵀ
    and dO·Vᵀ), at the price of fp32 atomic traffic and a summation order that varies from run to run.
    Otherwise dq_acc_ptr is never read."""
    pid_n = tl.program_id(0)
    hkv = HQ // GROUP
    off_b, off_hkv = _batch_and_head(tl.program_id(1), hkv)  # the grid's second axis: batch · kv head
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < SK
    k = _load_rows(k_ptr + off_b * stride_kb + off_hkv * stride_kh, offs_n, offs_d, stride_ks, col_ok, DOT_FP32)
    v = _load_rows(v_ptr + off_b * stride_vb + off_hkv * stride_vh, offs_n, offs_d, stride_vs, col_ok, DOT_FP32)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    if CAUSAL:
        # Query rows below start_n - OFF see none of these keys: skipped. Rows from start_n + BLOCK_N - 1 - OFF
        # on see all of them: no mask. Both edges rounded outwards to query-block edges; with OFF = 0 and
        # BLOCK_N a multiple of BLOCK_M they are start_n and start_n + BLOCK_N, the square case's diagonal.
        diag_lo = (tl.maximum(start_n - OFF, 0) // BLOCK_M) * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - OFF, 0), BLOCK_M) * BLOCK_M
        diag_hi = tl.minimum(full_lo, SQ)
        full_hi = tl.maximum(full_lo, (SQ // BLOCK_M) * BLOCK_M)
    else:
        diag_lo = 0
        diag_hi = 0
        full_lo = 0
        full_hi = (SQ // BLOCK_M) * BLOCK_M
    q_stop = SQ
    seg_k = 0
    if SEGMENTS:  # the query blocks of the key block's segments only (see _segment_ranges)
        seg_q_ptr += off_b * 3 * SQ
        seg_k_ptr += off_b * 3 * SK
        seg_k = tl.load(seg_k_ptr + offs_n, mask=col_ok, other=-1)
        q_lo = tl.load(seg_k_ptr + SK + start_n)  # the first query of the block's first segment
        if CAUSAL:  # rows below start_n - OFF see none of these keys, rows from full_lo on all of them
            q_lo = tl.maximum(q_lo, start_n - OFF)
        diag_lo, full_lo, full_hi, q_stop = _segment_ranges(
            seg_k_ptr, SK, start_n, tl.minimum(start_n + BLOCK_N, SK) - 1, q_lo, full_lo, SQ, SQ, BLOCK_M
        )
        diag_hi = full_lo
    if WINDOWED:  # queries from start_n - OFF + WINDOW on miss the block's first key; from q_stop on, all its keys
        full_hi = tl.maximum(tl.minimum(full_hi, (tl.maximum(start_n - OFF + WINDOW, 0) // BLOCK_M) * BLOCK_M), full_lo)
        q_stop = tl.minimum(q_stop, tl.maximum(start_n + BLOCK_N - 1 - OFF + WINDOW, 0))
    # Key rows past SK hold zeros; their dK/dV rows are computed but never stored.
    for g in range(GROUP):  # the query heads sharing this kv head, summed in registers
        off_h = off_hkv * GROUP + g
        q_head = q_ptr + off_b * stride_qb + off_h * stride_qh
        do_head = do_ptr + off_b * stride_db + off_h * stride_dh
        lse_head = lse_ptr + (off_b * HQ + off_h) * SQ
        delta_head = delta_ptr + (off_b * HQ + off_h) * SQ
        dq_head = dq_acc_ptr + (off_b * HQ + off_h) * SQ * HEAD_DIM
        # the query blocks crossing the diagonal band (none without a causal mask)
        dk, dv = _bwd_dkdv_inner(
            dk, dv, k, v, q_head, do_head, lse_head, delta_head, dq_head, stride_qs, stride_ds, offs_n, col_ok,
            offs_d, SQ, OFF, qk_scale, SOFTCAP, diag_lo, diag_hi, seg_k, seg_q_ptr, WINDOW, True, CAUSAL, SEGMENTS,
            WINDOWED, SOFTCAPPED, DOT_FP32, INPUT_PRECISION, ATOMIC_DQ, HEAD_DIM, BLOCK_M,
        )  # fmt: skip
        # the query blocks that see the whole key block
        dk, dv = _bwd_dkdv_inner(
            dk, dv, k, v, q_head, do_head, lse_head, delta_head, dq_head, stride_qs, stride_ds, offs_n, col_ok,
            offs_d, SQ, OFF, qk_scale, SOFTCAP, full_lo, full_hi, seg_k, seg_q_ptr, WINDOW, False, CAUSAL, SEGMENTS,
            WINDOWED, SOFTCAPPED, DOT_FP32, INPUT_PRECISION, ATOMIC_DQ, HEAD_DIM, BLOCK_M,
        )  # fmt: skip
        # the query block holding the query tail (SEGMENTS: the blocks up to the last segment's end)
        dk, dv = _bwd_dkdv_inner(
            dk, dv, k, v, q_head, do_head, lse_head, delta_head, dq_head, stride_qs, stride_ds, offs_n, col_ok,
            offs_d, SQ, OFF, qk_scale, SOFTCAP, full_hi, q_stop, seg_k, seg_q_ptr, WINDOW, True, CAUSAL, SEGMENTS,
            WINDOWED, SOFTCAPPED, DOT_FP32, INPUT_PRECISION, ATOMIC_DQ, HEAD_DIM, BLOCK_M,
        )  # fmt: skip
    dk = dk * scale  # S = scale·QKᵀ, so dK = scale·dSᵀQ
    tl.store(
        dk_ptr + off_b * stride_dkb + off_hkv * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :],
        dk.to(dk_ptr.dtype.element_ty),
        mask=col_ok[:, None],
    )
    tl.store(
        dv_ptr + off_b * stride_dvb + off_hkv * stride_dvh + offs_n[:, None] * stride_dvs + offs_d[None, :],
        dv.to(dv_ptr.dtype.element_ty),
        mask=col_ok[:, None],
    )


@triton.jit
def _bwd_dq_inner(
    dq, q, do, lse, delta, k_ptr, v_ptr, stride_ks, stride_vs, offs_m, offs_d, SK, OFF, qk_scale, SOFTCAP, lo, hi,
    seg_q, seg_ptr, WINDOW, MASK: tl.constexpr, CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAPPED: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dQ of one query block from the key blocks starting in [lo, hi)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kT_ptrs = k_ptr + cols[None, :] * stride_ks + offs_d[:, None]
        vT_ptrs = v_ptr + cols[None, :] * stride_vs + offs_d[:, None]
        if MASK:
            kT = tl.load(kT_ptrs, mask=cols[None, :] < SK, other=0.0)
            vT = tl.load(vT_ptrs, mask=cols[None, :] < SK, other=0.0)
        else:
            kT = tl.load(kT_ptrs)
            vT = tl.load(vT_ptrs)
        if DOT_FP32:
            kT = kT.to(tl.float32)
            vT = vT.to(tl.float32)
        qk = tl.dot(q, kT, input_precision=INPUT_PRECISION)
        if SOFTCAPPED:
            th = _tanh(qk * qk_scale / SOFTCAP)
            p = tl.math.exp2(SOFTCAP * th - lse[:, None])
        else:
            p = tl.math.exp2(qk * qk_scale - lse[:, None])
        if MASK:  # rows that see no key (lse = -inf, so p = +inf) are among the masked ones
            p = tl.where(_block_keep(offs_m, cols, SK, OFF, seg_q, seg_ptr, WINDOW, CAUSAL, SEGMENTS, WINDOWED), p, 0.0)
        dp = tl.dot(do, vT, input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        if SOFTCAPPED:
            ds = ds * (1.0 - th * th)
        ds = ds.to(k_ptr.dtype.element_ty)  # rounded for the tensor cores
        if DOT_FP32:
            ds = ds.to(tl.float32)
        dq = tl.dot(ds, tl.trans(kT), dq, input_precision=INPUT_PRECISION)  # dQ += dS K
    return dq


@triton.jit
def _flash_attention_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, seg_q_ptr, seg_k_ptr,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_db, stride_dh, stride_ds, stride_dqb, stride_dqh, stride_dqs,
    HQ, GROUP, SQ, SK, SK_BUCKET, qk_scale, scale, SOFTCAP, WINDOW, OFF,
    CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAPPED: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """SK_BUCKET is read by the autotuner only (see _TUNE). OFF, SEGMENTS, WINDOWED and SOFTCAPPED as in the
    forward kernel."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b, off_h = _batch_and_head(pid_bh, HQ)
    k_ptr += off_b * stride_kb + (off_h // GROUP) * stride_kh
    v_ptr += off_b * stride_vb + (off_h // GROUP) * stride_vh
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < SQ
    q = _load_rows(q_ptr + off_b * stride_qb + off_h * stride_qh, offs_m, offs_d, stride_qs, row_ok, DOT_FP32)
    do = _load_rows(do_ptr + off_b * stride_db + off_h * stride_dh, offs_m, offs_d, stride_ds, row_ok, DOT_FP32)
    row_base = pid_bh.to(tl.int64) * SQ
    lse = tl.load(lse_ptr + row_base + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(delta_ptr + row_base + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    full_end, masked_end = _query_block_key_ranges(start_m, SQ, SK, OFF, CAUSAL, BLOCK_M, BLOCK_N)
    head = 0
    mid_lo = 0
    seg_q = 0
    if SEGMENTS:  # the forward's three loops over the key blocks of the query block's segments
        seg_k_ptr += off_b * 3 * SK
        seg_q, head, mid_lo, full_end, masked_end = _query_block_segments(
            seg_q_ptr + off_b * 3 * SQ, offs_m, row_ok, start_m, SQ, full_end, masked_end, BLOCK_M, BLOCK_N
        )
    if WINDOWED:
        head, mid_lo, full_end = _window_key_ranges(
            start_m, SQ, OFF, WINDOW, head, mid_lo, full_end, masked_end, BLOCK_M, BLOCK_N
        )
    if SEGMENTS or WINDOWED:
        dq = _bwd_dq_inner(
            dq, q, do, lse, delta, k_ptr, v_ptr, stride_ks, stride_vs, offs_m, offs_d, SK, OFF, qk_scale, SOFTCAP,
            head, mid_lo, seg_q, seg_k_ptr, WINDOW, True, CAUSAL, SEGMENTS, WINDOWED, SOFTCAPPED, DOT_FP32,
            INPUT_PRECISION, BLOCK_N,
        )  # fmt: skip
    dq = _bwd_dq_inner(
        dq, q, do, lse, delta, k_ptr, v_ptr, stride_ks, stride_vs, offs_m, offs_d, SK, OFF, qk_scale, SOFTCAP,
        mid_lo, full_end, seg_q, seg_k_ptr, WINDOW, False, CAUSAL, SEGMENTS, WINDOWED, SOFTCAPPED, DOT_FP32,
        INPUT_PRECISION, BLOCK_N,
    )  # fmt: skip
    dq = _bwd_dq_inner(
        dq, q, do, lse, delta, k_ptr, v_ptr, stride_ks, stride_vs, offs_m, offs_d, SK, OFF, qk_scale, SOFTCAP,
        full_end, masked_end, seg_q, seg_k_ptr, WINDOW, True, CAUSAL, SEGMENTS, WINDOWED, SOFTCAPPED, DOT_FP32,
        INPUT_PRECISION, BLOCK_N,
    )  # fmt: skip
    dq = dq * scale
    tl.store(
        dq_ptr + off_b * stride_dqb + off_h * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :],
        dq.to(dq_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )
