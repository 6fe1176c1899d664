"""Schedules as data: every built-in program validates, the validator rejects broken ones by name, and the
simulator reproduces the bubble and memory formulas (DESIGN.md "Pipeline"). No process group needed.

Bubble fractions are ratios of small whole numbers of unit-cost actions, computed in float64 from the
same integers as the formulas, hence the 1e-12 tolerance.
"""

import itertools

import pytest

from tessel.parallel.pipeline.actions import Action, ActionKind, PipelineProgram, with_communication
from tessel.parallel.pipeline.grid import format_grid
from tessel.parallel.pipeline.programs import (
    gpipe_program,
    interleaved_program,
    one_f_one_b_program,
    zero_bubble_program,
)
from tessel.parallel.pipeline.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZeroBubble,
)
from tessel.parallel.pipeline.simulate import Costs, simulate
from tessel.parallel.pipeline.validate import ScheduleError, validate

F, B, W, BW = ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW
EXACT = 1e-12

BUILDERS = {
    "gpipe": gpipe_program,
    "1f1b": one_f_one_b_program,
    "interleaved": lambda p, m: interleaved_program(p, m, 2),
    "zb-h1": zero_bubble_program,
}
LAYOUTS = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p + 1, 4 * p)]


def _one_f_one_b_bubble(p, m):
    return (p - 1) / (m + p - 1)


# ---------------------------------------------------------------------------------------------------- validity


@pytest.mark.parametrize("name", BUILDERS)
@pytest.mark.parametrize(("p", "m"), LAYOUTS)
def test_every_builtin_program_validates(name, p, m):
    validate(BUILDERS[name](p, m))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize(("p", "m"), LAYOUTS)
def test_single_stage_programs_also_validate_when_sends_wait_for_receives(name, p, m):
    validate(BUILDERS[name](p, m), sends="rendezvous")


def test_interleaved_needs_no_divisibility_with_buffered_sends():
    # Megatron requires m % p == 0; with rounds of at least p microbatches any m runs without deadlock.
    for p in range(1, 6):
        for v in (2, 3):
            for m in range(1, 4 * p + 2):
                validate(interleaved_program(p, m, v))


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_interleaved_with_m_a_multiple_of_p_is_safe_when_sends_wait_for_receives(p):
    for m in (p, 2 * p, 4 * p):
        validate(interleaved_program(p, m, 2), sends="rendezvous")


def test_interleaved_rendezvous_failure_is_reported():
    with pytest.raises(ScheduleError, match="deadlocks when each batch of transfers waits"):
        validate(interleaved_program(4, 10, 2), sends="rendezvous")


def test_one_rank_needs_no_transfers():
    program = interleaved_program(1, 3, 3)
    assert not any(a.is_comm for a in program.ranks[0])
    validate(program)


def test_programs_are_pure_functions_of_the_layout():
    assert one_f_one_b_program(4, 9) == one_f_one_b_program(4, 9)
    assert Schedule1F1B.program_for(4, 9) == one_f_one_b_program(4, 9)
    assert ScheduleGPipe.program_for(2, 3) == gpipe_program(2, 3)
    assert ScheduleZeroBubble.program_for(2, 3) == zero_bubble_program(2, 3)
    assert ScheduleInterleaved1F1B.program_for(2, 5, 3) == interleaved_program(2, 5, 3)
    with pytest.raises(ValueError, match="one stage per rank, received stages_per_rank=2"):
        Schedule1F1B.program_for(2, 4, 2)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [((0, 4), ValueError, "num_ranks must be a positive int, received 0"),
     ((2, -1), ValueError, "n_microbatches must be a positive int, received -1"),
     ((2, 2.0), TypeError, "n_microbatches must be an int, received float")],
)  # fmt: skip
def test_builders_reject_bad_layouts(args, error, match):
    with pytest.raises(error, match=match):
        one_f_one_b_program(*args)


