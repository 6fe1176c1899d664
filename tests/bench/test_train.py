"""``python -m tessel.bench.train`` end to end: the default run learns, resuming is exact, a checkpoint loads
under another layout, a damaged checkpoint is refused, and a killed rank's restart ends where an
uninterrupted run ends.

The runs use tessel's plain-PyTorch kernel references (``TRITON_INTERPRET=0``): in Triton's interpreter one
step of the tiny preset takes ~5 s even at 2×16 tokens (bench/train.py measures why), so only
``test_interpreter_step_matches_reference`` runs the Triton kernels, for two steps.

The default run and the killed-rank restart start the command as a user would (``python -m`` and ``torchrun
--max-restarts``, ``python -m torch.distributed.run``, on gloo). Every other run calls the command's
``main(argv)`` on ranks forked by ``tests.multiprocess`` (the torchrun environment, one process per rank, its
stdout and stderr captured), which saves each rank the seconds a fresh interpreter spends importing torch,
``torch.distributed.checkpoint`` and matplotlib.
"""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from tessel.bench.checkpoint import checkpoint_keys, load_checkpoint
from tests.multiprocess import run_ranks

# Hidden GPUs make every run take its CPU defaults (gloo, tiny preset, fp32) on any machine.
CPU_ENV = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
PREFIX = "python -m tessel.bench.train: error: "
# dp=2 with ZeRO-2 (ZeroAdam's sharded moments and masters), 4 steps of 8×32 tokens, a checkpoint every 2.
RUN = ["--dp", "2", "--zero", "2", "--steps", "4", "--seq-len", "32", "--save-every", "2"]


@dataclass
class Run:
    """What a run left: its exit status and its output (every rank's, in rank order)."""

    returncode: int
    stdout: str
    stderr: str


def _train_rank(rank, world_size, argv):
    from tessel.bench.train import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return status, out.getvalue(), err.getvalue()


def _train(out, *args, nproc: int = 1, restarts: int | None = None, env=None, timeout: float = 240, command=False):
    """Run the main job on ``nproc`` ranks: forked ranks calling ``main(argv)``, or with ``command=True`` or
    ``restarts`` the command itself (``torchrun`` when ``nproc > 1`` or ``restarts``)."""
    argv = ["--out", str(out), *args]
    if command or restarts is not None:
        module = ["-m", "tessel.bench.train", *argv]
        if nproc == 1 and restarts is None:
            cmd = [sys.executable, *module]
        else:
            launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
            if restarts is not None:
                launcher.append(f"--max-restarts={restarts}")
            cmd = [sys.executable, *launcher, *module]
        proc = subprocess.run(cmd, env={**CPU_ENV, **(env or {})}, capture_output=True, text=True, timeout=timeout)
        return Run(proc.returncode, proc.stdout, proc.stderr)
    ranks = run_ranks(_train_rank, nproc, argv, timeout=timeout, init_process_group=False, env=_rank_env(env))
    status = next((s for s, _, _ in ranks if s != 0), 0)
    return Run(status, "".join(o for _, o, _ in ranks), "".join(e for _, _, e in ranks))


def _rank_env(env) -> dict[str, str]:
    """The variables of ``CPU_ENV`` that differ from this process's, with ``env`` over them."""
    changed = {k: v for k, v in CPU_ENV.items() if os.environ.get(k) != v}
    return {**changed, **(env or {})}


def _ok(proc):
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _losses(out):
    return [s["loss"] for s in json.loads((out / "run.json").read_text())["steps"]]


def _checkpoint(out, step):
    return out / "checkpoints" / f"step_{step:08d}"


def _tensors(path):
    """Every tensor of a checkpoint, read in this process (a world of one)."""
    state = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in checkpoint_keys(path).items()}
    load_checkpoint(path, state)
    return state


