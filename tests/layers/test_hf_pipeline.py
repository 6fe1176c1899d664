"""hf_pipeline_stage: a Hugging Face causal LM cut into pipeline stages computes the model's own logits, loss
and gradients, alone, under tensor parallelism (with and without sequence parallelism) and through a pipeline
schedule on gloo ranks.

The ranks run tessel's plain-PyTorch kernels (these tests check the plumbing; the kernels are proved
elsewhere). Stages are compared in float32 with the model they were cut from: in one process (Llama, Mistral's
sliding window, Qwen2's mix of full and sliding layers, Qwen3), and at tp=2 × pp=2 against the same
tensor-parallel model run whole.
"""

import importlib.util

import pytest
import torch

from tests.multiprocess import REFERENCE_KERNELS, run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")

VOCAB, LAYERS = 98, 5
MODELS = ("llama", "mistral", "qwen2", "qwen3")


def _model(kind: str, dtype=torch.float32, layers: int = LAYERS, **extra):
    import transformers

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, tie_word_embeddings=False, attn_implementation="sdpa")  # fmt: skip
    if kind == "mistral":
        kw["sliding_window"] = 7  # shorter than the sequences
    if kind == "qwen2":  # layers 2.. slide: a stage's layers must keep their own kinds
        kw.update(use_sliding_window=True, sliding_window=5, max_window_layers=2)
    names = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
    config = getattr(transformers, f"{names[kind]}Config")(**{**kw, **extra})
    torch.manual_seed(0)
    return getattr(transformers, f"{names[kind]}ForCausalLM")(config).to(dtype)


def _targets(ids):
    """Next-token targets: each row shifted by one, the last position ignored (Hugging Face's labels=ids)."""
    return torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _chained(model, ids, n: int, fused: bool):
    """``(stages, output, loss)``: ``model``'s ``n`` stages, ``ids`` through them chained, and the last stage's loss of
    that output."""
    from tessel.layers import hf_pipeline_stage

    stages = [hf_pipeline_stage(model, s, n, fused_loss=fused) for s in range(n)]
    h = ids
    for stage in stages:
        h = stage(*h) if isinstance(h, tuple) else stage(h)  # with what it passes on (Gemma 4's per-layer inputs)
    return stages, h, stages[-1].loss(h, _targets(ids))


def check_stages(model, ids, tag: str, logits_atol: float = 1e-6) -> tuple[dict, list]:
    """``model``'s stages, chained in 2 and 3, give its logits, its loss (from the logits and fused) and every
    gradient; returns the model's own gradients and each split's ``(n, fused, [(start, stop) of each stage])``."""
    want = model(ids, labels=ids, use_cache=False)
    want.loss.backward()
    want_grads, splits = _grads(model), []
    for n in (2, 3):
        for fused in (False, True):
            model.zero_grad(set_to_none=True)
            stages, h, loss = _chained(model, ids, n, fused)
            splits.append((n, fused, [(stage.start, stage.stop) for stage in stages]))
            if not fused:
                torch.testing.assert_close(h, want.logits, rtol=1e-5, atol=logits_atol, msg=f"{tag} {n} logits")
            torch.testing.assert_close(loss, want.loss, rtol=1e-5, atol=1e-6, msg=f"{tag} {n} {fused} loss")
            loss.backward()
            got = _grads(model)
            assert got.keys() == want_grads.keys(), f"{tag} {n}"
            for name, g in got.items():
                torch.testing.assert_close(g, want_grads[name], rtol=1e-4, atol=1e-6, msg=f"{tag} {n} {name}")
    return want_grads, splits


def _chain(rank, world_size):

    results = []
    for kind in MODELS:
        model = _model(kind)
        ids = torch.randint(VOCAB, (2, 19), generator=torch.Generator().manual_seed(1))
        _, splits = check_stages(model, ids, kind)
        results += [(kind, n, fused, bounds) for n, fused, bounds in splits]
    return results


