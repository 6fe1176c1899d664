"""Raw collectives behind one small transport interface, with a byte counter and an event log.

Every byte tessel moves between ranks goes through the functions here, so:

- :func:`count_bytes` can report what this rank sent and received during a region of code (tests and
  benchmarks compare it with the ring formulas: (t-1)/t·|X| for all-gather and reduce-scatter,
  2(t-1)/t·|X| for all-reduce);
- :func:`record_events` can record the order in which an overlapped op issues transfers and GEMMs,
  which is how tests prove the overlap without timing anything;
- the transport (``torch.distributed`` today: NCCL or gloo, async work handles, batched P2P) can be
  replaced by a device-signalled one without touching the layers.

Raw collectives return ``(tensor, work)``; ``work.wait()`` orders later work after them (on CUDA it
makes the current stream wait on the communication stream, with no host synchronisation).
Collective byte counts are the ring algorithm's, which is what NCCL moves for large messages.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..kernels._dispatch import opaque_to_compile

__all__ = [
    "ByteCounter",
    "EventLog",
    "all_gather",
    "all_reduce",
    "all_reduce_max",
    "all_to_all",
    "check_peer_group",
    "count_bytes",
    "group_rank",
    "group_size",
    "record_event",
    "record_events",
    "reduce_scatter",
    "ring_exchange",
    "subgroup",
]


# ---------------------------------------------------------------------------------------------------- accounting


@dataclass
class ByteCounter:
    """Bytes this rank sent and received through tessel's collectives while the counter was active."""

    sent: int = 0
    received: int = 0


@dataclass
class EventLog:
    """Ordered ``(kind, op, step)`` tuples, e.g. ``("send", "all_gather_matmul", 1)``, ``("gemm", ..., 0)``."""

    events: list[tuple[str, str, int]] = field(default_factory=list)

    def index(self, kind: str, op: str, step: int) -> int:
        return self.events.index((kind, op, step))


# The active counters and logs are process-wide, not per thread or per context: on CUDA the backward of
# an autograd Function runs on an autograd worker thread, which sees neither the caller's thread-locals
# nor its contextvars, and its communication must still be counted by the block around backward().
_counters: list[ByteCounter] = []
_logs: list[EventLog] = []


@contextlib.contextmanager
def _active(registry: list, item):
    registry.append(item)
    try:
        yield item
    finally:
        # By identity: two counters with equal counts compare equal.
        del registry[next(i for i, active in enumerate(registry) if active is item)]


def count_bytes() -> contextlib.AbstractContextManager[ByteCounter]:
    """Count the bytes this rank sends and receives through tessel's collectives inside the block.

    Counters nest (each active one counts) and see collectives issued from any thread of the process
    while they are active, including autograd's backward threads.
    """
    return _active(_counters, ByteCounter())


def record_events() -> contextlib.AbstractContextManager[EventLog]:
    """Record the order in which overlapped ops issue their transfers and GEMMs inside the block."""
    return _active(_logs, EventLog())


def record_event(kind: str, op: str, step: int) -> None:
    """Append ``(kind, op, step)`` to every active :func:`record_events` log; a no-op when none is active."""
    for log in tuple(_logs):
        log.events.append((kind, op, step))


def _account(sent: int, received: int) -> None:
    for counter in tuple(_counters):
        counter.sent += sent
        counter.received += received


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------------------------------------------- groups


def group_size(group: dist.ProcessGroup | None) -> int:
    """Size of ``group``; a world of one when no process group exists."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def check_peer_group(group, tp_group, *, caller: str, name: str, why: str) -> int | None:
    """The size of ``group`` (None when it is None), a group whose ranks hold other tokens than this rank's
    tensor-parallel peers: refused unless it is a ProcessGroup that shares no rank but this one with ``tp_group``
    (``None``: every rank). ``name`` is the argument's name, ``why`` says what its ranks must be."""
    if group is None:
        return None
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{caller}: {name} must be None or a torch.distributed ProcessGroup, received "
                        f"{type(group).__name__}")  # fmt: skip
    tp_ranks = dist.get_process_group_ranks(dist.group.WORLD if tp_group is None else tp_group)
    shared = set(dist.get_process_group_ranks(group)) & set(tp_ranks)
    if shared != {dist.get_rank()}:
        raise ValueError(f"{caller}: tp_group and {name} share the ranks {sorted(shared)}: {why}")
    return group_size(group)


_SUBGROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # {group: {its ranks' global ranks: subgroup}}


