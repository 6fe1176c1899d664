"""ZeroAdam with DDP (ZeRO-1/2) against one process training on the whole batch with torch.optim.AdamW.

Each rank trains on its half of every batch; the reference trains an unwrapped copy on the whole batch
(means over equal halves, so the averaged gradient is the whole-batch gradient), with
``torch.nn.utils.clip_grad_norm_`` where ZeroAdam clips. Tolerances: fp32 results differ only by the
summation order of the halves and of the norm's partial sums (~1e-7 relative after three steps),
checked at 1e-4. bf16 weights (fp32 master): the forward and gradients run in bf16 (relative error
~2^-8 per rounding) while the reference runs in fp32; Adam's normalised update moves each weight by at
most ~lr per step whatever the gradient error, so after 3 steps at lr=1e-3 weights agree to ~1e-2
absolute, outputs to ~2e-2.
"""

import contextlib
import math

import pytest
import torch
from torch import nn

from tests.multiprocess import run_ranks
from tests.parallel.data_parallel_models import batch as _batch
from tests.parallel.data_parallel_models import mse as _loss
from tests.parallel.data_parallel_models import probe as _probe

FP32 = dict(rtol=1e-4, atol=1e-6)
BF16 = dict(rtol=2e-2, atol=2e-2)
STEPS = 3
# name: (stage, max_grad_norm, loss_scale, dtype, lr, param groups, accumulation). Accumulation over
# microbatches: "no_sync" reduces only the last backward; "sync" reduces each backward into the shard.
CASES = {
    "zero1_groups_static_scale": (1, None, 128.0, torch.float32, 1e-2, True, None),
    "zero2_clip_dynamic_scale": (2, 0.05, "dynamic", torch.float32, 1e-2, False, None),
    "zero1_clip": (1, 0.05, None, torch.float32, 1e-2, True, None),
    "zero2_bf16": (2, None, "dynamic", torch.bfloat16, 1e-3, False, None),
    "zero1_no_sync": (1, None, None, torch.float32, 1e-2, False, "no_sync"),
    "zero2_no_sync": (2, 0.05, None, torch.float32, 1e-2, False, "no_sync"),
    "zero1_accumulate_synced": (1, None, None, torch.float32, 1e-2, False, "sync"),
    "zero2_accumulate_synced": (2, None, None, torch.float32, 1e-2, False, "sync"),
}
MICRO = 3


def _net(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 19), nn.GELU(), nn.Linear(19, 11), nn.Tanh(), nn.Linear(11, 5)).to(dtype)


def _param_groups(net, lr, groups: bool):
    if not groups:
        return [{"params": list(net.parameters()), "weight_decay": 0.1, "lr": lr}]
    decay = [p for p in net.parameters() if p.dim() > 1]
    return [{"params": decay, "weight_decay": 0.1, "lr": lr},
            {"params": [p for p in net.parameters() if p.dim() == 1], "weight_decay": 0.0, "lr": lr / 2}]  # fmt: skip


def _reference(name, steps=STEPS):
    _, clip, _, dtype, lr, groups, _ = CASES[name]
    net = _net(dtype).float()  # the bf16 case starts from the bf16-rounded weights, then trains in fp32
    opt = torch.optim.AdamW(_param_groups(net, lr, groups))
    for step in range(steps):
        _loss(net, *_batch(step)).backward()
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), math.inf if clip is None else clip)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()], net(_probe()).detach(), norm


def _half(x, rank, world_size):
    n = x.shape[0] // world_size
    return x[rank * n : (rank + 1) * n]


def _train(rank, world_size, name, steps=STEPS):
    from tessel.parallel.ddp import DDP
    from tessel.parallel.zero import ZeroAdam

    stage, clip, loss_scale, dtype, lr, groups, accumulation = CASES[name]
    net = _net(dtype)
    ddp = DDP(net, bucket_mb=60 * 4 / 2**20)
    opt = ZeroAdam(_param_groups(net, lr, groups), lr=lr, stage=stage, max_grad_norm=clip, loss_scale=loss_scale)
    micro = 1 if accumulation is None else MICRO
    for step in range(steps):
        x, y = (_half(t, rank, world_size) for t in _batch(step, dtype))
        for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            local = accumulation == "no_sync" and i < micro - 1
            with ddp.no_sync() if local else contextlib.nullcontext():
                opt.scale_loss(_loss(ddp, xm, ym) / micro).backward()
        opt.step()
        opt.zero_grad()
    copies_exact = all(
        torch.equal(m.to(dtype), b.param_shard) for m, b in zip(opt._master, ddp.buckets) if m is not b.param_shard
    )
    weights = [p.detach().float().clone() for p in net.parameters()]
    return weights, ddp(_probe(dtype)).detach().float(), copies_exact, opt.grad_norm.reshape(()).clone()


