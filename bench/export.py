"""``python -m tessel.bench.export CHECKPOINT OUT [--dtype {bf16,fp16,fp32}]``: a trained model for others to load.

A checkpoint of ``python -m tessel.bench.train`` (``--save-every``) holds every parameter as its global tensor,
whatever layout wrote it (:mod:`.train_state`). The export reads the model's tensors whole in one process (no
process group, no GPU; the fp32 weights take 4 bytes a parameter), checks them against the model the manifest
records, and writes ``OUT`` in Hugging Face's format (``config.json``, ``model.safetensors``), which
``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads without tessel:

- a Hugging Face family trained with ``--hf``: that family's model, its config built as the run built it, naming
  Hugging Face's own attention and experts (the run's were tessel's); GPT-2's ``Conv1D`` weights back in their
  ``[in, out]`` layout;
- tessel's GPT of Llama's design (SwiGLU, RMSNorm, no experts): a ``LlamaForCausalLM``, or a
  ``MistralForCausalLM`` where it slides a window. Its fused ``qkv`` splits into ``q_proj``/``k_proj``/``v_proj``
  and its ``fc`` into ``gate_proj``/``up_proj`` (their biases into ``attention_bias``/``mlp_bias`` layers); the
  rotary layout (rotate-half) and base, the norms' epsilon and the scale are Llama's, so the logits are the GPT's;
- any other GPT (GELU, LayerNorm, experts, biases with a window) as tessel's own: ``config.json``
  (:class:`GPTConfig`'s fields) and ``model.pt`` (the state dict, tensors only), which
  ``GPT(GPTConfig(**json.load(...)))`` loads with ``load_state_dict(torch.load(..., weights_only=True))``.

``CHECKPOINT`` is a checkpoint directory (``<out>/checkpoints/step_N``), or their root or a run's ``--out``, whose
latest complete checkpoint is taken. Its files are verified against the manifest first. The weights are written in
``--dtype`` (default: the run's). ``OUT`` must not exist or be empty.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, fields
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from ..layers.gpt import GPT, GPTConfig
from ..layers.gpt_llama import llama_design, llama_names
from .checkpoint import CheckpointError, checkpoint_keys, latest_checkpoint, load_checkpoint, verify_checkpoint
from .train_args import DTYPES

__all__ = ["ExportError", "export", "gpt_to_llama", "main"]

PROG = "python -m tessel.bench.export"
MODEL = "model."  # the checkpoint's prefix of the model's tensors (train_state.py)


class ExportError(ValueError):
    """A checkpoint that cannot be exported, or a bad argument: the message says which and why."""


def _checkpoint_dir(path: Path) -> Path:
    if (path / "manifest.json").is_file():
        return path
    for root in (path, path / "checkpoints"):  # checkpoints' root, or a run's --out
        latest = latest_checkpoint(root) if root.is_dir() else None
        if latest is not None:
            return latest
    raise ExportError(f"checkpoint must be a checkpoint directory, their root or a run's --out, received {path}")


def _gpt_config(record: dict) -> GPTConfig:
    """The GPTConfig a manifest records (settings newer than the checkpoint at their defaults)."""
    names = {f.name for f in fields(GPTConfig)}
    return GPTConfig(**{k: v for k, v in record.items() if k in names})


def _llama_config(config: GPTConfig, dtype: torch.dtype):
    import transformers

    kw = dict(vocab_size=config.vocab_size, hidden_size=config.n_embd, intermediate_size=config.mlp_hidden,
              num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
              num_key_value_heads=config.n_kv_head, head_dim=config.n_embd // config.n_head,
              max_position_embeddings=config.block_size, rms_norm_eps=config.norm_eps,
              initializer_range=config.init_std, tie_word_embeddings=False, hidden_act="silu", dtype=dtype)  # fmt: skip
    if config.sliding_window is None:
        made = transformers.LlamaConfig(**kw, attention_bias=config.bias, mlp_bias=config.bias)
    else:
        made = transformers.MistralConfig(**kw, sliding_window=config.sliding_window)
    made.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_theta}
    return made


def gpt_to_llama(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """tessel's GPT's (dense) state dict under Llama's names: ``qkv`` cut into q, k, v and ``fc`` into gate, up."""
    out = {}
    for name, keys in llama_names(config).items():
        d = config.n_embd // config.n_head
        sizes = {
            1: None,
            2: (config.mlp_hidden,) * 2,
            3: (config.n_head * d, config.n_kv_head * d, config.n_kv_head * d),
        }
        parts = state[name].split(sizes[len(keys)]) if len(keys) > 1 else (state[name],)
        out.update(zip(keys, parts, strict=True))
    return out


