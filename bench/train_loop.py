"""The training loop of ``python -m tessel.bench.train``: data, steps, checkpoints, restarts, the report.

A step ``k`` (0-based) trains on the global batch ``dataset.batch(k)``; after it ``k + 1`` steps are
complete, and a checkpoint taken then is ``step_<k+1>``. Resuming from ``step_N`` restores weights,
optimizer state and generators and continues with batch ``N``, so the resumed run computes exactly
what the uninterrupted one would have.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

import torch
import torch.distributed as dist

from ..layers.gpt import GPTConfig
from ..parallel.context import split_sequence
from ..parallel.dims import init_parallel, shutdown
from .checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    read_manifest,
    remove_stale,
    save_checkpoint,
)
from .dataset import ByteDataset
from .runner import environment, peak_tflops
from .train_args import DTYPES, learning_rate
from .train_engine import Engine, build_engine
from .train_hf import HF_FAMILIES
from .train_report import (
    Progress,
    StepProfiler,
    StepRecord,
    memory_peak_bytes,
    plot_loss,
    print_summary,
    summarize,
    write_json,
)
from .train_state import load_rng_state, rng_state

__all__ = ["RunError", "run"]


class RunError(RuntimeError):
    """A run that cannot go on; its message is the one line the command prints."""


def _jsonable(value):
    if isinstance(value, Path):
        return str(value)
    return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else value


def _layout(args) -> str:
    text = f"dp={args.dp} pp={args.pp} tp={args.tp}" + (f" cp={args.cp}" if args.cp > 1 else "") + f" zero={args.zero}"
    if args.pp > 1:
        text += f" schedule={args.schedule} microbatches={args.microbatches}"
    elif args.microbatches > 1:
        text += f" accumulation={args.microbatches}"
    if args.experts:
        text += f" experts={args.experts} top-k={args.top_k}" + (f" ep={args.ep}" if args.ep > 1 else "")
        text += f" groups={args.expert_groups} top-groups={args.top_groups}" if args.expert_groups > 1 else ""
    text += " hf-baseline" if args.hf_baseline else ""
    text += " sequence-parallel" if args.sequence_parallel else ""
    text += f" overlap={args.overlap}" if args.overlap != "auto" else ""
    text += " recompute" if args.recompute else ""
    text += " fp8" if args.fp8 else ""
    text += f" compile={args.compile}" if args.compile else ""
    return text + (" attention-backward=atomic" if args.attention_backward == "atomic" else "")


def _meta(args, engine: Engine, history: list[StepRecord]) -> dict:
    """The JSON part of a checkpoint's manifest: what was trained, how, and the loss so far."""
    return {
        "world_size": args.world_size,
        "layout": {"dp": args.dp, "pp": args.pp, "tp": args.tp, "cp": args.cp, "ep": args.ep, "zero": args.zero},
        "model": _model_record(args, engine),
        "run": {
            "seed": args.seed,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "lr": args.lr,
            "dtype": args.dtype,
            "data": Path(args.data).name,
        },
        "history": [[r.step, r.loss, r.step_s, r.tokens, r.eval_loss] for r in history],
    }


def _save(args, engine: Engine, step: int, history: list[StepRecord]) -> None:
    state = {**engine.state_dict(), "train.step": torch.tensor(step, dtype=torch.int64), **rng_state(engine.device)}
    save_checkpoint(args.out / "checkpoints", step, state, _meta(args, engine, history), keep=args.keep_checkpoints)


# Model settings that change how gradients are computed, not what the weights are: a run may resume with
# another choice (and from a checkpoint written before the setting existed). The load-balancing loss's weight
# is a training setting like the learning rate.
_NUMERICS_ONLY = frozenset({"deterministic_attention", "recompute", "aux_loss_coef", "z_loss_coef", "label_smoothing",
                            "logit_z_loss"})  # fmt: skip
