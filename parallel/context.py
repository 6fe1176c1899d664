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
travels one step behind it: it starts at the block's first stop, where the rank adds this step's share
(from :func:`~tessel.kernels.attention.flash_attention_backward`, whose probabilities are recomputed
from the whole softmax's ``lse``, so each share is exact); each later stop adds its share to the
accumulator it received and sends it on during the next step's computation; after the last stop it
goes home to the block's owner, which adds it to the share of its own block. dQ stays home, summed in
fp32.

Sliding window (``window=W``, causal): the steps' (query chunk, key chunk) pairs run apart, each with
the window placed at the pair's distance along the sequence, and pairs outside every window are
skipped. Rank ``r``'s first chunk then needs the blocks of ``r-1, r-2, …`` and its second chunk those
of ``r+1, r+2, …`` (their second chunks are its neighbours near the end of the sequence), as far as
``W`` reaches: the blocks travel both ways, in two streams each only as long as some rank needs it
(one link each way when ``W ≤ h + 1``), and blocks nobody needs never travel. When the two streams
would be no shorter than the ring, the ring it is.

Bytes each rank sends (and receives), ``n`` the links of the route (``c-1`` round the ring): forward
``n·|kv|``; backward ``n·|kv|`` for the keys and values plus ``n·|dkv|`` for the accumulators (fp32:
twice ``|kv|`` for bf16/fp16 inputs). Every transfer but the accumulators' last is issued before the
attention step it hides behind and waited for after it; the steps are logged with
:func:`~.comm.record_event` (``"ring_attention"`` for keys and values, ``"ring_attention.dkv"`` for
the accumulators), which is how tests check the overlap without timing.

Attention sinks (GPT-OSS's: a learned logit per query head that joins every row's softmax and attends to nothing)
fold into the merged result once the ring is done: ``lse' = logaddexp(lse, sink)``, ``out' = out·exp(lse - lse')``.
The backward runs the ring as without them, on ``out'`` and ``lse'``: the probabilities it recomputes from ``lse'``
are the sink-aware ones and its ``rowsum(dO·out')`` the sink-aware softmax's, so every block's share stays exact, and
the sink's gradient is ``-Σ_rows exp(sink - lse')·rowsum(dO·out')`` (this rank's rows; reduced over the
context-parallel group with the other parameters).

Under ``torch.compile`` the ring (point to point, which a graph cannot hold) gives way to its all-gather form,
as Llama 3 trains with context parallelism: every rank gathers the whole sequence's keys and values (a
functional all-gather; their gradients reduce-scattered back) and runs flash attention for each of its two
query chunks over the keys up to the chunk's end, so the compiled model keeps one graph. It holds the whole
sequence's keys and values at once, ``c`` times the ring's, and moves ``(c-1)·|kv|`` each way, as the ring does.

Parameters are replicated over the context-parallel ranks and each rank's gradients come from its own
tokens only: reduce them over the context-parallel group as over a data-parallel one (a data-parallel
wrapper whose group spans both, as Megatron-LM folds ``cp`` into ``dp`` for its gradient reduction).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..kernels._memo import kept_on
from ..kernels.attention import _block_backward, _block_forward, check_grid, flash_attention
from ..kernels.attention_inputs import HEAD_DIMS, _check_softcap, _check_window, _cross_segment_bounds, run_starts
from ..kernels.attention_inputs import _validate as _validate_attention
from ..kernels.attention_reference import wide_attention
from .collectives import gather_from_sequence
from .comm import all_gather, group_rank, group_size, record_event, ring_exchange

__all__ = ["gather_sequence", "ring_attention", "sequence_from_shares", "split_sequence", "zigzag_order",
           "zigzag_positions"]  # fmt: skip

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


def zigzag_order(seq_len: int, cp_size: int, *, device=None) -> torch.Tensor:
    """Global positions ``[S]`` of the tokens of every rank's zigzag share laid end to end, rank after rank (the
    order an all-gather of the shares produces); ``argsort`` of it puts such a gather back in sequence order."""
    return torch.cat([zigzag_positions(seq_len, cp_size, rank, device=device) for rank in range(cp_size)])


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
    whole = torch.empty_like(gathered)
    whole[zigzag_order(seq_len, c, device=x.device)] = gathered
    return whole.movedim(0, dim)


def sequence_from_shares(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """:func:`gather_sequence`, differentiable: the whole sequence along ``dim``, in order, from every rank's share
    ``x``; its backward hands each rank the sum over the ranks of its share's gradient. In a world of one, ``x``."""
    if (c := group_size(group)) == 1:
        return x
    whole = gather_from_sequence(x, group, dim=dim)  # rank after rank
    order = torch.argsort(zigzag_order(whole.shape[dim], c, device=x.device))
    return whole.index_select(dim, order)


# ---------------------------------------------------------------------------------------------------- ring


class _Pair(NamedTuple):
    """One flash-attention call of a ring step: the query rows and key rows (slices of the rank's tokens and
    of the block it holds), the causal flag, the window and the diagonal offset passed to the kernels,
    and whether these rows get their first partial result here (copied, not merged)."""

    rows: slice
    cols: slice
    causal: bool
    window: int | None = None
    offset: int | None = None
    first: bool = False


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


def _window_pairs(c: int, rank: int, src: int, h: int, window: int) -> list[_Pair]:
    """The calls of a step under a causal window: every (query chunk, key chunk) pair on its own, since
    each pair lies at its own distance along the sequence. Chunk ``a`` of queries and ``b`` of keys
    (global chunk numbers, ``a ≥ b``) start ``o = (a-b)·h`` tokens apart: a pair whose nearest tokens
    (``o - h + 1`` apart) are ``window`` or more apart is skipped; one whose farthest (``o + h - 1``)
    are closer needs no mask (and shares one call with its neighbour when that needs none either); the
    rest run with the window and the diagonal at ``o``."""
    halves = (slice(0, h), slice(h, None))
    pairs, unmasked = [], set()
    for qi, a in enumerate((rank, 2 * c - 1 - rank)):
        for ki, b in enumerate((src, 2 * c - 1 - src)):
            if b > a or (a - b) * h - h + 1 >= window:
                continue
            if a == b:  # the chunk itself (step 0): the window along its own diagonal, if shorter than the chunk
                pairs.append(_Pair(halves[qi], halves[ki], True, window if window < h else None, None, True))
            elif (a - b) * h + h - 1 < window:
                unmasked.add((qi, ki))
            else:
                pairs.append(_Pair(halves[qi], halves[ki], True, window, (a - b) * h))
    # pairs that need no mask and share their rows (or keys) run as one call, as the plain ring's steps do
    everything = slice(None)
    for qi in (0, 1):
        if {(qi, 0), (qi, 1)} <= unmasked:
            unmasked -= {(qi, 0), (qi, 1)}
            pairs.append(_Pair(halves[qi], everything, False))
    for ki in (0, 1):
        if {(0, ki), (1, ki)} <= unmasked:
            unmasked -= {(0, ki), (1, ki)}
            pairs.append(_Pair(everything, halves[ki], False))
    pairs += [_Pair(halves[qi], halves[ki], False) for qi, ki in sorted(unmasked)]
    return sorted(pairs, key=lambda pair: not pair.first)  # the rows' first results before any merge


class _Step(NamedTuple):
    """A step of the ring at one rank: the key/value block of rank ``src``, which arrived over ``hop``
    links of the stream travelling towards ``r + direction`` (``hop`` 0: the rank's own block), and the
    flash-attention calls run on it (none: the block only passes through)."""

    src: int
    direction: int
    hop: int
    pairs: tuple[_Pair, ...]


class _Plan(NamedTuple):
    """Every rank's route: ``hops[0]`` links of the stream to ``r+1`` (blocks of ``r-1, r-2, …``),
    ``hops[1]`` of the stream to ``r-1`` (blocks of ``r+1, r+2, …``), the same on every rank; and this
    rank's steps in order."""

    hops: tuple[int, int]
    steps: tuple[_Step, ...]


def _pairs(c: int, rank: int, src: int, causal: bool, h: int, window: int | None) -> tuple[_Pair, ...]:
    if window is None:
        return (_Pair(*_block(rank, src, 0 if src == rank else 1, causal, h), first=src == rank),)
    return tuple(_window_pairs(c, rank, src, h, window))


@functools.lru_cache(maxsize=64)
def _ring_plan(c: int, rank: int, causal: bool, h: int, window: int | None) -> _Plan:
    """The route of the key/value blocks and the calls of every step at ``rank``.

    Without a window (or with one over the whole sequence, which is the causal mask) every query sees
    some key of every block: one stream round the ring, ``c - 1`` links, one call per step (the module's
    table). With a window, rank ``r``'s first chunk needs the blocks of ``r-1, r-2, …`` and its second
    chunk (late in the sequence, next to the second chunks of ``r+1, r+2, …``) those of ``r+1, r+2, …``,
    as far as the window reaches: the blocks travel both ways, each stream only as far as some rank
    needs it, and blocks nobody needs never travel. When the two streams would not be shorter than
    the ring (a window over a good part of the sequence), the one stream round the ring it is."""
    if window is not None and window >= 2 * c * h:
        window = None
    hops = (c - 1, 0)
    if window is not None:
        needs = [(other, src) for other in range(c) for src in range(c) if src != other
                 and _window_pairs(c, other, src, h, window)]  # fmt: skip
        forward = [(other - src) % c for other, src in needs]  # the links to it along each stream
        backward = [(src - other) % c for other, src in needs]
        streams = (max((f for f, b in zip(forward, backward) if f <= b), default=0),
                   max((b for f, b in zip(forward, backward) if b < f), default=0))  # fmt: skip
        hops = streams if sum(streams) < c - 1 else hops
    steps = [_Step(rank, 0, 0, _pairs(c, rank, rank, causal, h, window))]
    for hop in range(1, max(hops) + 1):
        for direction, count in zip((1, -1), hops):
            if hop <= count:
                src = (rank - direction * hop) % c
                steps.append(_Step(src, direction, hop, _pairs(c, rank, src, causal, h, window)))
    return _Plan(hops, tuple(steps))


def _merge(out_acc: torch.Tensor, lse_acc: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold a partial ``(out, lse)`` over other keys into the fp32 accumulators, in place."""
    new = torch.logaddexp(lse_acc, lse)
    out_acc.mul_(torch.exp(lse_acc - new).unsqueeze(-1)).add_(out.float() * torch.exp(lse - new).unsqueeze(-1))
    lse_acc.copy_(new)


def _segment_tables(segment_ids: torch.Tensor | None, group, plan_key: tuple) -> list | None:
    """The kernels' segment tables of every call of the ring (``_cross_segment_bounds`` of the call's query
    rows and key rows), or None without ``segment_ids``. Tokens are numbered by the segment (run of
    equal ids) they lie in over the whole sequence; a rank's tokens, and any chunk of them, are in
    sequence order, so the numbers are non-decreasing along every block."""
    if segment_ids is None:
        return None
    c, r = group_size(group), group_rank(group)
    # every layer of a forward passes the same ids: the tables are built once (and again if they change)
    key = ("ring_tables", c, r, *plan_key)
    return kept_on(segment_ids, key, lambda: _build_segment_tables(segment_ids, c, r, _ring_plan(c, r, *plan_key)))


def _build_segment_tables(segment_ids: torch.Tensor, c: int, r: int, plan: _Plan) -> list:
    seq_len = segment_ids.shape[1]
    number = run_starts(segment_ids).cumsum(1)  # 1, 2, … along each row
    held = [number[:, zigzag_positions(seq_len, c, rank, device=number.device)] for rank in range(c)]
    return [
        [_cross_segment_bounds(held[r][:, pair.rows], held[step.src][:, pair.cols]) for pair in step.pairs]
        for step in plan.steps
    ]


def _kv_ring(k: torch.Tensor, v: torch.Tensor, group, plan: _Plan):
    """Yield ``(index, step, kv)`` for every step of ``plan``, where ``kv [2, B, Hkv, L, D]`` is the block
    the step works on; each stream's next block is in flight while the caller works on this one."""
    kv = torch.stack((k, v))  # keys and values travel as one message
    index = {(step.direction, step.hop): i for i, step in enumerate(plan.steps)}
    both = all(plan.hops)  # two streams start from the own block: neither may receive into it
    held, spare, handle = {}, {}, {}

    def send_on(direction: int, hop: int) -> None:  # the stream's block to r+direction; the next one in
        if (direction, hop + 1) in index:
            if spare.get(direction) is None:
                spare[direction] = torch.empty_like(kv)
            handle[direction] = ring_exchange(held[direction], spare[direction], group, direction)
            record_event("send", OP, index[(direction, hop + 1)])

    for i, step in enumerate(plan.steps):
        if step.hop == 0:
            for direction in (1, -1):
                held[direction] = kv
                send_on(direction, 0)
        else:
            handle.pop(step.direction).wait()
            record_event("wait", OP, i)
            done = held[step.direction]  # sent on and waited for: free, unless the other stream still sends it
            held[step.direction] = spare[step.direction]
            spare[step.direction] = None if both and done is kv else done
            send_on(step.direction, step.hop)
        if step.pairs:
            record_event("gemm", OP, i)
        yield i, step, held[step.direction] if step.hop else kv


def _table(tables, step: int, i: int):
    return None if tables is None else tables[step][i]


def _ring_forward(q, k, v, group, scale: float, plan: _Plan, tables=None, softcap=None, sinks=None):
    b, hq, length, d = q.shape
    out_acc = torch.empty((b, hq, length, d), device=q.device, dtype=torch.float32)
    lse_acc = torch.empty((b, hq, length), device=q.device, dtype=torch.float32)
    for index, step, kv in _kv_ring(k, v, group, plan):
        for i, pair in enumerate(step.pairs):
            rows, cols = pair.rows, pair.cols
            out, lse = _block_forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], pair.causal, scale,
                                      _table(tables, index, i), pair.window, pair.offset, softcap)  # fmt: skip
            if pair.first:  # the own block: every row sees at least its own key
                out_acc[:, :, rows] = out
                lse_acc[:, :, rows] = lse
            else:
                _merge(out_acc[:, :, rows], lse_acc[:, :, rows], out, lse)
    if sinks is not None:  # each head's sink joins every row's softmax (see the module's notes)
        with_sink = _sink_lse(lse_acc, sinks)
        out_acc.mul_(torch.exp(lse_acc - with_sink).unsqueeze(-1))
        lse_acc = with_sink
    # [B, L, Hq, D] in memory, like flash attention's output for a layer's [B, L, Hq·D] projection
    out = torch.empty((b, length, hq, d), device=q.device, dtype=q.dtype).transpose(1, 2)
    out.copy_(out_acc)
    return out, lse_acc


