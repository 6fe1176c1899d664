"""Every schedule on 2 and 4 gloo ranks against the unpipelined model, bytes moved, the merged timeline,
and no hang: a rank that raises, a stage whose shapes change, a peer that never runs the step.

One spawn per world size (a module-scoped job runs every case; the tests check its results): starting
processes costs seconds on a 2-core machine, the cases milliseconds. Microbatch counts are not
multiples of the stage count. Tolerance as in test_local.py: fp32, rtol 1e-5 (only the order in which
microbatch gradients are summed differs from the unpipelined backward of the mean loss).
"""

import time

import pytest
import torch
import torch.distributed as dist

from tessel.parallel.comm import count_bytes
from tessel.parallel.pipeline.p2p import PipelineAbortedError, PipelineTimeoutError
from tessel.parallel.pipeline.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZeroBubble,
)
from tessel.parallel.pipeline.stage import META_NUMEL, PipelineStage
from tessel.parallel.pipeline.timeline import gather_timeline
from tests.multiprocess import run_ranks
from tests.parallel.pipeline import models

pytestmark = pytest.mark.multiprocess

ENV = {"OMP_NUM_THREADS": "1"}  # see conftest.py
SCHEDULES = {
    "gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "zb": ScheduleZeroBubble, "interleaved": ScheduleInterleaved1F1B,
}  # fmt: skip
# (schedule, stages per rank, microbatches, deferred weight gradients)
CASES = {
    2: [("gpipe", 1, 3, False), ("1f1b", 1, 5, False), ("zb", 1, 3, False), ("zb", 1, 5, True),
        ("interleaved", 2, 3, False), ("interleaved", 2, 5, False)],
    4: [("gpipe", 1, 6, False), ("1f1b", 1, 6, False), ("1f1b", 1, 3, False), ("zb", 1, 6, True),
        ("interleaved", 2, 6, False), ("interleaved", 2, 3, False)],
}  # fmt: skip
MB_SIZE = 2


def _build(rank, world_size, name, v, m, deferred, group=None, wrap=None):
    num_stages = world_size * v
    modules = models.build_stages(num_stages, deferred)
    stages = [PipelineStage(wrap(modules[s]) if wrap else modules[s], s, num_stages, group)
              for s in range(rank, num_stages, world_size)]  # fmt: skip
    return stages, SCHEDULES[name](stages if v > 1 else stages[0], m, models.loss_fn, timeout=60)


def _run_case(rank, world_size, case):
    name, v, m, deferred = case
    stages, schedule = _build(rank, world_size, name, v, m, deferred)
    x, aux, target = models.make_batch(MB_SIZE * m)
    losses, runs_before = [], models.DEFERRED_RUNS[0]
    schedule.step(x, aux, target=target, losses=losses)
    grads = {f"{s.stage_index}.{n}": p.grad.clone() for s in stages for n, p in s.module.named_parameters()}
    return {"losses": torch.stack(losses) if losses else None, "grads": grads,
            "deferred_runs": models.DEFERRED_RUNS[0] - runs_before}  # fmt: skip


def _check_cases(results, world_size):
    for k, case in enumerate(CASES[world_size]):
        _, v, m, deferred = case
        x, aux, target = models.make_batch(MB_SIZE * m)
        ref_losses, ref_grads = models.reference(models.build_stages(world_size * v, deferred), x, aux, target, m)
        last_rank = (world_size * v - 1) % world_size
        for rank, per_rank in enumerate(results):
            got = per_rank["cases"][k]
            if rank == last_rank:
                torch.testing.assert_close(got["losses"], ref_losses, rtol=1e-5, atol=0, msg=f"{case} losses")
            else:
                assert got["losses"] is None
            assert len(got["grads"]) == 2 * v  # weight and bias of each of the rank's stages
            for param, grad in got["grads"].items():
                torch.testing.assert_close(grad, ref_grads[param], rtol=1e-5, atol=1e-7, msg=f"{case} {param}")
            # ZB's B deferred each DeferredLinear's weight gradient; W ran one closure per microbatch.
            assert got["deferred_runs"] == (m if deferred else 0)


def _fail_within_step(fn):
    """Run ``fn``; return the error's type name, its message and the seconds it took to raise."""
    start = time.monotonic()
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - start
    return None, None, time.monotonic() - start


# ---------------------------------------------------------------------------------------------------- 2 ranks


def _two_rank_job(rank, world_size):
    out = {"cases": [_run_case(rank, world_size, case) for case in CASES[2]]}
    # Bytes: activations (float h and int64 aux) forward, float gradients backward, metadata once.
    stages, schedule = _build(rank, world_size, "1f1b", 1, 3, False)
    x, aux, target = models.make_batch(MB_SIZE * 3)
    counted = []
    for _ in range(2):
        with count_bytes() as counter:
            schedule.step(x, aux, target=target)
        counted.append((counter.sent, counter.received))
    out["bytes"] = counted
    out["two_step_grad"] = stages[0].module.linear.weight.grad.clone()
    # A later step whose activations change shape: the sender raises, the receiver is told to stop.
    group = dist.new_group([0, 1])
    _, schedule = _build(rank, world_size, "1f1b", 1, 2, False, group=group)
    schedule.step(*models.make_batch(4)[:2], target=models.make_batch(4)[2])
    x, aux, target = models.make_batch(6)
    out["shape_change"] = _fail_within_step(lambda: schedule.step(x, aux, target=target))
    # A bad argument on one rank (a batch that does not divide) stops the other one too.
    group = dist.new_group([0, 1])
    _, schedule = _build(rank, world_size, "gpipe", 1, 2, False, group=group)
    x, aux, target = models.make_batch(4 if rank == 1 else 5)
    out["bad_argument"] = _fail_within_step(lambda: schedule.step(x, aux, target=target))
    # A peer that never runs the step: the waiting rank times out.
    group = dist.new_group([0, 1])
    stages, schedule = _build(rank, world_size, "gpipe", 1, 2, False, group=group)
    schedule.timeout = 1.0
    if rank == 0:
        out["timeout"] = _fail_within_step(lambda: schedule.step(*models.make_batch(4)[:2]))
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_two_rank_job, 2, env=ENV, timeout=150)


