"""``parallelize`` on the Hugging Face decoders that carry no tensor-parallel plan of their own
(:mod:`tessel.layers.hf_classic`): GPT-2, GPT-BigCode, GPT-Neo, OPT, XGLM, BioGPT, BLOOM, Falcon, MPT and Persimmon.
Each tiny model (random init, no dropout) dense against parallelized on 2 gloo ranks, with and without sequence
parallelism: logits and every gradient shard (fp32, 1e-4 relative, as test_hf.py); and what each rank holds.
"""

import copy

import pytest
import torch

from tests.layers.test_hf import REFERENCE_KERNELS, VOCAB, _check_against_dense, needs_hf
from tests.multiprocess import run_ranks

# the configs' own names for 64 features, 4 heads of 16, 2 layers, 96 or 4·64 intermediate features, no dropout
CLASSIC = {
    "gpt2": dict(n_embd=64, n_head=4, n_layer=2, n_inner=96, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0),
    "gpt_bigcode": dict(n_embd=64, n_head=4, n_layer=2, n_inner=96, n_positions=32, multi_query=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "gpt_neo": dict(hidden_size=64, num_heads=4, num_layers=2, intermediate_size=96, max_position_embeddings=32,
                    attention_types=[[["global", "local"], 1]], window_size=3, resid_dropout=0.0, embed_dropout=0.0,
                    attention_dropout=0.0),
    "opt": dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, ffn_dim=96, max_position_embeddings=32,
                word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0),
    "xglm": dict(d_model=64, attention_heads=4, num_layers=2, ffn_dim=96, max_position_embeddings=32, dropout=0.0,
                 attention_dropout=0.0, activation_dropout=0.0),
    "biogpt": dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=96,
                   max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "bloom": dict(hidden_size=64, n_head=4, n_layer=2, hidden_dropout=0.0, attention_dropout=0.0),
    "falcon": dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, new_decoder_architecture=True,
                   num_kv_heads=2, hidden_dropout=0.0, attention_dropout=0.0),
    "mpt": dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=32, resid_pdrop=0.0, emb_pdrop=0.0),
    "persimmon": dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=96,
                      hidden_dropout=0.0, attention_dropout=0.0),
}  # fmt: skip
# other layouts of the same families: Falcon's older one (q, k, v head by head, rotary, attention and MLP in turn),
# OPT after its norms (and its final norm's absence)
VARIANTS = {
    "falcon_rw": (
        "falcon",
        dict(new_decoder_architecture=False, multi_query=False, num_kv_heads=4, parallel_attn=False, bias=True),
    ),
    "opt_post_norm": ("opt", dict(do_layer_norm_before=False)),
    "opt_projected": ("opt", dict(word_embed_proj_dim=32)),
    # multi-query attention (StarCoder's, Falcon-7B's): one kv head, copied on every rank
    "gpt_bigcode_mqa": ("gpt_bigcode", dict(multi_query=True)),
    "falcon_mqa": ("falcon", dict(new_decoder_architecture=False, multi_query=True)),
}


