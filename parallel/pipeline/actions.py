"""The data a pipeline schedule is made of: actions, and one ordered list of actions per rank.

Legend: ``p`` pipeline ranks, ``S`` stages, ``v = S / p`` stages per rank, ``m`` microbatches. Stage ``s``
lives on rank ``s % p`` (with ``v > 1`` a rank holds stages ``r, r + p, r + 2p, ...``: Megatron's
interleaving). An action names a kind, a stage and a microbatch:

=========  ==============================================================================================
``F``      forward of the stage on the microbatch (the last stage also computes the loss)
``B``      backward-input: gradients of the stage's inputs; a weight-gradient GEMM that defers itself
           (:mod:`.weight_grad`) is stored for ``W``, everything else is computed here
``W``      backward-weight: runs the weight-gradient closures ``B`` stored for this stage and microbatch
``BW``     combined backward (``B`` and ``W`` together), for schedules that do not split the backward
``SEND_F`` send the stage's output for the microbatch to stage ``s + 1`` (on another rank)
``RECV_F`` receive the stage's input for the microbatch from stage ``s - 1``
``SEND_B`` send the gradient of the stage's input to stage ``s - 1``
``RECV_B`` receive the gradient of the stage's output from stage ``s + 1``
=========  ==============================================================================================

``SEND_F(s, i)`` pairs with ``RECV_F(s + 1, i)`` and ``SEND_B(s, i)`` with ``RECV_B(s - 1, i)``. Stages on
the same rank (``p = 1``) hand tensors over without send or receive. :func:`with_communication` inserts
the transfers a list of compute actions needs: each send right after the compute that produces its
tensor, each receive right before the compute that consumes it, so that the transfers between two
computes form one batch (Megatron's ``send_forward_recv_backward``). A unit of several computes (the
interleaved schedule's forward-backward pair) takes all its receives before it and all its sends
after it, as Megatron's ``send_forward_backward_recv_forward_backward`` does.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["COMM_KINDS", "COMPUTE_KINDS", "Action", "ActionKind", "PipelineProgram", "with_communication"]


class ActionKind(str, enum.Enum):
    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    def __str__(self) -> str:
        return self.value


COMPUTE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW})
COMM_KINDS = frozenset({ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B})
_BACKWARD_KINDS = frozenset({ActionKind.B, ActionKind.BW})


class _ActionFields(NamedTuple):
    kind: ActionKind
    stage: int
    microbatch: int


class Action(_ActionFields):
    """One step of a rank's list: ``kind`` applied to ``stage`` for ``microbatch`` (a hashable tuple)."""

    __slots__ = ()

    def __new__(cls, kind: ActionKind | str, stage: int, microbatch: int):
        return super().__new__(cls, ActionKind(kind), stage, microbatch)

    def __str__(self) -> str:
        return f"{self.kind}(stage={self.stage}, mb={self.microbatch})"

    __repr__ = __str__

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    @property
    def is_send(self) -> bool:
        return self.kind in (ActionKind.SEND_F, ActionKind.SEND_B)

    def peer_stage(self) -> int:
        """The stage on the other end of a transfer."""
        if self.kind in (ActionKind.SEND_F, ActionKind.RECV_B):
            return self.stage + 1
        if self.kind in (ActionKind.RECV_F, ActionKind.SEND_B):
            return self.stage - 1
        raise AssertionError(f"{self} is not a transfer")

    def matching(self) -> Action:
        """The action on the peer's list that completes this transfer."""
        partner = {
            ActionKind.SEND_F: ActionKind.RECV_F,
            ActionKind.RECV_F: ActionKind.SEND_F,
            ActionKind.SEND_B: ActionKind.RECV_B,
            ActionKind.RECV_B: ActionKind.SEND_B,
        }[self.kind]
        return Action(partner, self.peer_stage(), self.microbatch)


