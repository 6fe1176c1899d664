"""The model of a training run under its layout, and one optimizer step of it.

Every rank builds the whole ``GPT`` from the same seed (so the initial weights do not depend on the
layout: ``layers/gpt.py`` draws each global tensor and keeps the rank's TP shard), then keeps what its
layout gives it:

- tensor parallelism: the GPT is built on the mesh's TP group;
- pipeline parallelism: the rank's stages (``GPT.pipeline_stage``; under the interleaved schedule pp
  rank ``r`` holds stages ``r, r + pp, …``), each a ``PipelineStage`` driven by one schedule; the
  parameters of other stages are released;
- context parallelism (``--cp``): the GPT's attention runs as a ring over the mesh's CP group, and each
  rank trains on its zigzag share of every sequence (``parallel/context.py``);
- data parallelism: the rank's stages are wrapped in one tessel ``DDP`` (``--zero 0``: torch's AdamW;
  1, 2: ``ZeroAdam``) or ``FSDP`` (``--zero 3``, with ``ZeroAdam``) on the DP × CP group (the ranks
  that hold the same parameters; the DP group without ``--cp``); with one such rank and ``--zero 0``
  there is nothing to reduce and torch's AdamW updates the parameters directly.

The loss of a step is the mean over the global batch: each rank's loss is the mean over its tokens (and
over its microbatches: a pipeline's, or the pieces of gradient accumulation), the gradients are averaged
over DP × CP (every rank holds as many tokens), and the reported value is averaged over those ranks on the
last pipeline stage.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..layers.fp8 import convert_to_fp8, fp8_layers
from ..layers.gpt import GPT, GPTConfig, TransformerBlock
from ..layers.hf_router_loss import router_z_loss
from ..layers.moe import update_expert_biases
from ..parallel.comm import group_rank, group_size
from ..parallel.dims import ParallelDims
from ..parallel.flat import is_expert
from ..parallel.sharding import is_tp_sharded, square_sum
from .train_args import DTYPES, OVERLAPS, PRESETS, ArgumentError
from .train_hf import (
    attention_kwargs,
    build_hf,
    decoder_layer_class,
    decoder_layers,
    document_positions,
    hf_loss,
    hf_stage,
    init_from,
)
from .train_state import ModelState, TorchAdamWState, ZeroAdamState

__all__ = ["Engine", "build_engine", "compile_blocks"]

BETAS = (0.9, 0.95)
EPS = 1e-8


def _need(module: str, flag: str):
    """Import ``tessel.<module>`` or fail with one line saying which option needs it."""
    import importlib

    try:
        return importlib.import_module(f"tessel.{module}")
    except ImportError:
        raise ArgumentError(f"{flag} needs tessel.{module}, not available") from None


@dataclass
class Engine:
    """What one rank trains: the GPT, its stages and wrappers, the optimizer, and the pipeline schedule."""

    args: object
    dims: ParallelDims
    gpt: GPT
    stages: list[nn.Module]  # this rank's stage modules (the GPT itself without pipelining)
    wrapper: nn.Module  # the one DDP/FSDP wrapper around all of them
    named: dict[str, nn.Parameter]  # this rank's parameters by their name in the whole GPT
    optimizer: torch.optim.Optimizer
    opt_state: object  # the optimizer's state as pieces of global tensors, and back (train_state.py)
    num_params: int = 0  # of the whole model, counted before other stages' parameters were released
    flops_per_token: float = 0.0
    model_state: ModelState | None = None  # the parameters in fp32, unless the optimizer's state holds them
    schedule: object = None
    is_first: bool = True
    is_last: bool = True
    _microbatch_losses: list[torch.Tensor] = field(default_factory=list)
    _target_weight: torch.Tensor | None = None  # with documents: dp·cp / the global batch's counted targets
    _hf_router: torch.Tensor | None = None  # a Hugging Face mixture's weighted balancing loss, of the latest forward
    model_config: GPTConfig | None = None  # the model's shape (the GPT's own config; a Hugging Face model's source)
    fp8_layers: int = 0  # layers whose GEMMs run in fp8 (--fp8): linear layers and mixtures of experts

    @property
    def config(self) -> GPTConfig:
        return self.model_config if self.model_config is not None else self.gpt.config

    @property
    def device(self) -> torch.device:
        return self.dims.device

    @property
    def rank(self) -> int:
        return self.dims.rank

    # ------------------------------------------------------------------------------------------------ step

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return self.optimizer.scale_loss(loss) if hasattr(self.optimizer, "scale_loss") else loss

    def _pipeline_loss(self, output, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss: the last stage returns its final norm's output (``fused_loss``), and its head and
        loss run through the wrapper (which holds the head's parameters, gathered under FSDP) without logits. A
        Hugging Face mixture's last stage returns its router sums beside it: their balancing loss and router z-loss
        are trained (with weight 1 / microbatches, as the pieces of :meth:`_accumulate` weigh theirs), not
        reported."""
        last = next(k for k, stage in enumerate(self.stages) if stage.last)
        loss = self._weighted(self.wrapper(output, stage=last, targets=target), target, self.args.microbatches)
        if not torch.is_grad_enabled():  # evaluating (Schedule.eval): the loss itself
            return loss
        self._microbatch_losses.append(loss.detach().float())
        router = self.stages[last].router_loss(output) if self.args.hf else None
        if router is not None and self.args.z_loss_coef > 0:  # ST-MoE's router z-loss over every layer's routers
            router = router + self.args.z_loss_coef * router_z_loss(output[1], self.args.experts)
        return self._scaled(loss if router is None else loss + router)

    def _weighted(self, loss: torch.Tensor, target: torch.Tensor, parts: int = 1) -> torch.Tensor:
        """With documents, the mean ``loss`` over ``target``'s counted tokens (one of ``parts`` equal pieces of
        this rank's batch) times ``parts · dp·cp · count / global count``: averaged over the pieces and the
        data-parallel ranks, the mean over every counted target of the global batch."""
        if self._target_weight is None:
            return loss
        return loss * ((target != -100).sum() * parts * self._target_weight)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One optimizer step on this rank's rows ``x, y [B, S]`` (documents ``segment_ids``: ``[B, S]`` of
        the whole sequence under context parallelism); returns the global batch's mean loss (fp32) over its
        targets.

        With documents, targets across a document boundary are ignored (``-100``) and the ranks (and the
        pipeline's microbatches) count different numbers of the others: each mean is weighted by its share
        of the global count, so that the gradients the data-parallel ranks average, and the loss, are
        those of the mean over every target of the global batch, as in one process.
        """
        self.optimizer.zero_grad(set_to_none=False)
        self._target_weight = None if segment_ids is None else self._global_target_weight(y)
        if self.schedule is None:
            local = self._accumulate(x, y, segment_ids)
        else:
            self._run_pipeline(x, y, segment_ids)
            local = torch.stack(self._microbatch_losses).mean() if self.is_last else torch.zeros((), device=x.device)
        if self.args.grad_clip > 0 and self.args.zero == 0:
            clip_grad_norm(self.named.values(), self.args.grad_clip, self.dims)
        elif self.args.grad_clip > 0 and self.args.pp > 1:  # ZeroAdam's own clipping sees DP and TP, not PP
            clip_grad_shards(self.wrapper, self.args.grad_clip, self.dims, self.optimizer.loss_scale)
        self.optimizer.step()
        if self.config.expert_bias_rate:  # the step's routes per expert, over the ranks that hold other tokens
            update_expert_biases(nn.ModuleList(self.stages), self.config.expert_bias_rate, self.dims.dp_group)
        return self._global_loss(local)

    def _accumulate(self, x: torch.Tensor, y: torch.Tensor, segment_ids: torch.Tensor | None) -> torch.Tensor:
        """Forward and backward of this rank's rows in ``--microbatches`` equal pieces (gradient accumulation; one
        piece by default): the gradients add up locally and the DDP/FSDP wrapper reduces them once, in the last
        piece's backward. Returns this rank's loss (fp32), the mean over the pieces (each weighted by its counted
        targets with documents).

        Each piece's loss (the head and the loss chunk by chunk, GPT.forward with targets: no ``[B, S, V/t]``
        logits are held) enters the gradient with weight ``1 / pieces``, its experts' load-balancing and z-loss
        likewise, computed over the piece's own tokens as a pipeline's microbatches compute them."""
        parts = self.args.microbatches
        ids = [None] * parts if segment_ids is None else segment_ids.chunk(parts)
        pieces = zip(x.chunk(parts), y.chunk(parts), ids, strict=True)
        no_sync = getattr(self.wrapper, "no_sync", contextlib.nullcontext)
        losses = []
        for i, (xs, ys, seg) in enumerate(pieces):
            # the last backward runs outside no_sync: its buckets' reductions overlap it, as without accumulation
            with no_sync() if i < parts - 1 else contextlib.nullcontext():
                docs = {} if seg is None else {"segment_ids": seg}
                loss = self._weighted(self._model_loss(xs, ys, docs), ys, parts)
                router = self._router_loss()  # the experts' load balancing and z-loss: trained, not reported
                self._scaled((loss if router is None else loss + router) / parts).backward()
            losses.append(loss.detach().float())
        return torch.stack(losses).mean()

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The global batch's mean loss (fp32) over its targets, forward only: ``x, y`` and ``segment_ids`` as for
        :meth:`train_step`, nothing learned.

        The model in eval mode (no routes counted for the experts' biases) under ``torch.no_grad()``; a pipeline
        runs its schedule's forwards alone (``Schedule.eval``) in ``--microbatches`` pieces; otherwise the rows
        go through in one piece (no backward, so no activations to bound). The experts' router losses are not
        part of it."""
        self._target_weight = None if segment_ids is None else self._global_target_weight(y)
        self.wrapper.eval()
        try:
            if self.schedule is None:
                docs = {} if segment_ids is None else {"segment_ids": segment_ids}
                local = self._weighted(self._model_loss(x, y, docs), y).float()
            else:
                losses = []
                self.schedule.eval(*self._pipeline_inputs(x, segment_ids), target=y if self.is_last else None,
                                   losses=losses)  # fmt: skip
                local = torch.stack(losses).float().mean() if self.is_last else torch.zeros((), device=x.device)
        finally:
            self.wrapper.train()
        return self._global_loss(local)

    def _model_loss(self, x: torch.Tensor, y: torch.Tensor, docs: dict) -> torch.Tensor:
        """The mean loss of next-token targets ``y`` through the wrapped model, without logits: the GPT's
        ``forward(x, targets=)``, or a Hugging Face model's fused forward."""
        if self.args.hf:  # documents as Hugging Face packs them: position ids restarting at each one
            loss, self._hf_router = hf_loss(self.wrapper, x, y, docs.get("segment_ids"), self.args.aux_loss_coef,
                                            self.args.z_loss_coef, **attention_kwargs(self.args))  # fmt: skip
            return loss
        return self.wrapper(x, targets=y, **docs)

    def _router_loss(self) -> torch.Tensor | None:
        """The experts' load balancing (and z-loss) of the latest forward: the GPT's, or the one a Hugging Face
        mixture's forward returned beside its loss."""
        return self._hf_router if self.args.hf else self.gpt.router_loss()

    def _pipeline_inputs(self, x: torch.Tensor, segment_ids: torch.Tensor | None) -> tuple:
        """What the first stage takes: the tokens, and with documents their ids (tessel's GPT) or the positions
        restarting at each one (a Hugging Face model, as it packs sequences); later stages take nothing here."""
        if not self.is_first:
            return ()
        if segment_ids is None:
            return (x,)
        return (x, document_positions(segment_ids) if self.args.hf else segment_ids)

    def _global_target_weight(self, y: torch.Tensor) -> torch.Tensor:
        """``dp·cp / global count`` of the targets that are not ignored, over the data-parallel ranks."""
        total = (y != -100).sum().float()
        dist.all_reduce(total, group=self.dims.dp_cp_group)
        return (self.dims.dp * self.dims.cp) / total.clamp(min=1)

    def _run_pipeline(self, x: torch.Tensor, y: torch.Tensor, segment_ids: torch.Tensor | None = None) -> None:
        """One schedule step over the microbatches, reducing the DDP/FSDP gradients once instead of per backward.

        The schedule runs a backward per microbatch and stage, each of which would reduce every bucket or
        unit; under ``no_sync`` they accumulate locally, and ``sync_gradients()`` reduces the sums once.
        (FSDP then holds each unit's full gradient until the step's last backward, as torch's pipelining
        does with FSDP.)
        """
        self._microbatch_losses.clear()
        if self.config.n_expert:  # each stage's router losses, weighted as the microbatch losses are
            weight = self._scaled(torch.tensor(1 / self.config.n_layer, device=self.device))
            for stage in self.stages:
                stage.aux_grad = weight / self.args.microbatches
        no_sync = getattr(self.wrapper, "no_sync", None)
        with no_sync() if no_sync else contextlib.nullcontext():
            self.schedule.step(*self._pipeline_inputs(x, segment_ids), target=y if self.is_last else None)
        if no_sync:
            self.wrapper.sync_gradients()

    def _global_loss(self, local: torch.Tensor) -> torch.Tensor:
        """Mean over DP × CP of the last pipeline stage's loss (TP ranks hold the same value)."""
        total = local.reshape(1).to(self.device, torch.float32)
        dist.all_reduce(total)  # only last-stage ranks contribute: tp copies of each DP × CP rank's loss
        return (total / (self.dims.dp * self.dims.cp * self.dims.tp)).cpu()[0]

    # ------------------------------------------------------------------------------------------------ state

    def _model_buffers(self) -> dict[str, torch.Tensor]:
        """``model.<fqn>``: this rank's persistent buffers (the experts' routing biases), whole tensors alike on
        every rank that holds their stage; loading writes into them in place."""
        persistent = self.gpt.state_dict(keep_vars=True).keys()
        local = {id(b) for m in self.stages for b in m.buffers()}
        return {f"model.{n}": b for n, b in self.gpt.named_buffers() if id(b) in local and n in persistent}

    def state_dict(self) -> dict:
        """This rank's part of the run's state, keyed by global tensors (``train_state.py``); no communication."""
        state = {**self.opt_state.state(), **self._model_buffers()}
        if self.opt_state.owns_params:  # ZeroAdam: the fp32 masters are the model's weights
            return state
        return {**self.model_state.state(), **state}

    def state_template(self) -> dict:
        """The keys :meth:`state_dict` saves, with this rank's buffers to load into (:meth:`load_state_dict`)."""
        state = {**self.opt_state.template(), **self._model_buffers()}
        if self.opt_state.owns_params:
            return state
        return {**self.model_state.template(), **state}

    def load_state_dict(self, state: dict) -> None:
        """Apply a :meth:`state_template` that a checkpoint has filled (the buffers are loaded in place)."""
        if not self.opt_state.owns_params:
            self.model_state.load(state)
        self.opt_state.load(state)