def _skip_on_one_rank(rank, world_size):
    """A non-finite gradient on rank 1 only: every rank skips, bit for bit, and the dynamic scale halves."""
    from tessel.parallel.ddp import DDP
    from tessel.parallel.zero import ZeroAdam

    net = _net()
    ddp = DDP(net, bucket_mb=60 * 4 / 2**20)
    opt = ZeroAdam(ddp.parameters(), lr=1e-2, weight_decay=0.1, loss_scale="dynamic", growth_interval=100)

    def snapshot():
        return [t.clone() for t in [*net.parameters(), *opt._master, *opt._exp_avg, *opt._exp_avg_sq]]

    def train_step(step, poison):
        x, y = (_half(t, rank, world_size) for t in _batch(step))
        loss = _loss(ddp, x, y) * (math.inf if poison else 1.0)
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()

    train_step(0, poison=False)
    before, scale = snapshot(), opt.loss_scale
    train_step(1, poison=rank == 1)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, snapshot()))
    after_skip = (opt.loss_scale, opt.steps_taken, opt.steps_skipped)
    train_step(2, poison=False)
    moved = not all(torch.equal(a, b) for a, b in zip(before, snapshot()))
    return unchanged, scale, after_skip, moved, opt.steps_taken


def _checkpoint(rank, world_size):
    """Train 2 steps at dp=2, save, check the round trip, train 2 more: the uninterrupted run."""
    from tessel.parallel.ddp import DDP
    from tessel.parallel.zero import ZeroAdam

    net = _net()
    ddp = DDP(net, bucket_mb=60 * 4 / 2**20)
    opt = ZeroAdam(ddp.parameters(), lr=1e-2, weight_decay=0.1, stage=2, loss_scale="dynamic")
    saved = None
    for step in range(4):
        if step == 2:
            saved = opt.state_dict(), {k: v.clone() for k, v in net.state_dict().items()}
            opt.load_state_dict(saved[0])
            round_trip = _equal_state(opt.state_dict(), saved[0])
            sharded = _sharded_round_trip(opt, saved[0])
        x, y = (_half(t, rank, world_size) for t in _batch(step))
        opt.scale_loss(_loss(ddp, x, y)).backward()
        opt.step()
        opt.zero_grad()
    return saved, round_trip, [p.detach().clone() for p in net.parameters()], sharded


def _sharded_round_trip(opt, full: dict):
    """``sharded_state``'s views hold the full state's flat ranges and move no bytes; filling them (after
    scribbling over them) and ``load_sharded_state`` restore the optimizer exactly."""
    from tessel.parallel.comm import count_bytes

    with count_bytes() as moved:
        sd = opt.sharded_state()
    ranges, views_match = [], True
    for i, pieces in sd["shards"].items():
        for start, views in pieces:
            n = views["master"].numel()
            ranges.append((i, start, n))
            for k, view in views.items():
                views_match &= torch.equal(view, full["state"][i][k].reshape(-1)[start : start + n])
                view.fill_(float("nan"))
    assert any(p.isnan().any() for p in opt._params)  # fp32 masters are views of the parameters
    for i, pieces in sd["shards"].items():  # what a checkpoint reader does
        for start, views in pieces:
            for k, view in views.items():
                view.copy_(full["state"][i][k].reshape(-1)[start : start + view.numel()])
    opt.load_sharded_state(sd["step"], sd["loss_scale"], sd["growth_tracker"])
    restored = _equal_state(opt.state_dict(), full)
    return moved.sent + moved.received, ranges, views_match, restored, (sd["step"], sd["loss_scale"])