@dataclass(frozen=True)
class PipelineProgram:
    """A schedule as data: ``ranks[r]`` is rank r's ordered list of actions.

    A pure function of the layout (``num_ranks``, ``num_stages``, ``n_microbatches``): it can be
    validated (:func:`~.validate.validate`), simulated (:func:`~.simulate.simulate`) and printed
    (:func:`~.grid.format_grid`) without any process group, and is what the executor runs.
    ``forward_only``: a program of forwards and their transfers alone (evaluation,
    :func:`~.programs.forward_only_program`); a training program needs every backward.
    """

    name: str
    num_ranks: int
    num_stages: int
    n_microbatches: int
    ranks: tuple[tuple[Action, ...], ...]
    forward_only: bool = False

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.num_ranks

    def rank_of(self, stage: int) -> int:
        return stage % self.num_ranks

    def stages_of(self, rank: int) -> list[int]:
        return list(range(rank, self.num_stages, self.num_ranks))

    def peer_rank(self, action: Action) -> int:
        return self.rank_of(action.peer_stage())

    def __str__(self) -> str:
        lines = [f"{self.name}: {self.num_ranks} ranks, {self.num_stages} stages, {self.n_microbatches} microbatches"]
        lines += [f"  rank {r}: " + " ".join(map(str, actions)) for r, actions in enumerate(self.ranks)]
        return "\n".join(lines)


def with_communication(
    name: str, compute: Sequence[Iterable[Action | Sequence[Action]]], num_stages: int, n_microbatches: int
) -> PipelineProgram:
    """Turn per-rank lists of compute actions into a :class:`PipelineProgram` with its transfers.

    An item of a rank's list is an :class:`Action` or a tuple of them (a unit). Sends go right after
    the unit producing the tensor, receives right before the unit consuming it; stages on the same
    rank exchange tensors locally and get no transfer. Receives then move earlier where needed so that
    each rank receives from each peer in the order the peer sends.
    """
    num_ranks = len(compute)
    program = PipelineProgram(name, num_ranks, num_stages, n_microbatches, ())
    ranks = []
    for rank_actions in compute:
        out: list[Action] = []
        for unit in rank_actions:
            unit = (unit,) if isinstance(unit, Action) else tuple(unit)
            out += [r for a in unit for r in _receives_before(program, a)] + list(unit)
            out += [s for a in unit for s in _sends_after(program, a)]
        ranks.append(tuple(out))
    return PipelineProgram(name, num_ranks, num_stages, n_microbatches, _receive_in_send_order(program, ranks))


def _receive_in_send_order(program: PipelineProgram, ranks: list[tuple[Action, ...]]) -> tuple[tuple[Action, ...], ...]:
    """Move receives earlier so that each rank receives from each peer in the order the peer sends.

    Transfers between two ranks match first-in first-out. With two ranks and interleaved stages, one
    channel carries both activations and gradients, and a rank may need a later message first: it then
    receives the earlier ones just before. They were sent before the one it waits for, so this never
    waits longer than the original order would.
    """
    send_order: dict[tuple[int, int], list[Action]] = {}
    for rank, actions in enumerate(ranks):
        for a in actions:
            if a.is_send:
                send_order.setdefault((rank, program.peer_rank(a)), []).append(a.matching())
    reordered = []
    for rank, actions in enumerate(ranks):
        out, received, cursor = [], set(), {}
        for a in actions:
            if a.is_comm and not a.is_send:
                if a in received:
                    continue
                peer = program.peer_rank(a)
                queue, k = send_order.get((peer, rank), []), cursor.get(peer, 0)
                while k < len(queue) and a not in received:
                    out.append(queue[k])
                    received.add(queue[k])
                    k += 1
                cursor[peer] = k
                if a not in received:  # not sent by the peer at all: leave it for the validator to report
                    out.append(a)
                continue
            out.append(a)
        reordered.append(tuple(out))
    return tuple(reordered)


def _crosses(program: PipelineProgram, stage: int, other: int) -> bool:
    return 0 <= other < program.num_stages and program.rank_of(other) != program.rank_of(stage)


def _receives_before(program: PipelineProgram, a: Action) -> list[Action]:
    if a.kind == ActionKind.F and _crosses(program, a.stage, a.stage - 1):
        return [Action(ActionKind.RECV_F, a.stage, a.microbatch)]
    if a.kind in _BACKWARD_KINDS and _crosses(program, a.stage, a.stage + 1):
        return [Action(ActionKind.RECV_B, a.stage, a.microbatch)]
    return []


def _sends_after(program: PipelineProgram, a: Action) -> list[Action]:
    if a.kind == ActionKind.F and _crosses(program, a.stage, a.stage + 1):
        return [Action(ActionKind.SEND_F, a.stage, a.microbatch)]
    if a.kind in _BACKWARD_KINDS and _crosses(program, a.stage, a.stage - 1):
        return [Action(ActionKind.SEND_B, a.stage, a.microbatch)]
    return []
