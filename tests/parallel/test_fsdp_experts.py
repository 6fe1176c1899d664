"""FSDP (ZeRO-3) with expert parameters: dense parameters sharded over the data-parallel group, experts over
the expert-data-parallel group.

The toy of :mod:`tests.parallel.test_expert_data_parallel`: a dense input layer, ``ep`` experts of which rank
``r`` holds expert ``r % ep`` (marked ``expert_parallel``), a dense head; the reference is one process holding
every expert and training on the mean of the ranks' losses. Two unit layouts: ``root`` (no wrap policy: one
unit whose module holds dense parameters and an expert, as a transformer block with a mixture of experts
does: it is split into a dense part over dp and an expert part over expert-dp, gathered together) and
``units`` (the input layer, the expert and the head each a unit).

Layouts dp=4 ep=2 (expert groups {0, 2}, {1, 3}) and dp=2 ep=2 (expert groups of one rank). The ranks scribble
over what the construction broadcast must overwrite, as in the DDP test. Tolerances as there.
"""

import pytest
import torch
from torch import nn

from tests.parallel.test_expert_data_parallel import (
    BF16,
    CLIP,
    EP,
    FP32,
    STEPS,
    _data,
    _loss,
    _probe,
    _reference,
    _refusals,
    _scribble,
    _sharded_ranges,
    _step,
    _Toy,
    check_against_reference,
    check_refusals,
    check_replicas_agree,
    check_skipped_everywhere,
    check_state_dicts,
    layout_results,
)
from tests.parallel.test_zero import _equal_state

LAYOUTS = {"dp4_ep2": 4, "dp2_ep2": 2}
# name: ((ZeroAdam stage, max_grad_norm, dtype, lr, microbatches), units)
CASES = {
    "root_clip": ((3, CLIP, torch.float32, 1e-2, 1), "root"),
    "units_clip": ((3, CLIP, torch.float32, 1e-2, 1), "units"),
    "units_clip_no_sync": ((3, CLIP, torch.float32, 1e-2, 2), "units"),
    "units_bf16": ((3, None, torch.bfloat16, 1e-3, 1), "units"),
}


def _wrap_policy(units: str):
    """``root``: no unit below the root; ``units``: the outermost modules that are not containers."""
    return (lambda m: False) if units == "root" else (lambda m: not isinstance(m, nn.ModuleDict | _Toy))


def _wrapped(rank, dims, dtype=torch.float32, *, units="units", seed=0, **zero):
    from tessel.parallel.fsdp import FSDP
    from tessel.parallel.zero import ZeroAdam

    net = _Toy(keep=dims.ep_rank, dtype=dtype, seed=seed)
    _scribble(net, rank, dims)
    fsdp = FSDP(net, dims.dp_group, wrap=_wrap_policy(units), expert_group=dims.expert_dp_group)
    return fsdp, ZeroAdam(fsdp.parameters(), weight_decay=0.1, **zero)


def _params(fsdp) -> dict[str, torch.Tensor]:
    """This rank's parameters, gathered (its own expert, whole)."""
    names = {k for k, _ in fsdp.module.named_parameters()}
    return {k: v for k, v in fsdp.full_state_dict().items() if k in names}


def _train(rank, dims, name):
    (_, clip, dtype, lr, micro), units = CASES[name]
    fsdp, opt = _wrapped(rank, dims, dtype, units=units, lr=lr, max_grad_norm=clip)
    layout = [(u.name, u.bucket.expert, u.bucket.world_size) for u in fsdp.units]
    for step in range(STEPS):
        _step(fsdp, opt, step, rank, dims, micro, dtype)
        opt.step()
        opt.zero_grad()
    return {
        "weights": _params(fsdp),
        "out": fsdp(_probe(dtype), dims.ep_rank).detach().float(),
        "norm": opt.grad_norm.reshape(()).clone(),
        "layout": layout,
        "freed": all(u.full.untyped_storage().nbytes() == 0 for u in fsdp.units),
    }


def _skip(rank, dims):
    """Rank 1's expert gradient is non-finite on the second step: every rank skips it, bit for bit."""
    fsdp, opt = _wrapped(rank, dims, lr=1e-2, loss_scale="dynamic", growth_interval=100)

    def snapshot():
        shards = [u.bucket.param_shard for u in fsdp.units]
        return [t.clone() for t in [*shards, *opt._master, *opt._exp_avg, *opt._exp_avg_sq]]

    def train(step, poison=False):
        _step(fsdp, opt, step, rank, dims, poison=poison)
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