def subgroup(group: dist.ProcessGroup | None, first: int, size: int) -> dist.ProcessGroup | None:
    """The ranks ``[first, first + size)`` of ``group`` (``None``: every rank) as a process group of their own:
    ``group`` itself when they are all of it, otherwise created once (the first call, which those ranks alone make,
    together: ``use_local_synchronization``) and kept for ``group``'s lifetime. ``first`` and ``size`` are taken as
    they are: the callers compute them from the group's size. Raises ``ValueError`` for ranks outside the group."""
    t = group_size(group)
    for name, value in (("first", first), ("size", size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"subgroup: {name} must be an int, received {type(value).__name__}")
    if first < 0 or size < 1 or first + size > t:
        raise ValueError(f"subgroup: ranks [first, first + size) must lie in the group's {t} ranks, received "
                         f"first={first}, size={size}")  # fmt: skip
    if first == 0 and size == t:
        return group
    parent = dist.group.WORLD if group is None else group
    ranks = tuple(dist.get_process_group_ranks(parent)[first : first + size])
    made = _SUBGROUPS.setdefault(parent, {})
    if ranks not in made:
        made[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return made[ranks]


def _global_rank(group: dist.ProcessGroup | None, rank_in_group: int) -> int:
    return dist.get_global_rank(group, rank_in_group) if group is not None else rank_in_group


# ---------------------------------------------------------------------------------------------------- transport


class _Done:
    """The handle of an operation that completed synchronously (a world of one)."""

    def wait(self) -> bool:
        return True


class _Handles:
    def __init__(self, works):
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True


@opaque_to_compile
def _ring_exchange(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup | None, shift: int = 1):
    """The transport behind :func:`ring_exchange`, for groups of more than one rank."""
    size, rank = group_size(group), group_rank(group)
    if shift % size == 0:
        recv.copy_(send)
        return _Done()
    dst = _global_rank(group, (rank + shift) % size)
    src = _global_rank(group, (rank - shift) % size)
    ops = [dist.P2POp(dist.isend, send, dst, group), dist.P2POp(dist.irecv, recv, src, group)]
    _account(_nbytes(send), _nbytes(recv))
    return _Handles(dist.batch_isend_irecv(ops))


@opaque_to_compile
def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False):
    """The transport behind :func:`all_reduce`, for groups of more than one rank."""
    size = group_size(group)
    moved = 2 * (size - 1) * _nbytes(x) // size
    _account(moved, moved)
    work = dist.all_reduce(x, group=group, async_op=async_op)
    return x, work if async_op else _Done()


_all_gather_base = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_base = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@opaque_to_compile
def _all_gather(x: torch.Tensor, group: dist.ProcessGroup | None, out: torch.Tensor | None = None, async_op=False):
    """The transport behind :func:`all_gather`, for groups of more than one rank."""
    size = group_size(group)
    if out is None:
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    _account((size - 1) * _nbytes(x), (size - 1) * _nbytes(x))
    work = _all_gather_base(out, x.contiguous(), group=group, async_op=async_op)
    return out, work if async_op else _Done()


@opaque_to_compile
def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup | None, send_counts: list[int], recv_counts: list[int]):
    """The transport behind :func:`all_to_all`, for groups of more than one rank."""
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    row = x[:1].numel() * x.element_size() if x.dim() > 1 else x.element_size()
    me = group_rank(group)
    _account((sum(send_counts) - send_counts[me]) * row, (sum(recv_counts) - recv_counts[me]) * row)
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
    return out, _Done()


@opaque_to_compile
def _reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup | None, out: torch.Tensor | None = None, async_op=False):
    """The transport behind :func:`reduce_scatter`, for groups of more than one rank."""
    size = group_size(group)
    if out is None:
        out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    _account((size - 1) * _nbytes(out), (size - 1) * _nbytes(out))
    work = _reduce_scatter_base(out, x.contiguous(), group=group, async_op=async_op)
    return out, work if async_op else _Done()


# ---------------------------------------------------------------------------------------------------- traced transport
# Under torch.compile the collectives of several ranks are torch's functional collectives, which a graph holds
# (the transports above are opaque to it): the compiled model keeps one graph across its collectives, and the
# compiler may move their waits. Their bytes are not counted (count_bytes sees eager calls only), and
# ring_exchange (point to point) has no traced form: under compile the overlapped ops run their rings inside
# custom operators' nodes (overlap_ops.py), where these eager transports run and are counted.


def _traced_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return dist.group.WORLD if group is None else group


def _traced_all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None):
    return x.copy_(funcol.all_reduce(x, "sum", _traced_group(group))), _Done()


