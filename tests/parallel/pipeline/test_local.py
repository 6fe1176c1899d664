"""The executor and schedules in a world of one (no process group): stages on one rank hand tensors over
locally, so every schedule runs in this process. Argument errors, metadata, the recorded timeline.

Tolerances: the pipelined run computes each microbatch with the same ops as the unpipelined reference;
only the order in which microbatch gradients are summed differs (1/m-scaled backward per microbatch
against the backward of the mean), a few fp32 ulps: rtol 1e-5 as in the multi-rank tests.
"""

import itertools
import json

import pytest
import torch

from tessel.parallel.pipeline.schedules import (
    PipelineSchedule,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZeroBubble,
)
from tessel.parallel.pipeline.stage import META_NUMEL, PipelineStage, decode_meta, encode_meta
from tessel.parallel.pipeline.timeline import gather_timeline, plot_timeline, write_chrome_trace
from tests.parallel.pipeline import models

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "zb": ScheduleZeroBubble}


def _grads(stages):
    return {f"{s.stage_index}.{n}": p.grad for s in stages for n, p in s.module.named_parameters()}


def _check_against_reference(stages, losses, m, x, aux, target, deferred=False, atol=1e-7):
    x, aux, target = x.cpu(), aux.cpu(), target.cpu()
    ref_losses, ref_grads = models.reference(models.build_stages(len(stages), deferred), x, aux, target, m)
    torch.testing.assert_close(torch.stack(losses).cpu(), ref_losses, rtol=1e-5, atol=atol)
    for name, grad in _grads(stages).items():
        torch.testing.assert_close(grad.cpu(), ref_grads[name], rtol=1e-5, atol=atol)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("deferred", [False, True])
def test_single_stage_schedules_match_the_unpipelined_model(name, deferred):
    m = 3
    stage = PipelineStage(models.build_stages(1, deferred)[0], 0, 1)
    schedule = SCHEDULES[name](stage, m, models.loss_fn)
    x, aux, target = models.make_batch(2 * m)
    losses = []
    out = schedule.step(x, aux, target=target, losses=losses)
    assert out.shape == target.shape and len(losses) == m
    _check_against_reference([stage], losses, m, x, aux, target, deferred)


@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_stages_on_one_rank_hand_over_locally(v):
    m = 4
    stages = [PipelineStage(module, s, v) for s, module in enumerate(models.build_stages(v))]
    schedule = ScheduleInterleaved1F1B(list(reversed(stages)), m, models.loss_fn)  # any order of the list
    x, aux, target = models.make_batch(3 * m)
    losses = []
    schedule.step(x, aux, target=target, losses=losses)
    _check_against_reference(stages, losses, m, x, aux, target)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["interleaved", "zb"])
def test_cuda_stages_match_and_time_on_the_device(name):
    # On CUDA, autograd runs the deferring Function's backward on its device thread: ZB's B must still defer.
    m, v = 3, 2 if name == "interleaved" else 1
    modules = [module.cuda() for module in models.build_stages(v, deferred=name == "zb")]
    stages = [PipelineStage(module, s, v) for s, module in enumerate(modules)]
    schedule = (ScheduleInterleaved1F1B(stages, m, models.loss_fn) if v > 1
                else ScheduleZeroBubble(stages[0], m, models.loss_fn))  # fmt: skip
    x, aux, target = (t.cuda() for t in models.make_batch(2 * m))
    losses, runs_before = [], models.DEFERRED_RUNS[0]
    schedule.step(x, aux, target=target, losses=losses)
    assert models.DEFERRED_RUNS[0] - runs_before == (m if name == "zb" else 0)
    # cuBLAS and the CPU sum 19 products in different orders (TF32 is off for fp32 matmuls by default).
    _check_against_reference(stages, losses, m, x, aux, target, deferred=name == "zb", atol=1e-6)
    compute = [e for e in schedule.timeline if e.is_compute]  # CUDA events, resolved after the step
    assert len(compute) == v * m * (3 if name == "zb" else 2)
    assert all(e.end >= e.start for e in compute)


def test_two_steps_accumulate_gradients():
    stage = PipelineStage(models.build_stages(1)[0], 0, 1)
    schedule = Schedule1F1B(stage, 2, models.loss_fn)
    x, aux, target = models.make_batch(4)
    schedule.step(x, aux, target=target)
    first = {k: g.clone() for k, g in _grads([stage]).items()}
    schedule.step(x, aux, target=target)
    for k, g in _grads([stage]).items():
        torch.testing.assert_close(g, 2 * first[k], rtol=1e-6, atol=0)


def test_loss_without_target():
    stage = PipelineStage(models.build_stages(1)[0], 0, 1)
    losses = []
    ScheduleGPipe(stage, 2, lambda out: out.square().mean()).step(*models.make_batch(4)[:2], losses=losses)
    assert len(losses) == 2 and all(loss.requires_grad is False for loss in losses)


# ---------------------------------------------------------------------------------------------------- errors