@pytest.mark.multiprocess
def test_stages_chain_to_the_models_logits_loss_and_gradients():
    """One process: every split of every model gives its logits, its loss (from the logits or fused)
    and every gradient; the layers split evenly, earlier stages taking the remainder."""
    (results,) = run_ranks(_chain, 1, timeout=240, env=REFERENCE_KERNELS, init_process_group=False)
    assert len(results) == len(MODELS) * 2 * 2
    ranges = {n: r for _, n, _, r in results}
    assert ranges == {2: [(0, 3), (3, 5)], 3: [(0, 2), (2, 4), (4, 5)]}


def _pipelined(rank, world_size, sp, fused, kind):
    """tp=2 × pp=2: each pipeline rank's stage of the tensor-parallel model through 1F1B (two microbatches), against
    the same tensor-parallel model run whole on this rank's tp group, microbatch after microbatch (a mixture's
    balancing loss is each microbatch's own)."""
    import torch.distributed as dist

    from tessel.layers import hf_pipeline_stage, parallelize
    from tessel.parallel.pipeline import PipelineStage, Schedule1F1B

    tp_rank, pp_rank = rank % 2, rank // 2
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp, pp = tp_groups[pp_rank], pp_groups[tp_rank]
    ids = torch.randint(VOCAB, (4, 8), generator=torch.Generator().manual_seed(2))
    from tests.layers.test_hf_classic import classic_model
    from tests.layers.test_hf_families import GEMMA4_VARIANTS, gemma4_model
    from tests.layers.test_hf_mixers import planless_model

    build = {
        "llama": lambda: _model("llama", layers=3),
        "mistral": lambda: _model("mistral", layers=3, sliding_window=3),
        "mixtral": lambda: _mixture("Mixtral", output_router_logits=True, router_aux_loss_coef=0.5),
        "zamba2": lambda: planless_model("zamba2", num_hidden_layers=4, layers_block_type=["mamba", "hybrid"] * 2),
        "gemma4": lambda: gemma4_model(**GEMMA4_VARIANTS["keys and values shared"]),
        "gpt2": lambda: classic_model("gpt2", n_layer=3),
        "bloom": lambda: classic_model("bloom", n_layer=3),
        "deepseek_v4": lambda: __import__("tests.layers.test_hf_deepseek_v4", fromlist=["_v4"])._v4(),
    }[kind]
    whole = parallelize(build(), tp, sequence_parallel=sp)
    want = torch.stack([whole(half, labels=half).loss for half in ids.chunk(2)]).mean()
    want.backward()
    want_grads = _grads(whole)
    model = parallelize(build(), tp, sequence_parallel=sp)
    stage = hf_pipeline_stage(model, pp_rank, 2, fused_loss=fused)
    schedule = Schedule1F1B(PipelineStage(stage, pp_rank, 2, pp), 2, lambda out, t: stage.loss(out, t))
    losses = []
    schedule.step(ids, target=_targets(ids), losses=losses)
    got = _grads(model)
    mine = {n for n, p in model.named_parameters() if any(p is q for q in stage.parameters())}
    assert got.keys() == mine & want_grads.keys(), (sorted(got), sorted(mine))  # (Zamba 2: other layers' adapters)
    for name, g in got.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-4, atol=1e-6, msg=f"sp={sp} fused={fused} {name}")
    if pp_rank == 1:
        torch.testing.assert_close(torch.stack(losses).mean(), want.detach(), rtol=1e-5, atol=1e-6)
    return sorted(n.split(".")[2] if n.startswith("model.layers") else n.split(".")[-2] for n in mine)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("sp", "fused", "kind"),
    [(False, False, "llama"), (True, True, "llama"), (True, False, "llama"), (True, True, "mixtral"),
     (True, True, "zamba2"), (False, False, "zamba2"), (True, False, "gemma4"), (False, True, "gemma4"),
     (True, False, "mistral"), (True, False, "deepseek_v4"), (False, True, "deepseek_v4")],
)  # fmt: skip
def test_tensor_and_pipeline_parallel_stages_train_as_the_whole_model(sp, fused, kind):
    """Four gloo ranks, tp=2 × pp=2 (with sequence parallelism the stages pass [B, S/2, H] shards): every
    gradient shard a stage holds, and the loss, are those of the tensor-parallel model run whole; for Mixtral
    with its balancing loss, the stages' router sums over every token (the split routers' logits gathered); for
    Zamba 2, whose second hybrid layer lies on the second stage, the embeddings the first stage passes on (its
    gradient coming back to the embedding) and the layer's own index (its adapter); for Gemma 4 with its last two
    layers on the second stage reusing the keys and values of two on the first, those keys and values (over the
    whole sequence under sequence parallelism, this rank's heads) and their gradients; for Mistral sliding over 3 keys
    under sequence parallelism, the second stage's masks of the whole sequence; for DeepSeek-V4, its hyper-connections'
    residual streams ([B, S(/2), 2, H]) and its heads split in output groups."""
    results = run_ranks(_pipelined, 4, sp, fused, kind, timeout=300, env=REFERENCE_KERNELS)
    norm = "final_layernorm" if kind == "zamba2" else "norm"
    assert "embed_tokens" in results[0] and "lm_head" not in results[0]
    assert "lm_head" in results[2] and "embed_tokens" not in results[2] and norm in results[2]


