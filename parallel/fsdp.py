"""FSDP: fully sharded data parallelism (ZeRO-3): parameters live as 1/N shards between uses.

Legend: ``N`` data-parallel size, ``P`` a unit's padded numel, ``s = P/N`` this rank's shard of it.

Units are chosen by a wrap policy (:mod:`.fsdp_units`; by default each transformer block); the root unit
holds the rest. Each unit keeps a ``[s]`` parameter shard and a ``[s]`` reduced-gradient shard; its full
``[P]`` parameters exist only while it computes. One training step with units ``u0 u1`` and root ``r``::

    forward:   gather r, u0 | u0 fwd ‖ gather u1 | free u0 | u1 fwd | free u1 | head (root) | free r
    backward:  gather r, u1 (unpack) | u1 bwd ‖ gather u0 | grads of u1 → reduce-scatter, free u1 | ...

All-gather before a unit's forward (a forward pre-hook), with the next unit's gather issued
asynchronously (prefetch); free after its forward (a forward hook); gather again for backward; and
reduce-scatter its gradients into the shard once backward has produced all of them (gradient hooks),
after which its full parameters are freed again. Per step every parameter is gathered twice and its
gradient reduce-scattered once: 3Ψ of traffic. Under :meth:`FSDP.no_sync` a backward keeps each unit's
``[P]`` gradient instead of reduce-scattering it (``bucket.grad``, summed over the backwards run inside),
and the first backward outside reduce-scatters the sum once::

    no_sync backward:  gather r, u1 | u1 bwd ‖ gather u0 | grads of u1 → add into u1's [P] grad, free u1 | ...
    syncing backward:  gather r, u1 | u1 bwd ‖ gather u0 | [P] grad of u1 + its grads → reduce-scatter | ...

Gathering for backward uses saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``) around the
forward: every tensor autograd saves that lives in a unit's flat storage is packed with its unit, and
unpacking it gathers the unit first (prefetching the unit that ran before it in forward). Chosen over
hooks on a unit's outputs because it fires exactly when backward needs a parameter, whatever the unit
returns (tuples, outputs that do not require grad or are only partly used) and in whatever order the
graph runs; a parameter needed after its unit's gradients are done (a frozen one) is simply gathered
again. The unit's storage is resized rather than replaced, so saved tensors never go stale. A module that
checkpoints its own forward with its hooks outside the checkpoint (Hugging Face's gradient checkpointing)
saves nothing through these hooks and reads its parameters when backward recomputes it: the gradient of its
output, which arrives first, gathers it too.

With :class:`~tessel.parallel.zero.ZeroAdam` (ZeRO-3), the fp32 master weights and moments of each
shard live in the optimizer and the step writes the low-precision parameter shard in place.

Expert parameters (``p.expert_parallel = True``: different experts on the ranks of an expert-parallel group)
are sharded over ``expert_group``, the ranks holding the same experts (size ``N/ep``), as DDP reduces them
(:mod:`.ddp`). A unit whose module holds both (a transformer block with a mixture of experts) becomes two
units of the same module: its dense parameters over ``group``, its experts over ``expert_group``. Both are
gathered together before the module runs and freed together after it; each has its own storage, so
backward gathers each when it needs it. An expert gradient is summed over ``expert_group`` and divided by
``N``, the data-parallel size: every rank's tokens may reach every expert of the ep group.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from .comm import all_gather, group_rank, group_size, reduce_scatter
from .ddp import OWNER_ATTR, _check_sync_call, broadcast_from_first_rank, check_data_parallel_args, check_expert_group
from .flat import is_expert, shard_tensors
from .fsdp_units import Unit, assign_params, choose_units

__all__ = ["FSDP"]

_MAX_REDUCTIONS_IN_FLIGHT = 2  # bounds the full-size gradient buffers alive during backward


def _key(module: nn.Module | None) -> int:
    return 0 if module is None else id(module)


def _split_experts(named: list[tuple[str, nn.Parameter]]) -> list[tuple[bool, list[tuple[str, nn.Parameter]]]]:
    """A unit's parameters as ``(expert, params)`` parts: the dense ones, then the experts (each part non-empty)."""
    parts = [(expert, [(n, p) for n, p in named if is_expert(p) == expert]) for expert in (False, True)]
    return [(expert, part) for expert, part in parts if part] or [(False, named)]


