"""The reference GPT built from tessel's layers: dense with ``tp_group=None``, tensor-parallel otherwise.

Legend: ``B`` batch, ``S`` sequence, ``E`` = ``n_embd``, ``V`` vocabulary, ``L`` layers, ``t`` TP size.
A pre-norm decoder (GPT-2 / Llama layout): vocab-parallel embedding → L × [norm → attention (GQA,
rotary) → residual, norm → MLP (SwiGLU or GELU) → residual] → norm → vocab-parallel lm head. The
logits stay split over the vocabulary (``[B, S, V/t]``) and :meth:`GPT.loss` computes the cross entropy
without gathering them.

Initialisation is independent of the layout: every parameter's *global* tensor is drawn from its own
generator (seeded from torch's default generator, so ranks seeded alike agree) and each rank keeps its
shard. ``GPT(config, tp_group=g)`` therefore equals ``parallelize(GPT(config), g)`` under the same seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..kernels.attention import HEAD_DIMS
from ..parallel.comm import group_size
from ..parallel.sharding import global_shape, shard_like
from .attention import ParallelAttention, check_heads, check_window, context_size
from .cross_entropy import check_loss_options, vocab_parallel_cross_entropy
from .embedding import VocabParallelEmbedding
from .linear import ColumnParallelLinear
from .linear_cross_entropy import linear_cross_entropy
from .mlp import MLP_ACTIVATIONS, ParallelMLP
from .moe import ROUTER_SCORES, ParallelMoE, check_expert_groups, update_expert_biases
from .norm import LayerNorm, RMSNorm

__all__ = ["GPT", "GPTConfig", "TransformerBlock"]

NORMS = {"rmsnorm": RMSNorm, "layernorm": LayerNorm}


@dataclass
class GPTConfig:
    """nanoGPT's names plus GQA (``n_kv_head``), the MLP and norm kinds, and rotary's base."""

    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 256
    n_kv_head: int | None = None
    mlp: str = "swiglu"
    norm: str = "rmsnorm"
    bias: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    mlp_hidden: int | None = None
    init_std: float = 0.02
    deterministic_attention: bool = True  # False: flash attention's backward adds dQ up with atomics
    recompute: bool = False  # activation checkpointing: each block's activations are recomputed in backward
    sliding_window: int | None = None  # each token attends to this many latest tokens up to itself (Mistral's name)
    n_expert: int = 0  # > 0: every block's MLP is a mixture of this many experts (ParallelMoE), each mlp_hidden wide
    top_k: int = 2  # experts per token
    router_score: str = "softmax"  # how the router scores the experts: "softmax" (Mixtral) or "sigmoid" (DeepSeek-V3)
    # group-limited routing (DeepSeek-V3's n_group / topk_group): the experts form this many groups of consecutive
    # experts and each token chooses among those of its top_groups best groups only
    expert_groups: int = 1
    top_groups: int = 1
    aux_loss_coef: float = 0.01  # weight of the load-balancing loss (mean over the layers) in GPT.loss
    z_loss_coef: float = 0.0  # weight of the router z-loss (mean over the layers) in GPT.loss; ST-MoE uses 1e-3
    # > 0: auxiliary-loss-free balancing, each layer's expert biases move by this much per update_expert_bias()
    # (DeepSeek-V3 uses 1e-3 with aux_loss_coef ~0)
    expert_bias_rate: float = 0.0
    label_smoothing: float = 0.0  # of the language-model loss, as F.cross_entropy's (GPT.loss, forward(targets=))
    logit_z_loss: float = 0.0  # PaLM's z-loss on the output logits: this times logsumexp² per token (PaLM: 1e-4)

    def __post_init__(self):
        for name in ("vocab_size", "n_layer", "n_head", "n_embd", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig: {name} must be a positive int, received {value!r}")
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.n_embd % self.n_head or self.n_embd // self.n_head not in HEAD_DIMS:
            raise ValueError(
                f"GPTConfig: n_embd={self.n_embd} must split into n_head={self.n_head} heads of a size in {HEAD_DIMS} "
                "(the flash attention kernel's head dims)"
            )
        check_heads("GPTConfig", self.n_head, self.n_kv_head, 1)
        if self.mlp not in MLP_ACTIVATIONS:
            raise ValueError(f"GPTConfig: mlp must be one of {MLP_ACTIVATIONS}, received {self.mlp!r}")
        if self.norm not in NORMS:
            raise ValueError(f"GPTConfig: norm must be one of {tuple(NORMS)}, received {self.norm!r}")
        for name in ("deterministic_attention", "recompute"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"GPTConfig: {name} must be a bool, received {getattr(self, name)!r}")
        check_window("GPTConfig", self.sliding_window, True, arg="sliding_window")
        for name in ("n_expert", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"GPTConfig: {name} must be a non-negative int, received {value!r}")
        if self.n_expert and self.bias:
            raise ValueError("GPTConfig: the experts have no biases; bias=True needs n_expert=0")
        if self.router_score not in ROUTER_SCORES:
            raise ValueError(f"GPTConfig: router_score must be one of {ROUTER_SCORES}, received {self.router_score!r}")
        if self.n_expert and not 1 <= self.top_k <= self.n_expert:
            raise ValueError(f"GPTConfig: top_k must be in [1, n_expert={self.n_expert}], received {self.top_k}")
        if self.n_expert:
            check_expert_groups(
                "GPTConfig", self.n_expert, self.top_k, self.expert_groups, self.top_groups, "expert_groups"
            )
        elif (self.expert_groups, self.top_groups) != (1, 1):
            raise ValueError(f"GPTConfig: expert_groups={self.expert_groups}, top_groups={self.top_groups} group the "
                             "experts: they need n_expert > 0")  # fmt: skip
        for name in ("aux_loss_coef", "z_loss_coef", "expert_bias_rate"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not (0 <= value < math.inf):
                raise ValueError(f"GPTConfig: {name} must be a finite non-negative number, received {value!r}")
        check_loss_options("GPTConfig", self.label_smoothing, self.logit_z_loss, z_loss_name="logit_z_loss")
        if self.expert_bias_rate and not self.n_expert:
            raise ValueError(f"GPTConfig: expert_bias_rate={self.expert_bias_rate} needs experts (n_expert > 0)")
        if self.mlp_hidden is None:  # SwiGLU keeps the MLP's parameter count at ~8E² (Shazeer 2020), rounded to 64
            self.mlp_hidden = 4 * self.n_embd if self.mlp == "gelu" else 64 * math.ceil(8 * self.n_embd / 3 / 64)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def _norm(config: GPTConfig, tp_group, sequence_parallel: bool, device, dtype) -> nn.Module:
    return NORMS[config.norm](config.n_embd, config.norm_eps, tp_group=tp_group,
                              sequence_parallel=sequence_parallel, device=device, dtype=dtype)  # fmt: skip


class TransformerBlock(nn.Module):
    """``x + attn(attn_norm(x))``, then ``x + mlp(mlp_norm(x))``; ``[B, S, E]`` (``[B, S/t, E]`` under SP;
    the sequence is further split over ``cp_group``, see :class:`~tessel.layers.attention.ParallelAttention`)."""

    def __init__(self, config: GPTConfig, *, tp_group=None, sequence_parallel=False, overlap="auto",
                 cp_group=None, ep_group=None, device=None, dtype=None):  # fmt: skip
        super().__init__()
        kw = dict(tp_group=tp_group, sequence_parallel=sequence_parallel, overlap=overlap, device=device, dtype=dtype)
        self.attn_norm = _norm(config, tp_group, sequence_parallel, device, dtype)
        self.attn = ParallelAttention(config.n_embd, config.n_head, config.n_kv_head, bias=config.bias,
                                      rope_theta=config.rope_theta, deterministic=config.deterministic_attention,
                                      cp_group=cp_group, window=config.sliding_window, **kw)  # fmt: skip
        self.mlp_norm = _norm(config, tp_group, sequence_parallel, device, dtype)
        if config.n_expert:
            self.mlp = ParallelMoE(config.n_embd, config.mlp_hidden, config.n_expert, config.top_k,
                                   activation=config.mlp, tp_group=tp_group, sequence_parallel=sequence_parallel,
                                   ep_group=ep_group, cp_group=cp_group, expert_bias=config.expert_bias_rate > 0,
                                   router_score=config.router_score, expert_groups=config.expert_groups,
                                   top_groups=config.top_groups, device=device, dtype=dtype)  # fmt: skip
        else:
            self.mlp = ParallelMLP(config.n_embd, config.mlp_hidden, activation=config.mlp, bias=config.bias, **kw)

    def forward(self, x: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), segment_ids)
        return x + self.mlp(self.mlp_norm(x))


def run_blocks(blocks: nn.ModuleList, x: torch.Tensor, recompute: bool, segment_ids=None) -> torch.Tensor:
    """``x`` through ``blocks``, each given ``segment_ids`` (packed documents, or ``None``); with
    ``recompute`` (activation checkpointing, when autograd records) each block keeps only its input for
    backward and runs its forward again there, collectives included,
    before its own backward: per block one ``[B, S, E]`` tensor (``[B, S/t, E]`` under sequence
    parallelism) is held instead of every intermediate (norm outputs, q/k/v, the attention output and
    its log-sum-exp, the MLP's hidden activations), for one more forward pass of compute. The
    recomputation is non-reentrant (:func:`torch.utils.checkpoint.checkpoint` with ``use_reentrant=False``),
    so the block's own module hooks run again, as :class:`~tessel.parallel.FSDP`'s regathering needs,
    and gradients equal those of the plain forward bit for bit."""
    recompute = recompute and torch.is_grad_enabled()
    for block in blocks:
        x = checkpoint(block, x, segment_ids, use_reentrant=False) if recompute else block(x, segment_ids)
    return x


class GPT(nn.Module):
    """``GPT(config)(idx [B, S]) -> logits [B, S, V/t]`` (the whole vocabulary when ``t = 1``).

    With ``cp_group`` of ``c`` ranks (context parallelism) ``idx`` and ``targets`` are this rank's
    zigzag share of the sequence, ``[B, S/c]`` (:func:`~tessel.parallel.context.split_sequence`), the
    logits are those of these tokens, and :meth:`loss` is the mean over them: the mean over the cp
    ranks is the whole sequence's loss. Parameters are replicated over the cp ranks; average their
    gradients over the cp group (with the data-parallel ranks, in one data-parallel wrapper).
    """

    # Module-name glob → style, read by :func:`~tessel.layers.parallelize.parallelize`.
    tessel_tp_plan: ClassVar[dict[str, str]] = {
        "embed": "embedding",
        "blocks.*.attn_norm": "norm",
        "blocks.*.attn.qkv": "colwise",
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.mlp_norm": "norm",
        "blocks.*.mlp.fc": "colwise",
        "blocks.*.mlp.proj": "rowwise",
        "norm": "norm",
        "lm_head": "colwise",
    }

    def __init__(self, config: GPTConfig, *, tp_group=None, sequence_parallel=False, overlap="auto",
                 cp_group=None, ep_group=None, device=None, dtype=None):  # fmt: skip
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT: config must be a GPTConfig, received {type(config).__name__}")
        check_heads("GPT", config.n_head, config.n_kv_head, group_size(tp_group))
        self.config, self.tp_group, self.sequence_parallel = config, tp_group, sequence_parallel
        self.cp_group, self.ep_group = cp_group, ep_group
        if config.n_expert:  # each block's experts are split as one module (ParallelMoE.from_module)
            plan = {k: v for k, v in type(self).tessel_tp_plan.items() if not k.startswith("blocks.*.mlp.")}
            self.tessel_tp_plan = {**plan, "blocks.*.mlp": "moe"}
        if ep_group is not None and not config.n_expert:
            raise ValueError("GPT: ep_group splits the experts over ranks, but the config has none (n_expert=0)")
        # Drawn before the submodules draw their own (layout-dependent) initial values.
        init_seed = int(torch.randint(2**62, (1,)).item())
        kw = dict(tp_group=tp_group, sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.embed = VocabParallelEmbedding(config.vocab_size, config.n_embd, **kw)
        self.blocks = nn.ModuleList(
            TransformerBlock(config, overlap=overlap, cp_group=cp_group, ep_group=ep_group, **kw)
            for _ in range(config.n_layer)
        )
        self.norm = _norm(config, tp_group, sequence_parallel, device, dtype)
        self.lm_head = ColumnParallelLinear(config.n_embd, config.vocab_size, bias=False, overlap=overlap, **kw)
        self.reset_parameters(init_seed)

    # ------------------------------------------------------------------------------------------------ init

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """GPT-2's initialisation: N(0, init_std), residual projections scaled by 1/√(2L), norms 1, biases 0.

        Parameter i's global tensor comes from a generator seeded ``seed + i`` (``seed`` drawn from torch's
        default generator when None), so every layout of the same model starts from the same weights.
        """
        base_seed = int(torch.randint(2**62, (1,)).item()) if seed is None else seed
        std, t = self.config.init_std, group_size(self.tp_group)
        for index, (name, p) in enumerate(self.named_parameters()):
            if name.endswith("bias"):
                p.zero_()
            elif "norm" in name:
                p.fill_(1.0)
            else:
                residual = name.endswith(("proj.weight", "mlp.proj"))  # the experts' down-projections too
                scale = 1 / math.sqrt(2 * self.config.n_layer) if residual else 1.0
                gen = torch.Generator().manual_seed(base_seed + index)
                full = torch.randn(global_shape(p, t), generator=gen, dtype=torch.float32) * (std * scale)
                p.copy_(shard_like(full, p, self.tp_group))

    # ------------------------------------------------------------------------------------------------ forward

    def _check_idx(self, idx, segment_ids=None) -> None:
        if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int64, torch.int32) or idx.dim() != 2:
            got = f"{idx.dtype} tensor of shape {tuple(idx.shape)}" if isinstance(idx, torch.Tensor) else type(idx)
            raise ValueError(f"GPT: idx must be an int64 [batch, seq] tensor, received {got}")
        c = context_size(self.cp_group)
        if segment_ids is not None:
            whole = (idx.shape[0], idx.shape[1] * c)
            ok = isinstance(segment_ids, torch.Tensor) and not segment_ids.is_floating_point()
            if not (ok and segment_ids.dtype != torch.bool and tuple(segment_ids.shape) == whole):
                got = (f"{segment_ids.dtype} tensor of shape {tuple(segment_ids.shape)}"
                       if isinstance(segment_ids, torch.Tensor) else type(segment_ids).__name__)  # fmt: skip
                shape = "idx's shape" if c == 1 else f"[B, S] of the whole sequence ({c} cp ranks)"
                raise ValueError(f"GPT: segment_ids must be an integer tensor of {shape} {whole}, received {got}")
        if idx.shape[1] * c > self.config.block_size:
            held = f"{idx.shape[1]}" if c == 1 else f"{idx.shape[1] * c} ({idx.shape[1]} on each of {c} cp ranks)"
            raise ValueError(f"GPT: sequence length {held} exceeds block_size={self.config.block_size}")

    def hidden_states(self, idx: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm's output ``[B, S, E]`` (``[B, S/t, E]`` under sequence parallelism)."""
        self._check_idx(idx, segment_ids)
        return self.norm(run_blocks(self.blocks, self.embed(idx), self.config.recompute, segment_ids))

    def forward(
        self, idx: torch.Tensor, segment_ids: torch.Tensor | None = None, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits of ``idx [B, S]``. ``segment_ids`` (an integer ``[B, S]`` tensor, or ``None``): documents
        packed into one row; each run of equal ids attends only within itself, with rotary positions
        restarting at its first token, so its logits are those of the document alone (flash attention
        skips the blocks between documents). Under context parallelism ``idx`` is this rank's zigzag
        share and ``segment_ids`` the whole sequence's ``[B, S]`` ids, the same on every rank.

        With ``targets`` (``[B, S]`` ids, ``-100`` ignored) it returns their mean cross entropy (fp32)
        instead, from :func:`~.linear_cross_entropy.linear_cross_entropy`: the head and the loss run
        chunk by chunk and no ``[B, S, V/t]`` logits are ever held (a training step's largest activation
        otherwise). Called through the module (not :meth:`loss`), so data-parallel wrappers see it."""
        hidden = self.hidden_states(idx, segment_ids)
        if targets is None:
            return self.lm_head(hidden)
        return _head_loss(self.config, self.lm_head, hidden, targets, self.tp_group, self.sequence_parallel)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Mean cross entropy of next-token ``targets [B, S]`` (fp32), the logits never held whole (see
        :meth:`forward`); ``segment_ids`` as in :meth:`forward` (a document's last target is the next
        document's first token unless the caller sets it to ``-100``, which is ignored). With experts, the
        router losses (:meth:`router_loss`) are added."""
        loss = self(idx, segment_ids, targets=targets)
        router = self.router_loss()
        return loss if router is None else loss + router

    def aux_loss(self) -> torch.Tensor | None:
        """The mean over the layers of the experts' load-balancing losses of the last forward (None without
        experts)."""
        return self._mean_over_layers("aux_loss")

    def z_loss(self) -> torch.Tensor | None:
        """The mean over the layers of the routers' z-losses of the last forward (None without experts)."""
        return self._mean_over_layers("z_loss")

    def router_loss(self) -> torch.Tensor | None:
        """What :meth:`loss` adds to the cross entropy with experts: ``aux_loss_coef · aux_loss() + z_loss_coef ·
        z_loss()`` (None without experts)."""
        aux, z = self.aux_loss(), self.z_loss()
        return None if aux is None else self.config.aux_loss_coef * aux + self.config.z_loss_coef * z

    def update_expert_bias(self, group=None) -> torch.Tensor | None:
        """After an optimizer step with ``expert_bias_rate > 0``: move every layer's expert biases towards balance
        (:func:`~tessel.layers.moe.update_expert_biases` with ``group`` the data-parallel ranks) and return the
        step's routes per expert ``[n_layer, n_expert]``; None without the biases."""
        rate = self.config.expert_bias_rate
        return update_expert_biases(self, rate, group) if rate else None

    def _mean_over_layers(self, name: str) -> torch.Tensor | None:
        losses = [getattr(m, name) for m in self.modules() if isinstance(m, ParallelMoE)]
        return torch.stack(losses).mean() if losses and all(x is not None for x in losses) else None

    def loss_from_logits(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy of vocab-parallel ``logits [B, S, V/t]`` (a pipeline's last-stage loss function)."""
        c = self.config
        return vocab_parallel_cross_entropy(logits, targets, self.tp_group, label_smoothing=c.label_smoothing,
                                            z_loss=c.logit_z_loss)  # fmt: skip

    # ------------------------------------------------------------------------------------------------ accounting

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameters of the whole (unsharded) model, every expert included."""
        t = group_size(self.tp_group)
        total = sum(math.prod(global_shape(p, t)) for p in self.parameters())
        return total if include_embedding else total - self.config.vocab_size * self.config.n_embd

    def active_params(self) -> int:
        """Parameters one token passes through, without the embedding: with experts, ``top_k`` of each layer's
        ``n_expert`` experts (the router's included)."""
        c, t = self.config, group_size(self.tp_group)
        idle = sum(math.prod(global_shape(p, t)) for m in self.modules() if isinstance(m, ParallelMoE)
                   for p in (m.fc, m.proj))  # fmt: skip
        return self.num_params(include_embedding=False) - (idle * (c.n_expert - c.top_k) // c.n_expert if idle else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (PaLM, Chowdhery et al. 2022, App. B): ``6·N + 12·L·E·S``, N the parameters a
        token passes through (:meth:`active_params`); under a sliding window ``W`` the attention term counts
        ``min(S, W)`` keys instead of ``S``."""
        c = self.config
        keys = seq_len if c.sliding_window is None else min(seq_len, c.sliding_window)
        return 6 * self.active_params() + 12 * c.n_layer * c.n_embd * keys

    # ------------------------------------------------------------------------------------------------ pipeline

    def pipeline_stage(self, stage_index: int, num_stages: int, *, fused_loss: bool = False) -> GPTStage:
        """Stage ``stage_index`` of ``num_stages``: a contiguous, even split of the blocks (earlier stages
        take one more when it does not divide); the first stage also embeds, the last also normalises and
        projects to logits, or, with ``fused_loss``, returns the final norm's output, whose loss
        :meth:`GPTStage.loss` computes without the logits. The stage shares this model's parameters."""
        if not isinstance(fused_loss, bool):
            raise TypeError(f"GPT.pipeline_stage: fused_loss must be a bool, received {type(fused_loss).__name__}")
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"GPT.pipeline_stage: stage_index must be in [0, {num_stages}), received {stage_index}")
        if num_stages > self.config.n_layer:
            raise ValueError(f"GPT.pipeline_stage: {num_stages} stages for {self.config.n_layer} layers")
        per, extra = divmod(self.config.n_layer, num_stages)
        start = stage_index * per + min(stage_index, extra)
        stop = start + per + (stage_index < extra)
        stage = GPTStage(self, start, stop, first=stage_index == 0, last=stage_index == num_stages - 1)
        stage.fused_loss = fused_loss
        return stage


def _head_loss(config: GPTConfig, head: nn.Module, hidden, targets, tp_group, sequence_parallel: bool):
    """The mean cross entropy of ``targets`` from the final norm's output through the head, without logits."""
    return linear_cross_entropy(hidden, head.weight, targets, tp_group, bias=head.bias,
                                sequence_parallel=sequence_parallel, label_smoothing=config.label_smoothing,
                                z_loss=config.logit_z_loss)  # fmt: skip


class _WithAuxGrad(torch.autograd.Function):
    """``x`` itself forward; backward also gives ``aux`` the gradient ``weight`` (Megatron-LM's aux-loss
    auto-scaler): the router losses of pipeline stages that do not compute the loss get trained."""

    @staticmethod
    def forward(ctx, x, aux, weight):
        ctx.weight, ctx.aux_meta = weight, (aux.shape, aux.dtype)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype = ctx.aux_meta
        return grad, torch.ones(shape, dtype=dtype, device=grad.device) * ctx.weight, None


class GPTStage(nn.Module):
    """Blocks ``[start, stop)`` of a GPT, with the embedding on the first stage and the head on the last.

    ``forward(x, segment_ids=None)``: packed documents as in :meth:`GPT.forward`; a stage that is not the
    last then returns ``(x, segment_ids)``, so that the ids travel to the next stage with the activation
    (a few bytes per token beside its ``E`` values)."""

    def __init__(self, gpt: GPT, start: int, stop: int, *, first: bool, last: bool):
        super().__init__()
        self.first, self.last, self.tp_group, self.recompute = first, last, gpt.tp_group, gpt.config.recompute
        self.sequence_parallel, self.fused_loss = gpt.sequence_parallel, False
        self.embed = gpt.embed if first else None
        self.blocks = nn.ModuleList(gpt.blocks[start:stop])
        self.norm = gpt.norm if last else None
        self.lm_head = gpt.lm_head if last else None
        self.config = gpt.config
        self.aux_grad: float | torch.Tensor | None = None

    def forward(self, x: torch.Tensor, segment_ids: torch.Tensor | None = None, *, targets: torch.Tensor | None = None):
        """With experts and :attr:`aux_grad` set (a float or a 0-d tensor), the backward that reaches this
        stage's output gives each of its blocks' router losses (``aux_loss_coef · aux_loss + z_loss_coef ·
        z_loss``) the gradient ``aux_grad``, as if the pipeline's loss had added them as :meth:`GPT.loss` does
        (``1 / n_layer`` times the loss's own scale: 1/microbatches, a loss scale); the forward's values are
        unchanged. With ``targets`` (the last stage, ``fused_loss``): :meth:`loss` of ``x``, the stage's own
        output, through the forward, so that a schedule's ``loss_fn`` reaches the head through a wrapper that
        gathers parameters in its forward (FSDP): ``lambda output, t: wrapped(output, targets=t)``."""
        if targets is not None:
            return self.loss(x, targets)
        if self.first:
            x = self.embed(x)
        x = run_blocks(self.blocks, x, self.recompute, segment_ids)
        routers = [b.mlp for b in self.blocks if isinstance(b.mlp, ParallelMoE)]
        if self.aux_grad is not None and routers and torch.is_grad_enabled():
            aux, z = self.config.aux_loss_coef, self.config.z_loss_coef
            losses = torch.stack([aux * m.aux_loss + z * m.z_loss for m in routers])
            x = _WithAuxGrad.apply(x, losses.sum(), self.aux_grad)
        if self.last:
            return self.norm(x) if self.fused_loss else self.lm_head(self.norm(x))
        return x if segment_ids is None else (x, segment_ids)

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last stage's mean cross entropy of ``targets`` from its output with ``fused_loss`` (the final norm's),
        through :func:`~.linear_cross_entropy.linear_cross_entropy`: no logits are held."""
        if not self.last:
            raise ValueError("GPTStage.loss: only the last stage holds the head")
        return _head_loss(self.config, self.lm_head, hidden, targets, self.tp_group, self.sequence_parallel)
