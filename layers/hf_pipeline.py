"""Pipeline stages of a Hugging Face causal language model, for :mod:`tessel.parallel.pipeline`.

:func:`hf_pipeline_stage` cuts a ``*ForCausalLM`` (Llama, Mistral, Qwen2/3, OLMo, Phi-3, GLM, SmolLM3 and the
other families of ``SUPPORTED_MODEL_TYPES``), tensor-parallel after
:func:`~.parallelize.parallelize` or not, into ``num_stages`` contiguous runs of its decoder layers, as
:meth:`~.gpt.GPT.pipeline_stage` cuts tessel's GPT: the first stage also embeds the token ids, the last also
applies the final norm and the head. Each stage runs the model's own base-model forward over its layers alone
(a shallow copy of the base model whose ``layers`` are the stage's, whose config counts them, and whose
``layer_types`` are theirs), so the model's masks, rotary embeddings, sliding windows and attention
implementation are its own; a later stage feeds the hidden states it receives as ``inputs_embeds``.

Between stages travels the residual stream ``[B, S, H]`` (``[B, S/t, H]`` under sequence parallelism: the
model's own split, from its first decoder layer to its final norm, so each later stage passes the positions
of the whole sequence, and its base model a placeholder of the whole sequence's shape, from which it builds its
masks, while its first layer runs on the share). The last stage returns the logits (this rank's share of the
vocabulary when the head is split, never gathered) or, with ``fused_loss=True``, the final norm's output, and
:meth:`HFPipelineStage.loss` gives the mean next-token cross entropy over the targets (the labels already
shifted, ``-100`` ignored: what :class:`~tessel.parallel.pipeline.PipelineSchedule` passes as ``target``; with
the label smoothing and z-loss :func:`~.hf_loss.fuse_lm_loss` gave the model),
without logits in the fused case (:func:`~.linear_cross_entropy.linear_cross_entropy`). Under FSDP, whose
wrapper gathers the head's parameters only inside its forward, the schedule's ``loss_fn`` calls the wrapped
stage: ``lambda output, target: wrapped(output, targets=target)``.

The decoders Hugging Face gives no plan (GPT-2, GPT-BigCode, GPT-Neo, BLOOM, Falcon, MPT, Persimmon, OPT:
:mod:`.hf_classic`) cut the same way; OPT's layers, one module down in its decoder, in a copy of that decoder. Where
the base model changes the embeddings before its first layer (GPT-2's learned positions, BLOOM's embedding norm,
OPT's positions and projection in) a later stage's base model is given a placeholder, and its first layer the hidden
states the stage received; those modules are the first stage's alone, and OPT's projection out the last stage's.
Under sequence parallelism a stage but the last hands a base model that views its output in its input's shape
(GPT-2's) a placeholder of the whole sequence, and passes its share on.

Gemma 4's per-layer inputs (an embedding of the token ids for every layer, projected with the embeddings) are
computed for every layer by the first stage, which keeps its layers' and passes the rest on beside the activation;
each later stage keeps its own (the per-layer embedding and projection are the first stage's alone). Where its last
layers reuse the keys and values of the last earlier layer of their type (``num_kv_shared_layers``, Gemma 4's
E-models), a stage passes on those of each type that a later stage reuses, and their gradients come back through the
stages to the layer that computed them. Zamba 2's hybrid layers read the embeddings beside the hidden states, and
their own index (their adapter): the first stage passes its embeddings on, and each stage calls its layers with
their index in the whole model. A head the model does not split (Zamba 2's, which no plan names) is scored on each
rank alone (:func:`~.hf_loss.whole_logits_loss`).

A stage shares the model's parameters; the parameters of other stages may be released. Mixtures of experts
(Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, FlexOlmo, Phi-3.5-MoE, ERNIE-4.5-MoE, MiniMax and MiniMax-M2, Granite-MoE,
Laguna, Mellum) split like the dense families. Their load-balancing loss (``output_router_logits``)
pools every layer's routers, of which each stage holds a share: it is a function of per-expert sums that add over
layers (:mod:`.hf_router_loss`), so each stage adds its layers' sums to those it received and passes them on with
the activation, and the last stage's :meth:`HFPipelineStage.loss` adds ``router_aux_loss_coef`` times the
balancing loss of the total, as the model's own forward does; the gradient of each stage's routers flows back
through the sums.

Under context parallelism (``parallelize(cp_group=)``) each stage gives its base model the whole sequence's
positions (``0 … S-1``, or the packed documents' that travel with the activation), from which the model's hooks take
this rank's zigzag share and its ring attention the documents; the activations crossing stages are this rank's
tokens (under sequence parallelism as well, their share over the tensor-parallel ranks). Refused: other model types
(their base forward may transform the embeddings, as Starcoder2's dropout does, which a later stage must not
repeat), and tied input and output embeddings (the first and last stages would each train a copy).
"""

