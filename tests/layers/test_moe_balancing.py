"""Auxiliary-loss-free balancing of the experts (DeepSeek-V3): routing biases, their update, and their state.

One process: the biased choice against a float64 definition, the update written out by hand, which forwards
count, a skewed router brought to balance by the biases alone, bad arguments, the GPT's biases (fp32 whatever
the weights' dtype, in ``state_dict``, carried by ``from_module``). On gloo ranks: the routes counted under
tensor (with sequence parallelism), expert, data and context parallelism are the dense model's on the global
batch, so every rank ends a step with the same biases as one process would.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tessel.layers.gpt import GPT, GPTConfig
from tessel.layers.moe import ParallelMoE, route_top_k, update_expert_biases
from tests.multiprocess import REFERENCE_KERNELS, run_ranks

RATE = 0.01


def _config(**kw):
    base = dict(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=16, n_expert=4, top_k=2,
                mlp_hidden=32, expert_bias_rate=RATE)  # fmt: skip
    return GPTConfig(**{**base, **kw})


def _routes(layer: ParallelMoE, x: torch.Tensor) -> torch.Tensor:
    """Routes per expert of ``x`` under the layer's router and biases, in float64."""
    probs = torch.softmax(x.reshape(-1, layer.n_embd).double() @ layer.router.double().T, -1)
    ids = (probs + layer.expert_bias.double()).topk(layer.top_k, -1)[1]
    return torch.bincount(ids.reshape(-1), minlength=layer.n_expert).double()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_biases_choose_the_experts_and_the_probabilities_weigh_them(k):
    gen = torch.Generator().manual_seed(k)
    logits, bias = torch.randn(13, 6, generator=gen), 0.3 * torch.randn(6, generator=gen)
    weights, ids, probs = route_top_k(logits, k, bias)
    p64 = torch.softmax(logits.double(), -1)
    for n in range(13):
        chosen = sorted(range(6), key=lambda x: -(p64[n, x] + bias[x].double()).item())[:k]
        assert sorted(ids[n].tolist()) == sorted(chosen)
        want = p64[n, ids[n]] / p64[n, ids[n]].sum()
        torch.testing.assert_close(weights[n].double(), want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(probs.double(), p64, rtol=1e-6, atol=1e-7)
    plain = route_top_k(logits, k)
    biased = route_top_k(logits, k, torch.zeros(6))
    assert all(torch.equal(a, b) for a, b in zip(plain, biased, strict=True))
    forced = route_top_k(logits, 1, torch.tensor([0, 0, 0, 0, 2.0, 0]))[1]  # a bias above 1 always wins
    assert forced.eq(4).all()


@pytest.mark.usefixtures("reference_kernels")
def test_an_update_moves_each_bias_by_the_rate_towards_the_mean_load():
    torch.manual_seed(0)
    layer = ParallelMoE(16, 8, 5, 2, expert_bias=True)
    with torch.no_grad():
        layer.router.mul_(40.0)  # far from uniform: no near-tie for float64 to break otherwise
        layer.expert_bias.copy_(torch.tensor([0.0, 0.1, -0.05, 0.0, 0.02]))
    before = layer.expert_bias.clone()
    xs = [torch.randn(2, 7, 16), torch.randn(3, 5, 16)]
    want = sum(_routes(layer, x) for x in xs)  # counted over every forward since the last update
    for x in xs:
        layer(x).sum().backward()
    with torch.no_grad():
        layer(torch.randn(4, 16))  # no gradient: evaluation or generation, not counted
    layer.eval()
    layer(torch.randn(4, 16))  # nor in eval mode
    layer.train()
    torch.testing.assert_close(layer.expert_load.double(), want, rtol=0, atol=0)
    loads = update_expert_biases(layer, RATE)
    torch.testing.assert_close(loads, want[None].float(), rtol=0, atol=0)
    step = RATE * torch.sign(want.mean() - want)
    torch.testing.assert_close(layer.expert_bias.double(), before.double() + step, rtol=0, atol=1e-7)
    assert layer.expert_load.eq(0).all() and step.ne(0).any()
    balanced = ParallelMoE(16, 8, 2, 2, expert_bias=True)  # top 2 of 2: every expert takes every token
    balanced(torch.randn(3, 16)).sum().backward()
    update_expert_biases(balanced, RATE)
    assert balanced.expert_bias.eq(0).all()  # sign(0): a balanced expert keeps its bias


@pytest.mark.usefixtures("reference_kernels")
def test_the_biases_alone_balance_a_skewed_router():
    """Tokens from one distribution, a router that sends most of them to expert 0: updates of the biases, with
    no change of any weight, spread the routes evenly (DeepSeek-V3's claim, on a small scale)."""
    torch.manual_seed(0)
    layer = ParallelMoE(16, 8, 4, 1, expert_bias=True)
    x = torch.randn(256, 16) + 1.0
    with torch.no_grad():
        layer.router.normal_(std=0.3)  # tokens with preferences of their own
        layer.router[0] = 0.2  # and expert 0's score growing with the inputs' positive mean
    imbalance = []
    for _ in range(200):
        layer(x)  # a forward that records gradients counts its routes
        loads = update_expert_biases(layer, 0.005)[0]
        imbalance.append((loads.max() / loads.mean()).item())
    assert imbalance[0] > 3.5  # most tokens on expert 0 at first
    assert max(imbalance[-20:]) < 1.15  # measured: 1.08 at most over the last 20 of 200 updates


def test_bad_arguments_are_refused():
    layer = ParallelMoE(16, 8, 4, 2, expert_bias=True)
    for rate in (0, -1.0, float("inf"), float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match=r"update_expert_biases: rate must be a positive finite number"):
            update_expert_biases(layer, rate)
    with pytest.raises(TypeError, match=r"ParallelMoE: expert_bias must be a bool, received 1"):
        ParallelMoE(16, 8, 4, 2, expert_bias=1)
    with pytest.raises(ValueError, match=r"GPTConfig: expert_bias_rate must be a finite non-negative number"):
        _config(expert_bias_rate=-0.1)
    with pytest.raises(ValueError, match=r"GPTConfig: expert_bias_rate=0.1 needs experts \(n_expert > 0\)"):
        _config(n_expert=0, expert_bias_rate=0.1)
    assert update_expert_biases(ParallelMoE(16, 8, 4, 2), RATE) is None  # no biases: nothing to do


@pytest.mark.usefixtures("reference_kernels")
def test_the_gpt_keeps_fp32_biases_in_its_state_and_updates_every_layer():
    cfg = _config()
    gpt = GPT(cfg, dtype=torch.bfloat16)
    keys = [k for k in gpt.state_dict() if "expert" in k]
    assert keys == ["blocks.0.mlp.expert_bias", "blocks.1.mlp.expert_bias"]  # the counts are not state
    assert all(b.mlp.expert_bias.dtype == torch.float32 for b in gpt.blocks)
    idx = torch.randint(cfg.vocab_size, (3, 8), generator=torch.Generator().manual_seed(0))
    gpt.loss(idx, idx).backward()
    loads = gpt.update_expert_bias()
    assert loads.shape == (cfg.n_layer, cfg.n_expert) and loads.sum(1).eq(3 * 8 * cfg.top_k).all()
    for block, load in zip(gpt.blocks, loads, strict=True):
        assert torch.equal(block.mlp.expert_bias, RATE * torch.sign(load.mean() - load))
    assert GPT(_config(expert_bias_rate=0.0)).update_expert_bias() is None
    assert "expert_bias" not in GPT(_config(expert_bias_rate=0.0)).state_dict()
    copy = ParallelMoE.from_module(gpt.blocks[1].mlp)
    assert torch.equal(copy.expert_bias, gpt.blocks[1].mlp.expert_bias) and "expert_bias=True" in repr(copy)


# ---------------------------------------------------------------------------------------------------- parallel


def _solo(rank, world_size):
    return [dist.new_group([r]) for r in range(world_size)][rank]


def _biases_vs_dense(rank, world_size, layout):
    """Each rank's GPT runs its share of the global batch and updates over the data-parallel group; one dense
    GPT runs every share. The loads and the biases agree exactly (integer counts, the same choices)."""
    from tessel.parallel.context import split_sequence
    from tessel.parallel.dims import init_parallel

    tp, cp, ep, sp = layout
    dims = init_parallel(tp=tp, cp=cp, ep=ep)
    solo = _solo(rank, world_size)
    cfg = _config(top_k=1)
    torch.manual_seed(0)
    dense = GPT(cfg, tp_group=solo)
    torch.manual_seed(0)
    par = GPT(cfg, tp_group=dims.tp_group, cp_group=dims.cp_group if cp > 1 else None, ep_group=dims.ep_group,
              sequence_parallel=sp)  # fmt: skip
    batches = [torch.randint(cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(10 + d))
               for d in range(dims.dp)]  # fmt: skip
    for step in range(3):
        for idx in batches:
            dense.loss(idx, idx).backward()
        want = dense.update_expert_bias()
        mine = batches[dims.dp_rank]
        if cp > 1:
            mine = split_sequence(mine, dims.cp_group)
        par.loss(mine, mine).backward()
        got = par.update_expert_bias(dims.dp_group)
        assert torch.equal(got, want), (step, got, want)
        for a, b in zip(par.blocks, dense.blocks, strict=True):
            assert torch.equal(a.mlp.expert_bias, b.mlp.expert_bias), step
        batches = [b.roll(1, 1) for b in batches]
    return [b.mlp.expert_bias.tolist() for b in par.blocks]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout", [(2, 1, 1, True), (1, 1, 2, False), (1, 2, 1, False), (2, 1, 2, True)],
    ids=["tp2-sp", "dp2-ep2", "cp2", "tp2-sp-dp2-ep2"],
)  # fmt: skip
def test_every_rank_ends_with_the_dense_models_biases(layout):
    world = layout[0] * layout[1] * layout[2]  # tp · cp · dp, with dp = ep
    biases = run_ranks(_biases_vs_dense, world, layout, timeout=300, env=REFERENCE_KERNELS)
    assert all(b == biases[0] for b in biases) and any(v != 0 for layer in biases[0] for v in layer)