def _grad_tensors(out) -> list[torch.Tensor]:
    """The tensors of a module's output (nested in tuples, lists and dicts, as Hugging Face's outputs are) that
    autograd will send a gradient to."""
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad else []
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    return [t for item in items for t in _grad_tensors(item)]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class FSDP(nn.Module):
    """Fully sharded data parallelism over ``group``.

    Args:
        module: the model; its parameters become views of per-unit flat buffers, freed between uses.
        group: the data-parallel process group (``None``: the default group, or a world of one).
        wrap: the unit policy: ``None`` (each child of an ``nn.ModuleList``/``nn.Sequential``), a set of
            module classes (every outermost module of those classes), or a callable ``module -> bool``.
        prefetch: issue the next unit's all-gather before the current unit computes.
        accumulate_dtype: dtype of the full gradient sums that backwards under :meth:`no_sync` keep:
            ``torch.float32`` (default; as Megatron-LM's fp32 gradient accumulation: bf16/fp16
            gradients are added exactly and rounded once, when the sum is reduce-scattered) or
            ``None``, the parameters' dtype (half the memory for 16-bit models, one rounding per
            backward).
        expert_group: the expert-data-parallel group (``ParallelDims.expert_dp_group``), over which
            expert parameters (``expert_parallel = True``) are sharded; required when the module has
            expert parameters and ``group`` more than one rank.

    Rank 0's parameters and buffers are broadcast at construction, expert parameters and buffers from rank 0
    of ``expert_group``. Use with
    :class:`~tessel.parallel.zero.ZeroAdam`; outside forward and backward the parameters hold no data:
    read them with :meth:`full_state_dict`. After a backward each unit's averaged gradient is its
    ``bucket.grad_shard`` (``[s]``); backwards accumulate into it until ZeroAdam's ``zero_grad()``, and
    inside :meth:`no_sync` they accumulate locally, unreduced. Raises ``ValueError`` before changing
    anything when a unit cannot be sharded (a parameter shared across units; mixed dtypes or devices
    within a unit) or when ``expert_group`` is missing or is not a subset of ``group`` whose size divides it.
    :meth:`full_state_dict` holds this rank's own experts.
    """

    def __init__(
        self,
        module: nn.Module,
        group: dist.ProcessGroup | None = None,
        *,
        wrap=None,
        prefetch=True,
        accumulate_dtype: torch.dtype | None = torch.float32,
        expert_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        check_data_parallel_args("FSDP", module, group)
        check_expert_group("FSDP", module, group, expert_group)
        if accumulate_dtype not in (torch.float32, None):
            raise TypeError(
                f"FSDP: accumulate_dtype must be torch.float32 or None (the parameters' dtype), "
                f"received {accumulate_dtype!r}"
            )
        self.accumulate_dtype = accumulate_dtype
        chosen = choose_units(module, wrap)
        assigned = assign_params(module, chosen)
        self.module = module
        self.group, self.world_size, self.rank = group, group_size(group), group_rank(group)
        self.prefetch = bool(prefetch)
        specs = [(name, mod, named) for (name, mod), named in zip(chosen, assigned)]
        if assigned[-1]:
            specs.insert(0, ("", None, assigned[-1]))  # the root runs first: it wraps the whole forward
        self._live: dict[int, Unit] = {}  # storage address -> gathered unit (what _pack looks up)
        # Without an expert group (a world of one) expert parameters are sharded over ``group`` like the others.
        self.expert_group = group if expert_group is None else expert_group
        layouts = {False: (group, self.world_size, self.rank),
                   True: (self.expert_group, group_size(self.expert_group), group_rank(self.expert_group))}  # fmt: skip
        self.units = [
            Unit(name, mod, part, *layouts[expert], self._live)
            for name, mod, named in specs
            for expert, part in _split_experts(named)
        ]
        self.buckets = [u.bucket for u in self.units]
        self._units_of: dict[int, list[Unit]] = {}  # id(module) (0: the root) -> its units, gathered together
        for u in self.units:
            self._units_of.setdefault(_key(u.module), []).append(u)
        self._shard_params(module)
        self.zero_stage = 0
        self._forward_order: list[Unit] = []  # units in the order the current forward ran them
        self._last_forward_order: list[Unit] = list(self.units)  # the previous forward's (prefetch hint)
        self._pending: list[tuple[Unit, object, torch.Tensor, torch.Tensor]] = []
        self._backward_prefetched: set[int] = set()
        self._finish_queued = False
        self._sync = True  # False inside no_sync(): backward keeps the full gradients instead of reducing
        for us in self._units_of.values():
            if us[0].module is not None:
                us[0].module.register_forward_pre_hook(lambda m, args, us=us: self._before_forward(us))
                us[0].module.register_forward_hook(lambda m, args, out, us=us: self._after_forward(us, out))
        for ui, u in enumerate(self.units):
            for slot in u.bucket.slots:
                if slot.param.requires_grad:
                    slot.param.register_post_accumulate_grad_hook(lambda p, ui=ui: self._on_grad(ui))
                setattr(slot.param, OWNER_ATTR, self)

    def _shard_params(self, module: nn.Module) -> None:
        for u in self.units:
            u.adopt_params()
        for expert, group in ((False, self.group), (True, self.expert_group)):
            fulls = [u.full for u in self.units if u.bucket.expert == expert]
            broadcast_from_first_rank([*fulls, *(b for b in module.buffers() if is_expert(b) == expert)], group)
        param_shards = shard_tensors(self.buckets, lambda b: b.dtype)
        grad_shards = shard_tensors(self.buckets, lambda b: b.dtype)
        for u, param_shard, grad_shard in zip(self.units, param_shards, grad_shards):
            param_shard.copy_(u.bucket.shard_of(u.full))
            u.bucket.param_shard, u.bucket.grad_shard = param_shard, grad_shard
            u.free()

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside the block accumulate full gradients locally; the next backward outside reduces.

        Inside, a unit's backward adds its gradients into the unit's full ``[P]`` gradient
        (``bucket.grad``, allocated by the first such backward) instead of reduce-scattering them; the
        first backward outside adds its own gradients to that sum, reduce-scatters it once into the
        ``[s]`` gradient shard (averaged over the group as usual) and frees the ``[P]`` buffers. So
        ``m-1`` backwards inside and one outside give the gradient of the ``m`` losses summed, as one
        backward on the concatenated batch would (with each microbatch's mean loss divided by ``m``).
        Parameters are gathered for forward and backward and freed after use as always: only the
        gradients stay full.

        Like DDP's, it is decided when backward runs: put the ``backward()`` inside the block. Nested
        blocks are fine (the inner one changes nothing). The sums have ``accumulate_dtype``: by default
        fp32, so a bf16/fp16 model's gradients of ``m`` backwards are added exactly and rounded once to
        the parameters' dtype when the sum is reduce-scattered (the reduce-scatter, its traffic and the
        shard ZeroAdam reads keep the parameters' dtype). With ``accumulate_dtype=None`` they have the
        parameters' dtype: 2 bytes per element instead of 4 for bf16, rounded at every backward.

        Memory: while gradients are accumulated every unit holds its full ``[P]`` gradient sum, ``Ψ``
        elements per rank instead of ``Ψ/N``: ZeRO-3's saving on gradients is given up during the
        accumulation, as with torch's FSDP ``no_sync``; the memory account counts the buffers while they
        exist. Communication: a backward inside moves only the parameters' all-gathers.

        Run a backward outside the block (or :meth:`sync_gradients`) before ``ZeroAdam.step()``, which
        reads the reduced shards only and refuses to step while local sums are unreduced.
        ``ZeroAdam.zero_grad()`` drops the local sums too.
        """
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @property
    def has_unsynced_gradients(self) -> bool:
        """Whether backwards under :meth:`no_sync` left full gradients that are not reduced yet."""
        return any(u.bucket.grad is not None for u in self.units)

    def sync_gradients(self) -> None:
        """Reduce-scatter now the full gradients that backwards under :meth:`no_sync` accumulated.

        For loops whose last backward cannot run outside ``no_sync`` (a pipeline schedule's backward per
        microbatch and stage): run them all inside, then call this once. A collective over the group;
        outside backward and outside ``no_sync`` only.
        """
        _check_sync_call("FSDP", self._sync)
        try:
            for u in self.units:
                if u.bucket.grad is not None:
                    self._reduce(u)
        finally:
            while self._pending:
                self._complete(*self._pending.pop(0))

    # ------------------------------------------------------------------------------------------------ forward

    def forward(self, *args, **kwargs):
        self._forward_order = []
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            root = self._units_of.get(_key(None))
            if root:
                self._before_forward(root)
            try:
                return self.module(*args, **kwargs)
            finally:
                if root:
                    self._after_forward(root)
                self._last_forward_order = list(self._forward_order)

    def _before_forward(self, us: list[Unit]) -> None:
        """Gather a module's units (its dense parameters and its experts), prefetching the next module's."""
        for u in us:
            u.gather_async()
        if self.prefetch and not _in_backward():
            for nxt in self._next_in_forward(us[-1]):
                nxt.gather_async()
        for u in us:
            u.wait()
        if not _in_backward():
            self._forward_order.extend(us)

    def _next_in_forward(self, u: Unit) -> list[Unit]:
        """The units of the module that ran after ``u``'s in the previous forward (none after the last)."""
        order = self._last_forward_order or self.units
        i = next((i for i, x in enumerate(order) if x is u), None)
        return self._units_of[_key(order[i + 1].module)] if i is not None and i + 1 < len(order) else []

    def _after_forward(self, us: list[Unit], out=None) -> None:
        if _in_backward():  # a recomputation (activation checkpointing): backward still needs the values
            return
        for u in us:
            u.free()
        if torch.is_grad_enabled():
            for t in _grad_tensors(out):  # when their gradient arrives, before the module's own backward runs
                t.register_hook(lambda grad, us=us: self._gather_for_backward(us))

    def _gather_for_backward(self, us: list[Unit]) -> None:
        """Gather a module's units as the gradient of its output arrives. Its saved tensors gather it too, when
        unpacked; this is for a module whose forward saved none of them through this wrapper's hooks: one that
        checkpoints its own forward (Hugging Face's gradient checkpointing, with module hooks outside the
        checkpoint) recomputes it in backward and reads the parameters directly."""
        self._queue_finish()
        for u in us:
            u.gather_async()
        prev = self._previous_in_forward(us[0]) if self.prefetch else None
        if prev is not None and prev.ready == 0:  # the module whose backward comes next: its gather in flight
            prev.gather_async()
        for u in us:
            u.wait()

    # ------------------------------------------------------------------------------------------------ backward

    def _pack(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        u = self._live.get(ptr) if ptr else None
        return t if u is None else (u, t)

    def _unpack(self, packed):
        if not isinstance(packed, tuple):
            return packed
        u, t = packed
        self._queue_finish()
        u.gather_async()
        if self.prefetch and id(u) not in self._backward_prefetched:
            self._backward_prefetched.add(id(u))
            prev = self._previous_in_forward(u)
            if prev is not None and prev.ready == 0:
                prev.gather_async()
        u.wait()
        return t

    def _previous_in_forward(self, u: Unit) -> Unit | None:
        order = self._forward_order or self._last_forward_order
        i = next((i for i, x in enumerate(order) if x is u), None)
        return order[i - 1] if i else None

    def _queue_finish(self) -> None:
        if not self._finish_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._finish_queued = True

    def _on_grad(self, ui: int) -> None:
        self._queue_finish()
        u = self.units[ui]
        u.ready += 1
        if u.ready == u.trainable:
            self._grads_done(u)

    def _grads_done(self, u: Unit) -> None:
        """All of ``u``'s gradients of this backward are in: add them to its full gradient, free its parameters.

        Then reduce-scatter the full gradient into the shard, or, under :meth:`no_sync`, keep it for the
        next backward.
        """
        b = u.bucket
        if b.grad is None:  # a sum to keep (no_sync) takes accumulate_dtype; one reduced at once, the bucket's
            dtype = b.dtype if self._sync or self.accumulate_dtype is None else self.accumulate_dtype
            b.grad = torch.zeros(b.padded, dtype=dtype, device=b.device)
        for slot in b.slots:
            if slot.param.grad is not None:
                b.slot_view(b.grad, slot).add_(slot.param.grad)
                slot.param.grad = None
        u.free()
        if self._sync:
            self._reduce(u)

    def _reduce(self, u: Unit) -> None:
        """Launch the reduce-scatter of ``u``'s full gradient into its shard; the full gradient is dropped."""
        b = u.bucket
        full_grad, b.grad = b.grad, None
        if full_grad.dtype != b.dtype:  # an fp32 sum from no_sync: rounded once, reduced in the bucket's dtype
            full_grad = full_grad.to(b.dtype)
        out = torch.empty_like(b.grad_shard) if u.accumulated else b.grad_shard
        _, work = reduce_scatter(full_grad, b.group, out=out, async_op=True)
        self._pending.append((u, work, full_grad, out))
        while len(self._pending) > _MAX_REDUCTIONS_IN_FLIGHT:
            self._complete(*self._pending.pop(0))

    def _complete(self, u: Unit, work, full_grad: torch.Tensor, out: torch.Tensor) -> None:
        work.wait()
        if self.world_size > 1:
            out.div_(self.world_size)
        if out is not u.bucket.grad_shard:
            u.bucket.grad_shard.add_(out)
        u.accumulated = True

    def _finish_backward(self) -> None:
        """When backward ends: finish units with parameters that got no gradient, wait, free everything.

        A syncing backward also reduces the units that got no gradient in it but hold a sum from no_sync.
        """
        try:
            for u in self.units:
                if 0 < u.ready < u.trainable:
                    self._grads_done(u)
                elif self._sync and u.ready == 0 and u.bucket.grad is not None:
                    self._reduce(u)
            while self._pending:
                self._complete(*self._pending.pop(0))
            for u in self.units:
                u.free()
        finally:
            for u in self.units:
                u.ready = 0
            self._backward_prefetched.clear()
            self._finish_queued = False

    # ------------------------------------------------------------------------------------------------ ZeroAdam

    def _use_zero(self, stage: int) -> None:
        assert self.zero_stage == 0 and stage == 3
        self.zero_stage = 3

    def _zero_grads(self) -> None:
        for u in self.units:
            u.bucket.grad_shard.zero_()
            u.bucket.grad = None  # a sum accumulated under no_sync
            u.accumulated = False
            for slot in u.bucket.slots:
                slot.param.grad = None

    def _gather_params(self) -> None:
        """Nothing to do after a step: each unit gathers its updated shard before its next forward."""

    def _memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        params = [t for u in self.units for t in (u.bucket.param_shard, u.full)]
        grads = [u.bucket.grad_shard for u in self.units]
        grads += [u.bucket.grad for u in self.units if u.bucket.grad is not None]  # held under no_sync
        return {"params": params, "grads": grads}

    # ------------------------------------------------------------------------------------------------ state

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state dict unsharded: parameters gathered as fp32 CPU tensors, buffers copied.

        Expert parameters are gathered over ``expert_group``: this rank's own experts, whole.

        A collective: every rank calls it.
        """
        values: dict[int, torch.Tensor] = {}
        for u in self.units:
            full, _ = all_gather(u.bucket.param_shard, u.bucket.group)
            for slot in u.bucket.slots:
                values[id(slot.param)] = u.bucket.slot_view(full, slot).float().cpu().clone()
        out = {}
        for key, value in self.module.state_dict(keep_vars=True).items():
            out[key] = values[id(value)] if id(value) in values else value.detach().cpu().clone()
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load an unsharded state dict (``full_state_dict``'s or the plain module's) into the shards.

        Only the parameters and buffers: a ZeroAdam keeps its master weights (load its own state dict).
        """
        for u in self.units:
            for slot in u.bucket.slots:
                got = state_dict.get(slot.name)
                if got is None or got.numel() != slot.numel:
                    raise ValueError(
                        f"FSDP.load_full_state_dict: expected a tensor of shape {tuple(slot.shape)} for parameter "
                        f"{slot.name!r}, received {None if got is None else tuple(got.shape)}"
                    )
        for u in self.units:
            b = u.bucket
            for slot, lo, hi in b.shard_slices():
                start = b.shard_offset + lo - slot.offset
                b.param_shard[lo:hi].copy_(state_dict[slot.name].reshape(-1)[start : start + hi - lo])
        for name, buf in self.module.named_buffers():
            if name in state_dict:
                buf.copy_(state_dict[name])
