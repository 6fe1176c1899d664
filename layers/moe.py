"""A top-k mixture-of-experts MLP, split over tensor-parallel ranks by features and over expert-parallel ranks
by experts.

Legend: ``N`` tokens on this rank, ``E`` model width, ``F`` an expert's hidden width, ``X`` experts, ``k``
experts per token, ``t`` tensor-parallel size, ``e`` expert-parallel size, ``X/e`` experts per rank.

Routing (Mixtral, Qwen-MoE): a replicated router ``[X, E]`` scores every token in fp32, the softmax's ``k``
largest probabilities choose the experts and, renormalised to sum to one, weight their outputs; with
``router_score="sigmoid"`` (DeepSeek-V3) each expert's score is ``σ(logit)``, independent of the others', and the
``k`` largest, renormalised, weight the outputs (the load-balancing loss averages the scores normalised over the
experts); with ``expert_groups`` (DeepSeek-V3's group-limited routing) a token chooses only among the experts of
its ``top_groups`` best groups of consecutive experts, which bounds how many expert-parallel ranks it reaches. The
Switch
Transformer load-balancing loss (Fedus et al. 2021, eq. 4), ``X · Σ_x f_x · P_x`` with ``f_x`` the fraction of
routes that chose expert ``x`` and ``P_x`` its mean probability, is kept in :attr:`ParallelMoE.aux_loss` after
each forward, and ST-MoE's router z-loss (Zoph et al. 2022, eq. 5), the mean of ``logsumexp(logits)²``, which
keeps the router's logits small, in :attr:`ParallelMoE.z_loss`. With ``expert_bias=True`` the layer balances its
experts without a loss (DeepSeek-V3's auxiliary-loss-free balancing, Wang et al. 2024): a bias per expert, a
buffer outside the gradient, is added to the probabilities only to choose the ``k`` experts (the weights stay
the chosen probabilities), and :func:`update_expert_biases` raises the bias of every expert that received fewer
than the mean number of routes since the last update by a fixed rate and lowers the others' (called after each
optimizer step). All three are over the same tokens the dense model would see: under sequence parallelism the
counts and sums of every tensor-parallel rank's shard are added up (``reduce_from_tp``), under context
parallelism those of every rank's share of the sequence (an all-reduce whose backward all-reduces too: every cp
rank's loss is the whole sequence's, so gradients averaged over the cp ranks are the dense model's).

Each expert is a SwiGLU or GELU MLP whose parameters live in two 3-d tensors, ``fc [X/e, F/t (per part), E]``
and ``proj [X/e, E, F/t]``, split like :class:`~tessel.layers.mlp.ParallelMLP`'s over ``tp_group`` (each rank
keeps ``F/t`` of every expert's hidden features; Megatron-LM's expert tensor parallelism) and by experts over
``ep_group`` (rank ``r`` keeps experts ``r·X/e …``; the ranks of ``ep_group`` hold other tokens: data- or
context-parallel peers, ``init_parallel(ep=)``). A forward:

1. enters the tensor-parallel region as the MLP does: under sequence parallelism the hidden states, the chosen
   experts and their weights of every rank's shard are all-gathered (the gradients reduce-scattered back);
   otherwise they pass through ``copy_to_tp`` (the gradients all-reduced);
2. sorts the ``N·k`` (token, choice) routes by expert; with ``ep_group`` each route travels to the rank of its
   expert and back (:func:`~tessel.parallel.collectives.exchange_rows`, an all-to-all each way; the route counts
   are read on the host once per layer to size them, the layer's only synchronisation with the device; under
   ``torch.compile`` the exchange is one graph node, ``tessel::exchange_rows``, which reads them when it runs),
   every tensor-parallel rank exchanging the same routes with its own ep peers;
3. runs the local experts' GEMMs on their rows, each projection one grouped launch for every expert
   (:func:`~tessel.kernels.grouped_matmul`, which reads the row counts on the device);
4. weights each route's output in fp32 and adds the ``k`` routes of a token up, then leaves the region:
   reduce-scatter under sequence parallelism, all-reduce otherwise (each rank held ``F/t`` of the features).

The expert parameters are marked ``tensor_parallel`` (``tp_dim``, ``tp_parts``) and, with ``ep_group``,
``expert_parallel`` with ``expert_range = (first, stop)`` and ``expert_count = X``: :class:`~tessel.parallel.DDP`
reduces them over the expert-data-parallel group, and :func:`~tessel.parallel.sharding.global_shape` places them
in the ``[X, …]`` global tensor, so initialisation and checkpoints do not depend on the layout.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.grouped_matmul import grouped_matmul
from ..parallel.collectives import (
    copy_to_tp,
    exchange_rows,
    gather_from_sequence,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    sum_over_ranks,
)
from ..parallel.comm import all_gather, all_reduce, all_to_all, check_peer_group, group_rank, group_size
from ..parallel.sharding import shard_like
from .fp8 import fp8_grouped_linear
from .hf_balance import expert_loads
from .mlp import MLP_ACTIVATIONS
from .routes import sorted_counts

__all__ = [
    "ROUTER_SCORES",
    "ParallelMoE",
    "check_expert_groups",
    "load_balancing_loss",
    "route_top_k",
    "router_z_loss",
    "update_expert_biases",
]


ROUTER_SCORES = ("softmax", "sigmoid")


def route_top_k(logits: torch.Tensor, k: int, bias: torch.Tensor | None = None, score: str = "softmax", *,
                groups: int = 1, top_groups: int = 1):  # fmt: skip
    """``(weights [N, k] fp32, ids [N, k] int64, probs [N, X] fp32)``: the ``k`` highest-scoring experts of each
    row of ``logits [N, X]`` and their scores renormalised to sum to one. ``score``: ``"softmax"`` (Mixtral,
    Qwen-MoE) or ``"sigmoid"`` (DeepSeek-V3: each expert's affinity ``σ(logit)`` on its own). ``probs`` is the
    scores normalised over the experts (the softmax itself), what the load-balancing loss averages. With
    ``bias [X]`` the experts are those of the ``k`` largest ``score + bias`` (the weights are still their
    scores).

    Group-limited routing (DeepSeek-V3's ``n_group``/``topk_group``): with ``groups > 1`` the experts form that
    many groups of consecutive experts, each row keeps the ``top_groups`` groups whose two best ``score (+ bias)``
    add up highest, and chooses its ``k`` experts among theirs only. Groups laid out along the expert-parallel
    ranks bound the ranks a token's routes travel to."""
    if score not in ROUTER_SCORES:
        raise ValueError(f"route_top_k: score must be one of {ROUTER_SCORES}, received {score!r}")
    experts = logits.shape[-1]
    check_expert_groups("route_top_k", experts, k, groups, top_groups)
    if score == "softmax":
        scores = probs = torch.softmax(logits.float(), dim=-1)
    else:
        scores = torch.sigmoid(logits.float())
        probs = scores / scores.sum(-1, keepdim=True)
    choice = scores if bias is None else scores + bias.float()
    if groups > 1:
        grouped = choice.view(*choice.shape[:-1], groups, experts // groups)
        best = grouped.topk(min(2, experts // groups), dim=-1)[0].sum(-1)  # [N, groups]
        kept = torch.zeros_like(best, dtype=torch.bool).scatter_(-1, best.topk(top_groups, dim=-1)[1], True)
        choice = grouped.masked_fill(~kept[..., None], -math.inf).view_as(choice)
    ids = choice.topk(k, dim=-1)[1]
    top = scores.gather(-1, ids)
    return top / top.sum(-1, keepdim=True), ids, probs


def check_expert_groups(caller: str, n_expert: int, top_k: int, groups: int, top_groups: int,
                        name: str = "groups") -> None:  # fmt: skip
    """Group-limited routing's settings: ``groups`` (called ``name`` by ``caller``) divides the experts,
    ``1 <= top_groups <= groups``, and the kept groups hold at least ``top_k`` experts."""
    for arg, value in ((name, groups), ("top_groups", top_groups)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{caller}: {arg} must be a positive int, received {value!r}")
    if n_expert % groups:
        raise ValueError(f"{caller}: {name}={groups} does not divide the {n_expert} experts")
    if top_groups > groups:
        raise ValueError(f"{caller}: top_groups={top_groups} exceeds {name}={groups}")
    if top_k > top_groups * (n_expert // groups):
        raise ValueError(f"{caller}: top_k={top_k} exceeds the {top_groups * (n_expert // groups)} experts of "
                         f"top_groups={top_groups} groups of {n_expert // groups}")  # fmt: skip


def load_balancing_loss(counts: torch.Tensor, prob_sums: torch.Tensor, tokens: int, k: int) -> torch.Tensor:
    """Switch's ``X · Σ_x f_x · P_x`` from the routes per expert ``counts [X]`` (``f_x = counts_x / (tokens·k)``)
    and the summed probabilities ``prob_sums [X]`` (``P_x = prob_sums_x / tokens``); 1 when balanced."""
    experts = counts.numel()
    return experts * (counts.to(prob_sums.dtype) * prob_sums).sum() / (tokens * tokens * k)


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's ``mean_n logsumexp(logits[n])²`` over the rows of ``logits [N, X]``, in fp32."""
    return _squared_log_sum_exp(logits).mean()


def _squared_log_sum_exp(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits.float(), dim=-1).square()


@torch.no_grad()
def update_expert_biases(module: nn.Module, rate: float, group=None) -> torch.Tensor | None:
    """One step of auxiliary-loss-free balancing for every :class:`ParallelMoE` in ``module`` built with
    ``expert_bias=True``, and every Hugging Face block whose loads :func:`~tessel.layers.hf_balance.
    track_expert_loads` counts (its ``e_score_correction_bias``; ``parallelize`` tracks the blocks it splits):
    ``bias_x += rate · sign(mean load − load_x)``, where ``load_x`` counts the routes to expert ``x`` since the
    last update (every forward that recorded gradients, in training mode), summed over ``group``: the ranks that
    hold other tokens of the step beside this one, the data-parallel group (tensor- and context-parallel ranks'
    shares are already counted in every layer). One all-reduce for all layers of a kind; the counts start again
    from zero. Returns the summed loads ``[layers, X]`` (None when there is no such layer).

    A recomputed forward (activation checkpointing) counts its routes again: every count doubles and the signs,
    so the update, stay the same."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < math.inf:
        raise ValueError(f"update_expert_biases: rate must be a positive finite number, received {rate!r}")
    layers = [m for m in module.modules() if isinstance(m, ParallelMoE) and m.expert_bias is not None]
    tracked = expert_loads(module)
    if not layers and not tracked:
        return None
    biases, counts, extra = [m.expert_bias for m in layers], [m.expert_load for m in layers], [()] * len(layers)
    for load in tracked:
        biases.append(load.bias)
        counts.append(load.counts)
        extra.append(load.groups)
    if len({c.numel() for c in counts}) != 1:
        raise ValueError(f"update_expert_biases: the layers route to different numbers of experts "
                         f"{sorted({c.numel() for c in counts})}; update each model on its own")  # fmt: skip
    loads = torch.stack([c.to(torch.float32) for c in counts])
    # the tokens of other ranks inside these layers (sequence, context): in layer order, the same on every rank
    for groups in dict.fromkeys(g for g in extra if g):
        rows = [i for i, g in enumerate(extra) if g == groups]
        part = loads[rows]
        for g in groups:
            all_reduce(part, g)
        loads[rows] = part
    if group is not None and group_size(group) > 1:
        all_reduce(loads, group)
    for bias, count, load in zip(biases, counts, loads, strict=True):
        bias += rate * torch.sign(load.mean() - load)
        count.zero_()
    return loads


class _Routes:
    """Where each (token, choice) route went, to bring its output back (see :func:`_dispatch`)."""

    __slots__ = ("order", "perm", "recv", "send", "token", "tokens")

    def __init__(self, order, token, send, recv, perm, tokens):
        self.order, self.token, self.send, self.recv, self.perm, self.tokens = order, token, send, recv, perm, tokens


def _dispatch(x: torch.Tensor, ids: torch.Tensor, per_rank: int, group) -> tuple[torch.Tensor, torch.Tensor, _Routes]:
    """The rows ``[R, E]`` this rank's experts compute, grouped by local expert, the row count of each local
    expert (a device tensor), and the routes. Without a group (or one of one rank) the rows are ``x``'s, sorted
    by expert, and nothing is read on the host."""
    e = 1 if group is None else group_size(group)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # routes by expert (so by rank), in token order within one
    token = torch.div(order, ids.shape[-1], rounding_mode="floor")
    counts = sorted_counts(flat[order], e * per_rank).view(e, per_rank)
    if e == 1:
        return x[token], counts[0], _Routes(order, token, None, None, None, x.shape[0])
    received = all_to_all(counts, group, [1] * e, [1] * e)[0]  # [source rank, local expert]
    send, recv = torch.stack((counts.sum(1), received.sum(1))).cpu()  # the one read on the host
    rows = exchange_rows(x[token], group, send, recv)  # source after source, by local expert within one
    # the local expert of every received row, then a stable sort: grouped by expert, by source within one
    experts = torch.arange(per_rank, device=x.device).repeat(e)
    of_row = torch.repeat_interleave(experts, received.reshape(-1), output_size=rows.shape[0])  # sized: no sync
    perm = torch.argsort(of_row, stable=True)
    return rows.index_select(0, perm), received.sum(0), _Routes(order, token, send, recv, perm, x.shape[0])


def _combine(out: torch.Tensor, weights: torch.Tensor, routes: _Routes, group) -> torch.Tensor:
    """``[N, E]`` fp32: each token's routes' outputs, weighted, added up (the inverse of :func:`_dispatch`)."""
    if routes.perm is not None:
        out = out.index_select(0, torch.argsort(routes.perm))  # source after source again
        out = exchange_rows(out, group, routes.recv, routes.send, rows=routes.order.shape[0])  # in `order`
    weighted = out.float() * weights.reshape(-1)[routes.order, None]
    return weighted.new_zeros((routes.tokens, out.shape[-1])).index_add(0, routes.token, weighted)


class ParallelMoE(nn.Module):
    """``Σ_k weight_k · expert_{id_k}(x)`` over the ``top_k`` experts the router chooses for each token.

    Input and output are ``[B, S, E]`` (``[B, S/t, E]`` under ``sequence_parallel``). ``n_expert`` must split
    evenly over ``ep_group``. After each forward :attr:`aux_loss` holds the load-balancing loss and
    :attr:`z_loss` the router z-loss (fp32 scalars) of this forward's tokens, differentiable; ``cp_group`` only
    widens them to the whole sequence. ``expert_groups``/``top_groups``: group-limited routing
    (:func:`route_top_k`'s ``groups``/``top_groups``); with ``expert_groups`` a multiple of ``ep_group``'s size
    each group's experts live on one rank, so a token's routes reach at most ``top_groups`` ranks.
    """

    def __init__(self, n_embd: int, hidden: int, n_expert: int, top_k: int, *, activation: str = "swiglu",
                 tp_group=None, sequence_parallel: bool = False, ep_group=None, cp_group=None,
                 expert_bias: bool = False, router_score: str = "softmax", expert_groups: int = 1, top_groups: int = 1,
                 device=None, dtype=None):  # fmt: skip
        super().__init__()
        for name, value in (("n_embd", n_embd), ("hidden", hidden), ("n_expert", n_expert), ("top_k", top_k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelMoE: {name} must be a positive int, received {value!r}")
        if top_k > n_expert:
            raise ValueError(f"ParallelMoE: top_k={top_k} exceeds n_expert={n_expert}")
        if activation not in MLP_ACTIVATIONS:
            raise ValueError(f"ParallelMoE: activation must be one of {MLP_ACTIVATIONS}, received {activation!r}")
        if router_score not in ROUTER_SCORES:
            raise ValueError(f"ParallelMoE: router_score must be one of {ROUTER_SCORES}, received {router_score!r}")
        check_expert_groups("ParallelMoE", n_expert, top_k, expert_groups, top_groups, "expert_groups")
        why = "expert-parallel peers must hold other tokens (init_parallel(ep=)'s ep_group)"
        e = check_peer_group(ep_group, tp_group, caller="ParallelMoE", name="ep_group", why=why) or 1
        t = group_size(tp_group)
        if n_expert % e:
            raise ValueError(f"ParallelMoE: n_expert={n_expert} does not split over the {e} ranks of ep_group")
        if hidden % t:
            raise ValueError(f"ParallelMoE: hidden={hidden} does not split over the {t} tensor-parallel ranks")
        self.n_embd, self.hidden, self.n_expert, self.top_k = n_embd, hidden, n_expert, top_k
        self.activation, self.sequence_parallel, self.router_score = activation, sequence_parallel, router_score
        self.expert_groups, self.top_groups = expert_groups, top_groups
        self.fp8 = False  # the experts' GEMMs in fp8 (convert_to_fp8)
        self.tp_group, self.ep_group, self.cp_group = tp_group, ep_group, cp_group
        self.per_rank, self.first_expert = n_expert // e, group_rank(ep_group) * (n_expert // e) if e > 1 else 0
        kw = dict(device=device, dtype=dtype)
        parts = (hidden, hidden) if activation == "swiglu" else (hidden,)
        self.router = nn.Parameter(torch.empty(n_expert, n_embd, **kw))
        self.fc = nn.Parameter(torch.empty(self.per_rank, sum(parts) // t, n_embd, **kw))
        self.proj = nn.Parameter(torch.empty(self.per_rank, n_embd, hidden // t, **kw))
        for p, dim, p_parts in ((self.fc, 1, parts), (self.proj, 2, (hidden,))):
            p.tensor_parallel, p.tp_dim, p.tp_parts = True, dim, p_parts
            if e > 1:
                p.expert_parallel, p.expert_count = True, n_expert
                p.expert_range = (self.first_expert, self.first_expert + self.per_rank)
        if not isinstance(expert_bias, bool):
            raise TypeError(f"ParallelMoE: expert_bias must be a bool, received {expert_bias!r}")
        # fp32 whatever the parameters' dtype: steps of ~1e-3 vanish in a bf16 bias (its checkpointed state)
        bias = torch.zeros(n_expert, dtype=torch.float32, device=device) if expert_bias else None
        self.register_buffer("expert_bias", bias)
        self.register_buffer("expert_load", None if bias is None else torch.zeros_like(bias), persistent=False)
        self.aux_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None
        with torch.no_grad():
            for p in self.parameters():
                nn.init.normal_(p, std=0.02)

    @classmethod
    def from_module(cls, moe: ParallelMoE, *, tp_group=None, sequence_parallel: bool = False, ep_group=None,
                    cp_group=None) -> ParallelMoE:  # fmt: skip
        """A layer split over ``tp_group`` (and ``ep_group``) holding this rank's shards of a whole layer's
        parameters (what ``parallelize`` does with tessel's GPT); ``moe`` is not changed."""
        if not isinstance(moe, ParallelMoE):
            raise TypeError(f"ParallelMoE.from_module: expected a ParallelMoE, received {type(moe).__name__}")
        if moe.per_rank != moe.n_expert or group_size(moe.tp_group) != 1:
            raise ValueError(
                "ParallelMoE.from_module: the layer is already split over tensor- or expert-parallel ranks"
            )
        w = moe.router
        layer = cls(moe.n_embd, moe.hidden, moe.n_expert, moe.top_k, activation=moe.activation, tp_group=tp_group,
                    sequence_parallel=sequence_parallel, ep_group=ep_group, cp_group=cp_group,
                    expert_bias=moe.expert_bias is not None, router_score=moe.router_score,
                    expert_groups=moe.expert_groups, top_groups=moe.top_groups, device=w.device,
                    dtype=w.dtype)  # fmt: skip
        with torch.no_grad():
            for name, p in layer.named_parameters():
                p.copy_(shard_like(getattr(moe, name), p, tp_group))
            if moe.expert_bias is not None:
                layer.expert_bias.copy_(moe.expert_bias)
                layer.expert_load.copy_(moe.expert_load)
        layer.fp8 = moe.fp8
        return layer

    def extra_repr(self) -> str:
        e = 1 if self.ep_group is None else group_size(self.ep_group)
        return (f"{self.n_embd}, hidden={self.hidden}, experts={self.n_expert} ({self.router_score} top "
                f"{self.top_k}, {self.per_rank} "
                f"here, ep={e}), {self.activation}, tp={group_size(self.tp_group)}, "
                f"sequence_parallel={self.sequence_parallel}"
                + (f", groups={self.expert_groups} (top {self.top_groups})" if self.expert_groups > 1 else "")
                + (", expert_bias=True" if self.expert_bias is not None else "")
                + (", fp8=True" if self.fp8 else ""))  # fmt: skip

    def _router(self) -> torch.Tensor:
        shared = self.sequence_parallel and group_size(self.tp_group) > 1  # each rank scores its own tokens
        return copy_to_tp(self.router, self.tp_group) if shared else self.router

    def _router_losses(self, logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor):
        """(load-balancing loss, z-loss) over the dense model's tokens: the sums of probabilities and of squared
        log-sum-exps travel together, one collective per group."""
        counts = sorted_counts(torch.sort(ids.reshape(-1)).values, self.n_expert)
        sums, tokens = torch.cat((probs.sum(0), _squared_log_sum_exp(logits).sum()[None])), probs.shape[0]
        groups = []
        if self.sequence_parallel and group_size(self.tp_group) > 1:
            sums = reduce_from_tp(sums, self.tp_group)
            groups.append(self.tp_group)
        if self.cp_group is not None and group_size(self.cp_group) > 1:
            sums = sum_over_ranks(sums, self.cp_group)
            groups.append(self.cp_group)
        for group in groups:
            all_reduce(counts, group)
            tokens *= group_size(group)
        if self.expert_load is not None and self.training and torch.is_grad_enabled():
            self.expert_load += counts
        return load_balancing_loss(counts, sums[:-1], tokens, self.top_k), sums[-1] / tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.n_embd:
            raise ValueError(f"ParallelMoE: the input's last dim must be n_embd={self.n_embd}, received shape "
                             f"{tuple(x.shape)}")  # fmt: skip
        shape, tokens = x.shape, x.reshape(-1, self.n_embd)
        logits = F.linear(tokens.float(), self._router().float())
        weights, ids, probs = route_top_k(
            logits,
            self.top_k,
            self.expert_bias,
            self.router_score,
            groups=self.expert_groups,
            top_groups=self.top_groups,
        )
        self.aux_loss, self.z_loss = self._router_losses(logits, ids, probs)
        tp, t = self.tp_group, group_size(self.tp_group)
        if self.sequence_parallel and t > 1:
            tokens = gather_from_sequence(tokens, tp, dim=0)
            weights = gather_from_sequence(weights, tp, dim=0)
            ids = all_gather(ids, tp)[0]
        elif t > 1:
            tokens, weights = copy_to_tp(tokens, tp), copy_to_tp(weights, tp)
        rows, per_expert, routes = _dispatch(tokens, ids, self.per_rank, self.ep_group)
        out = _combine(self._experts(rows, per_expert), weights, routes, self.ep_group).to(x.dtype)
        if self.sequence_parallel and t > 1:
            out = reduce_scatter_to_sequence(out, tp, dim=0)
        elif t > 1:
            out = reduce_from_tp(out, tp)
        return out.view(shape)

    def _experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``[R, E]``: each local expert's MLP on its consecutive rows (partial sums over the ``F/t`` features),
        every expert's GEMM in one grouped launch."""
        offsets = torch.cat((counts.new_zeros(1), counts.cumsum(0)))
        if self.fp8:  # each expert's GEMMs in fp8 (tessel.layers.fp8; convert_to_fp8 turns it on)
            h = fp8_grouped_linear(rows, self.fc, offsets)
        else:
            h = grouped_matmul(rows, self.fc.transpose(1, 2), offsets)
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        if self.fp8:
            return fp8_grouped_linear(h, self.proj, offsets)
        return grouped_matmul(h, self.proj.transpose(1, 2), offsets)