def _copy_checkpoint(src, out):
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(src, out / "checkpoints" / src.name)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference run: 2 ranks, 4 steps, checkpoints after steps 2 and 4."""
    out = tmp_path_factory.mktemp("uninterrupted")
    _ok(_train(out, *RUN, nproc=2))
    return out


@pytest.mark.slow
def test_default_run_learns_and_writes_its_report(tmp_path):
    proc = _ok(_train(tmp_path, "--steps", "40", "--profile", command=True))
    losses = _losses(tmp_path)
    assert len(losses) == 40 and losses[0] > 5.0  # ln 256 = 5.55 at initialisation
    assert sum(losses[-10:]) / 10 < losses[0] - 1.5  # measured: ~2.9 after 40 steps
    assert "tessel GPT tiny" in proc.stdout and "final_loss" in proc.stdout and "not performance numbers" in proc.stdout
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["summary"]["layout"] == "dp=1 pp=1 tp=1 zero=0" and record["summary"]["tokens_per_s"] > 0
    assert record["summary"]["mfu"] is None  # no GPU, no peak to compare with
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert "traceEvents" in json.loads((tmp_path / "trace_rank0.json").read_text())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_resume_reproduces_the_uninterrupted_run_exactly(uninterrupted, tmp_path):
    _copy_checkpoint(_checkpoint(uninterrupted, 2), tmp_path)
    proc = _ok(_train(tmp_path, *RUN, "--resume", nproc=2))
    assert "resumed from" in proc.stdout and "(step 2)" in proc.stdout
    assert _losses(tmp_path) == _losses(uninterrupted)  # bit for bit, steps 3 and 4 recomputed
    resumed, reference = _tensors(_checkpoint(tmp_path, 4)), _tensors(_checkpoint(uninterrupted, 4))
    assert resumed.keys() == reference.keys()
    assert any(k.startswith("optim.") and k.endswith("exp_avg_sq") for k in reference)
    for key in reference:  # weights, moments, step, generators
        assert torch.equal(resumed[key], reference[key]), key


@pytest.mark.slow
@pytest.mark.multiprocess
def test_resume_may_switch_the_attention_backward(uninterrupted, tmp_path):
    """How dQ is summed is not part of the model: the run continues, to fp32 rounding of the same math."""
    _copy_checkpoint(_checkpoint(uninterrupted, 2), tmp_path)
    _ok(_train(tmp_path, *RUN, "--resume", "--attention-backward", "atomic", nproc=2))
    assert _losses(tmp_path) == pytest.approx(_losses(uninterrupted), rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_resume_may_turn_on_recompute(uninterrupted, tmp_path):
    """Activation checkpointing is not part of the model either, and changes no bit of the run."""
    _copy_checkpoint(_checkpoint(uninterrupted, 2), tmp_path)
    proc = _ok(_train(tmp_path, *RUN, "--resume", "--recompute", nproc=2))
    assert "zero=2 recompute" in proc.stdout
    assert _losses(tmp_path) == _losses(uninterrupted)
    resumed, reference = _tensors(_checkpoint(tmp_path, 4)), _tensors(_checkpoint(uninterrupted, 4))
    for key in reference:
        assert torch.equal(resumed[key], reference[key]), key


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [["--pp", "2", "--schedule", "zb"], ["--zero", "3"]], ids=["pp2-zb", "fsdp"])
def test_recompute_trains_exactly_like_the_plain_run(tmp_path, layout):
    """Under the zero-bubble schedule the recomputation runs in each microbatch's input-gradient pass and
    the weight gradients it defers still come out right; under FSDP the recomputed block gathers its
    parameters again. Either way the losses are the plain run's, bit for bit."""
    small = [*layout, "--steps", "3", "--seq-len", "32"]
    _ok(_train(tmp_path / "plain", *small, nproc=2))
    _ok(_train(tmp_path / "recompute", *small, "--recompute", nproc=2))
    assert _losses(tmp_path / "recompute") == _losses(tmp_path / "plain")
    record = json.loads((tmp_path / "recompute" / "run.json").read_text())
    assert record["model"]["recompute"] is True and record["summary"]["layout"].endswith("recompute")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sliding_window_run_trains_with_local_attention(tmp_path):
    """--sliding-window reaches every attention layer: the run records it, and its losses (from the first
    step on) are not those of full causal attention over the same data and weights. Under --cp 2 (the ring
    runs the window) the losses are the one-process run's."""
    small = ["--steps", "2", "--seq-len", "32"]
    _ok(_train(tmp_path / "plain", *small))
    _ok(_train(tmp_path / "window", *small, "--sliding-window", "4"))
    record = json.loads((tmp_path / "window" / "run.json").read_text())
    assert record["model"]["sliding_window"] == 4
    windowed, plain = _losses(tmp_path / "window"), _losses(tmp_path / "plain")
    assert len(windowed) == 2 and windowed[0] != plain[0]
    _ok(_train(tmp_path / "cp2", *small, "--sliding-window", "4", "--cp", "2", nproc=2))
    assert _losses(tmp_path / "cp2") == pytest.approx(windowed, rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_context_parallel_run_trains_like_data_parallel_and_its_checkpoint_loads_at_dp2(uninterrupted, tmp_path):
    """--cp 2: each rank holds half of every sequence (ring attention) where the reference's ranks hold half
    of the batch: the same tokens, the same math, gradients averaged over the same two ranks."""
    cp, resumed = tmp_path / "cp2", tmp_path / "dp2"
    proc = _ok(_train(cp, "--cp", "2", *RUN[2:], nproc=2))
    assert "dp=1 pp=1 tp=1 cp=2 zero=2" in proc.stdout
    assert json.loads((cp / "run.json").read_text())["args"]["cp"] == 2
    # fp32; the attention of each sequence is merged from two halves: agreement to fp32 rounding
    assert _losses(cp) == pytest.approx(_losses(uninterrupted), rel=1e-5)
    _copy_checkpoint(_checkpoint(cp, 2), resumed)
    _ok(_train(resumed, *RUN, "--resume", nproc=2))
    assert _losses(resumed)[2:] == pytest.approx(_losses(uninterrupted)[2:], rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout",
    [["--tp", "2", "--sequence-parallel", "--zero", "1"], ["--pp", "2", "--schedule", "1f1b", "--zero", "3"]],
    ids=["cp2-tp2-sp", "cp2-pp2-fsdp"],
)
def test_context_parallel_composes_with_tensor_and_pipeline_parallelism(uninterrupted, tmp_path, layout):
    """Four ranks: cp=2 with tp=2 and sequence parallelism (each TP group gathers its CP share), and cp=2 with
    two pipeline stages under FSDP over the dp × cp group; the loss curve is the reference's."""
    _ok(_train(tmp_path, "--cp", "2", *layout, "--steps", "4", "--seq-len", "32", nproc=4))
    assert _losses(tmp_path) == pytest.approx(_losses(uninterrupted), rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_packed_documents_train_alike_under_every_layout(tmp_path):
    """--doc-sep: the text's paragraphs (ending with a blank line) are documents. One process, tp=2 with
    sequence parallelism, dp=2 under FSDP, cp=2 and pp=2 give the same loss curve (the data-parallel ranks count
    different numbers of ignored targets, and weigh their means by their share of the rest, ~1e-4 apart
    without); without the documents the same batches give another curve."""
    docs = ["--doc-sep", "\\n\\n", "--steps", "3", "--seq-len", "64", "--batch-size", "4"]
    proc = _ok(_train(tmp_path / "one", *docs))
    assert "packed documents ending with '\\n\\n'" in proc.stdout
    assert json.loads((tmp_path / "one" / "run.json").read_text())["args"]["doc_sep"] == "\n\n"
    _ok(_train(tmp_path / "tp2", *docs, "--tp", "2", "--sequence-parallel", nproc=2))
    _ok(_train(tmp_path / "dp2", *docs, "--dp", "2", "--zero", "3", nproc=2))
    _ok(_train(tmp_path / "stream", *docs[2:]))
    assert _losses(tmp_path / "tp2") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)
    assert _losses(tmp_path / "dp2") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)
    # context parallelism (ring attention within documents) and pipeline stages (the ids travel with the
    # activations; each microbatch's mean weighed by its share of the counted targets)
    _ok(_train(tmp_path / "cp2", *docs, "--cp", "2", nproc=2))
    _ok(_train(tmp_path / "pp2", *docs, "--pp", "2", "--microbatches", "2", "--zero", "1", nproc=2))
    assert _losses(tmp_path / "cp2") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)
    assert _losses(tmp_path / "pp2") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)
    # a young model's loss hardly depends on what it attends to: ~7e-4 apart after two updates, 70x the tolerance
    assert _losses(tmp_path / "stream")[-1] != pytest.approx(_losses(tmp_path / "one")[-1], rel=1e-4)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_label_smoothing_and_logit_z_loss_train_alike_with_tensor_and_pipeline_parallelism(tmp_path):
    """--label-smoothing and --logit-z-loss reach the loss of every layout (the head's fused loss in one process
    and at tp=2 with sequence parallelism, the last pipeline stage's at pp=2: the same curve), are recorded in
    the checkpoint's model settings, and change the loss."""
    base = ["--steps", "2", "--seq-len", "32", "--batch-size", "4", "--save-every", "2"]
    options = ["--label-smoothing", "0.1", "--logit-z-loss", "1e-3"]
    _ok(_train(tmp_path / "one", *base, *options))
    _ok(_train(tmp_path / "tp2", *base, *options, "--tp", "2", "--sequence-parallel", nproc=2))
    _ok(_train(tmp_path / "pp2", *base, *options, "--pp", "2", "--microbatches", "2", nproc=2))
    _ok(_train(tmp_path / "plain", *base))
    assert _losses(tmp_path / "tp2") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)
    assert _losses(tmp_path / "pp2") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)
    assert _losses(tmp_path / "plain")[0] != pytest.approx(_losses(tmp_path / "one")[0], rel=1e-3)
    model = json.loads((_checkpoint(tmp_path / "one", 2) / "manifest.json").read_text())["model"]
    assert (model["label_smoothing"], model["logit_z_loss"]) == (0.1, 1e-3)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_checkpoint_saved_at_tp2_loads_in_a_world_of_one(uninterrupted, tmp_path):
    saved, resumed = tmp_path / "tp2", tmp_path / "dense"
    _ok(_train(saved, "--tp", "2", "--zero", "1", *RUN[4:], nproc=2, timeout=240))
    keys_tp2 = checkpoint_keys(_checkpoint(saved, 2))
    keys_dp2 = checkpoint_keys(_checkpoint(uninterrupted, 2))
    assert keys_tp2 == keys_dp2  # global tensors: the same names and shapes whatever the layout
    _copy_checkpoint(_checkpoint(saved, 2), resumed)
    # Saved by ZeroAdam over tp=2, continued by torch's AdamW in one process.
    _ok(_train(resumed, *RUN[4:], "--resume"))
    # The reference ran at dp=2: the same global batch and the same math, with gradients summed in a
    # different order (a dp all-reduce instead of tp partial sums), so agreement is to fp32 rounding.
    assert _losses(resumed)[2:] == pytest.approx(_losses(uninterrupted)[2:], rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pipelined_fsdp_checkpoint_loads_as_tensor_parallel_pieces(uninterrupted, tmp_path):
    """Saved by FSDP+ZeroAdam (ZeRO-3) over 2 pipeline stages, each rank writing only its stages' shards;
    continued at tp=2 by torch's AdamW, each rank reading only its TP shards' blocks."""
    saved, resumed = tmp_path / "pp2-zero3", tmp_path / "tp2"
    _ok(_train(saved, "--pp", "2", "--zero", "3", *RUN[4:], nproc=2, timeout=240))
    ckpt = _checkpoint(saved, 2)
    assert checkpoint_keys(ckpt) == checkpoint_keys(_checkpoint(uninterrupted, 2))
    assert len(list(ckpt.glob("*.distcp"))) == 2
    # pipelining splits the batch into microbatches: the same math, summed in another order
    assert _losses(saved) == pytest.approx(_losses(uninterrupted), rel=1e-5)
    _copy_checkpoint(ckpt, resumed)
    _ok(_train(resumed, "--tp", "2", *RUN[4:], "--resume", nproc=2, timeout=240))
    assert _losses(resumed)[2:] == pytest.approx(_losses(uninterrupted)[2:], rel=1e-5)


@pytest.mark.parametrize("damage", ["truncated", "corrupted"])
@pytest.mark.slow
@pytest.mark.multiprocess
def test_damaged_checkpoint_is_refused_with_one_line(uninterrupted, tmp_path, damage):
    _copy_checkpoint(_checkpoint(uninterrupted, 4), tmp_path)
    data = tmp_path / "checkpoints" / "step_00000004" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    if damage == "truncated":
        del raw[-100:]
    else:
        raw[len(raw) // 3] ^= 0x01
    data.write_bytes(bytes(raw))
    proc = _train(tmp_path, *RUN[4:], "--resume", "--steps", "5")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr and lines[-1].startswith(PREFIX), proc.stderr
    assert f"is {damage}" in lines[-1] and "__0_0.distcp" in lines[-1]
    assert not (tmp_path / "run.json").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fresh_run_refuses_an_out_dir_with_checkpoints(uninterrupted):
    before = sorted(p.name for p in (uninterrupted / "checkpoints").iterdir())
    proc = _train(uninterrupted, *RUN[4:])  # saves checkpoints, but no --resume
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"{PREFIX}{uninterrupted} already holds checkpoints (latest: step_00000004) that a later --resume would mix "
        "with this run's: pass --resume to continue from them, or choose another --out"
    ]
    assert sorted(p.name for p in (uninterrupted / "checkpoints").iterdir()) == before


@pytest.mark.slow
@pytest.mark.multiprocess
def test_killed_rank_restarts_from_its_checkpoint_and_ends_like_the_uninterrupted_run(uninterrupted, tmp_path):
    # Rank 1 dies (SIGKILL) as step 3 begins; torchrun restarts both ranks, which resume from step 2.
    kill = ["--resume", "--kill-rank", "1", "--kill-at-step", "3"]
    proc = _ok(_train(tmp_path, *RUN, *kill, nproc=2, restarts=1, timeout=300))
    assert "rank 1: killed at step 3" in proc.stderr
    assert "resumed from" in proc.stdout and "(step 2)" in proc.stdout
    assert _losses(tmp_path) == _losses(uninterrupted)  # the final loss included, bit for bit
    restarted, reference = _tensors(_checkpoint(tmp_path, 4)), _tensors(_checkpoint(uninterrupted, 4))
    for key in reference:
        assert torch.equal(restarted[key], reference[key]), key


@pytest.mark.slow
def test_interpreter_step_matches_reference(tmp_path):
    """Two steps with tessel's Triton kernels (through the interpreter), with either attention backward,
    against the PyTorch references: the second loss shows the first update."""
    small = ["--steps", "2", "--seq-len", "16", "--batch-size", "2"]
    interp = _ok(_train(tmp_path / "interp", *small, env={"TRITON_INTERPRET": "1"}))
    atomic = _ok(_train(tmp_path / "atomic", *small, "--attention-backward", "atomic", env={"TRITON_INTERPRET": "1"}))
    _ok(_train(tmp_path / "ref", *small))
    assert "kernels: Triton's interpreter" in interp.stdout and "attention-backward=atomic" in atomic.stdout
    record = json.loads((tmp_path / "atomic" / "run.json").read_text())
    assert record["args"]["attention_backward"] == "atomic" and record["model"]["deterministic_attention"] is False
    # fp32 throughout; the kernels and references differ only in summation order.
    reference = _losses(tmp_path / "ref")
    assert len(reference) == 2
    assert _losses(tmp_path / "interp") == pytest.approx(reference, rel=1e-5)
    assert _losses(tmp_path / "atomic") == pytest.approx(reference, rel=1e-5)