def test_what_it_refuses():
    from tessel.layers import hf_pipeline_stage

    with pytest.raises(TypeError, match="model must be a Hugging Face PreTrainedModel, received Linear"):
        hf_pipeline_stage(torch.nn.Linear(2, 2), 0, 1)
    tied = _model("llama", layers=2, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="ties its input and output embeddings"):
        hf_pipeline_stage(tied, 0, 2)
    model = _model("llama", layers=2)
    with pytest.raises(ValueError, match=r"num_stages must be in \[1, 2\] \(the model's decoder layers\), received 3"):
        hf_pipeline_stage(model, 0, 3)
    with pytest.raises(ValueError, match=r"stage_index must be in \[0, 2\), received 2"):
        hf_pipeline_stage(model, 2, 2)
    with pytest.raises(TypeError, match="stage_index must be an int, received bool"):
        hf_pipeline_stage(model, True, 2)
    with pytest.raises(TypeError, match="fused_loss must be a bool, received int"):
        hf_pipeline_stage(model, 0, 2, fused_loss=1)
    with pytest.raises(TypeError, match="forward_kwargs must be a dict or None, received list"):
        hf_pipeline_stage(model, 0, 2, forward_kwargs=[("deterministic", False)])
    with pytest.raises(ValueError, match=r"stage of layers \[0, 1\) is not the last"):
        hf_pipeline_stage(model, 0, 2).loss(torch.zeros(1, 2, VOCAB), torch.zeros(1, 2, dtype=torch.long))
    import transformers

    starcoder = transformers.Starcoder2ForCausalLM(transformers.Starcoder2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))  # fmt: skip
    with pytest.raises(ValueError, match=r"type llama, mistral, .* gpt_oss, .* zamba2, gpt2, .* \(a head on a base "
                                         r"model\), received Starcoder2ForCausalLM of type 'starcoder2'"):  # fmt: skip
        hf_pipeline_stage(starcoder, 0, 2)
    stage = hf_pipeline_stage(_mixture("Mixtral", output_router_logits=True), 1, 2)
    with pytest.raises(ValueError, match=r"takes the last stage's \(output, router sums\)"):
        stage.loss(torch.zeros(1, 2, VOCAB), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"expected position ids \(integers\) and router sums \(floats\)"):
        stage(torch.zeros(1, 2, 32), torch.zeros(9), torch.zeros(9))


def test_a_stage_shares_the_models_parameters_not_its_registrations():
    """A stage holds its own layers' (and the last stage the final norm's and head's) parameters, the model's
    objects themselves; a hook registered on the stage does not reach the model."""
    from tessel.layers import hf_pipeline_stage

    model = _model("llama", layers=3)
    first, last = hf_pipeline_stage(model, 0, 2), hf_pipeline_stage(model, 1, 2)
    owned = {id(p) for p in model.parameters()}
    assert all(id(p) in owned for stage in (first, last) for p in stage.parameters())
    names = {n.split(".")[1] if n.startswith("base.") else n.split(".")[0] for n, _ in last.named_parameters()}
    assert names == {"layers", "norm", "head"} and len(last.base.layers) == 1 and len(first.base.layers) == 2
    assert {n.split(".")[1] for n, _ in first.named_parameters()} == {"embed_tokens", "layers"}
    last.base.register_forward_hook(lambda *args: None)
    assert not model.model._forward_hooks and model.config.num_hidden_layers == 3


