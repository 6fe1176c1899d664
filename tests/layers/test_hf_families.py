"""``parallelize`` across Hugging Face families beyond Llama: each tiny model (random init, built from its
config class through the Auto classes) dense against parallelized on 2 gloo ranks, with and without sequence
parallelism: logits and every gradient shard (fp32, 1e-4 relative, as test_hf.py).

Phi-3.5-MoE, Granite-MoE, Hunyuan-MoE, Flint and Afmoe, whose own plans split their experts alone, have their
attention split by heads as well (each rank holds its heads' projections), with or without per-head q/k norms, with
Afmoe's output gate, and Afmoe's dense first MLP by features.

Among them, four that once went wrong:

- Nemotron's LayerNorm1P (``weight + 1``, a subclass of ``nn.LayerNorm`` with its own forward) was copied into
  tessel's LayerNorm under sequence parallelism as if it were a plain one: wrong logits. It is now probed and kept.
- NanoChat runs its final norm before its layers too: the norm's gather under sequence parallelism fired there as
  well (doubling the sequence). It now gathers only once the layers have run.
- Apertus's xIELU activation learns two scalars that act on each rank's share of the MLP's features: their
  gradients were each rank's share. They are now summed over the group.
- Sarvam-MoE's per-head q/k norms, which its plan does not name, act on each rank's heads: their gradients were
  each rank's share too (every rank's logits right). They are summed as well.

HY-V4 carries several residual streams (hyper-connections, ``[B, S, streams, H]``): under sequence parallelism they
split along the sequence, the modules that mix them run on each rank's tokens (their gradients summed), and its
latent attention's output gate, which reads the block's input, is fed by the block's ring.
"""

import copy

import pytest
import torch

from tests.layers.test_hf import REFERENCE_KERNELS, VOCAB, _check_against_dense, needs_hf
from tests.multiprocess import run_ranks

FAMILIES = ("nemotron", "nanochat", "apertus", "gpt_neox", "phi", "starcoder2", "cohere", "cohere2", "glm4",
            "granite", "exaone4", "helium", "internlm3", "smollm3", "seed_oss", "vaultgemma", "jais2", "olmo",
            "ernie4_5", "arcee", "phimoe", "granitemoe", "hunyuan_v1_moe", "flint", "afmoe",
            "granitemoe_swa", "sarvam_moe", "apertus1p5_text", "aria_text", "beam", "cohere2_moe", "cwm", "exaone",
            "exaone_moe", "granite_swa", "granitemoeshared", "hy_v3", "hyperclovax", "iquestcoder", "kolibri1",
            "llama4_text", "mimo_v2_flash", "ministral3", "solar_open", "glm4_moe_lite", "minicpm3",
            "qwen3_5_moe_text", "stablelm", "minimax_m3_vl_text", "hy_v4", "gptj", "codegen", "dots1", "axk1", "axk2",
            "youtu", "sarvam_mla")  # fmt: skip
# what a family's tiny config needs beside family_model's: multi-head latent attention expands the latent to every
# head (kv heads as many as the heads; the rotary width the head_dim); Qwen3.5-MoE's first three of each four layers
# are linear attention; GPT-J's and CodeGen's rotary width; experts routed in one group
_GROUPED = dict(n_group=1, topk_group=1, n_routed_experts=4)
_MLA = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16, head_dim=8, **_GROUPED)  # fmt: skip
FAMILY_CONFIGS = {"glm4_moe_lite": dict(num_key_value_heads=4), "minicpm3": dict(num_key_value_heads=4),
                  "hy_v4": dict(num_key_value_heads=4),
                  "qwen3_5_moe_text": dict(layer_types=["linear_attention", "full_attention"]),
                  "gptj": dict(rotary_dim=8), "codegen": dict(rotary_dim=8),
                  "dots1": dict(n_shared_experts=1, first_k_dense_replace=1, **_GROUPED),
                  "axk1": _MLA, "axk2": _MLA, "youtu": _MLA, "sarvam_mla": _MLA}  # fmt: skip
