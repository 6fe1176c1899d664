"""FSDP + ZeroAdam (ZeRO-3) against one process training on the whole batch with torch.optim.AdamW.

Each rank trains on its half of every batch; the reference trains an unwrapped copy on the whole batch
(means over equal halves: the averaged gradient is the whole-batch gradient) and clips with
``clip_grad_norm_`` where ZeroAdam clips. Tolerances as in test_zero.py: fp32 differs by summation order
only (~1e-7), checked at 1e-4; bf16 compute with fp32 masters at lr=1e-3 for 3 steps, ~1e-2 absolute.
``FSDP.no_sync`` is checked the same way (microbatch losses divided by their number, as test_ddp.py
does), and by the bytes its backwards move and the gradient shards the syncing backward leaves.
"""

import contextlib
from typing import NamedTuple

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


class Case(NamedTuple):
    wrap: str | None  # None: FSDP's default units; "linear": every nn.Linear a unit
    dtype: torch.dtype
    lr: float
    max_grad_norm: float | None
    recompute: bool | str  # activation checkpointing of every block; "forward": each block checkpoints its own
    # forward, its module hooks outside the checkpoint (as Hugging Face's layers do)
    micro: int  # backwards accumulated per step
    no_sync: bool = False  # all but the last backward of a step inside FSDP.no_sync()
    frozen: str | None = None  # a parameter that does not train (nor in the reference)
    sync_gradients: bool = False  # every backward inside no_sync(), then one sync_gradients() (a pipeline's)


CASES = {
    "default_wrap_clip": Case(None, torch.float32, 1e-2, 0.05, False, 1),
    "linear_units_no_root": Case("linear", torch.float32, 1e-2, None, False, 1),
    "activation_checkpointing": Case(None, torch.float32, 1e-2, None, True, 1),
    # the recomputation saves nothing through FSDP's hooks: the gradient of each block's output gathers it
    "checkpointed_forward": Case(None, torch.float32, 1e-2, None, "forward", 1),
    "accumulate_3_backwards": Case(None, torch.float32, 1e-2, None, False, 3),
    # 2 of 3 backwards per step under no_sync; block 1's first weight frozen (still needed by backward).
    "no_sync_frozen_clip": Case(None, torch.float32, 1e-2, 0.05, False, 3, no_sync=True, frozen="blocks.1.fc.weight"),
    # all 3 backwards under no_sync, then sync_gradients(), with clipping of the reduced shards
    "sync_gradients_clip": Case(None, torch.float32, 1e-2, 0.05, False, 3, no_sync=True, sync_gradients=True),
    "bf16": Case(None, torch.bfloat16, 1e-3, None, False, 1),
}


class _CheckpointedBlock(_Block):
    """A block whose forward checkpoints itself: FSDP's module hooks run outside the checkpoint, not again in the
    recomputation (transformers' GradientCheckpointingLayer)."""

    def forward(self, x):
        return checkpoint(super().forward, x, use_reentrant=False) if torch.is_grad_enabled() else super().forward(x)


class _Net(nn.Module):
    def __init__(self, h=12, n=3, recompute=False):
        super().__init__()
        self.inp = nn.Linear(7, h)
        self.blocks = nn.ModuleList((_CheckpointedBlock if recompute == "forward" else _Block)(h) for _ in range(n))
        self.head = nn.Linear(h, 5)
        self.recompute = recompute is True

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute else block(x)
        return self.head(x)


def _net(dtype=torch.float32, recompute=False, frozen=None):
    torch.manual_seed(0)
    net = _Net(recompute=recompute).to(dtype)
    if frozen is not None:
        net.get_parameter(frozen).requires_grad_(False)
    return net


def _trainable(module):
    return [p for p in module.parameters() if p.requires_grad]


def _reference(name):
    case = CASES[name]
    net = _net(case.dtype, frozen=case.frozen).float()  # bf16: from the bf16-rounded weights, trained in fp32
    opt = torch.optim.AdamW(_trainable(net), lr=case.lr, weight_decay=0.1)
    for step in range(STEPS):
        _loss(net, *_batch(step)).backward()
        if case.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(_trainable(net), case.max_grad_norm)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, net(_probe()).detach()


