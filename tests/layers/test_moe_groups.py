"""Group-limited routing (DeepSeek-V3's ``n_group``/``topk_group``): ``route_top_k(groups=, top_groups=)``,
``ParallelMoE(expert_groups=, top_groups=)`` and ``GPTConfig``'s settings.

Against a float64 definition written row by row, against Hugging Face's DeepSeek-V3 router, by hand, through the
layer (output and gradients), and under expert parallelism against the dense model.
"""

from __future__ import annotations

import pytest
import torch

from tessel.layers.gpt import GPTConfig
from tessel.layers.moe import ParallelMoE, route_top_k
from tests.layers.test_moe import _config, _layer, _moe_vs_dense, check_against_reference
from tests.multiprocess import REFERENCE_KERNELS, run_ranks

FP32 = dict(rtol=1e-5, atol=1e-7)  # route_top_k's fp32 scores against float64


def _choose(scores, k, groups, top_groups, bias=None):
    """float64, one row: the experts of the ``top_groups`` groups whose two best ``score + bias`` add up highest,
    then the ``k`` best of those."""
    choice = scores.double() + (0 if bias is None else bias.double())
    per = choice.numel() // groups
    group_score = [sorted(choice[g * per : (g + 1) * per].tolist(), reverse=True)[:2] for g in range(groups)]
    kept = sorted(range(groups), key=lambda g: -sum(group_score[g]))[:top_groups]
    eligible = [x for g in kept for x in range(g * per, (g + 1) * per)]
    return torch.tensor(sorted(eligible, key=lambda x: -choice[x].item())[:k])


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("experts, k, groups, top_groups", [(8, 3, 4, 2), (12, 2, 3, 1), (6, 4, 6, 4), (8, 2, 1, 1)])
def test_routing_matches_the_float64_definition(score, biased, experts, k, groups, top_groups):
    gen = torch.Generator().manual_seed(experts * 100 + k)
    logits = 3 * torch.randn(64, experts, generator=gen)
    bias = 0.3 * torch.randn(experts, generator=gen) if biased else None
    weights, ids, probs = route_top_k(logits, k, bias, score, groups=groups, top_groups=top_groups)
    scores = torch.softmax(logits.double(), -1) if score == "softmax" else torch.sigmoid(logits.double())
    for n in range(logits.shape[0]):
        want = _choose(scores[n], k, groups, top_groups, bias)
        assert sorted(ids[n].tolist()) == sorted(want.tolist()), f"row {n}"
        torch.testing.assert_close(weights[n].double(), scores[n][ids[n]] / scores[n][ids[n]].sum(), **FP32)
    torch.testing.assert_close(probs.double(), scores / scores.sum(-1, keepdim=True), **FP32)