from __future__ import annotations

import copy
import inspect

import torch
from torch import nn

from ..parallel.collectives import copy_to_tp
from .cross_entropy import vocab_parallel_cross_entropy
from .hf import _decoder_names, base_model, is_hf_model
from .hf_attention import CP_GROUP_ATTR
from .hf_experts import ROUTER_GATHER
from .hf_loss import BALANCED_TYPES, OPTIONS, head_loss, logit_multiplier, logit_softcap, whole_logits_loss
from .hf_router_loss import balancing_config, balancing_loss, router_sums
from .linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["HFPipelineStage", "hf_pipeline_stage"]

_NAME = "hf_pipeline_stage"
# Base models whose forward embeds, then runs its layers on the embeddings unchanged, then its final norm, and
# whose head's logits are the head's output, or that times a constant: Cohere's scale theirs (logit_scale) and
# Granite's divide them (logits_scaling), which the last stage does as the model's head does; Granite's base models
# also multiply their input embeddings (embedding_multiplier), which a later stage's copy does not repeat; Gemma's
# scale theirs inside the embedding module (the first stage's), and Gemma 2's soft-cap their logits, as the last
# stage does, fused loss too (checked family by family in tests/layers/test_hf_pipeline.py). Left out: Starcoder2's
# embedding dropout. The mixtures of experts among them train their load-balancing loss through the router sums the
# stages pass on; DeepSeek-V2/V3 (multi-head latent attention) route as the model does, with no balancing loss of
# Hugging Face's.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "ministral", "qwen2", "qwen3", "olmo", "olmo2", "olmo3", "phi3", "glm",
                         "smollm3", "helium", "exaone4", "arcee", "seed_oss", "ernie4_5", "hunyuan_v1_dense",
                         "apertus", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "flex_olmo", "phimoe", "ernie4_5_moe",
                         "minimax", "minimax_m2", "laguna", "mellum", "cohere", "cohere2", "granite", "granitemoe",
                         "gemma", "gemma2", "gemma3_text", "gemma4_text", "deepseek_v2", "deepseek_v3", "gpt_oss",
                         "deepseek_v32", "glm_moe_dsa", "glm4_moe_lite", "minicpm3", "deepseek_v4",
                         # hybrids: linear attention, state spaces or short convolutions between attention layers
                         "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "olmo_hybrid", "bamba", "granitemoehybrid",
                         "falcon_h1", "nemotron_h", "jamba", "lfm2", "kimi_linear", "bailing_hybrid",
                         "zamba2",
                         # the decoders Hugging Face gives no tensor-parallel plan (tessel.layers.hf_classic)
                         "gpt2", "gpt_bigcode", "gpt_neo", "bloom", "falcon", "mpt", "persimmon", "opt")  # fmt: skip
# Base models whose forward changes the embeddings before their first layer: GPT-2's, GPT-BigCode's and GPT-Neo's add
# their learned positions, BLOOM's norms them, DeepSeek-V4's copies them into its hyper-connections' residual streams
# ([B, S, hc, H], what travels between its stages). A later stage's base model is given a placeholder ([B, S, H]), and
# its first layer the hidden states the stage received (as under sequence parallelism).
EMBEDDING_TRANSFORMS = ("gpt2", "gpt_bigcode", "gpt_neo", "bloom", "opt", "deepseek_v4")
# ... and what computes it, which a later stage drops: their position embedding, its norm, OPT's projection in
_EMBEDDING_MODULES = ("wpe", "word_embeddings_layernorm", "embed_positions", "project_in")
# Base models whose forward views its output in the shape of its input (GPT-2's view(output_shape)): under sequence
# parallelism a stage but the last hands it a placeholder of the whole sequence's shape, and passes on its share.
OUTPUT_VIEWS = ("gpt2", "gpt_bigcode", "gpt_neo")


