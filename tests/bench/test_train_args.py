"""``python -m tessel.bench.train``: every bad argument ends the run with one line and a non-zero status."""

import itertools
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import tessel.bench.train_engine as train_engine
import tessel.kernels._dispatch as dispatch
from tessel.bench.train import main
from tessel.bench.train_args import PRESETS, ArgumentError, learning_rate, parse_args

# Hidden GPUs make the command take its CPU defaults on any machine.
CPU_ENV = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--tp", "2", "--dp", "1"], "--tp 2 × --pp 1 × --dp 1 = 2 does not match the world size 1"),
        (["--tp", "2"], "--tp 2 × --pp 1 = 2 does not divide the world size 1"),
        (["--seq-len", "257"], "--seq-len 257 exceeds the block size 256 of preset 'tiny'"),
        (["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
        (["--schedule", "zigzag"], "argument --schedule: invalid choice: 'zigzag'"),
        (["--attention-backward", "fast"], "argument --attention-backward: invalid choice: 'fast'"),
        (["--router-score", "tanh"], "argument --router-score: invalid choice: 'tanh'"),
        (["--doc-sep", ""], "argument --doc-sep: the document separator must not be empty"),
        (["--doc-sep", "\\x4"], "argument --doc-sep: cannot read the escapes of '\\\\x4'"),
        (["--warmup-steps", "400"], "--warmup-steps must be in [0, --steps 400), received 400"),
        (["--warmup-steps", "-1"], "--warmup-steps must be in [0, --steps 400), received -1"),
        (["--min-lr", "0.01"], "--min-lr must be in [0, --lr 0.003], received 0.01"),
        (["--lr-schedule", "linear"], "argument --lr-schedule: invalid choice: 'linear'"),
    ],
)
def test_bad_argument_ends_the_run_with_one_line(tmp_path, capsys, args, expected):
    assert main(["--out", str(tmp_path / "run"), *args]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m tessel.bench.train: error: "), err
    assert expected in lines[0], err
    assert out == "" and not (tmp_path / "run").exists()  # nothing ran, nothing written


def test_the_command_exits_with_status_two_and_one_line(tmp_path):
    """The same through ``python -m`` (the status is the process's; nothing else reaches stderr)."""
    cmd = [sys.executable, "-m", "tessel.bench.train", "--out", str(tmp_path / "run"), "--tp", "2", "--dp", "1"]
    proc = subprocess.run(cmd, env=CPU_ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "python -m tessel.bench.train: error: --tp 2 × --pp 1 × --dp 1 = 2 does not match the world size 1 "
        "(torchrun --nproc_per_node)"
    ]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("args", "world", "expected"),
    [
        (["--tp", "3"], 4, "--tp 3 × --pp 1 = 3 does not divide the world size 4"),
        (["--tp", "2", "--dp", "1"], 4, "= 2 does not match the world size 4"),
        (["--tp", "3"], 3, "--tp 3 does not divide the 4 heads of preset 'tiny'"),
        (["--pp", "4", "--schedule", "interleaved"], 4, "8 pipeline stages (--pp 4, schedule interleaved) exceed"),
        (["--pp", "8"], 8, "8 pipeline stages (--pp 8, schedule 1f1b) exceed the 4 layers"),
        (["--microbatches", "3"], 1, "the 16 sequences per data-parallel rank do not split into --microbatches 3"),
        (["--microbatches", "0"], 1, "--microbatches must be a positive integer, received 0"),
        (["--eval-every", "-1"], 1, "--eval-every must be 0 (never) or positive, received -1"),
        (["--doc-token", "3"], 1, "--doc-token separates documents of token ids (--tokens uint16/uint32)"),
        (["--hf-baseline"], 1, "--hf-baseline trains a Hugging Face model as it comes: it needs --hf"),
        (["--hf", "llama", "--hf-baseline", "--pp", "2"], 2, "--hf-baseline trains the model as Hugging Face makes it"),
        (["--vocab-size", "200"], 1, "--vocab-size must be at least 256 (every byte), received 200"),
        (["--vocab-size", "301", "--tp", "2"], 2, "at least 256 (every byte) and divisible by --tp 2, received 301"),
        (["--eval-every", "5", "--eval-batches", "0"], 1, "--eval-batches must be a positive integer, received 0"),
        (["--val-fraction", "0.2"], 1, "--val-fraction 0.2 holds text out for evaluation: it needs --eval-every"),
        (["--eval-every", "5", "--val-fraction", "1.5"], 1, "--val-fraction must lie in (0, 1), received 1.5"),
        (["--eval-every", "5", "--val-fraction", "1e-5"], 1, "leaves 5 held-out tokens of --data"),
        (["--batch-size", "6"], 4, "--batch-size 6 is not divisible by the data-parallel size 4"),
        (["--pp", "2", "--microbatches", "3"], 2, "do not split into --microbatches 3"),
        (["--dtype", "fp16"], 1, "--dtype fp16 needs loss scaling"),
        (["--lr", "0"], 1, "--lr must be positive, received 0.0"),
        (["--grad-clip", "-1"], 1, "--grad-clip must be non-negative, received -1.0"),
        (["--kill-rank", "0"], 1, "--kill-rank and --kill-at-step go together"),
        (["--kill-rank", "2", "--kill-at-step", "1"], 2, "--kill-rank 2 is not a rank of the world of 2"),
        (["--steps", "0"], 1, "--steps must be a positive integer"),
        (["--sequence-parallel", "--tp", "2", "--seq-len", "63"], 2, "--seq-len 63 divisible by --tp 2"),
        (["--cp", "0"], 1, "--cp must be a positive integer, received 0"),
        (["--cp", "3"], 4, "--tp 1 × --pp 1 × --cp 3 = 3 does not divide the world size 4"),
        (["--cp", "2", "--dp", "1"], 4, "--tp 1 × --pp 1 × --cp 2 × --dp 1 = 2 does not match the world size 4"),
        (["--cp", "2", "--seq-len", "30"], 2, "--cp 2 needs --seq-len 30 divisible by 2·cp = 4"),
        (["--cp", "2", "--tp", "4", "--sequence-parallel", "--seq-len", "36"], 8, "the 18 tokens per cp rank"),
        (["--sliding-window", "0"], 1, "--sliding-window must be a positive integer, received 0"),
        (["--ep", "0"], 1, "--ep must be a positive integer, received 0"),
        (["--ep", "2", "--experts", "4"], 3, "--ep 2 does not divide the data-parallel size 3"),
        (["--ep", "2"], 2, "--ep 2 splits experts over ranks: it needs --experts"),
        (["--experts", "-1"], 1, "--experts must be 0 (dense) or positive, received -1"),
        (["--label-smoothing", "1.5"], 1, "--label-smoothing must lie in [0, 1], received 1.5"),
        (["--logit-z-loss=-1e-4"], 1, "--logit-z-loss must be a finite non-negative number, received -0.0001"),
        (["--experts", "4", "--top-k", "5"], 1, "--top-k must be in [1, --experts 4], received 5"),
        (["--experts", "6", "--ep", "4"], 4, "--ep 4 does not divide --experts 6"),
        (
            ["--experts", "4", "--aux-loss-coef", "-1"],
            1,
            "--aux-loss-coef must be a finite non-negative number, received -1",
        ),
        (
            ["--experts", "4", "--z-loss-coef", "inf"],
            1,
            "--z-loss-coef must be a finite non-negative number, received inf",
        ),
        (
            ["--experts", "4", "--z-loss-coef", "nan"],
            1,
            "--z-loss-coef must be a finite non-negative number, received nan",
        ),
        (["--expert-bias-rate", "0.001"], 1, "--expert-bias-rate 0.001 balances experts: it needs --experts"),
        (
            ["--experts", "4", "--expert-bias-rate", "-1"],
            1,
            "--expert-bias-rate must be a finite non-negative number, received -1",
        ),
        (["--expert-groups", "2"], 1, "--expert-groups and --top-groups group the experts: they need --experts"),
        (
            ["--experts", "4", "--expert-groups", "3"],
            1,
            "--expert-groups must be a positive divisor of --experts 4, received 3",
        ),
        (
            ["--experts", "4", "--expert-groups", "2", "--top-groups", "3"],
            1,
            "--top-groups must be in [1, --expert-groups 2], received 3",
        ),
        (
            ["--experts", "4", "--top-k", "3", "--expert-groups", "2"],
            1,
            "--top-k 3 exceeds the 2 experts of --top-groups 1 groups",
        ),
    ],
)
def test_layout_and_run_checks(monkeypatch, args, world, expected):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ArgumentError) as info:
        parse_args(args)
    assert expected in str(info.value)


