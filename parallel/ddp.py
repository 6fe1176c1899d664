"""DDP: data-parallel training with gradients reduced bucket by bucket while backward still runs.

Legend: ``N`` data-parallel size, ``P`` a bucket's padded numel, ``s = P/N`` one rank's shard of it.

Parameters and gradients live in flat, shard-aligned buckets (:mod:`.flat`). A gradient hook on each
parameter copies a freshly allocated gradient into its bucket slot (or finds autograd already
accumulated into the slot, when ``p.grad`` is the slot's view) and, as soon as every parameter of a
bucket has its gradient, launches that bucket's asynchronous reduction. Buckets are launched in bucket
order on every rank, so collectives always match. A callback queued on the autograd engine waits for
all of them when backward ends and averages::

    backward:  grads of b0 | grads of b1 | grads of b2 |
    comm:                  | reduce b0   | reduce b1   | reduce b2 | wait, average (end of backward)

Without an optimizer attached the reduction is an all-reduce and ``p.grad`` is the averaged gradient
(a view into the bucket), so any torch optimizer works. :class:`~tessel.parallel.zero.ZeroAdam` switches
the wrapper to ZeRO-1/2: each bucket is reduce-scattered into this rank's ``[s]`` gradient shard (in
place, a view of the full gradient, for ZeRO-1; a separate shard, with the ``[P]`` gradient freed after
the reduction, for ZeRO-2), and ``p.grad`` is left ``None``: the averaged gradient exists only as shards.

Expert parameters (``p.expert_parallel = True``) hold different experts on the ranks of an
expert-parallel (ep) group and the same experts on the ranks of the expert-data-parallel group
``expert_group`` (size ``N/ep``; :attr:`~tessel.parallel.dims.ParallelDims.expert_dp_group`). They live
in buckets of their own whose every collective (reduction, ZeRO shards and all-gather, the broadcast at
construction) runs over ``expert_group``. The reduction sums over ``expert_group`` but still divides by
``N``: the loss is the mean of all ``N`` ranks' losses, and the all-to-all's backward has already summed
the contributions of the ep group's ranks to each expert's gradient::

    dense:   g = (1/N) · Σ_{N ranks} g_r           all-reduce over group, ÷ N
    expert:  g = (1/N) · Σ_{expert_group} g_r      all-reduce over expert_group, ÷ N
"""

from __future__ import annotations

import contextlib
import numbers

import torch
import torch.distributed as dist
from torch import nn

from .comm import all_gather, all_reduce, group_rank, group_size, reduce_scatter
from .flat import Bucket, backward_order, flatten_into_buffers, is_expert, make_buckets, shard_tensors

__all__ = ["DDP", "broadcast_from_first_rank", "check_data_parallel_args", "check_expert_group"]

OWNER_ATTR = "_tessel_data_parallel"  # set on every parameter a DDP or FSDP wrapper manages


def check_data_parallel_args(name: str, module, group) -> None:
    """The checks DDP and FSDP share: a module, a process group, parameters not wrapped yet."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{name}: module must be an nn.Module, received {type(module).__name__}")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{name}: group must be None or a torch.distributed ProcessGroup, received {type(group).__name__}"
        )
    for pname, p in module.named_parameters():
        owner = getattr(p, OWNER_ATTR, None)
        if owner is not None:
            raise ValueError(f"{name}: parameter {pname!r} is already managed by a {type(owner).__name__} wrapper")


def broadcast_from_first_rank(tensors, group) -> None:
    """Overwrite ``tensors`` on every rank with rank 0's (of ``group``) values; a no-op in a world of one."""
    if group_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for t in tensors:
        dist.broadcast(t, src=src, group=group)


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group or dist.group.WORLD) if dist.is_initialized() else [0]


def check_expert_group(name: str, module: nn.Module, group, expert_group) -> None:
    """``expert_group`` of wrapper ``name``: required when ``module`` has expert parameters and ``group`` more
    than one rank; a subset of ``group`` whose size divides ``group``'s (the expert-data-parallel group of that
    layout)."""
    if expert_group is not None and not isinstance(expert_group, dist.ProcessGroup):
        raise TypeError(
            f"{name}: expert_group must be None or a torch.distributed ProcessGroup, "
            f"received {type(expert_group).__name__}"
        )
    experts = [pname for pname, p in module.named_parameters() if is_expert(p)]
    n = group_size(group)
    if expert_group is None:
        if experts and n > 1:
            raise ValueError(
                f"{name}: the module has expert parameters (expert_parallel = True, e.g. {experts[0]!r}) and the "
                f"data-parallel group has {n} ranks: expert_group must be the expert-data-parallel group (the "
                "ranks that hold the same experts, ParallelDims.expert_dp_group), received None"
            )
        return
    ranks, expert_ranks = _ranks(group), _ranks(expert_group)
    if not set(expert_ranks) <= set(ranks):
        raise ValueError(
            f"{name}: expert_group must be a subset of group's ranks {ranks}, received a group of ranks {expert_ranks}"
        )
    if n % len(expert_ranks):
        raise ValueError(
            f"{name}: expert_group's size must divide the data-parallel size {n}, received a group of "
            f"{len(expert_ranks)} ranks {expert_ranks}"
        )


