"""The ``--hf`` families of the training job: what each is (the tables below) and its config at a preset's shape.

:func:`_hf_config` builds the family's Hugging Face config from the preset's :class:`~tessel.layers.gpt.GPTConfig`
and the run's options (experts, windows, kv sharing); one function per family's design gives the fields that differ
from a Llama of the preset's shape. :mod:`~tessel.bench.train_hf` builds, splits and trains the model.
"""

from __future__ import annotations

from ..layers import register_hf_experts
from ..layers.gpt import GPTConfig
from .train_args import ArgumentError

__all__ = [
    "ALTERNATING_WINDOWS",
    "BIASED_FAMILIES",
    "BIASED_WITH_LOSS",
    "CLASSIC_FAMILIES",
    "COMPRESSED_FAMILIES",
    "EAGER_FAMILIES",
    "HF_FAMILIES",
    "LINEAR_ATTENTION_FAMILIES",
    "MODEL_CLASSES",
    "MOE_FAMILIES",
    "NO_KV_REPLICAS",
    "ONE_KV_HEAD_PER_HEAD",
    "OWN_ATTENTION",
    "SPARSE_FAMILIES",
    "TEXT_CONFIGS",
    "WINDOW_FAMILIES",
    "model_class",
]

HF_FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "mixtral": "Mixtral",
               "qwen3_moe": "Qwen3Moe", "gemma": "Gemma", "gemma2": "Gemma2", "gemma3": "Gemma3", "olmo2": "Olmo2",
               "olmoe": "Olmoe", "phi3": "Phi3", "deepseek_v3": "DeepseekV3", "deepseek_v32": "DeepseekV32",
               "gpt_oss": "GptOss", "qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe", "bamba": "Bamba",
               "jamba": "Jamba", "gemma4": "Gemma4", "kimi_linear": "KimiLinear",
               "bailing_hybrid": "BailingHybrid", "gpt2": "GPT2", "opt": "OPT", "bloom": "Bloom",
               "falcon": "Falcon", "deepseek_v4": "DeepseekV4"}  # fmt: skip
# The causal LMs not named {family}ForCausalLM
MODEL_CLASSES = {"gpt2": "GPT2LMHeadModel"}
# The families Hugging Face gives no tensor-parallel plan (tessel.layers.hf_classic splits them): GPT-2's learned
# positions and Conv1D layers, OPT's MLP held by its layers, BLOOM's ALiBi, Falcon-40B's design (kv groups, attention
# and MLP side by side, rotary positions); their LayerNorms and GELU MLPs of the preset's width (BLOOM's is four times
# its width), no dropout. Not under --cp: no rotary positions to hand each rank's tokens, or attention that computes
# itself (Falcon's), which tessel's ring never reaches.
CLASSIC_FAMILIES = ("gpt2", "opt", "bloom", "falcon")
# Families whose text model's config class is named apart from the causal LM (Gemma3TextConfig, Gemma3ForCausalLM);
# they keep their own rotary embeddings (Gemma 3's two bases, Qwen3.5's partial rotary)
TEXT_CONFIGS = {"gemma3": "Gemma3Text", "qwen3_5": "Qwen3_5Text", "qwen3_5_moe": "Qwen3_5MoeText",
                "gemma4": "Gemma4Text"}  # fmt: skip
# The families whose blocks hold experts (--experts), and the name of their experts' width in the config.
MOE_FAMILIES = {"mixtral": "intermediate_size", "qwen3_moe": "moe_intermediate_size", "olmoe": "intermediate_size",
                "deepseek_v3": "moe_intermediate_size", "deepseek_v32": "moe_intermediate_size",
                "gpt_oss": "intermediate_size",
                "jamba": "intermediate_size", "qwen3_5_moe": "moe_intermediate_size",
                "kimi_linear": "moe_intermediate_size", "bailing_hybrid": "moe_intermediate_size",
                "deepseek_v4": "moe_intermediate_size"}  # fmt: skip
