"""DeepSeek-V4's attention split by heads (:mod:`tessel.layers.hf_grouped_output`): a tiny DeepSeek-V4 of a sliding
layer, a compressed sparse one and a heavily compressed one (their compressors and indexer), against the dense model
in float32 (``_check_against_dense``: logits and every gradient shard), on 2 and 4 ranks, with Hugging Face's eager
attention and with tessel's, whose mask for such an eager-only model is the eager one (the compressed keys' bias
joins it).
"""

import copy

import pytest
import torch

from tests.layers.test_hf import REFERENCE_KERNELS, _check_against_dense, needs_hf
from tests.layers.test_hf_families import family_model
from tests.multiprocess import run_ranks

V4 = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=16, q_lora_rank=24, o_groups=4,
          o_lora_rank=8, num_hidden_layers=3,
          layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
          compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4}, sliding_window=4,
          index_n_heads=2, index_head_dim=8, index_topk=3, n_routed_experts=4, num_experts_per_tok=2,
          mlp_layer_types=["moe"] * 3, hc_mult=2, hc_sinkhorn_iters=3, qk_rope_head_dim=8, partial_rotary_factor=0.5,
          rope_parameters={"main": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
                           "compress": {"rope_type": "default", "rope_theta": 1.6e5, "partial_rotary_factor": 0.5}},
          num_nextn_predict_layers=0, moe_intermediate_size=32, n_shared_experts=1)  # fmt: skip


def _v4(**kw):
    return family_model("deepseek_v4", **{**V4, **kw})


def _split_ranks(rank, world_size, o_groups):
    from tessel.layers.hf_attention import register_hf_attention
    from tessel.layers.parallelize import parallelize

    register_hf_attention()
    t, split = world_size, o_groups % world_size == 0
    for impl, sp in (("eager", False), ("tessel", False), ("eager", True)):
        dense = _v4(o_groups=o_groups)
        if sp and not split:  # attention left whole: nothing would gather its block's input
            with pytest.raises(ValueError, match=r"splits nothing in model\.layers\.0\.self_attn \(DeepseekV4"):
                parallelize(copy.deepcopy(dense), None, sequence_parallel=True)
            continue
        par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp)
        if impl == "tessel":
            par.set_attn_implementation("tessel")
        for layer in par.model.layers:
            attention = layer.self_attn
            heads = 4 // t if split else 4
            assert attention.num_heads == heads and attention.num_key_value_groups == heads
            assert attention.sinks.shape == (heads,) and attention.q_b_proj.weight.shape == (heads * 16, 24)
            assert attention.o_a_proj.weight.shape == (o_groups * 8 // (t if split else 1), 64 // o_groups)
            assert attention.o_a_proj.n_groups == attention.config.o_groups == o_groups // (t if split else 1)
            assert attention.kv_proj.weight.shape == (16, 64), "the key-and-value head stays whole"
        _check_against_dense(dense, par, f"deepseek_v4 over {t} ranks, {o_groups} output groups, {impl}, sp={sp}")
    return "ok"


@pytest.mark.multiprocess
@needs_hf
@pytest.mark.parametrize(("world", "o_groups"), [(2, 4), (4, 4), (4, 2)], ids=["tp2", "tp4", "tp4-groups2"])
def test_deepseek_v4_attention_splits_by_heads(world, o_groups):
    """Each rank keeps its heads (whole output groups): their query rows, sinks, grouped output rows and the output
    projection's columns; the one key-and-value head and the compressors stay whole, their outputs' gradients summed
    over the ranks. Under sequence parallelism the projections of the block's input (the query latent, the key, the
    compressors') multiply each rank's tokens and gather their outputs. Output groups that do not split over the
    ranks keep the attention whole on every rank (and refuse sequence parallelism by name)."""
    assert run_ranks(_split_ranks, world, o_groups, timeout=600, env=REFERENCE_KERNELS) == ["ok"] * world


def hashed_v4(**kw):
    """A tiny DeepSeek-V4 whose first two layers route by the token ids (hash_moe), through a random table of two
    distinct experts per id (Hugging Face's default table, zeros, would send every token to expert 0 twice)."""
    model = _v4(mlp_layer_types=["hash_moe", "hash_moe", "moe"], **kw)
    g = torch.Generator().manual_seed(4)
    for layer in model.model.layers[:2]:
        table = layer.mlp.gate.tid2eid
        table.copy_(torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(table.shape[0])]))
    return model


def _hash_ranks(rank, world_size):
    from tessel.layers.parallelize import parallelize

    for sp, split in ((False, "features"), (True, "features"), (True, "experts")):
        dense = hashed_v4()
        par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp, expert_split=split)
        _check_against_dense(dense, par, f"hash-routed deepseek_v4, sp={sp}, experts split by {split}")
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_hash_routed_layers_read_their_shares_token_ids():
    """Layers routed by the token ids (hash_moe) on two ranks, against dense: under sequence parallelism each rank's
    experts block routes its share of the tokens, so it reads the same share of the ids (the whole ids beside a
    shard's hidden states fail to route), with the experts split by features or whole on their ranks."""
    assert run_ranks(_hash_ranks, 2, timeout=600, env=REFERENCE_KERNELS) == ["ok"] * 2


