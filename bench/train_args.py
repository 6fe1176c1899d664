"""Command line of ``python -m tessel.bench.train``: options, model-size presets, and their validation (the layout's
and the model's here, the run's in :mod:`.train_checks`).

Everything here is checked before any process group exists, from torchrun's ``WORLD_SIZE``, so a bad
argument ends every rank at once with one line on stderr and a non-zero status, and never a traceback.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..layers.moe import ROUTER_SCORES
from .dataset import DEFAULT_DATASET, TOKEN_FORMATS
from .train_checks import ArgumentError, check_eval, check_experts, check_kill, check_run, positive

__all__ = [
    "COMPILE_BACKENDS",
    "DTYPES",
    "HF_CHOICES",
    "LR_SCHEDULES",
    "OVERLAPS",
    "PRESETS",
    "SCHEDULES",
    "ArgumentError",
    "Preset",
    "learning_rate",
    "parse_args",
]

PROG = "python -m tessel.bench.train"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")
# --hf's families (train_hf_config.HF_FAMILIES names their classes)
HF_CHOICES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "gemma", "gemma2", "gemma3", "olmo2",
              "olmoe", "phi3", "deepseek_v3", "deepseek_v32", "gpt_oss", "qwen3_5", "qwen3_5_moe", "bamba",
              "jamba", "gemma4", "kimi_linear", "bailing_hybrid", "gpt2", "opt", "bloom", "falcon",
              "deepseek_v4")  # fmt: skip
LR_SCHEDULES = ("cosine", "constant")
COMPILE_BACKENDS = ("inductor", "aot_eager")
OVERLAPS = {"auto": "auto", "on": True, "off": False, "peer": "peer"}  # --overlap: the layers' `overlap`
INTERLEAVED_CHUNKS = 2  # stages per pipeline rank under --schedule interleaved


@dataclass(frozen=True)
class Preset:
    """A model shape (``GPTConfig`` keywords) and the run defaults that suit it."""

    model: dict = field(default_factory=dict)
    seq_len: int = 64
    batch_size: int = 8
    lr: float = 1e-3
    steps: int = 100


# Shapes (layers, width, heads) of the GPT-3 paper's table (Brown et al. 2020, Table 2.1) for 125m,
# 350m and 1b (its "1.3B XL"); with a 256-byte vocabulary the embeddings are tiny, so the parameter
# counts (printed at start) are a little below the names: 85M, 302M and 1.21B.
PRESETS: dict[str, Preset] = {
    "tiny": Preset(dict(n_layer=4, n_head=4, n_embd=64, block_size=256), seq_len=64, batch_size=16, lr=3e-3, steps=400),
    "small": Preset(dict(n_layer=6, n_head=6, n_embd=384, block_size=1024), seq_len=256, batch_size=32, lr=1e-3),
    "125m": Preset(dict(n_layer=12, n_head=12, n_embd=768, block_size=2048), seq_len=1024, batch_size=16, lr=6e-4),
    "350m": Preset(dict(n_layer=24, n_head=16, n_embd=1024, block_size=2048), seq_len=1024, batch_size=16, lr=3e-4),
    "1b": Preset(dict(n_layer=24, n_head=16, n_embd=2048, block_size=2048), seq_len=2048, batch_size=8, lr=2e-4),
}


class _Parser(argparse.ArgumentParser):
    """Reports a bad argument in one line (argparse's default adds the whole usage text)."""

    def error(self, message: str):
        raise ArgumentError(f"{message} (see --help)")


def _epilog() -> str:
    lines = ["presets (layers × width, heads; default sequence length, batch, learning rate, steps):"]
    for name, p in PRESETS.items():
        m = p.model
        lines.append(
            f"  {name:6} {m['n_layer']:2} × {m['n_embd']:4}, {m['n_head']:2} heads; seq {p.seq_len}, batch "
            f"{p.batch_size}, lr {p.lr:g}, {p.steps} steps"
        )
    lines += [
        "",
        "examples:",
        "  python -m tessel.bench.train                                   # a world of one, the CPU default",
        "  torchrun --nproc_per_node=2 -m tessel.bench.train --tp 2 --sequence-parallel",
        "  torchrun --nproc_per_node=4 -m tessel.bench.train --pp 2 --dp 2 --zero 1 --schedule interleaved",
        "  torchrun --nproc_per_node=2 --max-restarts=1 -m tessel.bench.train --dp 2 --save-every 50 --resume",
        "  torchrun --nproc_per_node=4 -m tessel.bench.train --tp 2 --dp 2 --experts 8 --ep 2 --zero 1",
        "  torchrun --nproc_per_node=4 -m tessel.bench.train --hf llama --tp 2 --pp 2 --sequence-parallel",
        "",
        "Without a GPU the kernels run their PyTorch references; TRITON_INTERPRET=1 runs the Triton kernels",
        "through Triton's interpreter instead (about 100× slower).",
    ]
    return "\n".join(lines)


def _parser(cuda: bool) -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Train tessel's GPT (or a Hugging Face model: --hf) on a text under any dp × pp × tp layout.",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    add(
        "--preset",
        choices=PRESETS,
        default="125m" if cuda else "tiny",
        help="model size (default: tiny on a CPU, 125m on a GPU)",
    )
    add(
        "--hf",
        choices=HF_CHOICES,
        default=None,
        help="train this Hugging Face family's causal LM (needs transformers) instead of tessel's GPT: the preset's "
        "shape, parallelize()d, tessel's attention and fused loss, hf_pipeline_stage() under --pp",
    )
    add(
        "--hf-baseline",
        action="store_true",
        help="with --hf: the model as Hugging Face makes it (sdpa attention, its own head and loss; no tensor or "
        "pipeline parallelism), to compare tessel's layers with",
    )
    add("--tp", type=int, default=1, help="tensor-parallel size")
    add("--pp", type=int, default=1, help="pipeline-parallel size")
    add("--dp", type=int, default=-1, help="data-parallel size (default: world size / (cp·tp·pp))")
    add(
        "--cp",
        type=int,
        default=1,
        help="context-parallel size: ranks that split each sequence (ring attention; --seq-len divisible by 2·cp)",
    )
    add(
        "--experts",
        type=int,
        default=0,
        help="a mixture of this many experts in every block instead of the MLP (each the preset's MLP width; "
        "default: 0, dense); with --hf, of a mixture family (mixtral, qwen3_moe, olmoe, deepseek_v3)",
    )
    add("--top-k", type=int, default=2, help="experts per token with --experts (default: %(default)s)")
    add(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel size: groups of this many data-parallel ranks split the experts between them, each "
        "token travelling to its experts' ranks (a divisor of --dp and of --experts)",
    )
    add(
        "--aux-loss-coef",
        type=float,
        default=0.01,
        help="weight of the experts' load-balancing loss, added to the training loss (default: %(default)s)",
    )
    add(
        "--z-loss-coef",
        type=float,
        default=0.0,
        help="weight of the routers' z-loss (ST-MoE: the mean squared log-sum-exp of the router logits), added to "
        "the training loss (default: %(default)s; ST-MoE uses 1e-3)",
    )
    add(
        "--label-smoothing",
        type=float,
        default=0.0,
        help="label smoothing of the language-model loss, as torch's cross entropy takes it (default: %(default)s)",
    )
    add(
        "--logit-z-loss",
        type=float,
        default=0.0,
        help="weight of PaLM's z-loss on the output logits (logsumexp squared per token), added to the training loss "
        "(default: %(default)s; PaLM uses 1e-4)",
    )
    add(
        "--router-score",
        choices=ROUTER_SCORES,
        default="softmax",
        help="how the router scores the experts: softmax over them (Mixtral) or each one's sigmoid (DeepSeek-V3)",
    )
    add(
        "--expert-groups",
        type=int,
        default=1,
        help="group-limited routing (DeepSeek-V3's n_group): the experts form this many groups of consecutive "
        "experts and each token chooses among those of its --top-groups best groups only (default: 1, off)",
    )
    add(
        "--top-groups",
        type=int,
        default=1,
        help="with --expert-groups: the groups each token may choose from, those whose two best scores add up "
        "highest (DeepSeek-V3's topk_group; with --expert-groups a multiple of --ep, the ranks a token reaches)",
    )
    add(
        "--expert-bias-rate",
        type=float,
        default=0.0,
        help="auxiliary-loss-free balancing (DeepSeek-V3): after each step every expert's routing bias moves by "
        "this much towards balance (default: %(default)s, off; DeepSeek-V3 uses 1e-3 with --aux-loss-coef ~0)",
    )
    add(
        "--zero",
        type=int,
        choices=(0, 1, 2, 3),
        default=0,
        help="0: DDP + torch AdamW; 1, 2: DDP + ZeroAdam (ZeRO-1/2); 3: FSDP + ZeroAdam",
    )
    add("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule when --pp > 1")
    add(
        "--microbatches",
        type=int,
        default=None,
        help="microbatches per step: the pipeline schedule's with --pp > 1 (default: 2·pp), otherwise gradient "
        "accumulation: each data-parallel rank runs its rows in this many pieces, forward and backward, and the "
        "gradients are reduced once (default: 1)",
    )
    add("--sequence-parallel", action="store_true", help="split activations over the sequence between TP layers")
    add("--overlap", choices=OVERLAPS, default="auto", help="the TP layers' communication: 'auto' (chunked where "
        "that pays), 'on', 'off', or 'peer' (device-signalled writes into the peers' memory; fp8 too)")  # fmt: skip
    add(
        "--attention-backward",
        choices=("deterministic", "atomic"),
        default="deterministic",
        help="flash attention's backward: a dQ kernel of its own, bit-reproducible (default), or dQ added up "
        "with atomics in the dK/dV kernel (fewer GEMMs, run-to-run differences in the last bits)",
    )
    add(
        "--recompute",
        action="store_true",
        help="activation checkpointing: keep each block's input only and recompute its activations in backward "
        "(far less activation memory for one more forward pass)",
    )
    add(
        "--fp8",
        action="store_true",
        help="the linear layers' GEMMs in fp8 (tessel.layers.convert_to_fp8: e4m3 weights and activations, e5m2 "
        "gradients, current per-tensor scaling; the output head and the optimizer keep --dtype)",
    )
    add(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        choices=COMPILE_BACKENDS,
        help="torch.compile every transformer block (one graph per block, its collectives and tessel's kernels "
        "inside; shared by all blocks) with this backend (default without a value: inductor; aot_eager traces "
        "without generating code)",
    )
    add(
        "--sliding-window",
        type=int,
        default=None,
        help="sliding-window attention: each token attends to this many latest tokens up to itself (Mistral's "
        "sliding_window; default: off, every earlier token)",
    )
    add(
        "--kv-heads",
        type=int,
        default=None,
        help="key and value heads of the attention (grouped-query attention; default: the preset's, one per query "
        "head); over more tensor-parallel ranks than kv heads each is replicated on the ranks whose query heads "
        "read it",
    )
    add(
        "--kv-shared-layers",
        type=int,
        default=0,
        help="with --hf gemma4: the last N layers reuse the keys and values of the last earlier layer of their kind "
        "(Gemma 4's E-models' num_kv_shared_layers; default: %(default)s)",
    )
    add(
        "--dtype",
        choices=DTYPES,
        default="bf16" if cuda else "fp32",
        help="parameter and activation dtype (default: bf16 on a GPU, fp32 on a CPU)",
    )
    add("--steps", type=int, default=None, help="optimizer steps (default: the preset's)")
    add("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's)")
    add("--batch-size", type=int, default=None, help="sequences per step over all data-parallel ranks")
    add("--lr", type=float, default=None, help="AdamW learning rate (default: the preset's)")
    add(
        "--warmup-steps",
        type=int,
        default=None,
        help="steps over which the learning rate rises linearly to --lr (default: a tenth of --steps)",
    )
    add(
        "--lr-schedule",
        choices=LR_SCHEDULES,
        default="cosine",
        help="after the warm-up: cosine decay to --min-lr at the last step, or constant (default: %(default)s)",
    )
    add("--min-lr", type=float, default=None, help="where the cosine decay ends (default: a tenth of --lr)")
    add("--weight-decay", type=float, default=0.1, help="AdamW decoupled weight decay (default: %(default)s)")
    add(
        "--grad-clip",
        type=float,
        default=1.0,
        help="clip the global gradient norm to this, 0: off (default: %(default)s)",
    )
    add(
        "--seed",
        type=int,
        default=1234,
        help="seed of the initial weights and of the data order (default: %(default)s)",
    )
    add(
        "--data",
        type=Path,
        default=DEFAULT_DATASET,
        help="file to train on: a text read as bytes (default: the bundled text), or with --tokens a file of token ids",
    )
    add(
        "--tokens",
        choices=tuple(TOKEN_FORMATS),
        default="bytes",
        help="what --data holds: bytes (each byte a token, vocabulary 256; the default) or a flat little-endian "
        "array of uint16 or uint32 token ids (nanoGPT's train.bin), memory-mapped",
    )
    add(
        "--vocab-size",
        type=int,
        default=None,
        help="the model's vocabulary (default: 256 for bytes; for token ids the largest in --data plus one, rounded "
        "up to a multiple of 128); bytes may take a larger one, to train with another head size",
    )
    add(
        "--doc-token",
        type=int,
        default=None,
        help="with --tokens uint16/uint32: train on packed documents, each ending with this token id (e.g. GPT-2's "
        "<|endoftext|>, 50256), as --doc-sep does for a text",
    )
    add(
        "--doc-sep",
        type=_escaped_bytes,
        default=None,
        help="train on packed documents: this text (backslash escapes read, e.g. '\\n\\n\\n') ends each document; "
        "tokens attend within their own document, rotary positions restart at its start, and no token predicts "
        "the next document's first (default: off, the file is one stream)",
    )
    add(
        "--out",
        type=Path,
        default=Path("runs/train"),
        help="directory for run.json, loss.png, checkpoints (default: %(default)s)",
    )
    add(
        "--eval-every",
        type=int,
        default=0,
        help="evaluate every N steps and after the last: the mean loss of --eval-batches fixed batches of held-out "
        "text, forward only (0: never, the default; the whole file is then trained on)",
    )
    add(
        "--eval-batches",
        type=int,
        default=4,
        help="global batches (of --batch-size sequences) in each evaluation (default: %(default)s)",
    )
    add(
        "--val-fraction",
        type=float,
        default=None,
        help="with --eval-every: the share of --data, at its end, held out from training for evaluation (default: 0.1)",
    )
    add(
        "--init",
        type=Path,
        default=None,
        help="start from the weights of this Hugging Face checkpoint directory (an --hf family's, or a Llama's for "
        "tessel's GPT of Llama's design, as `python -m tessel.bench.export` writes them) instead of random ones: "
        "the model is built on the meta device, split, and each rank reads its shards (load_pretrained)",
    )
    add("--save-every", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    add("--keep-checkpoints", type=int, default=2, help="complete checkpoints kept on disk (default: %(default)s)")
    add("--resume", action="store_true", help="continue from the latest complete checkpoint under --out")
    add("--profile", action="store_true", help="write a Chrome trace of a few steps under --out")
    add("--kill-rank", type=int, default=None, help=argparse.SUPPRESS)  # test switch: see train_checks.check_kill
    add("--kill-at-step", type=int, default=None, help=argparse.SUPPRESS)
    return p


def _escaped_bytes(text: str) -> bytes:
    """``--doc-sep``'s bytes: backslash escapes (``\\n``, ``\\x1e``) read, other characters in UTF-8."""
    try:
        sep = text.encode("utf-8").decode("unicode_escape").encode("latin-1")
    except UnicodeError as err:
        raise argparse.ArgumentTypeError(f"cannot read the escapes of {text!r}: {err.reason}") from None
    if not sep:
        raise argparse.ArgumentTypeError("the document separator must not be empty")
    return sep


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate ``argv``; fill the preset's defaults; raise :class:`ArgumentError` on a bad one."""
    cuda = torch.cuda.is_available()
    args = _parser(cuda).parse_args(argv)
    preset = PRESETS[args.preset]
    for name in ("seq_len", "batch_size", "lr", "steps"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))
    if args.warmup_steps is None:
        args.warmup_steps = args.steps // 10 if args.steps > 0 else 0
    if args.min_lr is None:
        args.min_lr = args.lr / 10
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    _check_layout(args)
    _check_model(args, preset)
    check_run(args)
    check_eval(args)
    _check_hf(args)
    check_kill(args)
    return args