# multi-head latent attention of test_hf_experts's shape: a latent query, a dense first layer, then experts
MLA = dict(head_dim=8, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, kv_lora_rank=16, q_lora_rank=24,
           n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
           first_k_dense_replace=1, topk_group=1, num_key_value_heads=4)  # fmt: skip
# sparse attention (DeepSeek-V3.2, GLM-5): the indexer keeps 3 keys of each query's
SPARSE_MLA = {**MLA, "n_group": 1, "index_topk": 3, "index_n_heads": 2, "index_head_dim": 16}
FAMILIES = {"ministral": "Ministral", "olmo": "Olmo", "olmo2": "Olmo2", "olmo3": "Olmo3", "phi3": "Phi3", "glm": "Glm",
            "smollm3": "SmolLM3", "helium": "Helium", "exaone4": "Exaone4", "arcee": "Arcee", "seed_oss": "SeedOss",
            "ernie4_5": "Ernie4_5", "hunyuan_v1_dense": "HunYuanDenseV1", "apertus": "Apertus", "cohere": "Cohere",
            "cohere2": "Cohere2", "granite": "Granite", "gemma": "Gemma", "gemma2": "Gemma2",
            "gemma3_text": "Gemma3Text", "deepseek_v2": "DeepseekV2", "deepseek_v3": "DeepseekV3",
            "deepseek_v32": "DeepseekV32", "glm_moe_dsa": "GlmMoeDsa", "glm4_moe_lite": "Glm4MoeLite",
            "minicpm3": "MiniCPM3"}  # fmt: skip
# What a family's config takes beyond the common shape: Granite's embedding multiplier and logit scaling, Gemma 2's
# soft-capped logits (a cap the tiny model's logits reach) and eager attention
FAMILY_EXTRAS = {"granite": {"embedding_multiplier": 12.0, "logits_scaling": 4.0},
                 "gemma2": {"final_logit_softcapping": 0.5, "attn_implementation": "eager"},
                 "deepseek_v2": {**MLA, "n_group": None}, "deepseek_v3": {**MLA, "n_group": 1},
                 "glm4_moe_lite": {**MLA, "n_group": 1}, "minicpm3": MLA,
                 "deepseek_v32": SPARSE_MLA, "glm_moe_dsa": SPARSE_MLA}  # fmt: skip


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_every_supported_family_chains_to_its_logits(kind):
    """Each further family of SUPPORTED_MODEL_TYPES (those with sliding-window layers given a short window): its
    stages, chained, give the model's logits (Cohere's and Granite's scaled, Gemma 2's soft-capped, as their heads do)
    and its loss, from the logits and fused, for every split into 2 and 3; a stage leaves the model as it was."""
    import transformers

    from tessel.layers.hf_pipeline import SUPPORTED_MODEL_TYPES

    name = FAMILIES[kind]
    # no skip: a family the installed transformers lacks is one the list claims without a check
    assert hasattr(transformers, f"{name}Config"), f"transformers {transformers.__version__} has no {name}"
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=5, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, sliding_window=4, attn_implementation="sdpa")  # fmt: skip
    kw.update(FAMILY_EXTRAS.get(kind, {}))
    torch.manual_seed(0)
    head = name.removesuffix("Text")  # Gemma 3's text model: Gemma3ForCausalLM of a Gemma3TextConfig
    model = getattr(transformers, f"{head}ForCausalLM")(getattr(transformers, f"{name}Config")(**kw)).eval()
    assert model.config.model_type == kind and kind in SUPPORTED_MODEL_TYPES
    ids = torch.randint(VOCAB, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids, labels=ids)
        for n in (2, 3):
            for fused in (False, True):
                _, h, loss = _chained(model, ids, n, fused)
                if not fused:
                    torch.testing.assert_close(h, want.logits, rtol=1e-6, atol=1e-6, msg=f"{kind} in {n} stages")
                torch.testing.assert_close(loss, want.loss, rtol=1e-5, atol=1e-6, msg=f"{kind} {n} {fused} loss")
        torch.testing.assert_close(model(ids).logits, want.logits, rtol=0, atol=0)


