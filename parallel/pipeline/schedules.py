"""The schedules users construct, mirroring ``torch.distributed.pipelining``.

``Schedule(stage_or_stages, n_microbatches, loss_fn)``, then ``.step(*inputs, target=None, losses=None)``
on every pipeline rank: the batch is split into ``n_microbatches`` along dim 0; the rank holding the
first stage feeds ``inputs`` to it (other ranks' ``inputs`` are ignored), the rank holding the last
stage computes ``loss_fn(output, target_microbatch)`` (``loss_fn(output)`` without a target) and
appends one loss per microbatch to ``losses``. Gradients accumulate into ``.grad`` as those of the
mean microbatch loss; ``step`` returns the last stage's outputs concatenated over microbatches on the
rank holding it, ``None`` elsewhere. ``timeline`` holds this rank's recorded actions of the last step.
``.eval(*inputs, target=None, losses=None)`` runs the forwards alone (the schedule's own order, without
autograd; the loss only with a target) and returns the same.

Each class turns the layout into its :class:`~.actions.PipelineProgram` (``Schedule.program_for(p, m)``,
a pure function that needs no process group) and runs it with the one generic executor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .actions import PipelineProgram
from .executor import Executor
from .p2p import P2P, PipelineAbortedError
from .programs import (
    forward_only_program,
    gpipe_program,
    interleaved_program,
    one_f_one_b_program,
    zero_bubble_program,
)
from .stage import PipelineStage
from .timeline import TimelineEvent, TimelineRecorder
from .validate import ScheduleError, validate

__all__ = ["PipelineSchedule", "Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleZeroBubble"]


class PipelineSchedule:
    """Base of the schedules: checks the stages, builds and validates the program, runs steps."""

    multi_stage = False  # whether a rank may hold several stages

    def __init__(self, stage_or_stages: PipelineStage | Sequence[PipelineStage], n_microbatches: int,
                 loss_fn: Callable, *, timeout: float = 600.0):  # fmt: skip
        name = type(self).__name__
        self.stages = self._check_stages(name, stage_or_stages)
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"{name}: n_microbatches must be a positive int, received {n_microbatches!r}")
        if not callable(loss_fn):
            raise TypeError(f"{name}: loss_fn must be callable, received {type(loss_fn).__name__}")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"{name}: timeout must be a positive number of seconds, received {timeout!r}")
        first = self.stages[0]
        self.group, self.num_ranks, self.rank = first.group, first.group_size, first.group_rank
        self.n_microbatches, self.loss_fn, self.timeout = n_microbatches, loss_fn, float(timeout)
        self.program = self.program_for(self.num_ranks, n_microbatches, first.num_stages // self.num_ranks)
        self._check_program(name)
        self._eval_program: PipelineProgram | None = None  # built at the first eval
        self.timeline: list[TimelineEvent] = []

    @classmethod
    def program_for(cls, num_ranks: int, n_microbatches: int, stages_per_rank: int = 1) -> PipelineProgram:
        """This schedule's action lists for a layout; a pure function (no process group needed)."""
        raise TypeError(
            f"{cls.__name__} is the base of the schedules and builds no program: use ScheduleGPipe, "
            "Schedule1F1B, ScheduleInterleaved1F1B or ScheduleZeroBubble"
        )

    def _check_stages(self, name: str, stage_or_stages) -> list[PipelineStage]:
        stages = [stage_or_stages] if isinstance(stage_or_stages, PipelineStage) else list(stage_or_stages)
        if not stages or not all(isinstance(s, PipelineStage) for s in stages):
            raise TypeError(f"{name}: expected a PipelineStage or a non-empty list of them, received {stage_or_stages}")
        first = stages[0]
        if any(s.group is not first.group or s.num_stages != first.num_stages for s in stages):
            raise ValueError(f"{name}: all stages must share one pipeline group and one num_stages")
        v = first.num_stages // first.group_size
        if not self.multi_stage and v != 1:
            raise ValueError(
                f"{name} runs one stage per rank, but num_stages={first.num_stages} with {first.group_size} pipeline "
                "ranks puts several on each: use ScheduleInterleaved1F1B"
            )
        expected = list(range(first.group_rank, first.num_stages, first.group_size))
        if sorted(s.stage_index for s in stages) != expected:
            raise ValueError(
                f"{name}: pipeline rank {first.group_rank} must pass its stages {expected} (stage s lives on rank "
                f"s % {first.group_size}), received stages {sorted(s.stage_index for s in stages)}"
            )
        return sorted(stages, key=lambda s: s.stage_index)

    def _check_program(self, name: str) -> None:
        _validated(self.program, "buffered")  # built-in programs always pass; a custom subclass's may not
        if self.num_ranks > 1 and self.stages[0].device.type != "cpu":
            try:
                _validated(self.program, "rendezvous")
            except ScheduleError as e:
                raise ValueError(
                    f"{name}: n_microbatches={self.n_microbatches} with {self.num_ranks} pipeline ranks would "
                    f"deadlock on {dist.get_backend(self.group)}, where a large send waits for its receive "
                    f"(use a multiple of {self.num_ranks}): {e}"
                ) from None

    # ------------------------------------------------------------------------------------------------ step

    def step(self, *inputs: torch.Tensor, target: torch.Tensor | None = None, losses: list | None = None):
        """Run one forward and backward of the batch through the pipeline (see the module docstring).

        If this rank raises (a bad argument included), the other ranks of the group stop waiting for
        it and raise :class:`~.p2p.PipelineAbortedError`.
        """
        return self._run(self.program, inputs, target, losses)

    @torch.no_grad()
    def eval(self, *inputs: torch.Tensor, target: torch.Tensor | None = None, losses: list | None = None):
        """Run the batch through the pipeline's forwards alone: evaluation or inference.

        The forwards and their transfers of the training program, in its order
        (:func:`~.programs.forward_only_program`), under ``torch.no_grad()``: no backward, no gradient, no
        activation kept once passed on. With ``target`` the last stage applies ``loss_fn`` to each
        microbatch and appends the losses to ``losses``; without, ``loss_fn`` is not called. Returns
        what :meth:`step` returns; a failing rank stops the others as in :meth:`step`.
        """
        if self._eval_program is None:
            program = forward_only_program(self.program)
            _validated(program, "buffered")
            if self.num_ranks > 1 and self.stages[0].device.type != "cpu":
                _validated(program, "rendezvous")
            self._eval_program = program
        return self._run(self._eval_program, inputs, target, losses, "eval")

    def _run(self, program: PipelineProgram, inputs, target, losses, method: str = "step"):
        p2p = P2P(self.group, self.timeout, self.stages[0].device) if self.num_ranks > 1 else None
        recorder = TimelineRecorder(self.rank, self.stages[0].device)
        executor = Executor(program, {s.stage_index: s for s in self.stages}, self.loss_fn, p2p, recorder)
        try:
            executor.run(*self._microbatches(f"{type(self).__name__}.{method}", inputs, target, losses))
        except BaseException as e:
            if p2p is not None and not isinstance(e, PipelineAbortedError):
                where = f" at {executor.current}" if executor.current else ""
                p2p.abort(f"pipeline rank {self.rank} raised {type(e).__name__}{where}: {e}")
            raise
        finally:
            self.timeline = recorder.events()
        if not self.stages[-1].is_last:
            return None
        if losses is not None and executor.losses:  # none from an eval without targets
            losses.extend(executor.losses[i] for i in range(self.n_microbatches))
        outs = [torch.cat([executor.outputs[i][k] for i in range(self.n_microbatches)]) for k in
                range(len(executor.outputs[0]))]  # fmt: skip
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _microbatches(self, name: str, inputs, target, losses):
        """Check the arguments of ``name`` (step or eval); the inputs and targets split into microbatches where
        this rank needs them."""
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"{name}: losses must be a list or None, received {type(losses).__name__}")
        mb_inputs = mb_targets = None
        if self.stages[0].is_first:
            if not inputs:
                raise ValueError(f"{name}: the rank holding the first stage needs at least one input tensor")
            mb_inputs = list(zip(*(self._split(name, f"input {k}", x) for k, x in enumerate(inputs))))
        if self.stages[-1].is_last and target is not None:
            mb_targets = self._split(name, "target", target)
        return mb_inputs, mb_targets

    def _split(self, name: str, what: str, x) -> tuple[torch.Tensor, ...]:
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise TypeError(f"{name}: {what} must be a tensor with a batch dimension, received {_describe(x)}")
        if x.shape[0] % self.n_microbatches:
            raise ValueError(
                f"{name}: {what} has batch size {x.shape[0]}, which does not divide into "
                f"{self.n_microbatches} microbatches"
            )
        return x.split(x.shape[0] // self.n_microbatches)


@functools.lru_cache(maxsize=64)
def _validated(program: PipelineProgram, sends: str) -> None:
    """Validate once per program (they are immutable): every rank and every rebuilt schedule checks the same."""
    validate(program, sends=sends)


def _describe(value) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


class ScheduleGPipe(PipelineSchedule):
    """GPipe: every forward, then every backward. Bubble (p-1)/(m+p-1); holds all m activations."""

    @classmethod
    def program_for(cls, num_ranks, n_microbatches, stages_per_rank=1):
        _one_stage(cls, stages_per_rank)
        return gpipe_program(num_ranks, n_microbatches)


class Schedule1F1B(PipelineSchedule):
    """1F1B: warm-up forwards, then one forward and one backward in turn. Bubble (p-1)/(m+p-1); holds p."""

    @classmethod
    def program_for(cls, num_ranks, n_microbatches, stages_per_rank=1):
        _one_stage(cls, stages_per_rank)
        return one_f_one_b_program(num_ranks, n_microbatches)


class ScheduleInterleaved1F1B(PipelineSchedule):
    """Interleaved 1F1B over the v stages each rank holds (a list). Bubble (p-1)/(v·m+p-1) for m ≥ p."""

    multi_stage = True

    @classmethod
    def program_for(cls, num_ranks, n_microbatches, stages_per_rank=1):
        return interleaved_program(num_ranks, n_microbatches, stages_per_rank)


class ScheduleZeroBubble(PipelineSchedule):
    """ZB-H1: 1F1B with each backward split into B and a deferred W. Bubble (p-1)/(3m+p-1) at unit costs."""

    @classmethod
    def program_for(cls, num_ranks, n_microbatches, stages_per_rank=1):
        _one_stage(cls, stages_per_rank)
        return zero_bubble_program(num_ranks, n_microbatches)


def _one_stage(cls, stages_per_rank: int) -> None:
    if stages_per_rank != 1:
        raise ValueError(f"{cls.__name__} runs one stage per rank, received stages_per_rank={stages_per_rank}")