# families without grouped-query attention (a kv head per query head, whatever the config says)
NO_GQA = ("gpt_neox", "gptj", "codegen")
# the families whose own plans leave their attention whole: tessel splits it by heads
WHOLE_ATTENTION = ("phimoe", "granitemoe", "hunyuan_v1_moe", "flint", "afmoe")


def family_model(kind: str, seed: int = 0, **config):
    import transformers

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, attn_implementation="eager", num_experts=4, num_local_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=32)  # fmt: skip
    kw.update(config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(kind, **kw)).eval()
    with torch.no_grad():  # norms and activations away from their initial values, which hide wrong formulas
        for name, p in model.named_parameters():
            if "norm" in name or "act_fn" in name:
                p.add_(torch.rand(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.5)
    return model


def _families_ranks(rank, world_size, families):
    from tessel.layers.parallelize import parallelize

    for kind in families:
        for sp in (False, True):
            dense = family_model(kind, **FAMILY_CONFIGS.get(kind, {}))
            par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp)
            if kind in WHOLE_ATTENTION:
                attention = par.model.layers[1].self_attn
                assert attention.q_proj.weight.shape == (64 // world_size, 64), kind
                assert attention.o_proj.weight.shape == (64, 64 // world_size), kind
            _check_against_dense(dense, par, f"{kind} sp={sp}")
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_families_match_dense_on_two_ranks():
    assert run_ranks(_families_ranks, 2, FAMILIES, timeout=600, env=REFERENCE_KERNELS) == ["ok", "ok"]


def _one_kv_head_ranks(rank, world_size, families):
    from tessel.layers.parallelize import parallelize

    for kind in families:
        config = {k: v for k, v in FAMILY_CONFIGS.get(kind, {}).items() if k != "num_key_value_heads"}
        for sp in (False, True):
            dense = family_model(kind, num_key_value_heads=1, **config)
            par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp)
            copies = [m for m in par.modules() if getattr(m, "max_chunks", None)]
            assert bool(copies) == (kind not in NO_GQA), f"{kind}: {len(copies)} kv heads copied"
            _check_against_dense(dense, par, f"{kind} one kv head sp={sp}")
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_families_replicate_one_kv_head_over_two_ranks():
    """Every family with kv heads (not multi-head latent attention's, one a head; NO_GQA's have none) and one of them: a
    copy on each rank (MiMo-V2-Flash's sliding layers, whose two kv heads split, beside its full ones, whose one is
    copied; its values of a head width of their own), the dense model's logits and gradients ± sequence parallelism."""
    families = [kind for kind in FAMILIES if FAMILY_CONFIGS.get(kind, {}).get("num_key_value_heads") != 4]
    assert run_ranks(_one_kv_head_ranks, 2, families, timeout=900, env=REFERENCE_KERNELS) == ["ok", "ok"]


def _diffllama_ranks(rank, world_size):
    from tessel.layers.linear import ColumnParallelLinear
    from tessel.layers.parallelize import parallelize

    for sp in (False, True):
        dense = family_model("diffllama", num_key_value_heads=4)
        with torch.no_grad():  # λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init away from its initial value
            for name, p in dense.named_parameters():
                if "lambda" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
        par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp)
        attention, whole = par.model.layers[0].self_attn, dense.model.layers[0].self_attn
        # this rank's share of each half of the heads: head i stays with its partner i + H/2
        assert torch.equal(attention.q_proj.weight, whole.q_proj.weight.view(2, 2, 16, 64)[:, rank].reshape(32, 64))
        assert attention.k_proj.weight.shape == attention.v_proj.weight.shape == (32, 64)
        assert attention.o_proj.weight.shape == (64, 32)
        _check_against_dense(dense, par, f"diffllama sp={sp}")
    # two kv heads: a half of one head per rank would not split; the attention stays whole
    par = parallelize(family_model("diffllama"), None)
    assert not isinstance(par.model.layers[0].self_attn.q_proj, ColumnParallelLinear)
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_diffllama_keeps_its_head_pairs_on_each_rank():
    """DiffLlama's differential attention pairs query head i with head i + H/2 and the first and second halves of its
    kv heads; its plan splits only the embedding. tessel splits each half of the heads (q, k, v ``packed_colwise``),
    the output by pairs, and sums its shared λ vectors' gradients over the ranks."""
    assert run_ranks(_diffllama_ranks, 2, timeout=600, env=REFERENCE_KERNELS) == ["ok", "ok"]