def test_defaults_fill_from_the_preset(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = parse_args(["--preset", "tiny", "--pp", "2"])
    tiny = PRESETS["tiny"]
    assert (args.seq_len, args.batch_size, args.lr, args.steps) == (tiny.seq_len, tiny.batch_size, tiny.lr, tiny.steps)
    assert (args.dp, args.microbatches, args.stages_per_rank) == (1, 4, 1)
    assert args.attention_backward == "deterministic" and args.recompute is False and args.cp == 1
    assert parse_args([]).microbatches == 1  # without pipeline stages: no gradient accumulation
    assert (args.eval_every, args.val_fraction) == (0, 0.0)  # no evaluation: the whole text is trained on
    assert parse_args(["--eval-every", "10"]).val_fraction == 0.1
    assert parse_args(["--microbatches", "4"]).microbatches == 4


def test_document_separators_read_backslash_escapes():
    assert parse_args(["--doc-sep", "\\n\\n\\n"]).doc_sep == b"\n\n\n"
    assert parse_args(["--doc-sep", "é\\x1e"]).doc_sep == "é".encode() + b"\x1e"
    assert parse_args([]).doc_sep is None


def test_learning_rate_warms_up_then_follows_its_schedule():
    args = parse_args(["--steps", "110", "--lr", "1e-3", "--warmup-steps", "10"])
    assert args.min_lr == 1e-4 and args.lr_schedule == "cosine"
    lrs = [learning_rate(args, step) for step in range(110)]
    assert lrs[:10] == pytest.approx([1e-4 * (i + 1) for i in range(10)])  # linear, reaching --lr at step 9
    assert lrs[10] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(1e-4)  # cosine from --lr to --min-lr
    assert lrs[60] == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 50 / 99)))
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:]))  # never rises after the warm-up
    constant = parse_args(["--steps", "20", "--lr", "1e-3", "--lr-schedule", "constant"])
    assert constant.warmup_steps == 2  # a tenth of the steps by default
    assert [learning_rate(constant, s) for s in (0, 1, 2, 19)] == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3])
    no_warmup = parse_args(["--steps", "1", "--lr", "1e-3"])
    assert no_warmup.warmup_steps == 0 and learning_rate(no_warmup, 0) == pytest.approx(1e-3)