def _ring_backward(q, k, v, out, lse, dout, group, scale: float, deterministic: bool, plan: _Plan, tables=None,
                   softcap=None):  # fmt: skip
    """dq stays home; the dK/dV of the rank's own block too. Along each stream an fp32 accumulator of the
    block travels one step behind the block: started where the block makes its first hop, received
    from ``r - direction`` and sent on to ``r + direction`` during the stream's next step, and after
    its last hop sent straight home to the block's owner."""
    dq_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    dkv_home = torch.zeros((2, *k.shape), device=q.device, dtype=torch.float32)  # the own block's, summed
    acc, incoming, handle, homes = {}, {}, {}, []
    dout = dout.to(q.dtype)
    for index, step, kv in _kv_ring(k, v, group, plan):
        shares = []
        for i, pair in enumerate(step.pairs):
            rows, cols = pair.rows, pair.cols
            dq, dk, dv = _block_backward(
                q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], out[:, :, rows], lse[:, :, rows],
                dout[:, :, rows], pair.causal, scale, deterministic, _table(tables, index, i), pair.window,
                pair.offset, softcap,
            )  # fmt: skip
            dq_acc[:, :, rows] += dq
            shares.append((pair.cols, dk, dv))
        direction = step.direction
        if step.hop == 0:
            target = dkv_home
        elif step.hop == 1:  # the block's first hop: its accumulator starts here
            target = acc[direction] = torch.zeros_like(dkv_home)
            incoming[direction] = torch.empty_like(dkv_home)
        else:  # the accumulator of this block, sent by r-direction at the stream's previous step
            done, sent_at = handle.pop(direction)
            done.wait()
            record_event("wait", DKV_OP, sent_at)
            acc[direction], incoming[direction] = incoming[direction], acc[direction]
            target = acc[direction]
        for cols, dk, dv in shares:
            target[0][:, :, cols] += dk
            target[1][:, :, cols] += dv
        if step.hop == 0:
            continue
        last = step.hop == plan.hops[0 if direction == 1 else 1]
        if last:  # home: the block came from r - direction·hop
            back = torch.empty_like(dkv_home)
            homes.append((ring_exchange(acc[direction], back, group, -direction * step.hop), back, index))
        else:
            handle[direction] = (ring_exchange(acc[direction], incoming[direction], group, direction), index)
        record_event("send", DKV_OP, index)
    for done, back, index in homes:
        done.wait()
        record_event("wait", DKV_OP, index)
        dkv_home += back
    return dq_acc.to(q.dtype), dkv_home[0].to(k.dtype), dkv_home[1].to(v.dtype)