def _train(rank, world_size, name):
    from tessel.parallel.fsdp import FSDP
    from tessel.parallel.zero import ZeroAdam

    case = CASES[name]
    dtype, micro = case.dtype, case.micro
    net = _net(dtype, case.recompute, case.frozen)
    prefetched = []  # registered before FSDP's hooks: sees block 1's unit before block 1 gathers it itself

    def record(module, args):
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside backward
            prefetched.append(target.state != "free")

    net.blocks[1].register_forward_pre_hook(record)
    fsdp = FSDP(net, wrap={nn.Linear} if case.wrap == "linear" else None)
    target = next(u for u in fsdp.units if u.name in ("blocks.1", "blocks.1.fc"))
    opt = ZeroAdam(_trainable(fsdp), lr=case.lr, weight_decay=0.1, max_grad_norm=case.max_grad_norm)
    n = BATCH // world_size
    full_grads_held = []  # after each backward: whether every unit holds a [P] gradient
    for step in range(STEPS):
        x, y = (t[rank * n : (rank + 1) * n] for t in _batch(step, dtype))
        for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            inside = case.no_sync and (i < micro - 1 or case.sync_gradients)
            with fsdp.no_sync() if inside else contextlib.nullcontext():
                (_loss(fsdp, xm, ym) / micro).backward()
            full_grads_held.append(sorted({b.grad is not None for b in fsdp.buckets}))
        if case.sync_gradients:
            with pytest.raises(RuntimeError, match="not reduced yet"):
                opt.step()  # refused before anything changes: the run below still matches the reference
            fsdp.sync_gradients()
            assert not fsdp.has_unsynced_gradients
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
        "full_grads_held": full_grads_held,
    }


def _no_sync_traffic(rank, world_size):
    """Bytes moved and gradient bytes held by each backward of one step: nested no_sync, no_sync, syncing.

    No optimizer: the gradients read are the shards the syncing backward leaves (plain FSDP).
    """
    from tessel.parallel.comm import count_bytes
    from tessel.parallel.fsdp import FSDP
    from tessel.parallel.memory import memory_account

    fsdp = FSDP(_net())
    n = BATCH // world_size
    x, y = (t[rank * n : (rank + 1) * n] for t in _batch(0))
    (x0, x1, x2), (y0, y1, y2) = x.chunk(3), y.chunk(3)
    moved, grad_bytes = [], []

    def backward(xm, ym):
        loss = _loss(fsdp, xm, ym) / 3
        with count_bytes() as counter:
            loss.backward()
        moved.append((counter.sent, counter.received))
        grad_bytes.append(memory_account(fsdp).grads)

    with fsdp.no_sync():
        with fsdp.no_sync():
            backward(x0, y0)
        backward(x1, y1)  # the inner block has ended: still accumulating
    backward(x2, y2)
    shards = []  # per unit: (parameter, start in its flattened values, the shard's piece of it)
    for b in fsdp.buckets:
        shards.append([(slot.name, b.shard_offset + lo - slot.offset, b.grad_shard[lo:hi].clone())
                       for slot, lo, hi in b.shard_slices()])  # fmt: skip
    padding = [b.grad_shard[max(b.numel - b.shard_offset, 0) :].clone() for b in fsdp.buckets]
    shard_bytes = sum(4 * b.shard_numel for b in fsdp.buckets)  # fp32
    full_bytes = sum(4 * b.padded for b in fsdp.buckets)
    return {"moved": moved, "grad_bytes": grad_bytes, "shard_bytes": shard_bytes, "full_bytes": full_bytes,
            "shards": shards, "padding": padding}  # fmt: skip


def _all_cases(rank, world_size):
    return {**{name: _train(rank, world_size, name) for name in CASES}, "traffic": _no_sync_traffic(rank, world_size)}


@pytest.fixture(scope="module")
def two_rank_results():
    return run_ranks(_all_cases, 2, timeout=240)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(CASES))
def test_fsdp_zero3_matches_whole_batch_adamw(two_rank_results, name):
    tol = BF16 if CASES[name].dtype == torch.bfloat16 else FP32
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
        # Every unit holds a full [P] gradient after a no_sync backward, none after a syncing one.
        case = CASES[name]
        last = case.micro - 1 + case.sync_gradients  # the first backward that syncs (none with sync_gradients)
        held = [[case.no_sync and i % case.micro < last] for i in range(STEPS * case.micro)]
        assert got["full_grads_held"] == held, "full gradients must live exactly from no_sync to the syncing backward"
    units = two_rank_results[0]["linear_units_no_root"]["units"]
    assert units == ["inp", "blocks.0.fc", "blocks.0.proj", "blocks.1.fc", "blocks.1.proj", "blocks.2.fc",
                     "blocks.2.proj", "head"]  # fmt: skip
    assert two_rank_results[0]["default_wrap_clip"]["units"] == ["", "blocks.0", "blocks.1", "blocks.2"]