def _checkpoint(rank, dims):
    """Train 2 steps, save; a fresh FSDP + ZeroAdam (other initial weights) loads it; one more step on both."""
    fsdp, opt = _wrapped(rank, dims, lr=1e-2, max_grad_norm=CLIP)
    for step in range(2):
        _step(fsdp, opt, step, rank, dims)
        opt.step()
        opt.zero_grad()
    saved, at_save = opt.state_dict(), _params(fsdp)
    sharded = _sharded_ranges(opt, saved)
    names = {i: k for i, (k, _) in enumerate(fsdp.module.named_parameters())}
    fsdp2, opt2 = _wrapped(rank, dims, seed=1, lr=1e-2, max_grad_norm=CLIP)
    with torch.no_grad():  # the buffers come from the model's checkpoint, the parameters from the optimizer's
        for b2, b in zip(fsdp2.module.buffers(), fsdp.module.buffers()):
            b2.copy_(b)
    opt2.load_state_dict(saved)
    round_trip = _equal_state(opt2.state_dict(), saved)
    loaded = _params(fsdp2)
    for wrapper, optimizer in ((fsdp, opt), (fsdp2, opt2)):
        _step(wrapper, optimizer, 2, rank, dims)
        optimizer.step()
    after, after2 = _params(fsdp), _params(fsdp2)
    return {"saved": saved, "at_save": at_save, "names": names, "round_trip": round_trip,
            "loaded_equal": all(torch.equal(loaded[k], v) for k, v in at_save.items()),
            "resumed_equal": all(torch.equal(after2[k], v) for k, v in after.items()),
            "sharded": sharded}  # fmt: skip


def _all_cases(rank, world_size):
    from tessel.parallel.dims import init_parallel
    from tessel.parallel.fsdp import FSDP

    dims = init_parallel(ep=EP)
    out = {name: _train(rank, dims, name) for name in CASES}
    out["skip"] = _skip(rank, dims)
    out["checkpoint"] = _checkpoint(rank, dims)
    out["refusals"] = _refusals(rank, world_size, dims, FSDP)
    return out


@pytest.fixture(scope="module")
def results():
    return layout_results(_all_cases, LAYOUTS)


# ---------------------------------------------------------------------------------------------------- tests


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(CASES))
def test_matches_one_process_holding_every_expert(results, layout, name):
    world_size = LAYOUTS[layout]
    case, units = CASES[name]
    tol = BF16 if case[2] == torch.bfloat16 else FP32
    weights, outs, _, norm = _reference(case, world_size)
    if case[1] is not None:
        assert norm > 2 * case[1], "clipping must be active for the comparison to test it"
    ranks = results(layout)
    for rank, got in enumerate(ranks):
        got = got[name]
        check_against_reference(rank, got, weights, outs, tol)
        expert = rank % EP
        if case[1] is not None:  # the global norm over dense and every expert, before clipping
            torch.testing.assert_close(got["norm"], norm, **tol)
        # dense parts over all N ranks, the expert over its expert group of N / ep; nothing left gathered
        expert_dp = world_size // EP
        expected = {
            "root": [("", False, world_size), ("", True, expert_dp)],
            "units": [("inp", False, world_size), (f"experts.{expert}", True, expert_dp), ("head", False, world_size)],
        }[units]
        assert got["layout"] == expected and got["freed"], f"rank {rank}: {got['layout']}"
    check_replicas_agree([r[name]["weights"] for r in ranks])


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_non_finite_expert_gradient_on_one_rank_skips_everywhere(results, layout):
    check_skipped_everywhere(results(layout))


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_state_dict_holds_own_experts_and_round_trips(results, layout):
    from tessel.parallel.fsdp import FSDP
    from tessel.parallel.zero import ZeroAdam

    def one_process():
        fsdp = FSDP(_Toy(keep=1), wrap=_wrap_policy("units"))
        return ZeroAdam(fsdp.parameters(), weight_decay=0.1, lr=1e-2, max_grad_norm=CLIP), lambda: _params(fsdp)

    check_state_dicts([r["checkpoint"] for r in results(layout)], one_process)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bad_expert_group_is_refused_and_changes_nothing(results, layout):
    check_refusals(results(layout))


# ---------------------------------------------------------------------------------------------------- one process


@pytest.mark.parametrize("units", ["root", "units"])
def test_world_of_one_needs_no_expert_group(seed, units):
    """Without a process group FSDP + ZeroAdam on expert parameters is plain training of that model."""
    from tessel.parallel.fsdp import FSDP
    from tessel.parallel.zero import ZeroAdam

    plain = _Toy(keep=0)
    fsdp = FSDP(_Toy(keep=0), wrap=_wrap_policy(units))
    assert [u.bucket.expert for u in fsdp.units] == ([False, True] if units == "root" else [False, True, False])
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    opt = ZeroAdam(fsdp.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=CLIP)
    for step in range(STEPS):
        for model, o in ((plain, ref), (fsdp, opt)):
            _loss(model, *_data(step, 0), 0).backward()
            if o is ref:
                torch.nn.utils.clip_grad_norm_(plain.parameters(), CLIP)
            o.step()
            o.zero_grad()
    got = _params(fsdp)
    for k, a in plain.named_parameters():
        torch.testing.assert_close(got[k], a.detach(), **FP32, msg=lambda m, k=k: f"{k}: {m}")
