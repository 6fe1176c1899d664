"""Differentiable collectives: the Megatron f/g operators and the sequence-parallel pair.

Each op is an ``autograd.Function`` built only on the raw collectives of :mod:`.comm`, so
:func:`~tessel.parallel.comm.count_bytes` sees every byte it moves, forward and backward. Every op takes
its group explicitly; ``group=None`` means the default group, or a world of one when no process group
exists (then every op returns a copy of, or a view on, its input, and the same code runs).

Legend: ``t`` is the group size, ``r`` this rank's index in the group, ``x_q`` the input on rank ``q``,
``g_q`` the gradient arriving on rank ``q``. ``chunk_r(X)`` is the ``r``-th of ``t`` equal, contiguous
slices of ``X`` along ``dim``; ``cat_q`` concatenates along ``dim`` in rank order.

=============================  ==========================  ===============================
op                             forward, on rank r          backward, on rank r
=============================  ==========================  ===============================
copy_to_tp (Megatron "f")      x                           all-reduce: sum_q g_q
reduce_from_tp (Megatron "g")  all-reduce: sum_q x_q       g_r
gather_from_sequence           all-gather: cat_q x_q       reduce-scatter: chunk_r(sum_q g_q)
reduce_scatter_to_sequence     chunk_r(sum_q x_q)          all-gather: cat_q g_q
scatter_to_sequence            chunk_r(x)                  all-gather: cat_q g_q
gather_from_tp                 all-gather: cat_q x_q       chunk_r(g_r)
split_to_tp                    chunk_r(x)                  all-gather: cat_q g_q
=============================  ==========================  ===============================

The raw all-gather and reduce-scatter work on dim 0. For another ``dim`` the ``t`` blocks are laid out
along a new leading axis (``[t, ..., n, ...]``) and folded into ``dim`` afterwards, which costs one
copy on one side and none on the other, instead of a copy on both sides of a plain ``movedim``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import all_gather, all_reduce, all_to_all, group_rank, group_size, reduce_scatter
from .exchange_op import traced_exchange_rows

__all__ = [
    "copy_to_tp",
    "exchange_rows",
    "gather_from_sequence",
    "gather_from_tp",
    "reduce_from_tp",
    "reduce_scatter_to_sequence",
    "scatter_to_sequence",
    "split_to_tp",
    "sum_over_ranks",
]

Group = dist.ProcessGroup | None


# ---------------------------------------------------------------------------------------------------- validation


def _check_tensor(op: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, received {type(x).__name__}")


def _normalize_dim(op: str, x: torch.Tensor, dim) -> int:
    _check_tensor(op, x)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{op}: dim must be an int, received {type(dim).__name__} {dim!r}")
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"{op}: dim must be in [{-x.ndim}, {x.ndim}) for a {x.ndim}-d tensor, received {dim}")
    return dim % x.ndim


def _check_divisible(op: str, x: torch.Tensor, dim: int, group: Group) -> None:
    size = group_size(group)
    if x.shape[dim] % size:
        raise ValueError(
            f"{op}: size {x.shape[dim]} of dim {dim} (shape {tuple(x.shape)}) is not divisible by the group size {size}"
        )


# ---------------------------------------------------------------------------------------------------- data movement


def _all_reduced(x: torch.Tensor, group: Group) -> torch.Tensor:
    """A new tensor holding the sum of ``x`` over ``group`` (the raw all-reduce works in place)."""
    out = x.clone(memory_format=torch.contiguous_format)
    all_reduce(out, group)
    return out


def _owned(y: torch.Tensor) -> torch.Tensor:
    """``y`` if it owns its memory, else a contiguous copy. An autograd Function's output that is a view (of an
    input, or of a tensor made inside) cannot be modified in place, which models do to these results (Llama 4
    adds its routed experts onto the shared expert's output with ``add_``)."""
    if torch.compiler.is_compiling():  # a graph has no views to ask about: a copy the compiler may elide
        return y.clone(memory_format=torch.contiguous_format)
    return y if not y._is_view() else y.clone(memory_format=torch.contiguous_format)


def _gathered(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """``[..., n, ...]`` on each rank -> ``[..., t*n, ...]`` with rank q's block at ``q*n`` along ``dim``."""
    if dim == 0:
        return all_gather(x.contiguous(), group)[0]
    blocks, _ = all_gather(x.contiguous().unsqueeze(0), group)  # [t, ..., n, ...]
    return _owned(blocks.movedim(0, dim).flatten(dim, dim + 1))  # a copy, but where dims of size 1 lead


def _reduce_scattered(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """``[..., t*n, ...]`` -> ``[..., n, ...]``: block ``r`` along ``dim``, summed over ranks."""
    if dim == 0:
        return reduce_scatter(x.contiguous(), group)[0]
    size = group_size(group)
    blocks = x.unflatten(dim, (size, x.shape[dim] // size)).movedim(dim, 0)  # [t, ..., n, ...]
    out = x.new_empty(blocks.shape[1:])
    reduce_scatter(blocks.contiguous(), group, out=out.unsqueeze(0))  # [1, ..., n, ...]
    return out


def _own_chunk(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Block ``r`` of ``t`` along ``dim``, in memory of its own (never a view of ``x``); no communication."""
    n = x.shape[dim] // group_size(group)
    return _owned(x.narrow(dim, group_rank(group) * n, n).contiguous())


# ---------------------------------------------------------------------------------------------------- functions


class _ExchangeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, send_counts, recv_counts):
        ctx.group, ctx.send_counts, ctx.recv_counts = group, send_counts, recv_counts
        return all_to_all(x, group, send_counts, recv_counts)[0]

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad.contiguous(), ctx.group, ctx.recv_counts, ctx.send_counts)[0], None, None, None


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduced(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduced(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduced(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduced(grad, ctx.group), None


class _DimCollective(torch.autograd.Function):
    """``fwd(x, group, dim)`` forward and ``bwd(grad, group, dim)`` backward: one Function for each pair of
    data movements along ``dim`` (all-gather / reduce-scatter / own chunk) that the public ops below name."""

    @staticmethod
    def forward(ctx, x, group, dim, fwd, bwd):
        ctx.group, ctx.dim, ctx.bwd = group, dim, bwd
        return fwd(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.bwd(grad, ctx.group, ctx.dim), None, None, None, None


# ---------------------------------------------------------------------------------------------------- public ops


def exchange_rows(x: torch.Tensor, group: Group, send_counts, recv_counts, *, rows: int | None = None) -> torch.Tensor:
    """Rows to other ranks and back, an all-to-all (expert parallelism's token dispatch).

    Forward: the first ``send_counts[0]`` rows of ``x`` go to rank 0, the next ``send_counts[1]`` to rank 1…;
    the result holds the ``sum(recv_counts)`` rows received, rank after rank. Backward: the gradient rows
    travel back the same way reversed (``recv_counts`` sent, ``send_counts`` received), so each row's
    gradient reaches the rank it came from.

    The counts are lists of ints or ``[t]`` integer tensors (best on the CPU: they are read on the host).
    Under ``torch.compile`` tensor counts make the exchange one graph node, ``tessel::exchange_rows``
    (:mod:`.exchange_op`), whose output length the data decide unless ``rows`` (the number of rows received,
    where the caller knows it) says.
    """
    _check_tensor("exchange_rows", x)
    if isinstance(send_counts, torch.Tensor) or isinstance(recv_counts, torch.Tensor):
        if not (isinstance(send_counts, torch.Tensor) and isinstance(recv_counts, torch.Tensor)):
            raise TypeError(f"exchange_rows: send_counts and recv_counts must both be lists or both tensors, "
                            f"received {type(send_counts).__name__} and {type(recv_counts).__name__}")  # fmt: skip
        if torch.compiler.is_compiling():
            return traced_exchange_rows(x, group, send_counts, recv_counts, rows)
        send_counts, recv_counts = send_counts.tolist(), recv_counts.tolist()
    if rows is not None and sum(recv_counts) != rows:
        raise ValueError(f"exchange_rows: recv_counts {list(recv_counts)} must sum to rows={rows}")
    return _ExchangeRows.apply(x, group, list(send_counts), list(recv_counts))


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron's "f", entering a tensor-parallel region with an input replicated on every TP rank.

    Forward: identity (``x`` itself, no communication). Backward: all-reduce (sum) of the gradient over
    ``group``, because each rank's part of the region contributed a partial gradient of the same ``x``.
    """
    _check_tensor("copy_to_tp", x)
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron's "g", leaving a tensor-parallel region whose ranks hold partial sums (row-parallel output).

    Forward: all-reduce (sum) of ``x`` over ``group`` into a new tensor (``x`` is not modified).
    Backward: identity. What follows is replicated on every rank, so each rank's incoming gradient is
    already the complete gradient of the sum.
    """
    _check_tensor("reduce_from_tp", x)
    return _ReduceFromTP.apply(x, group)


def sum_over_ranks(x: torch.Tensor, group: Group) -> torch.Tensor:
    """A sum over ranks that each compute a loss of their own from it (a statistic of every context-parallel
    rank's tokens, whose gradients are then averaged over the group).

    Forward: all-reduce (sum) of ``x`` into a new tensor. Backward: all-reduce of the gradient too, because
    every rank's copy of the sum contributed to each rank's ``x``.
    """
    _check_tensor("sum_over_ranks", x)
    return _SumOverRanks.apply(x, group)


def gather_from_sequence(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Sequence-parallel shard -> full sequence, entering a tensor-parallel region (column-parallel input).

    Forward: all-gather along ``dim``: ``[..., n, ...]`` on each rank -> ``[..., t*n, ...]`` in rank
    order. Backward: reduce-scatter along ``dim``: the ranks' gradients of the full tensor are partial
    (each rank used it with its own weight shard), so they are summed and each rank keeps its block.
    """
    dim = _normalize_dim("gather_from_sequence", x, dim)
    return _DimCollective.apply(x, group, dim, _gathered, _reduce_scattered)


def reduce_scatter_to_sequence(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Partial sums of the full sequence -> sequence-parallel shard, leaving a row-parallel region.

    Forward: reduce-scatter along ``dim``: ``[..., t*n, ...]`` partial sums -> this rank's
    ``[..., n, ...]`` block of the sum. Backward: all-gather of the shard gradients along ``dim``; the
    gradient of every partial sum is the full gradient of the sum. ``x.shape[dim]`` must be divisible
    by the group size.
    """
    dim = _normalize_dim("reduce_scatter_to_sequence", x, dim)
    _check_divisible("reduce_scatter_to_sequence", x, dim, group)
    return _DimCollective.apply(x, group, dim, _reduce_scattered, _gathered)


def scatter_to_sequence(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Replicated full sequence -> sequence-parallel shard (e.g. after the embedding).

    Forward: this rank's ``[..., n, ...]`` chunk of ``x`` along ``dim``, no communication. Backward:
    all-gather of the shard gradients along ``dim``, so every rank holds the full gradient of the
    replicated ``x``. ``x.shape[dim]`` must be divisible by the group size.
    """
    dim = _normalize_dim("scatter_to_sequence", x, dim)
    _check_divisible("scatter_to_sequence", x, dim, group)
    return _DimCollective.apply(x, group, dim, _own_chunk, _gathered)


def gather_from_tp(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Column-parallel output shard -> full output replicated on every rank (``gather_output=True``).

    Forward: all-gather along ``dim`` (default: the feature dim). Backward: this rank's chunk of the
    gradient along ``dim``, no communication: what follows is replicated, so every rank's gradient of
    the full tensor is already complete.
    """
    dim = _normalize_dim("gather_from_tp", x, dim)
    return _DimCollective.apply(x, group, dim, _gathered, _own_chunk)


def split_to_tp(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Replicated full tensor -> this rank's shard (row-parallel input with ``input_is_parallel=False``).

    Forward: this rank's chunk of ``x`` along ``dim``, no communication. Backward: all-gather of the
    shard gradients along ``dim``. ``x.shape[dim]`` must be divisible by the group size.
    """
    dim = _normalize_dim("split_to_tp", x, dim)
    _check_divisible("split_to_tp", x, dim, group)
    return _DimCollective.apply(x, group, dim, _own_chunk, _gathered)
