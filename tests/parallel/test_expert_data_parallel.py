"""Expert data parallelism: DDP (and ZeroAdam on it) with experts that differ across an ep group.

The toy mixture of experts: a dense input layer, ``ep`` experts and a dense head. Rank ``r`` holds only
expert ``r % ep`` (marked ``expert_parallel``) and trains it on its own data, with no all-to-all: the
ranks that share an expert are its expert-data-parallel group. The reference is one process that holds
every expert and trains on the mean of the ``N`` ranks' losses (rank r's loss through expert r % ep),
so the true gradient of expert ``j`` is ``(1/N)·Σ`` of the local gradients of the ranks using it: DDP
must sum over the expert group and divide by ``N``, not by the expert group's size.

Layouts: dp=4 ep=2 (expert groups {0, 2}, {1, 3}) and dp=2 ep=2 (expert groups of one rank). Before
wrapping, every rank but 0 scribbles over its dense weights and every rank but the first of its expert
group over its expert, so the construction broadcast must come from the right rank of the right group.

Tolerances: fp32 gradients differ from the reference only in the summation order over ranks (~1e-7
relative); after three Adam steps weights and outputs agree to ~1e-6, checked at 1e-4. bf16 parameters
with fp32 masters against the fp32 reference: Adam moves each weight by at most ~lr per step whatever
the bf16 rounding of forward and gradients, so after 3 steps at lr=1e-3 weights agree to ~1e-2.
"""

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.multiprocess import run_ranks
from tests.parallel.test_zero import _equal_state

FP32 = dict(rtol=1e-4, atol=1e-6)
BF16 = dict(rtol=2e-2, atol=2e-2)
EP, STEPS, BATCH, CLIP = 2, 3, 4, 0.05
BUCKET_MB = 60 * 4 / 2**20  # 60 fp32 elements: dense, expert, expert, dense buckets on the toy
LAYOUTS = {"dp4_ep2": 4, "dp2_ep2": 2}
# name: optimizer ("adamw" or the ZeroAdam stage), max_grad_norm, dtype, lr, microbatches (all but the last
# backward under no_sync)
CASES = {
    "adamw": ("adamw", None, torch.float32, 1e-2, 1),
    "adamw_no_sync": ("adamw", None, torch.float32, 1e-2, 2),
    "zero1_clip": (1, CLIP, torch.float32, 1e-2, 1),
    "zero2_clip": (2, CLIP, torch.float32, 1e-2, 1),
    "zero2_clip_no_sync": (2, CLIP, torch.float32, 1e-2, 2),
    "zero2_bf16": (2, None, torch.bfloat16, 1e-3, 1),
}


class _Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 8), nn.Linear(8, 5)
        self.register_buffer("shift", 0.5 * torch.randn(5))  # per expert: broadcast like the expert's weights

    def forward(self, h):
        return self.fc2(torch.tanh(self.fc1(h))) + self.shift


class _Toy(nn.Module):
    """Dense ``inp``, experts ``experts.{j}``, dense ``head``; ``keep=j`` keeps only expert j, marked (its
    parameters and buffer)."""

    def __init__(self, keep: int | None = None, dtype=torch.float32, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(7, 5)
        self.experts = nn.ModuleDict({str(j): _Expert() for j in range(EP)})
        self.head = nn.Linear(5, 5)
        self.to(dtype)
        if keep is not None:
            for j in range(EP):
                if j != keep:
                    del self.experts[str(j)]
            for t in (*self.experts.parameters(), *self.experts.buffers()):
                t.expert_parallel = True

    def forward(self, x, expert: int):
        h = torch.nn.functional.gelu(self.inp(x))
        return self.head(h + self.experts[str(expert)](h))


def _data(step, rank, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, 7, generator=g).to(dtype), torch.randn(BATCH, 5, generator=g).to(dtype)


def _probe(dtype=torch.float32):
    return torch.randn(3, 7, generator=torch.Generator().manual_seed(7)).to(dtype)


def _loss(model, x, y, expert):
    return (model(x, expert) - y).float().pow(2).mean()


def _reference(case, world_size, steps=STEPS):
    """One process, every expert, the mean of the ranks' losses; clip_grad_norm_ where ZeroAdam clips.

    ``case``: ``(optimizer, max_grad_norm, dtype, lr, microbatches)`` as in :data:`CASES`."""
    _, clip, dtype, lr, _ = case
    net = _Toy(dtype=dtype).float()  # the bf16 case starts from the bf16-rounded weights, then trains in fp32
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.1)
    grads = None
    for step in range(steps):
        sum(_loss(net, *_data(step, r), r % EP) for r in range(world_size)).div(world_size).backward()
        grads = grads or {k: p.grad.clone() for k, p in net.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), math.inf if clip is None else clip)
        opt.step()
        opt.zero_grad()
    weights = {k: p.detach().clone() for k, p in net.named_parameters()}
    return weights, [net(_probe(), j).detach() for j in range(EP)], grads, norm


