"""The built-in schedules as pure functions of the layout: ``(p, m[, v]) -> PipelineProgram``.

Legend: ``p`` ranks, ``m`` microbatches, ``v`` stages per rank, rank ``r``; ``F`` forward, ``B``
backward-input, ``W`` backward-weight, ``BW`` both. Bubble fractions are for unit costs ``F = B = W``
(a combined ``BW`` costs ``B + W``) and no communication time (:func:`~.simulate.simulate` measures them):

- GPipe (Huang et al. 2019): all forwards, then all backwards. Bubble ``(p-1)/(m+p-1)``, ``m``
  microbatches' activations held at the peak.
- 1F1B (Narayanan et al. 2019, PipeDream-Flush): rank r runs ``p-1-r`` warm-up forwards, then alternates
  one forward and one backward. Same bubble as GPipe, at most ``p`` activations held.
- Interleaved 1F1B (Narayanan et al. 2021, §2.2): each rank holds ``v`` stages; forwards run in rounds
  of ``g`` microbatches through each of the rank's stages in turn (depth first), backwards likewise
  through the stages in reverse. Bubble ``(p-1)/(v·m+p-1)``, about 1/v of 1F1B's, for m a multiple of p.
- ZB-H1 (Qi et al. 2023, §3.1): 1F1B with each backward split into ``B`` (on the critical path) and
  ``W``; rank r postpones its first r ``W`` to the end, where they fill the cool-down bubble. Bubble
  ``(p-1)/(3m+p-1)``: the idle time is a third of 1F1B's, the peak activations still ``p``.

What interleaving truly needs: Megatron-LM requires m % p == 0 because its order comes from a closed
form over rounds of exactly p microbatches. Here the m microbatches are split into ``max(1, m // p)``
rounds as even as possible (the larger first), so each round holds at least ``min(p, m)``. With
buffered sends (gloo) every such program is deadlock-free for any m (the validator proves it; checked
for p ≤ 8, v ≤ 4, m ≤ 5p + 1) and its bubble is exactly ``(p-1)/(v·m+p-1)`` whenever m ≥ p. When a
send waits for its receive (NCCL), rounds longer than p can deadlock (e.g. p = 4, m = 10): there m must
be a multiple of p or below it, which the schedule checks at construction on CUDA.

All formulas above assume m ≥ p; with fewer microbatches than ranks the pipeline never fills.
"""

from __future__ import annotations

from .actions import Action, ActionKind, PipelineProgram, with_communication

__all__ = ["forward_only_program", "gpipe_program", "interleaved_program", "one_f_one_b_program", "zero_bubble_program"]

F, B, W, BW = ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW
_FORWARD_KINDS = frozenset({F, ActionKind.SEND_F, ActionKind.RECV_F})