def _hf_model(family: str, config: GPTConfig, kv_shared_layers: int = 0) -> nn.Module:
    """The ``--hf`` family's causal LM as the run built it (its config from the same builder), on the meta device:
    the checkpoint's tensors replace its parameters."""
    from .train_hf_config import EAGER_FAMILIES, HF_FAMILIES, _hf_config, model_class

    if family not in HF_FAMILIES:
        raise ExportError(f"the checkpoint's model is an unknown Hugging Face family {family!r} (known: "
                          f"{', '.join(HF_FAMILIES)})")  # fmt: skip
    args = SimpleNamespace(hf=family, experts=config.n_expert, top_k=config.top_k, expert_groups=config.expert_groups,
                           top_groups=config.top_groups, aux_loss_coef=config.aux_loss_coef,
                           z_loss_coef=config.z_loss_coef, hf_baseline=True,
                           kv_shared_layers=kv_shared_layers)  # fmt: skip
    made = _hf_config(args, config, "eager" if family in EAGER_FAMILIES else "sdpa")
    with torch.device("meta"):
        return model_class(family)(made)


def _conv1d_layout(state: dict[str, torch.Tensor], model: nn.Module) -> None:
    """GPT-2's Conv1D weights, which tessel trained as the nn.Linear weights (``[out, in]``) they compute, in the
    model's layout (``[in, out]``)."""
    from ..layers.hf_plans import is_conv1d

    for name, m in model.named_modules():
        key = f"{name}.weight"
        if is_conv1d(m) and key in state and state[key].shape == m.weight.shape[::-1] != m.weight.shape:
            state[key] = state[key].t().contiguous()


def _read_model(path: Path) -> dict[str, torch.Tensor]:
    """Every ``model.*`` tensor of checkpoint ``path``, whole (fp32 as saved), by its name in the model."""
    shapes = {k: v for k, v in checkpoint_keys(path).items() if k.startswith(MODEL) and v is not None}
    state = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in shapes.items()}
    load_checkpoint(path, state)
    return {k[len(MODEL) :]: v for k, v in state.items()}


def _check_names(state: dict[str, torch.Tensor], model: nn.Module, path: Path) -> None:
    expected = {k: v.shape for k, v in model.state_dict().items()}
    missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise ExportError(f"checkpoint {path} does not hold the model its manifest records: missing "
                          f"{missing[:5] or 'nothing'}, unexpected {unexpected[:5] or 'nothing'}")  # fmt: skip
    for name, shape in expected.items():
        if state[name].shape != shape:
            raise ExportError(f"checkpoint {path}: {name} is {tuple(state[name].shape)}, the model's is {tuple(shape)}")


def _cast(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating-point tensors in ``dtype`` (one at a time, each fp32 original freed), the others as they are."""
    for name in list(state):
        if state[name].is_floating_point():
            state[name] = state.pop(name).to(dtype).contiguous()
    return state


def export(checkpoint: str | Path, out: str | Path, *, dtype: str | None = None) -> Path:
    """Write the model of ``checkpoint`` (a checkpoint directory, their root or a run's ``--out``) to ``out``; see
    the module.

    Returns the checkpoint directory read. Raises :class:`ExportError` (a bad argument, a model with no such
    format) or :class:`~tessel.bench.checkpoint.CheckpointError` (a missing, truncated or corrupted checkpoint)
    before anything is written.
    """
    path, out = _checkpoint_dir(Path(checkpoint)), Path(out)
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {', '.join(DTYPES)}, received {dtype!r}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"out must be a new or empty directory, received {out} (it holds files)")
    manifest = verify_checkpoint(path)
    record = dict(manifest.get("model") or {})
    family, shared, config = record.pop("hf", None), record.pop("kv_shared_layers", 0), _gpt_config(record)
    torch_dtype = DTYPES[dtype or (manifest.get("run") or {}).get("dtype", "fp32")]
    state = _read_model(path)
    if family is not None:
        model = _hf_model(family, config, shared)
        _conv1d_layout(state, model)
        _check_names(state, model, path)
    elif llama_design(config) is None:
        _check_names(state, GPT(config, device="meta"), path)
        made = _llama_config(config, torch_dtype)
        state = gpt_to_llama(state, config)
        import transformers

        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(made)
    else:
        model = GPT(config, device="meta")
        _check_names(state, model, path)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(asdict(config), indent=2) + "\n")
        torch.save(_cast(state, torch_dtype), out / "model.pt")
        return path
    model.load_state_dict(_cast(state, torch_dtype), strict=True, assign=True)
    model.config.dtype = torch_dtype
    model.save_pretrained(out)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    parser.add_argument(
        "checkpoint", help="a checkpoint directory (<out>/checkpoints/step_N), their root or a run's --out (the latest)"
    )
    parser.add_argument("out", help="the directory to write (new or empty)")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="the weights' dtype (default: the run's)")
    args = parser.parse_args(argv)
    try:
        path = export(args.checkpoint, args.out, dtype=args.dtype)
    except (ExportError, CheckpointError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 2 if isinstance(exc, ExportError) else 1
    print(f"wrote {args.out} from {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