class HFPipelineStage(nn.Module):
    """One stage of a Hugging Face causal LM (see the module docstring): ``forward(input_ids)`` on the first
    stage, ``forward(hidden)`` on the others (each with what the previous stage passes on); the last returns
    logits, or the final norm's output with ``fused_loss`` (with a balancing mixture's router sums beside them)."""

    def __init__(self, model: nn.Module, start: int, stop: int, *, first: bool, last: bool, fused_loss: bool,
                 forward_kwargs: dict | None = None):  # fmt: skip
        super().__init__()
        _, base = base_model(model)
        layers, norm, embedding = _names(model, base)
        config = copy.deepcopy(base.config)
        types = getattr(config, "layer_types", None)
        config.num_hidden_layers = stop - start
        if types is not None:
            _set_layer_types(config, list(types), start, stop)
        stage = _shallow(base)
        every = base.get_submodule(layers)  # the whole model's layers (this stage's may hold no split attention)
        own = every[start:stop]
        holder = stage  # the module holding the layers: the base model, or OPT's decoder in it (a copy of its own)
        if "." in layers:
            inner = layers.rpartition(".")[0]
            holder = stage._modules[inner] = _shallow(base.get_submodule(inner))
            holder.config = config
            layers, norm, embedding = (n.rpartition(".")[2] for n in (layers, norm, embedding))
        # Zamba 2's layers read the embeddings beside the hidden states, and their index: the first stage's embeddings
        # travel with the activation, and each layer is called with its index in the whole model
        self.embeddings = any("original_hidden_states" in inspect.signature(type(m).forward).parameters for m in own)
        self.held = {}
        if self.embeddings:
            own = [_Indexed(m, start, self.held) for m in own]
        self.tp_group, self.sequence_parallel = _tensor_layout(every)
        # a later stage under sequence parallelism receives its share of the sequence: its base model is given a
        # placeholder of the whole sequence's shape (whose length its masks take) and its first layer the share (as
        # a later stage of a model whose base changes its embeddings is: GPT-2's positions, BLOOM's norm)
        self.fed = (self.sequence_parallel or model.config.model_type in EMBEDDING_TRANSFORMS) and not first
        self.streams = bool(getattr(config, "hc_mult", None))  # DeepSeek-V4's residual streams: [B, S, hc, H]
        if self.fed:
            own = [_Fed(own[0], self.held), *own[1:]]
        holder._modules[layers] = nn.ModuleList(own)
        if not first:
            holder._modules[embedding] = None  # a later stage is fed inputs_embeds
            for name in _EMBEDDING_MODULES if model.config.model_type in EMBEDDING_TRANSFORMS else ():
                if isinstance(holder._modules.get(name), nn.Module):  # its output goes to the placeholder: unused
                    holder._modules[name] = _Unused(holder._modules[name])
            if "embedding_multiplier" in vars(stage):  # Granite's: the first stage's base model multiplied them
                stage.embedding_multiplier = 1.0
        # under sequence parallelism the share of a stage but the last leaves a base model that views its output in
        # its input's shape through a placeholder of the whole sequence's (_Kept)
        self.kept = self.sequence_parallel and not last and model.config.model_type in OUTPUT_VIEWS
        if not last:
            holder._modules[norm] = _Kept(self.held) if self.kept else nn.Identity()
            if isinstance(holder._modules.get("hc_head"), nn.Module):  # DeepSeek-V4's collapse of its streams
                holder._modules["hc_head"] = nn.Identity()
            if isinstance(holder._modules.get("project_out"), nn.Module):  # OPT's, after its final norm
                holder._modules["project_out"] = None
        stage.config = config
        self.base = stage
        self.head = model.get_output_embeddings() if last else None
        self.start, self.stop, self.first, self.last, self.fused_loss = start, stop, first, last, fused_loss
        # the loss options fuse_lm_loss gave the model (label smoothing, z-loss), if any
        self.options = dict(getattr(model, OPTIONS, {}))
        self.logit_scale = logit_multiplier(model)  # what the model's head multiplies its logits by (Cohere's)
        self.softcap = logit_softcap(model)  # Gemma 2's soft-capped logits: c · tanh(logits / c)
        # a mixture's (experts, top_k, coefficient) when it trains its balancing loss (output_router_logits)
        self.balance = balancing_config(model) if getattr(model.config, "output_router_logits", False) else None
        self.gather = getattr(model, ROUTER_GATHER, None)  # parallelize's switch for gathering split routers' logits
        self.cp_size = _size(_context_group(every))
        self.forward_kwargs = dict(forward_kwargs or {})  # passed to every call of the base model
        self.per_layer = bool(getattr(base, "hidden_size_per_layer_input", 0))  # Gemma 4's per-layer inputs
        if self.per_layer:
            _split_per_layer_inputs(self, stage, base)
        # Gemma 4's shared keys and values: the layer types whose keys and values this stage receives, and passes on
        sharing = _kv_sharing(model.config)
        self.kv_sharing = sharing is not None
        self.kv_in, self.kv_out = _shared_kv_types(sharing, start, stop) if sharing else ((), ())

    def forward(self, x: torch.Tensor, *carried: torch.Tensor, targets: torch.Tensor | None = None):
        """The stage on ``x``; with ``targets`` (the last stage only), :meth:`loss` of ``x``, its own output: the
        form for a wrapper that gathers parameters in its forward (FSDP), called by the schedule's ``loss_fn`` as
        ``wrapped(output, targets=target)``.

        ``carried``: what travels with the activation, as the previous stage returned it:

        - ``position_ids``, ``[B, S]`` integers: positions of the whole sequence, restarting at each packed
          document (as Hugging Face packs sequences); without them, ``0 … S-1``. A stage but the last passes them on.
        - a mixture's router sums (a float tensor, :func:`~.hf_router_loss.router_sums` of the earlier stages'
          layers), when the model trains its balancing loss: this stage adds its own layers' and passes them on,
          the last stage beside its output, so that :meth:`loss` adds the balancing loss of every layer.
        - Gemma 4's per-layer inputs of this stage's layers and the later ones (``[B, S, L', P]``, projected): the
          first stage computes every layer's from the token ids; each keeps its layers' and passes the rest on.
        - Zamba 2's embeddings (``[B, S, H]``), which its hybrid layers read beside the hidden states: the first
          stage's, passed on by every stage but the last.
        - last, Gemma 4's shared keys and values (each ``[B, Hkv, S, D]`` as the storing layer's attention computed
          them), key then value of each layer type a later layer reuses, in the order of the storing layers: those
          stored before this stage and reused here or later (``kv_in``); a stage passes on those reused after it
          (``kv_out``).

        Returns the hidden states (the last stage: the logits, or with ``fused_loss`` the final norm's output), as a
        tuple with what it passes on when it passes anything."""
        if targets is not None:
            return self.loss(x, targets)
        kv = carried[len(carried) - 2 * len(self.kv_in) :]
        position_ids, sums, later, embeddings = _carried(carried[: len(carried) - len(kv)])
        self.held.clear()
        self.held["tp_group"] = self.tp_group
        if self.embeddings and not self.first:
            self.held["embeddings"] = embeddings
        extra = {}
        if self.per_layer and not self.first:  # this stage's layers' per-layer inputs, projected already
            extra["per_layer_inputs"], later = (
                later[:, :, : self.stop - self.start],
                later[:, :, self.stop - self.start :],
            )
        if self.fed:  # the hidden states for the first layer, the whole sequence's shape for the base model
            self.held["hidden"] = x
            split = _size(self.tp_group) if self.sequence_parallel else 1  # a share under sequence parallelism
            x = _placeholder(x[:, :, 0] if self.streams else x, split)  # (of one residual stream)
        positions = position_ids
        if positions is None:  # under context parallelism the whole sequence's (the model's hook takes its share)
            positions = torch.arange(x.shape[1] * self.cp_size, device=x.device)[None]
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        routers = {}
        if self.gather is not None:  # the split routers' logits gathered over the ranks while the loss asks for them
            self.gather["gather"] = self.balance is not None
        if self.balance is not None:
            routers = {"output_router_logits": True}
        shared = {}
        if self.kv_sharing:  # the model's own dict, which its storing layers fill and its reusing layers read
            from transformers.cache_utils import KVSharingDict

            shared = extra["shared_kv_states"] = KVSharingDict({t: kv[2 * i : 2 * i + 2] for i, t in
                                                               enumerate(self.kv_in)})  # fmt: skip
        out = self.base(**inputs, position_ids=positions, use_cache=False, **routers, **extra, **self.forward_kwargs)
        hidden = self.held.pop("kept") if self.kept else out.last_hidden_state
        if self.per_layer and self.first:
            later = self.later.pop()
        if self.embeddings and self.first:
            embeddings = self.held.get("seen")
        if self.balance is not None:
            local = router_sums(out.router_logits, *self.balance[:2])
            sums = local if sums is None else sums + local
        if not self.last:
            carry = (position_ids, sums, later if self.per_layer else None, embeddings if self.embeddings else None)
            passed = tuple(t for t in carry if t is not None) + tuple(x for t in self.kv_out for x in shared[t])
            return (hidden, *passed) if passed else hidden
        if not self.fused_loss:
            if isinstance(self.head, ColumnParallelLinear):  # this rank's share of the vocabulary, never gathered
                # the head's input gradient summed over the ranks' vocabulary shares (Megatron's f), as the layer does
                hidden = torch.nn.functional.linear(copy_to_tp(hidden, self.head.tp_group), self.head.weight,
                                                    self.head.bias)  # fmt: skip
            else:
                hidden = self.head(hidden)
            if self.logit_scale != 1.0:
                hidden = hidden * self.logit_scale
            if self.softcap is not None:
                hidden = torch.tanh(hidden / self.softcap) * self.softcap
        return hidden if self.balance is None else (hidden, sums)

    def loss(self, output, target: torch.Tensor) -> torch.Tensor:
        """The model's training loss from the last stage's ``output``: :meth:`lm_loss`, plus the mixture's
        :meth:`router_loss` when it trains one (as Hugging Face's forward adds it)."""
        router = self.router_loss(output)
        loss = self.lm_loss(output, target)
        return loss if router is None else loss + router

    def lm_loss(self, output, target: torch.Tensor) -> torch.Tensor:
        """The mean cross entropy of next-token ``target [B, S]`` (``-100`` ignored) from the last stage's
        ``output``: its logits, or with ``fused_loss`` its final norm's output through the head (beside them, a
        mixture's router sums, not read here)."""
        if not self.last:
            raise ValueError(f"HFPipelineStage.loss: stage of layers [{self.start}, {self.stop}) is not the last")
        if isinstance(output, tuple | list):
            output = output[0]
        if self.fused_loss:  # the head's logits, scaled and soft-capped as the model's
            return head_loss(output, self.head, target, self.logit_scale, self.softcap, **self.options)
        if not isinstance(self.head, ColumnParallelLinear):  # a head the model does not split (Zamba 2's)
            return whole_logits_loss(output, target, **self.options)  # soft-capped already, as the model's logits
        return vocab_parallel_cross_entropy(output, target, self.head.tp_group, **self.options)

    def router_loss(self, output) -> torch.Tensor | None:
        """``router_aux_loss_coef`` times the balancing loss of every layer's routers, from the router sums beside
        the last stage's ``output``; None for a model that trains none."""
        if not self.last:
            raise ValueError(f"HFPipelineStage.loss: stage of layers [{self.start}, {self.stop}) is not the last")
        if self.balance is None:
            return None
        if not isinstance(output, tuple | list) or len(output) != 2:
            raise ValueError("HFPipelineStage.loss: a mixture training its balancing loss takes the last stage's "
                             "(output, router sums)")  # fmt: skip
        experts, _, coef = self.balance
        return coef * balancing_loss(output[1], experts)