def test_each_step_runs_at_its_scheduled_learning_rate(tmp_path, monkeypatch):
    seen = []
    step = train_engine.Engine.train_step

    def recording(self, *a, **k):
        seen.append([group["lr"] for group in self.optimizer.param_groups])
        return step(self, *a, **k)

    monkeypatch.setattr(train_engine.Engine, "train_step", recording)
    monkeypatch.setattr(dispatch, "INTERPRET", False)  # the kernels' references: a step in seconds, not minutes
    argv = ["--steps", "4", "--warmup-steps", "2", "--lr", "1e-3", "--min-lr", "0", "--out", str(tmp_path)]
    assert main(argv) == 0
    args = parse_args(argv)
    assert seen == [[pytest.approx(learning_rate(args, s))] * len(seen[s]) for s in range(4)]
    assert [group[0] for group in seen] == pytest.approx([5e-4, 1e-3, 1e-3, 0.0])


@pytest.fixture
def ids_file(tmp_path):
    path = tmp_path / "ids.bin"
    np.array([5, 999, 3, 1200, 7] * 40, dtype="<u2").tofile(path)
    return path


@pytest.mark.parametrize(
    ("args", "world", "expected"),
    [
        (["--doc-sep", "\\n"], 1, "--doc-sep separates documents of a text; --tokens uint16 takes --doc-token"),
        (["--vocab-size", "1200"], 1, "--vocab-size must be at least 1201 (the data's largest token id plus one)"),
        (["--doc-token", "70000"], 1, "--doc-token must be a uint16 token id, received 70000"),
    ],
)
def test_token_file_checks(monkeypatch, ids_file, args, world, expected):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ArgumentError) as info:
        parse_args(["--data", str(ids_file), "--tokens", "uint16", "--seq-len", "16", *args])
    assert expected in str(info.value)


def test_token_file_vocabulary_defaults_to_the_largest_id_rounded_up(ids_file):
    assert parse_args(["--data", str(ids_file), "--tokens", "uint16", "--seq-len", "16"]).vocab_size == 1280
    assert parse_args([]).vocab_size == 256
    ids_file.write_bytes(bytes(402))  # 100.5 uint32 tokens
    with pytest.raises(ArgumentError, match="holds 402 bytes, not a whole number of uint32 tokens"):
        parse_args(["--data", str(ids_file), "--tokens", "uint32", "--seq-len", "16"])
