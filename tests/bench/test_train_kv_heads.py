"""``python -m tessel.bench.train --kv-heads N``: grouped-query attention of N key and value heads, split over the
tensor-parallel ranks, or replicated over more ranks than kv heads, each rank computing the one its query heads read
(tessel's GPT: :class:`~tessel.layers.attention.ParallelAttention`; a Hugging Face family's:
:mod:`tessel.layers.hf_kv_replicas`).
"""

import importlib.util

import pytest

from tests.bench.test_train import _checkpoint, _copy_checkpoint, _losses, _ok, _train

RUN = ["--steps", "3", "--seq-len", "32", "--batch-size", "8"]
needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")


def _follow_one_process(out, run, kv_heads, layouts):
    """``run`` with ``--kv-heads kv_heads`` in one process, then under each of ``layouts`` (``{name: (flags,
    processes)}``): every layout's curve that of the single process within 1e-5."""
    run = [*run, "--kv-heads", kv_heads]
    _ok(_train(out / f"one{kv_heads}", *run))
    one = _losses(out / f"one{kv_heads}")
    for name, (layout, nproc) in layouts.items():
        _ok(_train(out / f"{name}{kv_heads}", *run, *layout, nproc=nproc))
        assert _losses(out / f"{name}{kv_heads}") == pytest.approx(one, rel=1e-5), (kv_heads, name)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tessels_gpt_splits_its_kv_heads(tmp_path):
    """Two kv heads for the tiny preset's four query heads, over two tensor-parallel ranks: the single process's
    curve."""
    run = [*RUN, "--kv-heads", "2"]
    proc = _ok(_train(tmp_path / "one", *run))
    assert "tessel GPT tiny" in proc.stdout
    _ok(_train(tmp_path / "tp2", *run, "--tp", "2", "--sequence-parallel", nproc=2))
    assert _losses(tmp_path / "tp2") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tessels_gpt_replicates_kv_heads_fewer_than_the_ranks(tmp_path):
    """Two kv heads over four ranks ± sequence parallelism, and under ZeRO-1 beside two pipeline stages (the clipped
    norm from the gradient shards); one kv head over two ranks under FSDP and beside two context-parallel ranks: the
    single process's curve, and beside two stages of the zero-bubble schedule (whose deferred weight gradients must
    not stop at the summed copies). Every run clips (--grad-clip 0.05, below the norm): a copy counted twice would
    change the step."""
    run = [*RUN, "--grad-clip", "0.05"]
    _follow_one_process(
        tmp_path,
        run,
        "2",
        {
            "tp4": (["--tp", "4"], 4),
            "tp4-sp": (["--tp", "4", "--sequence-parallel"], 4),
            "tp2-pp2-zero1": (["--tp", "2", "--pp", "2", "--zero", "1", "--sequence-parallel"], 4),
        },
    )
    _follow_one_process(tmp_path, run, "1", {
        "tp2-fsdp": (["--tp", "2", "--dp", "2", "--zero", "3"], 4),
        "tp2-cp2": (["--tp", "2", "--cp", "2", "--sequence-parallel"], 4),
        "tp2-pp2-zb": (["--tp", "2", "--pp", "2", "--schedule", "zb", "--microbatches", "4"], 4)})  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tessels_replicated_kv_heads_resume_whole_and_split(tmp_path):
    """A checkpoint of one kv head replicated over two ranks (each copy's blocks written, the global head once)
    resumed in one process, and one of the single process resumed over two ranks: the uninterrupted curve."""
    run = [*RUN, "--kv-heads", "1", "--save-every", "2"]
    _ok(_train(tmp_path / "one", *run))
    _ok(_train(tmp_path / "tp2", *run, "--tp", "2", "--zero", "1", nproc=2))
    one = _losses(tmp_path / "one")
    _copy_checkpoint(_checkpoint(tmp_path / "tp2", 2), tmp_path / "whole")
    _ok(_train(tmp_path / "whole", *run, "--resume"))
    _copy_checkpoint(_checkpoint(tmp_path / "one", 2), tmp_path / "split")
    _ok(_train(tmp_path / "split", *run, "--resume", "--tp", "2", "--sequence-parallel", nproc=2))
    for name in ("tp2", "whole", "split"):
        assert _losses(tmp_path / name) == pytest.approx(one, rel=1e-5), name


@pytest.mark.slow
@pytest.mark.multiprocess
@needs_hf
def test_a_hugging_face_llama_replicates_its_kv_heads_over_more_ranks(tmp_path):
    """--hf llama with 2 kv heads over 4 tensor-parallel ranks (each kv head on the two ranks whose query heads read
    it), with and without sequence parallelism, and with one kv head over 2 ranks: Hugging Face's curve."""
    for kv_heads, tp in (("2", "4"), ("1", "2")):
        layouts = {"baseline": (["--hf-baseline"], 1), "tp-sp": (["--tp", tp, "--sequence-parallel"], int(tp)),
                   "tp": (["--tp", tp], int(tp))}  # fmt: skip
        _follow_one_process(tmp_path, ["--hf", "llama", *RUN], kv_heads, layouts)


