"""Context parallelism: the sequence split over ranks, attention run as a ring over key/value blocks.

Legend: ``c`` context-parallel size, ``r`` this rank, ``S`` the whole sequence, ``L = S/c`` the tokens
a rank holds, ``h = L/2 = S/(2c)`` one chunk, ``|kv|`` the bytes of one rank's keys and values.

Layout (load-balanced, "zigzag", as Megatron-LM's context parallelism lays it out): the sequence is
cut into ``2c`` chunks of ``h`` tokens and rank ``r`` holds chunks ``r`` and ``2c-1-r``, in that order.
Under a causal mask a rank holding one early and one late chunk has as many (query, key) pairs to
compute as any other, where a contiguous split would leave the last rank with ``2c-1`` times the
first one's work. :func:`split_sequence` cuts a batch this way, :func:`zigzag_positions` gives the
global positions of the tokens a rank holds (what rotary embeddings need), :func:`gather_sequence`
puts the pieces back in order.

Ring (:func:`ring_attention`, Liu et al. 2023 "Ring Attention", in FlashAttention form): every rank
keeps its queries; the key/value blocks travel. At step ``s`` rank ``r`` holds the block of rank
``src = (r - s) mod c``, sends it on to ``r+1`` and receives the next from ``r-1`` while flash attention
runs on the block it holds; the partial outputs merge exactly through their log-sum-exps
(``lse = logaddexp(lse₁, lse₂)``, ``out = Σ_i exp(lse_i - lse)·out_i``, in fp32). Under the causal mask
the zigzag layout makes every step but the first one exactly half a block, and the same half on every
rank::

    step s = 0      (own block)  both query chunks × both key chunks, causal (the local order is global)
    src < r         (earlier)    both query chunks × the first key chunk, no mask
    src > r         (later)      the second query chunk × both key chunks, no mask

Backward: the keys and values go round the ring again, and an fp32 dK/dV accumulator for each block
travels one step behind it: at step ``s`` the rank adds this step's share (from
:func:`~tessel.kernels.attention.flash_attention_backward`, whose probabilities are recomputed from the
whole softmax's ``lse``, so each share is exact) to the accumulator it received, and sends it on
during the next step's computation; after ``c`` sends every accumulator is back with its owner. dQ
stays home, summed in fp32.

Bytes each rank sends (and receives): forward ``(c-1)·|kv|``; backward ``(c-1)·|kv|`` for the keys
and values plus ``c·|dkv|`` for the accumulators (fp32: twice ``|kv|`` for bf16/fp16 inputs). Every
transfer is issued before the attention step it hides behind and waited for after it; the steps are
logged with :func:`~.comm.record_event` (``"ring_attention"`` for keys and values,
``"ring_attention.dkv"`` for the accumulators), which is how tests check the overlap without timing.

Parameters are replicated over the context-parallel ranks and each rank's gradients come from its own
tokens only: reduce them over the context-parallel group as over a data-parallel one (a data-parallel
wrapper whose group spans both, as Megatron-LM folds ``cp`` into ``dp`` for its gradient reduction).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..kernels._memo import kept_on
from ..kernels.attention import _block_backward, _block_forward, check_grid, flash_attention
from ..kernels.attention_inputs import _cross_segment_bounds, run_starts
from ..kernels.attention_inputs import _validate as _validate_attention
from .comm import all_gather, group_rank, group_size, record_event, ring_exchange

__all__ = ["gather_sequence", "ring_attention", "split_sequence", "zigzag_positions"]

OP = "ring_attention"
DKV_OP = "ring_attention.dkv"


# ---------------------------------------------------------------------------------------------------- layout


def _check_cp_length(name: str, seq_len: int, cp_size: int, what: str = "sequence length") -> None:
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"{name}: the {what} {seq_len} must be divisible by 2·cp = {2 * cp_size} (2 chunks per "
            "context-parallel rank)"
        )


def zigzag_positions(seq_len: int, cp_size: int, cp_rank: int, *, device=None) -> torch.Tensor:
    """Global positions ``[S/cp]`` (int64) of the tokens rank ``cp_rank`` holds: chunks r and 2c-1-r of 2c."""
    for name, value in (("seq_len", seq_len), ("cp_size", cp_size), ("cp_rank", cp_rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"zigzag_positions: {name} must be an int, received {type(value).__name__}")
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"zigzag_positions: need cp_size ≥ 1 and 0 ≤ cp_rank < cp_size, received cp_size={cp_size}, "
                         f"cp_rank={cp_rank}")  # fmt: skip
    _check_cp_length("zigzag_positions", seq_len, cp_size, "seq_len")
    h = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * h, (cp_rank + 1) * h, device=device)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * h, (2 * cp_size - cp_rank) * h, device=device)
    return torch.cat((first, second))


def _check_dim(name: str, x, dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: x must be a torch.Tensor, received {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"{name}: dim must be an int in [{-x.dim()}, {x.dim()}) for x of shape {tuple(x.shape)}, "
                         f"received {dim!r}")  # fmt: skip
    return dim % x.dim()


def split_sequence(x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = 1) -> torch.Tensor:
    """This rank's zigzag share of ``x`` along ``dim`` (a new tensor): chunks ``r`` and ``2c-1-r`` of ``2c``.

    For inputs and targets before the model; not differentiable. ``x.shape[dim]`` must be divisible by
    ``2c``. In a world of one, ``x`` itself.
    """
    dim = _check_dim("split_sequence", x, dim)
    c = group_size(group)
    if c == 1:
        return x
    _check_cp_length("split_sequence", x.shape[dim], c)
    return x.index_select(dim, zigzag_positions(x.shape[dim], c, group_rank(group), device=x.device))


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's zigzag share along ``dim``, in order; the inverse of :func:`split_sequence`.

    An all-gather (every rank receives everything); for evaluation and inspection, not differentiable.
    """
    dim = _check_dim("gather_sequence", x, dim)
    c = group_size(group)
    if c == 1:
        return x
    if x.shape[dim] % 2:
        raise ValueError(f"gather_sequence: each rank holds two equal chunks, so x.shape[{dim}] must be even, "
                         f"received {x.shape[dim]}")  # fmt: skip
    gathered, work = all_gather(x.detach().movedim(dim, 0).contiguous(), group)  # [c·L, ...] in rank order
    work.wait()
    seq_len = c * x.shape[dim]
    order = torch.cat([zigzag_positions(seq_len, c, rank) for rank in range(c)])
    whole = torch.empty_like(gathered)
    whole[order.to(x.device)] = gathered
    return whole.movedim(0, dim)


