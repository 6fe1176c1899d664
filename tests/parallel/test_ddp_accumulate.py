"""DDP's gradient accumulation under no_sync for 16-bit models: fp32 sums rounded once (``accumulate_dtype``).

A bf16 model trained on ``m`` microbatches: with the default fp32 sums the reduced gradient is the exact
sum of the ``m`` microbatch gradients rounded once to bf16, bit for bit (in a world of one, where the
reduction is the identity), for plain DDP (``p.grad``), ZeRO-1 and ZeRO-2 (the gradient shard); with
``accumulate_dtype=None`` the sums round at every backward and land measurably further away. On 2 gloo
ranks, parameters that get no gradient in the syncing backward still reduce what they accumulated.
"""

import contextlib

import pytest
import torch
from torch import nn

from tests.multiprocess import run_ranks

MICRO = 8


class Branchy(nn.Module):
    """A trunk and two heads; a call uses one head, so a backward leaves the other without a gradient."""

    def __init__(self, dtype=torch.bfloat16):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(7, 13)
        self.heads = nn.ModuleList([nn.Linear(13, 5), nn.Linear(13, 5)])
        self.to(dtype)

    def forward(self, x, head=0):
        return self.heads[head](torch.tanh(self.trunk(x)))


def _loss(model, x, y, head=0):
    return (model(x, head).float() - y.float()).pow(2).mean()


def _chunks(seed=5, micro=MICRO):
    g = torch.Generator().manual_seed(seed)
    x, y = (torch.randn(2 * micro, n, generator=g).to(torch.bfloat16) for n in (7, 5))
    return list(zip(x.chunk(micro), y.chunk(micro)))


def _grads(ddp, stage):
    """The reduced gradients: p.grad of each parameter with one (stage 0), each bucket's shard (ZeRO-1/2)."""
    if stage == 0:
        return [p.grad.clone() for p in ddp.module.parameters() if p.grad is not None]
    return [b.grad_shard.clone() for b in ddp.buckets]


def _clear(ddp, stage):
    if stage == 0:
        for p in ddp.module.parameters():
            p.grad = None
    else:
        ddp._zero_grads()  # what ZeroAdam.zero_grad() calls


def _microbatch_sums(stage, accumulate_dtype):
    """Each microbatch's reduced gradient alone, then after MICRO - 1 backwards under no_sync and a syncing
    one; the grads held (memory account) after the first backward under no_sync; p.grad there."""
    from tessel.parallel.ddp import DDP
    from tessel.parallel.memory import memory_account
    from tessel.parallel.zero import ZeroAdam

    ddp = DDP(Branchy(), bucket_mb=100 * 2 / 2**20, accumulate_dtype=accumulate_dtype)  # several buckets
    if stage:
        ZeroAdam(ddp.parameters(), lr=1e-3, stage=stage)
    chunks = _chunks()
    alone = []
    for xm, ym in chunks:
        _loss(ddp, xm, ym).backward()
        alone.append(_grads(ddp, stage))
        _clear(ddp, stage)
    held, grads_inside = None, None
    for i, (xm, ym) in enumerate(chunks):
        with ddp.no_sync() if i < MICRO - 1 else contextlib.nullcontext():
            _loss(ddp, xm, ym).backward()
        if i == 0:
            held = memory_account(ddp).grads
            grads_inside = [p.grad for p in ddp.module.parameters()]
            assert ddp.has_unsynced_gradients
    assert not ddp.has_unsynced_gradients and not ddp._sums
    exact = [torch.stack([a[i].double() for a in alone]).sum(0) for i in range(len(alone[0]))]
    return _grads(ddp, stage), exact, held, grads_inside, ddp


def _max_rel_err(got, want):
    return max(((g.double() - w).abs() / w.abs().clamp_min(1e-3)).max().item() for g, w in zip(got, want))


@pytest.mark.parametrize("stage", [0, 1, 2], ids=["ddp", "zero1", "zero2"])
def test_bf16_no_sync_sums_are_fp32_rounded_once(seed, stage):
    summed, exact, held, grads_inside, ddp = _microbatch_sums(stage, torch.float32)
    for got, want in zip(summed, exact):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want.to(torch.bfloat16), rtol=0, atol=0)
    assert all(g is None for g in grads_inside)  # the gradients live in the fp32 sums meanwhile
    padded = sum(b.padded for b in ddp.buckets)
    # While accumulating: the fp32 [P] sums, plus what the stage keeps anyway (ZeRO-1's and plain DDP's
    # bf16 [P] gradient buffer; ZeRO-2's bf16 [s] shards, which in a world of one are [P] too).
    assert held == 4 * padded + 2 * padded

    summed16, exact16, held16, grads_inside16, _ = _microbatch_sums(stage, None)
    # Sums in bf16: autograd accumulates into p.grad, views of the bucket, for the 4 parameters used.
    assert sum(g is not None and g.dtype == torch.bfloat16 for g in grads_inside16) == 4
    assert held16 <= 2 * padded + 2 * padded  # no fp32 buffer
    assert _max_rel_err(summed, exact) <= 2**-8 < _max_rel_err(summed16, exact16)  # one rounding against eight