def _check_sync_call(name: str, sync: bool) -> None:
    if torch._C._current_graph_task_id() != -1:
        raise RuntimeError(f"{name}.sync_gradients: called during backward; call it after backward returns")
    if not sync:
        raise RuntimeError(f"{name}.sync_gradients: called inside no_sync(); call it after leaving the block")


def _is_slot(grad: torch.Tensor | None, view: torch.Tensor) -> bool:
    return grad is not None and grad.data_ptr() == view.data_ptr() and grad.shape == view.shape


class DDP(nn.Module):
    """Data parallelism over ``group`` with bucketed, overlapped gradient reduction.

    Args:
        module: the model; its trainable parameters become views into flat buckets.
        group: the data-parallel process group (``None``: the default group, or a world of one).
        bucket_mb: bucket size in MiB; a bucket's reduction starts as soon as backward has filled it.
        accumulate_dtype: dtype of the local gradient sums of bf16/fp16 parameters under
            :meth:`no_sync`: ``torch.float32`` (default; as Megatron-LM's fp32 gradient accumulation,
            and as :class:`~tessel.parallel.fsdp.FSDP`) or ``None``, the parameters' dtype (autograd
            adds into ``p.grad`` in place, rounding at every backward, with no extra buffer). fp32
            parameters accumulate in place either way.
        expert_group: the expert-data-parallel group, the ranks of ``group`` that hold the same experts
            (``ParallelDims.expert_dp_group``), over which expert parameters (``expert_parallel = True``)
            are reduced and sharded; required when the module has expert parameters and ``group`` more
            than one rank, unused without them. Its size must divide ``group``'s.

    Rank 0's parameters and buffers are broadcast at construction; expert parameters (and frozen
    parameters or buffers marked ``expert_parallel``) from rank 0 of ``expert_group``, so each rank keeps
    its own experts. ``forward`` calls the module. Gradients are averaged over the group at the end of
    each backward (expert gradients summed over ``expert_group`` and divided by ``group``'s size); inside
    :meth:`no_sync` they accumulate locally and are reduced by the first backward outside it.
    """

    def __init__(
        self,
        module: nn.Module,
        group: dist.ProcessGroup | None = None,
        bucket_mb: float = 25,
        *,
        accumulate_dtype: torch.dtype | None = torch.float32,
        expert_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        check_data_parallel_args("DDP", module, group)
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, numbers.Real):
            raise TypeError(f"DDP: bucket_mb must be a number of MiB, received {type(bucket_mb).__name__}")
        if not bucket_mb > 0:
            raise ValueError(f"DDP: bucket_mb must be positive, received {bucket_mb}")
        if accumulate_dtype not in (torch.float32, None):
            raise TypeError(
                f"DDP: accumulate_dtype must be torch.float32 or None (the parameters' dtype), "
                f"received {accumulate_dtype!r}"
            )
        check_expert_group("DDP", module, group, expert_group)
        self.accumulate_dtype = accumulate_dtype
        self.module = module
        self.group, self.world_size, self.rank = group, group_size(group), group_rank(group)
        # Without an expert group (a world of one) expert buckets are laid out over ``group`` like the others.
        self.expert_group = group if expert_group is None else expert_group
        expert_layout = (self.expert_group, group_size(self.expert_group), group_rank(self.expert_group))
        named = backward_order(module)
        self.buckets: list[Bucket] = make_buckets(
            named, self.world_size, self.rank, int(bucket_mb * 2**20), group=group, expert_layout=expert_layout
        )
        self.flat_buffers = list(flatten_into_buffers(self.buckets).values())
        self._broadcast_initial_state()
        for bucket in self.buckets:
            bucket.grad = torch.zeros_like(bucket.params)
        self.zero_stage = 0  # 0: all-reduce; 1 or 2: reduce-scatter for ZeroAdam
        self._sync = True
        self._sums: dict[int, torch.Tensor] = {}  # bucket -> fp32 [P] gradient sum of backwards under no_sync
        self._summed: dict[int, set[int]] = {}  # bucket -> the slots with a gradient in that sum
        self._accumulated = [False] * len(self.buckets)  # a grad shard holds reduced grads not yet zeroed
        self._reset_backward_state()
        for bi, bucket in enumerate(self.buckets):
            for si, slot in enumerate(bucket.slots):
                slot.param.register_post_accumulate_grad_hook(lambda p, bi=bi, si=si: self._on_grad(bi, si, p))
                setattr(slot.param, OWNER_ATTR, self)

    def _broadcast_initial_state(self) -> None:
        """Every rank starts from rank 0's dense tensors and from rank 0 (of ``expert_group``)'s experts."""
        frozen = [p for p in self.module.parameters() if not p.requires_grad]
        others = [*frozen, *self.module.buffers()]
        dense = [t.data for t in others if not is_expert(t)]
        experts = [t.data for t in others if is_expert(t)]
        if any(b.expert for b in self.buckets):  # experts share the flat buffers: one broadcast per bucket
            dense = [*(b.params for b in self.buckets if not b.expert), *dense]
            experts = [*(b.params for b in self.buckets if b.expert), *experts]
        else:
            dense = [*self.flat_buffers, *dense]
        broadcast_from_first_rank(dense, self.group)
        broadcast_from_first_rank(experts, self.expert_group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally for the backwards run inside the block; the next backward outside reduces.

        Decided when backward runs (not at forward, unlike torch's DDP): put the ``backward()`` inside.
        With ``accumulate_dtype=torch.float32`` (the default) the gradients of bf16/fp16 parameters are
        added into an fp32 sum per bucket (``Ψ`` fp32 elements while accumulating, freed by the
        reduction) and ``p.grad`` is ``None`` between those backwards; the first backward outside adds
        its own gradients to the sum, rounds it once to the parameters' dtype and reduces it (in that
        dtype: the traffic is unchanged). So ``m`` microbatches of a bf16 model give the exact sum of
        their gradients rounded once, not ``m - 1`` roundings. With ``None`` autograd adds into
        ``p.grad`` (a view of the bucket) in place, as torch's DDP does.
        """
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @property
    def has_unsynced_gradients(self) -> bool:
        """Whether backwards under :meth:`no_sync` left gradients that no reduction has averaged yet."""
        return any(self._touched) or bool(self._sums)

    def sync_gradients(self) -> None:
        """Reduce now what backwards under :meth:`no_sync` accumulated, as a backward outside it would have.

        For loops whose last backward cannot run outside ``no_sync``, such as a pipeline schedule that
        runs one backward per microbatch and stage: run them all inside, then call this once. Every
        bucket is reduced, in bucket order (a collective over the group: every rank calls it). Outside
        backward and outside ``no_sync`` only.
        """
        _check_sync_call("DDP", self._sync)
        try:
            for bi in range(len(self.buckets)):
                self._launch(bi)
            for bi, work in self._works:
                work.wait()
                self._after_reduce(bi)
        finally:
            self._reset_backward_state()

    # ------------------------------------------------------------------------------------------------ backward

    def _reset_backward_state(self) -> None:
        self._ready = [0] * len(self.buckets)  # gradients captured per bucket in this backward
        self._next = 0  # the next bucket to launch: launches follow bucket order on every rank
        self._works: list[tuple[int, object]] = []
        self._touched = [False] * len(self.buckets)  # captured into since the last reduction
        self._stash: dict[int, torch.Tensor] = {}
        self._finish_queued = False

    def _on_grad(self, bi: int, si: int, param: nn.Parameter) -> None:
        if not self._finish_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._finish_queued = True
        bucket = self.buckets[bi]
        if not self._sync and self._sums_in_fp32(bucket):
            # Under no_sync a 16-bit gradient goes into the bucket's fp32 sum; p.grad is left None so that
            # autograd hands the next backward's gradient over fresh.
            if bi not in self._sums:
                self._sums[bi] = torch.zeros(bucket.padded, dtype=torch.float32, device=bucket.device)
                self._summed[bi] = set()
            bucket.slot_view(self._sums[bi], bucket.slots[si]).add_(param.grad)
            self._summed[bi].add(si)
            param.grad = None
            return
        self._touch(bi)
        view = bucket.slot_view(bucket.grad, bucket.slots[si])
        if bi in self._sums:  # the sum of the backwards under no_sync, plus this one, rounded once
            view.copy_(bucket.slot_view(self._sums[bi], bucket.slots[si]).add_(param.grad))
            param.grad = view
        elif not _is_slot(param.grad, view):  # a fresh gradient: the slot's old content is stale
            view.copy_(param.grad)
            param.grad = view
        if self._sync:
            self._ready[bi] += 1
            while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next].slots):
                self._launch(self._next)

    def _touch(self, bi: int) -> None:
        """First use of a bucket since its last reduction: make sure its full gradient exists."""
        if self._touched[bi]:
            return
        self._touched[bi] = True
        bucket = self.buckets[bi]
        if self.zero_stage and self._accumulated[bi]:
            # The coming reduce-scatter overwrites the shard (and under ZeRO-1, where the shard is a view of
            # the full gradient, so do the captures before it): keep the reduced gradients it holds.
            self._stash[bi] = bucket.grad_shard.clone()
        if bucket.grad is None:  # ZeRO-2 frees the full gradient after each reduction
            bucket.grad = torch.zeros(bucket.padded, dtype=bucket.dtype, device=bucket.device)

    def _sums_in_fp32(self, bucket: Bucket) -> bool:
        return self.accumulate_dtype is not None and bucket.dtype != self.accumulate_dtype

    def _launch(self, bi: int) -> None:
        bucket = self.buckets[bi]
        self._touch(bi)
        held, summed = self._sums.pop(bi, None), self._summed.pop(bi, ())
        for si, slot in enumerate(bucket.slots):  # parameters that got no gradient in this backward
            view = bucket.slot_view(bucket.grad, slot)  # contribute their no_sync sum, or zeros
            if not _is_slot(slot.param.grad, view):
                if si in summed:
                    view.copy_(bucket.slot_view(held, slot))
                    slot.param.grad = view
                else:
                    view.zero_()
        if self.zero_stage == 0:
            _, work = all_reduce(bucket.grad, bucket.group, async_op=True)
        else:
            _, work = reduce_scatter(bucket.grad, bucket.group, out=bucket.grad_shard, async_op=True)
        self._works.append((bi, work))
        self._next = bi + 1

    def _finish_backward(self) -> None:
        """Runs once when backward ends: launch what is left (unused parameters), wait, average."""
        try:
            if self._sync:
                for bi in range(self._next, len(self.buckets)):
                    self._launch(bi)
                for bi, work in self._works:
                    work.wait()
                    self._after_reduce(bi)
        finally:
            touched = self._touched if not self._sync else None
            stash = self._stash if not self._sync else None
            self._reset_backward_state()
            if touched is not None:  # under no_sync the cycle continues into the next backward
                self._touched, self._stash = touched, stash

    def _after_reduce(self, bi: int) -> None:
        """Average: divide by ``N`` (for expert buckets too, whose reduction summed over ``expert_group``)."""
        bucket = self.buckets[bi]
        if self.zero_stage == 0:
            if self.world_size > 1:
                bucket.grad.div_(self.world_size)
            return
        if self.world_size > 1:
            bucket.grad_shard.div_(self.world_size)
        if bi in self._stash:
            bucket.grad_shard.add_(self._stash[bi])
        self._accumulated[bi] = True
        for slot in bucket.slots:
            slot.param.grad = None
        if self.zero_stage == 2:
            bucket.grad = None

    # ------------------------------------------------------------------------------------------------ ZeroAdam

    def _use_zero(self, stage: int) -> None:
        """Switch to ZeRO-``stage`` reductions (called by ZeroAdam once its arguments are validated)."""
        assert self.zero_stage == 0 and stage in (1, 2)
        self.zero_stage = stage
        if stage == 1:
            for bucket in self.buckets:
                bucket.grad_shard = bucket.shard_of(bucket.grad)
            return
        for bucket, shard in zip(self.buckets, shard_tensors(self.buckets, lambda b: b.dtype)):
            bucket.grad_shard = shard
            bucket.grad = None
            for slot in bucket.slots:
                slot.param.grad = None

    def _zero_grads(self) -> None:
        """ZeroAdam.zero_grad: drop every gradient, local and reduced."""
        self._sums, self._summed = {}, {}
        for bi, bucket in enumerate(self.buckets):
            bucket.grad_shard.zero_()
            for slot in bucket.slots:
                slot.param.grad = None
            if self.zero_stage == 2:
                bucket.grad = None
            self._accumulated[bi] = False
        self._touched = [False] * len(self.buckets)
        self._stash = {}

    def _gather_params(self) -> None:
        """After the optimizer updated this rank's shards: all-gather every bucket in place."""
        works = [all_gather(b.param_shard, b.group, out=b.params, async_op=True)[1] for b in self.buckets]
        for work in works:
            work.wait()

    def _memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        grads = [b.grad for b in self.buckets if b.grad is not None]
        grads += [b.grad_shard for b in self.buckets if b.grad_shard is not None]
        grads += list(self._sums.values())
        return {"params": list(self.flat_buffers), "grads": grads}
