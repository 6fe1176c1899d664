"""Hugging Face Llama, Mistral and Qwen2 (tiny configs, random init, no downloads) through ``parallelize``
and through tessel's flash attention.

Tensor parallel: every rank builds the same dense model from one seed, parallelizes a deep copy, and
compares the logits (gathered over the vocabulary by the ``colwise_gather_output`` lm_head) and every
parameter's gradient shard with the dense model's. Tolerances: fp32 throughout; the parallel model sums
the row layers' partial products across ranks in another order, differences of a few ulps that grow
through two layers to ~1e-6 relative; checked at 1e-4 relative (issue 4).

The ranks run tessel's kernels through their plain-PyTorch references (``TRITON_INTERPRET=0``): the
Triton kernels are proven against the same references in tests/kernels, and what is under test here
is the sharding and the communication; the interpreter would add ~7 s per model and pass. The flash
attention test runs the Triton kernel (through the interpreter on a CPU).

Each multi-rank test imports transformers once per rank and runs every model inside one spawn.
"""

import copy
import importlib.util
import subprocess
import sys

import pytest
import torch

from tests.multiprocess import REFERENCE_KERNELS, run_ranks

B, S, VOCAB = 2, 8, 128  # S divisible by 2 and 4 (sequence parallelism)
# transformers is a test extra; find_spec does not import it (that takes seconds)
needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")


def _close(got, want, msg=None):
    """1e-4 relative, with the absolute floor scaled to the tensor: gradients such as the embedding's span
    four orders of magnitude (max ~75, entries ~1e-2), and fp32 reordering errs ~1e-6 of the largest."""
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * max(want.abs().max().item(), 1.0), msg=msg)


def _model(family, kv_heads=2, seed=0, **kw):
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),  # per-head q/k norms
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),  # (1 + weight) norms
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),  # soft-capped logits
    }[family]
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=kv_heads, head_dim=16, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(seed)
    return model_cls(config_cls(**{**base, **kw}))


def _gemma2(head_dim=16):
    """A tiny Gemma 2: a window of 3 in every other layer, logits soft-capped at 0.5, with the query and key
    projections scaled up so that the cap bends the logits (a random init's are ~0.005, ~0.5 after)."""
    model = _model("gemma2", head_dim=head_dim, attn_logit_softcapping=0.5, sliding_window=3)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(10)
            layer.self_attn.k_proj.weight.mul_(10)
    return model


def _batch(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(VOCAB, (B, S), generator=gen), torch.randn(B, S, VOCAB, generator=gen)


def _forward_backward(model, ids, weights, **kw):
    out = model(ids, **kw)
    logits = out.logits if hasattr(out, "logits") else out.last_hidden_state
    (logits * weights[..., : logits.shape[-1]]).sum().backward()  # every output gets its own random gradient
    return logits.detach()


def _check_against_dense(dense, par, tag, **kw):
    """par (parallelized) and dense on the same batch: logits, and each grad shard against the dense grad."""
    from tessel.parallel.sharding import shard_like

    ids, weights = _batch()
    want = _forward_backward(dense, ids, weights, **kw)
    got = _forward_backward(par, ids, weights, **kw)
    _close(got, want, msg=lambda m: f"{tag} logits: {m}")
    dense_params = dict(dense.named_parameters())
    for name, p in par.named_parameters():
        if not p.requires_grad:  # frozen (ERNIE's routing bias): no gradient on either side, the same values
            assert p.grad is None and torch.equal(p, dense_params[name]), f"{tag} {name}"
            continue
        if dense_params[name].grad is None:  # one the forward does not reach (Zamba 2's adapter of another layer)
            assert p.grad is None, f"{tag} {name}: a gradient where the dense model has none"
            continue
        full = dense_params[name].grad  # GPT-2's Conv1D [in, out], split as the nn.Linear [out, in] it computes
        expected = shard_like(full.t() if getattr(p, "hf_transposed", False) else full, p, None)
        _close(p.grad, expected, msg=lambda m, name=name: f"{tag} grad of {name}: {m}")


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model, before, types):
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    assert [type(m) for m in model.modules()] == types


# ---------------------------------------------------------------------------------------------------- tensor parallel


