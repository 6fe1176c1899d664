"""``python -m tessel.bench.train --hf deepseek_v4``: DeepSeek-V4's design at the preset's shape trained through tessel.

Its attention split by heads in whole output groups (one key-and-value head and the compressors whole on every rank),
hyper-connections' residual streams between pipeline stages, a first layer routed by the token ids (a table drawn
from the seed), the others by ``sqrt(softplus)`` scores balanced by their routing biases and, optionally, Hugging
Face's balancing loss beside them. Each layout follows the single process's curve to fp32 rounding.
"""

import importlib.util

import pytest
import torch

from tests.bench.test_train import PREFIX, _losses, _ok, _train

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")

V4 = ["--hf", "deepseek_v4", "--experts", "4", "--top-k", "2", "--aux-loss-coef", "0.05", "--expert-bias-rate", "1e-2",
      "--sliding-window", "8", "--steps", "4", "--seq-len", "32", "--batch-size", "8"]  # fmt: skip


def _config(*extra, window=8):
    """The job's config of the tiny preset's shape, sliding over ``window`` keys (the run's --sliding-window)."""
    from tessel.bench.train_args import parse_args
    from tessel.bench.train_hf_config import _hf_config
    from tessel.layers.gpt import GPTConfig

    c = GPTConfig(vocab_size=256, n_layer=4, n_head=4, n_embd=64, block_size=256, mlp_hidden=96, sliding_window=window)
    return _hf_config(parse_args([*V4[:12], *extra]), c, "eager")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_deepseek_v4_trains_the_single_processs_curve_in_every_layout(tmp_path):
    """With a sliding window of 8 over 32 tokens (keys compressed 4 to 1, kept by the indexer, or 8 to 1), its biases
    moving and a balancing loss: the single process's curve (2 microbatches) at tp=2 and tp=4 with sequence
    parallelism (each rank's token ids for its hash-routed layer), through a pipeline, both (the residual streams
    between stages), over two data-parallel ranks with the experts split over them (a microbatch each: the balancing
    loss is the same microbatches'), over two context-parallel ranks and with tp=2 or pp=2 beside them (the
    compressors compressing the gathered sequence), and as Hugging Face computes it (its eager attention, its loss).
    The routing biases and the balancing loss each shape that curve."""
    run = [*V4, "--microbatches", "2"]
    _ok(_train(tmp_path / "one", *run))
    one = _losses(tmp_path / "one")
    layouts = {"tp2-sp": (["--tp", "2", "--sequence-parallel"], 2), "tp4-sp": (["--tp", "4", "--sequence-parallel"], 4),
               "pp2": (["--pp", "2"], 2), "tp2-pp2-sp": (["--tp", "2", "--pp", "2", "--sequence-parallel"], 4),
               "dp2-ep2": (["--dp", "2", "--ep", "2", "--microbatches", "1"], 2), "cp2": (["--cp", "2"], 2),
               "tp2-cp2-sp": (["--tp", "2", "--cp", "2", "--sequence-parallel"], 4),
               "pp2-cp2": (["--pp", "2", "--cp", "2"], 4),
               "baseline": (["--hf-baseline"], 1)}  # fmt: skip
    for name, (layout, nproc) in layouts.items():
        _ok(_train(tmp_path / name, *run, *layout, nproc=nproc, timeout=600))
        assert _losses(tmp_path / name) == pytest.approx(one, rel=1e-5), name
    for name, change in {"unbiased": ["--expert-bias-rate", "0"], "unbalanced": ["--aux-loss-coef", "0"]}.items():
        _ok(_train(tmp_path / name, *run, *change))
        assert _losses(tmp_path / name)[1:] != pytest.approx(one[1:], rel=1e-5), name


def test_deepseek_v4_takes_its_proportions_from_the_preset():
    """Heads of the preset's head dim (16) with an eighth rotary, a query latent of a quarter of the width, an output
    group per head projected to a quarter of its width; the window of --sliding-window (128 without), compressions 4
    to 1 and a window to 1; the indexer's heads the model's, keeping a sixty-fourth of the block; two heavily
    compressed layers then alternating; the first layer routed by the token ids; the preset's rotary base for the
    sliding keys, V4's for the compressed ones; its experts and balancing loss from the options."""
    config = _config()
    assert (config.head_dim, config.qk_rope_head_dim, config.num_key_value_heads, config.q_lora_rank) == (16, 2, 1, 16)
    assert (config.o_groups, config.o_lora_rank, config.hc_mult) == (4, 4, 4)
    assert config.sliding_window == 8 and _config(window=32).sliding_window == 32
    assert config.compress_rates == {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}
    assert (config.index_n_heads, config.index_head_dim, config.index_topk) == (4, 16, 4)
    hca, csa = "heavily_compressed_attention", "compressed_sparse_attention"
    assert config.layer_types == [hca, hca, hca, csa] and config.mlp_layer_types == ["hash_moe", "moe", "moe", "moe"]
    assert config.rope_parameters["main"]["rope_theta"] == 10000.0
    assert config.rope_parameters["compress"]["rope_theta"] == 160000.0
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_shared_experts) == (4, 2, 1)
    assert config.router_aux_loss_coef == 0.05 and config.output_router_logits


