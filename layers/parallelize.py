"""``parallelize(model, tp_group)``: tensor parallelism for a model that already exists, from a plan.

A plan maps module-name globs to styles. Names are those of ``model.named_modules()``; in a glob ``*``
matches one name segment and ``?`` one character of a segment (``"layers.*.self_attn.q_proj"``).
Without a plan the model's own is used: ``model.tessel_tp_plan`` (tessel's GPT), else the
Hugging Face plan (``config.base_model_tp_plan`` below the base model's prefix, the input embedding
over the vocabulary as transformers 5.x adds it, and the head model's ``_tp_plan``). Where that plan
gathers q, k and v whole and runs every head on every rank, because the query and key norms span every head
(OLMo 2 and 3, OLMoE, FlexOlmo, MiniMax-M2: the norms become ``colwise_norm``) or because one fused ``qkv_proj``
is sliced by the config's head counts (Phi-3: ``colwise_qkv``), tessel splits the attention by heads
(:func:`~tessel.layers.hf_plans.head_split_plan`), so each rank computes only its heads; attention, gated MLPs and
experts the plan does not name are split too (:func:`~tessel.layers.hf_plans.whole_attention_plan`), and so is the
Gated DeltaNet linear attention it gathers whole or leaves out (Qwen3.5, Qwen3-Next, OLMo-hybrid:
:mod:`~tessel.layers.hf_linear_attention`), and so are Mamba-2 and Mamba-1 mixers and LFM2's short convolutions
(:mod:`~tessel.layers.hf_mixers`). Decoders with no plan of their own (GPT-2, GPT-BigCode, GPT-Neo, OPT, XGLM, BioGPT,
BLOOM, Falcon, MPT, Persimmon) are split as Megatron-LM splits a GPT: attention by heads from their fused projections,
MLPs by features, the vocabulary where it divides (:mod:`~tessel.layers.hf_classic`); GPT-2's ``Conv1D`` layers become
column and row layers of ``nn.Linear``'s layout.

=================================================  ===================================================
style (Hugging Face names in parentheses)          what the module becomes (``t`` ranks, rank ``r``)
=================================================  ===================================================
colwise (local_colwise)                            ColumnParallelLinear: output rows ``r·N/t …``
colwise_gather (colwise_gather_output,             the same with ``gather_output=True`` (full output on
colwise_rep, gather on a Linear)                   every rank: a Hugging Face ``lm_head``)
packed_colwise                                     one column layer over two packed halves ([gate; up]),
                                                   each split separately; returns one tensor
rowwise (local_rowwise)                            RowParallelLinear: input columns ``r·K/t …``, reduced
rowwise_split (rowwise_split_input, rowwise_rep)   the same with ``input_is_parallel=False``
embedding (embedding_rowwise; rowwise on an        VocabParallelEmbedding: vocabulary rows ``r·V/t …``
nn.Embedding)
norm (sequence_parallel)                           tessel RMSNorm/LayerNorm under sequence parallelism;
                                                   unchanged without it (its input is replicated)
colwise_qkv                                        a fused [q; k; v] projection (Phi-3's qkv_proj, a Gated
                                                   DeltaNet's in_proj_qkv; a Mamba-2 or short-conv in_proj),
                                                   each part split; its block reads this rank's head counts
                                                   from a view of its config (LocalHeadsConfig) or its own
                                                   attributes
colwise_conv                                       a depthwise conv1d over packed channels ([q | k | v],
                                                   [x | B | C]): this rank's channels of each part
colwise_gated_norm                                 SplitGatedRMSNorm: a Mamba-2 mixer's gated norm
rowwise_shared                                     SharedRowLinear: a row layer whose summed output each
                                                   rank's share of its block reads (Mamba-1's x_proj)
rowwise_heads                                      the same, each rank its heads' share of the output
                                                   (Doge's dt_proj, one value per kv head)
colwise_norm                                       SplitRMSNorm: an RMS norm over features a column layer
                                                   splits (all-head q/k norms): weight ``r·N/t …``, its
                                                   mean of squares summed over the group
replicated_with_grad_allreduce                     unchanged; its parameter gradients are summed over
                                                   the group in backward (norms over local heads)
all_reduce                                         unchanged; its output is summed over the group
replicate (local, local_params, ep_router)        unchanged
mla_kv_a_proj                                      unchanged (multi-head latent attention's joint latent and
                                                   rotary-key projection); the rotary key's gradient is
                                                   summed over the group
experts (moe_tp_experts)                           a Hugging Face experts module of 3-d parameters: each
                                                   expert keeps intermediate features ``r·I/t …``, its
                                                   output is summed over the group
                                                   (:mod:`~tessel.layers.hf_experts`)
ep_dispatch_experts                                the same, split by whole experts ``r·E/t …``
moe                                                tessel's ParallelMoE (GPT with experts): features over
                                                   the group, experts over ``ep_group``
=================================================  ===================================================

A plan may also name the parameters of a module it splits as experts (Hugging Face's
``experts.gate_up_proj: packed_colwise``, ``experts.down_proj: rowwise``; ``grouped_gemm`` for a split by
experts), which must agree with the split the experts module's layout gives them, and, as ``colwise``,
parameters with one value per query head of a module whose projections it splits (``self_attn.sinks``, a
per-head gate bias): each rank keeps its heads'. A learnable activation (``act_fn`` and the like: Apertus's xIELU)
of a block whose column and row projections are split acts on this rank's features, and a per-head q/k norm the plan
does not name (Sarvam-MoE's) on this rank's heads: their gradients are summed over the group
(``replicated_with_grad_allreduce``) without a plan entry.
A Hugging Face model's own plan may name modules that some of its configurations lack (the dense MLPs of
a model whose layers are all experts); a user plan may not.
Hugging Face's ``embedding_colwise``, ``packed_rowwise`` and ``grouped_gemm`` (of a module) and
``moe_identity_expert`` are refused by name.

Everything is checked before anything changes: an unknown style, a glob that matches nothing, a module of the wrong
kind (also an ``nn.Linear``/``nn.Embedding`` subclass that overrides ``forward``, whose extra work a tessel layer
would drop), widths or head counts that do not split over the group (kv heads fewer than the ranks are replicated
over them where the attention's q_proj/k_proj/v_proj or fused [q; k; v] allow it, :mod:`~tessel.layers.hf_kv_replicas`),
parameters tied to a module split differently, all raise ``ValueError`` and leave the model as it was. Then every
replacement is built, and only then installed. Parents of split projections see their local head counts: tessel's
attention derives them from its projections; Hugging Face attention of transformers 5.x reshapes with ``-1``, and
older head-count attributes (``num_heads``...) are divided (:func:`~tessel.layers.hf_plans.local_head_updates`), and
parameters with one value per query head (GPT-OSS's attention sinks) keep this rank's heads' values.

``sequence_parallel=True``: tessel's GPT (and any model written like it) passes the flag to every layer, and the
layers split and gather the sequence. A Hugging Face decoder is split where its layers begin and gathered after its
final norm (:class:`~tessel.layers.hf.HFSequenceLayout`), and the column projections of each block run as one
overlapped all-gather ring (:class:`~tessel.layers.hf.SequenceRing`); the sequence length must then be divisible by
``t``. In multi-head latent attention the narrow projections of the block's input multiply the shard and gather their
latents (:class:`~tessel.layers.hf.RingLatentLinear`). Parameters replicated over the group (norms, a replicated
embedding, biases of row layers) hold their complete gradient after ``backward()``.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from ..parallel.collectives import copy_to_tp, reduce_from_tp
from ..parallel.comm import check_peer_group, group_rank, group_size
from ..parallel.sharding import expert_spec, is_tp_sharded, part_chunks
from .attention import ParallelAttention, check_heads
from .embedding import VocabParallelEmbedding
from .hf import (
    HFSequenceLayout,
    RingColumnLinear,
    RingLatentLinear,
    SequenceRing,
    base_model,
    check_layers_split,
    is_hf_model,
)
from .hf_attention import (
    mla_rope_dim,
    mla_shared_key,
    per_head_parameters,
)
from .hf_balance import balanced_blocks, track_split_loads
from .hf_classic import as_linear, classic_qkv_parts, head_bias_installer, linear_like
from .hf_context import HFContextLayout, check_own_attention
from .hf_experts import (
    check_ep_group,
    check_parameter_styles,
    expert_block_modules,
    expert_splits,
    gather_router_logits,
    install_expert_hooks,
    reduce_parameter_grads,
    shard_experts,
)
from .hf_grouped_output import split_grouped_linear
from .hf_kv_replicas import replicate_kv_heads, replicated_updates
from .hf_linear_attention import delta_net_updates, is_delta_net, split_depthwise_conv
from .hf_mixers import (
    SharedRowLinear,
    SplitGatedRMSNorm,
    check_mixers_whole,
    inner_projections,
    is_mamba2,
    mixer_installer,
    mixer_updates,
    packed_parts,
)
from .hf_plans import LocalHeadsConfig, fused_qkv_parts, head_dim_of, is_conv1d, local_head_updates
from .hf_stacked_experts import assign_shards
from .linear import ColumnParallelLinear, RowParallelLinear
from .moe import ParallelMoE
from .norm import SplitRMSNorm, sequence_parallel_norm
from .plan import (
    ALL_REDUCE,
    BY_HEADS,
    COLUMN,
    COLUMN_CONV,
    COLUMN_GATHER,
    COLUMN_NORM,
    COLUMN_QKV,
    COLUMNS,
    EMBEDDING,
    EXPERTS,
    GATED_NORM,
    GRAD_ALL_REDUCE,
    GROUPED_COLUMN,
    MLA_KV_A,
    MOE,
    NORM,
    PACKED,
    PACKED_COLUMN,
    REPLICATE,
    RING_COLUMNS,
    ROW,
    ROW_HEADS,
    ROW_SHARED,
    ROW_SPLIT,
    SHARED_OUTPUT,
    SPLIT_LINEAR,
    STYLES,
    Entry,
    latent_projections,
    map_first_output,
    match_plan,
    own_plan,
    tied_parameters,
)
from .shared_input import share_inputs

__all__ = ["STYLES", "parallelize"]


def parallelize(model: nn.Module, tp_group, *, plan: Mapping[str, str] | None = None, sequence_parallel: bool = False,
                overlap: bool | str | None = None, cp_group=None,
                expert_split: str = "features", ep_group=None) -> nn.Module:  # fmt: skip
    """Split ``model``'s layers over ``tp_group`` in place, following ``plan`` or the model's own; returns it.

    ``tp_group=None`` is the default group (a world of one without a process group). Every rank of the
    group must call this on identical models (same weights): rank ``r`` keeps its shards. ``overlap``
    (``"auto"``, ``True``, ``False``, ``"peer"``) is given to every split linear layer; ``None`` keeps the setting
    of tessel's own layers and uses ``"auto"`` for ``nn.Linear``.

    ``expert_split`` (mixtures of experts, :mod:`~tessel.layers.hf_experts`): ``"features"`` gives every rank
    each expert's share of the intermediate features; ``"experts"`` gives rank ``r`` of ``t`` the experts
    ``r·E/t …`` whole (expert parallelism over the tensor-parallel group, which routes the same tokens on
    every rank), as a plan's ``ep_dispatch_experts`` does for its module. ``ep_group`` (expert parallelism
    over data-parallel ranks, ``init_parallel(ep=)``'s ``ep_group``): rank ``r`` of the group keeps experts
    ``r·E/e …`` whole, every route travels to its expert's rank by all-to-all, and the experts are not split
    over ``tp_group``; their parameters are marked ``expert_parallel`` for ``DDP(expert_group=)``.

    ``cp_group`` (context parallelism): the sequence is also split over this group, whose ranks must
    be other ranks than ``tp_group``'s. Each rank then calls the model with its
    :func:`~tessel.parallel.context.split_sequence` share of the tokens and attention runs as
    :func:`~tessel.parallel.context.ring_attention`. tessel's GPT takes the group in its attention
    modules (as ``GPT(cp_group=)`` does); a Hugging Face decoder is switched to tessel's attention
    implementation, its rotary embeddings see the global positions, a hybrid's recurrences run over the
    whole sequence of a share of their heads (:mod:`~tessel.layers.hf_mixer_context`), and what its local view
    would compute wrongly is refused (see :mod:`tessel.layers.hf`). Parameters are replicated over the cp
    ranks: reduce their gradients over the cp group as over a data-parallel one.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize: model must be an nn.Module, received {type(model).__name__}")
    if overlap not in (None, "auto", True, False, "peer"):
        raise ValueError(f"parallelize: overlap must be None, 'auto', True, False or 'peer', received {overlap!r}")
    if expert_split not in ("features", "experts"):
        raise ValueError(f"parallelize: expert_split must be 'features' or 'experts', received {expert_split!r}")
    t = group_size(tp_group)
    if is_hf_model(model):
        check_own_attention(model)
    ep = check_ep_group(ep_group, tp_group)
    context = _context_layout(model, tp_group, cp_group)
    own = plan is None
    plan = own_plan(model, t) if own else plan
    entries, head_params = match_plan(model, plan, strict=not (own and is_hf_model(model)))
    if own and t > 1 and is_hf_model(model):  # its layers whole on every rank (DBRX's): refused, not run silently
        check_layers_split(model, {e.name for e in entries} | set(head_params))
    for e in entries:
        e.ep_group = ep_group
        if e.kind in SPLIT_LINEAR and linear_like(e.module):  # GPT-2's Conv1D, Falcon's FalconLinear
            e.transposed, e.module = is_conv1d(e.module), as_linear(e.module)
    replicate_kv_heads(model, entries, t)
    for e in entries:
        if e.kind == EXPERTS:
            e.expert_split = "experts" if e.style == "ep_dispatch_experts" or ep else expert_split
        _validate_entry(e, ep or t if e.kind == EXPERTS else t, model)
    if ep and not any(e.kind in (EXPERTS, MOE) for e in entries):
        raise ValueError(f"parallelize: ep_group was given, but the plan splits no experts module of "
                         f"{type(model).__name__} (style 'moe_tp_experts' or 'ep_dispatch_experts')")  # fmt: skip
    layout = _sequence_layout(model, entries) if sequence_parallel and is_hf_model(model) else None
    for e in entries:
        e.sequence_parallel = sequence_parallel and not e.latent_fed and (layout is None or layout.in_region(e.name))
        # inside a block, a child of it or deeper (Bailing's forget_gate.f_proj): fed by the block's ring
        in_block = layout is not None and any(e.name.startswith(b + ".") for b in layout.blocks)
        e.gathered = in_block and e.kind in RING_COLUMNS and not e.latent_fed
    heads = _local_heads(model, entries, t)
    if isinstance(context, HFContextLayout):
        context.plan_mixers(model, {e.name for e in entries}, t, cp_group)
    check_mixers_whole(model, {e.name: e.kind for e in entries} | dict.fromkeys(head_params, COLUMN), t)
    installs = [f for p, _ in heads if (f := mixer_installer(p, tp_group) or head_bias_installer(p, tp_group))]
    per_head = per_head_parameters(_attention_parents(model, entries), tp_group, head_params)
    for e in entries:
        e.new = _build(e, tp_group, overlap)
        if e.transposed:  # the checkpoint's tensor is [in, out]: load_pretrained reads it transposed
            e.new.weight.hf_transposed = True
    rings = _rings(layout, entries, tp_group) if layout is not None else {}
    ties = tied_parameters(model, entries)
    balanced = is_hf_model(model) and balanced_blocks(model)  # checked here: raises before any change
    # ---- nothing of the model has changed above this line ----
    _install(model, entries, tp_group)
    for target, source in ties:
        setattr(model.get_submodule(target[0]), target[1], getattr(model.get_submodule(source[0]), source[1]))
    for parent, updates in heads:
        for attr, value in updates.items():
            setattr(parent, attr, value)
    for parent, name, local in per_head:
        setattr(parent, name, local)
    for install in installs:
        install()
    if layout is not None:
        layout.install(model, tp_group, rings, cp_group)
    elif is_hf_model(model):  # q/k/v, gate/up called one by one on one input: one op, one all-reduce of its gradient
        share_inputs(model, {e.name: e.new for e in entries if e.kind in RING_COLUMNS})
    if isinstance(context, HFContextLayout):
        context.install(model, cp_group, t if layout is not None else 1)
        if layout is None and hasattr(getattr(model, "config", None), "output_router_logits"):
            blocks = sorted({e.name.rsplit(".", 1)[0] for e in entries if e.kind == EXPERTS})
            gather_router_logits(model, type(base_model(model)[1]), blocks, tp_group, cp_group, sequence_parallel=False)
    elif context is not None:
        for m in model.modules():  # the modules that take a cp group, replacements (ParallelMoE) included
            if hasattr(m, "cp_group"):
                m.cp_group = cp_group
    if balanced:  # e_score_correction_bias: the ranks routing other tokens of each layer's batch, for its update
        sharded = [e.module for e in entries if e.kind == EXPERTS and e.sequence_parallel]
        track_split_loads(model, sharded, tp_group, cp_group)
    for attr, value in (("tp_group", tp_group), ("sequence_parallel", sequence_parallel)):
        if hasattr(model, attr):  # tessel's GPT: its loss reads the group
            setattr(model, attr, value)
    return model


