"""``python -m tessel.bench.train --eval-every K``: the loss of fixed held-out batches, forward only.

The held-out text is the file's last ``--val-fraction``; its batches are a function of the seed alone, so
every layout evaluates the same tokens with the same weights and reports the same loss (fp32 rounding
apart), and evaluating changes nothing in training.
"""

import json

import pytest
import torch

from tests.bench.test_train import _checkpoint, _copy_checkpoint, _losses, _ok, _tensors, _train
from tests.multiprocess import REFERENCE_KERNELS, run_ranks

BASE = ["--steps", "2", "--seq-len", "32", "--batch-size", "8", "--eval-every", "2", "--eval-batches", "2"]
DOCS = ["--doc-sep", "\\n\\n"]


def _eval_losses(out):
    return [s["eval_loss"] for s in json.loads((out / "run.json").read_text())["steps"]]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_held_out_loss_is_the_same_under_every_layout(tmp_path):
    """One process; tp=2 with sequence parallelism; dp=2 under FSDP; cp=2; pp=2 under 1F1B and the interleaved
    schedule (Schedule.eval: the forwards alone): one held-out loss, reported after step 2 only, in the summary and
    on the progress bar."""
    proc = _ok(_train(tmp_path / "one", *BASE))
    one = _eval_losses(tmp_path / "one")
    assert one[0] is None and one[1] > 0
    assert "evaluating every 2 steps" in proc.stdout and f"eval={one[1]:.4f}" in proc.stderr
    assert json.loads((tmp_path / "one" / "run.json").read_text())["summary"]["eval_loss"] == one[1]
    layouts = {
        "tp2": ["--tp", "2", "--sequence-parallel"],
        "fsdp": ["--dp", "2", "--zero", "3"],
        "cp2": ["--cp", "2"],
        "pp2": ["--pp", "2", "--microbatches", "2"],
        "interleaved": ["--pp", "2", "--schedule", "interleaved", "--microbatches", "2", "--zero", "1"],
    }
    for name, layout in layouts.items():
        _ok(_train(tmp_path / name, *BASE, *layout, nproc=2))
        assert _eval_losses(tmp_path / name) == pytest.approx(one, rel=1e-5), name


@pytest.mark.slow
@pytest.mark.multiprocess
def test_held_out_documents_weigh_their_counted_targets_alike_under_every_layout(tmp_path):
    """Packed documents: each rank (and each pipeline microbatch) counts different numbers of held-out targets."""
    _ok(_train(tmp_path / "one", *BASE, *DOCS))
    for name, layout in {"dp2": ["--dp", "2"], "pp2": ["--pp", "2", "--microbatches", "2"]}.items():
        _ok(_train(tmp_path / name, *BASE, *DOCS, *layout, nproc=2))
        assert _eval_losses(tmp_path / name) == pytest.approx(_eval_losses(tmp_path / "one"), rel=1e-5), name


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout",
    [[], ["--dp=2", "--zero=3"], ["--pp=2", "--microbatches=2"], ["--experts=4", "--expert-bias-rate=.01"]],
    ids=["one", "fsdp", "pp2", "expert-biases"],
)
def test_evaluating_changes_nothing_in_training(tmp_path, layout):
    """Evaluating after every step (FSDP's gathers, a pipeline's forward-only program, experts whose routes move
    their biases: none counted while evaluating) leaves the training curve bit for bit as evaluating at the end."""
    nproc = 2 if layout[:1] in (["--dp=2"], ["--pp=2"]) else 1
    run = ["--steps", "3", "--seq-len", "32", "--batch-size", "8", "--eval-batches", "1", *layout]
    _ok(_train(tmp_path / "every", *run, "--eval-every", "1", nproc=nproc))
    _ok(_train(tmp_path / "end", *run, "--eval-every", "3", nproc=nproc))
    assert _losses(tmp_path / "every") == _losses(tmp_path / "end")
    assert _eval_losses(tmp_path / "every")[-1] == _eval_losses(tmp_path / "end")[-1]
    assert None not in _eval_losses(tmp_path / "every")


def _reference_eval(rank, world_size, checkpoint, batches):
    """The held-out loss of ``checkpoint``'s weights, computed here with tessel's GPT in one process."""
    from tessel.bench.dataset import DEFAULT_DATASET, ByteDataset
    from tessel.layers import GPT, GPTConfig

    manifest = json.loads((checkpoint / "manifest.json").read_text())
    gpt = GPT(GPTConfig(**manifest["model"]))
    weights = {k.removeprefix("model."): v for k, v in _tensors(checkpoint).items() if k.startswith("model.")}
    missing, unexpected = gpt.load_state_dict(weights, strict=False)
    assert not unexpected and not [n for n, _ in gpt.named_parameters() if n in missing]
    data = ByteDataset(DEFAULT_DATASET, seq_len=32, val_fraction=0.1)
    with torch.no_grad():
        losses = [float(gpt(*data.batch(j, seed=1234, batch_size=8, split="val")[:1],
                            targets=data.batch(j, seed=1234, batch_size=8, split="val")[1]))
                  for j in range(batches)]  # fmt: skip
    return sum(losses) / batches


@pytest.mark.slow
@pytest.mark.multiprocess
def test_held_out_loss_is_the_models_loss_on_the_last_tenth_of_the_text(tmp_path):
    """The loss reported after step 2 is the mean cross entropy of the checkpointed weights on the held-out
    batches, recomputed from the checkpoint; a resumed run carries the evaluations of its checkpoint's history."""
    _ok(_train(tmp_path / "run", *BASE, "--steps", "4", "--save-every", "2", "--dp", "2", "--zero", "2", nproc=2))
    reported = _eval_losses(tmp_path / "run")
    assert reported[0] is None and reported[2] is None and None not in (reported[1], reported[3])
    (expected,) = run_ranks(_reference_eval, 1, _checkpoint(tmp_path / "run", 2), 2, init_process_group=False,
                            env=REFERENCE_KERNELS)  # fmt: skip
    assert reported[1] == pytest.approx(expected, rel=1e-5)
    _copy_checkpoint(_checkpoint(tmp_path / "run", 2), tmp_path / "resumed")
    run = [*BASE, "--steps", "4", "--dp", "2", "--zero", "2", "--resume"]
    _ok(_train(tmp_path / "resumed", *run, nproc=2))
    assert _eval_losses(tmp_path / "resumed") == pytest.approx(reported, rel=1e-6)