def _generate_ranks(rank, world_size):
    from tessel.layers.parallelize import parallelize

    dense = _v4()
    par = parallelize(copy.deepcopy(dense), None)
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(par.generate(ids, **kw), dense.generate(ids, **kw))
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_split_deepseek_v4_generates_the_dense_models_tokens():
    """Greedy decoding over the caches (the sliding keys, the compressors' windows) gives the dense model's tokens."""
    assert run_ranks(_generate_ranks, 2, timeout=300, env=REFERENCE_KERNELS) == ["ok"] * 2


@needs_hf
def test_tessels_attention_gets_the_eager_mask_of_an_eager_only_model():
    """DeepSeek-V4 runs eager attention alone and extends the mask it receives with its compressed keys' bias: under
    tessel's attention implementation it gets the eager mask, so its logits are the eager attention's (with ``sdpa``'s
    mask, None for a causal batch, the bias would be dropped and the compressed keys misplaced). A model that takes
    sdpa still gets sdpa's mask (None) and tessel's kernel."""
    from tessel.layers.hf_attention import _tessel_mask, register_hf_attention

    register_hf_attention()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    model = _v4()
    eager = model(ids).logits
    model.set_attn_implementation("tessel")
    torch.testing.assert_close(model(ids).logits, eager, rtol=0, atol=0)
    llama = family_model("llama")
    kw = dict(batch_size=1, q_length=4, kv_length=4, device="cpu")
    assert _tessel_mask(config=llama.config, **kw) is None
    assert _tessel_mask(config=model.config, **kw).dtype == torch.float32


def _context_parallel_ranks(rank, world_size):
    from tessel.layers.hf import register_hf_attention
    from tessel.layers.parallelize import parallelize
    from tests.layers.test_context_parallel import _grid
    from tests.layers.test_hf_families import _check_against_float64

    register_hf_attention()
    _, tp_group, cp_group = _grid(rank, world_size, 2)  # cp over two ranks, tp over the others
    sp = world_size > 2
    # None: a sliding layer, a CSA and an HCA one; {} also with a window longer than the sequence (the ring's plain
    # causal mask replaces the model's, of the local tokens)
    for layers, extra in ((["sliding_attention"] * 3, {}), (None, {}), (None, {"sliding_window": 64})):
        kinds = {**extra, **({} if layers is None else {"layer_types": layers})}
        par = parallelize(_v4(**kinds), tp_group, cp_group=cp_group, sequence_parallel=sp)
        par.set_attn_implementation("tessel")
        tag = f"deepseek_v4 {layers or 'compressed'} layers {extra}, cp=2, tp={world_size // 2}"
        _check_against_float64(_v4(**kinds), par, tag, tp_group, cp_group)
    return "ok"


@pytest.mark.multiprocess
@needs_hf
@pytest.mark.parametrize("world", [2, 4], ids=["cp2", "tp2-cp2-sp"])
def test_context_parallelism_runs_the_sliding_and_the_compressed_layers(world):
    """Over two context-parallel ranks (and tp=2 with sequence parallelism beside them): sliding layers (their sinks
    joining the ring's merged softmax), and compressed ones, whose compressors and indexer compress the whole sequence
    gathered from the ranks' shares and whose queries attend to the compressed keys beside the sequence's in one
    softmax (shared_keys_attention): the float64 dense model."""
    assert run_ranks(_context_parallel_ranks, world, timeout=600, env=REFERENCE_KERNELS) == ["ok"] * world


@needs_hf
def test_pipeline_stages_carry_the_residual_streams():
    """Stages of DeepSeek-V4 (2 and 3 of its 3 layers) pass its hyper-connections' residual streams ``[B, S, hc, H]``
    on, the last collapsing them: chained, the model's logits, loss and every gradient. A later stage holding a layer
    routed by the token ids (hash_moe), which only the first stage reads, is refused by name."""
    from tessel.layers import hf_pipeline_stage
    from tests.layers.test_hf_pipeline import check_stages

    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    _, splits = check_stages(_v4().eval(), ids, "deepseek_v4")
    assert [ranges for n, fused, ranges in splits if n == 3 and fused] == [[(0, 1), (1, 2), (2, 3)]]
    hashed = _v4(mlp_layer_types=["hash_moe", "hash_moe", "moe"])
    assert hf_pipeline_stage(hashed, 0, 2).stop == 2
    with pytest.raises(ValueError, match=r"stage 1 of 3 holds layers \[0, 1\] routed by the token ids \(hash_moe\)"):
        hf_pipeline_stage(hashed, 1, 3)