@pytest.mark.parametrize("kind", MODELS)
def test_packed_documents_positions_travel_with_the_activations(kind):
    """Position ids restarting at each packed document: each stage but the last returns ``(hidden, positions)``, and
    the chained stages give the model's own logits for those positions (without a cache, where Hugging Face's mask
    keeps each document to itself); they differ from the unpacked logits."""
    from tessel.layers.hf_pipeline import hf_pipeline_stage

    model = _model(kind).eval()
    ids = torch.randint(VOCAB, (2, 13), generator=torch.Generator().manual_seed(4))
    positions = torch.tensor([[*range(5), *range(8)], [*range(9), *range(4)]])
    with torch.no_grad():
        want = model(ids, position_ids=positions, use_cache=False).logits
        out = (ids, positions)
        for s in range(3):
            out = hf_pipeline_stage(model, s, 3)(*out)
            assert isinstance(out, tuple) == (s < 2) and (s == 2 or out[1] is positions)
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
        assert not torch.allclose(out, model(ids).logits, atol=1e-3)


_MOE = {"num_experts": 4, "moe_intermediate_size": 24, "mlp_only_layers": []}
MIXTURES = {"mixtral": ("Mixtral", {"num_local_experts": 4}),
            "qwen2_moe": ("Qwen2Moe", {**_MOE, "shared_expert_intermediate_size": 24}),
            "qwen3_moe": ("Qwen3Moe", _MOE)}  # fmt: skip


def _mixture(name: str, **extra):
    import transformers

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, tie_word_embeddings=False, num_experts_per_tok=2,
              attn_implementation="sdpa")  # fmt: skip
    kind = next(k for k, (n, _) in MIXTURES.items() if n == name)
    torch.manual_seed(0)
    config = getattr(transformers, f"{name}Config")(**kw, **MIXTURES[kind][1], **extra)
    return getattr(transformers, f"{name}ForCausalLM")(config)


@pytest.mark.parametrize("kind", list(MIXTURES))
def test_mixtures_of_experts_chain_to_their_logits_and_gradients(kind):
    """Mixtral, Qwen2-MoE (a shared expert) and Qwen3-MoE: chained stages give the model's logits for splits into 2
    and 3, and a backward through them the model's gradients (no balancing loss)."""
    from tessel.layers.hf_pipeline import SUPPORTED_MODEL_TYPES, hf_pipeline_stage

    model = _mixture(MIXTURES[kind][0])
    assert model.config.model_type == kind and kind in SUPPORTED_MODEL_TYPES
    ids = torch.randint(VOCAB, (2, 13), generator=torch.Generator().manual_seed(6))
    want = model(ids).logits
    want.square().mean().backward()
    grads = _grads(model)
    model.zero_grad()
    for n in (2, 3):
        h = ids
        for s in range(n):
            h = hf_pipeline_stage(model, s, n)(h)
        torch.testing.assert_close(h, want, rtol=1e-5, atol=1e-6, msg=f"{kind} in {n} stages")
    h.square().mean().backward()
    for name, g in grads.items():
        torch.testing.assert_close(model.get_parameter(name).grad, g, rtol=1e-4, atol=1e-6, msg=name)


def _balanced(kind: str):
    """A tiny mixture of ``kind`` (MIXTURES here, or test_hf_router_loss's further families) training its balancing
    loss."""
    from tests.layers.test_hf_router_loss import family_model

    if kind in MIXTURES:
        return _mixture(MIXTURES[kind][0], output_router_logits=True, router_aux_loss_coef=0.5)
    return family_model(kind, layers=4, output_router_logits=True, router_aux_loss_coef=0.5)


PIPELINED_MIXTURES = [
    *MIXTURES,
    "olmoe",
    "flex_olmo",
    "phimoe",
    "ernie4_5_moe",
    "minimax",
    "minimax_m2",
    "laguna",
    "mellum",
    "granitemoe",
    "gpt_oss",
    "qwen3_next",
    "qwen3_5_moe_text",
]


