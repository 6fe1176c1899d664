"""A parallelized Hugging Face causal language model whose ``forward(..., labels=...)`` never holds its logits.

``LlamaForCausalLM.forward`` (and every ``*ForCausalLM`` like it) computes ``logits = lm_head(hidden)`` for every
position, upcasts them to fp32 and takes their cross entropy: after :func:`~.parallelize.parallelize` each rank then
holds the gathered ``[B, S, V]`` logits, their fp32 copy and their gradient, several GB at Llama 3's 128k vocabulary.
:func:`fuse_lm_loss` replaces the model's ``forward`` (on the instance) so that a call with ``labels`` runs the base
model, then :func:`~.linear_cross_entropy.linear_cross_entropy` on its last hidden state with the split head's weight:
the same loss as Hugging Face's ``ForCausalLMLoss`` (labels shifted by one, ``-100`` ignored, the mean, or the sum
over ``num_items_in_batch`` when the trainer passes it, ``shift_labels`` when given; logits scaled as Granite,
HyperCLOVA X, Falcon-H1 and Cohere scale theirs (:func:`logit_multiplier`), soft-capped as Gemma 2 caps its), the same
gradients, and ``logits=None`` in the output. Mixtures of experts asking for their router logits (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, FlexOlmo, Phi-3.5-MoE, ERNIE-4.5-MoE, MiniMax, MiniMax-M2, Granite-MoE, Laguna, Mellum, GPT-OSS:
``BALANCED_TYPES``) add their load-balancing loss as Hugging Face does (:mod:`.hf_router_loss`; the output's
``aux_loss``). A call without labels, one asking for the router logits of another mixture (whose balancing loss may be
another), or with ``labels`` passed by position, runs the model's own forward unchanged.

``fuse_lm_loss(model, label_smoothing=, z_loss=)`` adds what Hugging Face's loss lacks: label smoothing (as
``F.cross_entropy``'s) and PaLM's z-loss on the logits (``z_loss · logsumexp²`` per token), as tessel's GPT takes
them; :func:`~.hf_pipeline.hf_pipeline_stage` gives the last stage's loss the same. With either set, a call that
asks for the router logits of a mixture other than those is refused (the model's own loss would drop them).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from .cross_entropy import check_loss_options
from .hf import base_model, is_hf_model
from .hf_router_loss import balancing_config, balancing_loss, router_sums
from .linear import ColumnParallelLinear
from .linear_cross_entropy import linear_cross_entropy

__all__ = ["fuse_lm_loss"]

_NAME = "fuse_lm_loss"
_BASE_POSITIONAL = 5  # input_ids, attention_mask, position_ids, past_key_values, inputs_embeds: the same in both
_UNFUSED = "_tessel_unfused_forward"  # the forward that fuse_lm_loss replaced, kept on the model
OPTIONS = "_tessel_lm_loss_options"  # fuse_lm_loss's label_smoothing and z_loss, kept on the model
# Mixtures whose loss adds Hugging Face's load_balancing_loss_func (see .hf_router_loss) of their router logits, their
# num_experts and num_experts_per_tok when asked for router logits (checked family by family against their own forward
# in tests/layers/test_hf_router_loss.py)
BALANCED_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "flex_olmo", "phimoe", "ernie4_5_moe", "minimax",
                  "minimax_m2", "granitemoe", "laguna", "mellum", "gpt_oss", "jamba", "qwen3_next",
                  "qwen3_5_moe_text", "deepseek_v4")  # fmt: skip


def _check(model) -> ColumnParallelLinear:
    if not isinstance(model, nn.Module) or not is_hf_model(model):
        raise TypeError(f"{_NAME}: model must be a Hugging Face PreTrainedModel, received {type(model).__name__}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, ColumnParallelLinear) or base_model(model)[0] == "":
        got = type(head).__name__ if head is not None else "no output embeddings"
        raise ValueError(f"{_NAME}: model must be a causal LM parallelized by tessel.layers.parallelize (its lm_head a "
                         f"ColumnParallelLinear), received {type(model).__name__} with {got}")  # fmt: skip
    loss_type = getattr(model, "loss_type", None)
    if loss_type not in (None, "ForCausalLM"):
        raise ValueError(
            f"{_NAME}: model's loss must be ForCausalLM (next-token cross entropy), received {loss_type!r}"
        )
    return head


def _text_config(model: nn.Module):
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def logit_softcap(model: nn.Module) -> float | None:
    """The cap of the model's soft-capped logits (``final_logit_softcapping``: Gemma 2's ``c·tanh(logits/c)``), or
    None."""
    cap = getattr(_text_config(model), "final_logit_softcapping", None)
    return None if cap is None else float(cap)


# Families whose head multiplies its logits by the config's logits_scaling (Granite's and MiniCPM3 divide by it)
_MULTIPLIED_SCALING = ("hyperclovax",)


def logit_multiplier(model: nn.Module) -> float:
    """What the model's head multiplies its logits by: ``1 / logits_scaling`` (Granite's families, MiniCPM3), or
    ``logits_scaling`` (HyperCLOVA X's), times Falcon-H1's ``lm_head_multiplier``, Muse's ``output_multiplier`` and the
    ``logit_scale`` the model holds (Cohere's); 1 for every other model."""
    config = _text_config(model)
    scaling = float(getattr(config, "logits_scaling", None) or 1.0)
    multiplied = any(str(getattr(c, "model_type", "")).startswith(_MULTIPLIED_SCALING) for c in (model.config, config))
    scale = scaling if multiplied else 1.0 / scaling
    for name in ("lm_head_multiplier", "output_multiplier"):
        scale *= float(getattr(config, name, None) or 1.0)
    held = getattr(model, "logit_scale", None)
    if isinstance(held, (int, float)) and not isinstance(held, bool):
        scale *= float(held)
    return scale


def head_loss(hidden: torch.Tensor, head: nn.Module, target: torch.Tensor, scale: float, softcap: float | None,
              **kwargs) -> torch.Tensor:  # fmt: skip
    """:func:`~.linear_cross_entropy.linear_cross_entropy` of the split ``head`` on ``hidden``, for logits that the
    model multiplies by ``scale`` (:func:`logit_multiplier`: ``(hidden · c) Wᵀ + bias · c``) and soft-caps with
    ``softcap`` (:func:`logit_softcap`); ``kwargs`` go to the loss."""
    bias = head.bias
    if scale != 1.0:
        hidden, bias = hidden * scale, None if bias is None else bias * scale
    if not isinstance(head, ColumnParallelLinear):  # a head the model does not split: every rank holds all logits
        return whole_logits_loss(F.linear(hidden, head.weight, bias), target, softcap, **kwargs)
    return linear_cross_entropy(hidden, head.weight, target, head.tp_group, bias=bias, softcap=softcap, **kwargs)


def whole_logits_loss(logits: torch.Tensor, target: torch.Tensor, softcap: float | None = None, *,
                      label_smoothing: float = 0.0, z_loss: float = 0.0, ignore_index: int = -100):  # fmt: skip
    """The mean next-token loss of logits this rank holds whole (a head no tensor-parallel group splits): what
    :func:`~.cross_entropy.vocab_parallel_cross_entropy` computes of a split head's, in this rank alone (whose
    default group may be a data-parallel or pipeline world, over which nothing is gathered): soft-capped with
    ``softcap``, smoothed by ``label_smoothing``, plus ``z_loss`` times each token's squared log-sum-exp, in fp32."""
    x = logits.float().flatten(0, -2)
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    t = target.flatten()
    loss = F.cross_entropy(x, t, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none")
    if z_loss:
        loss = loss + z_loss * torch.logsumexp(x, -1).square() * (t != ignore_index)
    return loss.sum() / (t != ignore_index).sum()


def _shifted(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``labels[..., 1:]`` with ``ignore_index`` after the last position, as Hugging Face's loss shifts them."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _fused_forward(self, *args, **kwargs):
    """The model's forward (a method of the model, so that a deep copy calls its own modules; see the module
    docstring)."""
    labels = kwargs.get("labels")
    routers = kwargs.get("output_router_logits")
    routers = getattr(self.config, "output_router_logits", False) if routers is None else routers
    options = getattr(self, OPTIONS)
    balanced = routers and getattr(self.config, "model_type", None) in BALANCED_TYPES
    if labels is not None and routers and not balanced and any(options.values()):
        raise ValueError(f"{_NAME}: label_smoothing and z_loss ({options}) are tessel's loss's, and a call asking for "
                         f"the router logits of a {self.config.model_type} takes the model's own loss: ask for none, "
                         "or fuse without them")  # fmt: skip
    if labels is None or (routers and not balanced) or len(args) > _BASE_POSITIONAL:
        return getattr(self, _UNFUSED)(*args, **kwargs)
    kwargs = dict(kwargs)
    del kwargs["labels"]
    num_items = kwargs.pop("num_items_in_batch", None)
    ignore_index = kwargs.pop("ignore_index", -100)
    shift_labels = kwargs.pop("shift_labels", None)
    return_dict = kwargs.pop("return_dict", None)
    kwargs.pop("logits_to_keep", None)  # the loss covers every position, as the model's own with the default 0
    mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
    if balanced:
        kwargs["output_router_logits"] = True
        if mask is not None and mask.dim() != 2:
            raise ValueError(f"{_NAME}: a mixture's balancing loss weighs its tokens by a [batch, sequence] "
                             f"attention_mask, received one of shape {tuple(mask.shape)}")  # fmt: skip
    outputs = base_model(self)[1](*args, **kwargs)
    head = self.get_output_embeddings()
    target = _shifted(labels, ignore_index) if shift_labels is None else shift_labels
    loss = head_loss(outputs.last_hidden_state, head, target.to(head.weight.device), logit_multiplier(self),
                     logit_softcap(self), ignore_index=ignore_index, reduction="mean" if num_items is None else "sum",
                     **options)  # fmt: skip
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    fields = dict(loss=loss, logits=None, past_key_values=outputs.past_key_values, hidden_states=outputs.hidden_states,
                  attentions=outputs.attentions)  # fmt: skip
    if balanced:  # Hugging Face's balancing loss over every layer's routers (the padding left out by the mask)
        from transformers.modeling_outputs import MoeCausalLMOutputWithPast as Output

        experts, top_k, coef = balancing_config(self)
        aux = balancing_loss(router_sums(outputs.router_logits, experts, top_k, mask), experts)
        fields.update(loss=loss + coef * aux.to(loss.device), aux_loss=aux, router_logits=outputs.router_logits)
    else:
        from transformers.modeling_outputs import CausalLMOutputWithPast as Output
    out = Output(**fields)
    return out.to_tuple() if return_dict is False else out


def fuse_lm_loss(model: nn.Module, *, label_smoothing: float = 0.0, z_loss: float = 0.0) -> nn.Module:
    """Make ``model(..., labels=labels)`` compute its loss without the logits (see the module docstring).

    ``model``: a Hugging Face causal language model after :func:`~.parallelize.parallelize` (its ``lm_head``
    split by vocabulary). ``label_smoothing`` (in [0, 1]) and ``z_loss`` (>= 0): as
    :func:`~.cross_entropy.vocab_parallel_cross_entropy` takes them. Returns ``model``, changed in place (its
    ``forward``, a method of the instance that keeps the one it replaces); calling it again only sets the options.
    """
    _check(model)
    check_loss_options(_NAME, label_smoothing, z_loss)
    setattr(model, OPTIONS, {"label_smoothing": float(label_smoothing), "z_loss": float(z_loss)})
    if hasattr(model, _UNFUSED):
        return model
    setattr(model, _UNFUSED, model.forward)
    model.forward = types.MethodType(_fused_forward, model)
    return model
