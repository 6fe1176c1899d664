"""One executor for every schedule: runs this rank's list of a :class:`~.actions.PipelineProgram` in order.

Per stage ``s`` and microbatch ``i`` it keeps the stage's inputs (leaves that collect the input
gradient), its outputs (roots of the backward) and the gradients in flight, and frees each as soon as
the action consuming it has run:

=========  ======================================================================================
``F``      inputs (the microbatch, the received activation, or a local handover) → module →
           outputs; the last stage applies the loss and keeps ``loss / m`` as its backward root
``B``      backward from the roots inside :func:`~.weight_grad.defer_weight_grads`; keeps the store
``W``      runs the stored weight-gradient closures of (s, i)
``BW``     backward, weight gradients included
transfers  each run of consecutive transfers is one batch: sends posted (waited for at the end of
           the step), receives posted and waited for before the next compute
=========  ======================================================================================

The gradients crossing a boundary are those of the floating-point tensors crossing it, in order.
Losses are scaled by 1/m before the backward, so the accumulated ``.grad`` is the gradient of the
mean microbatch loss. A ``forward_only`` program (evaluation) keeps no inputs or roots: each activation
is freed once sent or handed over, and the last stage applies the loss only when it has targets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .actions import Action, ActionKind, PipelineProgram
from .p2p import P2P
from .stage import META_NUMEL, PipelineStage, decode_meta, encode_meta
from .timeline import TimelineRecorder
from .weight_grad import WeightGradStore, defer_weight_grads

__all__ = ["Executor"]

_Key = tuple[int, int]  # (stage, microbatch)


def _floating(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t for t in tensors if t.is_floating_point() or t.is_complex()]


class Executor:
    """Runs one step of ``program`` on this rank's ``stages``; :attr:`current` is the action running."""

    def __init__(self, program: PipelineProgram, stages: dict[int, PipelineStage], loss_fn: Callable,
                 p2p: P2P | None, recorder: TimelineRecorder):  # fmt: skip
        self.program, self.stages, self.loss_fn, self.p2p, self.recorder = program, stages, loss_fn, p2p, recorder
        self.rank = next(iter(stages.values())).group_rank
        self.current: Action | None = None
        self.inputs: dict[_Key, tuple[torch.Tensor, ...]] = {}  # stage inputs (leaves), kept for their grads
        self.arrived: dict[_Key, tuple[torch.Tensor, ...]] = {}  # activations received or handed over
        self.roots: dict[_Key, tuple[torch.Tensor, ...]] = {}  # what the backward starts from
        self.out_grads: dict[_Key, tuple[torch.Tensor, ...]] = {}  # gradients of a stage's outputs
        self.to_send: dict[tuple[ActionKind, int, int], tuple[torch.Tensor, ...]] = {}
        self.stores: dict[_Key, WeightGradStore] = {}
        self.meta_due: set[int] = set()  # stages whose first activation must be preceded by its metadata
        self.losses: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}

    def run(self, mb_inputs: Sequence[tuple[torch.Tensor, ...]] | None, mb_targets: Sequence | None) -> None:
        self.mb_inputs, self.mb_targets = mb_inputs, mb_targets
        actions = self.program.ranks[self.rank]
        pos = 0
        while pos < len(actions):
            end = pos + 1
            if actions[pos].is_comm:
                while end < len(actions) and actions[end].is_comm:
                    end += 1
            batch = actions[pos:end]
            self.current = batch[0]
            with self.recorder.span(*batch):
                self._transfer(batch) if batch[0].is_comm else self._compute(batch[0])
            pos = end
        self.current = None
        if self.p2p is not None:
            self.p2p.finish()
        assert not self.stores and not self.roots and not self.to_send, "the validated program left work undone"

    def _remote(self, stage: int, other: int) -> bool:
        return self.program.rank_of(other) != self.program.rank_of(stage)

    # ------------------------------------------------------------------------------------------------ compute

    def _compute(self, a: Action) -> None:
        if a.kind == ActionKind.F:
            self._forward(a.stage, a.microbatch)
        elif a.kind == ActionKind.W:
            self.stores.pop((a.stage, a.microbatch)).run()
        else:
            self._backward(a.stage, a.microbatch, split=a.kind == ActionKind.B)

    def _forward(self, s: int, i: int) -> None:
        stage, training = self.stages[s], not self.program.forward_only
        if stage.is_first:
            args = self.mb_inputs[i]
        elif training:
            args = tuple(x.requires_grad_(x.is_floating_point()) for x in self.arrived.pop((s, i)))
            self.inputs[s, i] = args
        else:
            args = self.arrived.pop((s, i))
        outs = stage.forward(*args)
        if stage.is_last:
            out = outs[0] if len(outs) == 1 else outs
            self.outputs[i] = tuple(o.detach() for o in outs)
            if not training and self.mb_targets is None:
                return
            loss = self.loss_fn(out) if self.mb_targets is None else self.loss_fn(out, self.mb_targets[i])
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError(f"pipeline: loss_fn must return a scalar tensor, received {_describe(loss)}")
            self.losses[i] = loss.detach()
            if training:
                self.roots[s, i] = (loss / self.program.n_microbatches,)
            return
        if training:
            self.roots[s, i] = outs
        handed = tuple(o.detach() for o in outs)
        if not self._remote(s, s + 1):
            self.arrived[s + 1, i] = handed
            return
        if stage.check_output_meta(handed):
            self.meta_due.add(s)
        self.to_send[ActionKind.SEND_F, s, i] = tuple(o.contiguous() for o in handed)

    def _backward(self, s: int, i: int, split: bool) -> None:
        stage = self.stages[s]
        roots = self.roots.pop((s, i))
        if stage.is_last:
            pairs = [(roots[0], None)]
        else:
            pairs = [(t, g) for t, g in zip(_floating(roots), self.out_grads.pop((s, i))) if t.requires_grad]
        if split:
            with defer_weight_grads() as store:
                self._autograd(pairs)
            self.stores[s, i] = store
        else:
            self._autograd(pairs)
        if stage.is_first:
            return
        grads = tuple(x.grad if x.grad is not None else torch.zeros_like(x) for x in _floating(self.inputs.pop((s, i))))
        if self._remote(s, s - 1):
            self.to_send[ActionKind.SEND_B, s, i] = tuple(g.contiguous() for g in grads)
        else:
            self.out_grads[s - 1, i] = grads

    @staticmethod
    def _autograd(pairs) -> None:
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])

    # ------------------------------------------------------------------------------------------------ transfers

    def _transfer(self, batch: Sequence[Action]) -> None:
        """Post the batch's sends and receives together; wait for the receives."""
        sends: list[tuple[torch.Tensor, int]] = []
        for a in batch:
            if a.is_send:
                peer = self.program.peer_rank(a)
                if a.kind == ActionKind.SEND_F and a.stage in self.meta_due:
                    self.meta_due.discard(a.stage)
                    sends.append((encode_meta(self.stages[a.stage].output_meta).to(self.stages[a.stage].device), peer))
                sends += [(t, peer) for t in self.to_send.pop((a.kind, a.stage, a.microbatch))]
        recvs: list[tuple[torch.Tensor, int]] = []
        works = []
        for a in batch:
            if a.is_send:
                continue
            stage, peer = self.stages[a.stage], self.program.peer_rank(a)
            if a.kind == ActionKind.RECV_F and stage.input_meta is None:
                works += self.p2p.post(sends, recvs)  # keep the first-in first-out order with the peer
                sends, recvs = [], []
                stage.input_meta = self._receive_meta(stage, peer, a)
            buffers = self._buffers(a, stage)
            recvs += [(b, peer) for b in buffers]
        works += self.p2p.post(sends, recvs)
        self.p2p.wait(works, "receiving " + ", ".join(str(a) for a in batch if not a.is_send))

    def _receive_meta(self, stage: PipelineStage, peer: int, a: Action):
        meta = torch.empty(META_NUMEL, dtype=torch.int64, device=stage.device)
        self.p2p.wait(self.p2p.post([], [(meta, peer)]), f"the shapes of {a}")
        return decode_meta(meta.cpu())

    def _buffers(self, a: Action, stage: PipelineStage) -> tuple[torch.Tensor, ...]:
        """Allocate what ``a`` receives and file it where the consuming compute will look."""
        key = (a.stage, a.microbatch)
        if a.kind == ActionKind.RECV_F:
            metas = stage.input_meta
            self.arrived[key] = tuple(torch.empty(s, dtype=d, device=stage.device) for s, d in metas)
            return self.arrived[key]
        metas = [(s, d) for s, d in stage.output_meta if d.is_floating_point or d.is_complex]
        self.out_grads[key] = tuple(torch.empty(s, dtype=d, device=stage.device) for s, d in metas)
        return self.out_grads[key]


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__