@torch.no_grad()
def clip_grad_norm(params, max_norm: float, dims: ParallelDims) -> torch.Tensor:
    """Scale gradients so that their global norm (over TP shards and pipeline stages) is at most ``max_norm``.

    TP-sharded parameters contribute their squares from every TP rank (a chunk several of them hold, kv heads
    fewer than the ranks, from the first); replicated ones (norm weights,
    whose gradients the layers already reduce) once; pipeline stages hold disjoint parameters; the ranks of
    an expert-parallel group hold different experts (their squares are summed over the group first).
    """
    grads = [(p, p.grad, is_tp_sharded(p), is_expert(p)) for p in params if p.grad is not None]
    sums = torch.zeros(4, dtype=torch.float32, device=dims.device)  # tp-sharded, replicated; and those of experts
    tp_rank = group_rank(dims.tp_group)
    for p, g, sharded, expert in grads:  # a chunk replicated over tp ranks counted on one of them (square_sum)
        sums[(0 if sharded else 1) + 2 * expert] += square_sum(p, g.reshape(-1), 0, dims.tp, tp_rank)
    if dims.ep > 1:
        dist.all_reduce(sums[2:], group=dims.ep_group)
    sums = sums[:2] + sums[2:]
    if dims.tp > 1:
        dist.all_reduce(sums[:1], group=dims.tp_group)
    total = sums.sum().reshape(1)
    if dims.pp > 1:
        dist.all_reduce(total, group=dims.pp_group)
    norm = total.sqrt()[0]
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # torch.nn.utils.clip_grad_norm_'s rule
    if grads:
        torch._foreach_mul_([g for _, g, *_ in grads], coef)
    return norm