def test_action_and_program_print_readably():
    assert str(Action(F, 2, 3)) == "F(stage=2, mb=3)"
    text = str(gpipe_program(2, 1))
    assert text.splitlines()[0] == "GPipe: 2 ranks, 2 stages, 1 microbatches"
    assert "rank 0: F(stage=0, mb=0) SEND_F(stage=0, mb=0) RECV_B(stage=0, mb=0) BW(stage=0, mb=0)" in text


# ---------------------------------------------------------------------------------------------------- rejection


def _edit(program: PipelineProgram, rank: int, edit) -> PipelineProgram:
    ranks = list(program.ranks)
    ranks[rank] = tuple(edit(list(ranks[rank])))
    return PipelineProgram(program.name, program.num_ranks, program.num_stages, program.n_microbatches, tuple(ranks))


def _swap(actions, a, b):
    i, j = actions.index(a), actions.index(b)
    actions[i], actions[j] = actions[j], actions[i]
    return actions


def test_rejects_backward_before_forward():
    program = _edit(gpipe_program(2, 3), 1, lambda acts: _swap(acts, Action(F, 1, 2), Action(BW, 1, 2)))
    with pytest.raises(ScheduleError, match=r"rank 1 action #\d+ BW\(stage=1, mb=2\) runs before F\(stage=1, mb=2\)"):
        validate(program)


def test_rejects_upstream_backward_before_downstream_on_one_rank():
    program = interleaved_program(1, 2, 2)  # stages 0 and 1 both on rank 0
    program = _edit(program, 0, lambda acts: _swap(acts, Action(BW, 0, 1), Action(BW, 1, 1)))
    with pytest.raises(ScheduleError, match=r"BW\(stage=0, mb=1\) runs before BW\(stage=1, mb=1\)"):
        validate(program)


def test_rejects_unpaired_send():
    program = _edit(one_f_one_b_program(2, 3), 1, lambda acts: [a for a in acts if a != Action("RECV_F", 1, 1)])
    with pytest.raises(ScheduleError, match=r"SEND_F\(stage=0, mb=1\) has no matching RECV_F\(stage=1, mb=1\)"):
        validate(program)


def test_rejects_missing_microbatch():
    program = _edit(one_f_one_b_program(2, 3), 0, lambda acts: [a for a in acts if a.microbatch != 2])
    with pytest.raises(ScheduleError, match=r"F\(stage=0, mb=2\) is missing from rank 0's list \(microbatch 2"):
        validate(program)


def test_rejects_repeated_action():
    program = _edit(gpipe_program(2, 2), 0, lambda acts: [*acts, Action(BW, 0, 1)])
    with pytest.raises(ScheduleError, match=r"BW\(stage=0, mb=1\) repeats action #\d+"):
        validate(program)


def test_rejects_action_on_the_wrong_rank():
    program = _edit(gpipe_program(2, 2), 0, lambda acts: [Action(F, 1, 0), *acts])
    with pytest.raises(ScheduleError, match=r"rank 0 action #0 F\(stage=1, mb=0\): stage 1 lives on rank 1"):
        validate(program)


def test_rejects_out_of_range_microbatch():
    program = _edit(gpipe_program(2, 2), 0, lambda acts: [*acts, Action(F, 0, 5)])
    with pytest.raises(ScheduleError, match=r"F\(stage=0, mb=5\): stage or microbatch out of range"):
        validate(program)


def test_rejects_transfer_to_a_stage_on_the_same_rank():
    program = _edit(interleaved_program(1, 1, 2), 0, lambda acts: [*acts, Action("SEND_F", 0, 0)])
    with pytest.raises(ScheduleError, match=r"SEND_F\(stage=0, mb=0\) is not part of the schedule: stage 1"):
        validate(program)


def test_rejects_split_backward_without_its_weight_pass():
    program = _edit(zero_bubble_program(2, 3), 1, lambda acts: [a for a in acts if a != Action(W, 1, 0)])
    with pytest.raises(ScheduleError, match=r"B\(stage=1, mb=0\) has no W\(stage=1, mb=0\)"):
        validate(program)


