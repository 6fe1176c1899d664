"""``python -m tessel.bench.train --experts``: tessel's GPT with a mixture of experts in every block, under
expert parallelism (``--ep``) beside data and tensor parallelism; checkpoints hold every expert's global
tensor, so a run saved with the experts split over two ranks resumes with them on one.

Every run has the same global batch and the same math; only which rank computes an expert differs, so the
loss curves agree to fp32 rounding.
"""

import json

import pytest
import torch

from tests.bench.test_train import _checkpoint, _copy_checkpoint, _losses, _ok, _tensors, _train

# 4 steps of 8×32 tokens with 4 experts (2 per token) trained with the router z-loss too, a checkpoint every 2.
MOE = ["--experts", "4", "--top-k", "2", "--steps", "4", "--seq-len", "32", "--batch-size", "8", "--save-every", "2",
       "--z-loss-coef", "0.01"]  # fmt: skip


def _check_resumes(saved, out, reference, *args, nproc=1):
    """``saved``'s step-2 checkpoint, resumed in ``out`` with ``args``, follows ``reference`` from there on."""
    _copy_checkpoint(_checkpoint(saved, 2), out)
    _ok(_train(out, *args, "--resume", nproc=nproc))
    assert _losses(out)[2:] == pytest.approx(_losses(reference)[2:], rel=1e-5)


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    """The reference: dp=2, every rank holding every expert (torch's AdamW)."""
    out = tmp_path_factory.mktemp("moe-dp2")
    _ok(_train(out, "--dp", "2", *MOE, nproc=2))
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_expert_parallel_run_trains_like_the_replicated_experts(replicated, tmp_path):
    """--ep 2: each rank holds 2 of the 4 experts and the routes travel to them; ZeRO-1 shards the experts'
    state over their own (here single-rank) data-parallel group. The loss falls and follows the reference."""
    proc = _ok(_train(tmp_path, "--dp", "2", "--ep", "2", "--zero", "1", *MOE, nproc=2))
    assert "experts=4 top-k=2 ep=2" in proc.stdout
    losses = _losses(tmp_path)
    assert losses[-1] < losses[0]
    assert losses == pytest.approx(_losses(replicated), rel=1e-5)
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["args"]["ep"] == 2 and run["args"]["experts"] == 4