def _stage(num_stages=1, index=0):
    return PipelineStage(models.build_stages(num_stages)[index], index, num_stages)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [((torch.nn.Linear(2, 2), 1, 1), ValueError, r"stage_index must be in \[0, num_stages\), received stage_index=1"),
     ((torch.nn.Linear(2, 2), 0, 0), ValueError, "received stage_index=0, num_stages=0"),
     (("module", 0, 1), TypeError, "module must be an nn.Module, received str"),
     ((torch.nn.Linear(2, 2), 0.0, 1), TypeError, "stage_index must be an int, received float")],
)  # fmt: skip
def test_stage_rejects_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        PipelineStage(*args)


def test_schedules_reject_bad_arguments():
    with pytest.raises(ValueError, match="num_stages=2 with 1 pipeline ranks puts several on each"):
        Schedule1F1B(_stage(2), 2, models.loss_fn)
    with pytest.raises(ValueError, match=r"must pass its stages \[0, 1\] \(stage s .*\), received stages \[0\]"):
        ScheduleInterleaved1F1B([_stage(2)], 2, models.loss_fn)
    with pytest.raises(ValueError, match="n_microbatches must be a positive int, received 0"):
        ScheduleGPipe(_stage(), 0, models.loss_fn)
    with pytest.raises(TypeError, match="loss_fn must be callable, received NoneType"):
        ScheduleGPipe(_stage(), 2, None)
    with pytest.raises(TypeError, match="expected a PipelineStage or a non-empty list"):
        ScheduleGPipe([], 2, models.loss_fn)
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds, received 0"):
        ScheduleGPipe(_stage(), 2, models.loss_fn, timeout=0)
    with pytest.raises(TypeError, match="PipelineSchedule is the base of the schedules"):
        PipelineSchedule(_stage(), 2, models.loss_fn)


def test_step_rejects_a_batch_that_does_not_divide():
    schedule = ScheduleGPipe(_stage(), 4, models.loss_fn)
    x, aux, target = models.make_batch(10)
    with pytest.raises(ValueError, match="input 0 has batch size 10, which does not divide into 4 microbatches"):
        schedule.step(x, aux, target=target)
    x, aux, _ = models.make_batch(8)
    with pytest.raises(ValueError, match="target has batch size 10, which does not divide into 4 microbatches"):
        schedule.step(x, aux, target=target)
    with pytest.raises(ValueError, match="needs at least one input tensor"):
        schedule.step(target=target[:8])
    with pytest.raises(TypeError, match="losses must be a list or None, received tuple"):
        schedule.step(x, aux, target=target[:8], losses=())
    with pytest.raises(TypeError, match="input 1 must be a tensor with a batch dimension, received int"):
        schedule.step(x, 3, target=target[:8])


def test_step_rejects_a_loss_that_is_not_a_scalar():
    schedule = ScheduleGPipe(_stage(), 2, lambda out, target: out - target)
    x, aux, target = models.make_batch(4)
    with pytest.raises(TypeError, match=r"loss_fn must return a scalar tensor, received a tensor of shape \(2, 3, 5\)"):
        schedule.step(x, aux, target=target)


def test_metadata_round_trip_and_limits():
    metas = [((4, 3, 19), torch.float32), ((4, 3, 1), torch.int64), ((), torch.bfloat16)]
    encoded = encode_meta(metas)
    assert encoded.shape == (META_NUMEL,) and encoded.dtype == torch.int64
    assert decode_meta(encoded) == metas
    with pytest.raises(ValueError, match="need 65 metadata slots, more than 64"):
        encode_meta([((1,) * 62, torch.float32)])
    with pytest.raises(ValueError, match=r"cannot send a torch\.float8_e4m3fn tensor"):
        encode_meta([((2,), torch.float8_e4m3fn)])


def test_stage_checks_later_outputs_against_the_first():
    stage = _stage()
    assert stage.check_output_meta([torch.zeros(2, 3)]) is True
    assert stage.check_output_meta([torch.ones(2, 3)]) is False
    with pytest.raises(
        ValueError, match=r"now outputs float32\[4, 3\], but the first microbatch output float32\[2, 3\]"
    ):
        stage.check_output_meta([torch.zeros(4, 3)])


# ---------------------------------------------------------------------------------------------------- timeline


def test_timeline_records_every_compute_and_exports(tmp_path):
    stages = [PipelineStage(module, s, 2) for s, module in enumerate(models.build_stages(2))]
    schedule = ScheduleInterleaved1F1B(stages, 3, models.loss_fn)
    x, aux, target = models.make_batch(6)
    schedule.step(x, aux, target=target)
    events = gather_timeline(schedule.timeline)  # a world of one: no collective, times shifted to 0
    compute = [e for e in events if e.is_compute]
    assert sorted((e.kind, e.stage, e.microbatch) for e in compute) == sorted(
        (k, s, i) for k in ("F", "BW") for s in range(2) for i in range(3)
    )
    assert min(e.start for e in events) == 0 and all(e.end >= e.start for e in events)
    spans = sorted((e.start, e.end) for e in compute)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # one rank runs one action at a time
    trace_path = tmp_path / "trace.json"
    write_chrome_trace(events, trace_path)
    trace = json.loads(trace_path.read_text())["traceEvents"]
    assert {e["name"] for e in trace if e["ph"] == "X"} >= {"F0", "BW2"}
    png = tmp_path / "gantt.png"
    plot_timeline(events, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
