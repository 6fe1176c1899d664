"""``python -m tessel.bench.train --hf mixtral|qwen3_moe --experts N``: a Hugging Face mixture of experts trained
through tessel (parallelize, tessel's experts implementation over its grouped GEMM, fp8 through convert_to_fp8).

As for the dense families, the initial weights are drawn whole from the seed on every rank and split afterwards, so
a layout trains the same model on the same batches: tensor parallelism follows the single process to fp32 rounding.
Data parallelism does too without the load-balancing loss; with it each rank balances its own tokens (a loss
nonlinear in the batch's routing statistics), as for tessel's GPT.
"""

import importlib.util
import json
from types import SimpleNamespace

import pytest

from tests.bench.test_train import PREFIX, _checkpoint, _copy_checkpoint, _losses, _ok, _train
from tests.multiprocess import REFERENCE_KERNELS, run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")

RUN = ["--hf", "mixtral", "--experts", "4", "--top-k", "2", "--steps", "3", "--seq-len", "32", "--batch-size", "8"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf-moe-one")
    proc = _ok(_train(out, *RUN))
    assert "Hugging Face Mixtral tiny: 0.69M parameters, dp=1 pp=1 tp=1 zero=0 experts=4 top-k=2" in proc.stdout
    record = json.loads((out / "run.json").read_text())
    assert record["model"]["hf"] == "mixtral" and record["model"]["n_expert"] == 4
    return out


def _experts_implementation(rank, world_size):
    """The model the job builds runs its experts through tessel's implementation (the baseline: Hugging Face's)."""
    from tessel.bench.train_args import parse_args
    from tessel.bench.train_hf import build_hf
    from tessel.layers.gpt import GPTConfig
    from tessel.parallel import init_parallel

    dims = init_parallel()
    seen = []
    for extra in ([], ["--hf-baseline"]):
        args = parse_args([*RUN, *extra])
        config = GPTConfig(vocab_size=256, n_layer=2, n_head=4, n_embd=64, block_size=64, mlp_hidden=96)
        model, _, _ = build_hf(args, config, dims, __import__("torch").float32)
        seen.append(model.config._experts_implementation)
    return seen


def test_the_job_runs_the_experts_through_tessels_implementation():
    [seen] = run_ranks(_experts_implementation, 1, timeout=120, env=REFERENCE_KERNELS)
    assert seen[0] == "tessel" and seen[1] != "tessel"


def test_flops_count_the_active_experts_only():
    """Each token runs k of N experts: the FLOPs per token count the parameters outside the experts and k/N of
    theirs."""
    import transformers

    from tessel.bench.train_hf import _active_params

    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2))  # fmt: skip
    total = sum(p.numel() for p in model.parameters())
    experts = 2 * 8 * 3 * 32 * 48  # layers x experts x (gate, up, down) x hidden x width
    args = SimpleNamespace(hf="mixtral", experts=8, top_k=2)
    assert _active_params(model, args) == total - experts * 6 // 8
    assert _active_params(model, SimpleNamespace(hf="llama", experts=0, top_k=2)) == total


def test_the_load_balancing_loss_is_trained_not_reported(one_process, tmp_path):
    """The first step's reported loss is the language model's alone, with or without the balancing loss; the
    balancing loss changes what is learned (the later losses)."""
    _ok(_train(tmp_path, *RUN, "--aux-loss-coef", "0"))
    with_aux, without = _losses(one_process), _losses(tmp_path)
    assert with_aux[0] == without[0] and with_aux[1:] != without[1:]
    assert without[-1] < without[0]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tensor_parallel_experts_train_the_same_model(one_process, tmp_path):
    _ok(_train(tmp_path, *RUN, "--tp", "2", "--sequence-parallel", nproc=2))
    assert _losses(tmp_path) == pytest.approx(_losses(one_process), rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("layout", "nproc"),
    [(["--dp", "2", "--zero", "3"], 2), (["--dp", "2", "--ep", "2", "--zero", "3"], 2),
     (["--dp", "2", "--ep", "2", "--tp", "2", "--sequence-parallel"], 4), (["--cp", "2"], 2)],
    ids=["dp2-fsdp", "dp2-ep2-fsdp", "dp2-ep2-tp2-sp", "cp2"],
)  # fmt: skip
def test_data_and_expert_parallel_layouts_train_the_same_model_without_the_balancing_loss(tmp_path, layout, nproc):
    """Each data-parallel rank its own tokens; with --ep each rank of an expert-parallel group holds half the
    experts, every route travelling to its expert's rank and back (parallelize(ep_group=))."""
    _ok(_train(tmp_path / "one", *RUN, "--aux-loss-coef", "0"))
    _ok(_train(tmp_path / "layout", *RUN, "--aux-loss-coef", "0", *layout, nproc=nproc))
    assert _losses(tmp_path / "layout") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("zero", ["0", "2", "3"])