# ---------------------------------------------------------------------------------------------------- ranks


def _scribble(net, rank, dims):
    """Make what DDP must overwrite differ: dense weights off rank 0, experts off their group's first rank."""
    with torch.no_grad():
        for k, t in (*net.named_parameters(), *net.named_buffers()):
            if (rank != 0 and not k.startswith("experts.")) or (k.startswith("experts.") and dims.dp_rank >= EP):
                t.add_(1.0 + rank)


def _wrapped(rank, dims, dtype=torch.float32, *, seed=0, stage=None, **zero):
    from tessel.parallel.ddp import DDP
    from tessel.parallel.zero import ZeroAdam

    net = _Toy(keep=dims.ep_rank, dtype=dtype, seed=seed)
    _scribble(net, rank, dims)
    ddp = DDP(net, dims.dp_group, bucket_mb=BUCKET_MB, expert_group=dims.expert_dp_group)
    opt = None if stage is None else ZeroAdam(ddp.parameters(), weight_decay=0.1, stage=stage, **zero)
    return net, ddp, opt


def _step(ddp, opt, step, rank, dims, micro=1, dtype=torch.float32, poison=False):
    x, y = _data(step, rank, dtype)
    handle = None
    if poison:  # a non-finite gradient for this rank's expert only (its dense gradients stay finite)
        handle = ddp.module.experts[str(dims.ep_rank)].fc1.weight.register_hook(lambda g: g * math.inf)
    for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
        with ddp.no_sync() if i < micro - 1 else contextlib.nullcontext():
            scale = opt.scale_loss if hasattr(opt, "scale_loss") else lambda t: t
            scale(_loss(ddp, xm, ym, dims.ep_rank) / micro).backward()
    if handle is not None:
        handle.remove()


def _train(rank, dims, name):
    kind, clip, dtype, lr, micro = CASES[name]
    if kind == "adamw":
        net, ddp, _ = _wrapped(rank, dims, dtype)
        opt = torch.optim.AdamW(ddp.parameters(), lr=lr, weight_decay=0.1)
    else:
        net, ddp, opt = _wrapped(rank, dims, dtype, stage=kind, lr=lr, max_grad_norm=clip)
    grads = None
    for step in range(STEPS):
        _step(ddp, opt, step, rank, dims, micro, dtype)
        if kind == "adamw" and grads is None:
            grads = {k: p.grad.clone() for k, p in net.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {
        "weights": {k: p.detach().float().clone() for k, p in net.named_parameters()},
        "out": ddp(_probe(dtype), dims.ep_rank).detach().float(),
        "grads": grads,
        "norm": None if kind == "adamw" else opt.grad_norm.reshape(()).clone(),
    }


def _skip(rank, dims):
    """Rank 1's expert gradient is non-finite on the second step: every rank skips it, bit for bit."""
    net, ddp, opt = _wrapped(rank, dims, stage=2, lr=1e-2, loss_scale="dynamic", growth_interval=100)

    def snapshot():
        return [t.clone() for t in [*net.parameters(), *opt._master, *opt._exp_avg, *opt._exp_avg_sq]]

    def train(step, poison=False):
        _step(ddp, opt, step, rank, dims, poison=poison)
        opt.step()
        opt.zero_grad()

    train(0)
    before, scale = snapshot(), opt.loss_scale
    train(1, poison=rank == 1)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, snapshot()))
    after = (opt.loss_scale, opt.steps_taken, opt.steps_skipped)
    train(2)
    moved = not all(torch.equal(a, b) for a, b in zip(before, snapshot()))
    return unchanged, scale, after, moved


