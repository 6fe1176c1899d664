"""``python -m tessel.bench.train --hf FAMILY``: a Hugging Face causal LM instead of tessel's GPT.

The model is the family's ``*ForCausalLM`` built from a config of the preset's shape (the same as tessel's GPT
of that preset: layers, width, heads, kv heads, the SwiGLU width, rotary base, RMSNorm epsilon, vocabulary;
untied embeddings), randomly initialised from the run's seed on every rank, then made parallel the way a user
would: :func:`~tessel.layers.parallelize` (tensor and sequence parallelism), tessel's flash attention
(``attn_implementation="tessel"``), :func:`~tessel.layers.fuse_lm_loss` (the head's loss without logits), and
under pipeline parallelism :func:`~tessel.layers.hf_pipeline_stage`. The engine wraps and trains it as it does
the GPT (``train_engine.py``). ``--hf-baseline`` trains the same model as Hugging Face makes it (its ``sdpa``
attention, Gemma 2's eager one; its head and loss from the logits; one tensor- and pipeline-parallel rank): what
tessel's layers are measured against. The Gemma families keep their own MLP activation and embedding scale, Gemma 2
its soft-capped attention and logits and alternating window, Gemma 3 its q/k norms and its two rotary bases (local
and global layers). OLMo 2 and OLMoE keep their norms after each block and their q/k norms over all heads, which
``parallelize`` splits with the heads (:class:`~tessel.layers.norm.SplitRMSNorm`); Phi-3 its fused qkv and gate/up
projections, split by heads and by features (:mod:`~tessel.layers.hf_plans`).

Mixtures of experts (``--hf mixtral``, ``qwen3_moe`` or ``olmoe`` with ``--experts N --top-k k``): every block's MLP
is N experts of the preset's MLP width, run by tessel's grouped GEMM (``experts_implementation="tessel"``,
:func:`~tessel.layers.register_hf_experts`; the baseline keeps Hugging Face's default). Their load-balancing loss
(``--aux-loss-coef``, as Hugging Face weighs it: ``router_aux_loss_coef``) is trained and, as for tessel's GPT,
left out of the reported loss, and so is ST-MoE's router z-loss (``--z-loss-coef``, the mean squared log-sum-exp
of every layer's router logits, as for tessel's GPT; Hugging Face's mixtures have none); the balancing loss is
computed beside tessel's fused loss (:func:`~tessel.layers.fuse_lm_loss`, so the logits are never held and
``--label-smoothing`` and ``--logit-z-loss`` apply). FLOPs count the active
parameters: each token runs k of the N experts. With ``--ep`` the experts are split over expert-parallel groups of
data-parallel ranks (``parallelize(ep_group=)``); under ``--cp`` the routers' logits are gathered over the
context-parallel group for the balancing loss; under ``--pp`` each stage adds its layers' router sums to those it
received and passes them on, and the last stage's loss is every layer's (:func:`~tessel.layers.hf_pipeline_stage`).

``--hf deepseek_v3``: DeepSeek-V3's design at the preset's shape (:func:`_latent_attention_config`): multi-head latent
attention, a dense first layer, then one shared expert beside ``--experts N`` routed by sigmoid scores, group-limited
by ``--expert-groups`` and ``--top-groups``, and balanced without a loss: ``--expert-bias-rate`` moves each layer's
routing biases after every step (:func:`~tessel.layers.moe.update_expert_biases`; under ``--hf-baseline`` too, which
Hugging Face itself never does). ``--aux-loss-coef`` must be 0: the family has no balancing loss of Hugging Face's.

``--hf deepseek_v32``: DeepSeek-V3.2's, DeepSeek-V3's with its sparse attention (:func:`_indexer_config`): an
indexer keeps each query's top keys (FLOPs count those); not under ``--cp``.

``--hf kimi_linear``: Kimi Linear's (:func:`_kimi_config`): Kimi Delta Attention
(:mod:`~tessel.layers.hf_linear_attention`) in three layers of four, multi-head latent attention in the fourth, experts
routed and balanced as DeepSeek-V3's; every layout, ``--cp`` included (the delta attention by heads).
``--hf bailing_hybrid``: Bailing's (Ling/Ring 2.5, :func:`_bailing_config`), the same with full-rank gates and a gate
per head on the latent attention's output.

``--hf gpt_oss``: GPT-OSS's design at the preset's shape: attention sinks, every other layer sliding over 128 keys
(``--sliding-window W`` replaces the window, :data:`ALTERNATING_WINDOWS`), biased attention and experts with its clamped
SwiGLU, its balancing loss. Hugging Face runs its sinks in its eager attention only: the baseline's attention is
that (:data:`EAGER_FAMILIES`). FLOPs count each layer's keys (:func:`attention_windows`).

``--hf qwen3_5``: Qwen3.5's design at the preset's shape: three Gated DeltaNet linear-attention layers to each
full-attention one (:func:`_linear_attention_config`), split by heads under tensor parallelism
(:mod:`~tessel.layers.hf_linear_attention`); under cp each linear-attention layer trades the sequence split for a split
of its heads (:mod:`~tessel.layers.hf_mixer_context`). Its recurrence runs Hugging Face's kernels (``fla`` where
installed, its torch fallback otherwise). ``--hf bamba``: Bamba's design, three Mamba-2 layers to each attention layer
(:func:`_state_space_config`), the mixers split by heads (:mod:`~tessel.layers.hf_mixers`), the same layouts
(:data:`LINEAR_ATTENTION_FAMILIES`); its scan runs ``mamba_ssm``'s kernels where installed, Hugging Face's torch
fallback otherwise. ``--hf qwen3_5_moe`` (with ``--experts N``): Qwen3.5-MoE's, Qwen3.5's layers with experts
beside a shared expert of the preset's MLP width in every layer, its balancing loss. ``--hf jamba`` (with
``--experts N``): Jamba's, Mamba-1 mixers split by channels, one attention
layer in every 8 and experts in every other layer (:func:`_jamba_config`). FLOPs count no recurrence.

``--hf gemma4``: Gemma 4's design at the preset's shape (:func:`_gemma4_config`): five layers sliding over 512 keys
(``--sliding-window W`` replaces the window) to each full-attention layer, whose heads are twice as wide (Gemma 4's
512 beside 256; under cp wider than the kernels take, they ring in PyTorch), and a per-layer input embedding gated
into every layer's residual stream (under ``--pp`` the first stage computes every layer's and passes the later
layers' on with the activation). FLOPs count each layer's keys and head width (:func:`attention_widths`).

``--kv-shared-layers N`` (``--hf gemma4``): the last ``N`` layers reuse the keys and values of the last earlier layer
of their kind, as Gemma 4's E-models do (the layer before them attends to every key, as theirs does); under ``--pp`` a
stage passes on those a later stage reuses.

``--hf gpt2``, ``opt``, ``bloom``, ``falcon`` (:data:`CLASSIC_FAMILIES`): the decoders Hugging Face gives no plan,
split by :mod:`~tessel.layers.hf_classic` (GPT-2's Conv1D layers, OPT's MLP held by its layers, BLOOM's ALiBi, which
runs its own eager attention, Falcon-40B's design, its own sdpa: :data:`OWN_ATTENTION`); their LayerNorms and GELU
MLPs, learned positions (which FLOPs leave out, as the token embedding), ALiBi or rotary positions. Not under
``--cp``.

``--sliding-window W``: the families whose attention slides (:data:`WINDOW_FAMILIES`) are configured to slide every
layer over ``W`` keys (Hugging Face's ``sliding_window``), which tessel's attention runs with ``window=W``; without
it their window is set off explicitly (Mistral's config would otherwise default to 4096).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from ..layers import (
    fuse_lm_loss,
    hf_pipeline_stage,
    load_pretrained,
    parallelize,
    register_hf_attention,
    register_hf_experts,
)
from ..layers.gpt import GPTConfig
from ..layers.hf import base_model, decoder_layer_list
from ..layers.hf_balance import track_expert_loads
from ..layers.hf_router_loss import router_sums, router_z_loss
from .train_args import OVERLAPS, ArgumentError

__all__ = [
    "CLASSIC_FAMILIES",
    "HF_FAMILIES",
    "LINEAR_ATTENTION_FAMILIES",
    "MOE_FAMILIES",
    "SPARSE_FAMILIES",
    "WINDOW_FAMILIES",
    "attention_kwargs",
    "attention_widths",
    "attention_windows",
    "build_hf",
    "decoder_layer_class",
    "decoder_layers",
    "document_positions",
    "hf_flops_per_token",
    "hf_loss",
    "hf_stage",
    "init_from",
    "model_class",
    "refused_options",
]

HF_FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "mixtral": "Mixtral",
               "qwen3_moe": "Qwen3Moe", "gemma": "Gemma", "gemma2": "Gemma2", "gemma3": "Gemma3", "olmo2": "Olmo2",
               "olmoe": "Olmoe", "phi3": "Phi3", "deepseek_v3": "DeepseekV3", "deepseek_v32": "DeepseekV32",
               "gpt_oss": "GptOss", "qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe", "bamba": "Bamba",
               "jamba": "Jamba", "gemma4": "Gemma4", "kimi_linear": "KimiLinear",
               "bailing_hybrid": "BailingHybrid", "gpt2": "GPT2", "opt": "OPT", "bloom": "Bloom",
               "falcon": "Falcon"}  # fmt: skip
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
                "kimi_linear": "moe_intermediate_size", "bailing_hybrid": "moe_intermediate_size"}  # fmt: skip
# The mixtures that route as DeepSeek-V3 does: sigmoid scores, group-limited (--expert-groups, --top-groups), balanced
# by their routing biases (--expert-bias-rate) and not by a loss of Hugging Face's
BIASED_FAMILIES = ("deepseek_v3", "deepseek_v32", "kimi_linear", "bailing_hybrid")
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
EAGER_FAMILIES = ("gemma2", "gpt_oss", "bloom")
# The families whose attention keeps a kv head per query head (or latent keys and values): no --kv-heads
ONE_KV_HEAD_PER_HEAD = ("gpt2", "opt", "bloom", "deepseek_v3", "deepseek_v32", "kimi_linear", "bailing_hybrid")
# The families whose kv heads, fewer than the tensor-parallel ranks (--kv-heads below --tp), are not replicated over
# them as the others' are (tessel.layers.hf_kv_replicas: q_proj, k_proj, v_proj apart, norms of one head's width;
# Phi-3's fused qkv_proj): a k norm over every kv head (OLMo 2's, OLMoE's), Falcon's kv groups
NO_KV_REPLICAS = ("olmo2", "olmoe", "falcon")
# The families whose attention computes itself, and the implementation it runs in every run: BLOOM's eager one (its
# ALiBi), Falcon's sdpa (which has no tessel one)
OWN_ATTENTION = {"bloom": "eager", "falcon": "sdpa"}


def _experts_config(args, c: GPTConfig) -> dict:
    """A mixture's fields of the config: --experts of the preset's MLP width each, --top-k of them per token."""
    if args.hf not in MOE_FAMILIES:
        return {}
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
    if args.hf in MOE_FAMILIES and not args.hf_baseline:
        kw["experts_implementation"] = register_hf_experts()
    config = getattr(transformers, f"{TEXT_CONFIGS.get(args.hf, HF_FAMILIES[args.hf])}Config")(**kw)
    if args.kv_shared_layers:
        _check_kv_sharing(config)
    if args.hf in TEXT_CONFIGS:  # Gemma 3 keeps its own rotary bases, Qwen3.5 its partial rotary
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


def init_from(model: nn.Module, path, dims) -> None:
    """``--init``: ``model`` (split on the meta device) filled from the Hugging Face checkpoint at ``path``, each rank
    reading its shards; a checkpoint that does not fit the model is a bad argument."""
    try:
        load_pretrained(model, path, dims.tp_group, device=dims.device)
    except ValueError as exc:
        raise ArgumentError(f"--init {path}: {exc}") from None


def build_hf(args, config: GPTConfig, dims, dtype: torch.dtype) -> tuple[nn.Module, int, float]:
    """``(model, num_params, flops_per_token)``: the dense model drawn from the seed on the run's device (the same
    on every rank), counted, then laid out on ``dims``'s TP group with its fused loss, in ``dtype``. With
    ``--hf-baseline`` the model stays as Hugging Face makes it: its ``sdpa`` attention, its head and loss."""

    torch.manual_seed(args.seed)
    # the baseline's attention: sdpa, but eager for Gemma 2 and GPT-OSS (soft-capped attention, sinks: not sdpa's)
    attention = ("eager" if args.hf in EAGER_FAMILIES else "sdpa") if args.hf_baseline else register_hf_attention()
    attention = OWN_ATTENTION.get(args.hf, attention)
    with torch.device("meta" if args.init else dims.device):  # --init: each rank reads its shards once split
        model = model_class(args.hf)(_hf_config(args, config, attention))
    num_params = sum(p.numel() for p in model.parameters())
    flops = hf_flops_per_token(
        _active_params(model, args),
        config,
        args.seq_len,
        attention_windows(model.config),
        attention_widths(model.config),
    )
    model = model.to(dtype=dtype)
    if args.recompute:  # Hugging Face's activation checkpointing: each decoder layer recomputed in backward
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.hf_baseline:
        if args.init:
            init_from(model, args.init, dims)
        if args.expert_bias_rate:  # Hugging Face never moves its routing biases: tessel's updates count its routes
            track_expert_loads(model)
        return model, num_params, flops
    cp = {"cp_group": dims.cp_group} if dims.cp > 1 else {}  # each rank its zigzag share of every sequence
    ep = {"ep_group": dims.ep_group} if dims.ep > 1 else {}  # each rank of an ep group its share of the experts
    overlap = OVERLAPS[args.overlap]
    parallelize(model, dims.tp_group, sequence_parallel=args.sequence_parallel, overlap=overlap, **cp, **ep)
    if args.init:
        init_from(model, args.init, dims)
    return fuse_lm_loss(model, label_smoothing=args.label_smoothing, z_loss=args.logit_z_loss), num_params, flops


def _active_params(model: nn.Module, args) -> int:
    """The parameters a token runs through: all but the experts it is not routed to (k of every block's N) and the
    learned positions' embedding (GPT-2's, OPT's: looked up)."""
    embeddings = [m for m in base_model(model)[1].modules() if isinstance(m, nn.Embedding)]
    positions = sum(m.weight.numel() for m in embeddings if m is not model.get_input_embeddings())
    total = sum(p.numel() for p in model.parameters()) - positions
    if args.hf not in MOE_FAMILIES:
        return total
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    return total - experts * (args.experts - args.top_k) // args.experts


def hf_flops_per_token(num_params: int, c: GPTConfig, seq_len: int, windows: list[int | None] | None = None,
                       widths: list[int] | None = None) -> float:  # fmt: skip
    """``6·N + 12·L·E·S`` as :meth:`~tessel.layers.GPT.flops_per_token` counts it, N without the input embedding
    (``min(S, W)`` keys under a sliding window ``W``): ``windows`` gives each layer's (None: every earlier key;
    default: ``c.sliding_window`` in every layer), ``widths`` each layer's query heads times their head dim (default:
    ``E``)."""
    windows = [c.sliding_window] * c.n_layer if windows is None else windows
    widths = [c.n_embd] * len(windows) if widths is None else widths
    keys = sum(e * (seq_len if w is None else min(seq_len, w)) for w, e in zip(windows, widths, strict=True))
    return 6 * (num_params - c.vocab_size * c.n_embd) + 12 * keys


def attention_windows(config) -> list[int | None]:
    """Each layer's sliding window in a Hugging Face config (None: the layer attends to every earlier key): its
    ``sliding_window`` in the layers its ``layer_types`` call ``sliding_attention``, or in all when it has none; 0 in
    linear-attention layers, which compare no query with any key (their recurrence's FLOPs, linear in the sequence,
    go uncounted)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if getattr(config, "index_topk", None) is not None:  # a sparse attention: each query's top keys
        return [config.index_topk] * config.num_hidden_layers
    if types is None:
        return [window] * config.num_hidden_layers
    return [window if kind == "sliding_attention" else 0 if kind == "linear_attention" else None for kind in types]


def attention_widths(config) -> list[int] | None:
    """Each layer's query heads times their head dim where they differ from layer to layer (a config of per-layer
    values: Gemma 4's full-attention layers' heads twice the others' width), else None: every layer the model's
    width, as :func:`hf_flops_per_token` counts it by default."""
    layers = getattr(config, "per_layer_config", None)
    if layers is None:
        return None
    per_layer = [(getattr(layers[i], "num_attention_heads", None), getattr(layers[i], "head_dim", None))
                 for i in range(config.num_hidden_layers)]  # fmt: skip
    if any(heads is None or dim is None for heads, dim in per_layer):  # GPT-2's: no head_dim, one width
        return None
    widths = [heads * dim for heads, dim in per_layer]
    return widths if len(set(widths)) > 1 else None  # uniform: the model's width (DeepSeek-V3's head_dim is rotary)


def hf_stage(model: nn.Module, stage: int, num_stages: int, args) -> nn.Module:
    """Pipeline stage ``stage``: its loss fused (its last stage returns the final norm's output), its attention's
    backward the one ``--attention-backward`` names."""
    return hf_pipeline_stage(model, stage, num_stages, fused_loss=True, forward_kwargs=attention_kwargs(args))


def attention_kwargs(args) -> dict:
    """What every forward passes on to tessel's attention: ``deterministic=False`` for ``--attention-backward
    atomic`` (Hugging Face's keyword for flash attention's deterministic backward), nothing otherwise."""
    return {"deterministic": False} if args.attention_backward == "atomic" else {}


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers (its base model's ``layers``, GPT-2's ``h``): FSDP's units, what ``--compile``
    compiles."""
    return decoder_layer_list(model)


def decoder_layer_class(model: nn.Module) -> type:
    """The class of the model's decoder layers: FSDP's units."""
    return type(decoder_layers(model)[0])


def hf_loss(wrapper: nn.Module, x: torch.Tensor, y: torch.Tensor, segment_ids: torch.Tensor | None = None,
            aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0,
            **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``(loss, router loss)``: the mean cross entropy of next-token targets ``y`` (already shifted) through the
    model's forward: fused (``fuse_lm_loss``), or Hugging Face's own from the logits under ``--hf-baseline``; and a
    mixture's load-balancing loss times ``aux_loss_coef`` (its config's ``router_aux_loss_coef``), which Hugging
    Face adds into its loss, plus ST-MoE's router z-loss over every layer's router logits times ``z_loss_coef``
    (None without router logits). Packed documents (``segment_ids``) reach the model as Hugging Face
    packs them: position ids restarting at each document, from which (without a cache) its mask keeps each
    document to itself. ``kwargs`` go to the model's forward (:func:`attention_kwargs`)."""
    y = y.contiguous()  # a window of the batch (Hugging Face views it flat)
    packed = {} if segment_ids is None else {"position_ids": document_positions(segment_ids)}
    # no cache: training needs none, and with one Hugging Face does not read packed documents from the positions
    # (its mask would let every document see the ones before it in the row)
    out = wrapper(x, labels=y, shift_labels=y, use_cache=False, **packed, **kwargs)
    aux = getattr(out, "aux_loss", None)
    if aux is None:
        return out.loss, None
    balancing = aux_loss_coef * aux
    router = balancing
    if z_loss_coef > 0:
        experts = out.router_logits[0].shape[-1]
        router = router + z_loss_coef * router_z_loss(router_sums(out.router_logits, experts, 1), experts)
    return out.loss - balancing, router


def document_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` positions counted from each document's first token, for ids non-decreasing along each row."""
    index = torch.arange(segment_ids.shape[1], device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return index - torch.cummax(torch.where(starts, index, 0), dim=1).values


def refused_options(args) -> str | None:
    """Why ``args`` cannot train a Hugging Face model here (None when they can): ``--hf-baseline`` without
    ``--hf`` or with tessel's tensor or pipeline parallelism, no transformers, or options of tessel's GPT that the
    model has no counterpart for."""
    if args.hf is None:
        return "--hf-baseline trains a Hugging Face model as it comes: it needs --hf" if args.hf_baseline else None
    if args.hf_baseline and (args.tp > 1 or args.pp > 1):
        return (f"--hf-baseline trains the model as Hugging Face makes it: without --tp {args.tp} and --pp {args.pp} "
                "(tessel's layers and stages)")  # fmt: skip
    if importlib.util.find_spec("transformers") is None:
        return f"--hf {args.hf} needs transformers (pip install transformers)"
    moe = args.hf in MOE_FAMILIES
    if moe != (args.experts > 0):
        return (f"--hf {args.hf} is a mixture of experts: it needs --experts N" if moe else
                f"--hf {args.hf} is dense: --experts needs a mixture family ({', '.join(MOE_FAMILIES)})")  # fmt: skip
    smoothed = [flag for flag, on in (("--label-smoothing", args.label_smoothing > 0),
                                      ("--logit-z-loss", args.logit_z_loss > 0)) if on]  # fmt: skip
    if smoothed and args.hf_baseline:
        return (f"{' and '.join(smoothed)} {'shape' if len(smoothed) > 1 else 'shapes'} tessel's fused loss; "
                "--hf-baseline trains Hugging Face's own loss, which has neither")  # fmt: skip
    if args.hf in CLASSIC_FAMILIES and args.cp > 1:
        why = ("its attention computes itself, where tessel's ring never runs" if args.hf in OWN_ATTENTION else
               "its positions are not rotary (context parallelism hands each rank's tokens theirs through the rotary "
               "embedding)")  # fmt: skip
        return f"--hf {args.hf} trains without --cp: {why}"
    if args.hf in SPARSE_FAMILIES and args.cp > 1:
        return (f"--hf {args.hf} keeps each query's top keys by an indexer, which under --cp {args.cp} would score a "
                "rank's keys alone: train it without --cp")  # fmt: skip
    biased = args.hf in BIASED_FAMILIES
    if biased and (args.aux_loss_coef > 0 or args.z_loss_coef > 0):
        return (f"--hf {args.hf} balances its experts by their routing biases (--expert-bias-rate, DeepSeek-V3 uses "
                "1e-3), not by a loss of Hugging Face's, and gives no router logits: pass --aux-loss-coef 0 (and no "
                "--z-loss-coef)")  # fmt: skip
    unsupported = {
        **({"--router-score sigmoid": args.router_score != "softmax",
            "--expert-groups": args.expert_groups > 1, "--expert-bias-rate": args.expert_bias_rate > 0}
           if moe and not biased else {}),
        f"--sliding-window (its config slides not every layer; {', '.join(WINDOW_FAMILIES)} do, and "
        f"{', '.join(ALTERNATING_WINDOWS)} every other)": args.sliding_window is not None
        and args.hf not in WINDOW_FAMILIES and args.hf not in ALTERNATING_WINDOWS,
        "--attention-backward atomic with --hf-baseline (its attention is sdpa)": args.hf_baseline
        and args.attention_backward == "atomic",
        "--kv-shared-layers (Gemma 4's)": args.kv_shared_layers != 0 and args.hf != "gemma4",
        "--kv-heads (its attention has one kv head per query head, or latent keys and values)": args.kv_heads
        is not None and args.hf in ONE_KV_HEAD_PER_HEAD,
        "--kv-heads below --tp (its kv heads are not replicated: a norm over them all, or Falcon's kv groups)":
        args.kv_heads is not None and args.kv_heads < args.tp and args.hf in NO_KV_REPLICAS,
    }  # fmt: skip
    given = [flag for flag, on in unsupported.items() if on]
    return f"--hf {args.hf} trains without {', '.join(given)}: those are tessel's GPT's options" if given else None