_PRESENT_ONLY = frozenset({"expert_bias_rate"})  # the rate may change; whether the model has the biases may not


def _kind(key: str, value):
    return bool(value) if key in _PRESENT_ONLY else value


def _resume(args, engine: Engine) -> tuple[int, list[StepRecord], Path | None]:
    """Load the latest complete checkpoint under ``--out``; ``(0, [], None)`` when there is none yet."""
    path = latest_checkpoint(args.out / "checkpoints")
    if path is None:
        return 0, [], None
    manifest = read_manifest(path)
    saved, built = manifest.get("model") or {}, _model_record(args, engine)
    if saved.get("hf") != args.hf:  # a GPT's checkpoint for a Hugging Face model, or the other way round
        raise CheckpointError(f"checkpoint {path} holds a different model: {_model_name(saved.get('hf'))} (this run: "
                              f"{_model_name(args.hf)})")  # fmt: skip
    built.pop("hf", None)
    defaults = {f.name: f.default for f in fields(GPTConfig)}  # of settings newer than the checkpoint
    defaults[KV_SHARED] = 0
    built.setdefault(KV_SHARED, 0)
    differ = [
        f"{k}={saved.get(k, defaults[k])!r} (this run: {v!r})"
        for k, v in built.items()
        if k not in _NUMERICS_ONLY and _kind(k, saved.get(k, defaults[k])) != _kind(k, v)
    ]
    if differ:
        raise CheckpointError(f"checkpoint {path} holds a different model: {', '.join(differ)}")
    same_world = manifest.get("world_size") == args.world_size
    state = {**engine.state_template(), "train.step": torch.zeros((), dtype=torch.int64)}
    if same_world:
        state.update({k: torch.empty_like(v) for k, v in rng_state(engine.device).items()})
    load_checkpoint(path, state)
    engine.load_state_dict(state)
    if same_world:
        load_rng_state(state, engine.device)
    history = [StepRecord(*row) for row in manifest["history"]]
    return int(state["train.step"]), history, path


def _maybe_kill(args, rank: int, step: int) -> None:
    """The restart test's switch: this rank dies by SIGKILL as step ``--kill-at-step`` begins, first attempt only."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_attempt and args.kill_rank == rank and args.kill_at_step == step:
        print(f"rank {rank}: killed at step {step} (--kill-rank)", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def _max_over_world(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _kernels(device: torch.device) -> str:
    """Where tessel's kernels run (kernels/_dispatch.py decides; TRITON_INTERPRET was fixed in train.py)."""
    if device.type == "cuda":
        return "compiled Triton"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "Triton's interpreter"
    return "the plain-PyTorch references"


def _caveat(device: torch.device) -> str | None:
    if device.type == "cuda":
        return None
    return (
        f"NOTE: no GPU: tessel's kernels ran in {_kernels(device)} on a CPU; tokens/s here are not performance "
        "numbers (the run shows the model training, not its speed)."
    )


def _rank_batch(args, data: ByteDataset, dims, device: torch.device, step: int, split: str = "train"):
    """This rank's ``(x, y, segment_ids or None)`` of global batch ``step`` of ``split``, on ``device``."""
    where = dict(seed=args.seed, batch_size=args.batch_size, dp_rank=dims.dp_rank, dp_size=dims.dp, split=split)
    segments = None
    if args.doc_sep is None and args.doc_token is None:
        x, y = data.batch(step, **where)
    else:  # packed documents: segment ids of the whole sequence, on every cp rank and pipeline stage
        x, y, segments = data.document_batch(step, **where)
        segments = segments.to(device)
    if dims.cp > 1:  # this rank's zigzag share of every sequence
        x, y = split_sequence(x, dims.cp_group), split_sequence(y, dims.cp_group)
    return x.to(device), y.to(device), segments