@pytest.mark.multiprocess
def test_no_sync_backward_moves_only_gathers_and_syncing_backward_one_reduce_scatter(two_rank_results):
    for rank, results in enumerate(two_rank_results):
        got = results["traffic"]
        # Ring bytes on 2 ranks: gathering a unit sends and receives (N-1)·s fp32 elements, and so does
        # reduce-scattering its gradient. Backward gathers every unit once (forward freed them all).
        one_pass = (2 - 1) * got["shard_bytes"]
        nested, inner_ended, syncing = got["moved"]
        assert nested == inner_ended == (one_pass, one_pass), f"rank {rank}: no_sync moved {nested}, {inner_ended}"
        assert syncing == (2 * one_pass, 2 * one_pass), f"rank {rank}: the syncing backward moved {syncing}"
        # The memory account sees the [P] gradients while they are held and only the [s] shards after.
        held = got["shard_bytes"] + got["full_bytes"]
        assert got["grad_bytes"] == [held, held, got["shard_bytes"]], f"rank {rank}"


@pytest.mark.multiprocess
def test_gradient_shards_after_syncing_backward_are_whole_batch_gradients(two_rank_results):
    net = _net()
    _loss(net, *_batch(0)).backward()  # the whole batch: one mean, equal to the mean of the 6 one-row means
    want = {name: p.grad.reshape(-1) for name, p in net.named_parameters()}
    for rank, results in enumerate(two_rank_results):
        got = results["traffic"]
        for unit in got["shards"]:
            for name, start, piece in unit:
                torch.testing.assert_close(
                    piece,
                    want[name][start : start + piece.numel()],
                    **FP32,
                    msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}",
                )
        assert sum(piece.numel() for unit in got["shards"] for _, _, piece in unit) > 0
        assert all(p.eq(0).all() for p in got["padding"]), "the padding's gradient must stay zero"


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


