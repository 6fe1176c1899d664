"""DDP on 2 gloo ranks against one process training on the whole batch, plus a world of one and bad input.

Each rank trains on its half of every batch; the reference trains one unwrapped copy on the whole batch
with the same optimizer. The losses are means over equal halves, so the averaged gradient is the
whole-batch gradient. Tolerance: fp32 gradients differ only by the summation order of the two halves
(~1e-7 relative); after three AdamW steps weights and outputs agree to ~1e-6; checked at 1e-4.
"""

import pytest
import torch
from torch import nn

from tests.multiprocess import run_ranks

TOL = dict(rtol=1e-4, atol=1e-6)
STEPS = 3
BATCH = 6


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 19), nn.GELU(), nn.Linear(19, 11), nn.Tanh(), nn.Linear(11, 5))


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 7, generator=g), torch.randn(BATCH, 5, generator=g)


def _probe():
    return torch.randn(4, 7, generator=torch.Generator().manual_seed(7))


def _loss(model, x, y):
    return (model(x) - y).pow(2).mean()


def _reference(micro: int = 1):
    """One process, whole batch (as ``micro`` accumulated microbatches), torch AdamW."""
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    first_grads = None
    for step in range(STEPS):
        x, y = _batch(step)
        for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
            (_loss(net, xm, ym) / micro).backward()
        if first_grads is None:
            first_grads = [p.grad.clone() for p in net.parameters()]
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()], net(_probe()).detach(), first_grads


def _train_ddp(rank, world_size, micro: int, explicit_sync: bool = False):
    from tessel.parallel.ddp import DDP

    net = _net(seed=rank)  # different on every rank: DDP must broadcast rank 0's parameters
    ddp = DDP(net, bucket_mb=60 * 4 / 2**20)  # 60 fp32 elements: several buckets on this net
    broadcast_ok = all(torch.equal(p, q) for p, q in zip(net.parameters(), _net(seed=0).parameters()))
    launched_early = []
    first = next(iter(net.parameters()))  # the last parameter backward reaches
    first.register_post_accumulate_grad_hook(lambda p: launched_early.append(len(ddp._works)))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    half = BATCH // world_size
    first_grads = None
    for step in range(STEPS):
        x, y = _batch(step)
        x, y = x[rank * half : (rank + 1) * half], y[rank * half : (rank + 1) * half]
        for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            if i < micro - 1 or explicit_sync:
                with ddp.no_sync():
                    (_loss(ddp, xm, ym) / micro).backward()
            else:
                (_loss(ddp, xm, ym) / micro).backward()
        if explicit_sync:  # every backward ran under no_sync (a pipeline schedule's): reduce the sums now
            assert ddp.has_unsynced_gradients
            with pytest.raises(RuntimeError, match="inside no_sync"), ddp.no_sync():
                ddp.sync_gradients()
            ddp.sync_gradients()
            assert not ddp.has_unsynced_gradients
        if first_grads is None:
            first_grads = [p.grad.clone() for p in net.parameters()]
        opt.step()
        opt.zero_grad()
    return {
        "weights": [p.detach().clone() for p in net.parameters()],
        "out": ddp(_probe()).detach(),
        "grads": first_grads,
        "broadcast_ok": broadcast_ok,
        "buckets": len(ddp.buckets),
        "launched_before_backward_ended": max(launched_early),
    }


def _check(got, want_weights, want_out, want_grads):
    for i, (g, w) in enumerate(zip(got["weights"], want_weights)):
        torch.testing.assert_close(g, w, **TOL, msg=lambda m, i=i: f"weight {i}: {m}")
    torch.testing.assert_close(got["out"], want_out, **TOL)
    for i, (g, w) in enumerate(zip(got["grads"], want_grads)):
        torch.testing.assert_close(g, w, **TOL, msg=lambda m, i=i: f"averaged grad {i}: {m}")


def _both(rank, world_size):
    return {
        **{micro: _train_ddp(rank, world_size, micro) for micro in (1, 3)},
        "sync_gradients": _train_ddp(rank, world_size, 3, True),
    }


@pytest.fixture(scope="module")
def two_rank_results():
    return run_ranks(_both, 2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("micro", [1, 3, "sync_gradients"], ids=["sync", "no_sync", "sync_gradients"])
def test_ddp_matches_whole_batch_training(two_rank_results, micro):
    weights, out, grads = _reference(3 if micro == "sync_gradients" else micro)
    results = [r[micro] for r in two_rank_results]
    for rank, got in enumerate(results):
        assert got["broadcast_ok"], f"rank {rank} did not start from rank 0's parameters"
        assert got["buckets"] >= 3
        # Buckets of later layers were launched while backward still had the first layer to do.
        if micro != "sync_gradients":  # there every reduction waits for sync_gradients()
            assert got["launched_before_backward_ended"] >= 1
        _check(got, weights, out, grads)
    for a, b in zip(results[0]["weights"], results[1]["weights"]):
        assert torch.equal(a, b), "ranks diverged"


def test_ddp_world_of_one_matches_plain_training(seed):
    weights, out, grads = _reference(micro=1)
    from tessel.parallel.ddp import DDP

    # Without a process group DDP is a world of one: same hooks and buckets, no collectives.
    _check(_train_ddp(0, 1, 1), weights, out, grads)
    assert isinstance(DDP(_net()).module, nn.Sequential)


def test_ddp_bad_input_changes_nothing():
    from tessel.parallel.ddp import DDP

    net = _net()
    ptrs = [p.data_ptr() for p in net.parameters()]
    with pytest.raises(TypeError, match=r"DDP: module must be an nn\.Module, received Tensor"):
        DDP(torch.zeros(3))
    with pytest.raises(ValueError, match="DDP: bucket_mb must be positive, received 0"):
        DDP(net, bucket_mb=0)
    with pytest.raises(TypeError, match="DDP: bucket_mb must be a number of MiB, received str"):
        DDP(net, bucket_mb="25")
    with pytest.raises(TypeError, match=r"DDP: group must be None or a torch\.distributed ProcessGroup"):
        DDP(net, group="dp")
    assert [p.data_ptr() for p in net.parameters()] == ptrs
    DDP(net)
    with pytest.raises(ValueError, match=r"DDP: parameter '0\.weight' is already managed by a DDP wrapper"):
        DDP(net)