def _evaluate(args, engine: Engine, data: ByteDataset, dims) -> float:
    """The mean loss of the held-out text's first ``--eval-batches`` global batches (the same at every evaluation)."""
    losses = [float(engine.evaluate(*_rank_batch(args, data, dims, engine.device, j, "val")))
              for j in range(args.eval_batches)]  # fmt: skip
    return sum(losses) / len(losses)


def _finish(args, engine: Engine, history: list[StepRecord], timed: list[StepRecord], resumed: Path | None) -> None:
    memory = _max_over_world(memory_peak_bytes(engine.device), engine.device)
    if engine.rank != 0:
        return
    env = environment()
    peak = peak_tflops(env["device"], DTYPES[args.dtype]) if env["device"] != "cpu" else None
    summary = summarize(
        timed,
        flops_per_token=engine.flops_per_token,
        peak_tflops=peak,
        world_size=args.world_size,
        memory_bytes=memory,
        layout=_layout(args),
        num_params=engine.num_params,
    )
    if history:  # the loss columns cover the whole run, also what came from a checkpoint
        summary.update(steps=history[-1].step, first_loss=history[0].loss, final_loss=history[-1].loss)
        evaluated = [r.eval_loss for r in history if r.eval_loss is not None]
        summary.update(eval_loss=evaluated[-1] if evaluated else None)
    print_summary(summary, _caveat(engine.device))
    size = f"{engine.num_params / 1e6:.2f}M params"
    title = f"{_model_name(args.hf)} {args.preset} ({size}), {_layout(args)}, {args.dtype}"
    if history:
        plot_loss(history, args.out / "loss.png", title)
    record = {
        "argv": sys.argv[1:],
        "args": {k: _jsonable(v) for k, v in vars(args).items()},
        "environment": env,
        "model": _model_record(args, engine),
        "resumed_from": str(resumed) if resumed else None,
        "steps": [
            {
                "step": r.step,
                "loss": r.loss,
                "step_ms": r.step_s * 1e3,
                "tokens_per_s": r.tokens_per_s,
                "eval_loss": r.eval_loss,
            }
            for r in history
        ],
        "summary": summary,
        "caveat": _caveat(engine.device),
    }
    write_json(args.out / "run.json", record)
    print(f"wrote {args.out / 'run.json'} and {args.out / 'loss.png'}")


KV_SHARED = "kv_shared_layers"  # the model record's --kv-shared-layers, where it is not 0


def _model_name(hf: str | None) -> str:
    return "tessel GPT" if hf is None else f"Hugging Face {HF_FAMILIES[hf]}"


def _model_record(args, engine: Engine) -> dict:
    """The model's settings as checkpoints and run.json record them: its shape (GPTConfig), and ``hf``, the Hugging
    Face family trained instead of tessel's GPT, when there is one."""
    record = {**asdict(engine.config), **({"hf": args.hf} if args.hf else {})}  # the baseline's is the same model
    if getattr(args, "kv_shared_layers", 0):  # Gemma 4's layers that reuse keys and values (their k/v absent)
        record[KV_SHARED] = args.kv_shared_layers
    return record


def _banner(args, engine: Engine) -> str:
    return (
        f"{_model_name(args.hf)} {args.preset}: {engine.num_params / 1e6:.2f}M parameters, {_layout(args)}, "
        f"{args.dtype} on "
        f"{engine.device.type} ({dist.get_backend()}, kernels: {_kernels(engine.device)}); "
        f"{args.steps} steps of {args.batch_size}×{args.seq_len} tokens"
        + (f", fp8 GEMMs in {engine.fp8_layers} layers" if args.fp8 else "")
        + ("" if args.tokens == "bytes" else f", {args.tokens} token ids from {args.data.name}")
        + (f", vocabulary {args.vocab_size}" if args.vocab_size != 256 else "")
        + ("" if args.doc_sep is None else f", packed documents ending with {_jsonable(args.doc_sep)!r}")
        + ("" if args.doc_token is None else f", packed documents ending with token {args.doc_token}")
        + (
            f"; evaluating every {args.eval_every} steps on {args.eval_batches}×{args.batch_size} held-out sequences "
            f"(the last {args.val_fraction:.0%} of --data)"
            if args.eval_every
            else ""
        )
    )