def _carried(carried) -> tuple[torch.Tensor | None, ...]:
    """``(position_ids, router sums, per-layer inputs, embeddings)`` among what travels with the activation:
    integers, and floats of 1, 4 and 3 dims."""
    position_ids = sums = later = embeddings = None
    for t in carried:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"HFPipelineStage: what travels with the activation must be tensors, received "
                            f"{type(t).__name__}")  # fmt: skip
        if t.is_floating_point() and t.dim() == 4 and later is None:
            later = t
        elif t.is_floating_point() and t.dim() == 3 and embeddings is None:
            embeddings = t
        elif t.is_floating_point() and sums is None:
            sums = t
        elif not t.is_floating_point() and position_ids is None:
            position_ids = t
        else:
            raise ValueError(f"HFPipelineStage: expected position ids (integers) and router sums (floats) beside the "
                             f"activation, received {[str(c.dtype) for c in carried]}")  # fmt: skip
    return position_ids, sums, later, embeddings


class _Indexed(nn.Module):
    """A Zamba 2 layer in a stage: called with its index in the whole model (its hybrid layers' adapters and
    attention read it), and on a later stage with the first stage's embeddings (``held["embeddings"]``) for the
    embeddings its base model passes, which there are the hidden states it received; on the first stage it records
    them (``held["seen"]``) for the stage to pass on."""

    def __init__(self, layer: nn.Module, offset: int, held: dict):
        super().__init__()
        self.layer, self.offset = layer, offset
        self.__dict__["held"] = held  # not a submodule, not state

    def forward(self, hidden_states, original_hidden_states=None, layer_idx=None, *args, **kwargs):
        original_hidden_states = self.held.get("embeddings", original_hidden_states)
        self.held.setdefault("seen", original_hidden_states)
        return self.layer(hidden_states, original_hidden_states, layer_idx + self.offset, *args, **kwargs)