class _Branches(nn.Module):
    """A trunk and two branch units; each forward runs one branch, so a unit can miss a backward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(7, 5)
        self.branches = nn.ModuleList(nn.Linear(5, 5) for _ in range(2))

    def forward(self, x, branch):
        return self.branches[branch](self.inp(x))


def test_no_sync_sum_of_a_unit_unused_by_the_syncing_backward_is_reduced_and_zero_grad_drops_sums(seed):
    """A world of one (the reduce-scatter is a copy): the shard is the sum of the gradients of every backward."""
    from tessel.parallel.fsdp import FSDP
    from tessel.parallel.memory import memory_account

    dense, fsdp = _Branches(), FSDP(_Branches())
    x, y = torch.randn(4, 7), torch.randn(4, 5)

    def loss(model, branch):
        return (model(x, branch) - y).pow(2).mean()

    for first, second in ((1, 0), (0, 1)):  # the syncing backward misses branch 1, then branch 0
        with fsdp.no_sync():
            loss(fsdp, first).backward()
        loss(fsdp, second).backward()
        (loss(dense, first) + loss(dense, second)).backward()
    assert all(b.grad is None for b in fsdp.buckets)
    for u in fsdp.units:
        for slot in u.bucket.slots:
            want = dense.get_parameter(slot.name).grad
            torch.testing.assert_close(u.bucket.slot_view(u.bucket.grad_shard, slot), want, **FP32)
    with fsdp.no_sync():
        loss(fsdp, 0).backward()
    held = [b.grad is not None for b in fsdp.buckets]
    assert held == [True, True, False]  # the trunk (root) and branch 0 hold [P] gradients, branch 1 none
    held_bytes = 4 * sum(b.shard_numel + (b.padded if b.grad is not None else 0) for b in fsdp.buckets)
    assert memory_account(fsdp).grads == held_bytes  # every [s] shard (fp32) and the [P] gradients held
    fsdp._zero_grads()  # what ZeroAdam.zero_grad() calls
    assert all(b.grad is None for b in fsdp.buckets) and all(b.grad_shard.eq(0).all() for b in fsdp.buckets)


def _bf16_microbatch_sums(accumulate_dtype, micro=8):
    """World of one, bf16: each microbatch's gradient shard alone (syncing backwards), then the shards
    after ``micro - 1`` backwards under no_sync and a syncing one, and the bytes of gradients held
    while accumulating."""
    from tessel.parallel.fsdp import FSDP
    from tessel.parallel.memory import memory_account

    fsdp = FSDP(_net(torch.bfloat16), accumulate_dtype=accumulate_dtype)
    g = torch.Generator().manual_seed(5)
    x, y = (torch.randn(2 * micro, n, generator=g).to(torch.bfloat16) for n in (7, 5))
    chunks = list(zip(x.chunk(micro), y.chunk(micro)))
    assert len(chunks) == micro
    alone = []
    for xm, ym in chunks:
        _loss(fsdp, xm, ym).backward()
        alone.append([b.grad_shard.clone() for b in fsdp.buckets])
        fsdp._zero_grads()
    held = []
    for i, (xm, ym) in enumerate(chunks):
        with fsdp.no_sync() if i < micro - 1 else contextlib.nullcontext():
            _loss(fsdp, xm, ym).backward()
        if i == 0:
            held.append(memory_account(fsdp).grads)
    summed = [b.grad_shard.clone() for b in fsdp.buckets]
    exact = [torch.stack([a[i].double() for a in alone]).sum(0) for i in range(len(fsdp.buckets))]
    return summed, exact, held[0], fsdp


def test_no_sync_accumulates_bf16_gradients_in_fp32_and_rounds_once(seed):
    """8 microbatches of a bf16 model: the default fp32 sums give the exact sum of the 8 gradients
    rounded once to bf16, bit for bit; sums kept in bf16 (``accumulate_dtype=None``) round at every
    backward and land measurably further away."""
    summed, exact, held, fsdp = _bf16_microbatch_sums(torch.float32)
    for got, want in zip(summed, exact):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want.to(torch.bfloat16), rtol=0, atol=0)
    shards = sum(2 * b.shard_numel for b in fsdp.buckets)
    assert held == shards + sum(4 * b.padded for b in fsdp.buckets)  # fp32 [P] sums while accumulating

    summed16, exact16, held16, fsdp16 = _bf16_microbatch_sums(None)
    assert held16 == shards + sum(2 * b.padded for b in fsdp16.buckets)
    err16 = max(((got.double() - want).abs() / want.abs().clamp_min(1e-3)).max().item()
                for got, want in zip(summed16, exact16))  # fmt: skip
    err32 = max(((got.double() - want).abs() / want.abs().clamp_min(1e-3)).max().item()
                for got, want in zip(summed, exact))  # fmt: skip
    assert err32 <= 2**-8 < err16  # one rounding (half an ulp of bf16) against eight


def test_fsdp_refuses_an_unsupported_accumulate_dtype():
    from tessel.parallel.fsdp import FSDP

    net = _net()
    ptrs = [p.data_ptr() for p in net.parameters()]
    for bad in (torch.bfloat16, "fp32"):
        with pytest.raises(TypeError, match=r"FSDP: accumulate_dtype must be torch\.float32 or None .*received"):
            FSDP(net, accumulate_dtype=bad)
    assert _unchanged(net, ptrs)


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
@pytest.mark.parametrize("micro", [1, 3], ids=["sync", "no_sync"])
def test_cuda_bf16_world_of_one(micro):
    """ZeRO-3 on one GPU (storage resizing on CUDA, compiled kernels) against the fp32 CPU reference.

    With 3 microbatches the first 2 backwards run under no_sync (bf16 gradients summed in fp32 on the GPU).
    """
    from tessel.parallel.fsdp import FSDP
    from tessel.parallel.zero import ZeroAdam

    state, _ = _reference("bf16")
    net = _net(torch.bfloat16).cuda()
    fsdp = FSDP(net)
    opt = ZeroAdam(fsdp.parameters(), lr=1e-3, weight_decay=0.1)
    for step in range(STEPS):
        x, y = (t.cuda() for t in _batch(step, torch.bfloat16))
        for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            with fsdp.no_sync() if i < micro - 1 else contextlib.nullcontext():
                (_loss(fsdp, xm, ym) / micro).backward()
        opt.step()
        opt.zero_grad()
    got = fsdp.full_state_dict()
    for k, w in state.items():
        torch.testing.assert_close(got[k], w, **BF16, msg=lambda m, k=k: f"{k}: {m}")
    assert all(p.untyped_storage().nbytes() == 0 for p in net.parameters())