def _checkpoint(rank, dims, stage):
    """Train 2 steps, save; a fresh DDP + ZeroAdam (other initial weights) loads it; one more step on both."""
    net, ddp, opt = _wrapped(rank, dims, stage=stage, lr=1e-2, max_grad_norm=CLIP)
    for step in range(2):
        _step(ddp, opt, step, rank, dims)
        opt.step()
        opt.zero_grad()
    saved = opt.state_dict()
    at_save = {k: p.detach().clone() for k, p in net.named_parameters()}
    names = {i: k for i, (k, _) in enumerate(net.named_parameters())}
    sharded = _sharded_ranges(opt, saved)
    net2, ddp2, opt2 = _wrapped(rank, dims, seed=1, stage=stage, lr=1e-2, max_grad_norm=CLIP)
    with torch.no_grad():  # the buffers come from the model's checkpoint, the parameters from the optimizer's
        for b2, b in zip(net2.buffers(), net.buffers()):
            b2.copy_(b)
    opt2.load_state_dict(saved)
    round_trip = _equal_state(opt2.state_dict(), saved)
    for wrapper, optimizer in ((ddp, opt), (ddp2, opt2)):
        _step(wrapper, optimizer, 2, rank, dims)
        optimizer.step()
    resumed_equal = all(torch.equal(a, b) for a, b in zip(net.parameters(), net2.parameters()))
    return {"saved": saved, "at_save": at_save, "names": names, "round_trip": round_trip,
            "resumed_equal": resumed_equal, "sharded": sharded}  # fmt: skip


def _sharded_ranges(opt, full):
    """``(param index, start, numel)`` of this rank's sharded_state views, and whether they hold the full
    state's values."""
    ranges, match = [], True
    for i, pieces in opt.sharded_state()["shards"].items():
        for start, views in pieces:
            n = views["master"].numel()
            ranges.append((i, start, n))
            match &= all(torch.equal(v, full["state"][i][k].reshape(-1)[start : start + n]) for k, v in views.items())
    return ranges, match


def _untouched(net, ptrs) -> bool:
    from tessel.parallel.ddp import OWNER_ATTR

    return [p.data_ptr() for p in net.parameters()] == ptrs and not any(
        hasattr(p, OWNER_ATTR) for p in net.parameters()
    )


def _refusals(rank, world_size, dims, wrapper=None):
    """Each bad expert_group raises (ValueError/TypeError) and leaves the module as it was (DDP's, or
    ``wrapper``'s: FSDP's)."""
    from tessel.parallel.ddp import DDP

    wrapper = wrapper or DDP
    name = wrapper.__name__
    net = _Toy(keep=dims.ep_rank)
    ptrs = [p.data_ptr() for p in net.parameters()]
    own = dist.new_subgroups_by_enumeration([[r] for r in range(world_size)])[0]
    three = None
    if world_size == 4:  # overlapping groups of 3 (every rank creates both): every rank has one to pass
        first, last = dist.new_group([0, 1, 2]), dist.new_group([1, 2, 3])
        three, members = (last, "1, 2, 3") if rank == 3 else (first, "0, 1, 2")
    attempts = [
        ("missing", dict(group=dims.dp_group), ValueError,
         rf"{name}: the module has expert parameters \(expert_parallel = True, e.g. 'experts\.\d\.fc1\.weight'\) "
         rf"and the data-parallel group has {world_size} ranks: expert_group must be .* received None"),
        ("not a subset", dict(group=own, expert_group=dist.group.WORLD), ValueError,
         rf"{name}: expert_group must be a subset of group's ranks \[{rank}\], received a group of ranks "
         rf"\[{', '.join(map(str, range(world_size)))}\]"),
        ("wrong type", dict(group=dims.dp_group, expert_group="expert_dp"), TypeError,
         rf"{name}: expert_group must be None or a torch\.distributed ProcessGroup, received str"),
    ]  # fmt: skip
    if three is not None:
        attempts.append(("not dividing", dict(group=dims.dp_group, expert_group=three), ValueError,
                         rf"{name}: expert_group's size must divide the data-parallel size 4, received a group of 3 "
                         rf"ranks \[{members}\]"))  # fmt: skip
    outcome = {}
    for what, kwargs, error, match in attempts:
        with pytest.raises(error, match=match):
            wrapper(net, **kwargs)
        outcome[what] = _untouched(net, ptrs)
    return outcome


