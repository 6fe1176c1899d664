"""Flash attention (FlashAttention-2, Dao 2023) in Triton: forward and backward, causal or not, GQA/MQA.

    out[b, h, i] = Σ_j softmax_j(scale · q[b, h, i] · k[b, h // G, j]) · v[b, h // G, j]
    lse[b, h, i] = log Σ_j exp(scale · q[b, h, i] · k[b, h // G, j])          (natural log, fp32)

over all ``Sk`` keys, or, when causal, over ``j ≤ i + (Sk - Sq)``: the mask is BOTTOM-RIGHT aligned, as
in FlashAttention ≥ 2.1, so the last query sees every key. That is what a KV cache needs: a decode step
(``Sq = 1``) sees the whole cache, a chunk of ``Sq`` new queries after ``Sk - Sq`` cached tokens sees
the cache and its own causal triangle, and ``Sq == Sk`` is the ordinary causal mask (equal to
``scaled_dot_product_attention(is_causal=True)``). For ``Sq ≠ Sk`` torch's ``is_causal`` is TOP-LEFT
aligned (``j ≤ i``) and differs from this. When ``Sq > Sk`` the first ``Sq - Sk`` queries see no key:
their output is 0, their ``lse`` is ``-inf`` and they receive and pass on no gradient (no NaN anywhere).
Query head ``h`` reads key/value head ``h // G`` by indexing: repeated keys and values are never built.

Legend: ``B`` batch, ``Hq`` query heads, ``Hkv`` key/value heads, ``G = Hq / Hkv`` query heads per
key/value head (1: MHA, ``Hq``: MQA), ``Sq`` query length, ``Sk`` key/value length, ``D`` head dim in
{16, 32, 64, 128, 256}. ``q [B, Hq, Sq, D]``, ``k, v [B, Hkv, Sk, D]``, ``out [B, Hq, Sq, D]``,
``lse [B, Hq, Sq]``.

The log-sum-exp is what the backward recomputes the probabilities from, ``P = exp(scale·QKᵀ - lse)``,
and what lets partial results over disjoint key blocks be merged (context parallelism, ring attention):
``lse = logaddexp(lse₁, lse₂)``, ``out = exp(lse₁ - lse)·out₁ + exp(lse₂ - lse)·out₂``. It is
differentiable: a gradient on ``lse`` enters the backward through ``Δ = rowsum(dO ∘ O) - dlse``.

The three tiers and their kernels (the ``@triton.jit`` functions and their block sizes live in
:mod:`.attention_kernels`; this module is the host side):

- ``_flash_attention_fwd_kernel``: one program per (query block, batch·query head); online softmax in
  base 2 over key blocks, fp32 accumulators; writes ``out`` and ``lse``.
- ``_flash_attention_split_kv_kernel`` (split-KV, as in flash-decoding): for short queries, one program
  per (row block, batch·kv head, key split) whose rows are the ``G · Sq`` (query head, position) pairs
  of one kv head, so a decode step reads each key/value head once; each split stores a partial output
  and log-sum-exp, and ``_flash_attention_split_kv_combine_kernel`` merges them with the identity above.
  It replaces the forward when ``num_splits`` asks for it or, on CUDA, when ``G · Sq ≤ 64``.
- backward (FlashAttention-2 §3.2): ``_flash_attention_bwd_preprocess_kernel`` computes
  ``Δ = rowsum(dO ∘ O) - dlse``; ``_flash_attention_bwd_dkdv_kernel`` has one program per (key block,
  batch·kv head) that loops over the ``G`` query heads of its group and over their query blocks,
  summing dK and dV of the whole group in fp32 registers (deterministic, no fp32 scratch buffer, no
  atomics); ``_flash_attention_bwd_dq_kernel`` has one program per (query block, batch·query head) that
  loops over key blocks (recomputing P instead of sharing it with the dK/dV kernel, which keeps both
  free of atomics and bit-reproducible). With ``deterministic=False`` the dQ kernel is not launched:
  the dK/dV kernel (``ATOMIC_DQ``) adds ``dS·K`` of every block pair into a zeroed fp32 ``dQ`` with
  atomic adds, FlashAttention-2's own scheme, and the host scales and rounds it once.
- ``flash_attention`` validates and launches (differentiable through ``_FlashAttentionFunction``);
  ``flash_attention_reference`` (:mod:`.attention_reference`) is the plain-PyTorch definition, and
  :mod:`.attention_inputs` holds the argument checks and the segment tables.

Causal masking skips every block above the (shifted) diagonal, and only the blocks crossing it and the
query and key tails pay for masks: the others run a ``MASK=False`` copy of the inner loop.

Packed documents (``segment_ids``, ``SEGMENTS``): a run of equal ids in a row is a segment, and a query
sees only the keys of its own segment. The host turns the ids into each token's segment start and end
(``[B, S]`` int32); a query block reads the key blocks from its first row's segment start to its last
row's segment end (the causal bound still applies), and a key block the query blocks of its segments,
so blocks between unrelated documents are never loaded. A block whose rows all lie in one segment runs
the blocks inside that segment without masks; one spanning a boundary masks every block it reads. A pair
of ids (queries and keys with ids of their own: padding, queries over a cache, ring attention's blocks)
gives each token its id and the range of its partners with that id, which the same loops read. The shift
``Sk - Sq`` is a runtime int, so decode steps reuse one compiled kernel.

Numerics: scores, softmax statistics and all accumulators are fp32; P (and dS in the backward) are
rounded to the input dtype before their GEMMs, as on tensor cores in FlashAttention-2. Under Triton's
interpreter (``DOT_FP32``) every dot operand is first cast to fp32, because the interpreter multiplies
fp16/bf16 dot operands as raw bits; products of fp16/bf16 values are exact in fp32, so the interpreter
differs from the GPU only in the summation order. fp32 inputs run IEEE fp32 dots on the CPU, and TF32
on CUDA when ``torch.backends.cuda.matmul.allow_tf32`` is set (as torch's own GEMMs do).
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from ._dispatch import Backend, backend_for, cdiv, next_power_of_2, opaque_to_compile, upcast_dot_operands
from ._tuned import launch_tuned
from .attention_inputs import (
    _DTYPES,
    HEAD_DIMS,
    _check_num_splits,
    _check_softcap,
    _check_window,
    _segment_bounds,
    _validate,
)
from .attention_kernels import (
    INTERPRETER_DKDV_BLOCKS,
    INTERPRETER_DQ_BLOCKS,
    INTERPRETER_FWD_BLOCKS,
    INTERPRETER_SPLIT_KV_BLOCK_N,
    PREPROCESS_BLOCK_M,
    SPLIT_KV_KEY_ALIGN,
    _flash_attention_bwd_dkdv_kernel,
    _flash_attention_bwd_dq_kernel,
    _flash_attention_bwd_preprocess_kernel,
    _flash_attention_fwd_kernel,
    _flash_attention_split_kv_combine_kernel,
    _flash_attention_split_kv_kernel,
    dkdv_atomic_dq_kernel_tuned,
    dkdv_kernel_tuned,
    dq_kernel_tuned,
    fwd_kernel_tuned,
    sk_bucket,
    split_kv_kernel_tuned,
)
from .attention_reference import _backward_reference_rows, _reference_rows, flash_attention_reference

__all__ = ["HEAD_DIMS", "flash_attention", "flash_attention_backward", "flash_attention_reference"]

_LOG2E = 1.4426950408889634  # the kernels use exp2: exp(x) = 2^(x·log2 e)
_INT32_MAX = 2**31 - 1
_MAX_GRID_Y = 65535  # CUDA's limit on the grid's second dimension (batch · heads)
MAX_SPLITS = 64  # key splits of the split-KV forward; the merge holds one row's [splits, D] partials at once
AUTO_SPLIT_KV_MAX_ROWS = 64  # automatic split-KV: at most this many (query head, position) rows per kv head
_MIN_KEYS_PER_SPLIT = 256  # automatic split-KV: fewer keys per split cost more in the merge than they save


# ----------------------------------------------------------------------------------------------------
# Host side: dispatch, launch
# ----------------------------------------------------------------------------------------------------


def check_grid(name: str, q: torch.Tensor) -> str:
    """q's backend, after checking that its batch · query heads fit CUDA's grid (raises ValueError)."""
    backend = backend_for(q)
    if backend == Backend.TRITON and q.shape[0] * q.shape[1] > _MAX_GRID_Y:
        raise ValueError(
            f"{name}: batch · query heads = {q.shape[0] * q.shape[1]} exceeds the CUDA grid limit {_MAX_GRID_Y}; "
            "call it on smaller batches"
        )
    return backend


def _input_precision(dtype: torch.dtype, backend: str) -> str:
    # fp32 dots follow torch.matmul on the same machine: TF32 on CUDA only when torch allows it.
    if dtype == torch.float32 and (backend != Backend.TRITON or not torch.backends.cuda.matmul.allow_tf32):
        return "ieee"
    return "tf32"


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """The kernels take any batch/head/sequence strides but read head_dim contiguously."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _check_int32_rows(*tensors: torch.Tensor) -> None:
    """Offsets within one head are int32 in the kernels (batch and head offsets are int64).

    Outputs need no check: they follow an input's dimension order densely, so their strides are smaller.
    """
    for t in tensors:
        if (t.shape[2] - 1) * abs(t.stride(2)) + t.shape[3] > _INT32_MAX:
            raise ValueError(
                f"flash_attention: sequence length {t.shape[2]} times the row stride {t.stride(2)} spans more "
                "than 2**31 - 1 elements within one head; split the sequence"
            )