def test_rejects_weight_pass_before_its_backward():
    program = _edit(zero_bubble_program(2, 3), 0, lambda acts: _swap(acts, Action(B, 0, 1), Action(W, 0, 1)))
    with pytest.raises(ScheduleError, match=r"W\(stage=0, mb=1\) runs before B\(stage=0, mb=1\)"):
        validate(program)


def test_rejects_mixed_combined_and_split_backward():
    program = _edit(gpipe_program(2, 2), 0, lambda acts: [*acts, Action(B, 0, 0), Action(W, 0, 0)])
    with pytest.raises(ScheduleError, match=r"BW\(stage=0, mb=0\): stage 0 microbatch 0 has both"):
        validate(program)


def test_rejects_transfers_listed_in_different_orders():
    def send_late(acts):  # rank 0 sends microbatch 1 before microbatch 0; rank 1 receives 0 first
        acts.remove(Action("SEND_F", 0, 0))
        acts.insert(acts.index(Action("SEND_F", 0, 1)) + 1, Action("SEND_F", 0, 0))
        return acts

    program = _edit(gpipe_program(2, 3), 0, send_late)
    with pytest.raises(ScheduleError, match=r"rank 1's receive #0 from rank 0 is RECV_F\(stage=1, mb=0\)"):
        validate(program)


def test_rejects_deadlock_naming_each_blocked_action():
    # Rank 0 waits for the gradient of microbatch 0 before sending any activation: both ranks block.
    def late_sends(acts):
        sends = [Action("SEND_F", 0, 0), Action("SEND_F", 0, 1)]
        acts = [a for a in acts if a not in sends]
        at = acts.index(Action("RECV_B", 0, 0)) + 1
        return acts[:at] + sends + acts[at:]

    program = _edit(gpipe_program(2, 2), 0, late_sends)
    with pytest.raises(ScheduleError, match=r"deadlocks .*rank 0 action #2 RECV_B\(stage=0, mb=0\) waits for rank 1; "
                                            r"rank 1 action #0 RECV_F\(stage=1, mb=0\) waits for rank 0"):  # fmt: skip
        validate(program)


def test_rejects_unknown_send_model():
    with pytest.raises(ValueError, match="sends must be one of"):
        validate(gpipe_program(2, 2), sends="eager")


# ---------------------------------------------------------------------------------------------------- simulation


@pytest.mark.parametrize(("p", "m"), [*LAYOUTS, (2, 16), (4, 32), (8, 64)])
def test_one_f_one_b_and_gpipe_bubble_is_the_formula(p, m):
    # Unit F = B = W; the combined backward BW of these schedules costs B + W = 2.
    for program in (one_f_one_b_program(p, m), gpipe_program(p, m)):
        sim = simulate(program)
        assert sim.makespan == 3 * (m + p - 1)
        assert sim.bubble_fraction == pytest.approx(_one_f_one_b_bubble(p, m), abs=EXACT)
        assert sim.bubble == pytest.approx([_one_f_one_b_bubble(p, m)] * p, abs=EXACT)


@pytest.mark.parametrize(("p", "m"), LAYOUTS)
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_bubble_is_about_one_over_v_of_one_f_one_b(p, m, v):
    sim = simulate(interleaved_program(p, m, v))
    assert sim.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=EXACT)
    # Stated tolerance: the ratio to 1F1B's bubble exceeds 1/v by exactly (v-1)(p-1) / (v(vm+p-1)) (the
    # shorter run divides a smaller idle time), under 0.05 once m ≥ 4p.
    ratio = sim.bubble_fraction / _one_f_one_b_bubble(p, m)
    assert 1 / v <= ratio <= 1 / v + (v - 1) * (p - 1) / (v * (v * m + p - 1)) + EXACT
    if m >= 4 * p:
        assert ratio - 1 / v < 0.05