@torch.no_grad()
def clip_grad_shards(wrapper: nn.Module, max_norm: float, dims: ParallelDims, loss_scale: float | None) -> torch.Tensor:
    """:func:`clip_grad_norm` for ZeRO, whose averaged gradients exist only as this rank's shards of the
    wrapper's buckets (disjoint over DP). A non-finite gradient makes the coefficient 0·inf = NaN, which
    ZeroAdam's step then detects and skips as it would have done itself."""
    sums = torch.zeros(2, dtype=torch.float32, device=dims.device)
    shards = [b.grad_shard for b in wrapper.buckets]
    tp_rank = group_rank(dims.tp_group)
    for b in wrapper.buckets:
        for slot, lo, hi in b.shard_slices():
            start = lo + b.shard_offset - slot.offset  # of the parameter's flattened elements
            sums[0 if is_tp_sharded(slot.param) else 1] += square_sum(slot.param, b.grad_shard[lo:hi], start, dims.tp,
                                                                      tp_rank)  # fmt: skip
    dist.all_reduce(sums, group=dims.dp_cp_group)
    if dims.tp > 1:
        dist.all_reduce(sums[:1], group=dims.tp_group)
    total = sums.sum().reshape(1)
    dist.all_reduce(total, group=dims.pp_group)
    norm = total.sqrt()[0] / (loss_scale or 1.0)  # the gradients still carry the loss scale
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(shards, coef)
    return norm


