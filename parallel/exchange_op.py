"""Expert parallelism's token exchange as a ``torch.library`` custom operator: how a compiled mixture of experts
keeps its dispatch in the graph.

Eagerly, :func:`~.collectives.exchange_rows` reads the per-rank row counts on the host, once per dispatch. A graph
cannot read a tensor on the host, and the rows a rank receives depend on where the router sent every token, so
under ``torch.compile`` an exchange with tensor counts is one node, ``tessel::exchange_rows``, which reads them
when it runs. Its fake implementation gives the received rows an
unbacked size (a symbol whose value only the running graph knows) unless the caller knows it (``rows``: the way
back, whose row count is the number of routes the rank sent), and its registered backward is the exchange the
other way. So a model whose experts live on several ranks compiles whole (``fullgraph=True``).

The node reads the counts on the host, as the eager dispatch does, which waits for the device unless they are
there already (tessel's callers copy them to the host once per dispatch, so the way back and both backwards
read them without a wait): inductor's CUDA graphs ("reduce-overhead") leave it out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from .comm import _all_to_all, group_size

__all__ = ["exchange_rows_op", "traced_exchange_rows"]

_HOST_READ = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("tessel::exchange_rows", mutates_args=(), tags=_HOST_READ)
def exchange_rows_op(x: Tensor, send_counts: Tensor, recv_counts: Tensor, group_name: str, rows: int | None) -> Tensor:
    """The rows received (``sum(recv_counts)``, rank after rank) after sending the first ``send_counts[0]`` rows
    of ``x`` to rank 0 of the group named ``group_name``, the next ``send_counts[1]`` to rank 1…; the counts
    are ``[t]`` integer tensors; ``rows``, when given, is the number of rows received."""
    send, recv = torch.stack((send_counts, recv_counts)).tolist()  # the one read on the host
    if rows is not None and sum(recv) != rows:
        raise ValueError(f"tessel::exchange_rows: recv_counts {recv} must sum to rows={rows}")
    return _all_to_all(x.contiguous(), _resolve_process_group(group_name), send, recv)[0]


@exchange_rows_op.register_fake
def _(x, send_counts, recv_counts, group_name, rows):
    if rows is None:  # data decide it: a symbol the graph's shapes carry, at least 0
        rows = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty((rows, *x.shape[1:]))


def _setup(ctx, inputs, output):
    x, send_counts, recv_counts, group_name, _ = inputs
    ctx.save_for_backward(send_counts, recv_counts)
    ctx.group_name, ctx.rows = group_name, x.shape[0]


def _backward(ctx, grad):
    send_counts, recv_counts = ctx.saved_tensors
    back = exchange_rows_op(grad.contiguous(), recv_counts, send_counts, ctx.group_name, ctx.rows)
    return back, None, None, None, None


exchange_rows_op.register_autograd(_backward, setup_context=_setup)


def traced_exchange_rows(
    x: Tensor, group: dist.ProcessGroup | None, send_counts: Tensor, recv_counts: Tensor, rows: int | None = None
) -> Tensor:
    """:func:`~.collectives.exchange_rows` with the counts as ``[t]`` integer tensors on any device, for code that
    ``torch.compile`` traces: one ``tessel::exchange_rows`` node (differentiable), or in a world of one ``x``
    itself. ``rows``: the number of rows received where the caller knows it (otherwise data decide it)."""
    if group_size(group) == 1:
        return x
    name = (dist.group.WORLD if group is None else group).group_name
    return exchange_rows_op(x, send_counts, recv_counts, name, rows)