def _all_cases(rank, world_size):
    from tessel.parallel.dims import init_parallel

    dims = init_parallel(ep=EP)
    out = {name: _train(rank, dims, name) for name in CASES}
    out["skip"] = _skip(rank, dims)
    out["checkpoint"] = {stage: _checkpoint(rank, dims, stage) for stage in (1, 2)}
    out["refusals"] = _refusals(rank, world_size, dims)
    return out


def layout_results(all_cases, layouts: dict[str, int]):
    """A getter that spawns the ranks of a layout once, on first use, and runs ``all_cases`` there."""
    cache: dict[str, list] = {}

    def get(layout):
        if layout not in cache:
            cache[layout] = run_ranks(all_cases, layouts[layout], timeout=120)
        return cache[layout]

    return get


@pytest.fixture(scope="module")
def results():
    return layout_results(_all_cases, LAYOUTS)


# ---------------------------------------------------------------------------------------------------- tests


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(CASES))
def test_matches_one_process_holding_every_expert(results, layout, name):
    world_size = LAYOUTS[layout]
    kind, clip, dtype, _, _ = CASES[name]
    tol = BF16 if dtype == torch.bfloat16 else FP32
    weights, outs, grads, norm = _reference(CASES[name], world_size)
    if clip is not None:
        assert norm > 2 * clip, "clipping must be active for the comparison to test it"
    ranks = results(layout)
    for rank, got in enumerate(ranks[:world_size]):
        got = got[name]
        check_against_reference(rank, got, weights, outs, tol)
        if kind == "adamw":  # Adam is nearly blind to a gradient's scale: compare the first step's gradients
            for k, g in got["grads"].items():
                torch.testing.assert_close(g, grads[k], **tol, msg=lambda m, k=k, r=rank: f"rank {r} grad {k}: {m}")
        else:  # the global norm over dense and every expert, before clipping
            torch.testing.assert_close(got["norm"], norm, **tol)
    check_replicas_agree([r[name]["weights"] for r in ranks])


def check_against_reference(rank: int, got: dict, weights: dict, outs: list, tol: dict) -> None:
    """A rank holds the reference's dense weights and its own expert's (rank mod ep), with its output."""
    expert = rank % EP
    assert got["weights"].keys() == {k for k in weights if not k.startswith("experts.") or f".{expert}." in k}
    for k, w in got["weights"].items():
        torch.testing.assert_close(w, weights[k], **tol, msg=lambda m, k=k, r=rank: f"rank {r} {k}: {m}")
    torch.testing.assert_close(got["out"], outs[expert], **tol, msg=lambda m, r=rank: f"rank {r} output: {m}")


def check_replicas_agree(weights: list[dict]) -> None:
    """Bitwise: dense weights alike on every rank, each expert alike across its expert group."""
    for rank in range(1, len(weights)):
        mine, first = weights[rank], weights[rank % EP]
        assert all(torch.equal(w, weights[0][k]) for k, w in mine.items() if "experts" not in k)
        assert all(torch.equal(w, first[k]) for k, w in mine.items()), f"rank {rank} diverged"


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_non_finite_expert_gradient_on_one_rank_skips_everywhere(results, layout):
    check_skipped_everywhere(results(layout))


def check_skipped_everywhere(ranks: list[dict]) -> None:
    for rank, got in enumerate(ranks):
        unchanged, scale, (scale_after, taken, skipped), moved = got["skip"]
        assert unchanged, f"rank {rank}: parameters, masters or moments changed on a skipped step"
        assert scale_after == scale / 2 and (taken, skipped) == (1, 1), f"rank {rank}"
        assert moved


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("stage", [1, 2])
def test_state_dict_holds_own_experts_and_round_trips(results, layout, stage):
    from tessel.parallel.ddp import DDP
    from tessel.parallel.zero import ZeroAdam

    def one_process():
        net = _Toy(keep=1)
        opt = ZeroAdam(DDP(net).parameters(), weight_decay=0.1, stage=stage, lr=1e-2, max_grad_norm=CLIP)
        return opt, lambda: dict(net.named_parameters())

    check_state_dicts([r["checkpoint"][stage] for r in results(layout)], one_process)