def learning_rate(args, step: int) -> float:
    """The learning rate of step ``step`` (0-based): a linear warm-up over ``--warmup-steps`` steps to
    ``--lr``, then ``--lr`` or a cosine decay that reaches ``--min-lr`` at the last step. A function of
    the step alone, so a resumed run follows the uninterrupted run's schedule."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    if args.lr_schedule == "constant":
        return args.lr
    decay = args.steps - 1 - args.warmup_steps
    progress = (step - args.warmup_steps) / decay if decay > 0 else 0.0  # one step after the warm-up: --lr
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))


def _check_layout(args) -> None:
    positive(args, "tp", "pp", "cp", "ep")
    sizes = f"--tp {args.tp} × --pp {args.pp}" + (f" × --cp {args.cp}" if args.cp > 1 else "")
    model_ranks = args.tp * args.pp * args.cp  # the ranks that share one data-parallel replica's batch
    if args.dp == -1:
        if args.world_size % model_ranks:
            raise ArgumentError(
                f"{sizes} = {model_ranks} does not divide the world size {args.world_size} (torchrun --nproc_per_node)"
            )
        args.dp = args.world_size // model_ranks
    positive(args, "dp")
    if model_ranks * args.dp != args.world_size:
        raise ArgumentError(
            f"{sizes} × --dp {args.dp} = {model_ranks * args.dp} does not match the "
            f"world size {args.world_size} (torchrun --nproc_per_node)"
        )
    if args.dp % args.ep:
        raise ArgumentError(f"--ep {args.ep} does not divide the data-parallel size {args.dp}")
    if args.microbatches is None:
        args.microbatches = 2 * args.pp if args.pp > 1 else 1
    positive(args, "microbatches")
    args.stages_per_rank = INTERLEAVED_CHUNKS if args.pp > 1 and args.schedule == "interleaved" else 1


def _check_model(args, preset: Preset) -> None:
    model = preset.model
    block, layers, heads = model["block_size"], model["n_layer"], model["n_head"]
    positive(args, "seq_len")
    if args.seq_len > block:
        raise ArgumentError(f"--seq-len {args.seq_len} exceeds the block size {block} of preset {args.preset!r}")
    if args.kv_heads is not None:
        positive(args, "kv_heads")
        if heads % args.kv_heads:
            raise ArgumentError(f"--kv-heads {args.kv_heads} does not divide the {heads} heads of preset "
                                f"{args.preset!r}")  # fmt: skip
    kv_heads = args.kv_heads or model.get("n_kv_head") or heads
    if heads % args.tp:
        raise ArgumentError(f"--tp {args.tp} does not divide the {heads} heads of preset {args.preset!r}")
    if kv_heads % args.tp and args.tp % kv_heads:
        raise ArgumentError(f"--tp {args.tp} does not divide the {kv_heads} kv heads, nor do they divide it (fewer "
                            "kv heads than ranks are replicated over them)")  # fmt: skip
    stages = args.pp * args.stages_per_rank
    if stages > layers:
        raise ArgumentError(
            f"{stages} pipeline stages (--pp {args.pp}, schedule {args.schedule}) exceed the {layers} layers of "
            f"preset {args.preset!r}"
        )
    if args.sliding_window is not None:
        positive(args, "sliding_window")
    if not 0 <= args.logit_z_loss < math.inf:
        raise ArgumentError(f"--logit-z-loss must be a finite non-negative number, received {args.logit_z_loss}")
    if not 0 <= args.label_smoothing <= 1:
        raise ArgumentError(f"--label-smoothing must lie in [0, 1], received {args.label_smoothing}")
    check_experts(args)
    if args.cp > 1 and args.seq_len % (2 * args.cp):
        raise ArgumentError(
            f"--cp {args.cp} needs --seq-len {args.seq_len} divisible by 2·cp = {2 * args.cp} (two chunks per rank)"
        )
    if args.sequence_parallel and (args.seq_len // args.cp) % args.tp:
        what = f"--seq-len {args.seq_len}" if args.cp == 1 else f"the {args.seq_len // args.cp} tokens per cp rank"
        raise ArgumentError(f"--sequence-parallel needs {what} divisible by --tp {args.tp}")


def _check_hf(args) -> None:
    """What a Hugging Face model trains with here (``train_hf.refused_options``)."""
    from .train_hf import refused_options

    problem = refused_options(args)
    if problem:
        raise ArgumentError(problem)
    if args.fp8 and args.hf_baseline:
        raise ArgumentError("--hf-baseline trains the model as Hugging Face makes it: without --fp8")