@pytest.mark.parametrize(("p", "m"), LAYOUTS)
def test_zero_bubble_idles_a_third_of_one_f_one_b(p, m):
    zb, one = simulate(zero_bubble_program(p, m)), simulate(one_f_one_b_program(p, m))
    assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), abs=EXACT)
    # Idle time per rank is exactly a third of 1F1B's: (p-1) against 3(p-1) units.
    assert zb.idle == pytest.approx([(p - 1)] * p, abs=EXACT)
    assert one.idle == pytest.approx([3 * (p - 1)] * p, abs=EXACT)
    # As a fraction of a shorter makespan the ratio is 1/3 + 2(p-1) / (3(3m+p-1)): the stated tolerance.
    ratio = zb.bubble_fraction / one.bubble_fraction
    assert ratio <= 1 / 3 + 2 * (p - 1) / (3 * (3 * m + p - 1)) + EXACT


@pytest.mark.parametrize(("p", "m"), LAYOUTS)
def test_peak_activations(p, m):
    assert max(simulate(gpipe_program(p, m)).peak_activations) == m
    assert simulate(one_f_one_b_program(p, m)).peak_activations == [p - r for r in range(p)]
    assert max(simulate(zero_bubble_program(p, m)).peak_activations) == p
    # Interleaved: rank 0 holds Megatron's (v-1)·g + 2(p-1) + 1 stage activations, each 1/v of a rank's layers.
    g = m // max(1, m // p) + (m % max(1, m // p) > 0)
    assert simulate(interleaved_program(p, m, 2)).peak_activations[0] == min(2 * m, g + 2 * (p - 1) + 1)


def test_costs_and_communication():
    p, m = 4, 9
    costs = Costs(F=1, B=2, W=1)
    assert simulate(one_f_one_b_program(p, m), costs).makespan == (m + p - 1) * 4
    assert simulate(zero_bubble_program(p, m), costs).makespan == m * 4 + (p - 1) * (1 + 2 - 1)
    # GPipe's critical path crosses p-1 boundaries forward and p-1 backward.
    with_comm = simulate(gpipe_program(p, m), Costs(comm=0.5))
    assert with_comm.makespan == 3 * (m + p - 1) + 2 * (p - 1) * 0.5
    assert with_comm.busy == [3 * m] * p
    with pytest.raises(ValueError, match="Costs: comm must be a non-negative number, received -1"):
        Costs(comm=-1)


def test_simulation_events_cover_every_compute_once():
    sim = simulate(zero_bubble_program(4, 6))
    assert len(sim.events) == 4 * 6 * 3
    for rank in range(4):
        spans = sorted((e.start, e.end) for e in sim.events if e.rank == rank)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # one action at a time per rank


def test_simulate_validates_first():
    program = _edit(gpipe_program(2, 2), 1, lambda acts: acts[:-1])
    with pytest.raises(ScheduleError, match=r"RECV_B\(stage=0, mb=1\) has no matching SEND_B"):
        simulate(program)


# ---------------------------------------------------------------------------------------------------- grid


def test_grid_matches_the_documented_example():
    import tessel.parallel.pipeline.grid as grid_module

    documented = [line.strip() for line in grid_module.__doc__.splitlines() if line.strip().startswith("rank ")]
    assert format_grid(one_f_one_b_program(2, 3)).splitlines() == documented


def test_grid_labels_stages_and_spans_costs():
    lines = format_grid(interleaved_program(2, 2, 2)).splitlines()
    assert len(lines) == 2 and lines[0].startswith("rank 0 | F0a  F1a  F0b")
    grid = format_grid(zero_bubble_program(2, 2), Costs(F=1, B=2, W=1))
    assert grid.splitlines() == ["rank 0 | F0 F1 .  .  B0 B0 W0 B1 B1 W1", "rank 1 | .  F0 B0 B0 F1 B1 B1 W0 W1 ."]
    with pytest.raises(ValueError, match="whole numbers"):
        format_grid(gpipe_program(2, 2), Costs(F=1.5))


def test_with_communication_groups_units():
    # Receives of a unit go before it and its sends after it, so a rank's transfers between two units form one batch.
    program = with_communication("pairs", [[Action(F, 0, 0)], [(Action(F, 1, 0), Action(BW, 1, 0))]], 4, 1)
    assert [str(a) for a in program.ranks[1]][:3] == [
        "RECV_F(stage=1, mb=0)",
        "RECV_B(stage=1, mb=0)",
        "F(stage=1, mb=0)",
    ]