def _equal_state(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal_state(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal_state(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def _all_cases(rank, world_size):
    out = {name: _train(rank, world_size, name) for name in CASES}
    out["skip"] = _skip_on_one_rank(rank, world_size)
    out["checkpoint"] = _checkpoint(rank, world_size)
    return out


@pytest.fixture(scope="module")
def two_rank_results():
    return run_ranks(_all_cases, 2, timeout=240)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(CASES))
def test_zero_matches_whole_batch_adamw(two_rank_results, name):
    tol = BF16 if CASES[name][3] == torch.bfloat16 else FP32
    weights, out, norm = _reference(name)
    for rank, results in enumerate(two_rank_results):
        got_weights, got_out, copies_exact, got_norm = results[name]
        # the last step's global gradient norm (over both ranks' shards), before clipping
        torch.testing.assert_close(got_norm, norm, **tol)
        for i, (g, w) in enumerate(zip(got_weights, weights)):
            torch.testing.assert_close(g, w, **tol, msg=lambda m, i=i, r=rank: f"{name} rank {r} weight {i}: {m}")
        torch.testing.assert_close(got_out, out, **tol, msg=lambda m, r=rank: f"{name} rank {r} output: {m}")
        assert copies_exact, "the low-precision parameters must be exactly the fp32 masters cast"
    for a, b in zip(two_rank_results[0][name][0], two_rank_results[1][name][0]):
        assert torch.equal(a, b), "ranks diverged"


@pytest.mark.multiprocess
def test_non_finite_gradient_on_one_rank_skips_everywhere(two_rank_results):
    for results in two_rank_results:
        unchanged, scale, (scale_after, taken, skipped), moved, taken_later = results["skip"]
        assert unchanged, "weights, masters or moments changed on a skipped step"
        assert scale_after == scale / 2 and (taken, skipped) == (1, 1)
        assert moved and taken_later == 2


@pytest.mark.multiprocess
def test_sharded_state_is_each_ranks_own_ranges_as_live_views(two_rank_results):
    covered = {i: torch.zeros(p.numel(), dtype=torch.int64) for i, p in enumerate(_net().parameters())}
    for results in two_rank_results:
        moved, ranges, views_match, restored, (step, scale) = results["checkpoint"][3]
        assert moved == 0, "sharded_state communicated"
        assert views_match and restored and step == 2 and scale == results["checkpoint"][0][0]["loss_scale"]
        for i, start, n in ranges:
            covered[i][start : start + n] += 1
    assert all(c.eq(1).all() for c in covered.values()), "the two ranks' ranges must cover each parameter once"


@pytest.mark.multiprocess
def test_checkpoint_saved_at_dp2_continues_at_dp1(two_rank_results):
    from tessel.parallel.ddp import DDP
    from tessel.parallel.zero import ZeroAdam

    (opt_state, model_state), round_trip, uninterrupted, _ = two_rank_results[0]["checkpoint"]
    assert round_trip and two_rank_results[1]["checkpoint"][1]
    assert opt_state["step"] == 2 and opt_state["world_size"] == 2
    net = _net()
    net.load_state_dict(model_state)
    ddp = DDP(net)  # a world of one: the whole batch on one rank
    opt = ZeroAdam(ddp.parameters(), lr=1e-2, weight_decay=0.1, stage=2, loss_scale="dynamic")
    opt.load_state_dict(opt_state)
    assert _equal_state({k: v for k, v in opt.state_dict().items() if k != "world_size"},
                        {k: v for k, v in opt_state.items() if k != "world_size"})  # fmt: skip
    for step in (2, 3):
        opt.scale_loss(_loss(ddp, *_batch(step))).backward()
        opt.step()
        opt.zero_grad()
    for i, (g, w) in enumerate(zip(net.parameters(), uninterrupted)):
        torch.testing.assert_close(g.detach(), w, **FP32, msg=lambda m, i=i: f"weight {i}: {m}")


# ---------------------------------------------------------------------------------------------------- tp × dp


class _TPMLP(nn.Module):
    def __init__(self, fc, proj):
        super().__init__()
        self.fc, self.proj = fc, proj

    def forward(self, x):
        return self.proj(torch.nn.functional.gelu(self.fc(x)))


def _dense_mlp():
    torch.manual_seed(3)
    return _TPMLP(nn.Linear(9, 16), nn.Linear(16, 9))


def _mlp_batch(step):
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(4, 3, 9, generator=g), torch.randn(4, 3, 9, generator=g)


def _tp_dp(rank, world_size):
    from tessel.layers.linear import ColumnParallelLinear, RowParallelLinear
    from tessel.parallel.ddp import DDP
    from tessel.parallel.dims import init_parallel
    from tessel.parallel.zero import ZeroAdam

    dims = init_parallel(tp=2, dp=2)
    dense = _dense_mlp()
    model = _TPMLP(ColumnParallelLinear.from_linear(dense.fc, tp_group=dims.tp_group),
                   RowParallelLinear.from_linear(dense.proj, tp_group=dims.tp_group))  # fmt: skip
    for p in (model.fc.weight, model.fc.bias, model.proj.weight):  # the row bias stays replicated
        p.tensor_parallel = True
    ddp = DDP(model, group=dims.dp_group)
    opt = ZeroAdam(ddp.parameters(), lr=1e-2, weight_decay=0.1, group=dims.dp_group, tp_group=dims.tp_group,
                   max_grad_norm=0.05)  # fmt: skip
    for step in range(STEPS):
        x, y = (_half(t, dims.dp_rank, 2) for t in _mlp_batch(step))
        (ddp(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return dims.tp_rank, weights


@pytest.mark.multiprocess
def test_tp2_dp2_matches_dense_training():
    dense = _dense_mlp()
    opt = torch.optim.AdamW(dense.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        x, y = _mlp_batch(step)
        (dense(x) - y).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.05)  # active: the norm is ~1
        opt.step()
        opt.zero_grad()
    for tp_rank, got in run_ranks(_tp_dp, 4, timeout=180):
        rows, cols = slice(8 * tp_rank, 8 * (tp_rank + 1)), slice(8 * tp_rank, 8 * (tp_rank + 1))
        want = {"fc.weight": dense.fc.weight[rows], "fc.bias": dense.fc.bias[rows],
                "proj.weight": dense.proj.weight[:, cols], "proj.bias": dense.proj.bias}  # fmt: skip
        for k, w in want.items():
            torch.testing.assert_close(
                got[k], w.detach(), **FP32, msg=lambda m, k=k, t=tp_rank: f"tp rank {t} {k}: {m}"
            )


# ---------------------------------------------------------------------------------------------------- bad input


def test_zero_adam_bad_input_changes_nothing():
    from tessel.parallel.ddp import DDP
    from tessel.parallel.zero import ZeroAdam

    net = _net()
    ddp = DDP(net)
    before = [p.detach().clone() for p in net.parameters()]
    params = list(ddp.parameters())
    bad = [
        (dict(lr=-1.0), ValueError, r"ZeroAdam: lr must be >= 0, received -1\.0"),
        (dict(betas=(1.0, 0.9)), ValueError, r"ZeroAdam: betas\[0\] must be in \[0, 1\), received 1\.0"),
        (dict(betas=(0.9, -0.1)), ValueError, r"ZeroAdam: betas\[1\] must be in \[0, 1\), received -0\.1"),
        (dict(betas=0.9), TypeError, r"ZeroAdam: betas must be a pair of numbers"),
        (dict(eps=0.0), ValueError, r"ZeroAdam: eps must be > 0, received 0\.0"),
        (dict(weight_decay=-0.1), ValueError, r"ZeroAdam: weight_decay must be >= 0"),
        (dict(lr="1e-3"), TypeError, r"ZeroAdam: lr must be a real number, received str"),
        (dict(loss_scale=0), ValueError, r"ZeroAdam: loss_scale must be a positive finite number, received 0"),
        (dict(loss_scale="static"), ValueError, r"ZeroAdam: loss_scale must be None, a number or 'dynamic'"),
        (dict(max_grad_norm=0), ValueError, r"ZeroAdam: max_grad_norm must be None or > 0, received 0"),
        (dict(growth_interval=0), ValueError, r"ZeroAdam: growth_interval must be >= 1"),
        (dict(backoff_factor=1.5), ValueError, r"ZeroAdam: backoff_factor must be in \(0, 1\)"),
        (dict(stage=3), ValueError, r"ZeroAdam: stage must be one of \(1, 2\) with DDP, received 3"),
        (dict(tp_group="tp"), TypeError, r"ZeroAdam: tp_group must be None or a ProcessGroup, received str"),
    ]
    for kwargs, error, match in bad:
        with pytest.raises(error, match=match):
            ZeroAdam(params, **kwargs)
    with pytest.raises(ValueError, match=r"ZeroAdam: parameter 0 is not managed by a DDP or FSDP wrapper"):
        ZeroAdam(_net().parameters())
    on_meta = nn.Parameter(torch.zeros(3, device="meta"))
    with pytest.raises(ValueError, match=r"ZeroAdam: all parameters must be on one device; parameter 0 is on cpu, "
                                         r"parameter 1 on meta"):  # fmt: skip
        ZeroAdam([params[0], on_meta])
    for dtype in (torch.float64, torch.int64):
        p = nn.Parameter(torch.zeros(3, dtype=dtype), requires_grad=False)
        with pytest.raises(TypeError, match=rf"ZeroAdam: parameter 1 must be float32, bfloat16 or float16, "
                                            rf"received {dtype}"):  # fmt: skip
            ZeroAdam([params[0], p])
    assert ddp.zero_stage == 0 and all(torch.equal(p, q) for p, q in zip(net.parameters(), before))
    opt = ZeroAdam(params)
    with pytest.raises(ValueError, match=r"ZeroAdam: this DDP already has a ZeroAdam attached"):
        ZeroAdam(params)
    state = opt.state_dict()
    state["state"][0]["exp_avg"] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"ZeroAdam.load_state_dict: parameter 0's exp_avg has 5 elements"):
        opt.load_state_dict(state)
    assert opt.steps_taken == 0 and all(m.eq(0).all() for m in opt._exp_avg)


def test_dynamic_scale_grows_after_growth_interval_and_lr_schedulers_drive_the_step():
    from tessel.parallel.ddp import DDP
    from tessel.parallel.zero import ZeroAdam

    net = _net()
    ddp = DDP(net)  # a world of one
    opt = ZeroAdam(ddp.parameters(), lr=1e-2, loss_scale="dynamic", growth_interval=2)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0 if step == 1 else 1.0)
    scales, moved = [], []
    for step in range(3):
        before = [p.detach().clone() for p in net.parameters()]
        opt.scale_loss(_loss(ddp, *_batch(step))).backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
        scales.append(opt.loss_scale)
        moved.append(any(not torch.equal(a, b) for a, b in zip(before, net.parameters())))
    assert scales == [2.0**16, 2.0**17, 2.0**17]  # doubled after 2 good steps in a row, then counting again
    assert moved == [True, False, True]  # the scheduler's lr=0 on the second step reached the kernel
    assert opt.steps_taken == 3 and opt.steps_skipped == 0


@pytest.mark.gpu
@pytest.mark.parametrize("stage", [1, 2])
def test_cuda_bf16_world_of_one_and_skip(stage):
    """The compiled kernels and the pinned-memory skip flag on one GPU, against the fp32 CPU reference."""
    from tessel.parallel.ddp import DDP
    from tessel.parallel.zero import ZeroAdam

    weights, _, _ = _reference("zero2_bf16")  # lr 1e-3, weight decay 0.1, from the bf16-rounded weights
    net = _net(torch.bfloat16).cuda()
    ddp = DDP(net)
    opt = ZeroAdam(ddp.parameters(), lr=1e-3, weight_decay=0.1, stage=stage, loss_scale="dynamic")
    for step in range(STEPS):
        x, y = (t.cuda() for t in _batch(step, torch.bfloat16))
        opt.scale_loss(_loss(ddp, x, y)).backward()
        opt.step()
        opt.zero_grad()
    for i, (g, w) in enumerate(zip(net.parameters(), weights)):
        torch.testing.assert_close(g.detach().float().cpu(), w, **BF16, msg=lambda m, i=i: f"weight {i}: {m}")
    before, scale = [p.detach().clone() for p in net.parameters()], opt.loss_scale
    opt.scale_loss(_loss(ddp, x, y) * math.inf).backward()
    opt.step()
    opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    assert opt.loss_scale == scale / 2 and (opt.steps_taken, opt.steps_skipped) == (STEPS, 1)