def test_an_expert_parallel_checkpoint_holds_every_expert_and_resumes_in_one_process(tmp_path, zero):
    """Saved at dp=2 with --ep 2 (each rank writes its two of the four experts, and their optimizer state: torch's
    AdamW, ZeRO-2, FSDP): every expert's tensor is whole in the checkpoint, and one process holding them all resumes
    it on the uninterrupted run's curve. (Each rank once wrote its experts as the whole tensor: two of the four.)"""
    from tessel.bench.checkpoint import checkpoint_keys

    run = [*RUN[:-6], "--steps", "4", "--seq-len", "32", "--batch-size", "8", "--aux-loss-coef", "0"]
    run += ["--save-every", "2"]
    _ok(_train(tmp_path / "one", *run))
    _ok(_train(tmp_path / "ep2", *run, "--dp", "2", "--ep", "2", "--zero", zero, nproc=2))
    keys = checkpoint_keys(_checkpoint(tmp_path / "ep2", 2))
    experts = {k: v[0] for k, v in keys.items() if ".experts." in k}
    assert experts and all(shape[0] == 4 for shape in experts.values()), experts
    _copy_checkpoint(_checkpoint(tmp_path / "ep2", 2), tmp_path / "resumed")
    _ok(_train(tmp_path / "resumed", *run, "--resume"))
    assert _losses(tmp_path / "resumed")[2:] == pytest.approx(_losses(tmp_path / "one")[2:], rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_context_parallel_ranks_balance_the_whole_sequence(one_process, tmp_path):
    """Under --cp each rank routes its share of every sequence; the routers' logits are gathered over the group,
    so the balancing loss is the single process's and so is the curve."""
    _ok(_train(tmp_path, *RUN, "--cp", "2", nproc=2))
    assert _losses(tmp_path) == pytest.approx(_losses(one_process), rel=1e-5)


@pytest.mark.slow
def test_compiled_decoder_layers_train_alike(one_process, tmp_path):
    _ok(_train(tmp_path, *RUN, "--compile"))
    assert _losses(tmp_path) == pytest.approx(_losses(one_process), rel=1e-5)


@pytest.mark.slow
def test_fp8_experts_follow_the_curve_and_the_baseline_computes_the_same(one_process, tmp_path):
    """--fp8 runs every projection and the experts in fp8 (4 layers x 5), within 1% of the curve but not on it;
    --hf-baseline (Hugging Face's own experts, attention and loss) trains the same curve as tessel's."""
    proc = _ok(_train(tmp_path / "fp8", *RUN, "--fp8"))
    assert "fp8 GEMMs in 20 layers" in proc.stdout
    fp8, base = _losses(tmp_path / "fp8"), _losses(one_process)
    assert fp8 == pytest.approx(base, rel=1e-2) and fp8 != pytest.approx(base, rel=1e-6)
    _ok(_train(tmp_path / "baseline", *RUN, "--hf-baseline"))
    assert _losses(tmp_path / "baseline") == pytest.approx(base, rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_pipeline_trains_the_mixture_without_the_balancing_loss(tmp_path):
    """--pp 2 with --aux-loss-coef 0: the stages split the mixture's layers (its routers with them) and train the
    single process's curve, 1F1B and interleaved alike, and with the experts split over two data-parallel ranks."""
    run = [*RUN, "--aux-loss-coef", "0"]
    _ok(_train(tmp_path / "one", *run))
    layouts = {
        "1f1b": [], "interleaved": ["--schedule", "interleaved", "--zero", "1"], "dp2-ep2": ["--dp", "2", "--ep", "2"],
    }  # fmt: skip
    for name, layout in layouts.items():
        nproc = 4 if "--dp" in layout else 2
        _ok(_train(tmp_path / name, *run, "--pp", "2", "--microbatches", "2", *layout, nproc=nproc))
        assert _losses(tmp_path / name) == pytest.approx(_losses(tmp_path / "one"), rel=1e-5), name


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_pipeline_trains_the_balancing_loss_of_every_layer(tmp_path):
    """--pp 2 with the balancing loss: each stage passes its layers' router sums on with the activation and the last
    stage trains the balancing loss of every layer's routers, so the curve is the single process's over the same
    two pieces (--microbatches 2: each piece balances its own tokens), 1F1B, interleaved and zero-bubble (whose
    backward splits off the weights' gradients) under FSDP, with the sequence split
    over tp 2 or cp 2 too (the routers' logits gathered). The balancing loss shapes that curve: without it the curve
    is another."""
    run = [*RUN, "--aux-loss-coef", "0.1", "--microbatches", "2"]
    _ok(_train(tmp_path / "one", *run))
    layouts = {"1f1b": ([], 2), "interleaved": (["--schedule", "interleaved"], 2),
               "zb-fsdp": (["--schedule", "zb", "--zero", "3"], 2), "tp2-sp": (["--tp", "2", "--sequence-parallel"], 4),
               "cp2": (["--cp", "2"], 4)}  # fmt: skip
    for name, (layout, nproc) in layouts.items():
        _ok(_train(tmp_path / name, *run, "--pp", "2", *layout, nproc=nproc))
        assert _losses(tmp_path / name) == pytest.approx(_losses(tmp_path / "one"), rel=1e-5), name
    _ok(_train(tmp_path / "without", *RUN, "--aux-loss-coef", "0", "--microbatches", "2"))
    assert _losses(tmp_path / "without")[1:] != pytest.approx(_losses(tmp_path / "one")[1:], rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_router_z_loss_is_trained_not_reported_under_every_layout(tmp_path):
    """--z-loss-coef (ST-MoE's router z-loss over every layer's router logits, which Hugging Face's mixtures lack):
    the first step's reported loss is the run's without it, the later ones are not; the curve is the same through a
    pipeline (the z-loss from the router sums the stages carry), at tp 2 with the sequence split (the routers' logits
    gathered) and with Hugging Face's own forward (--hf-baseline)."""
    run = [*RUN, "--microbatches", "2"]
    _ok(_train(tmp_path / "plain", *run))
    _ok(_train(tmp_path / "one", *run, "--z-loss-coef", "0.5"))
    one, plain = _losses(tmp_path / "one"), _losses(tmp_path / "plain")
    assert one[0] == plain[0] and one[1:] != pytest.approx(plain[1:], rel=1e-5)
    layouts = {"pp2": (["--pp", "2"], 2), "tp2-sp": (["--tp", "2", "--sequence-parallel"], 2),
               "baseline": (["--hf-baseline"], 1)}  # fmt: skip
    for name, (layout, nproc) in layouts.items():
        _ok(_train(tmp_path / name, *run, "--z-loss-coef", "0.5", *layout, nproc=nproc))
        assert _losses(tmp_path / name) == pytest.approx(one, rel=1e-5), name


def test_label_smoothing_and_z_loss_shape_the_mixtures_fused_loss_beside_its_balancing_loss(one_process, tmp_path):
    """The balancing loss is computed beside tessel's fused loss, so --label-smoothing and --logit-z-loss reach a
    mixture that trains it: they raise the first step's reported loss."""
    _ok(_train(tmp_path, *RUN, "--label-smoothing", "0.1", "--logit-z-loss", "1e-3"))
    assert _losses(tmp_path)[0] > _losses(one_process)[0] + 1e-3


def test_qwen3_moe_trains(tmp_path):
    proc = _ok(_train(tmp_path, "--hf", "qwen3_moe", *RUN[2:]))
    assert "Hugging Face Qwen3Moe tiny" in proc.stdout and len(_losses(tmp_path)) == 3


@pytest.mark.slow
@pytest.mark.multiprocess
def test_olmoe_trains_its_balancing_loss_with_its_attention_split_by_heads(tmp_path):
    """--hf olmoe (q/k norms over all heads beside the experts): Hugging Face's own curve, balancing loss included,
    at tp=2 with sequence parallelism (the attention split by heads, the experts by features) and through a
    pipeline carrying the router sums."""
    run = ["--hf", "olmoe", *RUN[2:], "--aux-loss-coef", "0.1", "--microbatches", "2"]
    proc = _ok(_train(tmp_path / "one", *run))
    assert "Hugging Face Olmoe tiny" in proc.stdout and "experts=4 top-k=2" in proc.stdout
    _ok(_train(tmp_path / "baseline", *run, "--hf-baseline"))
    _ok(_train(tmp_path / "tp2", *run, "--tp", "2", "--sequence-parallel", nproc=2))
    _ok(_train(tmp_path / "pp2", *run, "--pp", "2", nproc=2))
    for layout in ("baseline", "tp2", "pp2"):
        assert _losses(tmp_path / layout) == pytest.approx(_losses(tmp_path / "one"), rel=1e-5), layout


DEEPSEEK = ["--hf", "deepseek_v3", "--experts", "4", "--top-k", "2", "--aux-loss-coef", "0", "--expert-bias-rate",
            "1e-2", "--steps", "4", "--seq-len", "32", "--batch-size", "8", "--microbatches", "2"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiprocess
def test_deepseek_v3_trains_its_curve_balanced_by_its_routing_biases(tmp_path):
    """--hf deepseek_v3: multi-head latent attention, a shared expert beside sigmoid-routed experts, balanced without a
    loss by moving its routing biases (--expert-bias-rate, each step's routes counted over the ranks that route other
    tokens). The single process's curve at tp=2 with sequence parallelism (the latents gathered), through a pipeline,
    both (a later stage receiving its share of the sequence: its queries, fed by a gathered latent, are not what tells
    the stage it is sequence-parallel), over two data-parallel ranks (with the experts split over them too), at cp=2,
    and as Hugging Face computes it (--hf-baseline, tessel moving the same biases); the biases shape that curve:
    without them it is another."""
    _ok(_train(tmp_path / "one", *DEEPSEEK))
    one = _losses(tmp_path / "one")
    layouts = {"tp2-sp": (["--tp", "2", "--sequence-parallel"], 2), "pp2": (["--pp", "2"], 2),
               "tp2-pp2-sp": (["--tp", "2", "--pp", "2", "--sequence-parallel"], 4),
               "dp2": (["--dp", "2"], 2), "dp2-ep2": (["--dp", "2", "--ep", "2"], 2), "cp2": (["--cp", "2"], 2),
               "baseline": (["--hf-baseline"], 1)}  # fmt: skip
    for name, (layout, nproc) in layouts.items():
        _ok(_train(tmp_path / name, *DEEPSEEK, *layout, nproc=nproc))
        assert _losses(tmp_path / name) == pytest.approx(one, rel=1e-5), name
    _ok(_train(tmp_path / "unbiased", *DEEPSEEK, "--expert-bias-rate", "0"))
    assert _losses(tmp_path / "unbiased")[1:] != pytest.approx(one[1:], rel=1e-5)


DEEPSEEK_V32 = ["--hf", "deepseek_v32", *DEEPSEEK[2:]]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_deepseek_v3_2_trains_its_sparse_attention(tmp_path):
    """--hf deepseek_v32: DeepSeek-V3's design with an indexer keeping each query's 16 top keys of 32. The single
    process's curve at tp=2 with sequence parallelism (the indexer's projections gathering their outputs as the
    latents do), through a pipeline, over two data-parallel ranks with the experts split over them, and as Hugging Face
    computes it (its eager attention keeping the same keys); --cp is refused by name."""
    _ok(_train(tmp_path / "one", *DEEPSEEK_V32))
    one = _losses(tmp_path / "one")
    layouts = {"tp2-sp": (["--tp", "2", "--sequence-parallel"], 2), "pp2": (["--pp", "2"], 2),
               "dp2-ep2": (["--dp", "2", "--ep", "2"], 2), "baseline": (["--hf-baseline"], 1)}  # fmt: skip
    for name, (layout, nproc) in layouts.items():
        _ok(_train(tmp_path / name, *DEEPSEEK_V32, *layout, nproc=nproc))
        assert _losses(tmp_path / name) == pytest.approx(one, rel=1e-5), name
    proc = _train(tmp_path / "cp2", *DEEPSEEK_V32, "--cp", "2", nproc=2)
    assert proc.returncode == 2 and "which under --cp 2 would score a rank's keys alone" in proc.stderr, proc.stderr
    # the indexer, which its model runs without gradients, has no AdamW state: saved as AdamW would start it, and the
    # run resumed from step 2 follows the uninterrupted one
    _ok(_train(tmp_path / "saved", *DEEPSEEK_V32, "--save-every", "2"))
    _copy_checkpoint(_checkpoint(tmp_path / "saved", 2), tmp_path / "resumed")
    _ok(_train(tmp_path / "resumed", *DEEPSEEK_V32, "--resume"))
    assert _losses(tmp_path / "resumed") == pytest.approx(one, rel=1e-6)


KIMI = ["--hf", "kimi_linear", *DEEPSEEK[2:]]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("family", ["kimi_linear", "bailing_hybrid"])
def test_kimi_linear_trains_its_delta_attention_in_every_layout(tmp_path, family):
    """--hf kimi_linear: three Kimi Delta Attention layers, then multi-head latent attention, experts balanced by their
    routing biases. The single process's curve at tp=2 with sequence parallelism, through a pipeline, over two
    data-parallel ranks with the experts split over them, over two context-parallel ranks (the delta attention by
    heads, the latent attention as the ring) and with tp=2 beside them, and as Hugging Face computes it; and Bailing's
    hybrid (full-rank gates, a gate per head on the latent attention's output) the same way."""
    run = ["--hf", family, *KIMI[2:]]
    _ok(_train(tmp_path / "one", *run))
    one = _losses(tmp_path / "one")
    layouts = {"tp2-sp": (["--tp", "2", "--sequence-parallel"], 2), "pp2": (["--pp", "2"], 2),
               "dp2-ep2": (["--dp", "2", "--ep", "2"], 2), "cp2": (["--cp", "2"], 2),
               "tp2-cp2-sp": (["--tp", "2", "--cp", "2", "--sequence-parallel"], 4),
               "baseline": (["--hf-baseline"], 1)}  # fmt: skip
    for name, (layout, nproc) in layouts.items():
        _ok(_train(tmp_path / name, *run, *layout, nproc=nproc))
        assert _losses(tmp_path / name) == pytest.approx(one, rel=1e-5), name


def test_deepseek_v3_2_takes_its_indexer_from_the_preset():
    """The indexer: the model's head count and head dim, a sixteenth of the block's keys; the FLOPs count those."""
    from tessel.bench.train_args import parse_args
    from tessel.bench.train_hf import _hf_config, attention_windows
    from tessel.layers.gpt import GPTConfig

    c = GPTConfig(vocab_size=256, n_layer=2, n_head=4, n_embd=64, block_size=256, mlp_hidden=96)
    config = _hf_config(parse_args(DEEPSEEK_V32), c, "sdpa")
    assert (config.index_n_heads, config.index_head_dim, config.index_topk) == (4, 16, 16)
    assert config.kv_lora_rank == 64 and attention_windows(config) == [16, 16]


def test_deepseek_v3_takes_its_shape_and_routing_from_the_options():
    from tessel.bench.train_args import parse_args
    from tessel.bench.train_hf import _hf_config
    from tessel.layers.gpt import GPTConfig

    args = parse_args([*DEEPSEEK[:4], "--top-k", "1", "--aux-loss-coef", "0", "--expert-groups", "2"])
    c = GPTConfig(vocab_size=256, n_layer=2, n_head=4, n_embd=64, block_size=64, mlp_hidden=96)
    config = _hf_config(args, c, "sdpa")
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_group, config.topk_group) == (4, 1, 2, 1)
    assert (config.moe_intermediate_size, config.n_shared_experts, config.first_k_dense_replace) == (96, 1, 1)
    # DeepSeek-V3's proportions to the head dim of 16: latents of 64 and 192, rotary keys of 8 beside 16
    latent = (config.kv_lora_rank, config.q_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim)
    assert latent == (64, 192, 8, 16)
    assert config.num_key_value_heads == 4 and config.v_head_dim == 16


def test_deepseek_v3_refuses_a_balancing_loss(tmp_path):
    proc = _train(tmp_path, *DEEPSEEK[:6], "--steps", "1")  # the default --aux-loss-coef 0.01
    assert proc.returncode == 2 and "balances its experts by their routing biases" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("extra", "nproc", "words"),
    [
        (["--experts", "0"], 1, "--hf mixtral is a mixture of experts: it needs --experts N"),
        (["--router-score", "sigmoid"], 1, "--hf mixtral trains without --router-score sigmoid"),
        (["--expert-bias-rate", "0.001"], 1, "--hf mixtral trains without --expert-bias-rate"),
    ],
)
def test_options_without_a_counterpart_are_refused(tmp_path, extra, nproc, words):
    proc = _train(tmp_path, *RUN, *extra, nproc=nproc)
    assert proc.returncode == 2 and PREFIX in proc.stderr and words in proc.stderr, proc.stderr


GPT_OSS = ["--hf", "gpt_oss", "--experts", "4", "--top-k", "2", "--aux-loss-coef", "0.1", "--sliding-window", "8",
           "--steps", "3", "--seq-len", "32", "--batch-size", "8", "--microbatches", "2"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiprocess
def test_gpt_oss_trains_its_curve_in_every_layout(tmp_path):
    """--hf gpt_oss: attention sinks, every other layer sliding over 8 keys, experts with biases and GPT-OSS's clamped
    SwiGLU, its balancing loss trained. Its plan splits the embedding alone; tessel splits its attention by heads
    (their sinks too) and its experts by features. The single process's curve as Hugging Face computes it (eager
    attention), at tp=2 with sequence parallelism, through a pipeline carrying the router sums, at cp=2 (the sinks
    joined to the ring's merged softmax; compiled, to its all-gather form's); over two data-parallel ranks (each
    balancing its own tokens) with the experts whole or split over them."""
    _ok(_train(tmp_path / "one", *GPT_OSS))
    one = _losses(tmp_path / "one")
    layouts = {"baseline": (["--hf-baseline"], 1), "tp2-sp": (["--tp", "2", "--sequence-parallel"], 2),
               "pp2": (["--pp", "2"], 2), "cp2": (["--cp", "2"], 2),
               "cp2-compiled": (["--cp", "2", "--compile", "aot_eager"], 2)}  # fmt: skip
    for name, (layout, nproc) in layouts.items():
        _ok(_train(tmp_path / name, *GPT_OSS, *layout, nproc=nproc))
        assert _losses(tmp_path / name) == pytest.approx(one, rel=1e-5), name
    _ok(_train(tmp_path / "dp2", *GPT_OSS, "--dp", "2", nproc=2))
    _ok(_train(tmp_path / "dp2-ep2", *GPT_OSS, "--dp", "2", "--ep", "2", nproc=2))
    assert _losses(tmp_path / "dp2-ep2") == pytest.approx(_losses(tmp_path / "dp2"), rel=1e-5)
    assert _losses(tmp_path / "dp2")[-1] < _losses(tmp_path / "dp2")[0]


def test_gpt_oss_takes_its_shape_and_windows_from_the_options():
    """Every other layer slides: over --sliding-window keys, or GPT-OSS's own 128; the FLOPs count each layer's keys."""
    from tessel.bench.train_args import parse_args
    from tessel.bench.train_hf import _hf_config, attention_windows, hf_flops_per_token
    from tessel.layers.gpt import GPTConfig

    c = GPTConfig(vocab_size=256, n_layer=4, n_head=4, n_embd=64, block_size=512, mlp_hidden=96)
    config = _hf_config(parse_args(GPT_OSS), GPTConfig(**{**c.__dict__, "sliding_window": 8}), "eager")
    assert (config.num_local_experts, config.num_experts_per_tok, config.intermediate_size) == (4, 2, 96)
    assert config.router_aux_loss_coef == 0.1 and config.output_router_logits
    assert attention_windows(config) == [8, None, 8, None]
    at = GPT_OSS.index("--sliding-window")
    own = _hf_config(parse_args(GPT_OSS[:at] + GPT_OSS[at + 2 :]), c, "eager")
    assert attention_windows(own) == [128, None, 128, None]
    # 12·E·(keys of every layer): two layers over min(S, W) keys, two over all S
    dense = hf_flops_per_token(10**6, c, 512, [None] * 4)
    assert dense - hf_flops_per_token(10**6, c, 512, [128, None, 128, None]) == 12 * 64 * 2 * (512 - 128)
    assert hf_flops_per_token(10**6, c, 512) == dense  # no window in c: every key of every layer
