"""Evaluating through a pipeline: forward-only programs (the schedule's forwards in its order, validated on
their own) and ``Schedule.eval`` on 2 and 4 gloo ranks against the unpipelined model, with no gradient,
no autograd graph, no loss without targets, and training unchanged afterwards."""

import pytest
import torch

from tessel.parallel.pipeline import forward_only_program
from tessel.parallel.pipeline.actions import Action, ActionKind, PipelineProgram
from tessel.parallel.pipeline.programs import gpipe_program, interleaved_program
from tessel.parallel.pipeline.validate import ScheduleError, validate
from tests.multiprocess import run_ranks
from tests.parallel.pipeline import models
from tests.parallel.pipeline.test_multirank import CASES, ENV, MB_SIZE, _build
from tests.parallel.pipeline.test_programs import BUILDERS, LAYOUTS

FORWARD = {ActionKind.F, ActionKind.SEND_F, ActionKind.RECV_F}


# ---------------------------------------------------------------------------------------------------- programs


@pytest.mark.parametrize("name", BUILDERS)
@pytest.mark.parametrize(("p", "m"), [*LAYOUTS, (3, 1), (3, 5)])
def test_forward_only_programs_keep_the_schedules_forwards_and_validate(name, p, m):
    program = BUILDERS[name](p, m)
    forward = forward_only_program(program)
    assert forward.forward_only and not program.forward_only and forward.name == f"{program.name} (forward only)"
    assert (forward.num_ranks, forward.num_stages, forward.n_microbatches) == (p, program.num_stages, m)
    for ours, theirs in zip(forward.ranks, program.ranks, strict=True):
        assert list(ours) == [a for a in theirs if a.kind in FORWARD]
    validate(forward)
    try:
        validate(program, sends="rendezvous")
    except ScheduleError:
        return
    validate(forward, sends="rendezvous")  # what NCCL needs holds for the forwards alone too
    assert forward_only_program(forward) is forward


@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("p", [2, 4])
def test_interleaved_forward_only_programs_validate_when_sends_wait_for_receives(p, v):
    validate(forward_only_program(interleaved_program(p, 2 * p, v)), sends="rendezvous")


def _forward_only(program: PipelineProgram, edit) -> PipelineProgram:
    ranks = [list(a) for a in forward_only_program(program).ranks]
    edit(ranks)
    return PipelineProgram("edited", program.num_ranks, program.num_stages, program.n_microbatches,
                           tuple(map(tuple, ranks)), forward_only=True)  # fmt: skip


def test_validator_rejects_a_backward_in_a_forward_only_program():
    broken = _forward_only(gpipe_program(2, 2), lambda ranks: ranks[1].append(Action(ActionKind.BW, 1, 0)))
    with pytest.raises(ScheduleError, match="a forward-only program runs forwards and their transfers alone"):
        validate(broken)


def test_validator_rejects_a_forward_only_program_missing_a_forward():
    broken = _forward_only(gpipe_program(2, 2), lambda ranks: ranks[1].remove(Action(ActionKind.F, 1, 1)))
    with pytest.raises(ScheduleError, match=r"F\(stage=1, mb=1\) is missing from rank 1"):
        validate(broken)


def test_a_training_program_without_backwards_is_still_refused():
    """Only a program marked forward-only may leave the backwards out."""
    stripped = forward_only_program(gpipe_program(2, 2))
    unmarked = PipelineProgram("unmarked", 2, 2, 2, stripped.ranks)
    with pytest.raises(ScheduleError, match="is missing"):
        validate(unmarked)


def test_forward_only_program_refuses_what_is_not_a_program():
    with pytest.raises(TypeError, match="program must be a PipelineProgram, received list"):
        forward_only_program([])


# ---------------------------------------------------------------------------------------------------- eval


def _eval_case(rank, world_size, case):
    name, v, m, deferred = case
    stages, schedule = _build(rank, world_size, name, v, m, deferred)
    x, aux, target = models.make_batch(MB_SIZE * m)
    losses, calls = [], []
    loss_fn, schedule.loss_fn = schedule.loss_fn, lambda out, t: calls.append(1) or loss_fn(out, t)
    out = schedule.eval(x, aux, target=target, losses=losses)
    untargeted = schedule.eval(x, aux, losses=(bare := []))  # no loss without targets
    grads = [p.grad for s in stages for p in s.module.parameters()]
    schedule.step(x, aux, target=target)  # training afterwards runs as usual
    return {
        "out": out, "untargeted": untargeted, "losses": torch.stack(losses) if losses else None, "bare": bare,
        "calls": len(calls), "grads_after_eval": grads, "out_requires_grad": out is not None and out.requires_grad,
        "trained": all(p.grad is not None for s in stages for p in s.module.parameters()),
    }  # fmt: skip


def _eval_job(rank, world_size):
    return [_eval_case(rank, world_size, case) for case in CASES[world_size]]


def _reference_outputs(num_stages, x, aux, target, m):
    stages = models.build_stages(num_stages)
    outs, losses = [], []
    with torch.no_grad():
        for xm, am, tm in zip(x.chunk(m), aux.chunk(m), target.chunk(m)):
            h, a = xm, am
            for stage in stages[:-1]:
                h, a = stage(h, a)
            outs.append(stages[-1](h, a))
            losses.append(models.loss_fn(outs[-1], tm))
    return torch.cat(outs), torch.stack(losses)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4])
def test_eval_matches_the_unpipelined_forward_without_gradients(world_size):
    results = run_ranks(_eval_job, world_size, env=ENV, timeout=150)
    for k, case in enumerate(CASES[world_size]):
        _, v, m, _ = case
        x, aux, target = models.make_batch(MB_SIZE * m)
        ref_out, ref_losses = _reference_outputs(world_size * v, x, aux, target, m)
        last_rank = (world_size * v - 1) % world_size
        for rank, per_rank in enumerate(results):
            got = per_rank[k]
            assert got["grads_after_eval"] == [None] * (2 * v), case  # eval left no gradient
            assert got["trained"], case
            assert got["bare"] == [] and not got["out_requires_grad"], case
            if rank != last_rank:
                assert got["out"] is None and got["losses"] is None and got["calls"] == 0, case
                continue
            torch.testing.assert_close(got["out"], ref_out, rtol=1e-5, atol=1e-6, msg=str(case))
            torch.testing.assert_close(got["untargeted"], ref_out, rtol=1e-5, atol=1e-6, msg=str(case))
            torch.testing.assert_close(got["losses"], ref_losses, rtol=1e-5, atol=0, msg=str(case))
            assert got["calls"] == 2 * m, case  # m in eval with targets, none without, m in the training step