class _Fed(nn.Module):
    """The first layer of a later stage under sequence parallelism: called by its base model with the whole
    sequence's placeholder (see :class:`HFPipelineStage`), it runs on the share the stage received
    (``held["hidden"]``)."""

    def __init__(self, layer: nn.Module, held: dict):
        super().__init__()
        self.layer = layer
        self.__dict__["held"] = held  # not a submodule, not state

    def forward(self, *args, **kwargs):
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = self.held["hidden"]
        else:
            args = (self.held["hidden"], *args[1:])
        return self.layer(*args, **kwargs)


def _placeholder(x: torch.Tensor, split: int) -> torch.Tensor:
    """Zeros (one value, expanded) of ``x``'s shape with ``split`` times its sequence: the whole sequence's shape of a
    share of it, for a base model that reads no more than the shape."""
    return x.new_zeros(()).expand(x.shape[0], x.shape[1] * split, *x.shape[2:])


class _Unused(nn.Module):
    """What a later stage's base model computes on its placeholder in place of the first stage's position embedding,
    embedding norm or projection (whose output the stage's first layer does not read): zeros of its output's shape,
    with no parameters of the model's."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.kind = (
            "embedding" if isinstance(module, nn.Embedding) else "linear" if isinstance(module, nn.Linear) else ""
        )
        self.width = module.embedding_dim if self.kind == "embedding" else getattr(module, "out_features", None)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.kind == "embedding":  # positions [B, S] (OPT's: its mask, and the ids as a keyword)
            ids = kwargs.get("position_ids")
            ids = ids if isinstance(ids, torch.Tensor) else x
            return torch.zeros(*ids.shape, self.width, device=ids.device)
        if self.kind == "linear":
            return x.new_zeros(*x.shape[:-1], self.width)
        return torch.zeros_like(x)  # a norm


class _Kept(nn.Module):
    """The final norm's place on a stage but the last under sequence parallelism, for a base model that views its
    output in its input's shape: it keeps the share (``held["kept"]``, what the stage passes on) and hands the base
    model a placeholder of the whole sequence's shape."""

    def __init__(self, held: dict):
        super().__init__()
        self.__dict__["held"] = held  # not a submodule, not state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.held["kept"] = x
        t = _size(self.held["tp_group"])
        return _placeholder(x, t)


