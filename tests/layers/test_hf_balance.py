"""Auxiliary-loss-free balancing of Hugging Face mixtures of experts (layers/hf_balance.py): the routes counted
at the experts of every block with an ``e_score_correction_bias``, and ``update_expert_biases`` moving the biases.

One process: GLM-4-MoE, DeepSeek-V3, ERNIE-4.5-MoE and Laguna (tiny, random; the last two hold the bias as a
parameter without gradient) against the routes their routers return (read by a hook on each router), training
forwards only; the biases kept in fp32. On 4 gloo ranks: tensor × context parallelism
(with and without sequence parallelism) and expert parallelism over data-parallel ranks, every rank's biases
after one update against the dense model's update on the whole batch (the exact same routes: integer counts,
routers sharpened so that fp32 reordering cannot flip a route).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tessel.layers import track_expert_loads, update_expert_biases
from tessel.layers.hf_balance import expert_loads
from tests.layers.test_hf import REFERENCE_KERNELS, VOCAB, B, S, needs_hf
from tests.layers.test_hf_experts import _moe
from tests.multiprocess import run_ranks

RATE = 0.01


def _biases(model) -> list[torch.Tensor]:
    """Every ``e_score_correction_bias`` of ``model`` (buffers, or ERNIE's parameters without gradient), in order."""
    return [t for name, t in (*model.named_buffers(), *model.named_parameters()) if name.endswith("correction_bias")]


def _routers(model):
    """The router (``gate``) of every block holding an ``e_score_correction_bias``, in module order."""
    return [m.gate for m in model.modules() if hasattr(m, "experts") and any(True for _ in _biases(m))]


def _routes_by_hand(model, run) -> torch.Tensor:
    """``[layers, X]``: the routes each router returned (its third output, the expert ids) while ``run()`` ran."""
    routers = _routers(model)
    counts = torch.zeros(len(routers), _biases(model)[0].numel(), dtype=torch.int64)

    def record(i, out):
        counts[i] += torch.bincount(out[2].reshape(-1), minlength=counts.shape[1])

    hooks = [r.register_forward_hook(lambda m, a, out, i=i: record(i, out)) for i, r in enumerate(routers)]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return counts


def _step(model, ids, weights=None):
    """A training forward and backward of ``model`` on ``ids``."""
    logits = model(ids).logits
    (logits * (weights if weights is not None else 1)).sum().backward()


@needs_hf
# ERNIE-4.5-MoE and Laguna hold the bias as a parameter without gradient ([1, X] and [X]), the others as a buffer
@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3", "ernie4_5_moe", "laguna"])
def test_training_routes_are_counted_and_move_the_biases(family):
    model = _moe(family)
    assert track_expert_loads(model) == len(_routers(model)) == 1  # the first layer is dense
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(VOCAB, (B, S), generator=gen) for _ in range(3)]
    model.train()
    want = _routes_by_hand(model, lambda: [_step(model, ids) for ids in batches[:2]])
    model.eval()
    model(batches[2])  # neither an evaluation forward
    model.train()
    with torch.no_grad():
        model(batches[2])  # nor one that records no gradient counts
    assert want.sum() == 2 * B * S * 2  # every token's two routes, in two training forwards
    assert torch.equal(torch.stack([load.counts for load in expert_loads(model)]), want)
    before = [bias.clone() for bias in _biases(model)]
    loads = update_expert_biases(model, RATE)
    assert torch.equal(loads, want.float())
    for bias, old, count in zip(_biases(model), before, want.float(), strict=True):
        torch.testing.assert_close(bias, old + RATE * torch.sign(count.mean() - count).float().view(old.shape))
        assert bias.dtype == torch.float32 and not bias.requires_grad
    assert all(not load.counts.any() for load in expert_loads(model))  # counting starts again
    assert not torch.equal(before[0], _biases(model)[0])


@needs_hf
def test_biases_stay_fp32_in_a_bf16_model_and_tracking_twice_counts_once():
    model = _moe("glm4_moe").to(torch.bfloat16)
    assert _routers(model)[0].e_score_correction_bias.dtype == torch.bfloat16
    assert track_expert_loads(model) == track_expert_loads(model) == 1
    assert _routers(model)[0].e_score_correction_bias.dtype == torch.float32  # 1e-3 steps survive
    assert next(model.parameters()).dtype == torch.bfloat16
    model.train()
    ids = torch.randint(VOCAB, (B, S), generator=torch.Generator().manual_seed(0))
    want = _routes_by_hand(model, lambda: _step(model, ids))
    assert torch.equal(expert_loads(model)[0].counts, want[0])
    update_expert_biases(model, 1e-3)
    assert _routers(model)[0].e_score_correction_bias.abs().max() == pytest.approx(1e-3)