def _doge_ranks(rank, world_size):
    from tessel.layers.hf_mixers import SharedRowLinear
    from tessel.layers.parallelize import parallelize

    for moe, layouts in ((False, (False, True)), (True, (False,))):
        for sp in layouts:
            config = dict(is_moe=True, num_experts=16, num_experts_per_tok=2) if moe else {}
            dense = family_model("doge", **config)
            with torch.no_grad():  # the mask's per-kv-head scales and the residual scales away from their init
                for name, p in dense.named_parameters():
                    if name.endswith((".A", "residual")):
                        p.add_(torch.rand(p.shape, generator=torch.Generator().manual_seed(len(name))))
            par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp)
            attention = par.model.layers[0].self_attn
            assert isinstance(attention.dt_proj, SharedRowLinear) and attention.dt_proj.per_head
            assert attention.dt_proj.weight.shape == (2, 32 // world_size) and attention.A.shape == (2 // world_size,)
            _check_against_dense(dense, par, f"doge moe={moe} sp={sp}")
    model = family_model("doge", is_moe=True, num_experts=16, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"router_gate .* gathers its output inside a block .* sequence_parallel"):
        parallelize(model, None, sequence_parallel=True)
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_doge_keeps_each_rank_its_heads_masks():
    """Doge's dynamic mask comes from every kv head's values (``dt_proj``, which its plan splits rowwise so that every
    rank would hold every head's mask): each rank keeps its kv heads' share of the summed output (``rowwise_heads``)
    and its heads' ``A``; the layers' residual scales, which see each rank's tokens under sequence parallelism, have
    their gradients summed. Its mixture of embedding experts trains without sequence parallelism, which refuses its
    router (it would read the sequence its block gathers for the other projections)."""
    assert run_ranks(_doge_ranks, 2, timeout=600, env=REFERENCE_KERNELS) == ["ok", "ok"]


@needs_hf
def test_a_layer_norm_subclass_of_its_own_is_probed():
    import transformers

    from tessel.layers.norm import LayerNorm, sequence_parallel_norm

    norm = transformers.models.nemotron.modeling_nemotron.NemotronLayerNorm1P(8)
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 0.5)
    with pytest.raises(ValueError, match=r"NemotronLayerNorm1P overrides nn\.LayerNorm\.forward and does not"):
        LayerNorm.from_module(norm)
    assert sequence_parallel_norm(norm, None) is None  # kept, its gradients reduced instead

    class Scaled(torch.nn.LayerNorm):  # overrides forward, computes the same: copied
        def forward(self, x):
            return super().forward(x) * 1.0

    copied = LayerNorm.from_module(Scaled(8))
    assert isinstance(copied, LayerNorm) and copied.dim == 8


def gpt_oss_model(seed: int = 0, **kw):
    """A tiny GPT-OSS with every bias, sink and router away from zero (their initial zeros hide a bias added on
    every rank), a window of 3 keys in its sliding layers (the batch is 8 tokens long), and a SwiGLU limit that
    clamps some of the experts' features and not others."""
    import transformers

    config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, pad_token_id=0, num_local_experts=4,
                  num_experts_per_tok=2, sliding_window=3, attn_implementation="eager", swiglu_limit=0.15,
                  **kw)  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**config)).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "sinks" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if "sinks" in name else 0.02))
            elif "norm" in name:
                p.add_(torch.rand(p.shape, generator=gen) * 0.5)
    return model