@pytest.mark.parametrize("kind", PIPELINED_MIXTURES)
def test_stages_carry_the_router_sums_to_the_models_balancing_loss(kind):
    """A mixture training its balancing loss (output_router_logits): each stage adds its layers' router sums to
    those it received and passes them on; the last stage's loss is the model's own (cross entropy plus
    router_aux_loss_coef times the balancing loss of every layer), from the logits or fused, and a backward through
    the chain gives every gradient of the model's, the routers' included. With packed documents the positions
    travel beside the sums."""
    from tessel.layers.hf_pipeline import SUPPORTED_MODEL_TYPES, hf_pipeline_stage

    model = _balanced(kind)
    assert model.config.model_type == kind and kind in SUPPORTED_MODEL_TYPES
    ids = torch.randint(VOCAB, (2, 13), generator=torch.Generator().manual_seed(7))
    positions = torch.tensor([[*range(6), *range(7)], [*range(13)]])
    for packed in (False, True):
        extra = {"position_ids": positions, "use_cache": False} if packed else {}
        want = model(ids, labels=ids, **extra)
        assert want.aux_loss > 0
        want.loss.backward()
        want_grads = _grads(model)
        routers = [n for n in want_grads if ".gate." in n or "router" in n]
        assert routers, sorted(want_grads)
        for n, fused in ((2, False), (3, True)):
            model.zero_grad(set_to_none=True)
            stages = [hf_pipeline_stage(model, s, n, fused_loss=fused) for s in range(n)]
            out = (ids, positions) if packed else (ids,)
            for s, stage in enumerate(stages):
                out = stage(*out)
                assert len(out) == (2 + packed if s < n - 1 else 2) and out[-1].shape == (10,)
            if not fused:
                torch.testing.assert_close(out[0], want.logits, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(stages[-1].router_loss(out), 0.5 * want.aux_loss, rtol=1e-5, atol=1e-7)
            loss = stages[-1].loss(out, _targets(ids))
            torch.testing.assert_close(loss, want.loss, rtol=1e-5, atol=1e-6, msg=f"{kind} {n} {packed}")
            loss.backward()
            for name, g in want_grads.items():
                torch.testing.assert_close(model.get_parameter(name).grad, g, rtol=1e-4, atol=1e-6,
                                           msg=f"{kind} {n} {packed} {name}")  # fmt: skip
        model.zero_grad(set_to_none=True)


def test_forward_kwargs_reach_the_attention(monkeypatch):
    """hf_pipeline_stage(forward_kwargs=): every stage passes them to its base model's forward, which hands them to
    the attention: tessel's runs its atomic dQ backward for deterministic=False, and refuses a value not a bool."""
    import tessel.kernels.attention as attention
    from tessel.layers import hf_pipeline_stage, register_hf_attention

    calls = []
    kernel = attention.flash_attention
    spy = lambda *a, **k: calls.append(k["deterministic"]) or kernel(*a, **k)
    monkeypatch.setattr(attention, "flash_attention", spy)
    model = _model("llama", layers=2)
    model.set_attn_implementation(register_hf_attention())
    ids = torch.randint(VOCAB, (2, 7), generator=torch.Generator().manual_seed(8))
    for kwargs, want in ((None, True), ({"deterministic": False}, False)):
        calls.clear()
        first, last = (hf_pipeline_stage(model, s, 2, forward_kwargs=kwargs) for s in range(2))
        last.loss(last(first(ids)), _targets(ids)).backward()
        assert calls == [want, want]
    with pytest.raises(TypeError, match="tessel attention: deterministic must be a bool, received int"):
        hf_pipeline_stage(model, 0, 2, forward_kwargs={"deterministic": 0})(ids)


def _context_split(rank, world_size):
    """cp=2 × tp=2 with the sequence split over both: the stages of the model know the ring's size, and each later
    stage's base model takes the whole sequence's positions beside hidden states split over the tensor-parallel
    ranks as well (the model's hook accepts them, and checks them)."""
    from tessel.layers import hf_pipeline_stage, parallelize
    from tessel.layers.hf_context import packed_positions
    from tests.layers.test_context_parallel import _grid

    solo, tp, cp = _grid(rank, world_size, 2)
    plain = parallelize(_model("llama", layers=2), solo, cp_group=cp)
    assert hf_pipeline_stage(plain, 1, 2).cp_size == 2
    split = parallelize(_model("llama", layers=2), tp, sequence_parallel=True, cp_group=cp)
    stage = hf_pipeline_stage(split, 1, 2)
    assert stage.cp_size == 2 and stage.sequence_parallel
    hidden = torch.zeros(2, 4, 32)  # [B, S/(c·t), H] of S = 16
    positions = torch.tensor([[*range(5), *range(11)]])
    whole, documents = packed_positions(positions, hidden, 2, split=2)
    assert whole is positions and documents.tolist() == [[0] * 5 + [1] * 11] * 2
    with pytest.raises(ValueError, match=r"position_ids must be the whole sequence's integer positions \[2 or 1, 8\]"):
        packed_positions(positions, hidden, 2)  # without the split: 8 positions expected
    with pytest.raises(ValueError, match=r"\[2 or 1, 8 or 16\] .* received torch.int64 tensor of shape \[1, 12\]"):
        packed_positions(positions[:, :12], hidden, 2, split=2)
    return "ok"


@pytest.mark.multiprocess
def test_context_parallel_stages_under_sequence_parallelism():
    assert run_ranks(_context_split, 4, timeout=240, env=REFERENCE_KERNELS) == ["ok"] * 4


_LINEAR = dict(layer_types=["linear_attention", "full_attention"] * 2, linear_key_head_dim=8, linear_value_head_dim=8,
               linear_num_key_heads=2, linear_num_value_heads=4)  # fmt: skip
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_expand=2, mamba_chunk_size=4)
# Hybrids whose layers mix tokens by linear attention, state spaces or short convolutions between attention layers,
# four layers of alternating kinds each (their configs' layer types, stored or computed from attention indices, a
# period and an offset)
HYBRIDS = {"qwen3_5_text": _LINEAR, "qwen3_next": {**_LINEAR, "num_experts": 4, "num_experts_per_tok": 2,
                                                   "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16},
           "qwen3_5_moe_text": {**_LINEAR, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                "shared_expert_intermediate_size": 16},
           "olmo_hybrid": _LINEAR, "bamba": {**_MAMBA2, "attn_layer_indices": [1, 3]},
           "granitemoehybrid": {**_MAMBA2, "layer_types": ["mamba", "attention"] * 2, "num_local_experts": 4,
                                "num_experts_per_tok": 2, "shared_intermediate_size": 16},
           "falcon_h1": {**_MAMBA2, "mamba_d_ssm": 64, "mamba_rms_norm": True, "lm_head_multiplier": 2.0,
                         "embedding_multiplier": 3.0},
           "nemotron_h": {"layers_block_type": ["mamba", "attention", "mamba", "mlp"], "mamba_num_heads": 4,
                          "mamba_head_dim": 8, "n_groups": 1, "ssm_state_size": 8, "chunk_size": 4},
           "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
                     "num_experts": 4, "num_experts_per_tok": 2, "mamba_d_state": 8, "mamba_dt_rank": 4},
           "lfm2": {"layer_types": ["conv", "full_attention"] * 2, "block_auto_adjust_ff_dim": False},
           # Kimi Delta Attention, then multi-head latent attention (kv heads as many as the heads), twice
           "kimi_linear": {"num_key_value_heads": 4, "linear_attn_config": {
               "kda_layers": [1, 3], "full_attn_layers": [2, 4], "head_dim": 8, "num_heads": 4,
               "short_conv_kernel_size": 4}},
           # Bailing's: the delta attention with full-rank gates, then latent attention with a gate per head, twice
           "bailing_hybrid": {"num_key_value_heads": 4, "layer_group_size": 2},
           "zamba2": {"n_mamba_heads": 4, "mamba_headdim": 16, "mamba_ngroups": 2, "mamba_d_state": 8,
                      "chunk_size": 4, "layers_block_type": ["mamba", "hybrid"] * 2, "adapter_rank": 8}}  # fmt: skip


