"""Plans for :func:`~tessel.layers.parallelize`: the styles, their canonical names, and the entries a plan
matches in a model (module-name globs, ``*`` one name segment, ``?`` one character of a segment)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from .hf import hf_tp_plan, is_hf_model
from .hf_attention import MLA_INDEXER_INPUTS, MLA_INDEXER_QUERIES, MLA_LATENT_PROJECTIONS, MLA_LATENT_READERS
from .hf_classic import classic_plan
from .hf_experts import ExpertSplit
from .hf_grouped_output import GROUPED_OUTPUT_LATENTS
from .hf_linear_attention import KIMI_LATENT_FED, KIMI_LATENTS, is_kimi_delta
from .hf_plans import ACTIVATION_NAMES, HEAD_NORM_NAMES, head_dim_of, head_split_plan, whole_attention_plan

__all__ = ["STYLES", "Entry", "glob_regex", "map_first_output", "match_plan", "own_plan", "tied_parameters"]

COLUMN, COLUMN_GATHER, PACKED_COLUMN = "colwise", "colwise_gather", "packed_colwise"
ROW, ROW_SPLIT, EMBEDDING, NORM = "rowwise", "rowwise_split", "embedding", "norm"
GRAD_ALL_REDUCE, ALL_REDUCE, REPLICATE = "replicated_with_grad_allreduce", "all_reduce", "replicate"
EXPERTS, MLA_KV_A, MOE, COLUMN_NORM = "experts", "mla_kv_a_proj", "moe", "colwise_norm"
COLUMN_QKV, COLUMN_CONV, GATED_NORM = "colwise_qkv", "colwise_conv", "colwise_gated_norm"
ROW_SHARED, ROW_HEADS = "rowwise_shared", "rowwise_heads"
GROUPED_COLUMN, SHARED_OUTPUT = "colwise_grouped", "shared_output"  # DeepSeek-V4's attention: hf_grouped_output
LATENT = "latent"  # not a style: a replicated projection of multi-head latent attention under sequence parallelism

STYLES: dict[str, str] = {
    COLUMN: COLUMN, "local_colwise": COLUMN,
    COLUMN_GATHER: COLUMN_GATHER, "colwise_gather_output": COLUMN_GATHER, "colwise_rep": COLUMN_GATHER,
    "gather": COLUMN_GATHER,
    PACKED_COLUMN: PACKED_COLUMN,
    ROW: ROW, "local_rowwise": ROW,
    ROW_SPLIT: ROW_SPLIT, "rowwise_split_input": ROW_SPLIT, "rowwise_rep": ROW_SPLIT,
    EMBEDDING: EMBEDDING, "embedding_rowwise": EMBEDDING,
    NORM: NORM, "sequence_parallel": NORM,
    GRAD_ALL_REDUCE: GRAD_ALL_REDUCE, ALL_REDUCE: ALL_REDUCE,
    REPLICATE: REPLICATE, "local": REPLICATE, "local_params": REPLICATE,
    EXPERTS: EXPERTS, "moe_tp_experts": EXPERTS, "ep_dispatch_experts": EXPERTS, MLA_KV_A: MLA_KV_A,
    "ep_router": REPLICATE, MOE: MOE, COLUMN_NORM: COLUMN_NORM, COLUMN_QKV: COLUMN_QKV, COLUMN_CONV: COLUMN_CONV,
    GATED_NORM: GATED_NORM, ROW_SHARED: ROW_SHARED, ROW_HEADS: ROW_HEADS, GROUPED_COLUMN: GROUPED_COLUMN,
    SHARED_OUTPUT: SHARED_OUTPUT,
}  # fmt: skip
_REFUSED = ("embedding_colwise", "packed_rowwise", "local_packed_rowwise", "moe_identity_expert", "grouped_gemm")
SPLIT_LINEAR = (COLUMN, COLUMN_GATHER, PACKED_COLUMN, COLUMN_QKV, ROW, ROW_SPLIT, ROW_SHARED, ROW_HEADS)
PACKED = (PACKED_COLUMN, COLUMN_QKV)  # one column layer over parts split separately, returning one tensor
COLUMNS = (COLUMN, COLUMN_GATHER, *PACKED)
RING_COLUMNS = (COLUMN, *PACKED)  # column layers a Hugging Face block's sequence ring feeds under SP
BY_HEADS = (COLUMN, *PACKED, ROW, ROW_SHARED, ROW_HEADS)  # projections whose parent's heads are split


@dataclass
class Entry:
    """One module a plan names, and what parallelize builds and installs for it."""

    name: str
    module: nn.Module
    style: str  # as written in the plan
    kind: str  # one of the canonical styles
    sequence_parallel: bool = False
    gathered: bool = False  # a column layer fed by its block's sequence ring (Hugging Face under SP)
    parts: tuple[int, ...] | None = None  # packed column layers: the global widths of their parts
    latent: bool = False  # under SP: a projection of a latent-attention block's input that gathers its output
    latent_fed: bool = False  # under SP: a column a latent feeds, reading the whole sequence
    new: nn.Module | None = None
    splits: list[ExpertSplit] | None = None  # experts: how each parameter splits
    shards: dict[str, nn.Parameter] | None = None  # experts: this rank's parameters, installed in place
    parameter_styles: dict[str, tuple[str, str]] = field(default_factory=dict)  # experts: (glob, style) by name
    groups: int | None = None  # colwise_gated_norm: the groups of its mixer's norm
    rope_dim: int | None = None  # mla_kv_a_proj: the width of the rotary key shared by every head
    expert_split: str = "features"  # experts: "features" or "experts"
    ep_group: object = None  # experts split over an expert-parallel group instead of the tensor-parallel one
    transposed: bool = False  # a Conv1D (weight [in, out]) split as the nn.Linear it computes
    max_chunks: tuple | None = None  # k/v (or fused [q; k; v]) of kv heads fewer than the ranks: copies of each
    nested: bool = False  # replicated_with_grad_allreduce: its submodules' parameters too (a norm wrapping a gate)


def own_plan(model: nn.Module, t: int = 1) -> dict[str, str]:
    """tessel's GPT's plan, or a Hugging Face model's as :mod:`~tessel.layers.hf_plans` rewrites it; a Hugging Face
    model without a plan of its own gets the blocks :func:`whole_attention_plan` finds (Mamba-2's, Zamba 2's) and those
    of the classic decoders (GPT-2, OPT, BLOOM, Falcon...: :mod:`~tessel.layers.hf_classic`)."""
    plan = getattr(model, "tessel_tp_plan", None) or hf_tp_plan(model)
    if is_hf_model(model) and (plan or t > 1):
        plan = whole_attention_plan(model, head_split_plan(model, plan or {}, glob_regex, t), glob_regex, t)
    if is_hf_model(model):  # also over one rank: its layers tessel's (the fused loss takes the head's)
        plan = classic_plan(model, plan or {}, glob_regex, t)
    if not plan and is_hf_model(model) and t == 1:  # nothing splits over one rank (context parallelism alone)
        return {}
    if not plan:
        raise ValueError(
            f"parallelize: {type(model).__name__} has no tensor-parallel plan (no tessel_tp_plan, no Hugging Face "
            "config.base_model_tp_plan); pass plan={module-name glob: style}, e.g. {'layers.*.fc1': 'colwise'}"
        )
    return dict(plan)


def glob_regex(glob: str) -> re.Pattern:
    """``*`` → one name segment, ``?`` → one character of a segment; everything else literal."""
    return re.compile("".join("[^.]*" if c == "*" else "[^.]" if c == "?" else re.escape(c) for c in glob))


def _check_style_type(style, glob: str) -> None:
    if not isinstance(style, str):
        raise TypeError(f"parallelize: the style of {glob!r} must be a str, received {type(style).__name__}")


def _canonical(style, glob: str) -> str:
    _check_style_type(style, glob)
    if style in _REFUSED:
        raise ValueError(f"parallelize: {glob!r}: the Hugging Face style {style!r} is not supported by tessel")
    if style not in STYLES:
        raise ValueError(f"parallelize: {glob!r}: unknown style {style!r}; expected one of {sorted(STYLES)}")
    return STYLES[style]


def match_plan(model: nn.Module, plan, strict: bool = True) -> tuple[list[Entry], set[str]]:
    """One entry per matched module, in the model's order, and the names of the per-head parameters the
    plan names. Every glob must match a module (``strict``; a Hugging Face model's own plan names modules
    some configurations lack, e.g. the dense MLPs of a model whose layers are all experts), parameters of
    modules the plan splits as experts, or ``colwise`` parameters of modules whose projections it splits
    by heads (one value per query head: attention sinks, a gate's per-head bias)."""
    if not isinstance(plan, Mapping):
        raise TypeError(f"parallelize: plan must be a mapping of module-name globs to styles, received {plan!r}")
    modules = [(name, m) for name, m in model.named_modules() if name]
    chosen: dict[str, Entry] = {}
    parameter_rules = []
    for glob, style in plan.items():
        if not isinstance(glob, str):
            raise TypeError(f"parallelize: plan keys must be module-name globs (str), received {glob!r}")
        regex = glob_regex(glob)
        hits = [(name, m) for name, m in modules if regex.fullmatch(name)]
        if not hits:
            params = [p for p, _ in model.named_parameters() if regex.fullmatch(p)]
            if params:  # their styles are read in Hugging Face's terms of the dim they split (below)
                _check_style_type(style, glob)
                parameter_rules.append((glob, style, params))
            elif strict:
                _canonical(style, glob)
                raise ValueError(f"parallelize: plan glob {glob!r} matches no module of {type(model).__name__}")
            continue
        kind = _canonical(style, glob)
        for name, m in hits:
            k = EMBEDDING if kind == ROW and isinstance(m, nn.Embedding) else kind  # Hugging Face 4.x's rowwise
            if name in chosen and chosen[name].kind != k:
                raise ValueError(f"parallelize: {name} is matched as {chosen[name].style!r} and as {style!r}")
            chosen[name] = Entry(name, m, style, k)
    experts = {name for name, e in chosen.items() if e.kind == EXPERTS}
    by_heads = {name.rsplit(".", 1)[0] for name, e in chosen.items() if e.kind in BY_HEADS}
    head_params = set()
    for glob, style, params in parameter_rules:
        for p in params:
            owner, _, leaf = p.rpartition(".")
            if owner in by_heads and owner not in experts:
                if style not in ("colwise", "local_colwise"):
                    raise ValueError(f"parallelize: plan glob {glob!r} splits {p}, a parameter of a module split by "
                                     f"heads, as {style!r}; tessel splits it by heads ('colwise')")  # fmt: skip
                head_params.add(p)
                continue
            if owner not in experts:
                raise ValueError(f"parallelize: plan glob {glob!r} names a parameter; plans name modules, and "
                                 f"parameters only of modules split as 'moe_tp_experts' or by heads (received "
                                 f"{p})")  # fmt: skip
            chosen[owner].parameter_styles[leaf] = (glob, style)
    if not chosen and (strict or plan):
        raise ValueError(f"parallelize: the plan matches no module of {type(model).__name__}: {dict(plan)}")
    chosen.update(_shares_in_split_blocks(dict(modules), chosen))
    order = {name: i for i, (name, _) in enumerate(modules)}
    return sorted(chosen.values(), key=lambda e: order[e.name]), head_params


def _shares_in_split_blocks(modules: dict[str, nn.Module], chosen: dict[str, Entry]) -> dict[str, Entry]:
    """Entries (style ``replicated_with_grad_allreduce``) for what the plan leaves whole inside blocks whose column
    and row projections it splits, and that acts on this rank's share of the block: learnable activations (Apertus's
    xIELU: this rank's intermediate features) and per-head q/k norms (``[head_dim]`` weights applied to each head:
    this rank's heads, in plans that do not name them, such as Sarvam-MoE's). Each rank's gradient of their
    parameters is a share, summed over the group."""
    kinds: dict[str, set[str]] = {}
    for name, e in chosen.items():
        kinds.setdefault(name.rpartition(".")[0], set()).add(
            "row" if e.kind == ROW else "column" if e.kind in RING_COLUMNS else ""
        )
    found = {}
    for parent, seen in kinds.items():
        if not {"row", "column"} <= seen or parent not in modules:
            continue
        head_dim = head_dim_of(modules[parent])
        for child, m in modules[parent].named_children():
            name = f"{parent}.{child}"
            if name in chosen or not any(True for _ in m.parameters()):
                continue
            weight = getattr(m, "weight", None)
            per_head = child in HEAD_NORM_NAMES and isinstance(weight, torch.Tensor) and weight.shape == (head_dim,)
            if child in ACTIVATION_NAMES or per_head:
                found[name] = Entry(name, m, GRAD_ALL_REDUCE, GRAD_ALL_REDUCE)
    return found


def tied_parameters(model: nn.Module, entries: list[Entry]) -> list[tuple[tuple[str, str], tuple[str, str]]]:
    """Parameters shared by replaced modules (a tied lm_head and embedding), to share again after the swap."""
    replaced = {e.name: e for e in entries if e.new is not None}
    owners: dict[int, list[tuple[str, str]]] = {}
    for mod_name, m in model.named_modules(remove_duplicate=False):
        for p_name, p in m.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((mod_name, p_name))
    ties = []
    for group in owners.values():
        names = sorted({mod for mod, _ in group})
        if len(names) < 2 or not any(n in replaced for n in names):
            continue
        outside = [n for n in names if n not in replaced]
        if outside:
            raise ValueError(f"parallelize: {names[0]} shares a parameter with {outside}, which the plan does not "
                             f"split the same way: split both or untie them")  # fmt: skip
        source, source_p = group[0]
        want = getattr(replaced[source].new, source_p)
        for target, target_p in group[1:]:
            got = getattr(replaced[target].new, target_p)
            if got.shape != want.shape or getattr(got, "tp_dim", 0) != getattr(want, "tp_dim", 0):
                raise ValueError(f"parallelize: {source} and {target} share a parameter but are split differently "
                                 f"({tuple(want.shape)} vs {tuple(got.shape)})")  # fmt: skip
            ties.append(((target, target_p), (source, source_p)))
    return ties


ADAPTERS = "gate_up_proj_adapter_list"  # Zamba 2's MLP: one low-rank adapter (H → r → 2I) per hybrid layer


def latent_projections(entries: list[Entry], modules: dict[str, nn.Module]) -> None:
    """Narrow replicated projections of a block's input under sequence parallelism, which multiply the shard and
    gather their latents (``latent``: :class:`~tessel.layers.hf.RingLatentLinear`), and the columns they feed, which
    read the whole sequence (``latent_fed``). Multi-head latent attention (DeepSeek-V2/V3): ``kv_a_proj_with_mqa``
    and ``q_a_proj`` feed ``kv_b_proj`` and ``q_b_proj`` (the block's other columns read its input and are ring
    columns: ``q_proj`` where there is one, an output gate). Zamba 2's
    MLP adapters: each one's first projection (to its rank) feeds its second. Entries are added for the replicated
    projections the plan leaves out. Kimi Delta Attention: its forget and output gates' first projections feed their
    second ones. A sparse attention's indexer inside such a block: ``wk`` and ``weights_proj``
    are latents; ``wq_b``, which reads the query latent, stays replicated (``latent_fed``)."""
    blocks = {e.name.rpartition(".")[0] for e in entries if e.kind == MLA_KV_A}
    named, added = {e.name for e in entries}, []
    for e in entries:
        block, _, leaf = e.name.rpartition(".")
        if block in blocks:
            if e.kind == MLA_KV_A:
                e.latent = True
            elif e.kind in RING_COLUMNS and leaf in MLA_LATENT_READERS:
                e.latent_fed = True
        adapter, _, index = block.rpartition(".")
        if e.kind in RING_COLUMNS and adapter.endswith(f".{ADAPTERS}") and index.isdigit() and leaf == "1":
            e.latent_fed = True
            first = modules[block][0]
            if isinstance(first, nn.Linear) and f"{block}.0" not in named:
                added.append(Entry(f"{block}.0", first, LATENT, LATENT, latent=True))
    # Kimi Delta Attention's low-rank gates: their first projections (to one head's width) are latents of the block
    for block in (n for n, m in modules.items() if n and is_kimi_delta(m)):
        for e in entries:
            if e.name in (f"{block}.{c}" for c in KIMI_LATENT_FED) and e.kind in RING_COLUMNS:
                e.latent_fed = True
        for child in KIMI_LATENTS:
            name = f"{block}.{child}"
            if name not in named and isinstance(modules.get(name), nn.Linear):
                added.append(Entry(name, modules[name], LATENT, LATENT, latent=True))
    entries.extend(added)
    for block in sorted(blocks):
        for child, m in modules[block].named_children():
            name = f"{block}.{child}"
            if isinstance(m, nn.Linear) and name not in named and child in MLA_LATENT_PROJECTIONS:
                entries.append(Entry(name, m, LATENT, LATENT, latent=True))
        # a sparse attention's indexer (DeepSeek-V3.2's, GLM-5's), replicated: its projections of the block's input
        # to its key and head weights are latents too, its query's reads the query latent (the whole sequence)
        indexer = modules.get(f"{block}.indexer")
        for child, m in indexer.named_children() if indexer is not None else ():
            name = f"{block}.indexer.{child}"
            if isinstance(m, nn.Linear) and name not in named and child in MLA_INDEXER_INPUTS:
                entries.append(Entry(name, m, LATENT, LATENT, latent=True))
            elif isinstance(m, nn.Linear) and name not in named and child in MLA_INDEXER_QUERIES:
                entries.append(Entry(name, m, REPLICATE, REPLICATE, latent_fed=True))
    # DeepSeek-V4's attention: its projections of the block's input (query latent, key-and-value head, the
    # compressors' and their indexer's) are latents; its queries and its compressed indexer's read the query latent
    v4_blocks = {e.name.rpartition(".")[0] for e in entries if e.kind == GROUPED_COLUMN}
    for e in entries:
        e.latent_fed = e.latent_fed or (e.kind in RING_COLUMNS and e.name.rpartition(".")[0] in v4_blocks)
    for block in sorted(v4_blocks):
        for child in (*GROUPED_OUTPUT_LATENTS, "compressor.indexer.q_b_proj"):
            name, m = f"{block}.{child}", modules.get(f"{block}.{child}")
            if isinstance(m, nn.Linear) and name not in named:
                latent = child in GROUPED_OUTPUT_LATENTS
                style = LATENT if latent else REPLICATE
                entries.append(Entry(name, m, style, style, latent=latent, latent_fed=not latent))


def map_first_output(out, fn):
    """``fn`` of a module's output tensor, or of the first of its output tuple (the rest kept)."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return (fn(out[0]), *out[1:])
    raise ValueError(f"parallelize: style 'all_reduce' needs a module returning a tensor, received {type(out)}")
