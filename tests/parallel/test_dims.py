"""Tests of init_parallel: layouts on 4 gloo ranks, reuse of an existing group, a world of one, and errors."""

import os

import pytest
import torch
import torch.distributed as dist

from tessel.parallel.dims import init_parallel, shutdown
from tests.multiprocess import run_ranks

_TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _members(group, world_size: int) -> list[int]:
    """The global ranks of ``group``, found by summing one-hot vectors over it (a real collective)."""
    onehot = torch.zeros(world_size)
    onehot[dist.get_rank()] = 1.0
    dist.all_reduce(onehot, group=group)
    return onehot.nonzero().flatten().tolist()


def _describe(dims) -> dict:
    """Everything a test checks about one rank's ParallelDims, as plain picklable values."""
    world = dims.world_size
    return {
        "sizes": (dims.dp, dims.pp, dims.tp, world),
        "rank": (dims.rank, dist.get_rank()),
        "coords": (dims.dp_rank, dims.pp_rank, dims.tp_rank),
        "names": dims.mesh.mesh_dim_names,
        "mesh": dims.mesh.mesh.tolist(),
        "backend": (dims.backend, dims.device.type, dims.mesh.device_type),
        "members": {name: _members(getattr(dims, f"{name}_group"), world) for name in ("dp", "pp", "tp")},
    }


def _expected(rank: int, dp: int, pp: int, tp: int) -> dict:
    """The row-major (dp, pp, tp) layout, tp innermost: rank = (dp_rank*pp + pp_rank)*tp + tp_rank."""
    layout = torch.arange(dp * pp * tp).reshape(dp, pp, tp)
    coords = tuple(int(i) for i in (layout == rank).nonzero()[0])
    d, p, t = coords
    return {
        "sizes": (dp, pp, tp, dp * pp * tp),
        "rank": (rank, rank),
        "coords": coords,
        "names": ("dp", "pp", "tp"),
        "mesh": layout.tolist(),
        "backend": ("gloo", "cpu", "cpu"),
        "members": {"dp": layout[:, p, t].tolist(), "pp": layout[d, :, t].tolist(), "tp": layout[d, p, :].tolist()},
    }


def _two_layouts_from_env(rank, world_size):
    assert not dist.is_initialized()
    first = _describe(init_parallel(tp=2, pp=1, dp=-1))  # joins the world from the torchrun variables
    second = _describe(init_parallel(tp=2, pp=2, dp=1))  # a second layout on the same default group
    shutdown()
    return first, second, dist.is_initialized()


@pytest.mark.multiprocess
def test_layouts_on_four_ranks_initialised_from_env():
    results = run_ranks(_two_layouts_from_env, 4, init_process_group=False)
    for rank, (first, second, still_initialised) in enumerate(results):
        assert first == _expected(rank, dp=2, pp=1, tp=2)
        assert second == _expected(rank, dp=1, pp=2, tp=2)
        assert not still_initialised


def _context_parallel_layouts(rank, world_size):
    found = []
    for kw in (dict(cp=2, tp=2), dict(cp=2, dp=2), dict(cp=4), dict(cp=1, tp=2)):
        dims = init_parallel(**kw)
        found.append({
            "names": dims.mesh.mesh_dim_names,
            "sizes": (dims.dp, dims.cp, dims.pp, dims.tp),
            "cp": None if dims.cp_group is None else _members(dims.cp_group, world_size),
            "cp_rank": dims.cp_rank,
            "tp": _members(dims.tp_group, world_size),
            "dp_cp": _members(dims.dp_cp_group, world_size),
        })  # fmt: skip
    return found


@pytest.mark.multiprocess
def test_context_parallel_layouts_on_four_ranks():
    """(dp, cp, pp, tp) row-major, tp innermost; dp_cp groups the ranks that hold the same parameters."""
    results = run_ranks(_context_parallel_layouts, 4)
    names = ("dp", "cp", "pp", "tp")
    for rank, (cp_tp, cp_dp, cp_only, no_cp) in enumerate(results):
        assert cp_tp == {"names": names, "sizes": (1, 2, 1, 2), "cp": [rank % 2, rank % 2 + 2], "cp_rank": rank // 2,
                         "tp": [rank - rank % 2, rank - rank % 2 + 1], "dp_cp": [rank % 2, rank % 2 + 2]}  # fmt: skip
        assert cp_dp == {"names": names, "sizes": (2, 2, 1, 1), "cp": [rank - rank % 2, rank - rank % 2 + 1],
                         "cp_rank": rank % 2, "tp": [rank], "dp_cp": [0, 1, 2, 3]}  # fmt: skip
        assert cp_only == {"names": names, "sizes": (1, 4, 1, 1), "cp": [0, 1, 2, 3], "cp_rank": rank, "tp": [rank],
                           "dp_cp": [0, 1, 2, 3]}  # fmt: skip
        # cp = 1: the contract's 3-D mesh, no cp group, and dp_cp is the DP group
        assert no_cp == {"names": ("dp", "pp", "tp"), "sizes": (2, 1, 1, 2), "cp": None, "cp_rank": 0,
                         "tp": [rank - rank % 2, rank - rank % 2 + 1], "dp_cp": [rank % 2, rank % 2 + 2]}  # fmt: skip


