"""Validation of ``python -m tessel.bench.train``'s run options (:mod:`.train_args` parses them): experts, the run's
length and optimizer, its data and their vocabulary, evaluation, and the restart test's switches. Each check raises
:class:`ArgumentError` with the one line the command prints."""

from __future__ import annotations

import math

import numpy as np

from .dataset import TOKEN_FORMATS, ByteDataset

__all__ = ["ArgumentError", "check_eval", "check_experts", "check_kill", "check_run", "positive"]


class ArgumentError(ValueError):
    """An argument that cannot work; its message is the one line the command prints."""


def positive(args, *names: str) -> None:
    for name in names:
        if getattr(args, name) < 1:
            raise ArgumentError(
                f"--{name.replace('_', '-')} must be a positive integer, received {getattr(args, name)}"
            )


def check_experts(args) -> None:
    if args.experts < 0:
        raise ArgumentError(f"--experts must be 0 (dense) or positive, received {args.experts}")
    if not args.experts:
        if args.ep > 1:
            raise ArgumentError(f"--ep {args.ep} splits experts over ranks: it needs --experts")
        if args.expert_bias_rate:
            raise ArgumentError(f"--expert-bias-rate {args.expert_bias_rate} balances experts: it needs --experts")
        if (args.expert_groups, args.top_groups) != (1, 1):
            raise ArgumentError("--expert-groups and --top-groups group the experts: they need --experts")
        return
    if not 1 <= args.top_k <= args.experts:
        raise ArgumentError(f"--top-k must be in [1, --experts {args.experts}], received {args.top_k}")
    if args.experts % args.ep:
        raise ArgumentError(f"--ep {args.ep} does not divide --experts {args.experts}")
    if args.expert_groups < 1 or args.experts % args.expert_groups:
        raise ArgumentError(f"--expert-groups must be a positive divisor of --experts {args.experts}, received "
                            f"{args.expert_groups}")  # fmt: skip
    if not 1 <= args.top_groups <= args.expert_groups:
        raise ArgumentError(f"--top-groups must be in [1, --expert-groups {args.expert_groups}], received "
                            f"{args.top_groups}")  # fmt: skip
    if args.top_k > args.top_groups * (args.experts // args.expert_groups):
        raise ArgumentError(f"--top-k {args.top_k} exceeds the {args.top_groups * (args.experts // args.expert_groups)}"
                            f" experts of --top-groups {args.top_groups} groups")  # fmt: skip
    for flag in ("aux_loss_coef", "z_loss_coef", "expert_bias_rate"):
        value = getattr(args, flag)
        if not 0 <= value < math.inf:
            raise ArgumentError(f"--{flag.replace('_', '-')} must be a finite non-negative number, received {value}")


def check_run(args) -> None:
    positive(args, "steps", "batch_size", "keep_checkpoints")
    if args.batch_size % args.dp:
        raise ArgumentError(f"--batch-size {args.batch_size} is not divisible by the data-parallel size {args.dp}")
    local = args.batch_size // args.dp
    if local % args.microbatches:
        raise ArgumentError(
            f"the {local} sequences per data-parallel rank do not split into --microbatches {args.microbatches}"
        )
    if args.lr <= 0:
        raise ArgumentError(f"--lr must be positive, received {args.lr}")
    if not 0 <= args.min_lr <= args.lr:
        raise ArgumentError(f"--min-lr must be in [0, --lr {args.lr:g}], received {args.min_lr:g}")
    if not 0 <= args.warmup_steps < args.steps:
        raise ArgumentError(f"--warmup-steps must be in [0, --steps {args.steps}), received {args.warmup_steps}")
    for name in ("weight_decay", "grad_clip"):
        if getattr(args, name) < 0:
            raise ArgumentError(f"--{name.replace('_', '-')} must be non-negative, received {getattr(args, name)}")
    if not 0 <= args.seed < 2**31:
        raise ArgumentError(f"--seed must be in [0, 2**31), received {args.seed}")
    if args.save_every < 0:
        raise ArgumentError(f"--save-every must be 0 (never) or positive, received {args.save_every}")
    if not args.data.is_file():
        raise ArgumentError(f"--data {args.data}: no such file")
    if args.init is not None and not (args.init / "config.json").is_file():
        raise ArgumentError(f"--init must be a Hugging Face checkpoint directory (config.json and safetensors), "
                            f"received {args.init}")  # fmt: skip
    _check_tokens(args)
    if args.dtype == "fp16" and args.zero == 0:
        raise ArgumentError("--dtype fp16 needs loss scaling: use --zero 1, 2 or 3 (ZeroAdam's dynamic loss scale)")


def _check_tokens(args) -> None:
    """The vocabulary the data need, and the document separator their format takes."""
    tp_note = f" and divisible by --tp {args.tp}" if args.tp > 1 else ""
    if args.tokens == "bytes":
        if args.doc_token is not None:
            raise ArgumentError("--doc-token separates documents of token ids (--tokens uint16/uint32); a text "
                                "takes --doc-sep")  # fmt: skip
        needed, default, what = 256, 256, "every byte"
    else:
        if args.doc_sep is not None:
            raise ArgumentError(f"--doc-sep separates documents of a text; --tokens {args.tokens} takes --doc-token")
        try:  # the file read as the training run reads it: a whole number of tokens, enough of them
            data = ByteDataset(args.data, seq_len=args.seq_len, tokens=args.tokens)
        except ValueError as exc:
            raise ArgumentError(f"--data {args.data}: {exc}") from None
        width = np.dtype(TOKEN_FORMATS[args.tokens]).itemsize
        if args.doc_token is not None and not 0 <= args.doc_token < 2 ** (8 * width):
            raise ArgumentError(f"--doc-token must be a {args.tokens} token id, received {args.doc_token}")
        needed, what = data.max_token() + 1, "the data's largest token id plus one"
        default = -(-needed // 128) * 128
    if args.vocab_size is None:
        args.vocab_size = default if args.tp == 1 or default % args.tp == 0 else -(-default // args.tp) * args.tp
    if args.vocab_size < needed or args.vocab_size % args.tp:
        raise ArgumentError(f"--vocab-size must be at least {needed} ({what}){tp_note}, received {args.vocab_size}")


def check_eval(args) -> None:
    if args.eval_every < 0:
        raise ArgumentError(f"--eval-every must be 0 (never) or positive, received {args.eval_every}")
    positive(args, "eval_batches")
    if not args.eval_every:
        if args.val_fraction is not None:
            raise ArgumentError(f"--val-fraction {args.val_fraction} holds text out for evaluation: it needs "
                                "--eval-every")  # fmt: skip
        args.val_fraction = 0.0
        return
    if args.val_fraction is None:
        args.val_fraction = 0.1
    if not 0 < args.val_fraction < 1:
        raise ArgumentError(f"--val-fraction must lie in (0, 1), received {args.val_fraction}")
    size = args.data.stat().st_size // np.dtype(TOKEN_FORMATS[args.tokens]).itemsize  # in tokens
    held_out = round(size * args.val_fraction)  # as ByteDataset cuts the file
    for split, length in (("held-out", held_out), ("training", size - held_out)):
        if length < args.seq_len + 1:
            raise ArgumentError(f"--val-fraction {args.val_fraction} leaves {length} {split} tokens of --data "
                                f"{args.data}, fewer than --seq-len + 1 = {args.seq_len + 1}")  # fmt: skip


def check_kill(args) -> None:
    """``--kill-rank R --kill-at-step K``: rank R kills itself with SIGKILL when step K begins, on the
    first attempt only (torchrun's ``TORCHELASTIC_RESTART_COUNT`` is 0), to test restarts."""
    if (args.kill_rank is None) != (args.kill_at_step is None):
        raise ArgumentError("--kill-rank and --kill-at-step go together")
    if args.kill_rank is not None and not 0 <= args.kill_rank < args.world_size:
        raise ArgumentError(f"--kill-rank {args.kill_rank} is not a rank of the world of {args.world_size}")