def _stage_ids(args, dims: ParallelDims) -> list[int]:
    return [dims.pp_rank + i * args.pp for i in range(args.stages_per_rank)]


def _release(gpt: GPT, keep: dict[str, nn.Parameter]) -> None:
    """Free the parameters of other pipeline ranks' stages (every rank built the whole model)."""
    kept = {id(p) for p in keep.values()}
    for p in gpt.parameters():
        if id(p) not in kept:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def _optimizer(args, params: list[nn.Parameter], dims: ParallelDims, named: dict):
    if args.zero == 0:
        fused = dims.device.type == "cuda"
        opt = torch.optim.AdamW(params, lr=args.lr, betas=BETAS, eps=EPS, weight_decay=args.weight_decay, fused=fused)
        return opt, TorchAdamWState(opt, named, dims.tp_group, dims.dp_cp_group, dims.expert_dp_group)
    zero = _need("parallel.zero", f"--zero {args.zero}")
    opt = zero.ZeroAdam(
        params,
        lr=args.lr,
        betas=BETAS,
        eps=EPS,
        weight_decay=args.weight_decay,
        group=dims.dp_cp_group,
        tp_group=dims.tp_group,
        loss_scale="dynamic" if args.dtype == "fp16" else None,
        max_grad_norm=(args.grad_clip or None) if args.pp == 1 else None,
        **({"stage": args.zero} if args.zero < 3 else {}),
    )
    return opt, ZeroAdamState(opt, named, dims.tp_group)