def _check_layout(name: str, p: int, m: int, v: int = 1) -> None:
    for arg, value in (("num_ranks", p), ("n_microbatches", m), ("stages_per_rank", v)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: {arg} must be an int, received {type(value).__name__} {value!r}")
        if value < 1:
            raise ValueError(f"{name}: {arg} must be a positive int, received {value}")


def gpipe_program(p: int, m: int) -> PipelineProgram:
    """GPipe: ``F0 … F(m-1)`` then ``BW0 … BW(m-1)`` on every rank."""
    _check_layout("gpipe_program", p, m)
    compute = [[Action(F, r, i) for i in range(m)] + [Action(BW, r, i) for i in range(m)] for r in range(p)]
    return with_communication("GPipe", compute, p, m)


def _one_f_one_b(r: int, p: int, m: int, backward: ActionKind) -> tuple[list[Action], int]:
    """Rank r's 1F1B order of forwards and (input-)backwards, and its number of warm-up forwards."""
    warmup = min(p - 1 - r, m)
    order = [Action(F, r, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action(F, r, warmup + i), Action(backward, r, i)]
    order += [Action(backward, r, i) for i in range(m - warmup, m)]
    return order, warmup


def one_f_one_b_program(p: int, m: int) -> PipelineProgram:
    """1F1B: ``p-1-r`` warm-up forwards, then one forward and one combined backward in turn."""
    _check_layout("one_f_one_b_program", p, m)
    compute = [_one_f_one_b(r, p, m, BW)[0] for r in range(p)]
    return with_communication("1F1B", compute, p, m)


def zero_bubble_program(p: int, m: int) -> PipelineProgram:
    """ZB-H1: 1F1B's order of ``F`` and ``B``; after the k-th ``B`` (k ≥ r) the oldest pending ``W``.

    Rank r thus holds back r weight-gradient passes, which run after its last ``B``: later ranks finish
    their ``B`` chain earlier and fill the time until the first rank is done with them.
    """
    _check_layout("zero_bubble_program", p, m)
    compute = []
    for r in range(p):
        order, pending, n_backward = [], [], 0
        for action in _one_f_one_b(r, p, m, B)[0]:
            order.append(action)
            if action.kind == B:
                pending.append(action.microbatch)
                n_backward += 1
                if n_backward > r:
                    order.append(Action(W, r, pending.pop(0)))
        order += [Action(W, r, i) for i in pending]
        compute.append(order)
    return with_communication("ZB-H1", compute, p, m)


def _rounds(p: int, m: int) -> list[range]:
    """Microbatches grouped in rounds of ``min(p, m)``; the last round takes the remainder."""
    n_rounds = max(1, m // p)
    sizes = [m // n_rounds + (k < m % n_rounds) for k in range(n_rounds)]
    starts = [sum(sizes[:k]) for k in range(n_rounds)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def _interleaved_order(r: int, p: int, m: int, v: int, reverse: bool) -> list[tuple[int, int]]:
    """(stage, microbatch) in the order rank r runs its forwards (or, reversed chunks, its backwards)."""
    chunks = range(v - 1, -1, -1) if reverse else range(v)
    return [(chunk * p + r, i) for rnd in _rounds(p, m) for chunk in chunks for i in rnd]


def interleaved_program(p: int, m: int, v: int = 2) -> PipelineProgram:
    """Interleaved 1F1B with ``v`` stages per rank (stage s on rank s % p), depth first in rounds of p.

    Rank r runs ``(v-1)·g + 2(p-1-r)`` warm-up forwards (Megatron-LM's count, g the round size), then
    alternates one forward and one backward, then drains the backwards.
    """
    _check_layout("interleaved_program", p, m, v)
    total, g = m * v, _rounds(p, m)[0].stop
    compute = []
    for r in range(p):
        forwards = [Action(F, s, i) for s, i in _interleaved_order(r, p, m, v, reverse=False)]
        backwards = [Action(BW, s, i) for s, i in _interleaved_order(r, p, m, v, reverse=True)]
        warmup = min((v - 1) * g + 2 * (p - 1 - r), total)
        order = forwards[:warmup]
        for j in range(total - warmup):
            order.append((forwards[warmup + j], backwards[j]))
        compute.append(order + backwards[total - warmup :])
    return with_communication(f"Interleaved1F1B(v={v})", compute, p * v, m)


def forward_only_program(program: PipelineProgram) -> PipelineProgram:
    """``program``'s forwards and their transfers alone, in its order: what evaluating the pipeline runs.

    Each rank keeps its forwards in the order the schedule gives them (the interleaved schedule's rounds
    through its stages included), so the forward-only program fills the pipeline as the training one does;
    dropping the backwards drops only waits, and no forward needs a backward, so it is deadlock-free
    whenever ``program`` is (the validator checks it again)."""
    if not isinstance(program, PipelineProgram):
        raise TypeError(f"forward_only_program: program must be a PipelineProgram, received {type(program).__name__}")
    if program.forward_only:
        return program
    ranks = tuple(tuple(a for a in actions if a.kind in _FORWARD_KINDS) for actions in program.ranks)
    return PipelineProgram(f"{program.name} (forward only)", program.num_ranks, program.num_stages,
                           program.n_microbatches, ranks, forward_only=True)  # fmt: skip
