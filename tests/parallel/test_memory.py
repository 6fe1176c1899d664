"""Measured per-rank memory and per-step traffic of DDP and ZeRO-1/2/3 against DESIGN.md's formulas.

Ψ-equivalent: DESIGN.md's "2Ψ" and "3Ψ" of traffic are counted here as ring passes over all Ψ
parameters in bytes of the parameter dtype: one pass sends (and receives) ``(N-1)/N · Ψ · 2`` bytes per
rank for bf16 (:func:`~tessel.parallel.memory.zero_traffic_bytes`). Memory is the ZeRO paper's with
K = 12 (:func:`~tessel.parallel.memory.zero_memory_bytes`).

Memory is measured on the tensors after a step (what a rank holds between steps). Tolerances: the
buckets are padded to a multiple of N (at most N-1 elements per bucket or FSDP unit, documented in
parallel/flat.py), so measured bytes must equal the formula evaluated on the padded layout exactly and
lie within 5% of the formula on Ψ; the model's Ψ ≈ 13.7k makes padding < 0.1%. Traffic adds the
8-byte all-reduce of the gradient statistics and the padding: within 2% of the formula.

Bytes do not depend on how the fused Adam kernel executes, so the ranks run it through its PyTorch
reference (``TRITON_INTERPRET=0``) instead of Triton's much slower interpreter; test_zero.py and
test_fsdp.py run the same steps through the interpreted kernel.
"""

import pytest
import torch
from torch import nn

from tests.multiprocess import REFERENCE_KERNELS, run_ranks
from tests.parallel.data_parallel_models import Block as _Block


def _net():
    torch.manual_seed(0)
    h = 40
    return nn.Sequential(nn.Linear(7, h), _Block(h), _Block(h), nn.Linear(h, 5)).to(torch.bfloat16)


def _step(model, opt, rank):
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 7, generator=g).bfloat16(), torch.randn(4, 5, generator=g).bfloat16()
    (model(x) - y).float().pow(2).mean().backward()
    opt.step()


def _measure(rank, world_size):
    from tessel.parallel.comm import count_bytes
    from tessel.parallel.ddp import DDP
    from tessel.parallel.fsdp import FSDP
    from tessel.parallel.memory import memory_account
    from tessel.parallel.zero import ZeroAdam

    out = {}
    for stage in (0, 1, 2, 3):
        net = _net()
        psi = sum(p.numel() for p in net.parameters())
        wrapper = FSDP(net, wrap={nn.Linear}) if stage == 3 else DDP(net, bucket_mb=0.01)
        opt = ZeroAdam(wrapper.parameters(), stage=stage) if stage else torch.optim.AdamW(wrapper.parameters())
        _step(wrapper, opt, rank)  # every lazily allocated buffer exists after one step
        opt.zero_grad()
        with count_bytes() as moved:
            _step(wrapper, opt, rank)
        account = memory_account(wrapper, opt)
        layout = (sum(b.padded for b in wrapper.buckets), sum(b.shard_numel for b in wrapper.buckets))
        out[stage] = (psi, account, layout, moved.sent, moved.received, len(wrapper.buckets))
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def measured(request):
    return request.param, run_ranks(_measure, request.param, timeout=240, env=REFERENCE_KERNELS)


def _padded_bytes(stage, padded, shard):
    """Bytes per category on the padded layout: bf16 params and grads, fp32 master, two fp32 moments."""
    params = 2 * (shard if stage == 3 else padded)
    grads = 2 * (shard if stage >= 2 else padded)
    return params, grads, 4 * shard, 8 * shard


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_memory_per_rank_matches_design(measured, stage):
    from tessel.parallel.memory import zero_memory_bytes

    world_size, results = measured
    for rank, result in enumerate(results):
        psi, account, (padded, shard), *_, buckets = result[stage]
        got = (account.params, account.grads, account.master, account.moments)
        assert got == _padded_bytes(stage, padded, shard), f"rank {rank}: {account}"
        assert padded - psi <= (world_size - 1) * buckets
        formula = zero_memory_bytes(psi, world_size, stage)
        assert abs(account.total - formula) <= 0.05 * formula, f"rank {rank}: {account.total} vs {formula}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bytes_moved_per_step_match_design(measured, stage):
    from tessel.parallel.memory import zero_traffic_bytes

    world_size, results = measured
    for rank, result in enumerate(results):
        psi, _, _, sent, received, _ = result[stage]
        want = zero_traffic_bytes(psi, world_size, stage)  # 2Ψ-equivalent, 3Ψ for ZeRO-3
        assert sent == received
        assert abs(sent - want) <= 0.02 * want, f"rank {rank} stage {stage}: sent {sent}, formula {want}"


def test_formulas():
    from tessel.parallel.memory import zero_memory_bytes, zero_traffic_bytes

    assert [zero_memory_bytes(1000, 4, s) for s in range(4)] == [16000, 7000, 5500, 4000]
    assert zero_memory_bytes(1000, 4, 3, param_bytes=4) == 4000  # fp32: the master is the parameter (K = 8)
    assert [zero_traffic_bytes(1000, 4, s) for s in (0, 2, 3)] == [3000, 3000, 4500]
    with pytest.raises(ValueError, match="zero_memory_bytes: stage must be 0, 1, 2 or 3, received 4"):
        zero_memory_bytes(1000, 4, 4)
    with pytest.raises(ValueError, match="zero_traffic_bytes: stage must be 0, 1, 2 or 3, received -1"):
        zero_traffic_bytes(1000, 4, -1)


def test_memory_account_of_a_plain_model_and_torch_adamw():
    from tessel.parallel.memory import memory_account

    net = _net().float()
    psi = sum(p.numel() for p in net.parameters())
    opt = torch.optim.AdamW(net.parameters())
    assert memory_account(net, opt).total == 4 * psi  # no grads, no state yet
    net(torch.randn(2, 7)).sum().backward()
    opt.step()
    account = memory_account(net, opt)
    assert (account.params, account.grads, account.master, account.moments) == (4 * psi, 4 * psi, 0, 8 * psi)