def compile_blocks(blocks, backend: str) -> None:
    """``torch.compile`` each transformer block's forward in place, with ``backend``: the GPT's blocks, or a
    Hugging Face model's decoder layers.

    The blocks share one compiled graph (same code; their parameters are the graph's inputs). Each block's
    module hooks stay outside it, so FSDP gathers and frees parameters around the compiled forward as it does
    eagerly (and tensor parallelism's sequence rings begin and end around it), and activation checkpointing
    recomputes the compiled forward."""
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=backend)


def _wrap(args, module: nn.Module, dims: ParallelDims, unit: type) -> nn.Module:
    if args.dp * args.cp == 1 and args.zero == 0:  # nothing to reduce: torch's AdamW on the module's own parameters
        return module
    experts = dims.expert_dp_group if dims.ep > 1 else None  # each ep rank's experts: over their replicas
    if args.zero == 3:  # units: the transformer blocks (their experts a unit apart); the root: embedding, norm, head
        fsdp = _need("parallel.fsdp", "--zero 3")
        return fsdp.FSDP(module, group=dims.dp_cp_group, wrap={unit}, expert_group=experts)
    return _need("parallel.ddp", f"--zero {args.zero}").DDP(module, group=dims.dp_cp_group, expert_group=experts)


class _Stages(nn.Module):
    """This rank's pipeline stages as one module, so that one DDP/FSDP wrapper (and one ZeroAdam) covers
    them all (the interleaved schedule gives a rank several)."""

    def __init__(self, stages: list[nn.Module]):
        super().__init__()
        self.stages = nn.ModuleList(stages)

    def forward(self, *args, stage: int = 0, targets: torch.Tensor | None = None):
        """Stage ``stage`` on ``args``; with ``targets``, that (last) stage's loss of its output ``args[0]`` (a
        Hugging Face stage's language-model loss alone: the engine adds a mixture's router loss unweighted)."""
        if targets is None:
            return self.stages[stage](*args)
        module = self.stages[stage]
        return getattr(module, "lm_loss", module.loss)(args[0], targets)


class _StageCall(nn.Module):
    """Stage ``index`` of a wrapped :class:`_Stages`, called through the wrapper (FSDP gathers parameters
    in its forward); holds the stage module so that its parameters (and device) are visible."""

    def __init__(self, wrapper: nn.Module, stage: nn.Module, index: int):
        super().__init__()
        self.stage, self.index, self._wrapper = stage, index, (wrapper,)  # a tuple: not a submodule

    def forward(self, *args):
        return self._wrapper[0](*args, stage=self.index)