def _sequence_layout(model: nn.Module, entries: list[Entry]) -> HFSequenceLayout:
    """The Hugging Face residual stream's layout; its norms join the plan (style ``norm``), and so do the
    modules beside split experts, the layers' own linear layers (Gemma 4's per-layer input gate) and the layers' own
    parameters (Doge's residual scales), which see this rank's tokens (style ``replicated_with_grad_allreduce``)."""
    modules = dict(model.named_modules())
    latent_projections(entries, modules)
    for e in entries:  # a mixer's projections of its own tensors read the whole sequence, as latent-fed columns do
        parent, _, leaf = e.name.rpartition(".")
        e.latent_fed = e.latent_fed or leaf in inner_projections(modules[parent])
    experts = [e.name for e in entries if e.kind == EXPERTS]
    fed = [e.name for e in entries if (e.kind in RING_COLUMNS and not e.latent_fed) or e.latent]
    layout = HFSequenceLayout.find(model, fed, experts)
    whole = {e.name for e in entries if e.kind == REPLICATE and e.latent_fed}  # replicated, reading a latent
    layout.check(model, {e.name for e in entries if e.kind in (*SPLIT_LINEAR, GROUPED_COLUMN) or e.latent} | whole)
    for e in entries:  # it would read the placeholder the block's ring hands its columns (Doge's router_gate)
        if e.kind == COLUMN_GATHER and e.name.rpartition(".")[0] in layout.blocks:
            _fail(e, "a column layer that gathers its output inside a block whose projections gather the sequence "
                     "under sequence_parallel=True; pass sequence_parallel=False")  # fmt: skip
    named = {e.name for e in entries}
    entries.extend(Entry(n, modules[n], NORM, NORM) for n in layout.norms if n not in named)
    local = [n for n in expert_block_modules(model, layout.local_blocks, experts) if n not in named]
    local += [n for n in expert_block_modules(model, layout.token_blocks, experts) if n not in named]  # on the shard
    local += [n for n in layout.layers if n not in named and modules[n]._parameters]  # Doge's residual scales
    entries.extend(Entry(n, modules[n], GRAD_ALL_REDUCE, GRAD_ALL_REDUCE) for n in local)
    return layout