# The mixtures that route as DeepSeek-V3 does: sigmoid scores, group-limited (--expert-groups, --top-groups), balanced
# by their routing biases (--expert-bias-rate) and not by a loss of Hugging Face's
BIASED_FAMILIES = ("deepseek_v3", "deepseek_v32", "kimi_linear", "bailing_hybrid", "deepseek_v4")
# Of those, the ones whose routers also give their logits, for Hugging Face's balancing loss beside the biases
# (--aux-loss-coef; DeepSeek-V4's, whose report adds a small balancing loss to its biases)
BIASED_WITH_LOSS = ("deepseek_v4",)
# The families whose attention keeps each query's top keys by an indexer (DeepSeek Sparse Attention): not under --cp,
# where the indexer would score a rank's keys alone
SPARSE_FAMILIES = ("deepseek_v32",)
# The families whose attention takes a sliding window (--sliding-window), and how their config asks for one in
# every layer (Qwen's layers below max_window_layers attend to everything).
WINDOW_FAMILIES = {"mistral": {}, "mixtral": {}, "qwen2": {"use_sliding_window": True, "max_window_layers": 0},
                   "qwen3": {"use_sliding_window": True, "max_window_layers": 0},
                   "qwen3_moe": {"use_sliding_window": True, "max_window_layers": 0}}  # fmt: skip
# The families whose layers are mostly Gated DeltaNet linear attention (tessel.layers.hf_linear_attention) or Mamba
# mixers (tessel.layers.hf_mixers), which run under context parallelism by heads (tessel.layers.hf_mixer_context)
LINEAR_ATTENTION_FAMILIES = ("qwen3_5", "qwen3_5_moe", "bamba", "jamba", "kimi_linear", "bailing_hybrid")
# The families whose layers alternate between a sliding window and full attention, and their own window, which
# --sliding-window W replaces (GPT-OSS: every other layer slides over 128 keys)
ALTERNATING_WINDOWS = {"gpt_oss": 128, "gemma4": 512}
# The families Hugging Face runs without sdpa (soft-capped attention, attention sinks): the baseline's attention is
# their eager one
EAGER_FAMILIES = ("gemma2", "gpt_oss", "bloom", "deepseek_v4")
# The families whose attention keeps a kv head per query head (or latent keys and values): no --kv-heads
ONE_KV_HEAD_PER_HEAD = ("gpt2", "opt", "bloom", "deepseek_v3", "deepseek_v32", "kimi_linear", "bailing_hybrid",
                        "deepseek_v4")  # fmt: skip
# The families whose kv heads, fewer than the tensor-parallel ranks (--kv-heads below --tp), are not replicated over
# them as the others' are (tessel.layers.hf_kv_replicas: q_proj, k_proj, v_proj apart, norms of one head's width;
# Phi-3's fused qkv_proj): a k norm over every kv head (OLMo 2's, OLMoE's), Falcon's kv groups
NO_KV_REPLICAS = ("olmo2", "olmoe", "falcon")
# The families whose every layer slides over a window beside keys compressed from the whole sequence (DeepSeek-V4's
# compressors), and their own window, which --sliding-window W replaces
COMPRESSED_FAMILIES = {"deepseek_v4": 128}
# The families whose attention computes itself, and the implementation it runs in every run: BLOOM's eager one (its
# ALiBi), Falcon's sdpa (which has no tessel one)
OWN_ATTENTION = {"bloom": "eager", "falcon": "sdpa"}


def _experts_config(args, c: GPTConfig) -> dict:
    """A mixture's fields of the config: --experts of the preset's MLP width each, --top-k of them per token."""
    if args.hf not in MOE_FAMILIES:
        return {}
    if args.hf == "deepseek_v4":  # one shared expert beside the routed ones in every layer, a loss beside the biases
        return {"n_routed_experts": args.experts, "num_experts_per_tok": args.top_k, "n_shared_experts": 1,
                "moe_intermediate_size": c.mlp_hidden, "router_aux_loss_coef": args.aux_loss_coef,
                "output_router_logits": args.aux_loss_coef > 0 or args.z_loss_coef > 0}  # fmt: skip
    if args.hf in BIASED_FAMILIES:  # one shared expert beside the routed ones, a dense first layer, as DeepSeek-V3
        count = "num_local_experts" if args.hf in ("kimi_linear", "bailing_hybrid") else "n_routed_experts"
        return {count: args.experts, "num_experts_per_tok": args.top_k, "n_shared_experts": 1,
                "moe_intermediate_size": c.mlp_hidden, "first_k_dense_replace": 1, "n_group": args.expert_groups,
                "topk_group": args.top_groups}  # fmt: skip
    count = "num_local_experts" if args.hf in ("mixtral", "gpt_oss") else "num_experts"
    shared = {"shared_expert_intermediate_size": c.mlp_hidden} if args.hf == "qwen3_5_moe" else {}
    return {**shared, count: args.experts, "num_experts_per_tok": args.top_k, MOE_FAMILIES[args.hf]: c.mlp_hidden,
            "router_aux_loss_coef": args.aux_loss_coef,
            "output_router_logits": args.aux_loss_coef > 0 or args.z_loss_coef > 0}  # fmt: skip