def _schedule(args, wrapper: nn.Module, modules: list[nn.Module], dims: ParallelDims, loss_fn):
    pipeline = _need("parallel.pipeline", f"--pp {args.pp}")
    n = args.pp * args.stages_per_rank
    ids = _stage_ids(args, dims)
    calls = [_StageCall(wrapper, m, k) for k, m in enumerate(modules)]
    stages = [pipeline.PipelineStage(c, s, n, group=dims.pp_group) for c, s in zip(calls, ids)]
    kinds = {
        "gpipe": "ScheduleGPipe",
        "1f1b": "Schedule1F1B",
        "interleaved": "ScheduleInterleaved1F1B",
        "zb": "ScheduleZeroBubble",
    }
    cls = getattr(pipeline, kinds[args.schedule])
    return cls(stages if args.schedule == "interleaved" else stages[0], args.microbatches, loss_fn)


def build_engine(args, dims: ParallelDims) -> Engine:
    """The GPT of ``args.preset`` laid out on ``dims``, wrapped, with its optimizer (and pipeline schedule)."""
    torch.manual_seed(args.seed)
    model = dict(PRESETS[args.preset].model)
    if args.kv_heads is not None:  # grouped-query attention
        model["n_kv_head"] = args.kv_heads
    config = GPTConfig(
        **model,
        vocab_size=args.vocab_size,
        deterministic_attention=args.attention_backward == "deterministic",
        recompute=args.recompute,
        sliding_window=args.sliding_window,
        n_expert=args.experts,
        top_k=args.top_k,
        aux_loss_coef=args.aux_loss_coef,
        z_loss_coef=args.z_loss_coef,
        label_smoothing=args.label_smoothing,
        logit_z_loss=args.logit_z_loss,
        expert_bias_rate=args.expert_bias_rate,
        router_score=args.router_score,
        expert_groups=args.expert_groups,
        top_groups=args.top_groups,
    )
    if args.hf:  # a Hugging Face model of the same shape, made parallel as a user would (train_hf.py)
        gpt, num_params, flops_per_token = build_hf(args, config, dims, DTYPES[args.dtype])
        unit = decoder_layer_class(gpt)
    else:
        gpt = GPT(
            config,
            tp_group=dims.tp_group,
            cp_group=dims.cp_group,
            ep_group=dims.ep_group,
            sequence_parallel=args.sequence_parallel,
            overlap=OVERLAPS[args.overlap],
            device="meta" if args.init else dims.device,  # --init: each rank reads its shards of the checkpoint
            dtype=DTYPES[args.dtype],
        )
        if args.init:
            init_from(gpt, args.init, dims)
        num_params, flops_per_token, unit = gpt.num_params(), gpt.flops_per_token(args.seq_len), TransformerBlock
    if args.fp8:  # every linear layer but the head (tessel's and Hugging Face's: their weights stay as they are)
        convert_to_fp8(gpt)
    fp8_count = len(fp8_layers(gpt))
    if args.compile:
        compile_blocks(decoder_layers(gpt) if args.hf else gpt.blocks, args.compile)
    if args.pp == 1:
        stages = [gpt]
    else:
        n = args.pp * args.stages_per_rank
        stage = (
            (lambda s: hf_stage(gpt, s, n, args)) if args.hf else (lambda s: gpt.pipeline_stage(s, n, fused_loss=True))
        )
        stages = [stage(s) for s in _stage_ids(args, dims)]
    local = {id(p) for m in stages for p in m.parameters()}
    named = {name: p for name, p in gpt.named_parameters() if id(p) in local}
    if args.pp > 1:
        _release(gpt, named)
    wrapper = _wrap(args, stages[0] if args.pp == 1 else _Stages(stages), dims, unit)
    optimizer, opt_state = _optimizer(args, list(named.values()), dims, named)
    engine = Engine(args, dims, gpt, stages, wrapper, named, optimizer, opt_state, num_params, flops_per_token,
                    model_state=ModelState(named, dims.tp_group, dims.dp_cp_group, dims.expert_dp_group),
                    model_config=config)  # fmt: skip
    if args.pp > 1:
        n = args.pp * args.stages_per_rank
        ids = _stage_ids(args, dims)
        engine.is_first, engine.is_last = 0 in ids, n - 1 in ids
        engine.schedule = _schedule(args, wrapper, stages, dims, engine._pipeline_loss)
    assert group_size(dims.tp_group) == args.tp
    engine.fp8_layers = fp8_count
    return engine
