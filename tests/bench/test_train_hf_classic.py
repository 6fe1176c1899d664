"""``python -m tessel.bench.train --hf gpt2 | opt | bloom``: the decoders Hugging Face gives no tensor-parallel plan,
split by :mod:`tessel.layers.hf_classic` (GPT-2's Conv1D layers and learned positions, OPT's MLP held by its layers,
BLOOM's ALiBi). Each trains the single process's curve as Hugging Face computes it, split over two ranks with
sequence parallelism and in two pipeline stages, and GPT-2 without sequence parallelism, over two
data-parallel ranks under ZeRO-2 and under FSDP, compiled, and at tp=2 × pp=2 with sequence parallelism.
"""

import importlib.util

import pytest

from tests.bench.test_train_hf import _check_hybrid_curves

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")

RUN = ["--steps", "3", "--seq-len", "32", "--batch-size", "8"]
LAYOUTS = {"baseline": (["--hf-baseline"], 1), "tp2-sp": (["--tp", "2", "--sequence-parallel"], 2)}
PIPELINED = {**LAYOUTS, "pp2": (["--pp", "2"], 2)}
# FSDP wraps each GPT-2 block (its layers are h, not layers), as --compile compiles each
GPT2_LAYOUTS = {**PIPELINED, "tp2": (["--tp", "2"], 2), "dp2": (["--dp", "2", "--zero", "2"], 2),
                "fsdp": (["--dp", "2", "--zero", "3"], 2),
                "tp2-sp-compiled": (["--tp", "2", "--sequence-parallel", "--compile", "aot_eager"], 2),
                "tp2-pp2-sp": (["--tp", "2", "--pp", "2", "--sequence-parallel"], 4)}  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("family", "name", "layouts"),
    [
        ("gpt2", "GPT2", GPT2_LAYOUTS),
        ("opt", "OPT", PIPELINED),
        ("bloom", "Bloom", PIPELINED),
        ("falcon", "Falcon", PIPELINED),
    ],
    ids=["gpt2", "opt", "bloom", "falcon"],
)
def test_classic_decoders_train_the_single_processs_curve(tmp_path, family, name, layouts):
    """The single process's curve (its Conv1D, fc1/fc2 and fused projections tessel's layers over one rank, the fused
    loss) as Hugging Face's own model computes it and in every layout, within 1e-5. BLOOM runs its own (eager)
    attention in every run: under tessel's attention implementation its mask would be tessel's None, and its attention,
    which computes itself, would see every key. Falcon (Falcon-40B's kv groups, attention beside the MLP) runs its own
    sdpa attention."""
    _check_hybrid_curves(tmp_path, ["--hf", family, *RUN], name, layouts)


@pytest.mark.parametrize(
    ("family", "words"),
    [("gpt2", "--hf gpt2 trains without --cp: its positions are not rotary"),
     ("falcon", "--hf falcon trains without --cp: its attention computes itself")],
)  # fmt: skip
def test_context_parallelism_is_refused(monkeypatch, family, words):
    from tessel.bench.train_args import ArgumentError, parse_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ArgumentError, match=words):
        parse_args(["--hf", family, *RUN, "--cp", "2"])


def test_the_flops_count_no_learned_positions():
    """GPT-2's and OPT's position embeddings are looked up, as the token embeddings are: 6·N counts neither."""
    from types import SimpleNamespace

    from tessel.bench.train_hf import _active_params
    from tessel.bench.train_hf_config import _classic_config
    from tessel.layers.gpt import GPTConfig

    c = GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=32)
    for family, positions in (("gpt2", "transformer.wpe.weight"), ("opt", "model.decoder.embed_positions.weight")):
        import transformers

        model = transformers.AutoModelForCausalLM.from_config(_classic_config(family, c, "eager"))
        params = dict(model.named_parameters())
        total = sum(p.numel() for p in params.values())
        assert _active_params(model, SimpleNamespace(hf=family)) == total - params[positions].numel(), family
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=4)  # fmt: skip
    llama = transformers.LlamaForCausalLM(config)
    assert _active_params(llama, SimpleNamespace(hf="llama")) == sum(p.numel() for p in llama.parameters())