def _traced_all_gather(x: torch.Tensor, group: dist.ProcessGroup | None, out: torch.Tensor | None):
    gathered = funcol.all_gather_tensor(x.contiguous(), 0, _traced_group(group))
    return (gathered if out is None else out.copy_(gathered)), _Done()


def _traced_reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup | None, out: torch.Tensor | None):
    scattered = funcol.reduce_scatter_tensor(x.contiguous(), "sum", 0, _traced_group(group))
    return (scattered if out is None else out.copy_(scattered)), _Done()


# ---------------------------------------------------------------------------------------------------- entry points
# A world of one moves nothing: those calls return before the opaque transports above, so that a compiled model
# of one rank (tensor-parallel layers at t = 1) keeps one graph. Several ranks under compile take the traced
# transport.


def ring_exchange(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup | None, shift: int = 1):
    """Send ``send`` to the rank ``shift`` places ahead in the ring and receive ``recv`` from the one behind.

    One batched isend/irecv pair; returns a handle whose ``wait()`` completes both. Both tensors must
    be contiguous. When ``shift`` is a multiple of the group size (always, in a world of one) the rank
    exchanges with itself: ``recv`` is a copy of ``send`` and nothing is moved.
    """
    if shift % group_size(group) == 0:
        recv.copy_(send)
        return _Done()
    return _ring_exchange(send, recv, group, shift)


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False):
    """Sum ``x`` in place over ``group``; returns ``(x, work)``. Ring bytes: 2(t-1)/t·|x| each way."""
    if group_size(group) == 1:
        return x, _Done()
    if torch.compiler.is_compiling():
        return _traced_all_reduce(x, group)
    return _all_reduce(x, group, async_op)


@opaque_to_compile
def all_reduce_max(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The elementwise maximum of ``x`` over ``group``, in place, waited for: a few control numbers (the largest
    magnitude of an fp8 tensor's shards, which must share one scale). Returns ``x``."""
    size = group_size(group)
    if size > 1:
        moved = 2 * (size - 1) * _nbytes(x) // size
        _account(moved, moved)
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def _own_copy(x: torch.Tensor, out: torch.Tensor | None):
    """What a world of one gathers or reduce-scatters: ``x`` itself, in a new tensor or in ``out``."""
    return (x.clone(memory_format=torch.contiguous_format) if out is None else out.copy_(x)), _Done()


def all_gather(x: torch.Tensor, group: dist.ProcessGroup | None, out: torch.Tensor | None = None, async_op=False):
    """Concatenate every rank's ``x`` along dim 0 (into ``out`` if given); returns ``(out, work)``."""
    if group_size(group) == 1:
        return _own_copy(x, out)
    if torch.compiler.is_compiling():
        return _traced_all_gather(x, group, out)
    return _all_gather(x, group, out, async_op)


def reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup | None, out: torch.Tensor | None = None, async_op=False):
    """Sum ``x`` over ranks and keep this rank's 1/t block of dim 0; returns ``(out, work)``."""
    size = group_size(group)
    if size == 1:
        return _own_copy(x, out)
    if x.shape[0] % size:
        raise ValueError(f"reduce_scatter: dim 0 of x ({x.shape[0]}) is not divisible by the group size {size}")
    if torch.compiler.is_compiling():
        return _traced_reduce_scatter(x, group, out)
    return _reduce_scatter(x, group, out, async_op)


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup | None, send_counts: list[int], recv_counts: list[int]):
    """Rows of ``x`` to every rank: the first ``send_counts[0]`` rows to rank 0, the next ``send_counts[1]`` to
    rank 1…; returns ``(out, work)``, ``out`` the ``sum(recv_counts)`` rows received, rank after rank. The
    rows a rank keeps for itself are not counted as traffic."""
    size = group_size(group)
    if len(send_counts) != size or len(recv_counts) != size or sum(send_counts) != x.shape[0]:
        raise ValueError(f"all_to_all: send_counts and recv_counts need {size} entries and send_counts must sum to "
                         f"the {x.shape[0]} rows of x, received {send_counts} and {recv_counts}")  # fmt: skip
    if size == 1:
        if list(recv_counts) != list(send_counts):
            raise ValueError(f"all_to_all: in a world of one the rank receives what it sends: recv_counts must equal "
                             f"send_counts {send_counts}, received {recv_counts}")  # fmt: skip
        return x.clone(memory_format=torch.contiguous_format), _Done()
    if torch.compiler.is_compiling():
        received = funcol.all_to_all_single(x.contiguous(), list(recv_counts), list(send_counts), _traced_group(group))
        return received, _Done()
    return _all_to_all(x, group, send_counts, recv_counts)