def check_state_dicts(ranks: list[dict], one_process) -> None:
    """Each rank's ZeroAdam state holds its own parameters, its expert included, round-trips and resumes; the
    shards cover every element of every parameter once; a world of one holding expert 1 (another
    expert-data-parallel size; ``one_process() -> (its ZeroAdam, a getter of its parameters)``) loads rank 1's."""
    covered: dict[tuple[int, str], torch.Tensor] = {}  # (ep rank or -1 for dense, name) -> elements covered
    for rank, got in enumerate(ranks):
        assert got["round_trip"] and got["resumed_equal"] and got.get("loaded_equal", True), f"rank {rank}"
        for i, k in got["names"].items():
            torch.testing.assert_close(got["saved"]["state"][i]["master"], got["at_save"][k], rtol=0, atol=0)
        ranges, views_match = got["sharded"]
        assert views_match
        for i, start, n in ranges:
            name = got["names"][i]
            key = (rank % EP if name.startswith("experts.") else -1, name)
            covered.setdefault(key, torch.zeros(got["at_save"][name].numel(), dtype=torch.int64))
            covered[key][start : start + n] += 1
    # dense parameters sharded over all N ranks, each expert over its expert group: every element once
    assert all(c.eq(1).all() for c in covered.values()) and len(covered) == 4 + 4 * EP
    saved = ranks[1]["saved"]
    opt, params = one_process()
    opt.load_state_dict(saved)
    assert _equal_state({k: v for k, v in opt.state_dict().items() if k != "world_size"},
                        {k: v for k, v in saved.items() if k != "world_size"})  # fmt: skip
    assert saved["world_size"] == len(ranks)
    assert all(torch.equal(p, ranks[1]["at_save"][k]) for k, p in params().items())


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bad_expert_group_is_refused_and_changes_nothing(results, layout):
    check_refusals(results(layout))


def check_refusals(ranks: list[dict]) -> None:
    for rank, got in enumerate(ranks):
        expected = {"missing", "not a subset", "wrong type"} | ({"not dividing"} if len(ranks) == 4 else set())
        assert got["refusals"].keys() == expected and all(got["refusals"].values()), f"rank {rank}: {got['refusals']}"


# ---------------------------------------------------------------------------------------------------- one process


def test_buckets_separate_experts_and_lay_them_out_over_the_expert_group():
    from tessel.parallel.flat import backward_order, make_buckets

    net = _Toy(keep=1)
    buckets = make_buckets(backward_order(net), 4, 3, 60 * 4, group="dp", expert_layout=("expert_dp", 2, 1))
    assert [[s.name for s in b.slots] for b in buckets] == [
        ["head.bias", "head.weight"],
        ["experts.1.fc2.bias", "experts.1.fc2.weight", "experts.1.fc1.bias"],
        ["experts.1.fc1.weight"],
        ["inp.bias", "inp.weight"],
    ]
    assert [b.expert for b in buckets] == [False, True, True, False]
    dense, expert = ("dp", 4, 3), ("expert_dp", 2, 1)
    assert [(b.group, b.world_size, b.rank) for b in buckets] == [dense, expert, expert, dense]
    assert [(b.numel, b.padded, b.shard_offset) for b in buckets] == [(30, 32, 24), (53, 54, 27), (40, 40, 20),
                                                                     (40, 40, 30)]  # fmt: skip


def test_world_of_one_needs_no_expert_group(seed):
    """Without a process group DDP + ZeroAdam on expert parameters is plain training of that model."""
    from tessel.parallel.ddp import DDP
    from tessel.parallel.zero import ZeroAdam

    plain, net = _Toy(keep=0), _Toy(keep=0)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    opt = ZeroAdam(DDP(net, bucket_mb=BUCKET_MB).parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=CLIP)
    for step in range(STEPS):
        for model, o in ((plain, ref), (net, opt)):
            _loss(model, *_data(step, 0), 0).backward()
            if o is ref:
                torch.nn.utils.clip_grad_norm_(plain.parameters(), CLIP)
            o.step()
            o.zero_grad()
    for (k, a), b in zip(plain.named_parameters(), net.parameters()):
        torch.testing.assert_close(b, a, **FP32, msg=lambda m, k=k: f"{k}: {m}")