def _two_ranks(rank, world_size):
    from tessel.layers.hf import register_hf_attention
    from tessel.layers.norm import RMSNorm
    from tessel.layers.parallelize import parallelize

    for family in ("llama", "mistral", "qwen2", "qwen3", "gemma"):
        for sp in (False, True):
            dense = _model(family)
            par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp)
            _check_against_dense(dense, par, f"{family} sp={sp}")
            # under SP the norms run on sequence shards: tessel's RMSNorm, or Gemma's own (1 + weight) norm,
            # which tessel's kernel does not compute, with its weight gradients reduced over the ranks
            is_tessel_norm = isinstance(par.model.layers[1].post_attention_layernorm, RMSNorm)
            assert is_tessel_norm == (sp and family != "gemma")
    # under SP each block's column projections (q/k/v; gate/up) run as ONE overlapped all-gather ring:
    # one ring per block, two per layer; three or two rings per block would mean a ring per projection
    from tessel.parallel.comm import record_events

    for family in ("llama", "qwen3"):
        dense = _model(family)
        par = parallelize(copy.deepcopy(dense), None, sequence_parallel=True, overlap=True)
        with record_events() as log:
            par(_batch()[0])
        rings = [e for e in log.events if e[:2] == ("send", "all_gather_matmul")]
        assert len(rings) == 2 * 2 * (world_size - 1), log.events
        _check_against_dense(dense, par, f"{family} sp ring")
    # a block that computes with its input before projecting it is refused rather than fed the placeholder
    par = parallelize(_model("llama"), None, sequence_parallel=True, overlap=True)
    mlp = par.model.layers[1].mlp
    mlp.forward = lambda x, forward=mlp.forward: forward(x * 1.0)
    with pytest.raises(ValueError, match=r"projections of model.layers.1.mlp read the sequence shard"):
        par(_batch()[0])
    # a base model (no lm_head): its last hidden state is gathered whole
    dense = _model("llama").model
    _check_against_dense(dense, parallelize(copy.deepcopy(dense), None, sequence_parallel=True), "LlamaModel")
    # tessel's attention on the local heads, inside a sequence-parallel model
    register_hf_attention()
    dense = _model("llama", attn_implementation="tessel")
    _check_against_dense(dense, parallelize(copy.deepcopy(dense), None, sequence_parallel=True), "llama+tessel")
    # tied embeddings stay tied: both are split over the vocabulary
    dense = _model("qwen2", tie_word_embeddings=True)
    par = parallelize(copy.deepcopy(dense), None)
    assert par.lm_head.weight is par.model.embed_tokens.weight
    _check_against_dense(dense, par, "qwen2 tied")
    # a user plan: only the MLPs
    mlp_only = {"model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
                "model.layers.*.mlp.down_proj": "rowwise"}  # fmt: skip
    dense = _model("mistral")
    par = parallelize(copy.deepcopy(dense), None, plan=mlp_only)
    assert type(par.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert par.model.layers[1].mlp.down_proj.weight.shape == (64, 48)
    _check_against_dense(dense, par, "mistral mlp-only")
    # ... which cannot run sequence-parallel: the attention would receive a sequence shard
    before, types = _state(dense), [type(m) for m in dense.modules()]
    with pytest.raises(ValueError, match=r"plan splits nothing in model.layers.0.self_attn \(MistralAttention\)"):
        parallelize(dense, None, plan=mlp_only, sequence_parallel=True)
    _assert_unchanged(dense, before, types)
    # sequence lengths that do not split
    par = parallelize(_model("llama"), None, sequence_parallel=True)
    with pytest.raises(ValueError, match="seq divisible by the tensor-parallel size 2, received"):
        par(torch.zeros(1, 7, dtype=torch.long))
    # GPT-OSS's attention sinks (one per query head) follow their heads, under its eager attention and
    # tessel's; the mixture of experts stays whole (a plan of the attention only)
    attention_plan = {f"model.layers.*.self_attn.{n}": "colwise" for n in ("q_proj", "k_proj", "v_proj")}
    attention_plan["model.layers.*.self_attn.o_proj"] = "rowwise"
    dense = _gpt_oss()
    for impl in ("eager", "tessel"):
        par = parallelize(copy.deepcopy(dense), None, plan=attention_plan)
        par.set_attn_implementation(impl)
        sinks, whole = par.model.layers[0].self_attn.sinks, dense.model.layers[0].self_attn.sinks
        assert sinks.shape == (2,) and torch.equal(sinks, whole[2 * rank : 2 * rank + 2])
        dense.zero_grad()
        _check_against_dense(dense, par, f"gpt-oss {impl}")
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_hf_models_match_dense_on_two_ranks():
    assert run_ranks(_two_ranks, 2, timeout=300, env=REFERENCE_KERNELS) == ["ok", "ok"]


def _four_ranks(rank, world_size):
    from tessel.layers.parallelize import parallelize

    for family in ("llama", "mistral", "qwen2"):
        for sp in (False, True):
            dense = _model(family, kv_heads=4)
            par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp, overlap=sp or "auto")
            _check_against_dense(dense, par, f"{family} sp={sp}")  # under SP: the overlapped rings
    bad = [
        # 2 query heads: fewer than the ranks (kv heads are replicated, query heads never)
        (
            _model("llama", kv_heads=2, num_attention_heads=2, head_dim=32),
            None,
            r"q_proj: 2 heads \(width 64, head_dim 32\) do not split over 4",
        ),
        (_model("qwen2", kv_heads=4, intermediate_size=90), None, r"gate_proj .*out_features 90 .* not divisible"),
        (_model("mistral", kv_heads=4), {"model.layers.*.mlp.up_proj": "colwise_sideways"}, "unknown style"),
        (_model("llama", kv_heads=4), {"model.layers.*.attn.q_proj": "colwise"}, "matches no module"),
        (_model("llama", kv_heads=4), {"model.layers.*.mlp.up_proj.weight": "colwise"}, "names a parameter"),
        (_model("llama", kv_heads=4), {"model.*.mlp.up_proj": "colwise"}, "matches no module"),  # * is one segment
        (_model("llama", kv_heads=4), {"model.layers.*.mlp.up_proj": "grouped_gemm"}, "not supported by tessel"),
        (_model("llama", kv_heads=4), {"model.layers.*.mlp.up_proj": "moe_tp_experts"}, "expected 3-d expert param"),
        (_model("llama", kv_heads=4), {"model.layers.*.mlp": "colwise"}, "expected an nn.Linear"),
    ]
    for model, plan, match in bad:
        before, types = _state(model), [type(m) for m in model.modules()]
        for sp in (False, True):
            with pytest.raises(ValueError, match=match):
                parallelize(model, None, plan=plan, sequence_parallel=sp)
            _assert_unchanged(model, before, types)
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_hf_models_match_dense_on_four_ranks_and_bad_plans_change_nothing():
    assert run_ranks(_four_ranks, 4, timeout=300, env=REFERENCE_KERNELS) == ["ok"] * 4


