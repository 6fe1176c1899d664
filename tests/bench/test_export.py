"""``python -m tessel.bench.export``: a training checkpoint written as a model Hugging Face loads (or tessel's own).

The exported model is checked by what loads it: ``from_pretrained`` with no missing or unexpected keys, its tensors
those the checkpoint holds, its logits those of tessel's GPT the checkpoint makes; a checkpoint written under tensor
parallelism (each rank its shards) exports the model the single process trains.
"""

import importlib.util
import json
from dataclasses import asdict

import pytest
import torch

from tessel.bench.checkpoint import CheckpointError, save_checkpoint
from tessel.bench.export import ExportError, export, main
from tessel.layers import GPT, GPTConfig
from tessel.layers.gpt_llama import llama_design
from tests.bench.test_train import _ok, _train

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")

RUN = ["--steps", "2", "--seq-len", "32", "--batch-size", "4", "--save-every", "2"]


def _from_pretrained(path, **kw):
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", output_loading_info=True, **kw
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    return model.eval()


def _gpt_checkpoint(root, config: GPTConfig, dtype: str = "fp32", seed: int = 0):
    """A checkpoint as the job writes it (``model.<name>`` fp32 tensors, the config in the manifest) of a GPT drawn
    from ``seed``, its norms moved off their initial ones; returns the GPT."""
    torch.manual_seed(seed)
    gpt = GPT(config).eval()
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.rand_like(p))
    state = {f"model.{n}": p.detach().clone() for n, p in gpt.named_parameters()}
    save_checkpoint(root, 1, state, {"model": asdict(config), "run": {"dtype": dtype}})
    return gpt


