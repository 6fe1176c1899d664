"""FSDP + ZeroAdam (ZeRO-3) against one process training on the whole batch with torch.optim.AdamW.

Each rank trains on its half of every batch; the reference trains an unwrapped copy on the whole batch
(means over equal halves: the averaged gradient is the whole-batch gradient) and clips with
``clip_grad_norm_`` where ZeroAdam clips. Tolerances as in test_zero.py: fp32 differs by summation order
only (~1e-7), checked at 1e-4; bf16 compute with fp32 masters at lr=1e-3 for 3 steps, ~1e-2 absolute.
"""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.multiprocess import run_ranks
from tests.parallel.data_parallel_models import BATCH
from tests.parallel.data_parallel_models import Block as _Block
from tests.parallel.data_parallel_models import batch as _batch
from tests.parallel.data_parallel_models import mse as _loss
from tests.parallel.data_parallel_models import probe as _probe

FP32 = dict(rtol=1e-4, atol=1e-6)
BF16 = dict(rtol=2e-2, atol=2e-2)
STEPS = 3
CASES = {  # name: (wrap, dtype, lr, max_grad_norm, activation checkpointing, backwards accumulated per step)
    "default_wrap_clip": (None, torch.float32, 1e-2, 0.05, False, 1),
    "linear_units_no_root": ("linear", torch.float32, 1e-2, None, False, 1),
    "activation_checkpointing": (None, torch.float32, 1e-2, None, True, 1),
    "accumulate_3_backwards": (None, torch.float32, 1e-2, None, False, 3),
    "bf16": (None, torch.bfloat16, 1e-3, None, False, 1),
}


class _Net(nn.Module):
    def __init__(self, h=12, n=3, recompute=False):
        super().__init__()
        self.inp = nn.Linear(7, h)
        self.blocks = nn.ModuleList(_Block(h) for _ in range(n))
        self.head = nn.Linear(h, 5)
        self.recompute = recompute

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute else block(x)
        return self.head(x)


def _net(dtype=torch.float32, recompute=False):
    torch.manual_seed(0)
    return _Net(recompute=recompute).to(dtype)


def _reference(name):
    _, dtype, lr, clip, _, _ = CASES[name]
    net = _net(dtype).float()  # bf16: from the bf16-rounded weights, trained in fp32
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.1)
    for step in range(STEPS):
        _loss(net, *_batch(step)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, net(_probe()).detach()


def _train(rank, world_size, name):
    from tessel.parallel.fsdp import FSDP
    from tessel.parallel.zero import ZeroAdam

    wrap, dtype, lr, clip, recompute, micro = CASES[name]
    net = _net(dtype, recompute)
    prefetched = []  # registered before FSDP's hooks: sees block 1's unit before block 1 gathers it itself

    def record(module, args):
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside backward
            prefetched.append(target.state != "free")

    net.blocks[1].register_forward_pre_hook(record)
    fsdp = FSDP(net, wrap={nn.Linear} if wrap == "linear" else None)
    target = next(u for u in fsdp.units if u.name in ("blocks.1", "blocks.1.fc"))
    opt = ZeroAdam(fsdp.parameters(), lr=lr, weight_decay=0.1, max_grad_norm=clip)
    n = BATCH // world_size
    for step in range(STEPS):
        x, y = (t[rank * n : (rank + 1) * n] for t in _batch(step, dtype))
        for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
            (_loss(fsdp, xm, ym) / micro).backward()
        opt.step()
        opt.zero_grad()
    freed = all(p.untyped_storage().nbytes() == 0 for p in net.parameters())
    copies_exact = all(
        torch.equal(m.to(dtype), b.param_shard) for m, b in zip(opt._master, fsdp.buckets) if m is not b.param_shard
    )
    return {
        "state": fsdp.full_state_dict(),
        "out": fsdp(_probe(dtype)).detach().float(),
        "units": [u.name for u in fsdp.units],
        "freed": freed,
        "prefetched": all(prefetched) and len(prefetched) > 0,
        "copies_exact": copies_exact,
    }


def _all_cases(rank, world_size):
    return {name: _train(rank, world_size, name) for name in CASES}


@pytest.fixture(scope="module")
def two_rank_results():
    return run_ranks(_all_cases, 2, timeout=240)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(CASES))
