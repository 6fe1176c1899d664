"""CodeGen's fused projection interleaves its rows in the groups of heads it was trained over (``mp_num = 4``): each
group's ``[q | v | k]`` rows of its heads, in turn. A column split over t ranks (t dividing 4) gives each rank whole
groups, and its attention module reads ``mp_num / t`` of them: without that local count it would cut each of its groups
at the wrong rows and give other logits, with no error. Over more ranks than groups a group would be cut: refused by
name. GPT-J, which keeps q, k and v apart, splits as any family does (tests/layers/test_hf_families.py).
"""

import pytest

from tests.layers.test_hf import REFERENCE_KERNELS, needs_hf
from tests.layers.test_hf_families import _families_ranks
from tests.multiprocess import run_ranks


@pytest.mark.multiprocess
@needs_hf
def test_codegen_splits_one_group_of_heads_per_rank_over_four_ranks():
    """Four ranks, one group (one head) each, ± sequence parallelism: the dense model's logits and gradients."""
    assert run_ranks(_families_ranks, 4, ("codegen",), timeout=300, env=REFERENCE_KERNELS) == ["ok"] * 4


@needs_hf
def test_more_ranks_than_codegens_groups_are_refused_by_name():
    import transformers

    from tessel.layers.hf_plans import local_head_updates

    config = transformers.CodeGenConfig(n_embd=64, n_head=8, rotary_dim=4, n_layer=1, vocab_size=32)
    attention = transformers.CodeGenForCausalLM(config).transformer.h[0].attn
    assert local_head_updates(attention, 2)["mp_num"] == 2
    with pytest.raises(ValueError, match=r"CodeGenAttention\.mp_num=4 does not split over 8 tensor-parallel ranks"):
        local_head_updates(attention, 8)