def _logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize(
    "config, family",
    [
        (GPTConfig(n_layer=2, n_head=4, n_embd=64), "LlamaForCausalLM"),
        (GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, bias=True, rope_theta=500.0), "LlamaForCausalLM"),
        (GPTConfig(n_layer=2, n_head=4, n_kv_head=1, n_embd=64, mlp_hidden=96, norm_eps=1e-6), "LlamaForCausalLM"),
        (GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, sliding_window=7), "MistralForCausalLM"),
    ],
    ids=["mha", "gqa-bias-theta", "mqa-width-eps", "window"],
)
def test_a_gpt_of_llamas_design_exports_as_llama(tmp_path, config, family):
    gpt = _gpt_checkpoint(tmp_path / "ck", config)
    export(tmp_path / "ck", tmp_path / "hf")
    model = _from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == family
    ids = torch.randint(0, config.vocab_size, (2, 29), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_logits(model, ids), _logits(gpt, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "config",
    [GPTConfig(n_layer=2, n_head=4, n_embd=64, mlp="gelu", norm="layernorm", bias=True),
     GPTConfig(n_layer=2, n_head=4, n_embd=64, n_expert=4, top_k=2),
     GPTConfig(n_layer=2, n_head=4, n_embd=64, bias=True, sliding_window=4)],
    ids=["gelu-layernorm", "experts", "bias-window"],
)  # fmt: skip
def test_other_gpts_export_as_tessels_own(tmp_path, config):
    assert llama_design(config) is not None
    gpt = _gpt_checkpoint(tmp_path / "ck", config, dtype="bf16")
    export(tmp_path / "ck", tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.pt"]
    loaded = GPT(GPTConfig(**json.loads((tmp_path / "out" / "config.json").read_text())))
    state = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    assert {v.dtype for v in state.values()} == {torch.bfloat16}  # the run's dtype
    loaded.load_state_dict(state)
    for (name, got), want in zip(loaded.named_parameters(), gpt.parameters(), strict=True):
        assert torch.equal(got, want.to(torch.bfloat16).float()), name


def test_a_hugging_face_run_exports_its_family(tmp_path):
    """``--hf qwen3_moe --experts 4``: the job's checkpoint (tessel's attention and experts) exported as the family
    Hugging Face makes, naming its own implementations, every tensor the checkpoint's; ``--dtype`` casts them."""
    _ok(_train(tmp_path / "run", "--hf", "qwen3_moe", "--experts", "4", *RUN))
    assert main([str(tmp_path / "run"), str(tmp_path / "hf")]) == 0  # the run's --out: its latest checkpoint
    model = _from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.num_experts == 4
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "tessel" not in json.dumps(config) and config["dtype"] == "float32"
    from tessel.bench.export import _read_model

    saved = _read_model(next((tmp_path / "run" / "checkpoints").iterdir()))
    assert saved.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved[name]), name
    assert main([str(tmp_path / "run"), str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    model = _from_pretrained(tmp_path / "bf16", dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("family", "extra"),
    [("olmo2", []), ("bamba", []), ("gemma4", []), ("gemma4", ["--kv-shared-layers", "2"]),
     ("kimi_linear", ["--experts", "4", "--aux-loss-coef", "0"]),
     ("deepseek_v32", ["--experts", "4", "--aux-loss-coef", "0"]), ("gpt2", []), ("phi3", ["--kv-heads", "1"]),
     ("deepseek_v4", ["--experts", "4", "--aux-loss-coef", "0", "--sliding-window", "8"])],
    ids=["olmo2", "bamba", "gemma4", "gemma4-kv-shared", "kimi_linear", "deepseek_v32", "gpt2", "phi3-one-kv-head",
         "deepseek_v4"],
)  # fmt: skip
def test_a_tensor_parallel_checkpoint_exports_the_single_processs_model(tmp_path, family, extra):
    """Saved at tp=2 with sequence parallelism (each rank its heads' shards, OLMo 2's q/k norms split with the heads,
    Bamba's Mamba-2 mixers by heads, Gemma 4's wider full-attention heads and per-layer input gates, and its last
    layers reusing earlier ones' keys and values, which the checkpoint records; Kimi Linear's delta attention and
    DeepSeek-V3.2's indexer beside latent attention and experts; GPT-2's Conv1D weights, trained as nn.Linear's,
    transposed back; Phi-3's one kv head, a copy in each rank's fused qkv_proj; DeepSeek-V4's grouped output
    projections, whole compressors and the table of its hash-routed layer): the exported model is the one the
    single process trains. (Two Adam steps
    magnify fp32 rounding where a gradient is near zero: one element in a few thousand moves by up to ~1e-4, or more
    of them, each by less than 1e-4, in DeepSeek-V4's hyper-connections, whose gradients are small; heads or features
    out of place would move a quarter of a tensor or more, by the weights' scale or by Adam's steps.)"""
    run = ["--hf", family, *RUN, *extra]
    _ok(_train(tmp_path / "one", *run))
    if "--kv-shared-layers" in extra:  # a checkpoint of another model: refused on resume
        proc = _train(tmp_path / "one", "--hf", family, *RUN, "--steps", "3", "--resume")
        assert proc.returncode != 0 and "kv_shared_layers=2 (this run: 0)" in proc.stderr, proc.stderr
    _ok(_train(tmp_path / "tp2", *run, "--tp", "2", "--sequence-parallel", nproc=2))
    export(tmp_path / "one", tmp_path / "one-hf")
    export(tmp_path / "tp2", tmp_path / "tp2-hf")
    one, tp2 = _from_pretrained(tmp_path / "one-hf"), _from_pretrained(tmp_path / "tp2-hf")
    assert getattr(tp2.config, "num_kv_shared_layers", 0) == (2 if "--kv-shared-layers" in extra else 0)
    for (name, a), b in zip(one.state_dict().items(), tp2.state_dict().values(), strict=True):
        off = ((b - a).abs() > 1e-5 + 1e-4 * a.abs()).float().mean().item()
        near = (b - a).abs().max().item() <= 1e-4  # a thirtieth of one Adam step (lr 3e-3) in every element
        assert a.shape == b.shape and (off <= 1e-3 or near), f"{name}: {off:.2%} of its elements differ"
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_logits(tp2, ids), _logits(one, ids), rtol=1e-3, atol=1e-3)


def test_bad_input_is_refused_before_anything_is_written(tmp_path):
    config = GPTConfig(n_layer=2, n_head=4, n_embd=64)
    _gpt_checkpoint(tmp_path / "ck", config)
    step = next((tmp_path / "ck").iterdir())
    with pytest.raises(ExportError, match="dtype must be one of fp32, bf16, fp16, received 'fp8'"):
        export(step, tmp_path / "a", dtype="fp8")
    with pytest.raises(ExportError, match=r"checkpoint must be a checkpoint directory, their root or a run.s --out"):
        export(tmp_path, tmp_path / "a")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ExportError, match="out must be a new or empty directory"):
        export(step, tmp_path / "full")
    assert not (tmp_path / "a").exists()
    # the manifest records another model than the tensors
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["model"]["n_layer"] = 3
    (step / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match=r"missing \['blocks.2.attn.proj.weight'"):
        export(step, tmp_path / "a")
    # the manifest's hash no longer matches: refused as a corrupted checkpoint
    data = next(step.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match="truncated"):
        export(step, tmp_path / "a")
    assert not (tmp_path / "a").exists()
    assert main([str(step), str(tmp_path / "a")]) == 1
    assert main([str(tmp_path), str(tmp_path / "a")]) == 2


def _first_batch_loss(hf_dir, argv) -> float:
    """The exported model's mean cross entropy (Hugging Face's own forward) on the job's first batch of ``argv``."""
    from tessel.bench.dataset import ByteDataset
    from tessel.bench.train_args import parse_args

    args = parse_args(argv)
    data = ByteDataset(args.data, seq_len=args.seq_len, val_fraction=args.val_fraction, tokens=args.tokens)
    x, y = data.batch(0, seed=args.seed, batch_size=args.batch_size)
    logits = _logits(_from_pretrained(hf_dir), x)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_run_starts_from_an_exported_model(tmp_path):
    """--init: the job builds its model on the meta device, splits it and reads each rank's shards of a Hugging Face
    checkpoint (here tessel's GPT trained two steps, exported as a Llama): its first loss is the exported model's
    on the first batch, for tessel's GPT alone and at tp=2 with sequence parallelism, and for --hf llama."""
    run = ["--steps", "1", "--seq-len", "32", "--batch-size", "4"]
    _ok(_train(tmp_path / "trained", *RUN))
    export(tmp_path / "trained", tmp_path / "hf")
    want = _first_batch_loss(tmp_path / "hf", run)
    from tests.bench.test_train import _losses

    init = ["--init", str(tmp_path / "hf"), *run]
    _ok(_train(tmp_path / "gpt", *init))
    _ok(_train(tmp_path / "gpt-tp2", *init, "--tp", "2", "--sequence-parallel", nproc=2))
    _ok(_train(tmp_path / "llama-tp2", "--hf", "llama", *init, "--tp", "2", nproc=2))
    for name in ("gpt", "gpt-tp2", "llama-tp2"):
        assert _losses(tmp_path / name)[0] == pytest.approx(want, rel=1e-5), name
    untrained = _train(tmp_path / "fresh", *run)
    assert _losses(tmp_path / "fresh")[0] != pytest.approx(want, rel=1e-3) and untrained.returncode == 0


def test_init_refuses_what_does_not_fit(tmp_path):
    from tests.bench.test_train import PREFIX

    missing = _train(tmp_path / "a", "--init", str(tmp_path / "nothing"), "--steps", "1")
    assert missing.returncode == 2 and f"{PREFIX}--init must be a Hugging Face checkpoint directory" in missing.stderr
    _gpt_checkpoint(tmp_path / "ck", GPTConfig(n_layer=2, n_head=4, n_embd=64))  # not the tiny preset's shape
    export(tmp_path / "ck", tmp_path / "hf")
    other = _train(tmp_path / "b", "--init", str(tmp_path / "hf"), "--steps", "1")
    assert other.returncode == 2 and f"{PREFIX}--init {tmp_path / 'hf'}: load_pretrained: " in other.stderr