# ---------------------------------------------------------------------------------------------------- ring


def _block(rank: int, src: int, step: int, causal: bool, h: int) -> tuple[slice, slice, bool]:
    """Query rows, key rows and mask of step ``step``, whose key/value block came from rank ``src``."""
    everything = slice(None)
    if not causal:
        return everything, everything, False
    if step == 0:
        return everything, everything, True
    if src < rank:
        return everything, slice(0, h), False
    return slice(h, None), everything, False


def _merge(out_acc: torch.Tensor, lse_acc: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold a partial ``(out, lse)`` over other keys into the fp32 accumulators, in place."""
    new = torch.logaddexp(lse_acc, lse)
    out_acc.mul_(torch.exp(lse_acc - new).unsqueeze(-1)).add_(out.float() * torch.exp(lse - new).unsqueeze(-1))
    lse_acc.copy_(new)


def _segment_tables(segment_ids: torch.Tensor | None, group, causal: bool) -> list | None:
    """The kernels' segment tables of every ring step (``_cross_segment_bounds`` of the step's query rows and
    key columns), or None without ``segment_ids``. Tokens are numbered by the segment (run of equal ids)
    they lie in over the whole sequence; a rank's tokens, and any chunk of them, are in sequence order,
    so the numbers are non-decreasing along every block."""
    if segment_ids is None:
        return None
    c, r = group_size(group), group_rank(group)
    # every layer of a forward passes the same ids: the tables are built once (and again if they change)
    return kept_on(segment_ids, ("ring_tables", c, r, causal), lambda: _build_segment_tables(segment_ids, c, r, causal))


def _build_segment_tables(segment_ids: torch.Tensor, c: int, r: int, causal: bool) -> list:
    seq_len = segment_ids.shape[1]
    number = run_starts(segment_ids).cumsum(1)  # 1, 2, … along each row
    held = [number[:, zigzag_positions(seq_len, c, rank, device=number.device)] for rank in range(c)]
    tables = []
    for step in range(c):
        src = (r - step) % c
        rows, cols, _ = _block(r, src, step, causal, seq_len // (2 * c))
        tables.append(_cross_segment_bounds(held[r][:, rows], held[src][:, cols]))
    return tables


def _kv_ring(k: torch.Tensor, v: torch.Tensor, group, causal: bool):
    """Yield ``(step, rows, cols, block_causal, kv)`` for every ring step, where ``kv [2, B, Hkv, L, D]`` is
    the key/value block the rank holds; the next block is in flight while the caller works on this one."""
    c, r = group_size(group), group_rank(group)
    h = k.shape[2] // 2
    kv, incoming = torch.stack((k, v)), None  # keys and values travel as one message
    for step in range(c):
        handle = None
        if step < c - 1:
            incoming = torch.empty_like(kv) if incoming is None else incoming
            handle = ring_exchange(kv, incoming, group)
            record_event("send", OP, step + 1)
        rows, cols, block_causal = _block(r, (r - step) % c, step, causal, h)
        record_event("gemm", OP, step)
        yield step, rows, cols, block_causal, kv
        if handle is not None:
            handle.wait()
            record_event("wait", OP, step + 1)
            kv, incoming = incoming, kv


def _ring_forward(q, k, v, group, causal: bool, scale: float, tables=None):
    b, hq, length, d = q.shape
    out_acc = torch.empty((b, hq, length, d), device=q.device, dtype=torch.float32)
    lse_acc = torch.empty((b, hq, length), device=q.device, dtype=torch.float32)
    for step, rows, cols, block_causal, kv in _kv_ring(k, v, group, causal):
        out, lse = _block_forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], block_causal, scale,
                                  None if tables is None else tables[step])  # fmt: skip
        if step == 0:  # covers every row, and every row sees at least one key
            out_acc.copy_(out)
            lse_acc.copy_(lse)
        else:
            _merge(out_acc[:, :, rows], lse_acc[:, :, rows], out, lse)
    # [B, L, Hq, D] in memory, like flash attention's output for a layer's [B, L, Hq·D] projection
    out = torch.empty((b, length, hq, d), device=q.device, dtype=q.dtype).transpose(1, 2)
    out.copy_(out_acc)
    return out, lse_acc


def _ring_backward(q, k, v, out, lse, dout, group, causal: bool, scale: float, deterministic: bool, tables=None):
    c = group_size(group)
    dq_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    dkv = torch.zeros((2, *k.shape), device=q.device, dtype=torch.float32)  # the accumulator of this step's block
    dkv_incoming, dkv_handle = torch.empty_like(dkv), None
    dout = dout.to(q.dtype)
    for step, rows, cols, block_causal, kv in _kv_ring(k, v, group, causal):
        dq, dk, dv = _block_backward(
            q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], out[:, :, rows], lse[:, :, rows],
            dout[:, :, rows], block_causal, scale, deterministic, None if tables is None else tables[step],
        )  # fmt: skip
        dq_acc[:, :, rows] += dq
        if dkv_handle is not None:  # the accumulator of this block, sent by r-1 during this step
            dkv_handle.wait()
            record_event("wait", DKV_OP, step - 1)
            dkv, dkv_incoming = dkv_incoming, dkv
        dkv[0][:, :, cols] += dk
        dkv[1][:, :, cols] += dv
        dkv_handle = ring_exchange(dkv, dkv_incoming, group)  # on to r+1; after the last step, home
        record_event("send", DKV_OP, step)
    dkv_handle.wait()
    record_event("wait", DKV_OP, c - 1)
    return dq_acc.to(q.dtype), dkv_incoming[0].to(k.dtype), dkv_incoming[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, deterministic, tables):
        out, lse = _ring_forward(q, k, v, group, causal, scale, tables)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.deterministic, ctx.tables = group, causal, scale, deterministic, tables
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(
            q, k, v, out, lse, dout, ctx.group, ctx.causal, ctx.scale, ctx.deterministic, ctx.tables
        )
        return dq, dk, dv, None, None, None, None, None


def _check_segment_ids(segment_ids, q, seq_len: int) -> None:
    if segment_ids is None:
        return
    if not isinstance(segment_ids, torch.Tensor):
        raise TypeError(f"ring_attention: segment_ids must be None or a torch.Tensor, received "
                        f"{type(segment_ids).__name__}")  # fmt: skip
    if segment_ids.is_floating_point() or segment_ids.is_complex() or segment_ids.dtype == torch.bool:
        raise TypeError(f"ring_attention: segment_ids must be an integer tensor, received {segment_ids.dtype}")
    if tuple(segment_ids.shape) != (q.shape[0], seq_len):
        raise ValueError(f"ring_attention: segment_ids must be [batch, whole sequence] = {[q.shape[0], seq_len]} "
                         f"(the whole sequence's ids, on every rank), received {tuple(segment_ids.shape)}")  # fmt: skip
    if segment_ids.device != q.device:
        raise ValueError(f"ring_attention: segment_ids must be on q's device {q.device}, received {segment_ids.device}")


def ring_attention(q, k, v, group=None, *, causal=False, scale=None, deterministic=True,
                   segment_ids=None) -> torch.Tensor:  # fmt: skip
    """Attention over a sequence split across the ranks of ``group``; differentiable.

    Args:
        q: ``[B, Hq, L, D]``, this rank's queries; k, v: ``[B, Hkv, L, D]``, its keys and values (GQA as
            in :func:`~tessel.kernels.attention.flash_attention`). Every rank passes the same shapes.
            Under ``causal`` the tokens must be laid out as :func:`split_sequence` lays them out
            (``L`` even), so that rank ``r`` holds chunks ``r`` and ``2c-1-r``; without it any split
            works, since every query sees every key.
        group: the context-parallel group; ``None`` is the default group (a world of one when no
            process group exists, where this is flash attention).
        causal: token at global position ``i`` attends to positions ``j ≤ i``.
        scale, deterministic: as for flash attention (``deterministic`` is read by the backward).
        segment_ids: ``None``, or an integer ``[B, S]`` tensor of the WHOLE sequence (``S = c·L``, in
            sequence order, the same on every rank) on q's device: documents packed into one row, as
            for flash attention's ``segment_ids``. Each query attends only to the keys of its own run of
            equal ids. The tokens must then be laid out as :func:`split_sequence` lays them out, causal
            or not. Every rank numbers the segments itself, with no communication; each ring step runs
            the kernel with the step's query and key segment tables, so key blocks of other documents
            are skipped, not computed and masked.

    Returns:
        ``[B, Hq, L, D]`` in q's dtype, laid out ``[B, L, Hq, D]`` in memory: the attention output of
        this rank's queries over the whole sequence. The partial results of the ring are merged in fp32
        and rounded once.
    """
    _validate_attention("ring_attention", q, k, v, causal, scale, (torch.float32, torch.float16, torch.bfloat16))
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"ring_attention: q and k must hold the same tokens (one query, key and value per local "
                         f"token), received q {tuple(q.shape)} and k {tuple(k.shape)}")  # fmt: skip
    if not isinstance(deterministic, bool):
        raise TypeError(f"ring_attention: deterministic must be a bool, received {type(deterministic).__name__}")
    c = group_size(group)
    _check_segment_ids(segment_ids, q, c * q.shape[2])
    if (causal or segment_ids is not None) and q.shape[2] % 2 and c > 1:
        raise ValueError(f"ring_attention: under the causal mask or with segment_ids each rank holds two equal "
                         f"chunks (see split_sequence), so the local length must be even, received "
                         f"{q.shape[2]}")  # fmt: skip
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if c == 1 or q.shape[2] == 0:
        return flash_attention(q, k, v, causal=causal, scale=scale, deterministic=deterministic,
                               segment_ids=segment_ids)  # fmt: skip
    check_grid("ring_attention", q)
    tables = _segment_tables(segment_ids, group, causal)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _RingAttention.apply(q, k, v, group, causal, scale, deterministic, tables)
    return _ring_forward(q, k, v, group, causal, scale, tables)[0]
