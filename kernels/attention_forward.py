"""The forward Triton kernels of flash attention and the block ranges the backward shares with them.

Legend, numerics and masks as in :mod:`.attention_kernels` (block sizes and autotuning) and
:mod:`.attention` (the host side): the one-pass forward, the split-KV forward and its merge, and the
helpers that say which key blocks a query block reads (causal bounds, packed-document segments).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "_block_keep",
    "_flash_attention_fwd_kernel",
    "_flash_attention_split_kv_combine_kernel",
    "_flash_attention_split_kv_kernel",
    "_query_block_key_ranges",
    "_query_block_segments",
    "_segment_ranges",
    "_window_key_ranges",
]


@triton.jit
def _batch_and_head(pid, HEADS):
    """The batch and head (int64) of a program whose grid axis ``pid`` enumerates ``batch · HEADS`` (heads
    innermost)."""
    return (pid // HEADS).to(tl.int64), (pid % HEADS).to(tl.int64)


@triton.jit
def _tanh(x):
    """tanh in fp32 to a few ulps: ``(1 - e)/(1 + e)`` with ``e = exp(-2|x|)`` (never NaN: ±1 where ``e``
    vanishes), and below |x| = 1/16, where ``1 - e`` would cancel, its series to x⁷ (relative error < 1e-11)."""
    a = tl.abs(x)
    e = tl.math.exp2(a * -2.8853900817779268)  # -2·log2(e)
    x2 = a * a
    series = a * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397)))
    t = tl.where(a < 0.0625, series, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -t, t)


@triton.jit
def _logits(qk, qk_scale, SOFTCAP, SOFTCAPPED: tl.constexpr):
    """Base-2 logits of raw dot products: ``qk_scale·q·k`` (``qk_scale`` = scale·log2(e)); SOFTCAPPED, capped
    as ``SOFTCAP·tanh(s / SOFTCAP)`` (Gemma 2's soft-capping, ``SOFTCAP`` the cap in base-2 units)."""
    s = qk * qk_scale
    if SOFTCAPPED:
        s = SOFTCAP * _tanh(s / SOFTCAP)
    return s


@triton.jit
def _block_keep(
    offs_m, cols, SK, OFF, seg_q, seg_ptr, WINDOW, CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr,
    WINDOWED: tl.constexpr,
):  # fmt: skip
    """``[rows, cols]`` bool: which keys ``cols`` each query row ``offs_m`` sees (the key tail, the causal
    band, under WINDOWED the WINDOW latest keys of each row, and under SEGMENTS equal ids: ``seg_q`` the
    rows' segment ids, ``seg_ptr`` the keys')."""
    keep = cols[None, :] < SK
    if CAUSAL:
        keep = keep & (offs_m[:, None] + OFF >= cols[None, :])
    if WINDOWED:
        keep = keep & (offs_m[:, None] + OFF - cols[None, :] < WINDOW)
    if SEGMENTS:
        seg_k = tl.load(seg_ptr + cols, mask=cols < SK, other=-1)
        keep = keep & (seg_q[:, None] == seg_k[None, :])
    return keep


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, k_ptr, v_ptr, stride_ks, stride_vs, offs_m, offs_d, SK, OFF, qk_scale, SOFTCAP, lo, hi,
    seg_q, seg_ptr, WINDOW, MASK: tl.constexpr, CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr, WINDOWED: tl.constexpr,
    SOFTCAPPED: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Online softmax over the key blocks starting in [lo, hi); MASK: mask the key tail, the diagonal band
    and (SEGMENTS) keys of other segments than their row's (seg_q: the rows' segment ids, seg_ptr: the keys')."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kT_ptrs = k_ptr + cols[None, :] * stride_ks + offs_d[:, None]
        v_ptrs = v_ptr + cols[:, None] * stride_vs + offs_d[None, :]
        kT = tl.load(kT_ptrs, mask=cols[None, :] < SK, other=0.0) if MASK else tl.load(kT_ptrs)
        if DOT_FP32:
            kT = kT.to(tl.float32)
        qk = tl.dot(q, kT, input_precision=INPUT_PRECISION)
        qk = _logits(qk, qk_scale, SOFTCAP, SOFTCAPPED)  # base-2 logits: scale·log2(e)·q·k (soft-capped)
        if MASK:
            keep = _block_keep(offs_m, cols, SK, OFF, seg_q, seg_ptr, WINDOW, CAUSAL, SEGMENTS, WINDOWED)
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
def _segment_ranges(seg_ptr, S, first, last, lo, full_lo, full_end, end, BLOCK: tl.constexpr):
    """Under SEGMENTS: the blocks (of BLOCK partners: keys for a query block, queries for a key block) that
    rows ``first..last`` need, as three loops: masked ``[head, mid_lo)``, whole ``[mid_lo, mid_hi)``, masked
    ``[mid_hi, stop)``.

    ``seg_ptr``: the rows' side of the segment table (``[3, S]`` of one batch row: ids, first partner, one
    past the last partner). ``lo``: the first partner any of the rows may see (their first segment's
    first partner, or later under the causal mask); ``[full_lo, full_end)``: where the causal mask lets
    every row see every partner; ``end``: the causal bound. Rows spanning several segments mask every
    block; rows of one segment run the whole blocks inside it unmasked.
    """
    one = tl.load(seg_ptr + first) == tl.load(seg_ptr + last)
    stop = tl.minimum(end, tl.load(seg_ptr + 2 * S + last))
    head = (lo // BLOCK) * BLOCK
    # never past ``stop``: rows with no partner in this block (an empty range, as blocks of ring attention
    # give) would otherwise leave the whole loop starting after the masked tail ends, which a window's
    # narrowing (_window_key_ranges) reads as a whole loop over the padding
    mid_lo = tl.where(one, tl.minimum(tl.maximum(tl.cdiv(lo, BLOCK) * BLOCK, full_lo), tl.maximum(stop, head)), head)
    mid_hi = tl.where(one, tl.maximum(tl.minimum(full_end, (stop // BLOCK) * BLOCK), mid_lo), head)
    return head, mid_lo, mid_hi, stop


@triton.jit
def _query_block_segments(
    seg_q_ptr, offs_m, row_ok, start_m, SQ, full_end, masked_end, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):  # fmt: skip
    """The rows' segment ids and the key loops of the query block at start_m (``seg_q_ptr``: one batch row's
    query side of the segment table): masked ``[head, mid_lo)``, whole ``[mid_lo, full_end)``, masked
    ``[full_end, masked_end)``."""
    seg_q = tl.load(seg_q_ptr + offs_m, mask=row_ok, other=-2)
    last = tl.minimum(start_m + BLOCK_M, SQ) - 1
    head, mid_lo, full_end, masked_end = _segment_ranges(
        seg_q_ptr, SQ, start_m, last, tl.load(seg_q_ptr + SQ + start_m), 0, full_end, masked_end, BLOCK_N
    )
    return seg_q, head, mid_lo, full_end, masked_end


@triton.jit
def _window_key_ranges(start_m, SQ, OFF, WINDOW, head, mid_lo, full_end, masked_end, BLOCK_M, BLOCK_N):
    """Under WINDOWED: the query block's key loops (masked ``[head, mid_lo)``, whole ``[mid_lo, full_end)``,
    masked ``[full_end, masked_end)``) narrowed to the WINDOW latest keys of its rows. Row ``start_m``
    sees keys from ``start_m + OFF - WINDOW + 1`` on; every row sees every key from
    ``last + OFF - WINDOW + 1`` on. With a window shorter than a block every block is masked."""
    last = tl.minimum(start_m + BLOCK_M, SQ) - 1
    first_seen = tl.maximum(start_m + OFF - WINDOW + 1, 0)
    all_seen = tl.maximum(last + OFF - WINDOW + 1, 0)
    head = tl.maximum(head, (first_seen // BLOCK_N) * BLOCK_N)
    mid_lo = tl.maximum(tl.minimum(tl.maximum(mid_lo, tl.cdiv(all_seen, BLOCK_N) * BLOCK_N), masked_end), head)
    return head, mid_lo, tl.maximum(full_end, mid_lo)


@triton.jit
def _flash_attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, seg_q_ptr, seg_k_ptr,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    HQ, GROUP, SQ, SK, SK_BUCKET, qk_scale, SOFTCAP, WINDOW, OFF,
    CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAPPED: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """SK_BUCKET is read by the autotuner only (see _TUNE). SOFTCAPPED: the logits are soft-capped (see
    _logits; SOFTCAP is the cap times log2(e)), and lse is that of the capped logits. OFF places the
    diagonal: under CAUSAL query i sees keys ``j ≤ i + OFF`` (``SK - SQ`` for the bottom-right aligned mask;
    a caller that assembles attention from blocks passes the distance between the block's first query and
    first key). WINDOWED
    (with CAUSAL): query i sees only the WINDOW latest keys up to its own, ``i + OFF - WINDOW < j ≤ i + OFF``.
    SEGMENTS: seg_q_ptr ``[B, 3, SQ]`` and seg_k_ptr ``[B, 3, SK]`` (int32) hold, for each query (key), its
    segment id, and the first and one past the last key (query) of that segment, whose ids are equal and
    contiguous on both sides; a query sees only the keys with its id. Otherwise they are never read."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b, off_h = _batch_and_head(pid_bh, HQ)
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
    full_end, masked_end = _query_block_key_ranges(start_m, SQ, SK, OFF, CAUSAL, BLOCK_M, BLOCK_N)
    head = 0
    mid_lo = 0
    seg_q = 0
    if SEGMENTS:  # masked, whole and masked key blocks of the query block's segments (see _segment_ranges)
        seg_k_ptr += off_b * 3 * SK
        seg_q, head, mid_lo, full_end, masked_end = _query_block_segments(
            seg_q_ptr + off_b * 3 * SQ, offs_m, row_ok, start_m, SQ, full_end, masked_end, BLOCK_M, BLOCK_N
        )
    if WINDOWED:
        head, mid_lo, full_end = _window_key_ranges(
            start_m, SQ, OFF, WINDOW, head, mid_lo, full_end, masked_end, BLOCK_M, BLOCK_N
        )
    if SEGMENTS or WINDOWED:
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, k_ptr, v_ptr, stride_ks, stride_vs, offs_m, offs_d, SK, OFF, qk_scale, SOFTCAP, head,
            mid_lo, seg_q, seg_k_ptr, WINDOW, True, CAUSAL, SEGMENTS, WINDOWED, SOFTCAPPED, DOT_FP32,
            INPUT_PRECISION, BLOCK_N,
        )  # fmt: skip
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_ptr, v_ptr, stride_ks, stride_vs, offs_m, offs_d, SK, OFF, qk_scale, SOFTCAP, mid_lo,
        full_end, seg_q, seg_k_ptr, WINDOW, False, CAUSAL, SEGMENTS, WINDOWED, SOFTCAPPED, DOT_FP32,
        INPUT_PRECISION, BLOCK_N,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_ptr, v_ptr, stride_ks, stride_vs, offs_m, offs_d, SK, OFF, qk_scale, SOFTCAP, full_end,
        masked_end, seg_q, seg_k_ptr, WINDOW, True, CAUSAL, SEGMENTS, WINDOWED, SOFTCAPPED, DOT_FP32,
        INPUT_PRECISION, BLOCK_N,
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
    HKV, GROUP, SQ, SK, SK_BUCKET, KEYS_PER_SPLIT, NSPLIT, qk_scale, SOFTCAP,
    CAUSAL: tl.constexpr, SOFTCAPPED: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_FP32: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, FINAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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
    pid_s = tl.program_id(2)
    off_b, off_kvh = _batch_and_head(tl.program_id(1), HKV)
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
        acc, l_i, m_i, q, k_ptr, v_ptr, stride_ks, stride_vs, pos, offs_d, SK, OFF, qk_scale, SOFTCAP, lo, mid, 0,
        k_ptr, 0, False, CAUSAL, False, False, SOFTCAPPED, DOT_FP32, INPUT_PRECISION, BLOCK_N,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_ptr, v_ptr, stride_ks, stride_vs, pos, offs_d, SK, OFF, qk_scale, SOFTCAP, mid, end, 0,
        k_ptr, 0, True, CAUSAL, False, False, SOFTCAPPED, DOT_FP32, INPUT_PRECISION, BLOCK_N,
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