def test_deepseek_v4_slides_over_128_keys_without_a_window():
    from tessel.bench.train_args import parse_args
    from tessel.bench.train_hf_config import _hf_config
    from tessel.layers.gpt import GPTConfig

    c = GPTConfig(vocab_size=256, n_layer=2, n_head=4, n_embd=64, block_size=256, mlp_hidden=96)
    config = _hf_config(parse_args([*V4[:10], "--aux-loss-coef", "0"]), c, "eager")
    assert config.sliding_window == 128 and config.compress_rates["heavily_compressed_attention"] == 128
    assert not config.output_router_logits


def test_flops_count_the_window_and_the_compressed_keys():
    """Per layer ``min(S, W)`` keys of the window plus ``S/m`` heavily compressed keys, or the indexer's top ``k`` of
    the ``S/4`` compressed ones: at S=64, W=8, k=4: 8+8, 8+8, 8+8, 8+4."""
    from tessel.bench.train_hf import attention_windows, compressed_keys, hf_flops_per_token
    from tessel.layers.gpt import GPTConfig

    config = _config()
    assert attention_windows(config) == [8] * 4 and compressed_keys(config, 64) == [8, 8, 8, 4]
    assert compressed_keys(config, 16) == [2, 2, 2, 4]  # 16/8 heavily compressed; top 4 of 16/4
    c = GPTConfig(vocab_size=256, n_layer=4, n_head=4, n_embd=64, block_size=256)
    flops = hf_flops_per_token(1000, c, 64, attention_windows(config), None, compressed_keys(config, 64))
    assert flops == 6 * (1000 - 256 * 64) + 12 * 64 * (16 + 16 + 16 + 12)
    assert compressed_keys(_llama(), 64) is None
    # the job's count: its active parameters, the window of --sliding-window and the compressed keys at --seq-len
    from tessel.bench.train_args import parse_args
    from tessel.bench.train_hf import _active_params, build_hf
    from tessel.parallel import init_parallel

    args = parse_args(V4)
    c = GPTConfig(vocab_size=256, n_layer=4, n_head=4, n_embd=64, block_size=256, mlp_hidden=96, sliding_window=8)
    model, _, flops = build_hf(args, c, init_parallel(), torch.float32)
    active = _active_params(model, args)
    assert flops == 6 * (active - 256 * 64) + 12 * 64 * 4 * (8 + 4)  # S=32: 32/8 = 4 keys, or the top 4 of 32/4


def _llama():
    import transformers

    return transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2)


def test_hash_routes_are_drawn_from_the_seed():
    """Each token id's k distinct experts, uniformly from the seed (Hugging Face's table is zeros): the same table
    from the same seed, another from another; the job's model holds it."""
    import transformers

    from tessel.bench.train_args import parse_args
    from tessel.bench.train_hf import build_hf, draw_hash_routes
    from tessel.layers.gpt import GPTConfig
    from tessel.parallel import init_parallel

    model = transformers.DeepseekV4ForCausalLM(_config())
    table = model.model.layers[0].mlp.gate.tid2eid
    assert not table.any()
    draw_hash_routes(model, 3)
    first = table.clone()
    assert first.shape == (256, 2) and first.min() >= 0 and first.max() < 4
    assert (first[:, 0] != first[:, 1]).all(), "an id's experts are distinct"
    assert set(first.flatten().tolist()) == {0, 1, 2, 3}
    draw_hash_routes(model, 3)
    assert torch.equal(table, first)
    draw_hash_routes(model, 4)
    assert not torch.equal(table, first)
    c = GPTConfig(vocab_size=256, n_layer=2, n_head=4, n_embd=64, block_size=256, mlp_hidden=96)
    built, _, _ = build_hf(parse_args(V4), c, init_parallel(), torch.float32)
    assert built.model.layers[0].mlp.gate.tid2eid.any()


@pytest.mark.parametrize(
    ("extra", "words"),
    [(["--expert-groups", "2"], "routes each token among all its experts: --expert-groups 2 limits"),
     (["--kv-heads", "2"], "trains without --kv-heads"),
     (["--doc-sep", "\\n\\n"], "compresses each row's keys whole, across the documents packed into it")],
    ids=["expert-groups", "kv-heads", "documents"],
)  # fmt: skip
def test_options_it_has_no_counterpart_for_are_refused(tmp_path, extra, words):
    proc = _train(tmp_path, *V4, *extra)
    assert proc.returncode == 2 and PREFIX in proc.stderr and words in proc.stderr, proc.stderr