def _classic_config(family: str, c: GPTConfig, attention: str):
    """A classic family's config (:data:`CLASSIC_FAMILIES`) of the preset's shape, without dropout."""
    import transformers

    kw = dict(vocab_size=c.vocab_size, hidden_size=c.n_embd, num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
              max_position_embeddings=c.block_size, layer_norm_epsilon=c.norm_eps, initializer_range=c.init_std,
              tie_word_embeddings=False, attn_implementation=attention, pad_token_id=None, bos_token_id=None,
              eos_token_id=None)  # fmt: skip
    kw.update({
        "gpt2": dict(n_inner=c.mlp_hidden, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "opt": dict(ffn_dim=c.mlp_hidden, word_embed_proj_dim=c.n_embd, dropout=0.0, attention_dropout=0.0,
                    layerdrop=0.0),
        "bloom": dict(hidden_dropout=0.0, attention_dropout=0.0),
        "falcon": dict(new_decoder_architecture=True, num_kv_heads=c.n_kv_head or c.n_head,
                       ffn_hidden_size=c.mlp_hidden, hidden_dropout=0.0, attention_dropout=0.0, bias=False),
    }[family])  # fmt: skip
    config = transformers.AutoConfig.for_model(family, **kw)
    if family == "falcon":  # the preset's rotary base
        config.rope_parameters = {**(config.rope_parameters or {}), "rope_type": "default", "rope_theta": c.rope_theta}
    return config


def model_class(family: str):
    """The ``--hf`` family's causal-LM class."""
    import transformers

    return getattr(transformers, MODEL_CLASSES.get(family, f"{HF_FAMILIES[family]}ForCausalLM"))


def _hf_config(args, c: GPTConfig, attention: str):
    import transformers

    if args.hf in CLASSIC_FAMILIES:
        return _classic_config(args.hf, c, attention)

    # no padding token: the job packs its batches (and a family's default id may lie past the preset's vocabulary)
    kw = dict(vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.mlp_hidden,
              num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head or c.n_head,
              head_dim=c.n_embd // c.n_head, max_position_embeddings=c.block_size, rms_norm_eps=c.norm_eps,
              initializer_range=c.init_std, tie_word_embeddings=False, attn_implementation=attention,
              pad_token_id=None)  # fmt: skip
    kw.update(_experts_config(args, c))
    if args.hf in ("deepseek_v3", "deepseek_v32"):
        kw.update(_latent_attention_config(c))
    if args.hf in SPARSE_FAMILIES:
        kw.update(_indexer_config(c))
    if args.hf == "kimi_linear":
        kw.update(_kimi_config(c))
    if args.hf == "bailing_hybrid":
        kw.update(_bailing_config(c))
    if args.hf in ("qwen3_5", "qwen3_5_moe"):
        kw.update(_linear_attention_config(c))
    if args.hf == "bamba":
        kw.update(_state_space_config(c))
    if args.hf == "jamba":
        kw.update(_jamba_config(c))
    if args.hf == "gemma4":
        kw.update(_gemma4_config(c, args.kv_shared_layers))
    if args.hf in WINDOW_FAMILIES:  # explicit: Mistral's config would otherwise slide over 4096 keys
        kw["sliding_window"] = c.sliding_window
        if c.sliding_window is not None:
            kw.update(WINDOW_FAMILIES[args.hf])
    if args.hf in ALTERNATING_WINDOWS:
        kw["sliding_window"] = c.sliding_window or ALTERNATING_WINDOWS[args.hf]
    if args.hf in COMPRESSED_FAMILIES:
        kw.update(_compressed_attention_config(c, c.sliding_window or COMPRESSED_FAMILIES[args.hf]))
    if args.hf in MOE_FAMILIES and not args.hf_baseline:
        kw["experts_implementation"] = register_hf_experts()
    config = getattr(transformers, f"{TEXT_CONFIGS.get(args.hf, HF_FAMILIES[args.hf])}Config")(**kw)
    if args.kv_shared_layers:
        _check_kv_sharing(config)
    if args.hf in TEXT_CONFIGS:  # Gemma 3 keeps its own rotary bases, Qwen3.5 its partial rotary
        return config
    if args.hf in COMPRESSED_FAMILIES:  # the preset's base for the sliding keys, its own for the compressed ones
        config.rope_parameters["main"]["rope_theta"] = c.rope_theta
        return config
    if hasattr(config, "rope_parameters"):  # transformers 5: the rotary base lives in rope_parameters
        config.rope_parameters = {**(config.rope_parameters or {}), "rope_type": "default", "rope_theta": c.rope_theta}
    else:
        config.rope_theta = c.rope_theta
    return config


def _linear_attention_config(c: GPTConfig) -> dict:
    """Gated DeltaNet layers of Qwen3.5's proportions to the preset's heads (Qwen3.5: 16 key heads and 32 value heads
    of 128 features beside 16 query heads of 256): half as many key heads as the preset's heads, as many value heads,
    each of the preset's head dim; three linear-attention layers to each full-attention one (its default)."""
    d = c.n_embd // c.n_head
    return {"linear_num_key_heads": max(1, c.n_head // 2), "linear_num_value_heads": c.n_head,
            "linear_key_head_dim": d, "linear_value_head_dim": d}  # fmt: skip


def _state_space_config(c: GPTConfig) -> dict:
    """Mamba-2 mixers of Bamba's proportions (Bamba-9B: 128 heads of 64 features, twice the width, one group of B and
    C of 128 states, chunks of 256 tokens) at the preset's shape: heads of the preset's head dim over twice its width,
    one group; three Mamba-2 layers to each attention layer."""
    d = c.n_embd // c.n_head
    return {"mamba_n_heads": 2 * c.n_embd // d, "mamba_d_head": d, "mamba_expand": 2, "mamba_n_groups": 1,
            "mamba_d_state": 128, "mamba_chunk_size": 256, "mamba_d_conv": 4,
            "attn_layer_indices": list(range(3, c.n_layer, 4))}  # fmt: skip


def _jamba_config(c: GPTConfig) -> dict:
    """Jamba's layout (Jamba 1.5: one attention layer in every 8, at the 5th; experts in every other layer; Mamba-1
    mixers of 16 states over twice the width) at the preset's depth: one attention layer in every 8 (in every 4 below
    8 layers), experts in every other layer. Its attention has no positions (no rotary embedding)."""
    period = 8 if c.n_layer >= 8 else 4
    return {"attn_layer_period": period, "attn_layer_offset": period // 2, "expert_layer_period": 2,
            "expert_layer_offset": 1, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
            "use_mamba_kernels": False}  # fmt: skip


def _gemma4_config(c: GPTConfig, shared: int = 0) -> dict:
    """Gemma 4's proportions at the preset's shape (Gemma 4: heads of 256 in its sliding layers and of 512 in its
    full-attention ones, one in every 6 and the last; per-layer inputs of 256 features beside a width of 2560): full
    layers' heads twice the preset's head dim, per-layer inputs of an eighth of its width over its vocabulary. With
    ``shared`` layers reusing keys and values, the last layer before them attends to every key as well, as in Gemma
    4's E-models (E2B: layer 14 of 35, before 20 sharing ones)."""
    d = c.n_embd // c.n_head
    kw = {"global_head_dim": 2 * d, "hidden_size_per_layer_input": max(1, c.n_embd // 8),
          "vocab_size_per_layer_input": c.vocab_size}  # fmt: skip
    if shared:
        full = {c.n_layer - 1, c.n_layer - shared - 1}
        kw["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 or i in full else "sliding_attention"
                             for i in range(c.n_layer)]  # fmt: skip
        kw["num_kv_shared_layers"] = shared
    return kw


def _check_kv_sharing(config) -> None:
    """``--kv-shared-layers``: the layers before the sharing ones must hold a layer of each kind to store them."""
    shared, layers = config.num_kv_shared_layers, config.num_hidden_layers
    kinds = set(config.layer_types[: max(0, layers - shared)])
    if not 0 < shared < layers or kinds != set(config.layer_types):
        raise ArgumentError(f"--kv-shared-layers must leave before the sharing layers one of each kind of "
                            f"{layers} ({config.layer_types}), received {shared}")  # fmt: skip


def _latent_attention_config(c: GPTConfig) -> dict:
    """Multi-head latent attention of DeepSeek-V3's proportions to the preset's head dim ``d`` (V3: 128): latents of
    ``4·d`` (keys and values) and ``12·d`` (queries), rotary keys of ``d/2`` beside ``d`` dims without rotation, values
    of ``d``. Every head reads the one latent (kv heads = heads); the rotary tables are ``d/2`` wide (``head_dim``)."""
    d = c.n_embd // c.n_head
    return {"num_key_value_heads": c.n_head, "kv_lora_rank": 4 * d, "q_lora_rank": 12 * d, "qk_nope_head_dim": d,
            "qk_rope_head_dim": d // 2, "v_head_dim": d, "head_dim": d // 2}  # fmt: skip


def _kimi_config(c: GPTConfig) -> dict:
    """Kimi Linear's design at the preset's shape (48B-A3B: three Kimi Delta Attention layers of 32 heads of 128 to each
    multi-head latent attention layer, whose queries have no latent): delta heads as many as the preset's, of its head
    dim, every fourth layer (and the last) latent attention of DeepSeek-V3's proportions."""
    kinds = ["full_attention" if (i + 1) % 4 == 0 or i == c.n_layer - 1 else "linear_attention"
             for i in range(c.n_layer)]  # fmt: skip
    return {**_latent_without_query_latent(c), "linear_num_heads": c.n_head, "linear_head_dim": c.n_embd // c.n_head,
            "linear_conv_kernel_dim": 4, "layer_types": kinds}  # fmt: skip


def _latent_without_query_latent(c: GPTConfig) -> dict:
    """The latent attention of the delta-attention hybrids (Kimi Linear's, Bailing's): DeepSeek-V3's proportions, its
    queries projected without a latent; no special token ids beyond the preset's vocabulary."""
    return {**_latent_attention_config(c), "q_lora_rank": None, "bos_token_id": None, "eos_token_id": None}


def _bailing_config(c: GPTConfig) -> dict:
    """Bailing's hybrid (Ling/Ring 2.5) at the preset's shape: five delta-attention layers of the model's heads and head
    dim (full-rank gates) to each latent-attention layer with a gate per head (every fourth below six layers), its
    latents of DeepSeek-V3's proportions without a query latent."""
    d = c.n_embd // c.n_head
    # head_dim: the delta attention's (the config then points it at the rotary keys, as DeepSeek-V3's does)
    return {**_latent_without_query_latent(c), "head_dim": d, "layer_group_size": 6 if c.n_layer >= 6 else 4}


def _indexer_config(c: GPTConfig) -> dict:
    """DeepSeek-V3.2's indexer at the preset's shape (V3.2: 64 heads of 128 features keeping 2048 keys of up to 128k):
    as many heads as the model's, of its head dim, keeping a sixteenth of the block's keys (at least 4)."""
    return {"index_n_heads": c.n_head, "index_head_dim": c.n_embd // c.n_head,
            "index_topk": max(4, c.block_size // 16)}  # fmt: skip


def _compressed_attention_config(c: GPTConfig, window: int) -> dict:
    """DeepSeek-V4's attention and routing at the preset's shape (V4-Pro: 128 heads of 512 features and 64 rotary ones
    over a width of 7168, a query latent of 1536, one key-and-value head, 16 output groups of 8 heads projected to 1024
    each, hyper-connections of 4 streams; every layer sliding over 128 keys beside keys compressed 4 to 1 and kept by an
    indexer of 64 heads of 128 features (512 of them), or compressed 128 to 1, alternately after two of the latter; its
    first 3 layers of 61 routed by the token ids): heads of the preset's head dim ``d`` with ``d/8`` rotary features, a
    query latent of a quarter of the width, an output group per head (so that any tensor-parallel size splitting the
    heads splits the groups) projected to ``d/4`` (V4: 8 heads' 4096 features to 1024), the indexer's heads
    as many as the model's of its head dim, keeping a sixteenth of a block's keys compressed 4 to 1 (at least 4), the
    heavy compression one window's keys to one (V4: 128 to 1 beside a window of 128), the first layer routed by the
    token ids (any pipeline stage but the first would lack them). Routing scores ``sqrt(softplus)``, balanced by its
    biases (:data:`BIASED_FAMILIES`)."""
    d, layers = c.n_embd // c.n_head, c.n_layer
    kinds = ["heavily_compressed_attention"] * min(layers, 2)
    kinds += ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(layers - 2)]
    rope = {"rope_type": "default", "partial_rotary_factor": 0.125}
    return {"num_key_value_heads": 1, "head_dim": d, "partial_rotary_factor": 0.125, "q_lora_rank": c.n_embd // 4,
            "o_groups": c.n_head, "o_lora_rank": max(1, d // 4), "sliding_window": window,
            "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": window},
            "index_n_heads": c.n_head, "index_head_dim": d, "index_topk": max(4, c.block_size // 64),
            "layer_types": kinds, "mlp_layer_types": ["hash_moe"] + ["moe"] * (layers - 1), "hc_mult": 4,
            "num_nextn_predict_layers": 0, "bos_token_id": None, "eos_token_id": None,
            "rope_parameters": {"main": {**rope, "rope_theta": c.rope_theta},
                                "compress": {**rope, "rope_theta": 160000.0}}}  # fmt: skip