def classic_model(kind: str, seed: int = 0, **config):
    import transformers

    family, extra = VARIANTS.get(kind, (kind, {}))
    kw = {**CLASSIC[family], **extra, **config}
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(family, vocab_size=VOCAB, tie_word_embeddings=False, pad_token_id=0,
                                               bos_token_id=1, eos_token_id=2, **kw)  # fmt: skip
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms away from their initial values, which hide wrong formulas; biases away from zero
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.add_(torch.rand(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.5)
    return model


# the linear layers each family keeps whole: XGLM's and BioGPT's heads, beside embeddings that scale their output
WHOLE = {
    "xglm": {"lm_head"},
    "biogpt": {"output_projection"},
    "opt_projected": {"model.decoder.project_in", "model.decoder.project_out"},
}  # OPT-350m's: to and from 32


def _whole_linears(model) -> set[str]:
    """The names of the nn.Linear (FalconLinear) and Conv1D modules left in ``model``."""
    return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"}


def _classic_ranks(rank, world_size, kinds):
    from tessel.layers.parallelize import parallelize

    for kind in kinds:
        for sp in (False, True) if kind != "opt_post_norm" else (False,):
            dense = classic_model(kind)
            par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp)
            assert _whole_linears(par) == WHOLE.get(kind, set()), (kind, _whole_linears(par))
            _check_against_dense(dense, par, f"{kind} sp={sp}")
    # what GPT-2's ranks hold: their heads' q, k and v of c_attn (a Conv1D [in, out], now nn.Linear's [out, in]), the
    # attention's local widths, half the vocabulary
    dense = classic_model("gpt2")
    par = parallelize(copy.deepcopy(dense), None)
    attention, whole = par.transformer.h[0].attn, dense.transformer.h[0].attn
    q, k, v = whole.c_attn.weight.t().split(64)
    mine = slice(32 * rank, 32 * rank + 32)
    assert torch.equal(attention.c_attn.weight, torch.cat([q[mine], k[mine], v[mine]]))
    assert attention.c_attn.weight.hf_transposed and attention.c_proj.weight.hf_transposed
    assert (attention.num_heads, attention.split_size, attention.embed_dim) == (2, 32, 32)
    assert par.lm_head.weight.shape == par.transformer.wte.weight.shape == (VOCAB // 2, 64)
    # a multi-query rank's c_attn: its query heads' rows and a copy of the one kv head's
    dense = classic_model("gpt_bigcode_mqa")
    attention, whole = parallelize(copy.deepcopy(dense), None).transformer.h[0].attn, dense.transformer.h[0].attn
    q, kv = whole.c_attn.weight.split([64, 32])
    assert torch.equal(attention.c_attn.weight, torch.cat([q[mine], kv])) and attention.c_attn.chunks == (2, 1, 1)
    counts = (attention.num_heads, attention.embed_dim, attention.split_size, attention.kv_dim)
    assert counts == (2, 32, 32, 16) and attention.num_key_value_groups == 2
    # BLOOM's ALiBi biases and MPT's: each rank's heads' slopes
    for kind in ("bloom", "mpt"):
        _check_against_dense(*_steep_alibi(kind, parallelize), f"{kind} steep ALiBi")
    return "ok"


def _steep_alibi(kind: str, parallelize):
    """``kind`` with its queries and keys scaled down, so that ALiBi's per-head slopes decide where each head looks:
    heads given another head's slopes would be far off. The dense model and its split copy."""
    dense = classic_model(kind)
    with torch.no_grad():
        for layer in dense.transformer.h if kind == "bloom" else dense.transformer.blocks:
            fused = layer.self_attention.query_key_value if kind == "bloom" else layer.attn.Wqkv
            fused.weight.mul_(0.05)
    return dense, parallelize(copy.deepcopy(dense), None)


@pytest.mark.multiprocess
@needs_hf
def test_classic_decoders_match_dense_on_two_ranks():
    kinds = (*CLASSIC, *VARIANTS)
    assert run_ranks(_classic_ranks, 2, kinds, timeout=600, env=REFERENCE_KERNELS) == ["ok", "ok"]


# attention tessel leaves whole: Falcon-RW's ALiBi (in its mask), BLOOM's emulation of its pretraining's tensor
# parallelism (which slices its projections' weights itself)
KEPT_WHOLE = {
    "falcon_rw": (dict(alibi=True), "transformer.h.0.self_attention"),
    "bloom": (dict(pretraining_tp=2, slow_but_exact=True), "transformer.h.0.self_attention"),
}


def _kept_whole_ranks(rank, world_size):
    from tessel.layers.linear import ColumnParallelLinear
    from tessel.layers.parallelize import parallelize

    for kind, (config, attention) in KEPT_WHOLE.items():
        dense = classic_model(kind, **config)
        if kind == "bloom":  # its MLP emulates the slices too: nothing in its layers splits, refused, not replicated
            with pytest.raises(ValueError, match=r"BloomForCausalLM's plan splits nothing inside its decoder layers"):
                parallelize(copy.deepcopy(dense), None)
            continue
        par = parallelize(copy.deepcopy(dense), None)
        inner = par.get_submodule(attention)
        assert not any(isinstance(m, ColumnParallelLinear) for m in inner.modules()), kind
        mlp = par.get_submodule(attention.rpartition(".")[0] + ".mlp")  # still split
        assert any(isinstance(m, ColumnParallelLinear) for m in mlp.modules()), kind
        _check_against_dense(dense, par, f"{kind} {config}")
        with pytest.raises(ValueError, match=f"sequence_parallel=True but the plan splits nothing in {attention}"):
            parallelize(copy.deepcopy(dense), None, sequence_parallel=True)
    # OPT after its norms has no final norm to gather the sequence at
    with pytest.raises(ValueError, match="cannot find one ModuleList of decoder layers followed by a final norm"):
        parallelize(classic_model("opt_post_norm"), None, sequence_parallel=True)
    # a model in training, its dropout on: the MLP's probe runs without it
    training = classic_model("gpt2", resid_pdrop=0.1).train()
    assert not _whole_linears(parallelize(training, None)) and training.training
    # a plan of the user's names GPT-2's Conv1D layers as it would nn.Linear ones
    dense = classic_model("gpt2")
    plan = {"transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}
    par = parallelize(copy.deepcopy(dense), None, plan=plan)
    assert _whole_linears(par) == {f"transformer.h.{i}.attn.{p}" for i in (0, 1) for p in ("c_attn", "c_proj")} | {
        "lm_head"
    }
    _check_against_dense(dense, par, "gpt2 user plan")
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_attention_tessel_cannot_split_stays_whole_beside_its_split_mlp():
    """Falcon's ALiBi keeps every head on every rank, its MLP split (the dense model's logits and gradients);
    sequence parallelism is refused by name. BLOOM's slow_but_exact keeps its attention and its MLP whole: a model
    whose layers nothing splits is refused by name. A user plan splits Conv1D layers."""
    assert run_ranks(_kept_whole_ranks, 2, timeout=600, env=REFERENCE_KERNELS) == ["ok", "ok"]


def _context_ranks(rank, world_size):
    from tessel.layers.parallelize import parallelize
    from tests.layers.test_context_parallel import _grid
    from tests.layers.test_hf_context_parallel import _check_against_dense as _check_context

    _, tp_group, cp_group = _grid(rank, world_size, 2)
    dense = classic_model("persimmon")  # attention through Hugging Face's functions, rotary positions
    _check_context(dense, parallelize(copy.deepcopy(dense), tp_group, cp_group=cp_group), tp_group, cp_group, "cp")
    for kind, words in (("falcon", "FalconAttention.* computes its own"), ("gpt2", "one rotary-embedding module")):
        with pytest.raises(ValueError, match=words):
            parallelize(classic_model(kind), tp_group, cp_group=cp_group)
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_context_parallelism_takes_attention_that_runs_hugging_faces_functions():
    """Persimmon (rotary positions, attention through Hugging Face's functions) runs tessel's ring on two
    context-parallel ranks; Falcon's attention, which computes itself (it would run on each rank's share of the keys),
    and GPT-2's learned positions are refused by name."""
    assert run_ranks(_context_ranks, 2, timeout=600, env=REFERENCE_KERNELS) == ["ok", "ok"]


@needs_hf
def test_attention_that_computes_itself_is_refused_tessels_attention_implementation():
    """BLOOM's and MPT's attention compute themselves: under tessel's attention implementation the model would build
    tessel's causal mask, None (the kernel's causal flag), and they would see every key. parallelize refuses it."""
    from tessel.layers import register_hf_attention
    from tessel.layers.parallelize import parallelize

    for kind, attention in (("bloom", "transformer.h.0.self_attention"), ("mpt", "transformer.blocks.0.attn")):
        model = classic_model(kind)
        model.config._attn_implementation = register_hf_attention()
        with pytest.raises(ValueError, match=f"{attention} computes its own attention, which would see no causal"):
            parallelize(model, None)
    model = classic_model("gpt2")  # through Hugging Face's attention functions: tessel's runs there
    model.config._attn_implementation = register_hf_attention()
    model.tower = _TowerAttention()  # outside the decoder layers (a vision or audio tower's): its own masks
    parallelize(model, None)


class _TowerAttention(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x @ x.transpose(-1, -2), dim=-1) @ x


# OPT's layers sit one module down, in its decoder; "opt_projected" projects its embeddings in and out of a narrower
# width (OPT-350m's)
PIPELINED = ("gpt2", "gpt_bigcode", "gpt_neo", "bloom", "falcon", "mpt", "persimmon", "opt", "opt_projected")


@needs_hf
@pytest.mark.parametrize("kind", PIPELINED)
def test_classic_decoders_chain_through_pipeline_stages(kind):
    """Five layers in 2 and 3 stages, chained: the model's logits, its loss (from the logits and fused) and every
    gradient. A later stage's base model is handed a placeholder, and its first layer the hidden states: GPT-2's would
    add its learned positions again, BLOOM's norm them again, OPT's project them in again (and a stage but the last
    project them out)."""
    from tests.layers.test_hf_pipeline import check_stages

    layers = {"gpt_neo": dict(num_layers=5, attention_types=[[["global", "local"], 2], [["global"], 1]])}
    depth = {"n_layer": 5} if kind in ("gpt2", "gpt_bigcode", "bloom") else {"n_layers": 5} if kind == "mpt" else {}
    depth = {"num_hidden_layers": 5} if kind.startswith("opt") else depth
    model = classic_model(kind, **layers.get(kind, depth or {"num_hidden_layers": 5}))
    assert len(_decoder_layers(model)) == 5, kind
    ids = torch.randint(VOCAB, (2, 13), generator=torch.Generator().manual_seed(3))
    check_stages(model, ids, kind)


def _decoder_layers(model):
    from tessel.layers.hf import decoder_layer_list

    return decoder_layer_list(model)


@needs_hf
def test_a_decoder_without_a_final_norm_is_refused_pipeline_stages():
    from tessel.layers import hf_pipeline_stage

    with pytest.raises(ValueError, match="cannot find OPTModel's input embedding, its decoder layers"):
        hf_pipeline_stage(classic_model("opt_post_norm"), 0, 2)


@pytest.mark.multiprocess
@needs_hf
@pytest.mark.parametrize(("sp", "fused", "kind"), [(True, True, "gpt2"), (False, False, "bloom")])
def test_classic_decoders_train_in_tensor_and_pipeline_parallel_stages(sp, fused, kind):
    """tp=2 × pp=2 through 1F1B: every gradient shard a stage holds, and the loss, are those of the tensor-parallel
    model run whole (GPT-2's positions added once, by the first stage; BLOOM's ALiBi of each rank's heads in both)."""
    from tests.layers.test_hf_pipeline import _pipelined

    results = run_ranks(_pipelined, 4, sp, fused, kind, timeout=300, env=REFERENCE_KERNELS)
    embedding, positions = ("wte", "wpe") if kind == "gpt2" else ("word_embeddings", "word_embeddings_layernorm")
    assert embedding in results[0] and positions in results[0] and "lm_head" not in results[0]
    assert "lm_head" in results[2] and "ln_f" in results[2] and embedding not in results[2]


def _generate_ranks(rank, world_size, kinds):
    from tessel.layers.parallelize import parallelize

    prompt = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    for kind in kinds:
        dense = classic_model(kind)
        par = parallelize(copy.deepcopy(dense), None)
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        want, got = dense.generate(prompt, **kw), par.generate(prompt, **kw)
        assert torch.equal(got, want), (kind, got, want)
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_split_classic_decoders_generate_the_dense_models_tokens():
    """Greedy generation over the cache, each rank its heads' keys and values (a multi-query rank its copy of the one
    kv head's): the dense model's tokens."""
    kinds = ("gpt2", "gpt_bigcode", "gpt_bigcode_mqa", "opt", "bloom", "falcon", "falcon_mqa", "mpt", "persimmon")
    assert run_ranks(_generate_ranks, 2, kinds, timeout=600, env=REFERENCE_KERNELS) == ["ok", "ok"]