def _expert_layouts(rank, world_size, layouts):
    found = []
    for kw in layouts:
        dims = init_parallel(**kw)
        found.append({
            "ep": dims.ep,
            "ep_rank": dims.ep_rank,
            "ep_group": None if dims.ep_group is None else _members(dims.ep_group, world_size),
            "expert_dp": _members(dims.expert_dp_group, world_size),
        })  # fmt: skip
    return found


def _expected_expert(rank: int, dp: int, ep: int, cp: int = 1, pp: int = 1, tp: int = 1) -> dict:
    """By definition, over every rank's (d, c, p, t): the ep group shares d // ep, c, p, t; the expert-dp
    group shares d % ep, p, t."""
    coords = [(d, c, p, t) for d in range(dp) for c in range(cp) for p in range(pp) for t in range(tp)]
    of = {((d * cp + c) * pp + p) * tp + t: (d, c, p, t) for d, c, p, t in coords}
    d, c, p, t = of[rank]
    ep_group = sorted(r for r, (d2, *rest) in of.items() if d2 // ep == d // ep and rest == [c, p, t])
    expert_dp = sorted(r for r, (d2, _, p2, t2) in of.items() if d2 % ep == d % ep and (p2, t2) == (p, t))
    return {"ep": ep, "ep_rank": d % ep, "ep_group": ep_group if ep > 1 else None, "expert_dp": expert_dp}


@pytest.mark.multiprocess
def test_expert_parallel_groups_on_four_ranks():
    """ep splits dp: ep groups of consecutive dp indices, expert-dp groups of equal ep rank across replicas."""
    layouts = [dict(ep=2), dict(tp=2, dp=2, ep=2), dict(cp=2, dp=2, ep=2), dict(ep=4), dict(tp=2)]
    for rank, (dp4, tp_dp, cp_dp, ep4, no_ep) in enumerate(run_ranks(_expert_layouts, 4, layouts)):
        pair = [rank - rank % 2, rank - rank % 2 + 1]
        assert dp4 == {"ep": 2, "ep_rank": rank % 2, "ep_group": pair, "expert_dp": [rank % 2, rank % 2 + 2]}
        # rank = 2d + t: the ep group spans d at fixed t; each d is its own expert-dp group (one replica)
        assert tp_dp == {"ep": 2, "ep_rank": rank // 2, "ep_group": [rank % 2, rank % 2 + 2], "expert_dp": [rank]}
        # rank = 2d + c: the ep group spans d at fixed c; the expert-dp group spans every cp index
        assert cp_dp == {"ep": 2, "ep_rank": rank // 2, "ep_group": [rank % 2, rank % 2 + 2], "expert_dp": pair}
        assert ep4 == {"ep": 4, "ep_rank": rank, "ep_group": [0, 1, 2, 3], "expert_dp": [rank]}
        assert no_ep == {"ep": 1, "ep_rank": 0, "ep_group": None, "expert_dp": [rank % 2, rank % 2 + 2]}
        for got, kw in zip((dp4, tp_dp, cp_dp, ep4, no_ep), layouts):
            assert got == _expected_expert(rank, **{"dp": 4 // kw.get("tp", 1) // kw.get("cp", 1), "ep": 1, **kw})


@pytest.mark.slow
@pytest.mark.multiprocess
def test_expert_parallel_groups_on_eight_ranks():
    layouts = [dict(dp=4, tp=2, ep=2), dict(dp=2, cp=2, pp=2, ep=2), dict(dp=4, cp=2, ep=2)]
    for rank, found in enumerate(run_ranks(_expert_layouts, 8, layouts, timeout=180)):
        for got, kw in zip(found, layouts):
            assert got == _expected_expert(rank, **kw), kw


def _reuse_default_group(rank, world_size):
    world = dist.group.WORLD
    # backend="nccl" is ignored because a group exists: on this CPU-only gloo world it would fail otherwise.
    dims = init_parallel(tp=1, pp=2, backend="nccl")
    return _describe(dims), dist.group.WORLD is world


@pytest.mark.multiprocess
def test_existing_default_group_is_reused():
    for rank, (described, same_world) in enumerate(run_ranks(_reuse_default_group, 4)):
        assert described == _expected(rank, dp=2, pp=2, tp=1)
        assert same_world


def _world_of_one(rank, world_size):
    # The harness can add or override variables but not remove them; this child is a fresh process and
    # init_parallel reads the environment when called, so removing them here is a clean environment.
    for name in _TORCHRUN_VARS:
        os.environ.pop(name, None)
    dims = init_parallel()
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(7))
    reduced = [x.clone() for _ in range(3)]
    for tensor, group in zip(reduced, (dims.tp_group, dims.pp_group, dims.dp_group)):
        dist.all_reduce(tensor, group=group)
    described = _describe(dims)
    shutdown()
    return described, x, reduced, dist.is_initialized()


@pytest.mark.multiprocess
def test_single_process_without_torchrun_is_a_world_of_one():
    [(described, x, reduced, still_initialised)] = run_ranks(_world_of_one, 1, init_process_group=False)
    assert described == _expected(0, dp=1, pp=1, tp=1)
    for tensor in reduced:
        torch.testing.assert_close(tensor, x, rtol=0, atol=0)
    assert not still_initialised


# ---------------------------------------------------------------------------------------------------- errors


@pytest.fixture
def no_process_group(monkeypatch):
    """A torchrun-like world of 4 without a rendezvous address; fails the test if a group got created."""
    assert not dist.is_initialized()
    for name in _TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    yield
    initialised = dist.is_initialized()
    if initialised:
        dist.destroy_process_group()
    assert not initialised, "init_parallel created a process group before rejecting its arguments"


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"tp": 0}, ValueError, "init_parallel: tp must be a positive int, received 0"),
        ({"pp": -2}, ValueError, "init_parallel: pp must be a positive int, received -2"),
        ({"dp": 0}, ValueError, "init_parallel: dp must be a positive int or -1 (all remaining ranks), received 0"),
        ({"tp": "2"}, TypeError, "init_parallel: tp must be an int, received str '2'"),
        ({"tp": True}, TypeError, "init_parallel: tp must be an int, received bool True"),
        ({"dp": 2.0}, TypeError, "init_parallel: dp must be an int, received float 2.0"),
        ({"backend": "mpi"}, ValueError, "init_parallel: backend must be 'nccl', 'gloo' or None, received 'mpi'"),
        ({"tp": 3}, ValueError, "init_parallel: the world size 4 is not divisible by tp*pp = 3*1 = 3"),
        ({"tp": 2, "dp": 3}, ValueError, "init_parallel: dp*pp*tp = 3*1*2 = 6 must equal the world size 4"),
        ({"tp": 2, "pp": 2, "dp": 2}, ValueError, "dp*pp*tp = 2*2*2 = 8 must equal the world size 4"),
        ({"tp": 2, "dp": 2}, RuntimeError, "init_parallel: WORLD_SIZE=4 is set but MASTER_ADDR is not"),
        ({"cp": 0}, ValueError, "init_parallel: cp must be a positive int, received 0"),
        ({"cp": 3}, ValueError, "the world size 4 is not divisible by cp*pp*tp = 3*1*1 = 3"),
        ({"cp": 2, "tp": 2, "dp": 2}, ValueError, "dp*cp*pp*tp = 2*2*1*2 = 8 must equal the world size 4"),
        ({"ep": 0}, ValueError, "init_parallel: ep must be a positive int, received 0"),
        ({"ep": 2.0}, TypeError, "init_parallel: ep must be an int, received float 2.0"),
        ({"ep": 3}, ValueError, "init_parallel: ep must divide the data-parallel size dp = 4, received 3"),
        ({"tp": 2, "ep": 4}, ValueError, "init_parallel: ep must divide the data-parallel size dp = 2, received 4"),
    ],
)
def test_bad_arguments_are_rejected_before_any_group_exists(no_process_group, kwargs, error, message):
    with pytest.raises(error) as info:
        init_parallel(**kwargs)
    assert message in str(info.value)
