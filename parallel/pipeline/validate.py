"""Checks that a :class:`~.actions.PipelineProgram` runs to completion and computes the right thing.

:func:`validate` raises :class:`ScheduleError` (a ``ValueError``) naming the offending action when:

- an action is out of range or on the wrong rank (stage s lives on rank s % p), or appears twice;
- a microbatch is missing: every stage needs one ``F`` and either one ``BW`` or one ``B`` and one ``W``
  per microbatch, and every crossing of a rank boundary one send paired with one receive (a
  ``forward_only`` program: the ``F`` and the forward transfers alone, and nothing else);
- an action runs before what it needs on its own rank: ``F`` before its ``B``/``BW``, ``B`` before
  ``W``, a receive before the compute that consumes it, a compute before the send of its result, the
  downstream stage's backward before the upstream one's when both live on the rank;
- two ranks order their transfers to each other differently (transfers match first-in first-out,
  as NCCL and gloo's untagged point-to-point do);
- the ranks, each running its list in order with blocking receives, would deadlock.

Two models of a send: ``"buffered"`` (a send never waits: gloo, and what the executor does) and
``"rendezvous"`` (each batch of consecutive transfers completes only once the peers have reached the
batches holding the partners of all its transfers: NCCL's grouped point-to-point, where a large send
waits for its receive). A program that passes the second passes the first.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from .actions import Action, ActionKind, PipelineProgram

__all__ = ["SEND_MODELS", "ScheduleError", "replay", "validate"]

SEND_MODELS = ("buffered", "rendezvous")
_F, _B, _W, _BW = ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW
_RECVS = (ActionKind.RECV_F, ActionKind.RECV_B)


class ScheduleError(ValueError):
    """A pipeline program that would compute a wrong result, fail, or hang; names the action."""


def validate(program: PipelineProgram, *, sends: str = "buffered") -> None:
    """Raise :class:`ScheduleError` unless ``program`` is complete, well ordered and deadlock-free."""
    if sends not in SEND_MODELS:
        raise ValueError(f"validate: sends must be one of {SEND_MODELS}, received {sends!r}")
    _check_layout(program)
    where = _index(program)
    _check_complete(program, where)
    _check_local_order(program, where)
    _check_channel_order(program)
    if sends == "buffered":
        replay(program, lambda action: 0.0)
    else:
        _check_rendezvous(program)


def _at(program: PipelineProgram, rank: int, pos: int) -> str:
    return f"rank {rank} action #{pos} {program.ranks[rank][pos]}"


# ---------------------------------------------------------------------------------------------------- structure


def _check_layout(program: PipelineProgram) -> None:
    p, stages, m = program.num_ranks, program.num_stages, program.n_microbatches
    if p < 1 or m < 1 or stages < 1 or stages % p:
        raise ScheduleError(
            f"{program.name}: needs positive ranks, stages and microbatches with the stages a multiple of the "
            f"ranks, received {p} ranks, {stages} stages, {m} microbatches"
        )
    if len(program.ranks) != p:
        raise ScheduleError(f"{program.name}: has action lists for {len(program.ranks)} ranks, expected {p}")


def _index(program: PipelineProgram) -> list[dict[Action, int]]:
    """Per rank, each action's position; rejects actions out of range, on the wrong rank, or repeated."""
    where: list[dict[Action, int]] = []
    for rank, actions in enumerate(program.ranks):
        seen: dict[Action, int] = {}
        for pos, action in enumerate(actions):
            if not isinstance(action, Action):
                raise ScheduleError(f"rank {rank} action #{pos} is {action!r}, not an Action")
            if not (0 <= action.stage < program.num_stages and 0 <= action.microbatch < program.n_microbatches):
                raise ScheduleError(
                    f"{_at(program, rank, pos)}: stage or microbatch out of range "
                    f"({program.num_stages} stages, {program.n_microbatches} microbatches)"
                )
            if program.rank_of(action.stage) != rank:
                raise ScheduleError(
                    f"{_at(program, rank, pos)}: stage {action.stage} lives on rank {program.rank_of(action.stage)}"
                )
            if action in seen:
                raise ScheduleError(f"{_at(program, rank, pos)} repeats action #{seen[action]}: each runs once")
            seen[action] = pos
        where.append(seen)
    return where


# ---------------------------------------------------------------------------------------------------- completeness