def test_fp32_models_accumulate_in_place_either_way(seed):
    from tessel.parallel.ddp import DDP

    ddp = DDP(Branchy(torch.float32))
    (xm, ym), _ = _chunks(micro=2)
    with ddp.no_sync():
        _loss(ddp, xm.float(), ym.float()).backward()
    used = [*ddp.module.trunk.parameters(), *ddp.module.heads[0].parameters()]
    assert not ddp._sums and all(p.grad is not None and p.grad.dtype == torch.float32 for p in used)


def test_a_parameter_without_gradient_in_the_syncing_backward_keeps_its_sum(seed):
    """Head 1 is used only under no_sync: the syncing backward (head 0) still reduces head 1's sum, and
    p.grad of a parameter that never got a gradient stays None (an optimizer skips it)."""
    from tessel.parallel.ddp import DDP

    ddp = DDP(Branchy())
    dense = Branchy()
    (x0, y0), (x1, y1) = _chunks(micro=2)
    with ddp.no_sync():
        _loss(ddp, x1, y1, head=1).backward()
    _loss(ddp, x0, y0, head=0).backward()
    _loss(dense, x1, y1, head=1).backward()
    _loss(dense, x0, y0, head=0).backward()
    for (name, got), want in zip(ddp.module.named_parameters(), dense.parameters()):
        assert got.grad is not None, name
        torch.testing.assert_close(got.grad.float(), want.grad.float(), rtol=2**-7, atol=1e-6, msg=name)
    ddp2 = DDP(Branchy())
    with ddp2.no_sync():
        _loss(ddp2, x0, y0, head=0).backward()
    _loss(ddp2, x0, y0, head=0).backward()
    assert all(p.grad is None for p in ddp2.module.heads[1].parameters())


def test_zero_grad_drops_the_sums(seed):
    from tessel.parallel.ddp import DDP
    from tessel.parallel.zero import ZeroAdam

    ddp = DDP(Branchy())
    opt = ZeroAdam(ddp.parameters(), lr=1e-3, stage=2)
    (xm, ym), _ = _chunks(micro=2)
    with ddp.no_sync():
        _loss(ddp, xm, ym).backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        opt.step()  # ZeroAdam refuses to step on local sums
    opt.zero_grad()
    assert not ddp._sums and not ddp.has_unsynced_gradients


def test_ddp_refuses_an_unsupported_accumulate_dtype():
    from tessel.parallel.ddp import DDP, OWNER_ATTR

    net = Branchy()
    ptrs = [p.data_ptr() for p in net.parameters()]
    for bad in (torch.bfloat16, "fp32"):
        with pytest.raises(TypeError, match=r"DDP: accumulate_dtype must be torch\.float32 or None .*received"):
            DDP(net, accumulate_dtype=bad)
    assert [p.data_ptr() for p in net.parameters()] == ptrs
    assert not any(hasattr(p, OWNER_ATTR) for p in net.parameters())


# ---------------------------------------------------------------------------------------------------- 2 ranks


def _two_rank_sums(rank, world_size):
    """Each rank: head 1 under no_sync, then head 0 syncing, for plain DDP (p.grad) and ZeRO-2 (the rank's
    gradient shards, and the same shards cut from the expected [P] gradient); the rank's own exact
    gradients from an unwrapped copy."""
    from tessel.parallel.ddp import DDP
    from tessel.parallel.zero import ZeroAdam

    (x0, y0), (x1, y1) = _chunks(seed=11 + rank, micro=2)
    local = Branchy()
    _loss(local, x1, y1, head=1).backward()
    _loss(local, x0, y0, head=0).backward()
    out = {"local": [p.grad.float() for p in local.parameters()]}
    for stage in (0, 2):
        ddp = DDP(Branchy(), bucket_mb=100 * 2 / 2**20)
        if stage:
            ZeroAdam(ddp.parameters(), lr=1e-3, stage=stage)
        with ddp.no_sync():
            _loss(ddp, x1, y1, head=1).backward()
        _loss(ddp, x0, y0, head=0).backward()
        if stage == 0:
            out[stage] = [p.grad.float() for p in ddp.module.parameters()]
        else:
            # (slot name, offset, numel) of each slot, the shard's indices into [P], the shard
            slots = [[(s.name, s.offset, s.numel) for s in b.slots] for b in ddp.buckets]
            index = [b.shard_of(torch.arange(b.padded)) for b in ddp.buckets]
            out[stage] = list(zip(slots, index, [b.grad_shard.float() for b in ddp.buckets]))
    return out


@pytest.mark.multiprocess
def test_two_ranks_reduce_the_fp32_sums():
    results = run_ranks(_two_rank_sums, 2)
    names = [n for n, _ in Branchy().named_parameters()]
    want = dict(zip(names, [(a + b) / 2 for a, b in zip(results[0]["local"], results[1]["local"])]))
    tol = dict(rtol=2**-6, atol=1e-5)
    for rank, got in enumerate(results):
        for name, g in zip(names, got[0]):
            torch.testing.assert_close(g, want[name], **tol, msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")
        assert len(got[2]) >= 2
        for slots, index, shard in got[2]:  # ZeRO-2: this rank's shard of each bucket's averaged gradient
            full = torch.zeros(max(o + n for _, o, n in slots) + len(index) * 2)
            for name, offset, numel in slots:
                full[offset : offset + numel] = want[name].flatten()
            torch.testing.assert_close(shard, full[index], **tol, msg=lambda m, r=rank: f"rank {r}: {m}")