def _context_layout(model: nn.Module, tp_group, cp_group) -> HFContextLayout | list[nn.Module] | None:
    """What ``cp_group`` changes: a Hugging Face decoder's layout, or tessel's modules that take a cp group."""
    if cp_group is None:
        return None
    check_peer_group(cp_group, tp_group, caller="parallelize", name="cp_group",
                     why="a rank's tensor-parallel and context-parallel peers must be distinct ranks (a (cp x tp) "
                         "grid, as init_parallel(cp=) builds)")  # fmt: skip
    if is_hf_model(model):
        return HFContextLayout.find(model)
    takers = [m for m in model.modules() if hasattr(m, "cp_group")]
    if not takers:
        raise ValueError(f"parallelize: cp_group needs tessel's GPT-style attention (modules with a cp_group) or a "
                         f"Hugging Face decoder; {type(model).__name__} has neither")  # fmt: skip
    return takers


# ---------------------------------------------------------------------------------------------------- validation


def _local_heads(model: nn.Module, entries: list[Entry], t: int) -> list[tuple[nn.Module, dict[str, int]]]:
    """The head-count attributes to set on attention modules; raises when heads do not split over ``t``."""
    parents: dict[str, list[Entry]] = {}
    for e in entries:
        if e.kind in BY_HEADS and "." in e.name:
            parents.setdefault(e.name.rsplit(".", 1)[0], []).append(e)
    heads = []
    for parent_name, children in parents.items():
        parent = model.get_submodule(parent_name)
        if any(e.max_chunks for e in children):  # its query heads and a copy of the kv head they read
            heads.append((parent, replicated_updates(parent, t)))
            continue
        if isinstance(parent, ParallelAttention):
            check_heads(parent_name, parent.n_head, parent.n_kv_head, t)
            continue
        try:  # a mixer's forward splits its channels by its head and group counts
            updates = mixer_updates(parent, t)
        except ValueError as err:
            raise ValueError(f"parallelize: {parent_name}: {err}") from None
        if updates is not None:
            heads.append((parent, updates))
            continue
        _check_head_widths(parent_name, parent, children, t)
        if is_delta_net(parent):  # linear attention: its forward splits its channels by its head counts
            if not is_delta_net(parent, t):
                raise ValueError(f"parallelize: {parent_name}: its {parent.num_k_heads} key heads do not split over "
                                 f"{t} tensor-parallel ranks")  # fmt: skip
            heads.append((parent, delta_net_updates(parent, t)))
            continue
        try:
            updates = local_head_updates(parent, t)
        except ValueError as err:
            raise ValueError(f"parallelize: {parent_name}: {err}") from None
        if any(e.kind == COLUMN_QKV for e in children) and fused_qkv_parts(parent) is not None:
            # its forward slices q, k, v by its config's head counts (Phi-3)
            config = parent.config
            updates["config"] = LocalHeadsConfig(config, num_attention_heads=config.num_attention_heads // t,
                                                 num_key_value_heads=config.num_key_value_heads // t)  # fmt: skip
        if updates:
            heads.append((parent, updates))
    return heads


def _attention_parents(model: nn.Module, entries: list[Entry]) -> dict[str, nn.Module]:
    """The modules whose child linear layers are split by heads (column or row), by name."""
    names = {e.name.rsplit(".", 1)[0] for e in entries if e.kind in BY_HEADS and "." in e.name}
    return {name: model.get_submodule(name) for name in sorted(names)}


def _fail(e: Entry, why: str) -> None:
    raise ValueError(f"parallelize: {e.name} ({type(e.module).__name__}, style {e.style!r}): {why}")


def _validate_entry(e: Entry, t: int, model: nn.Module) -> None:
    m = e.module
    if e.kind in SPLIT_LINEAR:
        parallel = ColumnParallelLinear if e.kind in COLUMNS else RowParallelLinear
        if isinstance(m, parallel) and e.kind not in PACKED:
            if m.tp_size != 1:
                _fail(e, f"already split over {m.tp_size} ranks")
        elif not isinstance(m, nn.Linear):
            _fail(e, f"expected an nn.Linear{'' if e.kind in PACKED else ' or ' + parallel.__name__}")
        elif type(m).forward is not nn.Linear.forward:
            _fail(e, "it overrides nn.Linear.forward, which the parallel layer would not reproduce")
        if e.kind in (ROW, ROW_SPLIT, ROW_SHARED, ROW_HEADS):
            if e.kind == ROW_HEADS and m.out_features % t:
                _fail(e, f"its {m.out_features} heads' outputs do not split over the tensor-parallel size {t}")
            if m.in_features % t:
                _fail(e, f"in_features={m.in_features} is not divisible by the tensor-parallel size {t}")
            return
        out = m.out_features
        if e.kind == PACKED_COLUMN:
            if out % 2:
                _fail(e, f"out_features={out} cannot hold two packed halves")
            out = e.parts = (out // 2, out // 2)
        elif e.kind == COLUMN_QKV:
            parent = model.get_submodule(e.name.rpartition(".")[0])
            leaf = e.name.rpartition(".")[2]
            out = e.parts = packed_parts(parent, leaf) or fused_qkv_parts(parent) or classic_qkv_parts(parent, leaf)
            if out is None:
                _fail(e, "expected the qkv_proj of an attention module whose config's num_attention_heads and "
                         "num_key_value_heads and whose head_dim give its width (H + 2·Hkv)·head_dim, GPT-2's c_attn "
                         "or MPT's Wqkv, or the input projection of a Gated DeltaNet, Mamba-2 or short-convolution "
                         "block")  # fmt: skip
        parts = (out,) if isinstance(out, int) else out
        for n, c in zip(parts, part_chunks(parts, e.max_chunks, t)):  # kv parts replicated: cut into fewer chunks
            if n % c:
                _fail(e, f"out_features {m.out_features} (part {n}) is not divisible by the tensor-parallel size {t}")
    elif e.kind == COLUMN_CONV:
        parent_name, _, leaf = e.name.rpartition(".")
        e.parts = packed_parts(model.get_submodule(parent_name), leaf)
        if e.parts is None:
            _fail(e, "expected the depthwise convolution of a Gated DeltaNet, Mamba-2 or short-convolution block "
                     "(tessel.layers.hf_linear_attention, tessel.layers.hf_mixers)")  # fmt: skip
        if any(n % t for n in e.parts):
            _fail(e, f"its channels {e.parts} do not split over the tensor-parallel size {t}")
    elif e.kind == GATED_NORM:
        parent_name, _, leaf = e.name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if not is_mamba2(parent) or leaf != "norm":
            _fail(e, "expected the gated norm of a Mamba-2 mixer (tessel.layers.hf_mixers)")
        e.groups = parent.n_groups
    elif e.kind == MLA_KV_A:
        if not isinstance(m, nn.Linear) or type(m).forward is not nn.Linear.forward:
            _fail(e, "expected an nn.Linear (MLA's kv_a_proj_with_mqa) that does not override forward")
        try:
            e.rope_dim = mla_rope_dim(model, e.name, m)
        except ValueError as err:
            _fail(e, str(err))
    elif e.kind == EXPERTS:
        try:
            e.splits = expert_splits(m, t, e.expert_split)
        except ValueError as err:
            _fail(e, str(err))
        if e.ep_group is None and (e.expert_split == "features" or e.style == "ep_dispatch_experts"):
            # else a keyword overrides the plan
            check_parameter_styles(e.name, m, e.splits, e.parameter_styles)
    elif e.kind == EMBEDDING:
        if isinstance(m, VocabParallelEmbedding):
            if m.tp_size != 1:
                _fail(e, f"already split over {m.tp_size} ranks")
        elif not isinstance(m, nn.Embedding):
            _fail(e, "expected an nn.Embedding or a VocabParallelEmbedding")
        elif type(m).forward is not nn.Embedding.forward:
            _fail(e, "it overrides nn.Embedding.forward, which VocabParallelEmbedding would not reproduce")
        elif m.max_norm is not None or m.scale_grad_by_freq or m.sparse:
            _fail(e, "max_norm, scale_grad_by_freq and sparse embeddings cannot be split over the vocabulary")
        if m.num_embeddings % t:
            _fail(e, f"num_embeddings={m.num_embeddings} is not divisible by the tensor-parallel size {t}")


def _check_head_widths(parent_name: str, parent: nn.Module, children: list[Entry], t: int) -> None:
    """With a ``head_dim``, each projection's width must hold a whole number of heads per rank."""
    head_dim = head_dim_of(parent)
    if head_dim is None:
        return
    for e in children:
        m = e.module
        if e.kind == ROW:
            widths = [m.in_features]
        elif e.kind in PACKED:
            widths = list(e.parts)
        else:
            widths = [m.out_features] if isinstance(m.out_features, int) else list(m.out_features)
        for width in widths:
            heads, rest = divmod(width, head_dim)
            if rest == 0 and heads % t:
                raise ValueError(
                    f"parallelize: {e.name}: {heads} heads (width {width}, head_dim {head_dim}) do not split over "
                    f"{t} tensor-parallel ranks (kv heads are replicated over the ranks only in attention of "
                    f"q_proj/k_proj/v_proj or a fused [q; k; v] whose query heads split, with no norm over every kv "
                    f"head): use a tensor-parallel size that divides every head count"
                )


# ---------------------------------------------------------------------------------------------------- building


def _build(e: Entry, tp_group, overlap) -> nn.Module | None:
    """The replacement of ``e.module`` (None: the module stays, with hooks). Changes nothing of the model."""
    if e.latent:  # under SP: multiplies the shard, gathers the latent
        return RingLatentLinear.from_linear(e.module)
    column = RingColumnLinear if e.gathered else ColumnParallelLinear
    kw = {} if overlap is None else {"overlap": overlap}
    if e.kind == COLUMN:  # max_chunks: a k_proj or v_proj of kv heads fewer than the ranks, copied on several
        kw |= {"max_chunks": e.max_chunks} if e.max_chunks else {}  # (else a world-of-one layer's own are kept)
        return column.from_linear(e.module, tp_group=tp_group, sequence_parallel=e.sequence_parallel, **kw)
    if e.kind == COLUMN_GATHER:
        return ColumnParallelLinear.from_linear(e.module, tp_group=tp_group, gather_output=True, **kw)
    if e.kind in PACKED:
        return column.from_packed(
            e.module,
            e.parts,
            tp_group=tp_group,
            sequence_parallel=e.sequence_parallel,
            overlap="auto" if overlap is None else overlap,
            max_chunks=e.max_chunks,
        )
    if e.kind == COLUMN_CONV:
        return split_depthwise_conv(e.module, e.parts, tp_group)
    if e.kind == GROUPED_COLUMN:
        return split_grouped_linear(e.module, group_rank(tp_group), group_size(tp_group), e.name)
    if e.kind == ROW:
        return RowParallelLinear.from_linear(e.module, tp_group=tp_group, sequence_parallel=e.sequence_parallel, **kw)
    if e.kind == ROW_SPLIT:
        return RowParallelLinear.from_linear(e.module, tp_group=tp_group, input_is_parallel=False, **kw)
    if e.kind in (ROW_SHARED, ROW_HEADS):
        layer = SharedRowLinear.from_linear(e.module, tp_group=tp_group, **kw)
        layer.per_head = e.kind == ROW_HEADS
        return layer
    if e.kind == EXPERTS:
        ep = e.ep_group is not None
        e.shards = shard_experts(e.module, e.splits, e.ep_group if ep else tp_group, expert_parallel=ep)
        return None
    if e.kind == MOE:  # tessel's own experts
        return ParallelMoE.from_module(e.module, tp_group=tp_group, sequence_parallel=e.sequence_parallel,
                                       ep_group=e.ep_group, cp_group=e.module.cp_group)  # fmt: skip
    if e.kind == EMBEDDING:
        return VocabParallelEmbedding.from_embedding(e.module, tp_group=tp_group, sequence_parallel=e.sequence_parallel)
    if e.kind == COLUMN_NORM:
        try:
            return SplitRMSNorm.from_module(e.module, tp_group=tp_group)
        except (TypeError, ValueError) as err:
            _fail(e, str(err))
    if e.kind == GATED_NORM:
        return SplitGatedRMSNorm.from_module(e.module, e.groups, tp_group)
    if e.kind == NORM and e.sequence_parallel and any(True for _ in e.module.parameters()):
        norm = sequence_parallel_norm(e.module, tp_group)
        if norm is None:  # a norm tessel's kernels do not reproduce keeps its forward; its grads are reduced, those
            e.kind, e.nested = GRAD_ALL_REDUCE, True  # of what it holds too (AXK2's norm and its gate's MLP)
        return norm
    return None


def _rings(layout: HFSequenceLayout, entries: list[Entry], tp_group) -> dict[str, SequenceRing]:
    """One ring per Hugging Face block under sequence parallelism, over the block's column projections."""
    columns: dict[str, list[RingColumnLinear]] = {}
    latents: dict[str, list[RingLatentLinear]] = {}
    for e in entries:  # each in the block it lies in (Zamba 2's adapters: in a Sequential of their MLP's)
        if e.gathered or e.latent:
            block = max((b for b in layout.blocks if e.name.startswith(b + ".")), key=len)
            (latents if e.latent else columns).setdefault(block, []).append(e.new)
    return {block: SequenceRing(block, columns.get(block, []), tp_group, latents.get(block, []))
            for block in layout.blocks}  # fmt: skip


# ---------------------------------------------------------------------------------------------------- installing


def _install(model: nn.Module, entries: list[Entry], tp_group) -> None:
    for e in entries:
        if e.kind == MLA_KV_A:  # the module itself, or under SP the projection that gathers its latent
            hook = lambda m, args, out, e=e: mla_shared_key(out, e.rope_dim, tp_group)
            (e.new or e.module).register_forward_hook(hook)
        if e.new is not None:
            parent, _, child = e.name.rpartition(".")
            setattr(model.get_submodule(parent), child, e.new)
        elif e.kind == EXPERTS:
            assign_shards(e.module, e.shards)  # dotted names too (DBRX's stacked experts), their local widths
            install_expert_hooks(e.module, tp_group, e.sequence_parallel, e.expert_split, e.ep_group)
            if e.ep_group is not None and group_size(tp_group) > 1:  # whole experts, each rank's own tokens
                reduce_parameter_grads(e.module, tp_group)
        elif e.kind == SHARED_OUTPUT:  # replicated, read by every rank's heads: its output's gradient summed
            e.module.register_forward_hook(lambda m, a, out: map_first_output(out, lambda y: copy_to_tp(y, tp_group)))
        elif e.kind == GRAD_ALL_REDUCE:
            for m in e.module.modules() if e.nested else (e.module,):  # not the split ones it holds (DBRX's attn)
                if m._parameters and not any(is_tp_sharded(p) or expert_spec(p) for p in m.parameters(recurse=False)):
                    reduce_parameter_grads(m, tp_group)
        elif e.kind == ALL_REDUCE:
            e.module.register_forward_hook(
                lambda m, args, out: map_first_output(out, lambda y: reduce_from_tp(y, tp_group))
            )
        else:
            assert e.kind not in SPLIT_LINEAR, f"{e.name}: a split layer was not built"