# the other families whose kv heads replicate (every --hf family but those with a kv head per query head, latent keys
# and values, a k norm over every kv head, or Falcon's kv groups), experts where they have them
REPLICATING = {"mistral": [], "qwen2": [], "qwen3": [], "gemma": [], "gemma2": [], "gemma3": [], "gemma4": [],
               "gpt_oss": ["--experts", "4"], "mixtral": ["--experts", "4"], "qwen3_moe": ["--experts", "4"],
               "qwen3_5": [], "qwen3_5_moe": ["--experts", "4"], "bamba": [], "jamba": ["--experts", "4"]}  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiprocess
@needs_hf
@pytest.mark.parametrize("family", REPLICATING)
def test_every_family_with_kv_heads_replicates_them(tmp_path, family):
    """One kv head over two ranks under sequence parallelism (GPT-OSS's beside its sinks, Qwen3.5's beside its gated
    queries, the hybrids' beside their mixers): the single process's curve."""
    run = ["--hf", family, *RUN, "--kv-heads", "1", *REPLICATING[family]]
    run += ["--aux-loss-coef", "0"] if "--experts" in run else []
    _ok(_train(tmp_path / "one", *run))
    _ok(_train(tmp_path / "tp2-sp", *run, "--tp", "2", "--sequence-parallel", nproc=2))
    assert _losses(tmp_path / "tp2-sp") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
@needs_hf
def test_phi3_replicates_the_kv_heads_of_its_fused_projection(tmp_path):
    """--hf phi3 with 2 kv heads over 4 ranks ± sequence parallelism, and with one over 2 ranks beside 2 pipeline
    stages (1F1B and zero-bubble): each rank's qkv_proj holds its query heads and a copy of the kv head they read;
    Hugging Face's curve."""
    run = ["--hf", "phi3", *RUN]
    _follow_one_process(
        tmp_path,
        run,
        "2",
        {
            "baseline": (["--hf-baseline"], 1),
            "tp4-sp": (["--tp", "4", "--sequence-parallel"], 4),
            "tp4": (["--tp", "4", "--zero", "1"], 4),
        },
    )
    _follow_one_process(tmp_path, run, "1", {
        "tp2-pp2-sp": (["--tp", "2", "--pp", "2", "--sequence-parallel"], 4),
        "tp2-pp2-zb": (["--tp", "2", "--pp", "2", "--schedule", "zb", "--microbatches", "4"], 4)})  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiprocess
@needs_hf
def test_replicated_kv_heads_resume_whole(tmp_path):
    """A checkpoint of one kv head replicated over two ranks (each copy's blocks written, the global head once)
    resumed in one process, and one of the single process resumed over two ranks: the uninterrupted curve."""
    run = ["--hf", "llama", *RUN, "--kv-heads", "1"]
    _ok(_train(tmp_path / "one", *run, "--save-every", "2"))
    _ok(_train(tmp_path / "tp2", *run, "--tp", "2", "--sequence-parallel", "--save-every", "2", nproc=2))
    one = _losses(tmp_path / "one")
    _copy_checkpoint(_checkpoint(tmp_path / "tp2", 2), tmp_path / "whole")
    _ok(_train(tmp_path / "whole", *run, "--resume"))
    _copy_checkpoint(_checkpoint(tmp_path / "one", 2), tmp_path / "split")
    _ok(_train(tmp_path / "split", *run, "--resume", "--tp", "2", nproc=2))
    for name in ("whole", "split"):
        assert _losses(tmp_path / name) == pytest.approx(one, rel=1e-5), name


@pytest.mark.parametrize(
    ("extra", "words"),
    [(["--kv-heads", "3"], "--kv-heads 3 does not divide the 4 heads of preset 'tiny'"),
     (["--kv-heads", "0"], "--kv-heads must be a positive integer, received 0"),
     (["--preset", "125m", "--kv-heads", "3", "--tp", "4"],
      "--tp 4 does not divide the 3 kv heads, nor do they divide it"),
     (["--hf", "olmo2", "--kv-heads", "2", "--tp", "4"], "--hf olmo2 trains without --kv-heads below --tp"),
     (["--hf", "falcon", "--kv-heads", "1", "--tp", "2"], "--hf falcon trains without --kv-heads below --tp (its kv "
      "heads are not replicated: a norm over them all, or Falcon's kv groups)"),
     (["--hf", "deepseek_v3", "--experts", "4", "--aux-loss-coef", "0", "--kv-heads", "2"],
      "--hf deepseek_v3 trains without --kv-heads (its attention has one kv head per query head")],
    ids=["not-dividing", "zero", "neither-divides", "norm-over-kv-heads", "kv-groups", "latent"],
)  # fmt: skip
def test_kv_heads_it_cannot_train_are_refused(monkeypatch, extra, words):
    from tessel.bench.train_args import ArgumentError, parse_args

    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ArgumentError, match=words.replace("(", r"\(").replace(")", r"\)")):
        parse_args([*RUN, *extra])