# ---------------------------------------------------------------------------------------------------- attention


@needs_hf
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_tessel_attention_matches_eager_and_sdpa(family, monkeypatch):
    import tessel.kernels.attention as attention
    from tessel.layers.hf import register_hf_attention

    assert register_hf_attention() == register_hf_attention() == "tessel"  # idempotent
    calls = []
    kernel = attention.flash_attention
    monkeypatch.setattr(attention, "flash_attention", lambda *a, **k: calls.append(k) or kernel(*a, **k))
    model = _model(family, num_hidden_layers=1)
    ids, weights = _batch()
    results = {}
    for impl, kw in (("eager", {}), ("sdpa", {}), ("tessel", {}), ("tessel-atomic", {"deterministic": False})):
        model.set_attn_implementation(impl.split("-")[0])
        model.zero_grad()
        logits = _forward_backward(model, ids, weights, **kw)
        results[impl] = logits, {n: p.grad.clone() for n, p in model.named_parameters()}
    # the kernel ran (forward), causal, 1/sqrt(16), its backward the call's (Hugging Face's flash keyword)
    assert calls == [{"causal": True, "scale": 0.25, "deterministic": d} for d in (True, False)]
    # fp32: the kernel's online softmax and block-wise sums reorder the additions (~1e-6 relative)
    for impl in ("eager", "sdpa", "tessel-atomic"):
        _close(results["tessel"][0], results[impl][0])
        for name, grad in results["tessel"][1].items():
            _close(grad, results[impl][1][name], msg=lambda m, n=name: f"{n}: {m}")