def _gpt_oss_ranks(rank, world_size):
    from tessel.layers import register_hf_attention, register_hf_experts
    from tessel.layers.parallelize import parallelize

    for experts in ("eager", register_hf_experts()):
        for attention in ("eager", register_hf_attention()):
            for sp in (False, True):
                dense = gpt_oss_model(experts_implementation=experts)
                dense.set_attn_implementation(attention)
                par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp)
                for layer in par.model.layers:  # every projection, expert and sink split by heads or features
                    assert layer.self_attn.q_proj.weight.shape == (64 // world_size, 64)
                    assert layer.self_attn.o_proj.weight.shape == (64, 64 // world_size)
                    assert layer.self_attn.sinks.shape == (4 // world_size,)
                    assert layer.mlp.experts.gate_up_proj.shape == (4, 64, 2 * 48 // world_size)
                    assert layer.mlp.experts.down_proj.shape == (4, 48 // world_size, 64)
                _check_against_dense(dense, par, f"gpt_oss experts={experts} attention={attention} sp={sp}")
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_gpt_oss_splits_its_attention_and_experts():
    """GPT-OSS's plan splits its embedding alone: tessel splits its attention by heads (with their sinks) and its
    experts by features (interleaved gate/up, biases; the output bias added once), with and without sequence
    parallelism, through Hugging Face's and tessel's attention and experts."""
    assert run_ranks(_gpt_oss_ranks, 2, timeout=600, env=REFERENCE_KERNELS) == ["ok", "ok"]


def gemma4_model(seed: int = 0, **kw):
    """A tiny Gemma 4 text model with its per-layer inputs (an embedding of 8 features per layer, gated into every
    layer's residual stream), its norms and per-layer scalars away from their initial values."""
    import transformers

    config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, pad_token_id=0,
                  vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
                  attn_implementation="eager")  # fmt: skip
    config.update(kw)  # the variant's over the defaults
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("gemma4_text", **config))
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if "norm" in name or "scale" in name:
                p.add_(torch.rand(p.shape, generator=gen) * 0.5)
    return model.eval()


GEMMA4_VARIANTS = {"per-layer inputs": {}, "experts beside the MLP": dict(enable_moe_block=True, num_experts=4,
                                                                          top_k_experts=2, moe_intermediate_size=32),
                   "k = v": dict(attention_k_eq_v=True),
                   # layers 3 and 4 reuse the keys and values of the last earlier layer of their type (2 and 1)
                   "keys and values shared": dict(num_hidden_layers=5, num_kv_shared_layers=2, layer_types=[
                       "sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                       "full_attention"])}  # fmt: skip


def _gemma4_ranks(rank, world_size):
    from tessel.layers.parallelize import parallelize

    for variant, kw in GEMMA4_VARIANTS.items():
        for sp in (False, True):
            dense = gemma4_model(**kw)
            par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp)
            layer = par.model.layers[0]
            assert layer.self_attn.q_proj.weight.shape == (64 // world_size, 64)
            assert layer.mlp.down_proj.weight.shape == (64, 96 // world_size)
            if "experts" in variant:
                assert layer.experts.down_proj.shape[-1] * world_size in (32, 64)  # split by features
            _check_against_float64(dense, par, f"gemma4 {variant} sp={sp}")
    return "ok"


def _check_against_float64(dense, par, tag, tp_group=None, cp_group=None):
    """par (parallelized over ``tp_group``, and ``cp_group`` if given; fp32) against the dense model in float64:
    logits and every gradient shard within 1e-4 of their largest entry, or 4× the fp32 rounding error where that is
    larger: the larger of the dense fp32 model's own error and that of the dense model with every weight moved by
    about one rounding (a relative 2^-23), since another order of the same sums (par's) can land anywhere in that
    range where the model is ill-conditioned (Gemma 4's full-attention heads of 512 under unit scaling). For models
    whose fp32 rounding alone exceeds test_hf's elementwise tolerance (Gemma 4's gradients of its two scaled
    embeddings). Under context parallelism each rank feeds its share of the sequence, the logits are gathered and
    the gradients summed over the cp ranks."""
    import torch.distributed as dist

    from tessel.parallel.context import gather_sequence, split_sequence
    from tessel.parallel.sharding import shard_like
    from tests.layers.test_hf import _batch, _forward_backward

    ids, weights = _batch()
    exact = copy.deepcopy(dense).double()
    exact.set_experts_implementation("eager")  # torch's grouped GEMM takes no float64
    want = _forward_backward(exact, ids, weights.double())
    rounded = _forward_backward(dense, ids, weights)
    moved = copy.deepcopy(dense)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in moved.parameters():
            p.mul_(1 + 2**-23 * torch.randn(p.shape, generator=gen))
    moved.zero_grad(set_to_none=True)
    rounded_moved = _forward_backward(moved, ids, weights)
    if cp_group is None:
        got = _forward_backward(par, ids, weights)
    else:
        got = _forward_backward(par, split_sequence(ids, cp_group), split_sequence(weights, cp_group))
        got = gather_sequence(got, cp_group)
        for p in (p for p in par.parameters() if p.grad is not None):  # DeepSeek-V4's indexer has none
            dist.all_reduce(p.grad, group=cp_group)

    def error(x, ref):
        return ((x.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()

    pairs = [("logits", got, (rounded, rounded_moved), want)]
    exact_params = dict(exact.named_parameters())
    dense_params, moved_params = dict(dense.named_parameters()), dict(moved.named_parameters())
    for name, p in par.named_parameters():
        if exact_params[name].grad is None and p.grad is None:
            continue
        ref = shard_like(exact_params[name].grad, p, tp_group)
        fp32 = (shard_like(params[name].grad, p, tp_group) for params in (dense_params, moved_params))
        pairs.append((name, p.grad, tuple(fp32), ref))
    for name, g, (d, m), ref in pairs:
        assert g.shape == ref.shape, f"{tag} {name}: {tuple(g.shape)} vs {tuple(ref.shape)}"
        bound = max(4 * error(d, ref), 4 * error(m, ref), 1e-4)
        assert error(g, ref) <= bound, (
            f"{tag} {name}: error {error(g, ref):.3g}, the dense fp32 model's {error(d, ref):.3g} (moved: "
            f"{error(m, ref):.3g})"
        )


@pytest.mark.multiprocess
@needs_hf
def test_gemma4_with_its_per_layer_inputs_and_experts_in_the_layer():
    """Gemma 4 splits its attention and MLP by its plan; under sequence parallelism each layer's per-layer input
    (computed for the whole sequence before the layers) is split along the sequence with the residual stream, the
    layer's own per-layer gate and projection multiply this rank's tokens (their gradients summed over the group),
    and experts that sit in the layer itself, beside its dense MLP, route this rank's tokens with the layer's router."""
    assert run_ranks(_gemma4_ranks, 2, timeout=600, env=REFERENCE_KERNELS) == ["ok", "ok"]


def _gemma4_context_ranks(rank, world_size):
    from tessel.layers.parallelize import parallelize
    from tessel.parallel.comm import record_events
    from tests.layers.test_context_parallel import _grid

    _, tp_group, cp_group = _grid(rank, world_size, 2)
    for variant, kw in GEMMA4_VARIANTS.items():
        for sp in (False,) if world_size == 2 else (False, True):
            dense = gemma4_model(**kw)
            global_layer = dense.model.layers[1].self_attn
            assert global_layer.head_dim == 512 and global_layer.sliding_window is None  # wider than the kernels
            par = parallelize(copy.deepcopy(dense), tp_group, cp_group=cp_group, sequence_parallel=sp)
            with record_events() as log:
                _check_against_float64(dense, par, f"gemma4 {variant} cp=2 sp={sp}", tp_group, cp_group)
            # the ring ran in every layer (its window of 512 holds the sequence; those reusing keys and values too),
            # forward and backward
            sends = [e for e in log.events if e[:2] == ("send", "ring_attention")]
            assert len(sends) == 2 * dense.config.num_hidden_layers, log.events
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_gemma4_under_context_parallelism_with_its_global_heads_of_512():
    """Gemma 4's full-attention layers have heads of 512 features, wider than the kernels take: under context
    parallelism their ring runs its blocks in PyTorch by tiles of query rows (``wide_attention``), merged through
    their log-sum-exps as the kernel's are; its sliding layers run the kernel. cp=2, and tp=2 × cp=2 with and
    without sequence parallelism (each layer's per-layer input split with the residual stream)."""
    assert run_ranks(_gemma4_context_ranks, 2, timeout=600, env=REFERENCE_KERNELS) == ["ok"] * 2
    assert run_ranks(_gemma4_context_ranks, 4, timeout=900, env=REFERENCE_KERNELS) == ["ok"] * 4


def qwen3_5_model(kind: str = "qwen3_5_text", seed: int = 0, **overrides):
    """A tiny Qwen3.5 (or Qwen3.5-MoE, Qwen3-Next, OLMo-hybrid) of one Gated DeltaNet layer (2 key heads, 4 value
    heads of 8 features; ``overrides`` of the config) and one full-attention layer, every parameter of the linear
    attention away from its initial value."""
    import transformers

    config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, pad_token_id=0,
                  layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8, linear_value_head_dim=8,
                  linear_num_key_heads=2, linear_num_value_heads=4, attn_implementation="eager", num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)  # fmt: skip
    config.update(overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(kind, **config))
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name or "A_log" in name or "conv1d.bias" in name:
                p.add_(torch.rand(p.shape, generator=gen) * 0.5)
    return model.eval()


def _qwen3_5_ranks(rank, world_size):
    from tessel.layers.parallelize import parallelize

    for kind in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "olmo_hybrid", "lara_mini"):
        for sp in (False, True):
            dense = qwen3_5_model(kind)
            par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp)
            delta = par.model.layers[0].linear_attn
            assert (delta.num_k_heads, delta.num_v_heads, delta.key_dim, delta.value_dim) == (1, 2, 8, 16)
            out = delta.o_proj if kind == "olmo_hybrid" else delta.out_proj
            if kind == "qwen3_next":  # q, k, v, z packed by key head; b, a likewise
                assert delta.in_proj_qkvz.weight.shape == ((2 * 16 + 2 * 32) // world_size, 64)
                assert delta.in_proj_ba.weight.shape == (2 * 4 // world_size, 64)
            elif kind == "olmo_hybrid":  # each apart, under attention's names; its plan names none of them
                assert delta.q_proj.weight.shape == (8, 64) and delta.v_proj.weight.shape == (16, 64)
                assert delta.g_proj.weight.shape == (16, 64) and delta.a_proj.weight.shape == (2, 64)
            else:
                assert delta.in_proj_qkv.weight.shape == ((2 * 16 + 32) // world_size, 64)
                assert delta.in_proj_z.weight.shape == (16, 64) and delta.in_proj_b.weight.shape == (2, 64)
            assert delta.conv1d.weight.shape[0] == delta.conv1d.groups == (2 * 16 + 32) // world_size
            assert delta.A_log.shape == delta.dt_bias.shape == (2,) and out.weight.shape == (64, 16)
            _check_against_dense(dense, par, f"{kind} sp={sp}")
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_qwen3_5_linear_attention_splits_by_heads():
    """Hugging Face's Qwen3.5 and Qwen3-Next plans gather their Gated DeltaNet blocks whole, LaraMini's gathers only
    their output projection's output, and OLMo-hybrid's leaves them out; tessel splits them by heads (each rank its key
    heads and their value heads: their rows of the q/k/v projections, or of Qwen3-Next's packed by key head, and
    channels of the depthwise convolution, z/g, b, a, A_log and dt_bias), with and without sequence parallelism,
    against the dense model. Context parallelism, which the recurrence does not take, is refused before anything
    changes."""
    assert run_ranks(_qwen3_5_ranks, 2, timeout=600, env=REFERENCE_KERNELS) == ["ok", "ok"]


def test_the_linear_attention_helpers_refuse_what_they_do_not_split():
    from tessel.layers.hf_linear_attention import delta_net_updates, split_depthwise_conv

    with pytest.raises(TypeError, match=r"conv must be a depthwise nn\.Conv1d"):
        split_depthwise_conv(torch.nn.Conv1d(4, 4, 3), (2, 2), None)
    with pytest.raises(ValueError, match=r"parts must add up to the 6 channels.*received \(2, 2\)"):
        split_depthwise_conv(torch.nn.Conv1d(6, 6, 3, groups=6), (2, 2), None)
    with pytest.raises(ValueError, match=r"delta_net_updates: expected a Gated DeltaNet block .* received Linear"):
        delta_net_updates(torch.nn.Linear(2, 2), 2)


# ------------------------------------------------------------------------------------------------ sparse attention
# DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): an indexer picks each query's top-k keys, which the attention
# keeps; multi-head latent attention around it (kv heads as many as the heads)
SPARSE_FAMILIES = ("deepseek_v32", "glm_moe_dsa")
SPARSE = dict(num_key_value_heads=4, index_topk=3, index_n_heads=2, index_head_dim=16, qk_rope_head_dim=8)


@needs_hf
@pytest.mark.parametrize("family", SPARSE_FAMILIES)
@pytest.mark.parametrize("padding", [None, "left"])
def test_a_sparse_attentions_selected_keys_are_kept(family, padding):
    """tessel's attention keeps only the keys the indexer selected (``indices``), within the model's mask, as the
    model's eager attention does: logits and gradients, with and without left padding (3 keys of up to 8: the
    attention over every key differs)."""
    from tessel.layers.hf import register_hf_attention
    from tests.layers.test_hf import _close, _eager_and_tessel

    register_hf_attention()
    model = family_model(family, **SPARSE)
    results = _eager_and_tessel(model, padding)
    _close(results["tessel"][0], results["eager"][0])
    for name, grad in results["tessel"][1].items():
        _close(grad, results["eager"][1][name], msg=lambda m, n=name: f"{n}: {m}")
    dense = family_model(family, **{**SPARSE, "index_topk": 64})
    assert (dense(torch.arange(12)[None]).logits - model(torch.arange(12)[None]).logits).abs().max() > 1e-3


def test_selected_keys_refuse_what_is_not_an_index_per_query():
    from tessel.layers.hf_attention import _selected_keys

    q, k = torch.zeros(2, 4, 5, 8), torch.zeros(2, 4, 7, 8)
    keep = _selected_keys(None, torch.tensor([[[0, 4]] * 5] * 2), q, k, causal=True)
    assert keep.shape == (2, 1, 5, 7) and keep[0, 0].nonzero().tolist() == [[0, 0], [1, 0], [2, 0], [2, 4], [3, 0],
                                                                              [3, 4], [4, 0], [4, 4]]  # fmt: skip
    additive = _selected_keys(torch.zeros(1, 1, 5, 7), torch.tensor([[[6]] * 5] * 2), q, k, causal=True)
    assert (additive[:, :, :, 6] == 0).all() and (additive[:, :, :, :6] == torch.finfo(torch.float32).min).all()
    for bad, words in ((torch.zeros(2, 5, 1), r"received torch.float32 \(2, 5, 1\)"),
                       (torch.zeros(2, 4, 1, dtype=torch.long), r"received torch.int64 \(2, 4, 1\)"),
                       ([[0]], "received list")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"indices \(a sparse attention's selected keys\) must be integers "
                                             rf"\[batch=2, queries=5, k\], {words}"):  # fmt: skip
            _selected_keys(None, bad, q, k, causal=True)


def _sparse_ranks(rank, world_size):
    from tessel.layers.hf import RingLatentLinear, register_hf_attention
    from tessel.layers.hf_attention import CP_GROUP_ATTR, tessel_attention_forward
    from tessel.layers.parallelize import parallelize
    from tests.layers.test_context_parallel import _grid

    register_hf_attention()
    _, tp_group, cp_group = _grid(rank, world_size, 2)  # cp over both ranks
    for family in SPARSE_FAMILIES:
        for sp in (False, True):
            dense = family_model(family, **SPARSE)
            par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp)
            par.set_attn_implementation("tessel")
            indexer = par.model.layers[0].self_attn.indexer
            # under sequence parallelism its projections of the input gather their outputs, its queries' reads the
            # gathered query latent; otherwise it stays as it is, replicated
            assert isinstance(indexer.wk, RingLatentLinear) == sp and type(indexer.wq_b) is torch.nn.Linear
            assert isinstance(indexer.weights_proj, RingLatentLinear) == sp
            _check_against_dense(dense, par, f"{family} sp={sp}")
        with pytest.raises(ValueError, match="layers of type 'indexed_attention', which would see this rank's share"):
            parallelize(family_model(family, **SPARSE), tp_group, cp_group=cp_group)
    # the attention itself refuses the selected keys of a module marked for context parallelism
    module = torch.nn.Module()
    setattr(module, CP_GROUP_ATTR, cp_group)
    q = torch.zeros(1, 2, 4, 16)
    with pytest.raises(ValueError, match="the keys a sparse attention's indexer selected"):
        tessel_attention_forward(module, q, q, q, None, indices=torch.zeros(1, 4, 2, dtype=torch.long))
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_sparse_attention_splits_by_heads_and_its_indexer_reads_the_whole_sequence():
    """DeepSeek-V3.2 and GLM-5 (multi-head latent attention with an indexer that picks each query's keys) under
    tessel's attention, split over 2 ranks, against the dense model's eager attention, with and without sequence
    parallelism: the indexer, replicated, gathers the sequence as the latents do. Context parallelism is refused
    (the indexer would score this rank's keys alone), and so are selected keys in the ring, by name."""
    assert run_ranks(_sparse_ranks, 2, timeout=600, env=REFERENCE_KERNELS) == ["ok", "ok"]


# Kimi Linear: Kimi Delta Attention in its first layer, multi-head latent attention in its second
KIMI = dict(num_key_value_heads=4, linear_attn_config={"kda_layers": [1], "full_attn_layers": [2], "head_dim": 16,
                                                       "num_heads": 4, "short_conv_kernel_size": 4})  # fmt: skip
# Bailing's hybrid (Ling/Ring): the same delta attention with full-rank gates, then latent attention with a gate per
# head on its output
BAILING = dict(num_key_value_heads=4, layer_group_size=2)


def _kimi_ranks(rank, world_size):
    from tessel.layers.hf import RingLatentLinear
    from tessel.layers.parallelize import parallelize

    for sp in (False, True):
        dense = family_model("bailing_hybrid", **BAILING)
        par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp)
        kda, mla = par.model.layers[0].self_attn, par.model.layers[1].self_attn
        assert (kda.num_heads, kda.forget_gate.num_heads, kda.forget_gate.A_log.shape) == (2, 2, (2,))
        assert kda.g_proj.weight.shape == kda.forget_gate.f_proj.weight.shape == (32, 64)
        assert mla.g_proj.weight.shape == (2, 64) and mla.num_heads == 2  # its gate split with its heads
        _check_against_dense(dense, par, f"bailing_hybrid sp={sp}")
    for sp in (False, True):
        dense = family_model("kimi_linear", **KIMI)
        par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp)
        kda = par.model.layers[0].self_attn
        assert (kda.num_heads, kda.qkv_dim) == (2, 32) and kda.q_proj.weight.shape == (32, 64)
        assert kda.conv1d.weight.shape[0] == 96 and kda.b_proj.weight.shape == (2, 64)
        assert kda.forget_gate.A_log.shape == (1, 1, 2, 1) and kda.forget_gate.dt_bias.shape == (32,)
        assert kda.o_proj.weight.shape == (64, 32) and kda.g_b_proj.weight.shape == (32, 16)
        # the gates' projections to one head's width stay whole; under sequence parallelism they gather their latents
        assert isinstance(kda.g_a_proj, RingLatentLinear) == sp and kda.g_a_proj.weight.shape == (16, 64)
        assert isinstance(kda.forget_gate.f_a_proj, RingLatentLinear) == sp
        _check_against_dense(dense, par, f"kimi_linear sp={sp}")
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_kimi_linear_splits_its_delta_attention_by_heads():
    """Kimi Delta Attention (a Gated DeltaNet decaying per channel, with low-rank forget and output gates) split by
    heads over 2 ranks: q, k, v, β, the convolution's channels, the gates' second projections and the per-channel
    decay parameters; the gates' first projections whole (under sequence parallelism gathering their latents). Bailing's
    (full-rank gates, the forget gate's projection inside it fed by the block's ring under sequence parallelism) and
    its latent attention's gate per head. With and without sequence parallelism, against the dense model (under
    context parallelism: tests/layers/test_hf_mixer_context.py)."""
    assert run_ranks(_kimi_ranks, 2, timeout=600, env=REFERENCE_KERNELS) == ["ok", "ok"]