# what computes Gemma 4's per-layer inputs from the token ids and their embeddings, on the first stage
_PER_LAYER_MODULES = ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm")


def _split_per_layer_inputs(owner: HFPipelineStage, stage: nn.Module, base: nn.Module) -> None:
    """Gemma 4's per-layer inputs across stages: the first stage computes every layer's (from the token ids and
    their embeddings, by the whole model's base, whose config counts every layer), keeps its layers' and leaves the
    rest in ``owner.later`` for its forward to pass on; a later stage receives its own projected already."""
    owner.later = []
    start, stop = owner.start, owner.stop
    if owner.first:

        def project(inputs_embeds, per_layer_inputs=None):
            every = base.project_per_layer_inputs(inputs_embeds, per_layer_inputs)
            owner.later.append(every[:, :, stop:])
            return every[:, :, start:stop]

        stage.get_per_layer_inputs = base.get_per_layer_inputs
    else:

        def project(inputs_embeds, per_layer_inputs=None):
            return per_layer_inputs

        for name in _PER_LAYER_MODULES:  # the first stage's alone (the embedding is the vocabulary by every layer)
            if name in stage._modules:
                stage._modules[name] = None

    stage.project_per_layer_inputs = project


def _kv_sharing(config) -> tuple[list[str], list[str | None]] | None:
    """``(layer_types, kv_sharing_modes)`` of a model whose later layers reuse earlier ones' keys and values (each
    layer's mode: ``"store"``, ``"reuse"`` or None); None for a model that shares none."""
    if not getattr(config, "num_kv_shared_layers", 0):
        return None
    return list(config.layer_types), list(config.kv_sharing_modes)