@pytest.mark.slow
@pytest.mark.multiprocess
def test_expert_parallel_checkpoint_holds_every_expert_and_resumes_in_a_world_of_one(replicated, tmp_path):
    """Saved with the experts split over 2 ep ranks (torch's AdamW; each rank writes its own experts): the same
    global tensors as the replicated run's checkpoint, values equal to fp32 rounding; continued in one process,
    every expert on it, the run ends as the reference does."""
    saved, resumed = tmp_path / "ep2", tmp_path / "one"
    _ok(_train(saved, "--dp", "2", "--ep", "2", *MOE, nproc=2))
    ours, theirs = _tensors(_checkpoint(saved, 2)), _tensors(_checkpoint(replicated, 2))
    assert ours.keys() == theirs.keys()
    expert_keys = [k for k in ours if k.endswith((".mlp.fc", ".mlp.proj"))]
    assert expert_keys and all(ours[k].shape[0] == 4 for k in expert_keys)  # [experts, ...] whole
    for key in ours:  # Adam's update of an element whose gradient nearly cancels magnifies rounding: 1e-4 of the max
        if ours[key].is_floating_point():
            assert ours[key].double().sub(theirs[key].double()).abs().max() <= 1e-4 * theirs[key].abs().max(), key
    _check_resumes(saved, resumed, replicated, *MOE)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_experts_split_by_features_and_by_ranks_on_four_ranks(replicated, tmp_path):
    """tp=2 (each expert's hidden features split, sequence parallelism) × dp=2 with ep=2, ZeRO-2; resumed
    from its step-2 checkpoint at dp=2 with every expert on every rank."""
    split, resumed = tmp_path / "tp2-ep2", tmp_path / "dp2"
    layout = ["--tp", "2", "--sequence-parallel", "--dp", "2", "--ep", "2", "--zero", "2"]
    _ok(_train(split, *layout, *MOE, nproc=4))
    assert _losses(split) == pytest.approx(_losses(replicated), rel=1e-5)
    _check_resumes(split, resumed, replicated, "--dp", "2", *MOE, nproc=2)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pipelined_experts_train_their_load_balancing_loss(replicated, tmp_path):
    """Two pipeline stages: the first stage's load-balancing losses reach the backward through its output
    (GPTStage.aux_grad). With one microbatch the run is the one-process run; with two (1F1B) each microbatch is
    one data-parallel rank's half of the reference's batch, so the curve is the dp=2 reference's."""
    one, gpipe, one_f_one_b = tmp_path / "one", tmp_path / "pp2-gpipe", tmp_path / "pp2-1f1b"
    _ok(_train(one, *MOE))
    _ok(_train(gpipe, "--pp", "2", "--schedule", "gpipe", "--microbatches", "1", *MOE, nproc=2))
    assert _losses(gpipe) == pytest.approx(_losses(one), rel=1e-5)
    _ok(_train(one_f_one_b, "--pp", "2", "--microbatches", "2", *MOE, nproc=2))
    assert _losses(one_f_one_b) == pytest.approx(_losses(replicated), rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_resuming_checks_the_experts_but_not_their_loss_weight(replicated, tmp_path):
    """The experts are part of the model: a dense run refuses the checkpoint with one line. The weights of the
    load-balancing loss and of the z-loss are training settings: a run may resume with others. A checkpoint
    written before the expert settings existed (no n_expert in its manifest) is a dense model's and still loads
    into a dense run."""
    model = json.loads((_checkpoint(replicated, 2) / "manifest.json").read_text())["model"]
    assert (model["n_expert"], model["aux_loss_coef"], model["z_loss_coef"]) == (4, 0.01, 0.01)
    _copy_checkpoint(_checkpoint(replicated, 2), tmp_path / "dense")
    proc = _train(tmp_path / "dense", "--dp", "2", *MOE[2:-2], "--resume", nproc=2)
    assert proc.returncode != 0 and "holds a different model: n_expert=4 (this run: 0)" in proc.stderr
    _copy_checkpoint(_checkpoint(replicated, 2), tmp_path / "coef")
    _ok(_train(tmp_path / "coef", "--dp", "2", *MOE, "--aux-loss-coef", "0.1", "--z-loss-coef", "0.2", "--resume",
               nproc=2))  # fmt: skip
    assert _losses(tmp_path / "coef")[:2] == _losses(replicated)[:2]
    assert _losses(tmp_path / "coef")[3] != pytest.approx(_losses(replicated)[3], rel=1e-6)

    old = tmp_path / "old"
    _ok(_train(old, *MOE[2:-2]))  # dense, one process
    manifest = _checkpoint(old, 4) / "manifest.json"  # the latest, which --resume reads
    record = json.loads(manifest.read_text())
    for key in ("n_expert", "top_k", "aux_loss_coef", "z_loss_coef"):
        del record["model"][key]
    manifest.write_text(json.dumps(record))
    proc = _ok(_train(old, *MOE[2:-2], "--steps", "5", "--resume"))
    assert "(step 4)" in proc.stdout and len(_losses(old)) == 5


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fully_sharded_experts_train_like_the_replicated_ones(replicated, tmp_path):
    """--zero 3 (FSDP units: the blocks) with every expert on every rank, and with the experts split over ep=2 of
    4 data-parallel ranks: each block's dense weights sharded over the 4 ranks, its experts over the 2 holding
    them. The split run follows dp=4 with every expert on every rank (not the dp=2 reference: the load-balancing
    loss is each rank's, so the data-parallel size changes it, by ~1e-4 here); its step-2 checkpoint resumes
    there."""
    everywhere, dp4, split, resumed = (tmp_path / d for d in ("dp2", "dp4", "dp4-ep2", "resumed"))
    _ok(_train(everywhere, "--dp", "2", "--zero", "3", *MOE, nproc=2))
    assert _losses(everywhere) == pytest.approx(_losses(replicated), rel=1e-5)
    _ok(_train(dp4, "--dp", "4", *MOE, nproc=4))
    proc = _ok(_train(split, "--dp", "4", "--ep", "2", "--zero", "3", *MOE, nproc=4))
    assert "zero=3 experts=4 top-k=2 ep=2" in proc.stdout
    assert _losses(split) == pytest.approx(_losses(dp4), rel=1e-5)
    _check_resumes(split, resumed, dp4, "--dp", "4", *MOE, nproc=4)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fully_sharded_experts_under_pipeline_stages(tmp_path):
    """pp=2 × dp=2 with ep=2: each rank's stage is one FSDP (its blocks' experts sharded over the expert-dp group
    of one rank, the rest over dp) and trains as the same layout under ZeRO-1 does."""
    layout = ["--pp", "2", "--dp", "2", "--ep", "2", "--microbatches", "2"]
    zero1, zero3 = tmp_path / "zero1", tmp_path / "zero3"
    _ok(_train(zero1, *layout, "--zero", "1", *MOE, nproc=4))
    proc = _ok(_train(zero3, *layout, "--zero", "3", *MOE, nproc=4))
    assert "pp=2" in proc.stdout and "zero=3" in proc.stdout
    assert _losses(zero3) == pytest.approx(_losses(zero1), rel=1e-5)
    assert _losses(zero3)[-1] < _losses(zero3)[0]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_experts_over_data_parallel_ranks_beside_context_parallelism(replicated, tmp_path):
    """cp=2 × dp=2 with ep=2: each sequence split over two ranks (ring attention, the load-balancing loss summed
    over both halves), the experts over the two data-parallel ranks of each cp index."""
    proc = _ok(_train(tmp_path, "--cp", "2", "--dp", "2", "--ep", "2", "--zero", "1", *MOE, nproc=4))
    assert "cp=2 zero=1 experts=4 top-k=2 ep=2" in proc.stdout
    assert _losses(tmp_path) == pytest.approx(_losses(replicated), rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_group_limited_routing_over_expert_parallel_ranks(replicated, tmp_path):
    """--expert-groups 2 --top-groups 1 with --ep 2: the groups are the ranks' experts, so each token's two routes
    go to one rank. The run follows the same routing with every expert on both ranks, and not the unlimited one."""
    grouped = [*MOE, "--expert-groups", "2", "--top-groups", "1"]
    everywhere, split = tmp_path / "dp2", tmp_path / "dp2-ep2"
    _ok(_train(everywhere, "--dp", "2", *grouped, nproc=2))
    proc = _ok(_train(split, "--dp", "2", "--ep", "2", "--zero", "1", *grouped, nproc=2))
    assert "experts=4 top-k=2 ep=2 groups=2 top-groups=1" in proc.stdout
    assert _losses(split) == pytest.approx(_losses(everywhere), rel=1e-5)
    assert _losses(everywhere) != pytest.approx(_losses(replicated), rel=1e-4)  # the same model, routed otherwise
    run = json.loads((split / "run.json").read_text())
    assert (run["args"]["expert_groups"], run["args"]["top_groups"]) == (2, 1)


# DeepSeek-V3's recipe: sigmoid scores and auxiliary-loss-free balancing only, at a rate that changes routes within
# a step of this young model (whose scores differ by ~1e-2; 0.05 would send every route to the raised experts
# and back, step after step).
BIASED = [*MOE, "--router-score", "sigmoid", "--expert-bias-rate", "0.01", "--aux-loss-coef", "0"]


def _biases(out, step):
    return {k: v for k, v in _tensors(_checkpoint(out, step)).items() if k.endswith(".expert_bias")}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_expert_biases_move_alike_under_every_layout_and_resume_exactly(replicated, tmp_path):
    """--expert-bias-rate: every layout counts the global batch's routes, so the biases (checkpointed as whole
    fp32 tensors) and the losses are the dp=2 reference's: ep=2 under ZeRO-1, two pipeline stages of two
    microbatches, recomputed blocks (whose routes are counted twice, which changes no sign). Resumed from step
    2, the run is the uninterrupted one bit for bit (the routes of steps 3 and 4 depend on the saved biases);
    the rate may change on resume, the biases' presence may not."""
    ref = tmp_path / "dp2"
    _ok(_train(ref, "--dp", "2", *BIASED, nproc=2))
    want = _biases(ref, 4)
    assert sorted(want) == [f"model.blocks.{i}.mlp.expert_bias" for i in range(4)]  # the tiny preset's 4 blocks
    assert all(b.dtype == torch.float32 and b.abs().sum() > 0 for b in want.values())
    assert any(b.abs().sum() > 0 for b in _biases(ref, 2).values())  # what the resumed run must start from
    assert json.loads((_checkpoint(ref, 4) / "manifest.json").read_text())["model"]["router_score"] == "sigmoid"
    layouts = {"ep2": ["--dp", "2", "--ep", "2", "--zero", "1"], "pp2": ["--pp", "2", "--microbatches", "2"],
               "recompute": ["--dp", "2", "--zero", "3", "--recompute"]}  # fmt: skip
    for name, layout in layouts.items():
        _ok(_train(tmp_path / name, *layout, *BIASED, nproc=2))
        assert _losses(tmp_path / name) == pytest.approx(_losses(ref), rel=1e-5), name
        got = _biases(tmp_path / name, 4)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), name

    _copy_checkpoint(_checkpoint(ref, 2), tmp_path / "resumed")
    _ok(_train(tmp_path / "resumed", "--dp", "2", *BIASED, "--resume", nproc=2))
    assert _losses(tmp_path / "resumed") == _losses(ref)
    assert all(torch.equal(b, want[k]) for k, b in _biases(tmp_path / "resumed", 4).items())
    _copy_checkpoint(_checkpoint(ref, 2), tmp_path / "rate")
    _ok(_train(tmp_path / "rate", "--dp", "2", *BIASED, "--expert-bias-rate", "0.002", "--resume", nproc=2))
    _copy_checkpoint(_checkpoint(ref, 2), tmp_path / "unbiased")
    proc = _train(tmp_path / "unbiased", "--dp", "2", *MOE, "--router-score", "sigmoid", "--resume", nproc=2)
    assert proc.returncode != 0 and "holds a different model: expert_bias_rate=0.01 (this run: 0.0)" in proc.stderr