def _empty_in_layout_of(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A dense tensor of t's shape whose memory follows t's order of batch, head and sequence (by stride).

    A [B, H, S, D] view of a [B, S, H, D] (or [S, B, H, D]) buffer gets an output laid out the same way,
    so the layer's merge of heads (``out.transpose(1, 2).reshape(B, S, H * D)``) copies nothing.
    """
    order = [*sorted(range(3), key=lambda i: -t.stride(i)), 3]  # stable: ties keep the logical order
    inverse = [order.index(i) for i in range(4)]
    return torch.empty([t.shape[i] for i in order], device=t.device, dtype=dtype or t.dtype).permute(inverse)


def _device(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _cap(softcap: float | None) -> float:
    """The kernels' SOFTCAP argument: the cap in base-2 logit units (never read without a cap)."""
    return 0.0 if softcap is None else float(softcap) * _LOG2E


def _diagonal(sq: int, sk: int, offset: int | None) -> int:
    """The kernels' OFF: query i sees keys j ≤ i + OFF under the causal mask (bottom-right aligned by default)."""
    return sk - sq if offset is None else offset


def _flags(q: torch.Tensor, causal: bool, backend: str, segments=None, window=None, softcap=None) -> dict:
    return {
        "CAUSAL": causal,
        "SEGMENTS": segments is not None,
        "WINDOWED": window is not None,
        "SOFTCAPPED": softcap is not None,
        "HEAD_DIM": q.shape[-1],
        "DOT_FP32": upcast_dot_operands(backend),
        "INPUT_PRECISION": _input_precision(q.dtype, backend),
    }


@opaque_to_compile
def _launch(kernel, tuned, blocks: dict, backend: str, program_rows: str, rows: int, bh: int, args, flags) -> None:
    """Launch on a (row blocks, batch·heads) grid: fixed blocks under the interpreter, autotuned on CUDA.

    Row blocks of one head are neighbours in launch order, so they share that head's keys in L2.
    """
    if backend == Backend.INTERPRETER:
        kernel[(cdiv(rows, blocks[program_rows]), bh)](*args, **flags, **blocks)
    else:
        launch_tuned(tuned, lambda meta: (cdiv(rows, meta[program_rows]), bh), args, flags)


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, asked once per device (decode calls this every step)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_kv_plan(q, k, num_splits: int | None, backend: str) -> tuple[int, int, int] | None:
    """(BLOCK_M, keys per split, splits) for the split-KV forward, or None for the one-pass kernel.

    ``num_splits=None`` chooses: on CUDA, a call with at most AUTO_SPLIT_KV_MAX_ROWS query rows per
    kv head (``G · Sq``: decode and short verification chunks) runs split-KV, with enough splits for
    two programs per SM and at least _MIN_KEYS_PER_SPLIT keys in each; everything else, and every
    interpreter run, takes the one-pass kernel. An explicit count above 1 always runs split-KV, with at
    most that many splits (fewer when the rounded split size covers the keys sooner).
    """
    b, hq, sq, _ = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    rows = hq // hkv * sq
    if num_splits == 1:
        return None
    block_m = min(AUTO_SPLIT_KV_MAX_ROWS, max(16, next_power_of_2(rows)))
    if num_splits is None:
        if backend != Backend.TRITON or rows > AUTO_SPLIT_KV_MAX_ROWS:
            return None
        programs = b * hkv * cdiv(rows, block_m)
        num_splits = max(1, min(cdiv(2 * _sm_count(q.device), programs), sk // _MIN_KEYS_PER_SPLIT))
    align = INTERPRETER_SPLIT_KV_BLOCK_N if backend == Backend.INTERPRETER else SPLIT_KV_KEY_ALIGN
    keys = cdiv(cdiv(sk, min(num_splits, MAX_SPLITS)), align) * align
    return block_m, keys, cdiv(sk, keys)


@opaque_to_compile
def _forward_split_kv(
    q, k, v, out, lse, causal: bool, scale: float, backend: str, block_m: int, keys: int, splits: int, softcap=None
) -> None:
    """Split-KV forward into ``out`` and ``lse``: the split kernel, then the merge (none for one split)."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    final = splits == 1
    if final:  # the kernel stores out and lse itself; the partial pointers are never read
        part_out = part_lse = lse
    else:
        part_out = torch.empty((b * hq * sq, splits, d), device=q.device, dtype=torch.float32)
        part_lse = torch.empty((b * hq * sq, splits), device=q.device, dtype=torch.float32)
    args = (
        q, k, v, part_out, part_lse, out, lse, q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2), hkv, hq // hkv, sq, sk, sk_bucket(sk), keys, splits,
        scale * _LOG2E, _cap(softcap),
    )  # fmt: skip
    flags = {**_flags(q, causal, backend, softcap=softcap), "FINAL": final, "BLOCK_M": block_m}
    del flags["SEGMENTS"], flags["WINDOWED"]  # the split kernel takes neither
    grid = (cdiv(hq // hkv * sq, block_m), b * hkv, splits)
    with _device(q):
        if backend == Backend.INTERPRETER:
            _flash_attention_split_kv_kernel[grid](*args, **flags, BLOCK_N=INTERPRETER_SPLIT_KV_BLOCK_N)
        else:
            launch_tuned(split_kv_kernel_tuned, grid, args, flags)
        if not final:
            _flash_attention_split_kv_combine_kernel[(b * hq * sq,)](
                part_out, part_lse, out, lse, out.stride(0), out.stride(1), out.stride(2), hq, sq, splits,
                HEAD_DIM=d, SPLITS=next_power_of_2(splits),
            )  # fmt: skip


def _forward(q, k, v, causal: bool, scale: float, backend: str, num_splits: int | None, segments=None, window=None,
             offset=None, softcap=None):  # fmt: skip
    """out [B, Hq, Sq, D] in q's memory layout, and lse [B, Hq, Sq] fp32. ``segments``: the query and key
    segment tables of :func:`_segment_bounds` or :func:`_cross_segment_bounds`; ``window``: None or the
    causal window (the one-pass kernel runs with either, whatever ``num_splits`` says); ``offset``: where
    the causal diagonal lies, query i seeing keys ``j ≤ i + offset`` (None: ``Sk - Sq``, bottom-right
    aligned; another value runs the one-pass kernel); ``softcap``: None or the cap ``c`` of soft-capped
    logits ``c·tanh(s/c)``."""
    b, hq, sq, _ = q.shape
    sk = k.shape[2]
    out = _empty_in_layout_of(q)
    lse = torch.empty((b, hq, sq), device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        return out, lse
    if sk == 0:  # no key at all: every row is a row that sees none
        return out.zero_(), lse.fill_(float("-inf"))
    one_pass = segments is not None or window is not None or offset is not None
    plan = None if one_pass else _split_kv_plan(q, k, num_splits, backend)
    if plan is not None:
        _forward_split_kv(q, k, v, out, lse, causal, scale, backend, *plan, softcap=softcap)
        return out, lse
    seg_q, seg_k = segments if segments is not None else (lse, lse)  # never read without segments
    args = (
        q, k, v, out, lse, seg_q, seg_k, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        hq, hq // k.shape[1], sq, sk, sk_bucket(sk), scale * _LOG2E, _cap(softcap), window or 0,
        _diagonal(sq, sk, offset),
    )  # fmt: skip
    with _device(q):
        _launch(
            _flash_attention_fwd_kernel, fwd_kernel_tuned, INTERPRETER_FWD_BLOCKS, backend, "BLOCK_M", sq, b * hq,
            args, _flags(q, causal, backend, segments, window, softcap),
        )  # fmt: skip
    return out, lse


@opaque_to_compile
def _backward(
    q, k, v, out, lse, dout, dlse, causal: bool, scale: float, backend: str, need_dq: bool, need_dkv: bool,
    deterministic: bool = True, segments=None, window=None, offset=None, softcap=None,
):  # fmt: skip
    """dq, dk, dv (None where not needed): the preprocess, then the dK/dV and the dQ kernels, or, when
    all three are needed and ``deterministic`` is False, the one dK/dV kernel that also adds dQ up
    with fp32 atomics. ``segments``, ``window``, ``offset`` and ``softcap`` as for :func:`_forward`."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    dq = _empty_in_layout_of(q) if need_dq else None
    dk = _empty_in_layout_of(k) if need_dkv else None
    dv = _empty_in_layout_of(v) if need_dkv else None
    if q.numel() == 0 or k.numel() == 0:  # no query or no key: nothing depends on anything
        return tuple(None if t is None else t.zero_() for t in (dq, dk, dv))
    # Gradients may arrive in another dtype or as broadcast views (the gradient of out.sum() has stride 0
    # everywhere): dO's batch/head/sequence strides go to the kernels, dlse is read as a flat row.
    dout = _unit_last_stride(dout.to(q.dtype))
    _check_int32_rows(dout)
    dlse = None if dlse is None else dlse.to(torch.float32).contiguous()
    delta = torch.empty_like(lse)
    flags = _flags(q, causal, backend, segments, window, softcap)
    seg_q, seg_k = segments if segments is not None else (delta, delta)  # never read without segments
    with _device(q):
        _flash_attention_bwd_preprocess_kernel[(cdiv(sq, PREPROCESS_BLOCK_M), b * hq)](
            out, dout, dlse if dlse is not None else delta, delta,
            out.stride(0), out.stride(1), out.stride(2), dout.stride(0), dout.stride(1), dout.stride(2), hq, sq,
            HAS_DLSE=dlse is not None, HEAD_DIM=d, BLOCK_M=PREPROCESS_BLOCK_M,
        )  # fmt: skip
        common = (
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
        )  # fmt: skip
        tail = (hq, hq // hkv, sq, sk, sk_bucket(sk), scale * _LOG2E, scale, _cap(softcap), window or 0,
                _diagonal(sq, sk, offset))  # fmt: skip
        atomic_dq = need_dq and need_dkv and not deterministic
        if need_dkv:
            # the accumulator of the atomic dQ, or (never read) any fp32 tensor
            dq_acc = torch.zeros((b, hq, sq, d), device=q.device, dtype=torch.float32) if atomic_dq else delta
            args = (q, k, v, dout, lse, delta, dk, dv, dq_acc, seg_q, seg_k, *common, *dk.stride()[:3],
                    *dv.stride()[:3], *tail)  # fmt: skip
            _launch(
                _flash_attention_bwd_dkdv_kernel, dkdv_atomic_dq_kernel_tuned if atomic_dq else dkdv_kernel_tuned,
                INTERPRETER_DKDV_BLOCKS, backend, "BLOCK_N", sk, b * hkv, args, {**flags, "ATOMIC_DQ": atomic_dq},
            )  # fmt: skip
            if atomic_dq:  # scaled and rounded into q's dtype and layout in one pass
                torch.mul(dq_acc, scale, out=dq)
        if need_dq and not atomic_dq:
            args = (q, k, v, dout, lse, delta, dq, seg_q, seg_k, *common, *dq.stride()[:3], *tail)
            _launch(
                _flash_attention_bwd_dq_kernel, dq_kernel_tuned, INTERPRETER_DQ_BLOCKS, backend, "BLOCK_M",
                sq, b * hq, args, flags,
            )  # fmt: skip
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------
# The backward on its own, and blocks for callers that assemble attention from pieces
# ----------------------------------------------------------------------------------------------------


def flash_attention_backward(q, k, v, out, lse, dout, causal=False, scale=None, *, deterministic=True,
                             segment_ids=None, window=None, softcap=None):  # fmt: skip
    """The backward of :func:`flash_attention` on its own: ``(dq, dk, dv)`` from the saved ``out`` and ``lse``.

    Not differentiable; for callers that assemble an attention from pieces, such as context-parallel
    (ring) attention, where ``out``, ``lse`` and ``dout`` are those of the whole softmax over every
    key while ``k``, ``v`` hold only some of the keys: the probabilities are recomputed as
    ``P = exp(scale·q·kᵀ - lse)`` and ``Δ = rowsum(dout ∘ out)``, so the result is this block's exact
    share of the gradients of the whole attention (``dq`` summed over key blocks gives the full ``dq``;
    ``dk``, ``dv`` are the full gradients of these keys and values from these queries).

    Args:
        q, k, v, causal, scale, deterministic, segment_ids, window, softcap: as for :func:`flash_attention`.
        out: ``[B, Hq, Sq, D]`` in q's dtype; lse: ``[B, Hq, Sq]`` float32 (natural log; ``-inf`` for
            a row that sees no key); dout: ``[B, Hq, Sq, D]``, any floating dtype (rounded to q's).

    Returns:
        ``dq``, ``dk``, ``dv`` in the dtype and memory order of ``q``, ``k``, ``v``.
    """
    _validate("flash_attention_backward", q, k, v, causal, scale, _DTYPES)
    b, hq, sq, d = q.shape
    for arg, t, shape in (("out", out, (b, hq, sq, d)), ("dout", dout, (b, hq, sq, d)), ("lse", lse, (b, hq, sq))):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flash_attention_backward: {arg} must be a torch.Tensor, received {type(t).__name__}")
        if tuple(t.shape) != shape:
            raise ValueError(f"flash_attention_backward: {arg} must have shape {list(shape)} (from q), received "
                             f"{tuple(t.shape)}")  # fmt: skip
        if t.device != q.device:
            raise ValueError(f"flash_attention_backward: {arg} must be on q's device {q.device}, received {t.device}")
    if out.dtype != q.dtype:
        raise TypeError(f"flash_attention_backward: out must have q's dtype {q.dtype}, received {out.dtype}")
    if lse.dtype != torch.float32:
        raise TypeError(f"flash_attention_backward: lse must be float32, received {lse.dtype}")
    if not dout.is_floating_point():
        raise TypeError(f"flash_attention_backward: dout must be a floating tensor, received {dout.dtype}")
    if not isinstance(deterministic, bool):
        raise TypeError(
            f"flash_attention_backward: deterministic must be a bool, received {type(deterministic).__name__}"
        )
    _check_window("flash_attention_backward", window, causal)
    _check_softcap("flash_attention_backward", softcap)
    segments = _segment_bounds("flash_attention_backward", segment_ids, q, k)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    return _block_backward(q, k, v, out, lse, dout, causal, scale, deterministic, segments, window, softcap=softcap)


def _block_forward(q, k, v, causal: bool, scale: float, segments, window=None, offset=None, softcap=None):
    """``(out, lse)`` of validated arguments on their backend, without autograd: for callers that assemble
    an attention from blocks (:func:`~tessel.parallel.context.ring_attention`). ``segments``, ``window``
    and ``offset`` as for :func:`_forward` (segments e.g. from :func:`_cross_segment_bounds`; the offset
    of a block whose first query lies ``o`` places after its first key is ``o``)."""
    backend = backend_for(q)
    if backend == Backend.REFERENCE or q.shape[-1] not in HEAD_DIMS:  # heads wider than the kernels': by row tiles
        return _reference_rows(q, k, v, causal, scale, segments, window, offset, softcap)
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    _check_int32_rows(q, k, v)
    return _forward(q, k, v, causal, scale, backend, None, segments, window, offset, softcap)


def _block_backward(q, k, v, out, lse, dout, causal: bool, scale: float, deterministic: bool, segments, window=None,
                    offset=None, softcap=None):  # fmt: skip
    """:func:`flash_attention_backward` of validated arguments; the rest as for :func:`_block_forward`."""
    backend = backend_for(q)
    if backend == Backend.REFERENCE or q.shape[-1] not in HEAD_DIMS:
        return _backward_reference_rows(q, k, v, out, lse, dout, causal, scale, segments, window, offset, softcap)
    q, k, v, out = (_unit_last_stride(t) for t in (q, k, v, out))
    _check_int32_rows(q, k, v, out)
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    return _backward(
        q,
        k,
        v,
        out,
        lse.contiguous(),
        dout,
        None,
        causal,
        scale,
        backend,
        True,
        True,
        deterministic,
        segments,
        window,
        offset,
        softcap,
    )


# ----------------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------------


class _FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, backend, num_splits, deterministic, segments, window, softcap):
        out, lse = _forward(q, k, v, causal, scale, backend, num_splits, segments, window, softcap=softcap)
        ctx.save_for_backward(q, k, v, out, lse, *(segments or ()))
        ctx.causal, ctx.scale, ctx.backend, ctx.deterministic = causal, scale, backend, deterministic
        ctx.window, ctx.softcap = window, softcap
        # An unused output (lse when only out is returned) gets None instead of a tensor of zeros.
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable  # the Triton backward builds no graph of its own
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *segments = ctx.saved_tensors
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        if dout is None:  # only lse was used: Δ = -dlse and dO = 0
            dout = torch.zeros_like(out)
        # torch.use_deterministic_algorithms(True) at the time of the backward wins over deterministic=False
        deterministic = ctx.deterministic or torch.are_deterministic_algorithms_enabled()
        dq, dk, dv = _backward(
            q, k, v, out, lse, dout, dlse, ctx.causal, ctx.scale, ctx.backend, need_q, need_k or need_v, deterministic,
            tuple(segments) or None, ctx.window, softcap=ctx.softcap,
        )  # fmt: skip
        return dq, dk if need_k else None, dv if need_v else None, None, None, None, None, None, None, None, None


def flash_attention(q, k, v, causal=False, scale=None, *, return_lse=False, num_splits=None, deterministic=True,
                    segment_ids=None, window=None, softcap=None):  # fmt: skip
    """Softmax attention in one pass over the keys, never materialising the ``Sq × Sk`` scores; differentiable.

    Args:
        q: ``[B, Hq, Sq, D]``, float32/float16/bfloat16, any batch/head/sequence strides (a transposed
            ``[B, Sq, Hq, D]`` view or a slice of a fused QKV buffer is read in place; a head_dim
            that is not contiguous is copied first). ``D`` in {16, 32, 64, 128, 256}.
        k, v: ``[B, Hkv, Sk, D]`` with ``Hq % Hkv == 0``; query head ``h`` attends with key/value head
            ``h // (Hq / Hkv)`` (GQA; ``Hkv = 1`` is MQA). q's dtype, device, batch and head dim; any
            length ``Sk`` (k and v the same), which may differ from ``Sq`` (decode, chunked prefill
            over a KV cache, cross attention).
        causal: query ``i`` attends to keys ``j ≤ i + (Sk - Sq)`` only: the mask is bottom-right
            aligned, as in FlashAttention ≥ 2.1, so ``Sq = 1`` sees every key and ``Sq == Sk`` is the
            usual ``j ≤ i``. torch's ``scaled_dot_product_attention(is_causal=True)`` is top-left
            aligned (``j ≤ i``) and differs when ``Sq ≠ Sk``. When ``Sq > Sk`` the first ``Sq - Sk``
            queries see no key: their output is 0, their lse ``-inf``, their gradients 0.
        scale: multiplier of the scores, ``1/sqrt(D)`` by default.
        return_lse: also return the log-sum-exp.
        num_splits: how the forward cuts the keys (split-KV, "flash-decoding"). ``None`` (default)
            chooses: on CUDA, a call with at most 64 query rows per key/value head (``Hq/Hkv · Sq``:
            decode steps, short speculative chunks) runs the split-KV kernel, which packs each key/value
            head's query heads and positions into one tile and cuts the keys into enough splits to fill
            the GPU; anything longer runs one pass over the keys. ``1`` always takes the one-pass
            kernel; ``n > 1`` always takes split-KV with at most ``min(n, 64)`` splits. The result is the
            same up to the summation order; the backward is the same either way.
        deterministic: how the backward computes dQ. ``True`` (default): a second kernel per query
            block recomputes the scores and dP (seven GEMMs per block pair in all), so gradients are
            bit-for-bit reproducible. ``False``: the dK/dV kernel also adds each key block's share
            of dQ into an fp32 buffer with atomic adds (five GEMMs, FlashAttention-2's scheme, plus
            the atomic traffic); gradients then differ between runs in the last bits of fp32 before
            rounding. ``torch.use_deterministic_algorithms(True)`` in force at the backward turns
            ``False`` back into ``True``. Only the backward reads it.
        segment_ids: ``None``, or an integer ``[B, S]`` tensor on q's device for queries and keys of one
            sequence (``Sq == Sk == S``): documents packed into one row. A run of equal ids is a
            segment, and a query attends only to the keys of its own segment (and, when causal, to
            those up to its own position), as if each segment were a sequence of its own; each query
            block reads the key blocks of its segments only, so the work grows with the sum of the
            squared segment lengths rather than with ``S²``. Or a pair ``(q_segment_ids [B, Sq],
            kv_segment_ids [B, Sk])`` of non-negative ids, non-decreasing along each row, for queries and
            keys with ids of their own (``Sq`` and ``Sk`` may differ): query ``i`` attends to key ``j``
            only when their ids are equal. Padded batches take this form (padding keys get an id no query
            has; a query that should see nothing, an id no key has: its output is 0, its lse ``-inf``), as
            do queries over a cache of packed documents. Runs the one-pass kernel (a larger
            ``num_splits`` is refused).
        window: ``None``, or a number of keys ``W ≥ 1`` with ``causal=True``: local (sliding-window)
            attention as in Mistral and Gemma 2, query ``i`` attending to the ``W`` latest keys up to its
            own, ``i + (Sk - Sq) - W < j ≤ i + (Sk - Sq)`` (Hugging Face's ``sliding_window``). Each query
            block reads only the key blocks of its rows' windows, so the work grows with ``S · W``
            rather than with ``S²``. Combines with ``segment_ids``; runs the one-pass kernel, except
            for one query (a decoding step): it sees the last ``W`` keys and nothing else, which are
            then read as a slice without a mask, and ``num_splits`` (split-KV) applies as without a
            window.
        softcap: ``None``, or a cap ``c > 0``: the logits are soft-capped, ``c·tanh(s/c)`` for the scaled
            score ``s``, before the softmax (Gemma 2's ``attn_logit_softcapping``, Grok's); ``lse`` is
            that of the capped logits, and the backward goes through the cap. Any kernel, any mask.

    Returns:
        ``out [B, Hq, Sq, D]`` in q's dtype, dense, with q's order of batch, head and sequence in
        memory: for q a ``[B, Hq, Sq, D]`` view of a ``[B, Sq, ...]`` projection, ``out`` is laid out
        ``[B, Sq, Hq, D]`` and ``out.transpose(1, 2).reshape(B, Sq, Hq * D)``, what an attention layer
        does next, copies nothing (dq, dk, dv likewise follow q, k, v).

        With ``return_lse=True`` the pair ``(out, lse)``, where ``lse [B, Hq, Sq]`` float32 is the
        natural-log log-sum-exp of the scaled (and masked) scores of each query row,
        ``lse = log Σ_j exp(scale · q·k_j)``. Partial results over disjoint key sets merge exactly
        with it (``lse = logaddexp(lse₁, lse₂)``, ``out = Σ_i exp(lse_i - lse)·out_i``), which is what
        context-parallel attention needs; gradients may flow through ``lse`` as well.

    Softmax and all accumulation run in fp32. The backward recomputes the probabilities from the
    saved ``lse`` (FlashAttention-2) and computes dK and dV summed over each GQA group inside one
    kernel; dQ comes from a second kernel or, with ``deterministic=False``, from atomic adds in the first.
    """
    _validate("flash_attention", q, k, v, causal, scale, _DTYPES)
    _check_num_splits(num_splits)
    if segment_ids is not None and num_splits not in (None, 1):
        raise ValueError(f"flash_attention: segment_ids run the one-pass kernel; num_splits must be None or 1, "
                         f"received {num_splits}")  # fmt: skip
    _check_window("flash_attention", window, causal)
    _check_softcap("flash_attention", softcap)
    if window is not None and q.shape[2] == 1 and segment_ids is None:
        # one query's window is the last W keys: a slice, and no mask (the split-KV kernel takes it)
        first = max(k.shape[2] - window, 0)
        k, v, window = k[:, :, first:], v[:, :, first:], None
    if window is not None and num_splits not in (None, 1):
        raise ValueError(f"flash_attention: a window runs the one-pass kernel; num_splits must be None or 1, "
                         f"received {num_splits}")  # fmt: skip
    if not isinstance(deterministic, bool):
        raise TypeError(f"flash_attention: deterministic must be a bool, received {type(deterministic).__name__}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    backend = check_grid("flash_attention", q)
    if backend == Backend.REFERENCE:
        return flash_attention_reference(q, k, v, causal, scale, return_lse=return_lse, segment_ids=segment_ids,
                                         window=window, softcap=softcap)  # fmt: skip
    segments = _segment_bounds("flash_attention", segment_ids, q, k)
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    _check_int32_rows(q, k, v)
    if torch.compiler.is_compiling():  # one graph node each way (see .library)
        out, lse = torch.ops.tessel.flash_attention(q, k, v, causal, scale, num_splits, window, softcap, deterministic,
                                                    *(segments or (None, None)))  # fmt: skip
    elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _FlashAttentionFunction.apply(q, k, v, causal, scale, backend, num_splits, deterministic, segments,
                                                 window, softcap)  # fmt: skip
    else:
        out, lse = _forward(q, k, v, causal, scale, backend, num_splits, segments, window, softcap=softcap)
    return (out, lse) if return_lse else out
