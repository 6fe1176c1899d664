"""tessel's GPT of Llama's design and Hugging Face's Llama (or Mistral, with a sliding window): the same model.

A GPT with a SwiGLU MLP, RMSNorm and no experts computes what ``LlamaForCausalLM`` computes: rotary embeddings in
the rotate-half layout with the same base, the norms' epsilon, GQA, ``1/sqrt(d)`` scores, untied embeddings, and
with ``bias=True`` Llama's ``attention_bias``/``mlp_bias``. Its tensors are Llama's under other names, the fused ones
concatenated along dim 0: ``qkv`` is ``[q_proj; k_proj; v_proj]`` and ``fc`` is ``[gate_proj; up_proj]``.
:func:`llama_names` says which; ``python -m tessel.bench.export`` writes a GPT as a Llama, and
:func:`~tessel.layers.load_pretrained` reads a Llama or Mistral checkpoint into a GPT (split or not).
"""

from __future__ import annotations

from .gpt import GPTConfig

__all__ = ["check_llama_config", "llama_design", "llama_names"]


def llama_design(config: GPTConfig) -> str | None:
    """Why tessel's GPT of ``config`` is not a Llama (Mistral with a window), or None when it is one."""
    if config.mlp != "swiglu":
        return f"mlp={config.mlp!r} (Llama's is 'swiglu')"
    if config.norm != "rmsnorm":
        return f"norm={config.norm!r} (Llama's is 'rmsnorm')"
    if config.n_expert:
        return f"n_expert={config.n_expert} (Llama has no experts)"
    if config.bias and config.sliding_window is not None:
        return "bias=True with a sliding window (Mistral has no biases)"
    return None


def llama_names(config: GPTConfig) -> dict[str, tuple[str, ...]]:
    """Each tensor of the GPT of ``config`` and the Llama tensors it is, concatenated along dim 0 in this order."""
    names = {"embed.weight": ("model.embed_tokens.weight",), "norm.weight": ("model.norm.weight",),
             "lm_head.weight": ("lm_head.weight",)}  # fmt: skip
    for i in range(config.n_layer):
        src, attn, mlp = f"blocks.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        names[f"{src}attn_norm.weight"] = (f"model.layers.{i}.input_layernorm.weight",)
        names[f"{src}mlp_norm.weight"] = (f"model.layers.{i}.post_attention_layernorm.weight",)
        for kind in ("weight", "bias") if config.bias else ("weight",):
            names[f"{src}attn.qkv.{kind}"] = tuple(f"{attn}{p}_proj.{kind}" for p in "qkv")
            names[f"{src}attn.proj.{kind}"] = (f"{attn}o_proj.{kind}",)
            names[f"{src}mlp.fc.{kind}"] = (f"{mlp}gate_proj.{kind}", f"{mlp}up_proj.{kind}")
            names[f"{src}mlp.proj.{kind}"] = (f"{mlp}down_proj.{kind}",)
    return names


def check_llama_config(hf: dict, config: GPTConfig) -> None:
    """Raise ``ValueError`` naming the first setting of Hugging Face's config dict ``hf`` (a ``config.json``) that
    makes its model compute other than the GPT of ``config`` (shapes are checked tensor by tensor elsewhere)."""
    why = llama_design(config)
    if why is not None:
        raise ValueError(f"the GPT is not of Llama's design: {why}")
    family = "mistral" if config.sliding_window is not None else "llama"
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    window = hf.get("sliding_window") if hf.get("model_type") == "mistral" else None
    checks = [("model_type", hf.get("model_type"), family), ("hidden_act", hf.get("hidden_act"), "silu"),
              ("rope_type", rope.get("rope_type", rope.get("type", "default")), "default"),
              ("rope_theta", float(theta), float(config.rope_theta)),
              ("rms_norm_eps", float(hf.get("rms_norm_eps", 0.0)), float(config.norm_eps)),
              ("sliding_window", window, config.sliding_window),
              ("tie_word_embeddings", bool(hf.get("tie_word_embeddings", False)), False)]  # fmt: skip
    for name, got, want in checks:
        if got != want:
            raise ValueError(f"the checkpoint's {name} is {got!r}, the GPT's config asks for {want!r}")
