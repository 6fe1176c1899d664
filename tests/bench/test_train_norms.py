"""The job's gradient norms over tensor-parallel ranks that hold copies of the same kv head: each copy is counted
once, so the norm is the dense model's. ``clip_grad_norm`` (plain AdamW), ``clip_grad_shards`` (ZeroAdam's shards
under pipeline parallelism) and ZeroAdam's own clipping, against the norm of a world of one's gradients.

A kv head counted on every rank that holds it would add its squares ``t / n_kv_head`` times over; its gradient is
about as large as a query head's, so the norm would grow by a few percent here, far above the 1e-5 checked.
"""

import math

import pytest
import torch
import torch.distributed as dist

from tests.multiprocess import REFERENCE_KERNELS, run_ranks


def _norms(rank, world_size, n_kv_head):
    from tessel.bench.train_engine import clip_grad_norm, clip_grad_shards
    from tessel.layers.gpt import GPT, GPTConfig
    from tessel.parallel.ddp import DDP
    from tessel.parallel.dims import init_parallel
    from tessel.parallel.zero import ZeroAdam

    dims = init_parallel(tp=world_size)
    solo = [dist.new_group([r]) for r in range(world_size)][rank]
    cfg = GPTConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=n_kv_head, n_embd=64, block_size=16)
    gen = torch.Generator().manual_seed(5)
    idx = torch.randint(64, (2, 9), generator=gen)
    torch.manual_seed(0)
    dense = GPT(cfg, tp_group=solo)
    dense.loss(idx[:, :-1], idx[:, 1:]).backward()
    want = torch.stack([p.grad.pow(2).sum() for p in dense.parameters()]).sum().sqrt()
    norms = {}
    torch.manual_seed(0)
    plain = GPT(cfg, tp_group=dims.tp_group)
    plain.loss(idx[:, :-1], idx[:, 1:]).backward()
    norms["clip_grad_norm"] = clip_grad_norm(list(plain.parameters()), math.inf, dims)
    torch.manual_seed(0)
    model = GPT(cfg, tp_group=dims.tp_group)
    wrapper = DDP(model, group=dims.dp_group)
    opt = ZeroAdam(wrapper.parameters(), lr=1e-3, group=dims.dp_group, tp_group=dims.tp_group, max_grad_norm=1e9)
    model.loss(idx[:, :-1], idx[:, 1:]).backward()
    norms["clip_grad_shards"] = clip_grad_shards(wrapper, math.inf, dims, None)
    opt.step()
    norms["ZeroAdam"] = opt.grad_norm.reshape(())
    for name, got in norms.items():
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0, msg=lambda m, name=name: f"{name}: {m}")
    return "ok"


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size, n_kv_head", [(4, 2), (4, 1), (2, 1)])
def test_replicated_kv_heads_count_once_in_the_gradient_norm(world_size, n_kv_head):
    assert run_ranks(_norms, world_size, n_kv_head, timeout=300, env=REFERENCE_KERNELS) == ["ok"] * world_size
