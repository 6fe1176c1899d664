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

Each family's config and the tables of what it is (:data:`HF_FAMILIES` and the others) live in
:mod:`~tessel.bench.train_hf_config`, with the functions named below.

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

``--hf deepseek_v4``: DeepSeek-V4's (:func:`_compressed_attention_config`): every layer sliding over 128 keys
(``--sliding-window W`` replaces the window, :data:`COMPRESSED_FAMILIES`) beside keys compressed 4 to 1 and kept by an
indexer, or compressed a window to 1; one key-and-value head, grouped output projections, hyper-connections. Its first
layer routes each token by its id (a table drawn from the seed, :func:`draw_hash_routes`), the others by
``sqrt(softplus)`` scores balanced by their biases (``--expert-bias-rate``) and Hugging Face's balancing loss where
``--aux-loss-coef`` asks for it (:data:`BIASED_WITH_LOSS`). FLOPs count each layer's compressed keys beside its window
(:func:`compressed_keys`). Under ``--cp`` every rank compresses the whole sequence, gathered from the ranks' shares
of the compressors' projections, and its queries attend to the compressed keys beside the ring's
(:func:`~tessel.parallel.context_shared.shared_keys_attention`).

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
)
from ..layers.gpt import GPTConfig
from ..layers.hf import base_model, decoder_layer_list
from ..layers.hf_balance import track_expert_loads
from ..layers.hf_router_loss import router_sums, router_z_loss
from .train_args import OVERLAPS, ArgumentError
from .train_hf_config import (
    ALTERNATING_WINDOWS,
    BIASED_FAMILIES,
    BIASED_WITH_LOSS,
    CLASSIC_FAMILIES,
    COMPRESSED_FAMILIES,
    EAGER_FAMILIES,
    HF_FAMILIES,
    LINEAR_ATTENTION_FAMILIES,
    MOE_FAMILIES,
    NO_KV_REPLICAS,
    ONE_KV_HEAD_PER_HEAD,
    OWN_ATTENTION,
    SPARSE_FAMILIES,
    WINDOW_FAMILIES,
    _hf_config,
    model_class,
)

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
    "compressed_keys",
    "decoder_layer_class",
    "decoder_layers",
    "document_positions",
    "draw_hash_routes",
    "hf_flops_per_token",
    "hf_loss",
    "hf_stage",
    "init_from",
    "model_class",
    "refused_options",
]


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
    if not args.init:
        draw_hash_routes(model, args.seed)
    num_params = sum(p.numel() for p in model.parameters())
    flops = hf_flops_per_token(
        _active_params(model, args),
        config,
        args.seq_len,
        attention_windows(model.config),
        attention_widths(model.config),
        compressed_keys(model.config, args.seq_len),
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


def draw_hash_routes(model: nn.Module, seed: int) -> None:
    """Every hash router's table of each token id's experts (DeepSeek-V4's ``tid2eid``, ``[vocab, k]``, which Hugging
    Face initialises to zeros and a checkpoint fills) drawn from ``seed``: ``k`` distinct experts per id, uniformly, the
    same on every rank."""
    g = torch.Generator().manual_seed(seed)
    for router in (m for m in model.modules() if isinstance(getattr(m, "tid2eid", None), torch.Tensor)):
        vocab, k = router.tid2eid.shape
        routes = torch.rand(vocab, router.num_experts, generator=g).argsort(dim=-1)[:, :k]
        router.tid2eid.copy_(routes)


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
                       widths: list[int] | None = None, compressed: list[int] | None = None) -> float:  # fmt: skip
    """``6·N + 12·L·E·S`` as :meth:`~tessel.layers.GPT.flops_per_token` counts it, N without the input embedding
    (``min(S, W)`` keys under a sliding window ``W``): ``windows`` gives each layer's (None: every earlier key;
    default: ``c.sliding_window`` in every layer), ``widths`` each layer's query heads times their head dim (default:
    ``E``), ``compressed`` each layer's compressed keys beside its window (:func:`compressed_keys`; default none)."""
    windows = [c.sliding_window] * c.n_layer if windows is None else windows
    widths = [c.n_embd] * len(windows) if widths is None else widths
    compressed = [0] * len(windows) if compressed is None else compressed
    layers = zip(windows, widths, compressed, strict=True)
    keys = sum(e * ((seq_len if w is None else min(seq_len, w)) + extra) for w, e, extra in layers)
    return 6 * (num_params - c.vocab_size * c.n_embd) + 12 * keys


def compressed_keys(config, seq_len: int) -> list[int] | None:
    """Each layer's compressed keys a query reads beside its window, counted as for full attention (every key of the
    sequence): DeepSeek-V4's ``S/m`` keys compressed ``m`` to 1 (``heavily_compressed_attention``), or of those the
    indexer's top ``k`` (``compressed_sparse_attention``); None for a config without compressors. The compressors' and
    the indexer's scoring FLOPs, linear in the sequence, go uncounted."""
    rates = getattr(config, "compress_rates", None)
    if rates is None:
        return None
    counts = {kind: seq_len // rate for kind, rate in rates.items()}
    counts["compressed_sparse_attention"] = min(config.index_topk, counts["compressed_sparse_attention"])
    return [counts.get(kind, 0) for kind in config.layer_types]


def attention_windows(config) -> list[int | None]:
    """Each layer's sliding window in a Hugging Face config (None: the layer attends to every earlier key): its
    ``sliding_window`` in the layers its ``layer_types`` call ``sliding_attention``, or in all when it has none or has
    compressors (DeepSeek-V4's: every layer slides beside its compressed keys, :func:`compressed_keys`); 0 in
    linear-attention layers, which compare no query with any key (their recurrence's FLOPs, linear in the sequence,
    go uncounted)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if getattr(config, "compress_rates", None) is not None:  # every layer slides, beside its compressed keys
        return [window] * config.num_hidden_layers
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
    if args.hf in COMPRESSED_FAMILIES and (args.doc_sep is not None or args.doc_token is not None):
        return (f"--hf {args.hf} compresses each row's keys whole, across the documents packed into it (Hugging Face's "
                "compressors know no documents): train it without --doc-sep and --doc-token")  # fmt: skip
    if args.hf in COMPRESSED_FAMILIES and args.expert_groups > 1:
        return (f"--hf {args.hf} routes each token among all its experts: --expert-groups {args.expert_groups} limits "
                "DeepSeek-V3's routing to groups, which it has not")  # fmt: skip
    biased = args.hf in BIASED_FAMILIES
    if biased and args.hf not in BIASED_WITH_LOSS and (args.aux_loss_coef > 0 or args.z_loss_coef > 0):
        return (f"--hf {args.hf} balances its experts by their routing biases (--expert-bias-rate, DeepSeek-V3 uses "
                "1e-3), not by a loss of Hugging Face's, and gives no router logits: pass --aux-loss-coef 0 (and no "
                "--z-loss-coef)")  # fmt: skip
    unsupported = {
        **({"--router-score sigmoid": args.router_score != "softmax",
            "--expert-groups": args.expert_groups > 1, "--expert-bias-rate": args.expert_bias_rate > 0}
           if moe and not biased else {}),
        f"--sliding-window (its config slides not every layer; {', '.join([*WINDOW_FAMILIES, *COMPRESSED_FAMILIES])}"
        f" do, and {', '.join(ALTERNATING_WINDOWS)} every other)": args.sliding_window is not None
        and not any(args.hf in kinds for kinds in (WINDOW_FAMILIES, ALTERNATING_WINDOWS, COMPRESSED_FAMILIES)),
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