def _shared_kv_types(sharing: tuple[list[str], list[str | None]], start: int,
                     stop: int) -> tuple[tuple[str, ...], tuple[str, ...]]:  # fmt: skip
    """The layer types whose shared keys and values a stage of layers ``start … stop-1`` receives (stored before it,
    reused in it or after) and passes on (stored before its end, reused after it), in the storing layers' order, from
    the model's :func:`_kv_sharing`."""
    types, modes = sharing
    stores = [(i, t) for i, (t, m) in enumerate(zip(types, modes, strict=True)) if m == "store"]

    def reused_from(t, first):
        return any(m == "reuse" and types[i] == t for i, m in enumerate(modes) if i >= first)

    return (tuple(t for i, t in stores if i < start and reused_from(t, start)),
            tuple(t for i, t in stores if i < stop and reused_from(t, stop)))  # fmt: skip


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of ``module`` sharing every submodule, parameter and hook with it, in dictionaries of its own: what is
    registered on the copy later stays off the model."""
    copied = copy.copy(module)
    copied.__dict__.update({k: type(v)(v) for k, v in vars(module).items() if isinstance(v, dict)})
    return copied


def _names(model: nn.Module, base: nn.Module) -> tuple[str, str, str]:
    """The names in the base model of its decoder layers, its final norm (Nemotron-H's ``norm_f``, LFM2's
    ``embedding_norm``) and its input embedding (Nemotron-H's ``embeddings``)."""
    try:
        layers, norm = _decoder_names(model, base)
    except ValueError:
        layers = norm = None
    embeddings = base.get_input_embeddings()
    embedding = next((n for n, m in base.named_modules() if m is embeddings and n.count(".") <= 1), None)
    # one module holds them all: the base model, or one child of it (OPT's decoder)
    holders = {n.rpartition(".")[0] for n in (layers, norm, embedding) if n is not None}
    if layers is None or embedding is None or len(holders) != 1 or layers.count(".") > 1:
        raise ValueError(f"{_NAME}: cannot find {type(base).__name__}'s input embedding, its decoder layers (a "
                         f"ModuleList among its children or its decoder's) and the final norm after them")  # fmt: skip
    return layers, norm, embedding


def _set_layer_types(config, types: list[str], start: int, stop: int) -> None:
    """``config``'s layer types become those of layers ``start … stop-1``: set, or where the config computes them
    (Bamba's and Falcon-H1's from their attention layers' indices, Jamba's from a period and an offset) through what
    they are computed from; raises when the slice's types cannot be said so."""
    try:
        config.layer_types = types[start:stop]
    except AttributeError:  # a property without a setter
        if getattr(config, "attn_layer_indices", None) is not None:
            config.attn_layer_indices = [i - start for i in config.attn_layer_indices if start <= i < stop]
        for kind in ("attn", "expert"):  # Jamba's: every period-th layer from the offset
            period, offset = (getattr(config, f"{kind}_layer_{n}", None) for n in ("period", "offset"))
            if isinstance(period, int) and isinstance(offset, int):
                setattr(config, f"{kind}_layer_offset", (offset - start) % period)
    if list(config.layer_types) != types[start:stop]:
        raise ValueError(f"{_NAME}: {type(config).__name__} computes its layer types in a way a stage of layers "
                         f"{start} … {stop - 1} cannot give")  # fmt: skip


def _size(group) -> int:
    return 1 if group is None else torch.distributed.get_world_size(group)


def _context_group(layers: nn.Module):
    """The context-parallel group ``parallelize(cp_group=)`` marked the attention modules of the decoder ``layers``
    with (None: none)."""
    return next((g for m in layers.modules() if (g := getattr(m, CP_GROUP_ATTR, None)) is not None), None)


def _tensor_layout(layers: nn.Module):
    """``(tp_group, sequence_parallel)`` of the model's split decoder ``layers`` (``(None, False)`` unsplit): sequence
    parallel when any split layer is (a column layer fed by a gathered latent, multi-head latent attention's
    ``q_b_proj``, reads the whole sequence and is not)."""
    split = [m for m in layers.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    return (split[0].tp_group, any(m.sequence_parallel for m in split)) if split else (None, False)


def _check(model, stage_index, num_stages, fused_loss) -> int:
    if not isinstance(model, nn.Module) or not is_hf_model(model):
        raise TypeError(f"{_NAME}: model must be a Hugging Face PreTrainedModel, received {type(model).__name__}")
    prefix, base = base_model(model)
    model_type = getattr(model.config, "model_type", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not prefix or head is None or model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{_NAME}: model must be a causal LM of type {', '.join(SUPPORTED_MODEL_TYPES)} (a head on "
                         f"a base model), received {type(model).__name__} of type {model_type!r}")  # fmt: skip
    if head.weight is base.get_input_embeddings().weight:
        raise ValueError(f"{_NAME}: {type(model).__name__} ties its input and output embeddings, which the first "
                         "and last stages would each train apart; untie them (tie_word_embeddings=False)")  # fmt: skip
    if getattr(model.config, "output_router_logits", False) and model_type not in BALANCED_TYPES:
        raise ValueError(f"{_NAME}: {type(model).__name__} asks for its router logits (output_router_logits=True), "
                         f"whose balancing loss the stages compute for {', '.join(BALANCED_TYPES)} only")  # fmt: skip
    sharing = _kv_sharing(model.config)
    if sharing is not None and "store" not in sharing[1]:
        raise ValueError(f"{_NAME}: every one of {type(model).__name__}'s layers reuses keys and values "
                         f"(num_kv_shared_layers={model.config.num_kv_shared_layers} of "
                         f"{model.config.num_hidden_layers}): none of its layers computes them")  # fmt: skip
    if not isinstance(fused_loss, bool):
        raise TypeError(f"{_NAME}: fused_loss must be a bool, received {type(fused_loss).__name__}")
    for arg, value in (("stage_index", stage_index), ("num_stages", num_stages)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{_NAME}: {arg} must be an int, received {type(value).__name__}")
    layers = len(base.get_submodule(_names(model, base)[0]))
    if not 1 <= num_stages <= layers:
        raise ValueError(f"{_NAME}: num_stages must be in [1, {layers}] (the model's decoder layers), received "
                         f"{num_stages}")  # fmt: skip
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"{_NAME}: stage_index must be in [0, {num_stages}), received {stage_index}")
    return layers


def hf_pipeline_stage(model: nn.Module, stage_index: int, num_stages: int, *, fused_loss: bool = False,
                      forward_kwargs: dict | None = None):  # fmt: skip
    """Stage ``stage_index`` of ``num_stages`` of a Hugging Face causal LM: a contiguous, even split of its decoder
    layers (earlier stages take one more when it does not divide), as :meth:`~.gpt.GPT.pipeline_stage` splits
    tessel's GPT (see the module docstring). Wrap it in a :class:`~tessel.parallel.pipeline.PipelineStage`; the
    schedule's ``loss_fn`` is the last stage's :meth:`HFPipelineStage.loss`.

    Raises ``TypeError`` / ``ValueError`` naming the argument for a model it cannot split (see the module
    docstring), a stage index out of range, or more stages than layers.

    ``forward_kwargs``: keyword arguments the stage passes to every call of the base model, which Hugging Face hands
    on to the attention (``{"deterministic": False}``: tessel's attention with its atomic dQ backward)."""
    layers = _check(model, stage_index, num_stages, fused_loss)
    if forward_kwargs is not None and not isinstance(forward_kwargs, dict):
        raise TypeError(f"{_NAME}: forward_kwargs must be a dict or None, received {type(forward_kwargs).__name__}")
    per, extra = divmod(layers, num_stages)
    start = stage_index * per + min(stage_index, extra)
    stop = start + per + (stage_index < extra)
    hashed = [i for i, kind in enumerate(getattr(model.config, "mlp_layer_types", None) or ()) if "hash" in str(kind)]
    if start > 0 and any(start <= i < stop for i in hashed):  # DeepSeek-V4's: the first stage alone has the ids
        raise ValueError(f"{_NAME}: stage {stage_index} of {num_stages} holds layers {hashed} routed by the token ids "
                         "(hash_moe), which only the first stage reads: use fewer stages")  # fmt: skip
    return HFPipelineStage(model, start, stop, first=stage_index == 0, last=stage_index == num_stages - 1,
                           fused_loss=fused_loss, forward_kwargs=forward_kwargs)  # fmt: skip