def test_two_ranks_match_the_unpipelined_model(two_ranks):
    _check_cases(two_ranks, 2)


def test_two_ranks_count_the_bytes_they_move(two_ranks):
    h_bytes = MB_SIZE * models.TOKENS * models.HIDDEN * 4  # fp32 activation of one microbatch
    aux_bytes = MB_SIZE * models.TOKENS * 1 * 8  # int64, carried along without a gradient
    meta = META_NUMEL * 8
    forward, backward = 3 * (h_bytes + aux_bytes), 3 * h_bytes
    assert two_ranks[0]["bytes"] == [(forward + meta, backward), (forward, backward)]  # metadata on the first step
    assert two_ranks[1]["bytes"] == [(backward, forward + meta), (backward, forward)]


def test_second_step_accumulates_gradients(two_ranks):
    x, aux, target = models.make_batch(MB_SIZE * 3)
    _, ref_grads = models.reference(models.build_stages(2), x, aux, target, 3)
    torch.testing.assert_close(two_ranks[0]["two_step_grad"], 2 * ref_grads["0.linear.weight"], rtol=1e-5, atol=1e-7)


def test_changed_shapes_stop_both_ranks(two_ranks):
    sender, receiver = two_ranks[0]["shape_change"], two_ranks[1]["shape_change"]
    assert sender[0] == "ValueError" and "now outputs float32[3, 3, 19]" in sender[1]
    assert receiver[0] == "PipelineAbortedError" and "pipeline rank 0 raised ValueError" in receiver[1]
    assert receiver[2] < 10  # told within one poll of the abort key, not after the 60 s timeout


def test_a_bad_argument_on_one_rank_stops_the_other(two_ranks):
    assert two_ranks[0]["bad_argument"][0] == "ValueError"
    assert "input 0 has batch size 5, which does not divide into 2 microbatches" in two_ranks[0]["bad_argument"][1]
    kind, message, elapsed = two_ranks[1]["bad_argument"]
    assert kind == PipelineAbortedError.__name__ and "pipeline rank 0 raised ValueError: " in message
    assert elapsed < 10


def test_a_peer_that_never_runs_makes_the_wait_time_out(two_ranks):
    kind, message, elapsed = two_ranks[0]["timeout"]
    assert kind == PipelineTimeoutError.__name__ and "did not complete within 1 s" in message
    assert 1.0 <= elapsed < 10


# ---------------------------------------------------------------------------------------------------- 4 ranks


def _four_rank_job(rank, world_size):
    out = {"cases": [_run_case(rank, world_size, case) for case in CASES[4]]}
    _, schedule = _build(rank, world_size, "zb", 1, 5, False)
    x, aux, target = models.make_batch(MB_SIZE * 5)
    schedule.step(x, aux, target=target)
    merged = gather_timeline(schedule.timeline)
    out["timeline"] = [(e.rank, e.kind, e.stage, e.microbatch, e.start, e.end) for e in merged]
    # Rank 2 raises in its third forward; every rank must stop with an error well before the 60 s timeout.
    group = dist.new_group(list(range(world_size)))
    wrap = (lambda module: models.FailingStage(module, fail_at=2)) if rank == 2 else None
    _, schedule = _build(rank, world_size, "1f1b", 1, 6, False, group=group, wrap=wrap)
    x, aux, target = models.make_batch(MB_SIZE * 6)
    out["abort"] = _fail_within_step(lambda: schedule.step(x, aux, target=target))
    return out


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(_four_rank_job, 4, env=ENV, timeout=150)


def test_four_ranks_match_the_unpipelined_model(four_ranks):
    _check_cases(four_ranks, 4)


def test_four_ranks_gather_one_timeline(four_ranks):
    events = four_ranks[0]["timeline"]
    assert events == four_ranks[3]["timeline"]  # the same merged timeline on every rank
    compute = sorted((r, k, s, i) for r, k, s, i, _, _ in events if k in ("F", "B", "W"))
    assert compute == sorted((r, k, r, i) for r in range(4) for k in ("F", "B", "W") for i in range(5))
    assert min(start for *_, start, _ in events) == 0
    first_f = {r: min(start for rr, k, _, _, start, _ in events if rr == r and k == "F") for r in range(4)}
    assert first_f[0] < first_f[1] < first_f[2] < first_f[3]  # the fill of the pipeline, on a shared clock


def test_a_rank_that_raises_stops_every_rank(four_ranks):
    failed = four_ranks[2]["abort"]
    assert failed[0] == "RuntimeError" and "injected failure" in failed[1]
    for rank in (0, 1, 3):
        kind, message, elapsed = four_ranks[rank]["abort"]
        assert kind == PipelineAbortedError.__name__, (rank, kind, message)
        assert "pipeline rank 2 raised RuntimeError at F(stage=2, mb=2)" in message
        assert elapsed < 10, elapsed  # bounded by the abort signal, not by the 60 s timeout