def test_fsdp_zero3_matches_whole_batch_adamw(two_rank_results, name):
    tol = BF16 if CASES[name][1] == torch.bfloat16 else FP32
    state, out = _reference(name)
    for rank, results in enumerate(two_rank_results):
        got = results[name]
        assert got["state"].keys() == state.keys()
        for k, w in state.items():
            torch.testing.assert_close(
                got["state"][k], w, **tol, msg=lambda m, k=k, r=rank: f"{name} rank {r} {k}: {m}"
            )
        torch.testing.assert_close(got["out"], out, **tol, msg=lambda m, r=rank: f"{name} rank {r} output: {m}")
        assert got["freed"], "parameters must hold no storage between steps"
        assert got["prefetched"], "block 1 must have been gathered (prefetched) before its own forward"
        assert got["copies_exact"], "the bf16 shards must be exactly the fp32 masters cast"
    units = two_rank_results[0]["linear_units_no_root"]["units"]
    assert units == ["inp", "blocks.0.fc", "blocks.0.proj", "blocks.1.fc", "blocks.1.proj", "blocks.2.fc",
                     "blocks.2.proj", "head"]  # fmt: skip
    assert two_rank_results[0]["default_wrap_clip"]["units"] == ["", "blocks.0", "blocks.1", "blocks.2"]


def test_fsdp_world_of_one_and_full_state_dict_round_trip():
    from tessel.parallel.fsdp import FSDP
    from tessel.parallel.zero import ZeroAdam

    state, out = _reference("default_wrap_clip")
    got = _train(0, 1, "default_wrap_clip")
    for k, w in state.items():
        torch.testing.assert_close(got["state"][k], w, **FP32, msg=lambda m, k=k: f"{k}: {m}")
    fsdp = FSDP(_net())
    fsdp.load_full_state_dict(state)
    assert all(torch.equal(fsdp.full_state_dict()[k], v) for k, v in state.items())
    torch.testing.assert_close(fsdp(_probe()), out, **FP32)
    with pytest.raises(ValueError, match=r"FSDP.load_full_state_dict: expected a tensor of shape \(5, 12\) for "
                                         r"parameter 'head.weight', received \(3,\)"):  # fmt: skip
        fsdp.load_full_state_dict({**state, "head.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"ZeroAdam: stage must be one of \(3,\) with FSDP, received 2"):
        ZeroAdam(fsdp.parameters(), stage=2)


def _unchanged(net, ptrs):
    return [p.data_ptr() for p in net.parameters()] == ptrs and not any(
        hasattr(p, "_tessel_data_parallel") for p in net.parameters()
    )


def test_fsdp_refuses_units_it_cannot_shard():
    from tessel.parallel.fsdp import FSDP

    tied = _net()
    tied.blocks[1].fc.weight = tied.blocks[0].fc.weight
    ptrs = [p.data_ptr() for p in tied.parameters()]
    with pytest.raises(ValueError, match=r"FSDP: parameter 'blocks\.0\.fc\.weight' is shared by unit 'blocks\.0' "
                                         r"and unit 'blocks\.1' \(as 'blocks\.1\.fc\.weight'\)"):  # fmt: skip
        FSDP(tied)
    assert _unchanged(tied, ptrs)
    root_tied = _net()
    root_tied.blocks[0].extra = root_tied.head  # the head is registered in the root and in unit blocks.0
    with pytest.raises(ValueError, match=r"FSDP: parameter 'blocks\.0\.extra\.weight' is shared by unit 'blocks\.0' "
                                         r"and unit 'the root'"):  # fmt: skip
        FSDP(root_tied)
    mixed = _net()
    mixed.blocks[2].proj.to(torch.bfloat16)
    ptrs = [p.data_ptr() for p in mixed.parameters()]
    with pytest.raises(ValueError, match=r"FSDP: unit 'blocks\.2' mixes parameter dtypes/devices \(torch\.bfloat16 "
                                         r"on cpu, torch\.float32 on cpu\)"):  # fmt: skip
        FSDP(mixed)
    assert _unchanged(mixed, ptrs)
    devices = _net()
    devices.inp.to("meta")
    with pytest.raises(ValueError, match=r"FSDP: unit 'the root' mixes parameter dtypes/devices"):
        FSDP(devices, wrap={_Block})
    with pytest.raises(TypeError, match=r"FSDP: wrap must be None, a set of nn\.Module classes or a callable"):
        FSDP(_net(), wrap={"blocks"})
    with pytest.raises(TypeError, match=r"FSDP: module must be an nn\.Module, received int"):
        FSDP(3)


@pytest.mark.gpu
def test_cuda_bf16_world_of_one():
    """ZeRO-3 on one GPU (storage resizing on CUDA, compiled kernels) against the fp32 CPU reference."""
    from tessel.parallel.fsdp import FSDP
    from tessel.parallel.zero import ZeroAdam

    state, _ = _reference("bf16")
    net = _net(torch.bfloat16).cuda()
    fsdp = FSDP(net)
    opt = ZeroAdam(fsdp.parameters(), lr=1e-3, weight_decay=0.1)
    for step in range(STEPS):
        _loss(fsdp, *(t.cuda() for t in _batch(step, torch.bfloat16))).backward()
        opt.step()
        opt.zero_grad()
    got = fsdp.full_state_dict()
    for k, w in state.items():
        torch.testing.assert_close(got[k], w, **BF16, msg=lambda m, k=k: f"{k}: {m}")
    assert all(p.untyped_storage().nbytes() == 0 for p in net.parameters())