def _cpu_threads() -> None:
    """One intra-op thread per process on a CPU unless OMP_NUM_THREADS says otherwise: the tiny preset's
    GEMMs are too small to gain from more, and with other processes on the cores, two threads per
    process made its steps ~10× slower (1.8 s instead of 0.13 s, measured on 2 busy cores)."""
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def _join_torchrun_attempt() -> None:
    """Join the default process group through a store namespace of this torchrun attempt.

    torchrun (since torch 2.5) shares its rendezvous TCPStore with the workers, and a restarted worker
    finds the previous attempt's keys there: gloo then reads a dead peer's address and fails to connect
    (pytorch/pytorch#135712; measured here: every restart failed). Prefixing the store with
    ``TORCHELASTIC_RESTART_COUNT``, which all workers of a restarted group share, gives each attempt
    fresh keys. ``init_parallel`` then finds the group initialised and builds the mesh on it.
    """
    if dist.is_initialized() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=int(os.environ.get("TESSEL_PG_TIMEOUT", "600")))
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    prefixed = dist.PrefixStore(f"tessel/attempt_{attempt}", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world_size, timeout=timeout)


def run(args) -> None:
    """Train as ``args`` says; on return every rank has passed a barrier and left the process group."""
    earlier = latest_checkpoint(args.out / "checkpoints")
    if args.save_every and not args.resume and earlier is not None:
        raise RunError(
            f"{args.out} already holds checkpoints (latest: {earlier.name}) that a later --resume would mix with "
            "this run's: pass --resume to continue from them, or choose another --out"
        )
    _cpu_threads()
    _join_torchrun_attempt()
    dims = init_parallel(args.tp, args.pp, args.dp, cp=args.cp, ep=args.ep)
    engine = build_engine(args, dims)
    args.out.mkdir(parents=True, exist_ok=True)
    start, history, resumed = _resume(args, engine) if args.resume else (0, [], None)
    if engine.rank == 0:
        print(_banner(args, engine), flush=True)
        if resumed:
            print(f"resumed from {resumed} (step {start})", flush=True)
        elif args.resume:
            print(f"no checkpoint under {args.out / 'checkpoints'} yet: starting at step 0", flush=True)
    if args.save_every:
        remove_stale(args.out / "checkpoints")
    separator = args.doc_sep if args.tokens == "bytes" else args.doc_token
    data = ByteDataset(args.data, seq_len=args.seq_len, doc_sep=separator, val_fraction=args.val_fraction,
                       tokens=args.tokens)  # fmt: skip
    progress = Progress(args.steps, start, enabled=engine.rank == 0)
    profiler = StepProfiler(args.out / f"trace_rank{dims.rank}.json", start, args.steps, args.profile)
    timed: list[StepRecord] = []  # the steps this process ran (throughput), unlike history
    for step in range(start, args.steps):
        _maybe_kill(args, dims.rank, step)
        for group in engine.optimizer.param_groups:
            group["lr"] = learning_rate(args, step)
        batch = _rank_batch(args, data, dims, engine.device, step)
        profiler.before(step)
        begin = time.perf_counter()
        loss = float(engine.train_step(*batch))
        record = StepRecord(step + 1, loss, time.perf_counter() - begin, args.batch_size * args.seq_len)
        profiler.after(step)
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
            record.eval_loss = _evaluate(args, engine, data, dims)
        history.append(record)
        timed.append(record)
        progress.update(record)
        if args.save_every and (step + 1) % args.save_every == 0:
            _save(args, engine, step + 1, history)
    progress.close()
    _finish(args, engine, history, timed, resumed)
    del engine
    shutdown()