def test_routing_agrees_with_hugging_face_deepseek_v3():
    """HF's DeepseekV3TopkRouter (sigmoid scores, e_score_correction_bias, 8 groups keep 3, normalised top 4)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=16, n_routed_experts=32, num_experts_per_tok=4, n_group=8, topk_group=3,
                              norm_topk_prob=True, routed_scaling_factor=1.0)  # fmt: skip
    router = DeepseekV3TopkRouter(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(32, 16, generator=gen))
        router.e_score_correction_bias.copy_(0.2 * torch.randn(32, generator=gen))
    hidden = torch.randn(50, 16, generator=gen)
    logits, hf_weights, hf_ids = router(hidden)
    weights, ids, _ = route_top_k(logits, 4, router.e_score_correction_bias, "sigmoid", groups=8, top_groups=3)
    for mine, theirs in ((ids, hf_ids), (weights, hf_weights)):
        order_mine, order_theirs = ids.argsort(-1), hf_ids.argsort(-1)
        torch.testing.assert_close(mine.gather(-1, order_mine), theirs.gather(-1, order_theirs))


def test_group_limited_routing_by_hand():
    # groups {0, 1} {2, 3} {4, 5}: sums of the two best 0.9+0.1, 0.6+0.55, 0.7+0.0 → groups 1 then 0
    logits = torch.logit(torch.tensor([[0.9, 0.1, 0.6, 0.55, 0.7, 1e-6]]))
    assert route_top_k(logits, 2, score="sigmoid")[1].tolist() == [[0, 4]]  # no groups: the two best overall
    assert route_top_k(logits, 2, score="sigmoid", groups=3, top_groups=1)[1].tolist() == [[2, 3]]
    assert route_top_k(logits, 2, score="sigmoid", groups=3, top_groups=2)[1].tolist() == [[0, 2]]
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.5])  # group 2 now sums 1.2 + 0.7: first
    assert route_top_k(logits, 2, bias, score="sigmoid", groups=3, top_groups=1)[1].tolist() == [[4, 5]]


def test_groups_as_expert_parallel_ranks_bound_the_ranks_a_token_reaches():
    """8 experts over 4 ranks (2 each) in 4 groups, top 2: every token's 3 routes go to at most 2 ranks."""
    logits = torch.randn(500, 8, generator=torch.Generator().manual_seed(1))
    ids = route_top_k(logits, 3, score="sigmoid", groups=4, top_groups=2)[1]
    ranks = [len(set((row // 2).tolist())) for row in ids]
    assert max(ranks) == 2 and min(ranks) == 2  # 3 routes over groups of 2: always both kept groups
    plain = route_top_k(logits, 3, score="sigmoid")[1]
    assert max(len(set((row // 2).tolist())) for row in plain) == 3


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_layer_with_groups_matches_the_float64_definition(score):
    moe = _layer(n_expert=6, top_k=2)
    moe.router_score, moe.expert_groups, moe.top_groups = score, 3, 1
    assert "groups=3 (top 1)" in repr(moe)
    check_against_reference(moe, score, choose=lambda s: _choose(s, 2, 3, 1))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(groups=3), r"route_top_k: groups=3 does not divide the 8 experts"),
        (dict(groups=0), r"route_top_k: groups must be a positive int, received 0"),
        (dict(groups=4, top_groups=5), r"route_top_k: top_groups=5 exceeds groups=4"),
        (dict(groups=4, top_groups=True), r"route_top_k: top_groups must be a positive int, received True"),
        (dict(groups=8, top_groups=2), r"route_top_k: top_k=3 exceeds the 2 experts of top_groups=2 groups of 1"),
    ],
)
def test_bad_groups_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        route_top_k(torch.randn(4, 8), 3, **kw)


def test_layer_and_config_refuse_bad_groups():
    with pytest.raises(ValueError, match=r"ParallelMoE: expert_groups=4 does not divide the 6 experts"):
        ParallelMoE(8, 8, 6, 2, expert_groups=4)
    with pytest.raises(ValueError, match=r"ParallelMoE: top_k=2 exceeds the 1 experts of top_groups=1 groups of 1"):
        ParallelMoE(8, 8, 6, 2, expert_groups=6)
    with pytest.raises(ValueError, match=r"GPTConfig: top_groups=3 exceeds expert_groups=2"):
        _config(expert_groups=2, top_groups=3)
    with pytest.raises(ValueError, match=r"GPTConfig: expert_groups=2, top_groups=1 group the experts: they need "
                                         r"n_expert > 0"):  # fmt: skip
        GPTConfig(vocab_size=16, n_layer=1, n_head=2, n_embd=32, block_size=8, expert_groups=2)


@pytest.mark.multiprocess
def test_group_limited_experts_over_ep_ranks_match_dense():
    """tp=2 with sequence parallelism × ep=2, sigmoid scores with routing biases, 4 experts in 2 groups of which
    each token keeps one: the groups are the ep ranks."""
    cfg_kw = {"router_score": "sigmoid", "expert_bias_rate": 0.01, "expert_groups": 2, "top_groups": 1}
    run_ranks(_moe_vs_dense, 4, (2, 2), True, cfg_kw, timeout=300, env=REFERENCE_KERNELS)
