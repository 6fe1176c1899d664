"""``python -m tessel.bench.train --hf FAMILY``: a Hugging Face causal LM of the preset's shape trained through
tessel (parallelize, tessel's attention, the fused loss, hf_pipeline_stage, DDP/FSDP and ZeroAdam).

Its initial weights are drawn whole from the seed on every rank and split afterwards, so every layout trains the
same model on the same batches and the loss curves agree to fp32 rounding.
"""

import importlib.util
import json

import pytest

from tessel.bench.train_hf import HF_FAMILIES, MOE_FAMILIES
from tests.bench.test_train import PREFIX, _checkpoint, _copy_checkpoint, _losses, _ok, _train
from tests.bench.test_train_eval import _eval_losses
from tests.multiprocess import REFERENCE_KERNELS, run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")

RUN = ["--hf", "llama", "--steps", "3", "--seq-len", "32", "--batch-size", "8"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf-one")
    proc = _ok(_train(out, *RUN, "--save-every", "2"))
    assert "Hugging Face Llama tiny: 0.25M parameters" in proc.stdout  # tessel's GPT tiny's shape and count
    record = json.loads((out / "run.json").read_text())
    assert record["model"]["hf"] == "llama" and record["summary"]["parameters"] == 246336
    return out


@pytest.mark.slow
def test_a_hugging_face_llama_learns(tmp_path):
    _ok(_train(tmp_path, *RUN[:2], "--steps", "20", "--seq-len", "32", "--batch-size", "8"))
    losses = _losses(tmp_path)
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 1.0  # measured: 5.51 to ~3.6


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout",
    [
        ["--tp", "2", "--sequence-parallel"],
        ["--pp", "2", "--microbatches", "2"],
        ["--pp", "2", "--schedule", "interleaved", "--microbatches", "2", "--zero", "1"],
        ["--dp", "2", "--zero", "3"],
        ["--dp", "2", "--zero", "2", "--microbatches", "2"],
        ["--cp", "2"],
        ["--pp", "2", "--microbatches", "2", "--zero", "3"],
    ],
    ids=["tp2-sp", "pp2-1f1b", "pp2-interleaved-zero1", "dp2-fsdp", "dp2-zero2-accumulate", "cp2", "pp2-fsdp"],
)
def test_every_layout_trains_the_same_model(one_process, tmp_path, layout):
    _ok(_train(tmp_path, *RUN, *layout, nproc=2))
    assert _losses(tmp_path) == pytest.approx(_losses(one_process), rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_compiled_decoder_layers_train_alike(one_process, tmp_path):
    """--compile: each decoder layer's forward through torch.compile (aot_eager here), alone and at tp=2 with
    sequence parallelism (the sequence rings begin and end in hooks around the compiled layer)."""
    _ok(_train(tmp_path / "one", *RUN, "--compile", "aot_eager"))
    _ok(_train(tmp_path / "tp2", *RUN, "--compile", "aot_eager", "--tp", "2", "--sequence-parallel", nproc=2))
    for run in ("one", "tp2"):
        assert _losses(tmp_path / run) == pytest.approx(_losses(one_process), rel=1e-5), run


def _checkpointing(rank, world_size):
    """Whether the job's Hugging Face model checkpoints its layers, with and without --recompute."""
    import torch

    from tessel.bench.train_args import parse_args
    from tessel.bench.train_engine import build_engine
    from tessel.parallel import init_parallel

    dims = init_parallel()
    models = [build_engine(parse_args([*RUN, *extra]), dims).gpt for extra in (["--recompute"], [])]
    assert all(isinstance(m, torch.nn.Module) for m in models)
    return tuple(m.is_gradient_checkpointing for m in models)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_recomputed_decoder_layers_train_alike(one_process, tmp_path):
    """--recompute: Hugging Face's activation checkpointing of each decoder layer, alone, at tp=2 with sequence
    parallelism, at pp=2 and under FSDP (whose hooks run outside the checkpoint: the output's gradient regathers the
    layer for its recomputation): the same gradients, so the same curve."""
    assert "recompute" in _ok(_train(tmp_path / "one", *RUN, "--recompute")).stdout
    assert run_ranks(_checkpointing, 1, timeout=120, env=REFERENCE_KERNELS) == [(True, False)]
    _ok(_train(tmp_path / "tp2", *RUN, "--recompute", "--tp", "2", "--sequence-parallel", nproc=2))
    _ok(_train(tmp_path / "pp2", *RUN, "--recompute", "--pp", "2", "--microbatches", "2", nproc=2))
    _ok(_train(tmp_path / "fsdp", *RUN, "--recompute", "--dp", "2", "--zero", "3", nproc=2))
    for run in ("one", "tp2", "pp2", "fsdp"):
        assert _losses(tmp_path / run) == pytest.approx(_losses(one_process), rel=1e-5), run


@pytest.mark.slow
@pytest.mark.multiprocess
def test_packed_documents_train_as_hugging_face_packs_them(tmp_path):
    """--doc-sep: position ids restarting at each document reach the model, as Hugging Face packs sequences; the
    curve is Hugging Face's own (the baseline packs through its sdpa mask), at tp=2 with sequence parallelism, at
    dp=2 under FSDP, through a pipeline (the positions travel with the activations) and at cp=2 (each rank's ring
    attention reads the documents from the whole sequence's positions) too; without the documents it is another
    one."""
    docs = ["--hf", "llama", "--steps", "3", "--seq-len", "64", "--batch-size", "4", "--doc-sep", "\\n\\n"]
    _ok(_train(tmp_path / "one", *docs))
    _ok(_train(tmp_path / "baseline", *docs, "--hf-baseline"))
    _ok(_train(tmp_path / "tp2", *docs, "--tp", "2", "--sequence-parallel", nproc=2))
    _ok(_train(tmp_path / "fsdp", *docs, "--dp", "2", "--zero", "3", nproc=2))
    _ok(_train(tmp_path / "pp2", *docs, "--pp", "2", "--microbatches", "2", nproc=2))  # the positions travel along
    _ok(_train(tmp_path / "cp2", *docs, "--cp", "2", nproc=2))
    _ok(_train(tmp_path / "stream", *docs[:-2]))
    for run in ("baseline", "tp2", "fsdp", "pp2", "cp2"):
        assert _losses(tmp_path / run) == pytest.approx(_losses(tmp_path / "one"), rel=1e-5), run
    assert _losses(tmp_path / "stream")[-1] != pytest.approx(_losses(tmp_path / "one")[-1], rel=1e-4)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_context_parallel_pipeline_stages_train_the_same_model(one_process, tmp_path):
    """--pp 2 --cp 2 (four ranks): each stage's base model takes the whole sequence's positions and its ranks' ring
    attention their shares of it; packed documents too, with the sequence split over tp 2 as well (eight ranks,
    each later stage receiving a quarter of the sequence): Hugging Face's own curve."""
    _ok(_train(tmp_path / "pp2-cp2", *RUN, "--pp", "2", "--cp", "2", "--microbatches", "2", nproc=4))
    assert _losses(tmp_path / "pp2-cp2") == pytest.approx(_losses(one_process), rel=1e-5)
    docs = ["--hf", "llama", "--steps", "3", "--seq-len", "64", "--batch-size", "4", "--doc-sep", "\\n\\n"]
    _ok(_train(tmp_path / "baseline", *docs, "--hf-baseline"))
    layout = ["--pp", "2", "--cp", "2", "--tp", "2", "--sequence-parallel", "--microbatches", "2"]
    _ok(_train(tmp_path / "docs", *docs, *layout, nproc=8))
    assert _losses(tmp_path / "docs") == pytest.approx(_losses(tmp_path / "baseline"), rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_tensor_parallel_checkpoint_resumes_in_one_process(one_process, tmp_path):
    """Saved at tp=2 (each rank its shards), resumed whole in one process: the run ends as the reference does."""
    saved, resumed = tmp_path / "tp2", tmp_path / "one"
    _ok(_train(saved, *RUN, "--tp", "2", "--save-every", "2", nproc=2))
    _copy_checkpoint(_checkpoint(saved, 2), resumed)
    _ok(_train(resumed, *RUN, "--resume"))
    assert _losses(resumed) == pytest.approx(_losses(one_process), rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("family", ["phi3", "olmo2"])
def test_head_split_checkpoints_resume_whole(tmp_path, family):
    """Phi-3's fused q/k/v (three parts of unequal widths, each split by heads) and OLMo 2's q/k norms (split with
    their heads), saved at tp=2 with sequence parallelism and resumed in one process: the single process's curve."""
    run = ["--hf", family, *RUN[2:]]
    _ok(_train(tmp_path / "one", *run))
    _ok(_train(tmp_path / "tp2", *run, "--tp", "2", "--sequence-parallel", "--save-every", "2", nproc=2))
    _copy_checkpoint(_checkpoint(tmp_path / "tp2", 2), tmp_path / "resumed")
    _ok(_train(tmp_path / "resumed", *run, "--resume"))
    assert _losses(tmp_path / "resumed") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)


@pytest.mark.slow
def test_other_families_train_and_checkpoints_keep_their_model(one_process, tmp_path):
    """Mistral, Qwen2 and Qwen3 of the same shape train; a checkpoint of tessel's GPT (or of another family) is
    refused with one line."""
    for family in ("mistral", "qwen2", "qwen3"):
        proc = _ok(_train(tmp_path / family, "--hf", family, *RUN[2:]))
        assert f"Hugging Face {HF_FAMILIES[family]} tiny" in proc.stdout
        assert len(_losses(tmp_path / family)) == 3
    _copy_checkpoint(_checkpoint(one_process, 2), tmp_path / "gpt")
    proc = _train(tmp_path / "gpt", *RUN[2:], "--resume")
    assert proc.returncode != 0 and "holds a different model: Hugging Face Llama (this run: tessel GPT)" in proc.stderr


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3"])
def test_gemma_trains_hugging_faces_curve_through_tessels_layers(tmp_path, family):
    """--hf gemma, gemma2 and gemma3 (embeddings scaled inside the embedding module; Gemma 2's attention and final
    logits soft-capped, its baseline with eager attention; Gemma 3's q/k norms and two rotary bases): the same curve as
    Hugging Face's own model, at tp=2 with sequence parallelism and through a pipeline (Gemma 2's stages' fused loss
    soft-capped)."""
    run = ["--hf", family, *RUN[2:]]
    proc = _ok(_train(tmp_path / "one", *run))
    assert f"Hugging Face {HF_FAMILIES[family]} tiny" in proc.stdout
    _ok(_train(tmp_path / "baseline", *run, "--hf-baseline"))
    _ok(_train(tmp_path / "tp2", *run, "--tp", "2", "--sequence-parallel", nproc=2))
    _ok(_train(tmp_path / "pp2", *run, "--pp", "2", "--microbatches", "2", nproc=2))
    for layout in ("baseline", "tp2", "pp2"):
        assert _losses(tmp_path / layout) == pytest.approx(_losses(tmp_path / "one"), rel=1e-5), layout


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("family", ["olmo2", "phi3"])
def test_what_hugging_face_gathers_trains_its_curve_split_by_heads(tmp_path, family):
    """--hf olmo2 (norms after each block, q/k norms over all heads) and phi3 (fused qkv and gate/up projections),
    whose attention Hugging Face's plan gathers whole: Hugging Face's own curve at tp=2 with sequence parallelism,
    the attention split by heads (each q/k norm summing its squares over the ranks; Phi-3's attention reading its
    local head counts), through a pipeline, and at tp 2 x cp 2 with the sequence split over both."""
    run = ["--hf", family, *RUN[2:]]
    proc = _ok(_train(tmp_path / "one", *run))
    assert f"Hugging Face {HF_FAMILIES[family]} tiny" in proc.stdout
    _ok(_train(tmp_path / "baseline", *run, "--hf-baseline"))
    _ok(_train(tmp_path / "tp2", *run, "--tp", "2", "--sequence-parallel", nproc=2))
    _ok(_train(tmp_path / "pp2", *run, "--pp", "2", "--microbatches", "2", nproc=2))
    _ok(_train(tmp_path / "tp2-cp2", *run, "--tp", "2", "--cp", "2", "--sequence-parallel", nproc=4))
    for layout in ("baseline", "tp2", "pp2", "tp2-cp2"):
        assert _losses(tmp_path / layout) == pytest.approx(_losses(tmp_path / "one"), rel=1e-5), layout


@pytest.mark.slow
@pytest.mark.multiprocess
def test_phi3_split_by_heads_compiles(tmp_path):
    """Phi-3's attention reads its head counts from a view of its config (LocalHeadsConfig): torch.compile traces
    it in every decoder layer at tp=2 with sequence parallelism, and the curve is the single process's."""
    run = ["--hf", "phi3", *RUN[2:]]
    _ok(_train(tmp_path / "one", *run))
    _ok(_train(tmp_path / "tp2", *run, "--tp", "2", "--sequence-parallel", "--compile", "aot_eager", nproc=2))
    assert _losses(tmp_path / "tp2") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_baseline_computes_what_tessels_layers_compute(one_process, tmp_path):
    """--hf-baseline (Hugging Face's own sdpa attention, head and loss from the logits, nothing swapped) trains the
    same curve as the model with tessel's attention and fused loss, alone and at dp=2 under FSDP."""
    proc = _ok(_train(tmp_path / "one", *RUN, "--hf-baseline"))
    assert "zero=0 hf-baseline" in proc.stdout
    _ok(_train(tmp_path / "fsdp", *RUN, "--hf-baseline", "--dp", "2", "--zero", "3", nproc=2))
    for run in ("one", "fsdp"):
        assert _losses(tmp_path / run) == pytest.approx(_losses(one_process), rel=1e-5), run


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_a_sliding_window_trains_as_hugging_faces_own_attention_does(tmp_path, family):
    """--sliding-window W (W below --seq-len): the family's config slides every layer's attention over W keys, and
    tessel's kernel with window=W trains the curve of Hugging Face's sdpa with its window mask, alone and at tp=2
    with sequence parallelism; the window changes the curve (it is really on)."""
    run = ["--hf", family, *RUN[2:]]
    window = ["--sliding-window", "8"]
    proc = _ok(_train(tmp_path / "tessel", *run, *window))
    _ok(_train(tmp_path / "baseline", *run, *window, "--hf-baseline"))
    _ok(_train(tmp_path / "tp2", *run, *window, "--tp", "2", "--sequence-parallel", nproc=2))
    _ok(_train(tmp_path / "full", *run))
    tessel = _losses(tmp_path / "tessel")
    for other in ("baseline", "tp2"):
        assert _losses(tmp_path / other) == pytest.approx(tessel, rel=1e-5), other
    assert _losses(tmp_path / "full")[1:] != pytest.approx(tessel[1:], rel=1e-4)
    assert json.loads((tmp_path / "tessel" / "run.json").read_text())["model"]["sliding_window"] == 8, proc.stdout


@pytest.mark.slow
@pytest.mark.multiprocess
def test_label_smoothing_and_logit_z_loss_reach_the_fused_loss_under_every_layout(one_process, tmp_path):
    """--label-smoothing and --logit-z-loss shape the fused loss (fuse_lm_loss's options), in one process, at tp=2
    with sequence parallelism and through a pipeline's last stage alike; the curve is not the plain loss's."""
    run = [*RUN, "--label-smoothing", "0.1", "--logit-z-loss", "1e-3"]
    _ok(_train(tmp_path / "one", *run))
    for name, layout in (("tp2", ["--tp", "2", "--sequence-parallel"]), ("pp2", ["--pp", "2", "--microbatches", "2"])):
        _ok(_train(tmp_path / name, *run, *layout, nproc=2))
        assert _losses(tmp_path / name) == pytest.approx(_losses(tmp_path / "one"), rel=1e-5), name
    assert _losses(tmp_path / "one")[0] > _losses(one_process)[0] + 1e-3  # smoothing and z-loss add to the loss


def test_flops_under_a_sliding_window_count_its_keys():
    """MFU's attention term counts min(S, W) keys per token, as tessel's GPT counts them."""
    from tessel.bench.train_hf import hf_flops_per_token
    from tessel.layers import GPT, GPTConfig

    base = dict(vocab_size=64, n_layer=2, n_embd=64, n_head=4, block_size=64)
    for window in (None, 8, 100):
        config = GPTConfig(**base, sliding_window=window)
        gpt = GPT(config)  # its parameters with the input embedding, which both counts leave out
        assert hf_flops_per_token(gpt.num_params(), config, 64) == pytest.approx(gpt.flops_per_token(64)), window


def _atomic_backward(rank, world_size):
    """The model's forward (hf_loss) and its pipeline stages (hf_stage) hand deterministic=False to tessel's attention
    for --attention-backward atomic, nothing otherwise (the kernel's default: deterministic)."""
    import torch
    import transformers

    import tessel.kernels.attention as attention
    from tessel.bench.train_args import parse_args
    from tessel.bench.train_hf import attention_kwargs, hf_loss, hf_stage
    from tessel.layers import fuse_lm_loss, parallelize, register_hf_attention

    calls = []
    kernel = attention.flash_attention
    attention.flash_attention = lambda *a, **k: calls.append(k["deterministic"]) or kernel(*a, **k)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                      attn_implementation=register_hf_attention())  # fmt: skip
    model = fuse_lm_loss(parallelize(transformers.LlamaForCausalLM(config), None))
    x = torch.randint(64, (2, 8))
    seen = {}
    for backward in ("deterministic", "atomic"):
        args = parse_args([*RUN, "--attention-backward", backward])
        calls.clear()
        hf_loss(model, x, x, **attention_kwargs(args))[0].backward()
        first, last = hf_stage(model, 0, 2, args), hf_stage(model, 1, 2, args)
        last.lm_loss(last(first(x)), x).backward()
        seen[backward] = list(calls)
    return seen


def test_the_atomic_attention_backward_reaches_every_forward():
    [seen] = run_ranks(_atomic_backward, 1, timeout=120, env=REFERENCE_KERNELS)
    assert seen == {"deterministic": [True] * 4, "atomic": [False] * 4}  # two layers, whole then staged


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [["--pp", "2", "--microbatches", "2"], ["--cp", "2"]], ids=["pp2", "cp2"])
def test_the_atomic_attention_backward_trains_under_pipeline_and_context_parallelism(one_process, tmp_path, layout):
    _ok(_train(tmp_path, *RUN, "--attention-backward", "atomic", *layout, nproc=2))
    assert _losses(tmp_path) == pytest.approx(_losses(one_process), rel=1e-5)


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (
            ["--hf-baseline", "--attention-backward", "atomic"],
            "--hf llama trains without --attention-backward atomic with --hf-baseline",
        ),
        (["--experts", "4"], f"--hf llama is dense: --experts needs a mixture family ({', '.join(MOE_FAMILIES)})"),
        (["--recompute", "--sliding-window", "8"], "--hf llama trains without --sliding-window"),
        (["--label-smoothing", "0.1", "--hf-baseline"], "--label-smoothing shapes tessel's fused loss; --hf-baseline"),
        (["--kv-shared-layers", "2"], "--hf llama trains without --kv-shared-layers (Gemma 4's)"),
    ],
)
def test_options_of_tessels_gpt_alone_are_refused(tmp_path, extra, words):
    proc = _train(tmp_path, *RUN, *extra)
    assert proc.returncode == 2 and PREFIX in proc.stderr and words in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.multiprocess
