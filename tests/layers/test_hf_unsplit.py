"""A Hugging Face model whose own plan (as tessel completes it) splits nothing inside its decoder layers is refused by
name, before anything changes, instead of running every layer whole on every rank: a DBRX whose one kv head and odd
expert width split over no two ranks. Over one rank nothing splits anyway and it passes; a user's plan is the user's.
"""

import copy

import pytest
import torch

from tests.layers.test_hf import REFERENCE_KERNELS, _assert_unchanged, _state, needs_hf
from tests.multiprocess import run_ranks


def dbrx(kv_heads: int = 2, width: int = 32):
    """A tiny DBRX (fused GQA attention with clipped projections, 4 experts stacked in 2-d weights), in eval mode."""
    import transformers

    attention = {"kv_n_heads": kv_heads, "rope_theta": 10000.0, "clip_qkv": 8.0}
    experts = {"moe_num_experts": 4, "moe_top_k": 2, "ffn_hidden_size": width}
    config = transformers.DbrxConfig(d_model=64, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=128,
                                     attn_config=attention, ffn_config=experts)  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _ranks(rank, world_size):
    from tessel.layers.linear import ColumnParallelLinear, RowParallelLinear
    from tessel.layers.parallelize import parallelize

    model = dbrx(kv_heads=1, width=33)
    before, types = _state(model), [type(m) for m in model.modules()]
    with pytest.raises(
        ValueError,
        match=r"DbrxForCausalLM's plan splits nothing inside its decoder layers "
        r"\(transformer\.blocks\.\*; it splits \['lm_head', 'transformer\.wte'\]\)",
    ):
        parallelize(model, None)
    _assert_unchanged(model, before, types)
    # the user's plan is the user's: its head alone split, the layers whole
    par = parallelize(copy.deepcopy(model), None, plan={"lm_head": "colwise_gather_output"})
    assert isinstance(par.lm_head, ColumnParallelLinear)
    assert not any(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for m in par.transformer.modules())
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_a_model_whose_layers_nothing_splits_is_refused_by_name():
    assert run_ranks(_ranks, 2, timeout=300, env=REFERENCE_KERNELS) == ["ok", "ok"]


@needs_hf
def test_over_one_rank_nothing_splits_and_it_passes():
    from tessel.layers.parallelize import parallelize

    model = parallelize(dbrx(kv_heads=1, width=33), None)
    ids = torch.randint(0, 128, (1, 8))
    assert model(ids).logits.shape == (1, 8, 128)