@pytest.mark.parametrize("kind", list(HYBRIDS))
def test_hybrids_chain_to_their_logits_and_gradients(kind):
    """Each hybrid of SUPPORTED_MODEL_TYPES: its stages, chained, give the model's logits (Falcon-H1's multiplied by
    its lm_head_multiplier, its embeddings by its embedding_multiplier once), its loss, from the logits and fused, and
    its gradients, for every split into 2 and 3 (a stage's layers keep their kinds: Bamba's attention indices and
    Jamba's offsets are those of its layers; Nemotron-H's final norm is norm_f, LFM2's embedding_norm)."""
    import transformers

    from tessel.layers.hf_pipeline import SUPPORTED_MODEL_TYPES

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, tie_word_embeddings=False, pad_token_id=0,
              attn_implementation="eager")  # fmt: skip
    kw.update(HYBRIDS[kind])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(kind, **kw)).eval()
    assert model.config.model_type == kind and kind in SUPPORTED_MODEL_TYPES
    ids = torch.randint(VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    check_stages(model, ids, kind, logits_atol=1e-5)


@pytest.mark.parametrize("variant", ["per-layer inputs", "experts beside the MLP", "keys and values shared"])
def test_gemma4_stages_pass_the_later_layers_per_layer_inputs_on(variant):
    """Gemma 4: the first stage computes every layer's per-layer input (from the token ids and their embeddings),
    keeps its layers' and passes the rest on beside the activation; each later stage keeps its own. Chained in 2 and
    3 stages: the model's logits, loss and every gradient (the per-layer embedding's and projection's through the
    inputs the later stages received). Where the last layers reuse the keys and values of earlier ones, a stage
    passes on those a later stage reuses: stored by the first stage or by a middle one, passed through a stage that
    does not reuse them, the storing layers' key and value projections trained by every layer that reads them."""
    import transformers

    from tessel.layers import hf_pipeline_stage
    from tests.layers.test_hf_families import GEMMA4_VARIANTS

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, global_head_dim=16, tie_word_embeddings=False, pad_token_id=0,
              vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, sliding_window=5,
              attn_implementation="eager")  # fmt: skip
    kw.update(GEMMA4_VARIANTS[variant])
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("gemma4_text", **kw)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    layers = config.num_hidden_layers
    ids = torch.randint(VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    want_grads, splits = check_stages(model, ids, variant, logits_atol=1e-5)
    assert any("per_layer" in name for name in want_grads)
    for n in (2, 3):
        first = hf_pipeline_stage(model, 0, n)
        hidden, later, *kv = first(ids)  # the later layers' per-layer inputs, beside the activation
        assert later.shape == (2, 12, layers - first.stop, 8) and hidden.shape == (2, 12, 32)
        assert len(kv) == 2 * len(first.kv_out)
        later_names = [name for name, _ in hf_pipeline_stage(model, n - 1, n).named_parameters()]
        assert not any("per_layer_model" in name or "embed_tokens" in name for name in later_names)  # the first's
    if variant != "keys and values shared":
        return
    assert [s for n, fused, s in splits if not fused] == [[(0, 3), (3, 5)], [(0, 2), (2, 4), (4, 5)]]
    # layer 1 stores the full-attention layers' keys and values, layer 2 the sliding ones': what each stage receives
    # and passes on (the middle of three passes the full ones through)
    stages = {n: [hf_pipeline_stage(model, i, n) for i in range(n)] for n in (2, 3)}
    assert [(s.kv_in, s.kv_out) for s in stages[2]] == [((), ("full_attention", "sliding_attention")),
                                                        (("full_attention", "sliding_attention"), ())]  # fmt: skip
    assert [(s.kv_in, s.kv_out) for s in stages[3]] == [
        ((), ("full_attention",)),
        (("full_attention",), ("full_attention",)),
        (("full_attention",), ()),
    ]
    hidden, later, k, v = stages[3][1](*stages[3][0](ids))
    assert k.shape == v.shape == (2, 2, 12, 16)  # the full-attention layers' heads (their width)
    for name in ("k_proj", "v_proj"):  # the reusing layers' share of the storing layers' gradients reached them
        assert want_grads[f"model.layers.1.self_attn.{name}.weight"].abs().sum() > 0
        assert f"model.layers.4.self_attn.{name}.weight" not in want_grads
    every = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("gemma4_text", **{**kw, "num_kv_shared_layers": layers})
    )
    with pytest.raises(ValueError, match=r"every one of Gemma4ForCausalLM's layers reuses keys and values"):
        hf_pipeline_stage(every, 0, 2)
