"""Mixtures of experts of Hugging Face models split over tensor-parallel ranks (style ``moe_tp_experts``).

Hugging Face stores a layer's experts as one module of 3-d parameters (Mixtral, Qwen2/3-MoE, OLMoE,
GPT-OSS and some sixty more in transformers 5.x), whose class says how they are laid out
(``is_transposed``, ``is_concatenated``, ``has_gate``, ``has_bias``). Each of ``t`` ranks keeps every
expert, with ``I/t`` of its ``I`` intermediate features (Megatron's tensor-parallel experts)::

    gate_up_proj  [E, 2I, H] (transposed: [E, H, 2I])  rank r: gate rows r·I/t … and up rows r·I/t …
                                                       (interleaved [g0, u0, g1, u1, …]: pairs r·I/t …)
    up_proj       [E, I, H]  (has_gate=False)           rows r·I/t …
    down_proj     [E, H, I]  (transposed: [E, I, H])   columns r·I/t …
    gate_up_proj_bias [E, 2I], up_proj_bias [E, I]     as their weights' rows
    down_proj_bias [E, H]                               whole on every rank, added by rank 0 only

Experts fed every token once per expert, with the routing scores already applied (Llama 4's: ``[E·T, H]``
rows, no routing arguments), split by features only. Every rank runs the router on the same tokens and
the experts on its features; the experts' output is
a partial sum, all-reduced (``reduce_from_tp``). The hidden states and the routing weights enter the
experts through ``copy_to_tp`` (identity forward, all-reduce of the gradient), so the router, and
every module replicated beside the experts (a shared expert), receive the complete gradient on every
rank. The routing itself (which expert a token goes to) is computed identically on every rank.

Under sequence parallelism the block holding the experts (``mlp``) receives the sequence shard and
stays local to its tokens: the router and any shared expert run on this rank's tokens (their weight
gradients are summed over the group, as the norms' are), and the experts all-gather the hidden
states, the chosen experts and the routing weights of every rank's tokens, and reduce-scatter their
output back to the shard (the gradients of the gathered tensors are summed on the way back). A shared
expert whose projections the plan splits (DeepSeek-V3, GLM-4-MoE) gathers the shard for them in one ring,
as a dense MLP block does. For the load-balancing loss (``output_router_logits``) each router's logits are
gathered over the group in the model's token order (:func:`gather_router_logits`), so that every rank
computes the dense model's loss. Under context parallelism (``cp_group``) the experts route each rank's
share of the tokens as they are (routing is per token), and the router logits are gathered over the cp
group too, put back in the sequence's order.

Expert parallelism (``parallelize(expert_split="experts")``, or a plan's ``ep_dispatch_experts``): rank ``r``
keeps experts ``r·E/t …`` whole instead; each expert's GEMMs keep their full intermediate width. Without
sequence parallelism every rank routes every token, the routes to other ranks' experts are skipped
(Hugging Face's sentinel id ``E/t``, weight 0), and the same all-reduce sums the ranks' outputs. Under
sequence parallelism each rank keeps its own tokens: every (token, choice) route travels to the rank
of its expert and its output comes back (:func:`~tessel.parallel.collectives.exchange_rows`, an
all-to-all each way), weighted at home, so a rank sends ``k`` rows per token at most instead of
gathering every rank's tokens.

Expert parallelism over data-parallel ranks (``parallelize(ep_group=)``, Megatron-LM's and DeepSpeed-MoE's
layout): the ranks of ``ep_group`` hold different tokens (other batches, or other shards of the sequence under
context parallelism) and different experts, so every route is dispatched by the same all-to-all over
``ep_group``. The experts stay whole on each tensor-parallel rank: no
communication over ``tp_group`` (under sequence parallelism their gradients are summed over it, as the
router's). The parameters are marked ``expert_parallel``: :class:`~tessel.parallel.DDP` reduces them over
the expert-data-parallel group (the ranks holding the same experts) instead of the whole data-parallel group,
and :class:`~tessel.parallel.FSDP` shards them over it.
Every forward is then a collective over ``ep_group``: ranks generating text step together
(``generate(..., synced_gpus=True)`` keeps a rank that has finished running forwards until all have).

``has_post_expert_norm`` (a norm of each expert's whole output) cannot be split and is refused, as is
an experts module with parameters other than the ones above.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from ..parallel.collectives import (
    copy_to_tp,
    exchange_rows,
    gather_from_sequence,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
)
from ..parallel.comm import all_gather, all_to_all, check_peer_group, group_rank, group_size
from ..parallel.context import zigzag_order
from ..parallel.sharding import local_shard
from .hf_stacked_experts import stacked_layout, stacked_splits

__all__ = [
    "ExpertSplit",
    "check_ep_group",
    "check_expert_blocks",
    "check_parameter_styles",
    "expert_block_modules",
    "expert_blocks",
    "expert_splits",
    "gather_router_logits",
    "install_expert_hooks",
    "reduce_parameter_grads",
    "shard_experts",
]  # fmt: skip


_FIRST = ("gate_up_proj", "up_proj")  # the experts' first projection, [E, ...]


@dataclass(frozen=True)
class ExpertSplit:
    """How one parameter of an experts module is split: along ``dim`` in ``parts`` (None: replicated)."""

    name: str
    dim: int | None
    parts: tuple[int, ...] = ()


def _flag(module: nn.Module, name: str, default: bool) -> bool:
    value = getattr(module, name, default)
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, received {value!r}")
    return value


def _expected_shapes(first: str, w2: torch.Tensor, transposed: bool, gated: bool) -> tuple[dict, int, int]:
    """The shapes of every parameter the layout allows, read from ``down_proj``; and ``(I, width of first)``."""
    experts = w2.shape[0]
    inter, hidden = (w2.shape[1], w2.shape[2]) if transposed else (w2.shape[2], w2.shape[1])
    width = 2 * inter if gated else inter
    want = {first: (experts, hidden, width) if transposed else (experts, width, hidden),
            "down_proj": (experts, inter, hidden) if transposed else (experts, hidden, inter),
            f"{first}_bias": (experts, width), "down_proj_bias": (experts, hidden)}  # fmt: skip
    return want, inter, width


def _matches(params: dict, want: dict) -> bool:
    return all(tuple(p.shape) == want[n] for n, p in params.items() if n in want)


def expert_splits(module: nn.Module, t: int, by: str = "features") -> list[ExpertSplit]:
    """The split of each parameter of ``module`` over ``t`` ranks, ``by`` its intermediate ``"features"`` or
    by whole ``"experts"``; ``ValueError`` (without the module's name) when the module is not a Hugging Face
    experts module or does not split.

    A module without ``is_transposed`` (Llama 4's experts) has its layout read from the shapes, when only
    one layout fits them."""
    if by not in ("features", "experts"):
        raise ValueError(f"the experts split by 'features' or 'experts', received {by!r}")
    if stacked_layout(module) is not None:  # DBRX's 2-d weights, expert after expert
        return stacked_splits(module, t, by)
    if _flag(module, "has_post_expert_norm", False):
        raise ValueError("has_post_expert_norm=True: a norm of each expert's whole output cannot be split over ranks")
    concatenated = _flag(module, "is_concatenated", True)
    gated = _flag(module, "has_gate", True)
    first = "gate_up_proj" if gated else "up_proj"
    params = dict(module.named_parameters(recurse=False))
    w1, w2 = params.get(first), params.get("down_proj")
    if w1 is None or w2 is None or w1.dim() != 3 or w2.dim() != 3:
        got = {n: tuple(p.shape) for n, p in params.items()}
        raise ValueError(f"expected 3-d expert parameters {first} and down_proj, received {got}")
    if hasattr(module, "is_transposed"):
        transposed = _flag(module, "is_transposed", False)
    else:
        fits = [tr for tr in (False, True) if _matches(params, _expected_shapes(first, w2, tr, gated)[0])]
        if len(fits) != 1:
            shapes = {n: tuple(p.shape) for n, p in params.items()}
            raise ValueError(f"the layout of the expert parameters {shapes} is {'ambiguous' if fits else 'unknown'}: "
                             "set is_transposed on the module ([experts, in, out] or [experts, out, in])")  # fmt: skip
        transposed = fits[0]
    want, inter, width = _expected_shapes(first, w2, transposed, gated)
    for name, p in params.items():
        if name not in want:
            raise ValueError(f"unexpected parameter {name} {tuple(p.shape)}: tessel splits {sorted(want)} only")
        if tuple(p.shape) != want[name]:
            raise ValueError(f"{name} has shape {tuple(p.shape)}, expected {want[name]} (is_transposed={transposed})")
    if any(True for c in module.children() for _ in c.parameters()):
        raise ValueError("an experts module with parametrised submodules is not a Hugging Face experts module")
    if by == "experts":
        return _whole_expert_splits(module, params, t)
    if inter % t:
        raise ValueError(f"the intermediate size {inter} is not divisible by the tensor-parallel size {t}")
    parts = (inter, inter) if gated and concatenated else (width,)
    splits = [ExpertSplit(first, 2 if transposed else 1, parts), ExpertSplit("down_proj", 1 if transposed else 2,
                                                                             (inter,))]  # fmt: skip
    if f"{first}_bias" in params:
        splits.append(ExpertSplit(f"{first}_bias", 1, parts))
    if "down_proj_bias" in params:
        splits.append(ExpertSplit("down_proj_bias", None))
    return splits


def _whole_expert_splits(module: nn.Module, params: dict, t: int) -> list[ExpertSplit]:
    experts = params["down_proj"].shape[0]
    if experts % t:
        raise ValueError(f"the {experts} experts do not split over the {t} ranks of the group")
    if len(_routing_names(module)) != 3:
        raise ValueError("experts fed every token once per expert are split by 'features' only")
    if not isinstance(getattr(module, "num_experts", None), int):
        raise ValueError("split by 'experts' needs the module's num_experts, which its forward reads")
    return [ExpertSplit(name, 0, (experts,)) for name in params]


def shard_experts(module: nn.Module, splits: list[ExpertSplit], group, expert_parallel: bool = False
                  ) -> dict[str, nn.Parameter]:  # fmt: skip
    """This rank's parameters (new tensors; ``module`` is not changed), tagged for :mod:`tessel.parallel.sharding`,
    or, split over an expert-parallel group, ``expert_parallel = True`` (for :class:`~tessel.parallel.DDP`)."""
    t, r = group_size(group), group_rank(group)
    local = {}
    for s in splits:
        p = module.get_parameter(s.name)
        if s.dim is None:
            continue
        shard = nn.Parameter(local_shard(p.detach(), s.dim, s.parts, r, t).clone(), requires_grad=p.requires_grad)
        if expert_parallel:  # experts [first, first + n) of the module's t·n, for checkpoints and loading
            n = shard.shape[0]
            shard.expert_parallel, shard.expert_range, shard.expert_count = True, (r * n, (r + 1) * n), t * n
        else:
            shard.tensor_parallel, shard.tp_dim, shard.tp_parts = True, s.dim, s.parts
        local[s.name] = shard
    return local


def check_ep_group(ep_group, tp_group) -> int | None:
    """The size of ``ep_group`` (None without one); its ranks must be distinct from ``tp_group``'s peers: its
    ranks hold different tokens, which tensor-parallel peers (the same tokens, or one sequence's shards) do not."""
    why = ("expert-parallel peers must hold other tokens (data- or context-parallel peers), not tensor-parallel ones "
           "(init_parallel(ep=)'s ep_group; for expert parallelism over the tensor-parallel group use "
           "expert_split='experts')")  # fmt: skip
    return check_peer_group(ep_group, tp_group, caller="parallelize", name="ep_group", why=why)


def _tp_share(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, tp_group):
    """This tensor-parallel rank's ``1/t`` of the tokens every rank of ``tp_group`` holds, padded to a multiple of
    ``t`` with tokens routed to expert 0 with weight 0 (their rows come back zero). The hidden states and weights
    pass through :func:`scatter_to_sequence`: the backward all-gathers their gradients over the group."""
    pad = -hidden.shape[0] % group_size(tp_group)
    if pad:
        hidden = torch.cat([hidden, hidden.new_zeros((pad, *hidden.shape[1:]))])
        ids = torch.cat([ids, ids.new_zeros((pad, *ids.shape[1:]))])
        weights = torch.cat([weights, weights.new_zeros((pad, *weights.shape[1:]))])
    n = ids.shape[0] // group_size(tp_group)
    own = ids.narrow(0, group_rank(tp_group) * n, n)
    return scatter_to_sequence(hidden, tp_group, dim=0), own, scatter_to_sequence(weights, tp_group, dim=0)


def _with_values(args: tuple, kwargs: dict, names: tuple[str, ...], values: list) -> tuple[tuple, dict]:
    """A call's arguments with its leading parameters ``names`` (positional or keyword) set to ``values``."""
    args, kwargs = list(args), dict(kwargs)
    for i, (name, value) in enumerate(zip(names, values)):
        if i < len(args):
            args[i] = value
        else:
            kwargs[name] = value
    return tuple(args), kwargs


def _routing_names(module: nn.Module) -> tuple[str, ...]:
    """The names of the experts' forward's leading parameters (hidden states, expert ids, weights), or of
    its hidden states alone (experts that receive every token once per expert, already weighted: Llama 4).
    Their values come from the call's leading arguments, positional or keyword (no ``Signature.bind``, which
    ``torch.compile`` cannot trace)."""
    sig = inspect.signature(type(module).forward)
    names = [p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(names) not in (2, 4):
        raise ValueError(f"{type(module).__name__}.forward must take (hidden_states, top_k_index, top_k_weights) or "
                         f"(hidden_states) alone, received the parameters {names[1:]}")  # fmt: skip
    return tuple(names[1:])


def install_expert_hooks(module: nn.Module, tp_group, sequence_parallel: bool, by: str = "features",
                         ep_group=None) -> None:  # fmt: skip
    """The communication around ``module``'s forward (its parameters already split); see the module docstring.

    Experts taking hidden states alone receive ``[E·T, H]``: every one of the ``T`` tokens once per expert,
    expert after expert. Under sequence parallelism each expert's rows are gathered from every rank
    (``[E, T/t, H] → [E, T, H]``) and its output rows reduce-scattered back.

    Split ``by="experts"``, rank ``r`` holds experts ``r·E/t …`` whole (``module.num_experts`` becomes
    ``E/t``): the routes to other ranks' experts get the local id ``E/t``, which the experts' forward skips,
    and weight 0, as Hugging Face's all-reduce expert parallelism does.

    With ``ep_group`` (expert parallelism over data-parallel ranks, whose tokens differ) the parameters hold
    this rank's experts of ``ep_group``'s split and every route is dispatched over ``ep_group``; the experts
    are whole on every tensor-parallel rank. Under sequence parallelism each tensor-parallel rank dispatches
    its shard's tokens. Without it the tensor-parallel ranks hold the same tokens: each dispatches its
    ``1/t`` of them (padded to a multiple of ``t``, the padding routed with weight 0) and the outputs are
    all-gathered over ``tp_group``, so no expert computes a token twice.
    """
    group = tp_group if ep_group is None else ep_group
    by = "experts" if ep_group is not None else by
    names = _routing_names(module)
    experts = (stacked_layout(module) or [p.shape[0] for n, p in module.named_parameters() if n in _FIRST])[0]
    first_rank = group_rank(tp_group) == 0
    replicated = [n for n in ("down_proj_bias",) if by == "features" and module._parameters.get(n) is not None]
    saved: list[dict] = []
    if by == "experts":  # the parameters hold this rank's experts already
        local_experts, first_expert = experts, group_rank(group) * experts
        module.num_experts = local_experts
        if hasattr(module, "_is_expert_parallel"):
            module._is_expert_parallel = True  # Hugging Face's implementations then mask the skipped routes

    # split by experts under sequence parallelism, every rank holds tokens of its own: each (token, choice)
    # route travels to the rank of its expert and its output back (an all-to-all each way), weighted at home
    dispatch = ep_group is not None or (by == "experts" and sequence_parallel and len(names) == 3)
    # expert parallelism over other ranks than tp_group's, whose ranks hold the same tokens: each takes 1/t
    share = ep_group is not None and not sequence_parallel and group_size(tp_group) > 1
    shared_rows: list[int] = []  # the token count before the split, per call
    t = group_size(group)
    routes: list[tuple] = []
    inputs: list[tuple] = []  # (hidden states, routing weights) handed to the experts, without dispatch

    def send_routes(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        owner = (ids // local_experts).reshape(-1)
        order = torch.argsort(owner, stable=True)  # routes grouped by the rank of their expert, in token order
        send = torch.bincount(owner, minlength=t).view(t)  # sized (owner < t): static under compile
        token = torch.div(order, ids.shape[-1], rounding_mode="floor")
        local = (ids.reshape(-1)[order] % local_experts)[:, None]
        # on the host once: the exchanges and their backwards read them there (graph nodes under compile)
        send_counts, recv_counts = torch.stack((send, all_to_all(send, group, [1] * t, [1] * t)[0])).cpu()
        rows = exchange_rows(hidden[token], group, send_counts, recv_counts)
        local_ids = exchange_rows(local, group, send_counts, recv_counts, rows=rows.shape[0])
        routes.append((order, token, weights, send_counts, recv_counts, hidden.shape[0], rows))
        return rows, local_ids, torch.ones_like(local_ids, dtype=weights.dtype)

    def combine_routes(out: torch.Tensor) -> torch.Tensor:
        order, token, weights, send_counts, recv_counts, tokens, rows = routes.pop()
        if rows.requires_grad and not out.requires_grad:
            # a rank whose experts received no route may return a constant: tie it to the rows, so that its
            # backward still joins both exchanges' all-to-alls, which every other rank's backward runs
            out = out + rows.sum() * 0
        back = exchange_rows(out, group, recv_counts, send_counts, rows=order.shape[0])  # grouped by rank
        weighted = back * weights.reshape(-1)[order, None].to(back.dtype)
        return back.new_zeros((tokens, back.shape[-1])).index_add(0, token, weighted)

    def route(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if by == "features":
            return ids, weights
        local = ids - first_expert
        off = (local < 0) | (local >= local_experts)
        return local.masked_fill(off, local_experts), weights.masked_fill(off, 0.0)

    def per_expert(x: torch.Tensor, op) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] % experts:
            raise ValueError(f"parallelize: {type(module).__name__} takes [experts · tokens, hidden] rows with "
                             f"{experts} experts, received shape {tuple(x.shape)}")  # fmt: skip
        return op(x.view(experts, -1, x.shape[-1]), tp_group, dim=1).reshape(-1, x.shape[-1])

    def enter(m, args, kwargs):
        values = [args[i] if i < len(args) else kwargs.get(n) for i, n in enumerate(names)]
        if not all(isinstance(x, torch.Tensor) for x in values):
            raise ValueError(f"parallelize: {type(m).__name__} split over tensor-parallel ranks needs its arguments "
                             f"{list(names)} as tensors")  # fmt: skip
        if len(names) == 1:
            hidden = values[0]
            values = [per_expert(hidden, gather_from_sequence) if sequence_parallel else copy_to_tp(hidden, tp_group)]
        elif dispatch:
            hidden, ids, weights = values
            if share:
                shared_rows.append(hidden.shape[0])
                hidden, ids, weights = _tp_share(hidden, ids, weights, tp_group)
            rows, local_ids, ones = send_routes(hidden, ids, weights)
            values = [rows, local_ids, ones]
        else:
            hidden, ids, weights = values
            if sequence_parallel:
                hidden, ids = gather_from_sequence(hidden, tp_group, dim=0), all_gather(ids, tp_group)[0]
                weights = gather_from_sequence(weights, tp_group, dim=0)
            else:  # the expert ids carry no gradient
                hidden, weights = copy_to_tp(hidden, tp_group), copy_to_tp(weights, tp_group)
            ids, weights = route(ids, weights)
            values = [hidden, ids, weights]
            inputs.append((hidden, weights))
        # a bias added after the experts' partial sums would be summed t times: rank 0 adds it, every rank
        # receives its complete gradient (copy_to_tp sums rank 0's with the others' zeros)
        own = {n: m._parameters[n] for n in replicated}
        saved.append(own)
        for n, p in own.items():
            shared = copy_to_tp(p, tp_group)
            m._parameters[n] = shared if first_rank else shared * 0
        return _with_values(args, kwargs, names, values)

    def leave(m, args, kwargs, out):
        if saved:  # always called: an exception inside forward must not leave the stand-ins installed
            m._parameters.update(saved.pop())
        if out is None:  # the exception's path (or a forward without output, which nothing could use)
            routes.clear()
            inputs.clear()
            shared_rows.clear()
            return None
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"parallelize: {type(m).__name__} must return a tensor, received {type(out).__name__}")
        if len(names) == 3 and not dispatch:
            hidden, weights = inputs.pop()
            if (hidden.requires_grad or weights.requires_grad) and not out.requires_grad:
                # no route reached this rank's experts (split by experts), and the eager implementation returns
                # a constant: tie it to the inputs, so that their collectives' backwards run here as elsewhere
                out = out + (hidden.sum() + weights.sum()) * 0
        if dispatch:
            out = combine_routes(out)
            return gather_from_tp(out, tp_group, dim=0)[: shared_rows.pop()] if share else out
        if not sequence_parallel:
            return reduce_from_tp(out, tp_group)
        if len(names) == 1:
            return per_expert(out, reduce_scatter_to_sequence)
        return reduce_scatter_to_sequence(out, tp_group, dim=0)

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(leave, with_kwargs=True, always_call=True)


# Hugging Face's styles for the parameters of an experts module, by the dim they split: a 3-d weight's
# "colwise" splits dim 1, its "rowwise" dim 2 (so a transposed [E, in, out] gate_up is "packed_rowwise");
# a split bias is "colwise"; an unsplit one "rowwise" (added after the sum) or replicated
_COLUMN_STYLES = ("colwise", "local_colwise", "packed_colwise")
_ROW_STYLES = ("rowwise", "local_rowwise", "packed_rowwise", "local_packed_rowwise")


def check_parameter_styles(name: str, module: nn.Module, splits: list[ExpertSplit], styles: dict) -> None:
    """The styles a plan gives the parameters of experts ``name`` (``{parameter: (glob, style)}``) must
    describe the split tessel makes of them."""
    for s in splits:
        if s.name not in styles:
            continue
        glob, style = styles[s.name]
        ndim = module.get_parameter(s.name).dim()
        if s.dim == 0:  # split by experts
            allowed, where = ("grouped_gemm",), "split by experts"
        elif s.dim is None:
            allowed, where = (*_ROW_STYLES, "replicate", "local"), "whole on every rank"
        elif ndim == 3:
            allowed, where = (_COLUMN_STYLES if s.dim == 1 else _ROW_STYLES), f"along dim {s.dim}"
        else:
            allowed, where = _COLUMN_STYLES + _ROW_STYLES, f"along dim {s.dim}"
        if style not in allowed:
            raise ValueError(f"parallelize: plan glob {glob!r} splits the expert parameter {name}.{s.name} as "
                             f"{style!r}; tessel keeps it {where}: {' or '.join(allowed[:2])} in Hugging Face's "
                             f"terms (see tessel.layers.hf_experts)")  # fmt: skip


# ---------------------------------------------------------------------------------------------------- sequence parallel


def _inside(name: str, parents) -> bool:
    """Whether module ``name`` lies below one of ``parents`` (also used by :mod:`tessel.layers.hf`)."""
    return any(name.startswith(p + ".") for p in parents)


def expert_blocks(layer_names: list[str], ring_blocks: list[str], expert_names) -> list[str]:
    """The blocks holding split experts (``mlp``; the experts themselves where they sit directly in a layer), which
    receive their layer's sequence shard and compute on it; raises when one is not a direct child of a layer or
    holds column projections (a sequence ring)."""
    # experts that sit directly in a decoder layer (Gemma 4's, beside its dense MLP) are their own block
    parents = {name: name.rsplit(".", 1)[0] for name in expert_names}
    blocks = sorted({name if parent in layer_names else parent for name, parent in parents.items()})
    for block in blocks:
        if block.rpartition(".")[0] not in layer_names:
            raise ValueError(f"parallelize: sequence_parallel=True needs the experts' block {block} to be a "
                             "direct child of a decoder layer (it receives a sequence shard)")  # fmt: skip
        if block in ring_blocks:
            raise ValueError(
                f"parallelize: sequence_parallel=True cannot split column projections directly in {block}, which "
                "holds split experts and computes on its sequence shard; only a submodule of it (a shared expert) "
                "may gather the sequence for its column projections"
            )
    return blocks


def check_expert_blocks(modules: dict[str, nn.Module], blocks: list[str], ring_blocks: list[str], split_names) -> None:
    """Inside an experts' block only the projections of a ring block (a shared expert) may be split."""
    for block in blocks:
        for sub, _ in modules[block].named_modules():
            name = f"{block}.{sub}"
            if name in split_names and name.rsplit(".", 1)[0] not in ring_blocks:
                raise ValueError(
                    f"parallelize: sequence_parallel=True cannot split {name}: {block} holds split experts and "
                    "computes on its sequence shard; only a submodule of it with column projections of its "
                    "own (a shared expert) gathers the sequence"
                )


def expert_block_modules(model: nn.Module, blocks: list[str], expert_names) -> list[str]:
    """Modules with parameters of their own inside ``blocks``, the experts aside (routers, shared experts):
    they see this rank's tokens, so their gradients are summed over the group."""
    modules = dict(model.named_modules())
    names = []
    for block in blocks:
        for sub, m in modules[block].named_modules():
            name = f"{block}.{sub}" if sub else block
            own = any(True for _ in m.parameters(recurse=False))
            if own and name not in expert_names and not _inside(name, expert_names):
                names.append(name)
    return names


def _routers(base_cls: type, modules: dict[str, nn.Module], blocks: list[str]) -> list[tuple[nn.Module, int]]:
    """``(module, output index)`` of the modules inside ``blocks`` whose output Hugging Face records as
    ``router_logits`` (the base model's ``_can_record_outputs``)."""
    recorder = (getattr(base_cls, "_can_record_outputs", None) or {}).get("router_logits")
    if recorder is None:
        return []
    cls, index = getattr(recorder, "target_class", None), getattr(recorder, "index", 0) or 0
    class_name, layer_name = getattr(recorder, "class_name", None), getattr(recorder, "layer_name", None)
    found = []
    for block in blocks:
        for sub, m in modules[block].named_modules():
            name = f"{block}.{sub}" if sub else block
            if layer_name is not None and not name.endswith(layer_name):
                continue
            if (cls is not None and isinstance(m, cls)) or (class_name and type(m).__name__.endswith(class_name)):
                found.append((m, index))
    return found


def _asks_router_logits(model: nn.Module, kwargs: dict) -> bool:
    """Whether a forward of ``model`` records router logits (its argument, else its config)."""
    flag = kwargs.get("output_router_logits")
    if flag is None:
        flag = getattr(getattr(model, "config", None), "output_router_logits", False)
    return bool(flag)


ROUTER_GATHER = "_tessel_router_gather"  # the model's switch: gather the routers' logits in this forward


def gather_router_logits(model: nn.Module, base_cls: type, blocks: list[str], tp_group, cp_group=None, *,
                         sequence_parallel: bool = True) -> None:  # fmt: skip
    """When a forward asks for ``output_router_logits`` (the load-balancing loss), each router's logits are
    gathered, ``[B·S/(t·c), E] → [B·S, E]`` in the model's token order, so that every rank records every token's,
    as the dense model does, and computes the whole load-balancing loss.

    ``tp_group`` (with ``sequence_parallel``, the sequence split over it): the tensor-parallel ranks' routers
    sum their gradients over the group, so each receives the gradient of its own tokens' logits
    (``gather_from_tp``). ``cp_group`` (context parallelism; None: none): the cp ranks' gradients are averaged
    (a data-parallel reduction over dp × cp), and every rank's loss holds every token's routing, so the gather's
    backward sums every rank's gradient of each rank's logits (``gather_from_sequence``): after the average
    each router has the dense model's gradient.
    The zigzag shares (:func:`~tessel.parallel.context.split_sequence`) are put back in order, which the
    whole sequence's attention mask of a padded batch needs."""
    modules = dict(model.named_modules())
    routers = _routers(base_cls, modules, blocks)
    state = {"gather": False, "batch": None}
    setattr(model, ROUTER_GATHER, state)  # for pipeline stages, which run the base model without the model's hooks

    def begin(module, args, kwargs):
        flag = _asks_router_logits(module, kwargs)
        if flag and not routers:
            raise ValueError(
                "parallelize: output_router_logits=True with the sequence split over ranks, but no router of "
                f"{base_cls.__name__} is known (its _can_record_outputs names none inside the split experts' "
                "blocks): the load-balancing loss would see this rank's tokens only; use output_router_logits=False "
                "or split no sequence (sequence_parallel=False, no cp_group)"
            )
        state["gather"] = bool(flag)

    def batch(module, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        state["batch"] = hidden.shape[0] if isinstance(hidden, torch.Tensor) and hidden.dim() == 3 else 1

    def gather(logits: torch.Tensor) -> torch.Tensor:
        # [B, L, E], or [B·L, E] whose rows' tokens are contiguous
        rows = logits if logits.dim() == 3 else logits.view(state["batch"], -1, logits.shape[-1])
        if sequence_parallel:
            rows = gather_from_tp(rows, tp_group, dim=1)
        if cp_group is not None and group_size(cp_group) > 1:
            rows = gather_from_sequence(rows, cp_group, dim=1)  # every rank's zigzag share, rank after rank
            order = zigzag_order(rows.shape[1], group_size(cp_group), device=rows.device)
            rows = rows.index_select(1, torch.argsort(order))
        return rows if logits.dim() == 3 else rows.reshape(-1, logits.shape[-1])

    def record(module, args, out, index):
        if not state["gather"]:
            return None
        if isinstance(out, tuple):
            return (*out[:index], gather(out[index]), *out[index + 1 :])
        return gather(out)

    model.register_forward_pre_hook(begin, with_kwargs=True)
    for block in blocks:
        modules[block].register_forward_pre_hook(batch, with_kwargs=True)
    for router, index in routers:  # before Hugging Face's recording hook, whenever that was installed
        router.register_forward_hook(lambda m, a, o, index=index: record(m, a, o, index), prepend=True)


def reduce_parameter_grads(module: nn.Module, tp_group) -> None:
    """During each forward the module's own parameters pass through ``copy_to_tp`` (identity forward,
    all-reduce backward), so their gradients are summed over the group before they accumulate: correct
    under gradient accumulation too, where a hook on ``.grad`` would reduce the running sum again."""
    saved: list[dict] = []

    def enter(m, args):
        own = {n: p for n, p in m._parameters.items() if p is not None and p.requires_grad}
        saved.append(own)
        for n, p in own.items():
            m._parameters[n] = copy_to_tp(p, tp_group)

    def leave(m, args, out):
        m._parameters.update(saved.pop())

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