def _required(program: PipelineProgram, stage: int, mb: int, has_split: bool) -> list[Action]:
    """The actions stage ``stage`` needs for microbatch ``mb`` (its compute and the transfers it takes part in)."""
    backward = not program.forward_only
    need = [Action(_F, stage, mb)]
    if backward:
        need += [Action(_B, stage, mb), Action(_W, stage, mb)] if has_split else [Action(_BW, stage, mb)]
    rank = program.rank_of(stage)
    if stage + 1 < program.num_stages and program.rank_of(stage + 1) != rank:
        need += [Action(ActionKind.SEND_F, stage, mb)] + ([Action(ActionKind.RECV_B, stage, mb)] if backward else [])
    if stage > 0 and program.rank_of(stage - 1) != rank:
        need += [Action(ActionKind.RECV_F, stage, mb)] + ([Action(ActionKind.SEND_B, stage, mb)] if backward else [])
    return need


def _check_complete(program: PipelineProgram, where: list[dict[Action, int]]) -> None:
    required: set[Action] = set()
    for stage in range(program.num_stages):
        rank = program.rank_of(stage)
        for mb in range(program.n_microbatches):
            split = Action(_B, stage, mb) in where[rank] or Action(_W, stage, mb) in where[rank]
            if split and Action(_BW, stage, mb) in where[rank]:
                raise ScheduleError(
                    f"{_at(program, rank, where[rank][Action(_BW, stage, mb)])}: stage {stage} microbatch {mb} "
                    "has both a combined backward BW and a split one (B, W)"
                )
            required.update(_required(program, stage, mb, split))
    for rank, actions in enumerate(where):
        for action, pos in actions.items():
            if action not in required:
                why = _why_extra(program, action)
                raise ScheduleError(f"{_at(program, rank, pos)} is not part of the schedule: {why}")
    kinds = list(ActionKind)
    for action in sorted(required, key=lambda a: (a.microbatch, a.stage, kinds.index(a.kind))):
        rank = program.rank_of(action.stage)
        if action not in where[rank]:
            raise ScheduleError(_missing(program, where, action))


def _why_extra(program: PipelineProgram, action: Action) -> str:
    if program.forward_only and action.kind not in (_F, ActionKind.SEND_F, ActionKind.RECV_F):
        return "a forward-only program runs forwards and their transfers alone"
    if action.is_comm:
        return f"stage {action.peer_stage()} does not exist or lives on the same rank (no transfer needed)"
    return "unexpected action"  # cannot happen: every compute kind is required by _required


def _missing(program: PipelineProgram, where: list[dict[Action, int]], action: Action) -> str:
    rank = program.rank_of(action.stage)
    if action.is_comm:
        partner = action.matching()
        prank = program.rank_of(partner.stage)
        if partner in where[prank]:
            return (
                f"{_at(program, prank, where[prank][partner])} has no matching {action} on rank {rank} "
                "(an unpaired transfer)"
            )
    if action.kind == _W and Action(_B, action.stage, action.microbatch) in where[rank]:
        b = Action(_B, action.stage, action.microbatch)
        return f"{_at(program, rank, where[rank][b])} has no {action} on rank {rank}: a split backward needs its W"
    return f"{action} is missing from rank {rank}'s list (microbatch {action.microbatch} of stage {action.stage})"


# ---------------------------------------------------------------------------------------------------- order


def _prerequisites(program: PipelineProgram, where: dict[Action, int], a: Action) -> list[Action]:
    """Actions on the same rank that must come before ``a``."""
    s, mb, rank = a.stage, a.microbatch, program.rank_of(a.stage)
    local = lambda other: 0 <= other < program.num_stages and program.rank_of(other) == rank
    if a.kind == _F:
        if s == 0:
            return []
        return [Action(_F, s - 1, mb) if local(s - 1) else Action(ActionKind.RECV_F, s, mb)]
    if a.kind in (_B, _BW):
        need = [Action(_F, s, mb)]
        if local(s + 1):
            need += [d for d in (Action(_B, s + 1, mb), Action(_BW, s + 1, mb)) if d in where]
        elif s + 1 < program.num_stages:
            need.append(Action(ActionKind.RECV_B, s, mb))
        return need
    if a.kind == _W:
        return [Action(_B, s, mb)]
    if a.kind == ActionKind.SEND_F:
        return [Action(_F, s, mb)]
    if a.kind == ActionKind.SEND_B:
        return [b for b in (Action(_B, s, mb), Action(_BW, s, mb)) if b in where]
    return []


