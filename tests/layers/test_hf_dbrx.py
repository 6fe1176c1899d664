"""DBRX split over tensor-parallel ranks (it has no plan of its own): its fused ``Wqkv`` ``[q | k | v]`` of fewer kv
heads than query heads by heads (each rank its query heads and its kv heads of each part, the clip applied to its
share), ``out_proj`` row-parallel, and its experts, stacked expert after expert in 2-d ``[E·I, H]`` weights, by
intermediate features (``tessel.layers.hf_stacked_experts``): the dense model's logits and every gradient shard, with
and without sequence parallelism, where its ``norm_attn_norm`` wrapper (a "norm" by its name, holding the split
attention) sums only its norms' gradients over the ranks, not the split projections'.
"""

import copy

import pytest

from tests.layers.test_hf import REFERENCE_KERNELS, _check_against_dense, needs_hf
from tests.layers.test_hf_unsplit import dbrx
from tests.multiprocess import run_ranks


def _ranks(rank, world_size):
    from tessel.layers.parallelize import parallelize

    for sp in (False, True):
        dense = dbrx()
        par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp)
        block = par.transformer.blocks[0]
        attention, experts = block.norm_attn_norm.attn, block.ffn.experts
        assert attention.Wqkv.weight.shape == ((4 + 2 * 2) * 16 // 2, 64)  # [q | k | v], this rank's heads of each
        assert attention.out_proj.weight.shape == (64, 32)
        assert (attention.num_heads, attention.num_key_value_heads, attention.hidden_size) == (2, 1, 32)
        assert experts.mlp.w1.shape == experts.mlp.w2.shape == (4 * 16, 64) and experts.ffn_hidden_size == 16
        _check_against_dense(dense, par, f"dbrx sp={sp}")
    with pytest.raises(ValueError, match=r"experts stacked in 2-d weights \(DBRX's\) split by 'features' only"):
        parallelize(dbrx(), None, expert_split="experts")
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_dbrx_splits_its_fused_attention_and_stacked_experts():
    assert run_ranks(_ranks, 2, timeout=600, env=REFERENCE_KERNELS) == ["ok", "ok"]