@needs_hf
def test_models_without_routing_biases_track_nothing():
    model = _moe("mixtral")
    assert track_expert_loads(model) == 0 and expert_loads(model) == []
    assert update_expert_biases(model, RATE) is None
    with pytest.raises(TypeError, match=r"track_expert_loads: model must be an nn.Module, received str"):
        track_expert_loads("model")


@needs_hf
def test_a_route_beyond_the_biases_is_refused_and_the_device_path_counts_alike(monkeypatch):
    """A route to an expert the bias has no value for is refused on a CPU (ValueError naming it); the path taken on a
    GPU and under compile (sorted ids, binary search, a device-side assertion: no host sync) counts the same."""
    model = _moe("glm4_moe")
    track_expert_loads(model)
    experts = next(m.experts for m in model.modules() if hasattr(m, "experts") and any(True for _ in _biases(m)))
    model.train()
    hidden = torch.randn(5, 64)
    weights = torch.full((5, 2), 0.5)
    with pytest.raises(ValueError, match=r"a route chose expert 4, beyond the 4 values of its e_score_correction_bias"):
        experts(hidden, torch.tensor([[0, 1]] * 4 + [[2, 4]]), weights)
    ids = torch.tensor([[0, 1], [3, 1], [2, 0], [1, 1], [3, 3]])
    load = expert_loads(model)[0]
    load.counts.zero_()
    experts(hidden, ids, weights)
    on_host = load.counts.clone()
    load.counts.zero_()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    experts(hidden, ids, weights)
    assert torch.equal(load.counts, on_host) and on_host.tolist() == [2, 4, 1, 3]


# ---------------------------------------------------------------------------------------------------- ranks


def _dense_update(dense, batches) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The biases of ``dense`` after training forwards on ``batches`` and one update, and the loads it counted."""
    track_expert_loads(dense)
    dense.train()
    for ids in batches:
        _step(dense, ids)
    loads = update_expert_biases(dense, RATE)
    return _biases(dense), loads


def _parallel(rank, world_size):
    """tp=2 × cp=2 (each rank its share of the sequence; with sequence parallelism each tp rank routes its shard
    of it): the counts are summed over the groups ``parallelize`` noted. Then dp=4 with ep=2 (each rank its own
    batch, every route sent to its expert's rank): summed over the data-parallel group given to the update."""
    from tessel.layers.parallelize import parallelize
    from tessel.parallel import init_parallel
    from tessel.parallel.context import split_sequence
    from tests.layers.test_context_parallel import _grid

    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(VOCAB, (B, S), generator=gen) for _ in range(world_size)]
    _, tp_group, cp_group = _grid(rank, world_size, 2)
    for family in ("glm4_moe", "ernie4_5_moe"):
        for sp in (False, True):
            dense = _moe(family)
            par = parallelize(copy.deepcopy(dense), tp_group, cp_group=cp_group, sequence_parallel=sp)
            par.train()
            _step(par, split_sequence(batches[0], cp_group))
            loads = update_expert_biases(par, RATE)
            want, want_loads = _dense_update(dense, batches[:1])
            assert torch.equal(loads, want_loads), (family, sp, loads, want_loads)  # every token once
            for got, ref in zip(_biases(par), want, strict=True):
                assert torch.equal(got, ref), (family, sp, got, ref)
    dims = init_parallel(ep=2)
    dense = _moe("glm4_moe")
    par = parallelize(copy.deepcopy(dense), dims.tp_group, ep_group=dims.ep_group)
    par.train()
    _step(par, batches[dims.dp_rank])
    loads = update_expert_biases(par, RATE, dims.dp_group)
    want, want_loads = _dense_update(dense, batches)
    assert torch.equal(loads, want_loads) and loads.sum() == world_size * B * S * 2
    assert torch.equal(_biases(par)[0], want[0])
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_parallel_layouts_update_the_biases_as_the_dense_model_does():
    assert run_ranks(_parallel, 4, timeout=400, env=REFERENCE_KERNELS) == ["ok"] * 4
