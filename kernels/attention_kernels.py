"""The Triton kernels of flash attention and their block sizes; the host side is :mod:`.attention`.

Legend and numerics as in :mod:`.attention`: ``q [B, Hq, Sq, D]``, ``k, v [B, Hkv, Sk, D]``,
``G = Hq / Hkv``; scores and accumulators in fp32, exp2 with ``scale·log2 e`` folded into the scores.
``DOT_FP32`` casts every dot operand to fp32 (Triton's interpreter multiplies fp16/bf16 dot operands as
raw bits).

Causal masks are bottom-right aligned: query ``i`` sees keys ``j ≤ i + OFF`` with ``OFF = SK - SQ``, a
runtime int computed in the kernels (a constexpr would compile a new kernel at every decode step). A
block of queries ``[m, m + BLOCK_M)`` therefore sees every key below ``m + OFF + 1`` (no mask needed),
a band of keys up to ``min(m + BLOCK_M, SQ) + OFF`` through the mask, and nothing beyond; a block of
keys ``[n, n + BLOCK_N)`` is seen by no query below ``n - OFF`` and entirely by every query from
``n + BLOCK_N - 1 - OFF`` on. Rows with ``i + OFF < 0`` (only when ``SQ > SK``) see no key: their
running maximum stays ``-inf``, their sum 0, and they store ``out = 0``, ``lse = -inf``; the backward
masks them out (``exp2(s - lse)`` is ``+inf`` there, and only ever read through the mask).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "INTERPRETER_DKDV_BLOCKS",
    "INTERPRETER_DQ_BLOCKS",
    "INTERPRETER_FWD_BLOCKS",
    "INTERPRETER_SPLIT_KV_BLOCK_N",
    "PREPROCESS_BLOCK_M",
    "SPLIT_KV_KEY_ALIGN",
    "dkdv_kernel_tuned",
    "dq_kernel_tuned",
    "fwd_kernel_tuned",
    "sk_bucket",
    "split_kv_kernel_tuned",
]


# ----------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, k_ptr, v_ptr, stride_ks, stride_vs, offs_m, offs_d, SK, OFF, qk_scale, lo, hi, seg_q,
    seg_ptr, MASK: tl.constexpr, CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr, DOT_FP32: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Online softmax over the key blocks starting in [lo, hi); MASK: mask the key tail, the diagonal band
    and (SEGMENTS) keys of other segments than their row's (seg_q: the rows' segment starts)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kT_ptrs = k_ptr + cols[None, :] * stride_ks + offs_d[:, None]
        v_ptrs = v_ptr + cols[:, None] * stride_vs + offs_d[None, :]
        kT = tl.load(kT_ptrs, mask=cols[None, :] < SK, other=0.0) if MASK else tl.load(kT_ptrs)
        if DOT_FP32:
            kT = kT.to(tl.float32)
        qk = tl.dot(q, kT, input_precision=INPUT_PRECISION)
        qk = qk * qk_scale  # base-2 logits: scale·log2(e)·q·k
        if MASK:
            keep = cols[None, :] < SK
            if CAUSAL:
                keep = keep & (offs_m[:, None] + OFF >= cols[None, :])
            if SEGMENTS:
                seg_k = tl.load(seg_ptr + cols, mask=cols < SK, other=-1)
                keep = keep & (seg_q[:, None] == seg_k[None, :])
            qk = tl.where(keep, qk, float("-inf"))
        # A row that sees any key sees key 0 (or its segment's first key), which is in its first key block:
        # m_new is finite from then on and exp2(-inf - m_new) is an exact 0. Rows that see no key yet (causal
        # with SQ > SK; a later segment's rows in the blocks before their segment) keep m_new = -inf:
        # subtracting 0 instead keeps their p and alpha 0 rather than NaN.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new) if MASK and (CAUSAL or SEGMENTS) else m_new
        p = tl.math.exp2(qk - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptrs, mask=cols[:, None] < SK, other=0.0) if MASK else tl.load(v_ptrs)
        # P is rounded to the input dtype for the tensor cores, as in FlashAttention-2; its row sum
        # l_i was taken in fp32 before that rounding.
        p = p.to(v_ptr.dtype.element_ty)
        if DOT_FP32:
            v = v.to(tl.float32)
            p = p.to(tl.float32)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _query_block_key_ranges(start_m, SQ, SK, OFF, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The keys of the query block [start_m, start_m + BLOCK_M): [0, full_end) unmasked, [full_end, masked_end)
    masked (the diagonal band and the key tail), none beyond. full_end is a multiple of BLOCK_N.

    With OFF = 0 and BLOCK_M a multiple of BLOCK_N this is [0, start_m) and [start_m, min(start_m + BLOCK_M, SK)):
    the square case's diagonal block, unchanged.
    """
    if CAUSAL:  # row start_m sees keys below start_m + OFF + 1; the last valid row, below its own + OFF + 1
        full_end = (tl.maximum(tl.minimum(start_m + OFF + 1, SK), 0) // BLOCK_N) * BLOCK_N
        masked_end = tl.maximum(tl.minimum(tl.minimum(start_m + BLOCK_M, SQ) + OFF, SK), full_end)
    else:  # only the key block holding the key tail needs a mask
        full_end = (SK // BLOCK_N) * BLOCK_N
        masked_end = SK
    return full_end, masked_end


@triton.jit
def _segment_ranges(seg_start_ptr, seg_end_ptr, first, last, lo, full_lo, full_end, end, BLOCK: tl.constexpr):
    """Under SEGMENTS: the blocks (of BLOCK partners: keys for a query block, queries for a key block) that
    rows ``first..last`` need, as three loops: masked ``[head, mid_lo)``, whole ``[mid_lo, mid_hi)``, masked
    ``[mid_hi, stop)``.

    ``lo``: the first partner any of the rows may see (their first segment's start, or later under the
    causal mask); ``[full_lo, full_end)``: where the causal mask lets every row see every partner;
    ``end``: the causal bound. Rows spanning several segments mask every block; rows of one segment run
    the whole blocks inside it unmasked.
    """
    one = tl.load(seg_start_ptr + first) == tl.load(seg_start_ptr + last)
    stop = tl.minimum(end, tl.load(seg_end_ptr + last))
    head = (lo // BLOCK) * BLOCK
    mid_lo = tl.where(one, tl.maximum(tl.cdiv(lo, BLOCK) * BLOCK, full_lo), head)
    mid_hi = tl.where(one, tl.maximum(tl.minimum(full_end, (stop // BLOCK) * BLOCK), mid_lo), head)
    return head, mid_lo, mid_hi, stop


@triton.jit
def _query_block_segments(
    seg_start_ptr, seg_end_ptr, offs_m, row_ok, start_m, SQ, full_end, masked_end, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The rows' segment starts and the key loops of the query block at start_m (one batch row's segment
    pointers): masked ``[head, mid_lo)``, whole ``[mid_lo, full_end)``, masked ``[full_end, masked_end)``."""
    seg_q = tl.load(seg_start_ptr + offs_m, mask=row_ok, other=-2)
    last = tl.minimum(start_m + BLOCK_M, SQ) - 1
    head, mid_lo, full_end, masked_end = _segment_ranges(
        seg_start_ptr, seg_end_ptr, start_m, last, tl.load(seg_start_ptr + start_m), 0, full_end, masked_end, BLOCK_N
    )
    return seg_q, head, mid_lo, full_end, masked_end


@triton.jit
def _flash_attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, seg_start_ptr, seg_end_ptr,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    HQ, GROUP, SQ, SK, SK_BUCKET, qk_scale,
    CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_FP32: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """SK_BUCKET is read by the autotuner only (see _TUNE). SEGMENTS (SQ == SK): seg_start_ptr/seg_end_ptr
    ([B, S] int32) hold the first index and one past the last of each token's segment; a query sees only
    the keys of its own segment. Otherwise they are never read."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // HQ).to(tl.int64)
    off_h = (pid_bh % HQ).to(tl.int64)
    q_ptr += off_b * stride_qb + off_h * stride_qh
    k_ptr += off_b * stride_kb + (off_h // GROUP) * stride_kh
    v_ptr += off_b * stride_vb + (off_h // GROUP) * stride_vh
    out_ptr += off_b * stride_ob + off_h * stride_oh
    lse_ptr += pid_bh.to(tl.int64) * SQ

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < SQ
    q = tl.load(q_ptr + offs_m[:, None] * stride_qs + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    OFF = SK - SQ
    full_end, masked_end = _query_block_key_ranges(start_m, SQ, SK, OFF, CAUSAL, BLOCK_M, BLOCK_N)
    head = 0
    seg_q = 0
    if SEGMENTS:  # masked, whole and masked key blocks of the query block's segments (see _segment_ranges)
        seg_start_ptr += off_b * SQ
        seg_q, head, mid_lo, full_end, masked_end = _query_block_segments(
            seg_start_ptr, seg_end_ptr + off_b * SQ, offs_m, row_ok, start_m, SQ, full_end, masked_end, BLOCK_M,
            BLOCK_N,
        )  # fmt: skip
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, k_ptr, v_ptr, stride_ks, stride_vs, offs_m, offs_d, SK, OFF, qk_scale, head, mid_lo,
            seg_q, seg_start_ptr, True, CAUSAL, True, DOT_FP32, INPUT_PRECISION, BLOCK_N,
        )  # fmt: skip
        head = mid_lo
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_ptr, v_ptr, stride_ks, stride_vs, offs_m, offs_d, SK, OFF, qk_scale, head, full_end,
        seg_q, seg_start_ptr, False, CAUSAL, SEGMENTS, DOT_FP32, INPUT_PRECISION, BLOCK_N,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_ptr, v_ptr, stride_ks, stride_vs, offs_m, offs_d, SK, OFF, qk_scale, full_end,
        masked_end, seg_q, seg_start_ptr, True, CAUSAL, SEGMENTS, DOT_FP32, INPUT_PRECISION, BLOCK_N,
    )  # fmt: skip

    # A row that saw a key has l_i ≥ 1 (its maximum contributes exp2(0)); one that saw none has l_i = 0
    # and m_i = -inf, and stores out = 0 and lse = -inf.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    acc = acc / l_safe[:, None]
    lse = (m_i + tl.math.log2(l_safe)) * 0.6931471805599453  # back to the natural log: · ln 2
    tl.store(lse_ptr + offs_m, lse, mask=row_ok)
    out_ptrs = out_ptr + offs_m[:, None] * stride_os + offs_d[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _flash_attention_split_kv_kernel(
    q_ptr, k_ptr, v_ptr, part_out_ptr, part_lse_ptr, out_ptr, lse_ptr,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    HKV, GROUP, SQ, SK, SK_BUCKET, KEYS_PER_SPLIT, NSPLIT, qk_scale,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    FINAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Split-KV forward (flash-decoding) for short queries: one program per (row block, batch·kv head, key split).

    The rows of a tile are the ``GROUP · SQ`` (query head, query position) pairs of one key/value head,
    row ``r`` being head ``kv_head·GROUP + r // SQ`` at position ``r % SQ``: a decode step's query heads
    share one pass over their keys and values instead of reading them ``GROUP`` times, and a tile of 16
    rows replaces one of 64+ rows holding a single query. Split ``s`` covers the keys
    ``[s·KEYS_PER_SPLIT, (s+1)·KEYS_PER_SPLIT)``, a multiple of every BLOCK_N so that only the key tail
    and the causal band are masked. Each split stores its normalised partial output and its base-2
    log-sum-exp into ``part_out [B·Hq·SQ, NSPLIT, D]`` and ``part_lse [B·Hq·SQ, NSPLIT]`` (fp32), which
    :func:`_flash_attention_split_kv_combine_kernel` merges; with ``FINAL`` (one split) it stores ``out``
    and ``lse`` itself. A row that sees no key of its split stores lse ``-inf`` and a zero output.
    SK_BUCKET is read by the autotuner only.
    """
    pid_r = tl.program_id(0)
    pid_bkv = tl.program_id(1)
    pid_s = tl.program_id(2)
    off_b = (pid_bkv // HKV).to(tl.int64)
    off_kvh = (pid_bkv % HKV).to(tl.int64)
    rows = pid_r * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * SQ
    head = off_kvh * GROUP + rows // SQ  # int64: the query head of each row
    pos = rows % SQ  # its position among the queries
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = q_ptr + off_b * stride_qb + head[:, None] * stride_qh + pos[:, None] * stride_qs + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    k_ptr += off_b * stride_kb + off_kvh * stride_kh
    v_ptr += off_b * stride_vb + off_kvh * stride_vh

    OFF = SK - SQ
    lo = pid_s * KEYS_PER_SPLIT
    hi = tl.minimum(lo + KEYS_PER_SPLIT, SK)
    if CAUSAL:  # every row sees keys below its position + OFF + 1: unmasked up to the lowest row's limit
        pos_lo = tl.min(tl.where(row_ok, pos, SQ - 1), 0)
        pos_hi = tl.max(tl.where(row_ok, pos, 0), 0)
        full_end = (tl.maximum(tl.minimum(pos_lo + OFF + 1, SK), 0) // BLOCK_N) * BLOCK_N
        masked_end = tl.maximum(tl.minimum(pos_hi + OFF + 1, SK), full_end)
    else:
        full_end = (SK // BLOCK_N) * BLOCK_N
        masked_end = SK
    mid = tl.maximum(tl.minimum(full_end, hi), lo)
    end = tl.maximum(tl.minimum(masked_end, hi), mid)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_ptr, v_ptr, stride_ks, stride_vs, pos, offs_d, SK, OFF, qk_scale, lo, mid, 0, k_ptr,
        False, CAUSAL, False, DOT_FP32, INPUT_PRECISION, BLOCK_N,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_ptr, v_ptr, stride_ks, stride_vs, pos, offs_d, SK, OFF, qk_scale, mid, end, 0, k_ptr,
        True, CAUSAL, False, DOT_FP32, INPUT_PRECISION, BLOCK_N,
    )  # fmt: skip

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    acc = acc / l_safe[:, None]
    lse2 = m_i + tl.math.log2(l_safe)  # -inf where the row saw no key of this split
    if FINAL:
        out_ptrs = out_ptr + off_b * stride_ob + head[:, None] * stride_oh + pos[:, None] * stride_os + offs_d[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        tl.store(lse_ptr + (off_b * HKV * GROUP + head) * SQ + pos, lse2 * 0.6931471805599453, mask=row_ok)
    else:
        part = ((off_b * HKV * GROUP + head) * SQ + pos) * NSPLIT + pid_s  # the row's slot of this split
        tl.store(part_lse_ptr + part, lse2, mask=row_ok)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _flash_attention_split_kv_combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, stride_ob, stride_oh, stride_os, HQ, SQ, NSPLIT,
    HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """Merge one query row's split results: ``lse = log2 Σ_s 2^lse_s``, ``out = Σ_s 2^(lse_s - lse)·out_s``.

    One program per row of ``[B·Hq·SQ]``; SPLITS is NSPLIT rounded up to a power of two. Splits the row
    did not see weigh 0; a row that saw no key at all stores out 0 and lse ``-inf``.
    """
    row = tl.program_id(0).to(tl.int64)
    pos = row % SQ
    off_b = row // SQ // HQ
    off_h = row // SQ % HQ
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    split_ok = offs_s < NSPLIT
    lse_s = tl.load(part_lse_ptr + row * NSPLIT + offs_s, mask=split_ok, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse_s - m)
    total = tl.sum(w, 0)
    parts = tl.load(
        part_out_ptr + (row * NSPLIT + offs_s[:, None]) * HEAD_DIM + offs_d[None, :], mask=split_ok[:, None], other=0.0
    )
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    out_ptr += off_b * stride_ob + off_h * stride_oh + pos * stride_os
    tl.store(out_ptr + offs_d, out.to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + row, (m + tl.math.log2(total)) * 0.6931471805599453)


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
    off_b = (pid_bh // HQ).to(tl.int64)
    off_h = (pid_bh % HQ).to(tl.int64)
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
    dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, dq_acc_ptr, stride_qs, stride_ds, offs_n, offs_d, SQ, OFF,
    qk_scale, lo, hi, seg_k, seg_ptr,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr, DOT_FP32: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
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
        pT = tl.math.exp2(qkT * qk_scale - (lse * 1.4426950408889634)[None, :])
        if MASK:  # rows that see no key (lse = -inf, so pT = +inf) are among the masked ones
            keep = row_ok[None, :]
            if CAUSAL:
                keep = keep & (offs_m[None, :] + OFF >= offs_n[:, None])
            if SEGMENTS:
                seg_q = tl.load(seg_ptr + offs_m, mask=row_ok, other=-2)
                keep = keep & (seg_k[:, None] == seg_q[None, :])
            pT = tl.where(keep, pT, 0.0)
        dpT = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        dsT = pT * (dpT - delta[None, :])  # dSᵀ = Pᵀ ∘ (dPᵀ - Δ); scale is applied once at the end
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
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dq_acc_ptr, seg_start_ptr, seg_end_ptr,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_db, stride_dh, stride_ds, stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs,
    HQ, GROUP, SQ, SK, SK_BUCKET, qk_scale, scale,
    CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_FP32: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """SK_BUCKET is read by the autotuner only (see _TUNE). SEGMENTS as in the forward kernel.

    ATOMIC_DQ: the one-kernel backward. dQ (unscaled, fp32, [B, HQ, SQ, HEAD_DIM] contiguous and zeroed
    by the caller) is accumulated into dq_acc_ptr with atomic adds as each key block's dS is formed,
    so the backward runs five GEMMs per block pair instead of seven (the dQ kernel recomputes QKᵀ
    and dO·Vᵀ), at the price of fp32 atomic traffic and a summation order that varies from run to run.
    Otherwise dq_acc_ptr is never read."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)  # batch · kv head
    hkv = HQ // GROUP
    off_b = (pid_bh // hkv).to(tl.int64)
    off_hkv = (pid_bh % hkv).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < SK
    k = _load_rows(k_ptr + off_b * stride_kb + off_hkv * stride_kh, offs_n, offs_d, stride_ks, col_ok, DOT_FP32)
    v = _load_rows(v_ptr + off_b * stride_vb + off_hkv * stride_vh, offs_n, offs_d, stride_vs, col_ok, DOT_FP32)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    OFF = SK - SQ
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
        seg_start_ptr += off_b * SQ
        seg_end_ptr += off_b * SQ
        seg_k = tl.load(seg_start_ptr + offs_n, mask=col_ok, other=-1)
        # causal: rows below start_n see none of these keys, rows from full_lo on all of them
        q_lo = start_n if CAUSAL else tl.load(seg_start_ptr + start_n)
        diag_lo, full_lo, full_hi, q_stop = _segment_ranges(
            seg_start_ptr, seg_end_ptr, start_n, tl.minimum(start_n + BLOCK_N, SK) - 1, q_lo, full_lo, SQ, SQ,
            BLOCK_M,
        )  # fmt: skip
        diag_hi = full_lo
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
            dk, dv, k, v, q_head, do_head, lse_head, delta_head, dq_head, stride_qs, stride_ds, offs_n, offs_d,
            SQ, OFF, qk_scale, diag_lo, diag_hi, seg_k, seg_start_ptr, True, CAUSAL, SEGMENTS, DOT_FP32,
            INPUT_PRECISION, ATOMIC_DQ, HEAD_DIM, BLOCK_M,
        )  # fmt: skip
        # the query blocks that see the whole key block
        dk, dv = _bwd_dkdv_inner(
            dk, dv, k, v, q_head, do_head, lse_head, delta_head, dq_head, stride_qs, stride_ds, offs_n, offs_d,
            SQ, OFF, qk_scale, full_lo, full_hi, seg_k, seg_start_ptr, False, CAUSAL, SEGMENTS, DOT_FP32,
            INPUT_PRECISION, ATOMIC_DQ, HEAD_DIM, BLOCK_M,
        )  # fmt: skip
        # the query block holding the query tail (SEGMENTS: the blocks up to the last segment's end)
        dk, dv = _bwd_dkdv_inner(
            dk, dv, k, v, q_head, do_head, lse_head, delta_head, dq_head, stride_qs, stride_ds, offs_n, offs_d,
            SQ, OFF, qk_scale, full_hi, q_stop, seg_k, seg_start_ptr, True, CAUSAL, SEGMENTS, DOT_FP32,
            INPUT_PRECISION, ATOMIC_DQ, HEAD_DIM, BLOCK_M,
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
    dq, q, do, lse, delta, k_ptr, v_ptr, stride_ks, stride_vs, offs_m, offs_d, SK, OFF, qk_scale, lo, hi, seg_q,
    seg_ptr, MASK: tl.constexpr, CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr, DOT_FP32: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
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
        p = tl.math.exp2(qk * qk_scale - lse[:, None])
        if MASK:  # rows that see no key (lse = -inf, so p = +inf) are among the masked ones
            keep = cols[None, :] < SK
            if CAUSAL:
                keep = keep & (offs_m[:, None] + OFF >= cols[None, :])
            if SEGMENTS:
                seg_k = tl.load(seg_ptr + cols, mask=cols < SK, other=-1)
                keep = keep & (seg_q[:, None] == seg_k[None, :])
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, vT, input_precision=INPUT_PRECISION)
        ds = (p * (dp - delta[:, None])).to(k_ptr.dtype.element_ty)  # rounded for the tensor cores
        if DOT_FP32:
            ds = ds.to(tl.float32)
        dq = tl.dot(ds, tl.trans(kT), dq, input_precision=INPUT_PRECISION)  # dQ += dS K
    return dq


@triton.jit
def _flash_attention_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, seg_start_ptr, seg_end_ptr,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_db, stride_dh, stride_ds, stride_dqb, stride_dqh, stride_dqs,
    HQ, GROUP, SQ, SK, SK_BUCKET, qk_scale, scale,
    CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_FP32: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """SK_BUCKET is read by the autotuner only (see _TUNE). SEGMENTS as in the forward kernel."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // HQ).to(tl.int64)
    off_h = (pid_bh % HQ).to(tl.int64)
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
    OFF = SK - SQ
    full_end, masked_end = _query_block_key_ranges(start_m, SQ, SK, OFF, CAUSAL, BLOCK_M, BLOCK_N)
    head = 0
    seg_q = 0
    if SEGMENTS:  # the forward's three loops over the key blocks of the query block's segments
        seg_start_ptr += off_b * SQ
        seg_q, head, mid_lo, full_end, masked_end = _query_block_segments(
            seg_start_ptr, seg_end_ptr + off_b * SQ, offs_m, row_ok, start_m, SQ, full_end, masked_end, BLOCK_M,
            BLOCK_N,
        )  # fmt: skip
        dq = _bwd_dq_inner(
            dq, q, do, lse, delta, k_ptr, v_ptr, stride_ks, stride_vs, offs_m, offs_d, SK, OFF, qk_scale, head,
            mid_lo, seg_q, seg_start_ptr, True, CAUSAL, True, DOT_FP32, INPUT_PRECISION, BLOCK_N,
        )  # fmt: skip
        head = mid_lo
    dq = _bwd_dq_inner(
        dq, q, do, lse, delta, k_ptr, v_ptr, stride_ks, stride_vs, offs_m, offs_d, SK, OFF, qk_scale, head, full_end,
        seg_q, seg_start_ptr, False, CAUSAL, SEGMENTS, DOT_FP32, INPUT_PRECISION, BLOCK_N,
    )  # fmt: skip
    dq = _bwd_dq_inner(
        dq, q, do, lse, delta, k_ptr, v_ptr, stride_ks, stride_vs, offs_m, offs_d, SK, OFF, qk_scale, full_end,
        masked_end, seg_q, seg_start_ptr, True, CAUSAL, SEGMENTS, DOT_FP32, INPUT_PRECISION, BLOCK_N,
    )  # fmt: skip
    dq = dq * scale
    tl.store(
        dq_ptr + off_b * stride_dqb + off_h * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :],
        dq.to(dq_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


# ----------------------------------------------------------------------------------------------------
# Block sizes
# ----------------------------------------------------------------------------------------------------


def _configs(shapes) -> list[triton.Config]:
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in shapes]


def sk_bucket(sk: int) -> int:
    """The autotuning key for the key length: its power-of-two bucket (at least 16).

    Decode calls the kernels with a key length one longer at every step; an exact key would re-run the
    autotuner (tens of timed launches) at every token. The query length stays exact, so with SQ == SK
    the key (SQ, bucket) is as fine as the former S and the square case tunes exactly as before.
    """
    return max(16, triton.next_power_of_2(sk))


def _prune_for_short_sequences(configs, named_args, **kwargs):
    """Drop tiles longer than 64 over a shorter sequence (query tiles BLOCK_M over SQ, key tiles BLOCK_N over
    SK): mostly past the end, and costly to tune."""

    def fits(block: int, length: int) -> bool:
        return block <= max(64, triton.next_power_of_2(length))

    sq, sk = named_args["SQ"], named_args["SK"]
    kept = [c for c in configs if fits(c.kwargs["BLOCK_M"], sq) and fits(c.kwargs["BLOCK_N"], sk)]
    return kept or configs


# Hopper (sm_90) candidates, chosen from what ptxas makes of them at bf16, D=128, causal and not
# (tests/kernels/sm90_compile.py reports registers, spills and local-memory traffic per loop step):
# every tile keeps its main loop free of register spills except the FlashAttention-2 backward tile
# (64×128, 8 warps), kept as a candidate for its wide MMAs although it refills a few dozen registers per
# step. Tiles of 128 query rows over 4 warps are left out: their fp32 accumulators (128×128 over 128
# threads) spill at every step. The 64×64 and 64×32 tiles serve short sequences and fp32 with D=128,
# where the larger tiles overflow shared memory (the autotuner skips those).
_FWD_CONFIGS = _configs([
    (128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 3), (128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3),
    (64, 32, 4, 2),
])  # fmt: skip
# dK/dV: each program owns a wide key tile (BLOCK_N) and streams narrow query tiles (BLOCK_M) past it. The
# two fp32 accumulators (dK, dV: 2·BLOCK_N·D) crowd the registers, so the tiles spread over 8 warps.
_DKDV_CONFIGS = _configs([
    (64, 128, 8, 3), (64, 64, 8, 3), (32, 128, 8, 3), (32, 128, 8, 2), (32, 64, 8, 3), (16, 128, 8, 3),
    (16, 64, 8, 3), (16, 32, 4, 2),
])  # fmt: skip
# The one-kernel backward holds the dS·K product of each step as well: 32-row tiles of 64 keys keep
# their loops spill-free, 32×128 refills a dozen registers per causal step.
_DKDV_ATOMIC_DQ_CONFIGS = _configs([
    (64, 128, 8, 3), (64, 64, 8, 3), (32, 128, 8, 3), (32, 64, 8, 3), (32, 64, 8, 2), (16, 128, 8, 3),
    (16, 64, 8, 3), (16, 32, 4, 2),
])  # fmt: skip
# dQ: each program owns a tall query tile (BLOCK_M) and streams narrow key tiles (BLOCK_N) past it.
_DQ_CONFIGS = _configs([
    (128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2),
    (32, 16, 4, 2),
])  # fmt: skip

_TUNE = dict(
    key=["SQ", "SK_BUCKET", "HEAD_DIM", "CAUSAL", "SEGMENTS"],
    prune_configs_by={"early_config_prune": _prune_for_short_sequences},
)
fwd_kernel_tuned = triton.autotune(configs=_FWD_CONFIGS, **_TUNE)(_flash_attention_fwd_kernel)
dkdv_kernel_tuned = triton.autotune(configs=_DKDV_CONFIGS, **_TUNE)(_flash_attention_bwd_dkdv_kernel)
dq_kernel_tuned = triton.autotune(configs=_DQ_CONFIGS, **_TUNE)(_flash_attention_bwd_dq_kernel)
# The one-kernel backward (ATOMIC_DQ) adds onto its dQ accumulator: every timed launch of the autotuner
# starts from zeros again, and so does the launch that follows the tuning.
dkdv_atomic_dq_kernel_tuned = triton.autotune(configs=_DKDV_ATOMIC_DQ_CONFIGS, reset_to_zero=["dq_acc_ptr"], **_TUNE)(
    _flash_attention_bwd_dkdv_kernel
)

# Split-KV (decode): the host picks BLOCK_M from the rows (GROUP · SQ) and cuts the keys into splits of a
# multiple of SPLIT_KV_KEY_ALIGN, the widest key tile here, so every tile of a split is whole or the tail.
_SPLIT_KV_CONFIGS = [
    triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)
    for bn, w, st in ((64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3), (64, 8, 2), (128, 4, 2))
]
SPLIT_KV_KEY_ALIGN = 128
split_kv_kernel_tuned = triton.autotune(
    configs=_SPLIT_KV_CONFIGS, key=["GROUP", "SQ", "SK_BUCKET", "HEAD_DIM", "CAUSAL", "FINAL", "BLOCK_M"]
)(_flash_attention_split_kv_kernel)

# Under the interpreter every block operation costs milliseconds of numpy work: blocks just large
# enough that the test sequences (1..130) span several query and key blocks, tails and diagonal bands.
INTERPRETER_FWD_BLOCKS = {"BLOCK_M": 32, "BLOCK_N": 16}
INTERPRETER_DKDV_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 32}
INTERPRETER_DQ_BLOCKS = {"BLOCK_M": 32, "BLOCK_N": 16}
INTERPRETER_SPLIT_KV_BLOCK_N = 16
PREPROCESS_BLOCK_M = 64