def _sink_lse(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``logaddexp(lse, sink)``: each row's log-sum-exp with its head's sink in the softmax (fp32)."""
    return torch.logaddexp(lse, sinks.float()[None, :, None])


def _apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention output ``out`` over keys of log-sum-exp ``lse`` with the sinks joined to its softmax, differentiably
    (through ``lse`` too): ``out·Σ/(Σ + e^sink) = out·sigmoid(lse - sink)``."""
    return (out * torch.sigmoid(lse - sinks.float()[None, :, None]).unsqueeze(-1)).to(out.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, scale, deterministic, plan, tables, softcap):
        out, lse = _ring_forward(q, k, v, group, scale, plan, tables, softcap, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.group, ctx.scale, ctx.deterministic, ctx.plan, ctx.tables = group, scale, deterministic, plan, tables
        ctx.softcap = softcap
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = _ring_backward(
            q, k, v, out, lse, dout, ctx.group, ctx.scale, ctx.deterministic, ctx.plan, ctx.tables, ctx.softcap
        )
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:  # the sink's probability times -rowsum(dO·out')
            sink_p = torch.exp(sinks.float()[None, :, None] - lse)
            dsinks = -(sink_p * (dout.float() * out.float()).sum(-1)).sum((0, 2)).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None, None, None, None


def _gathered_attention(q, k, v, group, causal: bool, scale: float, deterministic: bool, segment_ids, window,
                        softcap, sinks=None):  # fmt: skip
    """The ring's result by its all-gather form (see the module's notes): what a compiled model runs."""
    c, r, length = group_size(group), group_rank(group), q.shape[2]
    zigzag = causal or segment_ids is not None  # in sequence order, or rank after rank: every query sees every key
    keys, values = (sequence_from_shares(t, group, 2) if zigzag else gather_from_sequence(t, group, 2) for t in (k, v))
    # the segments' numbers (non-decreasing along each row), to pair queries and keys by equal numbers
    number = None if segment_ids is None else run_starts(segment_ids).cumsum(1)
    attend = functools.partial(_attendapply_sinks, sinks=sinks, scale=scale, deterministic=deterministic,
                               softcap=softcap)  # fmt: skip
    if not causal:
        ids = None if number is None else (number[:, zigzag_positions(c * length, c, r, device=q.device)], number)
        return attend(q, keys, values, segment_ids=ids)
    h, outs = length // 2, []
    for chunk, rows in ((r, slice(0, h)), (2 * c - 1 - r, slice(h, length))):
        end = (chunk + 1) * h  # the chunk sees the keys before its end (bottom-right aligned causal mask)
        ids = None if number is None else (number[:, chunk * h : end], number[:, :end])
        outs.append(attend(q[:, :, rows], keys[:, :, :end], values[:, :, :end], causal=True, window=window,
                           segment_ids=ids))  # fmt: skip
    return torch.cat(outs, dim=2)


def _attendapply_sinks(q, k, v, sinks=None, **kwargs) -> torch.Tensor:
    """Flash attention (heads wider than its kernels': :func:`wide_attention`), with ``sinks`` (None: none) joined to
    its softmax through its log-sum-exp."""
    attend = flash_attention if q.shape[-1] in HEAD_DIMS else wide_attention
    if sinks is None:
        return attend(q, k, v, **kwargs)
    out, lse = attend(q, k, v, return_lse=True, **kwargs)
    return _apply_sinks(out, lse, sinks)


def _check_sinks(sinks, q) -> None:
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        got = sinks.dtype if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise TypeError(f"ring_attention: sinks must be None or a floating-point torch.Tensor, received {got}")
    if tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"ring_attention: sinks must hold one logit per query head, shape ({q.shape[1]},), received "
                         f"{tuple(sinks.shape)}")  # fmt: skip
    if sinks.device != q.device:
        raise ValueError(f"ring_attention: sinks must be on q's device {q.device}, received {sinks.device}")


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
                   segment_ids=None, window=None, softcap=None, sinks=None) -> torch.Tensor:  # fmt: skip
    """Attention over a sequence split across the ranks of ``group``; differentiable.

    Args:
        q: ``[B, Hq, L, D]``, this rank's queries; k, v: ``[B, Hkv, L, D]``, its keys and values (GQA as
            in :func:`~tessel.kernels.attention.flash_attention`). Every rank passes the same shapes. ``D``
            one of the kernels' head dims, or any above the largest (Gemma 4's 512), whose blocks run in
            PyTorch by tiles of query rows (``wide_attention``), merged and sent round the ring as the rest.
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
        window: ``None``, or a number of keys ``W ≥ 1`` with ``causal``: sliding-window attention, the
            token at position ``i`` attending to positions ``i - W < j ≤ i`` (flash attention's
            ``window``; combines with ``segment_ids``). Pairs of chunks wholly outside every window are
            skipped, and the key/value blocks travel only as far as the window reaches, both ways
            round the ring (see the module's notes): with ``W ≤ h + 1``, ``h = L/2``, each rank
            sends at most two blocks, whatever ``c`` is.
        softcap: ``None``, or a cap ``c > 0`` for soft-capped logits ``c·tanh(s/c)`` (flash attention's
            ``softcap``): every block runs capped, and the partial results merge through the capped
            log-sum-exps.
        sinks: ``None``, or ``[Hq]`` logits, one per query head, that join every row's softmax and attend to
            nothing (GPT-OSS's attention sinks): each row's output is scaled by ``Σ/(Σ + e^sink)``.
            Differentiable; applied once the partial results are merged.

    Returns:
        ``[B, Hq, L, D]`` in q's dtype, laid out ``[B, L, Hq, D]`` in memory: the attention output of
        this rank's queries over the whole sequence. The partial results of the ring are merged in fp32
        and rounded once.
    """
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    _validate_attention("ring_attention", q, k, v, causal, scale, dtypes, wide=True)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"ring_attention: q and k must hold the same tokens (one query, key and value per local "
                         f"token), received q {tuple(q.shape)} and k {tuple(k.shape)}")  # fmt: skip
    if not isinstance(deterministic, bool):
        raise TypeError(f"ring_attention: deterministic must be a bool, received {type(deterministic).__name__}")
    _check_window("ring_attention", window, causal)
    _check_softcap("ring_attention", softcap)
    _check_sinks(sinks, q)
    c = group_size(group)
    _check_segment_ids(segment_ids, q, c * q.shape[2])
    if (causal or segment_ids is not None) and q.shape[2] % 2 and c > 1:
        raise ValueError(f"ring_attention: under the causal mask or with segment_ids each rank holds two equal "
                         f"chunks (see split_sequence), so the local length must be even, received "
                         f"{q.shape[2]}")  # fmt: skip
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if c == 1 or q.shape[2] == 0:
        return _attendapply_sinks(q, k, v, sinks, causal=causal, scale=scale, deterministic=deterministic,
                                  segment_ids=segment_ids, window=window, softcap=softcap)  # fmt: skip
    check_grid("ring_attention", q)
    if torch.compiler.is_compiling():
        return _gathered_attention(q, k, v, group, causal, scale, deterministic, segment_ids, window, softcap, sinks)
    plan_key = (causal, q.shape[2] // 2, window)
    plan = _ring_plan(c, group_rank(group), *plan_key)
    tables = _segment_tables(segment_ids, group, plan_key)
    learns = (q, k, v) if sinks is None else (q, k, v, sinks)
    if torch.is_grad_enabled() and any(t.requires_grad for t in learns):
        return _RingAttention.apply(q, k, v, sinks, group, scale, deterministic, plan, tables, softcap)
    return _ring_forward(q, k, v, group, scale, plan, tables, softcap, sinks)[0]