@needs_hf
def test_decoding_with_a_cache_runs_the_kernel_one_query_at_a_time(monkeypatch):
    from tessel.layers.hf import register_hf_attention

    register_hf_attention()
    calls = _spy_on_kernel(monkeypatch)
    model = _model("llama", num_hidden_layers=2).eval()
    prompt = _batch()[0][:, :5]
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        want = model.generate(
            prompt, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        model.set_attn_implementation("tessel")
        got = model.generate(
            prompt, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    # the prompt at full length, then 3 steps of one query over a growing cache, in each of the 2 layers
    lengths = [c[:2] for c in calls]
    assert lengths == [(5, 5)] * 2 + [(1, 6)] * 2 + [(1, 7)] * 2 + [(1, 8)] * 2
    assert torch.equal(got.sequences, want.sequences)
    for step, (g, w) in enumerate(zip(got.logits, want.logits)):
        _close(g, w, msg=lambda m, step=step: f"decoding step {step}: {m}")


PADDINGS = {  # attention_mask rows of B=2, S=8
    "left": [[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8],
    "right": [[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0]],
    "both rows": [[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0, 0]],
}


def _spy_on_kernel(monkeypatch):
    import tessel.kernels.attention as attention

    calls = []
    kernel = attention.flash_attention
    monkeypatch.setattr(attention, "flash_attention", lambda q, k, v, **kw: calls.append((q.shape[2], k.shape[2], kw))
                        or kernel(q, k, v, **kw))  # fmt: skip
    return calls


@needs_hf
@pytest.mark.parametrize("padding", list(PADDINGS))
@pytest.mark.parametrize("family, kw", [("llama", {}), ("mistral", dict(sliding_window=3)), ("qwen2", {})],
                         ids=["llama", "mistral-window", "qwen2"])  # fmt: skip
def test_padded_batches_run_the_kernel(monkeypatch, family, kw, padding):
    """A padded fine-tuning batch: Hugging Face's mask hides the padding keys from every query; the kernel runs
    with ids for queries and keys, and the logits (at every position: a left-padding query that sees nothing
    gives 0 in both) and every gradient are sdpa's; the real positions' logits are eager's too."""
    from tessel.layers.hf import register_hf_attention

    register_hf_attention()
    calls = _spy_on_kernel(monkeypatch)
    model = _model(family, num_hidden_layers=2, **kw)
    ids, weights = _batch()
    mask = torch.tensor(PADDINGS[padding])
    results = {}
    for impl in ("eager", "sdpa", "tessel"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        logits = _forward_backward(model, ids, weights * mask[..., None], attention_mask=mask)
        results[impl] = logits, {n: p.grad.clone() for n, p in model.named_parameters()}
    assert len(calls) == 2 and all(isinstance(c[2].get("segment_ids"), tuple) for c in calls), calls
    assert all(c[2].get("window") == kw.get("sliding_window") for c in calls)
    _close(results["tessel"][0], results["sdpa"][0])
    _close(results["tessel"][0][mask.bool()], results["eager"][0][mask.bool()])
    for name, grad in results["tessel"][1].items():
        _close(grad, results["sdpa"][1][name], msg=lambda m, n=name: f"{n}: {m}")


@needs_hf
def test_masks_the_ids_do_not_express_fall_back_to_sdpa(monkeypatch):
    """A padding hole inside a row (a key hidden from every query between real ones): sdpa computes it."""
    import tessel.kernels.attention as attention
    from tessel.layers.hf import register_hf_attention

    register_hf_attention()
    monkeypatch.setattr(attention, "flash_attention", lambda *a, **k: pytest.fail("the kernel ran a hole in a row"))
    model = _model("llama", num_hidden_layers=1)
    ids, _ = _batch()
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, 3] = 0
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        want = model(ids, attention_mask=mask).logits
        model.set_attn_implementation("tessel")
        got = model(ids, attention_mask=mask).logits
    _close(got, want)


@needs_hf
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=["no-grad", "inference-mode"])
@pytest.mark.parametrize("family, kw", [("llama", {}), ("mistral", dict(sliding_window=3))], ids=["llama", "window"])
def test_batched_generation_with_left_padding_runs_the_kernel(monkeypatch, family, kw, mode):
    """generate() on a left-padded batch: the prompt and every decoding step run the kernel (the steps with ids
    for the query and the cache's keys, or a slice of the cache where every row sees the same last keys);
    the tokens and the logits of every step are sdpa's. Under inference mode too, where nothing read from
    a mask is kept on it (no version counter) and each layer reads it again."""
    from tessel.layers.hf import register_hf_attention

    register_hf_attention()
    calls = _spy_on_kernel(monkeypatch)
    model = _model(family, num_hidden_layers=2, **kw).eval()
    prompt = _batch()[0][:, :6]
    mask = torch.ones_like(prompt)
    mask[0, :2] = 0
    out = {}
    with mode():
        for impl in ("sdpa", "tessel"):
            model.set_attn_implementation(impl)
            out[impl] = model.generate(prompt, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                       output_logits=True, return_dict_in_generate=True)  # fmt: skip
    assert [c[0] for c in calls] == [6] * 2 + [1] * 6  # the prompt, then 3 steps, in each of the 2 layers
    assert torch.equal(out["tessel"].sequences, out["sdpa"].sequences)
    for step, (g, w) in enumerate(zip(out["tessel"].logits, out["sdpa"].logits)):
        _close(g, w, msg=lambda m, step=step: f"decoding step {step}: {m}")


def _eager_and_tessel(model, padding):
    """{impl: (the logits of the real tokens, every parameter's gradient)} of one forward and backward of the
    batch (padded as ``PADDINGS[padding]``, or not) under eager attention and under tessel's."""
    ids, weights = _batch()
    mask = torch.tensor(PADDINGS[padding] if padding else [[1] * S] * B)
    results = {}
    for impl in ("eager", "tessel"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        logits = _forward_backward(model, ids, weights * mask[..., None], attention_mask=mask)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[impl] = logits[mask.bool()], grads
    return results


def _gpt_oss():
    """A tiny GPT-OSS: attention sinks (a learned logit per head, drawn here), a window of 3 in the first layer."""
    import transformers

    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=3,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()
    return model


@needs_hf
@pytest.mark.parametrize("padding", [None, "both rows"], ids=["unpadded", "padded"])
def test_attention_sinks_run_the_kernel(monkeypatch, padding):
    """GPT-OSS's sinks join each row's softmax: the kernel's output is rescaled by its log-sum-exp, and the
    logits and every gradient (the sinks' too) are those of GPT-OSS's own eager attention."""
    from tessel.layers.hf import register_hf_attention

    register_hf_attention()
    calls = _spy_on_kernel(monkeypatch)
    results = _eager_and_tessel(_gpt_oss(), padding)
    assert [c[2].get("window") for c in calls] == [3, None] and all(c[2]["return_lse"] for c in calls)
    _close(results["tessel"][0], results["eager"][0])
    assert any("sinks" in name for name in results["tessel"][1])
    for name, grad in results["tessel"][1].items():
        _close(grad, results["eager"][1][name], msg=lambda m, n=name: f"{n}: {m}")


@needs_hf
def test_attention_sinks_in_generation_and_in_the_eager_fallback(monkeypatch):
    """Decoding with sinks runs the kernel at every step; a mask the ids do not express (a hole in a row) runs
    GPT-OSS's eager attention with the additive mask it expects (sdpa cannot take sinks)."""
    from tessel.layers.hf import register_hf_attention

    register_hf_attention()
    calls = _spy_on_kernel(monkeypatch)
    model = _gpt_oss().eval()
    prompt = _batch()[0][:, :6]
    out = {}
    with torch.no_grad():
        for impl in ("eager", "tessel"):
            model.set_attn_implementation(impl)
            out[impl] = model.generate(prompt, max_new_tokens=4, do_sample=False, output_logits=True,
                                       return_dict_in_generate=True)  # fmt: skip
        assert [c[0] for c in calls] == [6] * 2 + [1] * 6
        assert torch.equal(out["tessel"].sequences, out["eager"].sequences)
        for step, (g, w) in enumerate(zip(out["tessel"].logits, out["eager"].logits)):
            _close(g, w, msg=lambda m, step=step: f"decoding step {step}: {m}")
        hole = torch.ones(B, S, dtype=torch.long)
        hole[0, 4] = 0
        calls.clear()
        logits = {}
        for impl in ("eager", "tessel"):
            model.set_attn_implementation(impl)
            logits[impl] = model(_batch()[0], attention_mask=hole).logits
    assert calls == []  # both layers' masks hold the hole
    _close(logits["tessel"], logits["eager"])


@needs_hf
@pytest.mark.parametrize("family, padding", [("llama-head24", None), ("llama-head80", "left"), ("deepseek_v3", None),
                                             ("deepseek_v3", "left")])  # fmt: skip
def test_head_dims_the_kernel_lacks_are_widened_with_zeros(monkeypatch, family, padding):
    """Head dims of 24 and 80 (queries, keys and values), and multi-head latent attention's values of 8 dims beside
    queries and keys of 16 (DeepSeek-V3), run the kernel at the next head dim it takes (32, 128, 16): zeros add
    nothing to q·k, the values' zero columns give output columns that are cut off, and the scale stays the
    model's. Logits and gradients are eager attention's."""
    from tessel.layers.hf import register_hf_attention
    from tests.layers.test_hf_experts import _moe

    register_hf_attention()
    calls = []
    import tessel.kernels.attention as attention

    kernel = attention.flash_attention
    monkeypatch.setattr(attention, "flash_attention", lambda q, k, v, **kw: calls.append((q.shape[-1], v.shape[-1],
                        kw["scale"])) or kernel(q, k, v, **kw))  # fmt: skip
    head_dim = {"llama-head24": 24, "llama-head80": 80}.get(family)
    model = _moe("deepseek_v3") if family == "deepseek_v3" else _model("llama", num_hidden_layers=1, head_dim=head_dim)
    results = _eager_and_tessel(model, padding)
    width, scale = {"llama-head24": (32, 24**-0.5), "llama-head80": (128, 80**-0.5)}.get(family, (16, 16**-0.5))
    assert calls and all(c[:2] == (width, width) and c[2] == pytest.approx(scale) for c in calls), calls
    _close(results["tessel"][0], results["eager"][0])
    for name, grad in results["tessel"][1].items():
        _close(grad, results["eager"][1][name], msg=lambda m, n=name: f"{n}: {m}")


@needs_hf
@pytest.mark.parametrize("padding, head_dim", [(None, 16), ("left", 16), (None, 256)],
                         ids=["unpadded", "padded", "head-dim-256"])  # fmt: skip
def test_soft_capped_logits_run_the_kernel(monkeypatch, padding, head_dim):
    """Gemma 2 soft-caps its attention logits (c·tanh(s/c)), which sdpa refuses: the kernel runs them with
    ``softcap``, at Gemma 2's real head dim of 256 too; logits and gradients are those of Gemma 2's eager
    attention."""
    from tessel.layers.hf import register_hf_attention

    register_hf_attention()
    calls = _spy_on_kernel(monkeypatch)
    results = _eager_and_tessel(_gemma2(head_dim), padding)
    kernel_calls = [(0.5, 3), (0.5, None)]
    assert [(c[2].get("softcap"), c[2].get("window")) for c in calls] == kernel_calls
    _close(results["tessel"][0], results["eager"][0])
    for name, grad in results["tessel"][1].items():
        _close(grad, results["eager"][1][name], msg=lambda m, n=name: f"{n}: {m}")


@needs_hf
@pytest.mark.gpu
@pytest.mark.parametrize("padding", [None, "both rows"], ids=["unpadded", "padded"])
def test_tessel_attention_in_bf16_on_cuda(padding):
    from tessel.layers.hf import register_hf_attention

    register_hf_attention()
    model = _model("llama", num_hidden_layers=1).to("cuda", torch.bfloat16)
    ids, weights = (t.cuda() for t in _batch())
    mask = torch.tensor(PADDINGS[padding] if padding else [[1] * S] * B, device="cuda")
    kw = dict(attention_mask=mask) if padding else {}
    results = {}
    for impl in ("sdpa", "tessel"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        logits = _forward_backward(model, ids, (weights * mask[..., None]).bfloat16(), **kw)
        real = logits[mask.bool()].float()  # what CUDA's sdpa gives a query that sees nothing is its own choice
        results[impl] = real, model.model.layers[0].self_attn.q_proj.weight.grad.float()
    # bf16 (8-bit mantissa): both kernels round P to bf16 before P·V, in different blocks; 2e-2 of the max
    for got, want in zip(results["tessel"], results["sdpa"]):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_tessel_layers_import_without_transformers():
    code = ("import sys; sys.modules['transformers'] = None; "
            "import tessel.layers, tessel.layers.hf, tessel.layers.parallelize")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@needs_hf
def test_decoding_past_a_sliding_window_runs_the_kernel_over_the_window(monkeypatch):
    """Mistral with a window of 3, decoding past it: each step's mask holds the cache's last keys, which the
    kernel reads as a slice of the cache; the tokens and logits are sdpa's."""
    from tessel.layers.hf import register_hf_attention

    register_hf_attention()
    calls = _spy_on_kernel(monkeypatch)
    model = _model("mistral", num_hidden_layers=2, sliding_window=3).eval()
    prompt = _batch()[0][:, :5]
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        want = model.generate(prompt, max_new_tokens=4, do_sample=False, output_logits=True,
                              return_dict_in_generate=True)  # fmt: skip
        model.set_attn_implementation("tessel")
        got = model.generate(prompt, max_new_tokens=4, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)  # fmt: skip
    lengths = [c[:2] for c in calls]
    assert lengths[:2] == [(5, 5)] * 2 and all(q == 1 and k <= 3 for q, k in lengths[2:]) and len(lengths) == 8
    assert torch.equal(got.sequences, want.sequences)
    for step, (g, w) in enumerate(zip(got.logits, want.logits)):
        _close(g, w, msg=lambda m, step=step: f"decoding step {step}: {m}")


@needs_hf
@pytest.mark.parametrize("family, kw", [("llama", {}), ("mistral", dict(sliding_window=3))], ids=["llama", "window"])
def test_queries_over_a_cache_run_the_kernel(monkeypatch, family, kw):
    """A chunk of 3 tokens after a cached prompt of 5 (chunked prefill, speculative tokens): Hugging Face's
    mask is the causal mask aligned to the chunk's positions (in Mistral's window), which the kernel runs
    with its bottom-right causal mask; a padded prompt's too, with ids for the queries and the keys."""
    from tessel.layers.hf import register_hf_attention

    register_hf_attention()
    calls = _spy_on_kernel(monkeypatch)
    model = _model(family, num_hidden_layers=2, **kw).eval()
    ids = _batch()[0]
    logits = {}
    with torch.no_grad():
        for impl in ("sdpa", "tessel"):
            model.set_attn_implementation(impl)
            cache = model(ids[:, :5], use_cache=True).past_key_values
            logits[impl] = model(ids[:, 5:8], past_key_values=cache, use_cache=True).logits
    window = kw.get("sliding_window")
    # Mistral's cache keeps only the window's last keys: the chunk sees 2 cached ones and itself
    seen = [(c[0], c[1], c[2].get("window")) for c in calls]
    assert seen == [(5, 5, window)] * 2 + [(3, 8 if window is None else 5, window)] * 2
    _close(logits["tessel"], logits["sdpa"])
    # a padded batch's prompt and chunk: the kernel runs both, with ids for the queries and the keys
    mask = torch.ones(B, 8, dtype=torch.long)
    mask[0, 0] = 0
    for impl in ("sdpa", "tessel"):
        model.set_attn_implementation(impl)
        calls.clear()
        with torch.no_grad():
            cache = model(ids[:, :5], attention_mask=mask[:, :5], use_cache=True).past_key_values
            logits[impl] = model(ids[:, 5:8], attention_mask=mask, past_key_values=cache, use_cache=True).logits
    assert [c[0] for c in calls] == [5, 5, 3, 3]
    _close(logits["tessel"], logits["sdpa"])