def test_held_out_evaluation_agrees_through_a_pipeline(tmp_path):
    """--eval-every: the Hugging Face model's held-out loss in one process and through pp=2's forward-only schedule."""
    run = [*RUN, "--eval-every", "3", "--eval-batches", "2"]
    _ok(_train(tmp_path / "one", *run))
    _ok(_train(tmp_path / "pp2", *run, "--pp", "2", "--microbatches", "2", nproc=2))
    one, pp2 = (_eval_losses(tmp_path / r) for r in ("one", "pp2"))
    assert one[-1] > 0 and pp2 == pytest.approx(one, rel=1e-5)


def test_the_command_line_offers_every_family_the_job_builds():
    from tessel.bench.train_args import HF_CHOICES

    assert sorted(HF_CHOICES) == sorted(HF_FAMILIES)


# the layouts a hybrid of linear attention or state spaces trains in with the single process's curve
HYBRID_LAYOUTS = {
    "baseline": (["--hf-baseline"], 1),
    "tp2-sp": (["--tp", "2", "--sequence-parallel"], 2),
    "tp2": (["--tp", "2"], 2),
    "pp2": (["--pp", "2"], 2),
    "dp2": (["--dp", "2", "--zero", "2"], 2),
    "cp2": (["--cp", "2"], 2),
    "pp2-cp2": (["--pp", "2", "--cp", "2"], 4),
    "tp2-cp2-sp": (["--tp", "2", "--cp", "2", "--sequence-parallel"], 4),
}