def _check_local_order(program: PipelineProgram, where: list[dict[Action, int]]) -> None:
    for rank, actions in enumerate(program.ranks):
        for pos, action in enumerate(actions):
            for need in _prerequisites(program, where[rank], action):
                if where[rank][need] > pos:
                    raise ScheduleError(
                        f"{_at(program, rank, pos)} runs before {need} (action #{where[rank][need]}), which it needs"
                    )


def _check_channel_order(program: PipelineProgram) -> None:
    """The k-th send from rank a to rank b must be the partner of rank b's k-th receive from rank a."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for rank, actions in enumerate(program.ranks):
        for pos, a in enumerate(actions):
            if a.is_comm:
                peer = program.peer_rank(a)
                (sends[rank, peer] if a.is_send else recvs[peer, rank]).append(pos)
    for (src, dst), positions in sends.items():
        for k, (spos, rpos) in enumerate(zip(positions, recvs[src, dst])):
            if program.ranks[src][spos].matching() != program.ranks[dst][rpos]:
                raise ScheduleError(
                    f"{_at(program, src, spos)} is transfer #{k} from rank {src} to rank {dst}, but rank {dst}'s "
                    f"receive #{k} from rank {src} is {program.ranks[dst][rpos]} (action #{rpos}): transfers match "
                    "in order, so both ranks must list them in the same order"
                )


# ---------------------------------------------------------------------------------------------------- deadlock


def replay(program: PipelineProgram, duration: Callable[[Action], float]) -> list[list[tuple[Action, float, float]]]:
    """Run every rank's list in order with buffered sends and blocking receives; ``(action, start, end)``.

    A compute takes ``duration(action)``; a send takes no time on its rank and its data arrive
    ``duration(send)`` later; a receive waits until then. Raises :class:`ScheduleError` naming each
    rank's blocked action when the ranks deadlock. Assumes the channel order has been checked.
    """
    n = program.num_ranks
    pos, clock = [0] * n, [0.0] * n
    arrival: dict[Action, float] = {}  # send -> time its data reach the peer
    timed: list[list[tuple[Action, float, float]]] = [[] for _ in range(n)]
    progress = True
    while progress:
        progress = False
        for r in range(n):
            actions = program.ranks[r]
            while pos[r] < len(actions):
                a = actions[pos[r]]
                start = clock[r]
                if a.kind in _RECVS:
                    if a.matching() not in arrival:
                        break
                    clock[r] = max(clock[r], arrival[a.matching()])
                elif a.is_send:
                    arrival[a] = clock[r] + duration(a)
                else:
                    clock[r] += duration(a)
                timed[r].append((a, start, clock[r]))
                pos[r] += 1
                progress = True
    blocked = [r for r in range(n) if pos[r] < len(program.ranks[r])]
    if blocked:
        waits = "; ".join(f"{_at(program, r, pos[r])} waits for rank {program.peer_rank(program.ranks[r][pos[r]])}"
                          for r in blocked)  # fmt: skip
        raise ScheduleError(f"{program.name} deadlocks with buffered sends and blocking receives: {waits}")
    return timed


def _segments(actions: tuple[Action, ...]) -> list[list[int]]:
    """Positions grouped into single computes and maximal batches of consecutive transfers."""
    segments: list[list[int]] = []
    for pos, a in enumerate(actions):
        if a.is_comm and segments and actions[segments[-1][-1]].is_comm:
            segments[-1].append(pos)
        else:
            segments.append([pos])
    return segments


def _check_rendezvous(program: PipelineProgram) -> None:
    n = program.num_ranks
    segments = [_segments(actions) for actions in program.ranks]
    segment_of = {}  # (rank, action) -> index of the segment holding it
    for r in range(n):
        for k, segment in enumerate(segments[r]):
            for pos in segment:
                segment_of[r, program.ranks[r][pos]] = k
    current = [0] * n

    def posted(action: Action) -> bool:
        rank = program.rank_of(action.stage)
        return current[rank] >= segment_of[rank, action]

    progress = True
    while progress:
        progress = False
        for r in range(n):
            while current[r] < len(segments[r]):
                batch = [program.ranks[r][pos] for pos in segments[r][current[r]]]
                if not all(posted(a.matching()) for a in batch if a.is_comm):
                    break
                current[r] += 1
                progress = True
    blocked = [r for r in range(n) if current[r] < len(segments[r])]
    if blocked:
        waits = "; ".join(_at(program, r, segments[r][current[r]][0]) for r in blocked)
        raise ScheduleError(f"{program.name} deadlocks when each batch of transfers waits for its partners: {waits}")