def _check_hybrid_curves(tmp_path, run: list[str], name: str, layouts: dict = HYBRID_LAYOUTS,
                         rel: dict | None = None) -> None:  # fmt: skip
    """``run``'s single-process curve in every layout of ``layouts``, within 1e-5 (or ``rel[layout]``)."""
    proc = _ok(_train(tmp_path / "one", *run))
    assert f"Hugging Face {name} tiny" in proc.stdout
    one = _losses(tmp_path / "one")
    for layout_name, (layout, nproc) in layouts.items():
        _ok(_train(tmp_path / layout_name, *run, *layout, nproc=nproc))
        tolerance = (rel or {}).get(layout_name, 1e-5)
        assert _losses(tmp_path / layout_name) == pytest.approx(one, rel=tolerance), layout_name


QWEN3_5 = ["--hf", "qwen3_5", "--steps", "3", "--seq-len", "32", "--batch-size", "8", "--microbatches", "2"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_qwen3_5_trains_its_linear_attention_split_by_heads(tmp_path):
    """--hf qwen3_5: three Gated DeltaNet layers to each full-attention one. The single process's curve as Hugging
    Face computes it, at tp=2 with and without sequence parallelism (the linear attention split by heads), in two
    pipeline stages, over two data-parallel ranks under ZeRO-2, and over two context-parallel ranks (the linear
    attention trading the sequence split for a split of its heads)."""
    _check_hybrid_curves(tmp_path, QWEN3_5, "Qwen3_5")


# no balancing loss in the layouts: each data-parallel rank would balance its own batch (its own test below)
QWEN3_5_MOE = ["--hf", "qwen3_5_moe", "--experts", "4", "--aux-loss-coef", "0", "--steps", "3", "--seq-len", "32",
               "--batch-size", "8", "--microbatches", "2"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiprocess
def test_qwen3_5_moe_trains_its_linear_attention_and_experts(tmp_path):
    """--hf qwen3_5_moe: Qwen3.5's layers with four experts beside a shared expert in each. The single process's
    curve as Hugging Face computes it, at tp=2 with and without sequence parallelism (the linear attention split by
    heads, the experts by features), in two pipeline stages, over two data-parallel ranks under ZeRO-2, and over two
    context-parallel ranks; with its balancing loss, Hugging Face's curve and two pipeline stages' (the router sums
    passed on)."""
    _check_hybrid_curves(tmp_path, QWEN3_5_MOE, "Qwen3_5Moe")
    balanced = [*QWEN3_5_MOE[:5], "0.01", *QWEN3_5_MOE[6:]]
    layouts = {name: HYBRID_LAYOUTS[name] for name in ("baseline", "pp2", "tp2-sp")}
    _check_hybrid_curves(tmp_path / "balanced", balanced, "Qwen3_5Moe", layouts)


BAMBA = ["--hf", "bamba", "--steps", "3", "--seq-len", "32", "--batch-size", "8", "--microbatches", "2"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bamba_trains_its_mamba2_mixers_split_by_heads(tmp_path):
    """--hf bamba: three Mamba-2 layers to each attention layer, one group of B and C (shared by the tensor-parallel
    ranks). The single process's curve as Hugging Face computes it, at tp=2 with and without sequence parallelism (the
    mixers split by heads), in two pipeline stages, over two data-parallel ranks under ZeRO-2, and over two
    context-parallel ranks."""
    _check_hybrid_curves(tmp_path, BAMBA, "Bamba")


# no balancing loss: each data-parallel rank would balance its own batch (tests/bench/test_train_hf_moe.py)
JAMBA = ["--hf", "jamba", "--experts", "4", "--aux-loss-coef", "0", "--steps", "3", "--seq-len", "32", "--batch-size",
         "8", "--microbatches", "2"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiprocess
def test_jamba_trains_its_mamba1_mixers_and_experts(tmp_path):
    """--hf jamba: Mamba-1 mixers (split by channels, x_proj summed over the ranks' channels), attention without
    positions, experts in every other layer. The single process's curve as Hugging Face computes it, at tp=2 with and
    without sequence parallelism, in two pipeline stages, over two data-parallel ranks under ZeRO-2, and over two
    context-parallel ranks (alone, with two stages, and with tp=2 and sequence parallelism)."""
    _check_hybrid_curves(tmp_path, JAMBA, "Jamba")


GEMMA4 = ["--hf", "gemma4", "--steps", "3", "--seq-len", "32", "--batch-size", "8", "--sliding-window", "4"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_gemma4_trains_its_per_layer_inputs_and_wider_global_heads(tmp_path):
    """--hf gemma4: five layers sliding over 4 keys to each full-attention layer of heads twice as wide, per-layer
    inputs gated into every layer. The single process's curve as Hugging Face computes it, at tp=2 with and without
    sequence parallelism (each layer's per-layer input split with the residual stream), in two pipeline stages (the
    second stage's per-layer inputs passed on by the first), over two data-parallel ranks under ZeRO-2, and over two
    context-parallel ranks (alone, with two stages, and with tp=2 and sequence parallelism)."""
    _check_hybrid_curves(tmp_path, [*GEMMA4, "--microbatches", "2"], "Gemma4")


# the preset's four layers slide, attend to every key, then reuse layer 0's and layer 1's keys and values: each of
# four stages passes some on
GEMMA4_KV_LAYOUTS = {name: HYBRID_LAYOUTS[name] for name in ("baseline", "tp2-cp2-sp")}
GEMMA4_KV_LAYOUTS["pp4"] = (["--pp", "4"], 4)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_gemma4_trains_the_keys_and_values_its_last_layers_share(tmp_path):
    """--hf gemma4 --kv-shared-layers 2 (Gemma 4's E-models): the last two layers read the keys and values of the last
    earlier layer of their kind. The single process's curve as Hugging Face computes it, in four pipeline stages
    (each passing some on, their gradients coming back: the same sums, equal to the last bit), and at tp=2 × cp=2
    with sequence parallelism within 1e-4.

    This model's fp32 gradients are ill-conditioned (unit attention scaling over normed queries and keys): Hugging
    Face's own forward (the baseline) drifts from tessel's single process by up to 1.3e-5 within six steps, and the
    sums of a ring by up to 1.2e-4, as Adam turns noise in near-zero gradients into whole steps.
    tests/layers/test_hf_families.py checks each step's gradients at tp=2 × cp=2 against float64."""
    run = [*GEMMA4, "--microbatches", "4", "--kv-shared-layers", "2"]
    _check_hybrid_curves(tmp_path, run, "Gemma4", GEMMA4_KV_LAYOUTS, rel={"tp2-cp2-sp": 1e-4})


def test_gemma4_shares_keys_and_values_only_where_each_kind_is_stored():
    """--kv-shared-layers: the config's last layers reuse; the layers before them must hold one of each kind."""
    from tessel.bench.train_args import ArgumentError, parse_args
    from tessel.bench.train_hf import _hf_config
    from tessel.layers.gpt import GPTConfig

    c = GPTConfig(vocab_size=256, n_layer=8, n_head=4, n_embd=64, block_size=64, mlp_hidden=96, sliding_window=4)
    config = _hf_config(parse_args([*GEMMA4, "--kv-shared-layers", "2"]), c, "sdpa")
    assert config.kv_sharing_modes == [None] * 4 + ["store"] * 2 + ["reuse"] * 2
    config = _hf_config(parse_args([*GEMMA4, "--kv-shared-layers", "3"]), c, "sdpa")  # layer 4 attends to every key
    assert [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"] == [4, 5, 7]
    assert config.kv_sharing_modes == [None] * 3 + ["store"] * 2 + ["reuse"] * 3
    for shared in ("7", "8", "-1"):  # 7: layer 0 attends to every key, none stores the sliding layers'
        with pytest.raises(ArgumentError, match=rf"--kv-shared-layers must leave before the sharing layers one of "
                                                rf"each kind of 8 .*, received {shared}"):  # fmt: skip
            _hf_config(parse_args([*GEMMA4, "--kv-shared-layers", shared]), c, "sdpa")


def test_gemma4_takes_its_heads_from_the_preset():
    """Full-attention layers' heads twice the preset's head dim, one in every six and the last; per-layer inputs of an
    eighth of the width; the FLOPs count each layer's keys (its window) and its heads' width."""
    from tessel.bench.train_args import parse_args
    from tessel.bench.train_hf import _hf_config, attention_widths, attention_windows, hf_flops_per_token
    from tessel.layers.gpt import GPTConfig

    c = GPTConfig(vocab_size=256, n_layer=8, n_head=4, n_embd=64, block_size=64, mlp_hidden=96, sliding_window=4)
    config = _hf_config(parse_args(GEMMA4), c, "sdpa")
    assert config.model_type == "gemma4_text" and config.sliding_window == 4
    assert [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"] == [5, 7]
    assert config.hidden_size_per_layer_input == 8 and config.per_layer_config[5].head_dim == 32
    widths = attention_widths(config)
    assert widths == [64] * 5 + [128, 64, 128]
    keys = 6 * 64 * 4 + 2 * 128 * 64  # six sliding layers over 4 keys, two full ones over 64, each by its width
    assert attention_windows(config) == [4] * 5 + [None, 4, None]
    assert hf_flops_per_token(10**6, c, 64, attention_windows(config), widths) == 6 * (10**6 - 256 * 64) + 12 * keys
    dense = GPTConfig(vocab_size=256, n_layer=8, n_head=4, n_embd=64, block_size=64, mlp_hidden=96)
    for family in (["--hf", "llama"], ["--hf", "deepseek_v3", "--experts", "4", "--aux-loss-coef", "0"]):
        assert attention_widths(_hf_config(parse_args(family), dense, "sdpa")) is None  # uniform: the model's width


def test_bamba_takes_its_mixers_from_the_preset():
    """Heads of the preset's head dim over twice its width, one group; an attention layer after each three Mamba-2
    layers, whose attention alone the FLOPs count."""
    from tessel.bench.train_args import parse_args
    from tessel.bench.train_hf import _hf_config, attention_windows
    from tessel.layers.gpt import GPTConfig

    c = GPTConfig(vocab_size=256, n_layer=8, n_head=4, n_embd=64, block_size=64, mlp_hidden=96)
    config = _hf_config(parse_args(BAMBA), c, "sdpa")
    assert config.model_type == "bamba" and config.attn_layer_indices == [3, 7]
    assert (config.mamba_n_heads, config.mamba_d_head, config.mamba_n_groups, config.mamba_expand) == (8, 16, 1, 2)
    assert attention_windows(config) == [0, 0, 0, None] * 2


def test_qwen3_5_takes_its_heads_from_the_preset():
    """Half as many key heads as the preset's heads, as many value heads, each of its head dim; three linear layers
    to each full one, whose attention alone the FLOPs count."""
    from tessel.bench.train_args import parse_args
    from tessel.bench.train_hf import _hf_config, attention_windows, hf_flops_per_token
    from tessel.layers.gpt import GPTConfig

    c = GPTConfig(vocab_size=256, n_layer=4, n_head=4, n_embd=64, block_size=64, mlp_hidden=96)
    config = _hf_config(parse_args(QWEN3_5), c, "sdpa")
    assert config.model_type == "qwen3_5_text" and config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    heads = (config.linear_num_key_heads, config.linear_num_value_heads)
    assert heads == (2, 4) and config.linear_key_head_dim == config.linear_value_head_dim == 16
    assert attention_windows(config) == [0, 0, 0, None]
    assert hf_flops_per_token(10**6, c, 64, [0, 0, 0, None]) == 6 * (10**6 - 256 * 64) + 12 * 64 * 64
