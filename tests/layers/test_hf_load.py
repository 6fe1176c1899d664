"""``load_pretrained``: a model built on the meta device, ``parallelize``d, then filled from a Hugging Face checkpoint,
each rank reading its own shards: every tensor equal to the one ``parallelize`` makes of the dense model, and the
logits and every gradient those of the dense model (test_hf.py's check).

Among the families, those ``parallelize`` probes: Phi-3's fused gate/up (whether its activation pairs the halves
feature by feature) and Nemotron's LayerNorm1P (``weight + 1``, kept as it is); on the meta device the probe runs on a
copy with random values. Without that, Nemotron's norm would become tessel's plain LayerNorm: wrong logits.
"""

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.layers.test_hf import REFERENCE_KERNELS, _check_against_dense, needs_hf
from tests.layers.test_hf_classic import CLASSIC, classic_model
from tests.layers.test_hf_classic import VARIANTS as CLASSIC_VARIANTS
from tests.multiprocess import run_ranks

FAMILIES = ("llama", "qwen3", "olmo2", "phi3", "nemotron", "gemma", "gemma3_text", "gpt_oss", "apertus")
HYBRIDS = ("bamba", "qwen3_5_text", "mamba", "lfm2", "falcon_h1", "falcon_h1:2", "zamba2")
# checkpoints transformers converts as it loads them: experts stored one by one (stacked, gate beside up), renamed
# modules (Mixtral's block_sparse_moe, Granite-MoE's packed experts, Nemotron-H's backbone), fused tensors it splits
# into the model's (Sarvam-MoE's query_key_value, LaraMini's in_proj)
CONVERTED = ("qwen3_moe", "mixtral", "granitemoe", "deepseek_v3", "sarvam_moe")
CONVERTED_HYBRIDS = ("jamba", "minimax", "nemotron_h", "lara_mini")
# multi-head latent attention (GLM-4.7-Flash, MiniCPM3), with a sparse attention's indexer (DeepSeek-V3.2, GLM-5), and
# linear attention beside experts (Qwen3.5-MoE's, Kimi Linear's)
LATENT = ("glm4_moe_lite", "minicpm3", "deepseek_v32", "glm_moe_dsa", "qwen3_5_moe_text", "kimi_linear",
          "bailing_hybrid")  # fmt: skip


def _dense(kind: str):
    from tests.layers.test_hf_experts import _moe
    from tests.layers.test_hf_families import BAILING, FAMILY_CONFIGS, KIMI, SPARSE, SPARSE_FAMILIES, family_model
    from tests.layers.test_hf_mixer_context import hybrid_model

    if kind in (*CLASSIC, *CLASSIC_VARIANTS):
        return classic_model(kind)
    if kind == "deepseek_v3":  # multi-head latent attention, a dense first layer, shared and routed experts
        return _moe(kind)
    if kind == "deepseek_v4":  # its attention split by heads in whole output groups, its checkpoint's own names
        from tests.layers.test_hf_deepseek_v4 import _v4

        return _v4()
    if kind == "dbrx":  # fused GQA attention, experts stacked in 2-d weights
        from tests.layers.test_hf_unsplit import dbrx

        return dbrx()
    if kind in SPARSE_FAMILIES:
        return family_model(kind, **SPARSE)
    if kind in ("kimi_linear", "bailing_hybrid"):
        return family_model(kind, **(KIMI if kind == "kimi_linear" else BAILING))
    if kind in (*HYBRIDS, *CONVERTED_HYBRIDS):
        return hybrid_model(kind)
    return family_model(kind, **FAMILY_CONFIGS.get(kind, {}))


def _saved(dense, path, rank, **kw):
    """``dense`` written by rank 0 with ``save_pretrained(**kw)``, read by every rank once it is there."""
    if rank == 0:
        dense.save_pretrained(path, **kw)
    dist.barrier()
    return path


def _on_meta(dense):
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(dense.config))  # parallelize edits it


def _assert_same_tensors(got, want, tag):
    got_state, want_state = got.state_dict(), want.state_dict()
    assert got_state.keys() == want_state.keys(), tag
    for name, value in want_state.items():
        assert torch.equal(got_state[name], value), f"{tag}: {name}"
    for (name, value), other in zip(want.named_buffers(), got.buffers(), strict=True):  # non-persistent ones too
        assert torch.equal(other, value), f"{tag}: {name}"


def _families_ranks(rank, world_size, kinds, root, layouts=({}, {"sequence_parallel": True})):
    from tessel.layers import load_pretrained, parallelize

    for kind in kinds:
        dense = _dense(kind)
        path = _saved(dense, f"{root}/{kind}", rank)
        for kw in layouts:
            model = parallelize(_on_meta(dense), None, **kw)
            assert all(p.is_meta for p in model.parameters())
            assert load_pretrained(model, path) is model
            assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
            _assert_same_tensors(model, parallelize(copy.deepcopy(dense), None, **kw), f"{kind} {kw}")
            _check_against_dense(copy.deepcopy(dense), model.eval(), f"{kind} {kw}")
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_split_on_the_meta_device_then_loaded_equals_the_split_dense_model(tmp_path):
    assert run_ranks(_families_ranks, 2, FAMILIES, str(tmp_path), timeout=900, env=REFERENCE_KERNELS) == ["ok"] * 2


@pytest.mark.multiprocess
@needs_hf
def test_hybrids_split_on_the_meta_device_load_their_mixers(tmp_path):
    """Bamba's Mamba-2 mixers (B and C gathered over the ranks of their one group), Qwen3.5's Gated DeltaNet, Mamba's
    Mamba-1 (x_proj a shared row layer), LFM2's short convolutions: their split parameters are read by their tags.
    Falcon-H1's per-feature multipliers, a buffer its model computes from the config: computed whole by the model's
    own initialisation, then cut to this rank's features (its B and C those of the one group it shares, or its
    own of two). Zamba 2's hybrid layers, whose MLP's split is probed on a copy with random values."""
    assert run_ranks(_families_ranks, 2, HYBRIDS, str(tmp_path), timeout=900, env=REFERENCE_KERNELS) == ["ok"] * 2


@pytest.mark.multiprocess
@needs_hf
def test_checkpoints_that_transformers_converts_load_by_slices_of_their_stored_tensors(tmp_path):
    """Experts stored one by one are read as the stacked tensor transformers makes of them (gate beside up), each
    rank reading its share of every expert's features, or with ``expert_split="experts"`` its experts' rows alone;
    renamed modules under the names transformers gives them; a fused tensor as the pieces transformers splits it
    into (Sarvam-MoE's q, k and v of different sizes; LaraMini's four in_proj parts), each rank reading its slices of
    each piece."""
    layouts = ({}, {"sequence_parallel": True}, {"expert_split": "experts"})
    moe = run_ranks(_families_ranks, 2, CONVERTED, str(tmp_path), layouts, timeout=900, env=REFERENCE_KERNELS)
    assert moe == ["ok"] * 2
    hybrids = run_ranks(_families_ranks, 2, CONVERTED_HYBRIDS, str(tmp_path), timeout=900, env=REFERENCE_KERNELS)
    assert hybrids == ["ok"] * 2


@pytest.mark.multiprocess
@needs_hf
def test_latent_attention_and_hybrid_mixtures_load_by_slices(tmp_path):
    """GLM-4.7-Flash, MiniCPM3, DeepSeek-V3.2 and GLM-5 (their latents and the indexer replicated, the heads split,
    the experts by features or by experts), Qwen3.5-MoE (Gated DeltaNet split by heads beside experts) and Kimi Linear
    (Kimi Delta Attention's per-head decay parameters, A_log split along its third dim) and Bailing's hybrid: split on
    the meta device with and without sequence parallelism, then loaded, equal to the split dense model."""
    layouts = ({}, {"sequence_parallel": True}, {"expert_split": "experts"})
    assert (
        run_ranks(_families_ranks, 2, LATENT, str(tmp_path), layouts, timeout=900, env=REFERENCE_KERNELS) == ["ok"] * 2
    )


@pytest.mark.multiprocess
@needs_hf
def test_deepseek_v4_loads_its_checkpoints_names(tmp_path):
    """DeepSeek-V4's checkpoint keeps DeepSeek's names (``attn.wq_b``, ``attn.norm`` for the key-and-value norm,
    experts one by one), which transformers renames as it loads them; its final ``model.norm`` keeps its name, as
    transformers leaves a key that the renaming would take away from the model's. Each rank reads its heads' rows and
    output groups, its share of every expert's features or its experts alone, with and without sequence parallelism."""
    layouts = ({}, {"sequence_parallel": True}, {"expert_split": "experts"})
    assert run_ranks(_families_ranks, 2, ("deepseek_v4",), str(tmp_path), layouts, timeout=600,
                     env=REFERENCE_KERNELS) == ["ok"] * 2  # fmt: skip


@pytest.mark.multiprocess
@needs_hf
def test_dbrx_loads_its_stacked_experts_by_slices(tmp_path):
    """DBRX split on the meta device (its fused ``Wqkv`` by heads of each part, its experts' ``[E·I, H]`` weights by
    each expert's rows), with and without sequence parallelism, then loaded: each rank reads its slices alone, equal to
    the split dense model."""
    assert run_ranks(_families_ranks, 2, ("dbrx",), str(tmp_path), timeout=600, env=REFERENCE_KERNELS) == ["ok"] * 2


@pytest.mark.multiprocess
@needs_hf
def test_classic_decoders_split_on_the_meta_device_load_their_weights(tmp_path):
    """GPT-2 (its Conv1D weights [in, out], split as nn.Linear's [out, in], read transposed), BLOOM, Falcon, MPT, OPT
    and Persimmon split on the meta device with and without sequence parallelism, then loaded, equal to the split
    dense model."""
    kinds = ("gpt2", "bloom", "falcon", "mpt", "opt", "persimmon")
    assert run_ranks(_families_ranks, 2, kinds, str(tmp_path), timeout=900, env=REFERENCE_KERNELS) == ["ok"] * 2


def _transposed_ranks(rank, world_size, root):
    """Qwen3-VL-MoE's experts as its published checkpoints store them, ``[experts, hidden, 2 x intermediate]``:
    transformers transposes them as it loads them (``Transpose(1, 2)``); each rank reads its slices of the swapped
    dims (or its experts' rows), the vision tower whole."""
    import safetensors.torch
    import transformers

    from tessel.layers import load_pretrained, parallelize

    text = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, deepstack_visual_indexes=[0])  # fmt: skip
    config = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    dense = transformers.Qwen3VLMoeForConditionalGeneration(config).eval()
    path = f"{root}/qwen3_vl_moe"
    if rank == 0:
        dense.save_pretrained(path)
        (file,) = Path(path).glob("*.safetensors")
        state = safetensors.torch.load_file(file)
        experts = [k for k in state if ".experts." in k]
        assert experts and all(state[k].shape[1:] == (48, 64) for k in experts if "gate_up" in k)  # as the model
        state.update({k: state[k].transpose(1, 2).contiguous() for k in experts})
        safetensors.torch.save_file(state, file, metadata={"format": "pt"})
    dist.barrier()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    for kw in ({}, {"expert_split": "experts"}):
        with torch.device("meta"):
            meta = transformers.Qwen3VLMoeForConditionalGeneration(copy.deepcopy(config))
        model = load_pretrained(parallelize(meta, None, **kw), path)
        _assert_same_tensors(model, parallelize(copy.deepcopy(dense), None, **kw), f"qwen3_vl_moe {kw}")
        torch.testing.assert_close(model.eval()(ids).logits, dense(ids).logits, rtol=1e-4, atol=1e-5)
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_experts_stored_transposed_load_by_slices_of_the_swapped_dims(tmp_path):
    assert run_ranks(_transposed_ranks, 2, str(tmp_path), timeout=600, env=REFERENCE_KERNELS) == ["ok"] * 2


def _gemma4_ranks(rank, world_size, root):
    from tessel.layers import load_pretrained, parallelize
    from tests.layers.test_hf_families import GEMMA4_VARIANTS, _check_against_float64, gemma4_model

    for i, (variant, kw) in enumerate(GEMMA4_VARIANTS.items()):
        dense = gemma4_model(**kw)
        path = _saved(dense, f"{root}/gemma4-{i}", rank)
        for sp in (False, True):
            model = load_pretrained(parallelize(_on_meta(dense), None, sequence_parallel=sp), path)
            _assert_same_tensors(model, parallelize(copy.deepcopy(dense), None, sequence_parallel=sp), variant)
            _check_against_float64(copy.deepcopy(dense), model.eval(), f"gemma4 {variant} sp={sp}")
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_gemma4_loads_its_per_layer_inputs_and_experts_beside_the_mlp(tmp_path):
    """Gemma 4 (its per-layer input embedding and projection, experts in the layer beside the MLP, keys as values):
    split on the meta device with and without sequence parallelism, then loaded, against float64."""
    assert run_ranks(_gemma4_ranks, 2, str(tmp_path), timeout=600, env=REFERENCE_KERNELS) == ["ok"] * 2


def _expert_parallel_ranks(rank, world_size, root):
    """Experts over an expert-parallel group (``parallelize(ep_group=)``): each rank reads its experts' rows of the
    stacked tensor, the slices of its experts' stored tensors alone."""
    from tessel.layers import load_pretrained, parallelize
    from tests.layers.test_hf_expert_parallel import _check, _groups
    from tests.layers.test_hf_experts import _moe

    groups = _groups(rank, world_size, 1, 2)
    tp_group, ep_group = groups[0], groups[2]
    for family in ("mixtral", "qwen3_moe"):
        dense = _moe(family)
        path = _saved(dense, f"{root}/{family}", rank)
        model = load_pretrained(parallelize(_on_meta(dense), tp_group, ep_group=ep_group), path, tp_group)
        experts = [p for n, p in model.named_parameters() if ".experts." in n]
        assert experts and all(p.expert_range == (2 * rank, 2 * rank + 2) for p in experts)
        _assert_same_tensors(model, parallelize(copy.deepcopy(dense), tp_group, ep_group=ep_group), family)
        _check(copy.deepcopy(dense), model, groups, f"{family} ep=2")
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_expert_parallel_ranks_read_their_experts_alone(tmp_path):
    assert run_ranks(_expert_parallel_ranks, 2, str(tmp_path), timeout=600, env=REFERENCE_KERNELS) == ["ok"] * 2


def _four_ranks(rank, world_size, root):
    """tp=2 (sequence parallel) × cp=2: Llama's ring attention and Bamba's and Falcon-H1's mixers by heads over the cp
    ranks (which slice the replicated per-head parameters the loader put in place, and Falcon-H1's multipliers the
    loader computed), after each rank read its tensor-parallel shards."""
    from tessel.layers import load_pretrained, parallelize
    from tests.layers.test_context_parallel import _grid
    from tests.layers.test_hf_context_parallel import _check_against_dense as check_cp

    _, tp_group, cp_group = _grid(rank, world_size, 2)
    for kind in ("llama", "bamba", "falcon_h1"):
        dense = _dense(kind)
        path = _saved(dense, f"{root}/{kind}", rank, max_shard_size="100KB")  # several files and their index
        assert (Path(path) / "model.safetensors.index.json").is_file()
        kw = dict(cp_group=cp_group, sequence_parallel=True)
        model = load_pretrained(parallelize(_on_meta(dense), tp_group, **kw), path, tp_group)
        _assert_same_tensors(model, parallelize(copy.deepcopy(dense), tp_group, **kw), kind)
        check_cp(dense, model.eval(), tp_group, cp_group, f"{kind} tp=2 cp=2 sp")
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_tensor_and_context_parallel_models_load_on_four_ranks(tmp_path):
    assert run_ranks(_four_ranks, 4, str(tmp_path), timeout=900, env=REFERENCE_KERNELS) == ["ok"] * 4


def _llama(config, sliding_window=None, seed=0):
    """A Hugging Face Llama (Mistral with a window) of the GPT ``config``'s shape, random, norms off their ones."""
    import transformers

    from tessel.bench.export import _llama_config

    made = _llama_config(config, torch.float32)
    made.sliding_window = sliding_window
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(made, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.rand_like(p))
    return model


def _gpt_ranks(rank, world_size, root):
    """tessel's GPT built on the meta device, split over 2 ranks (with and without sequence parallelism) or whole,
    filled from a Llama (Mistral) checkpoint: the whole GPT's logits are the Llama's, each split GPT's tensors are the
    whole one's shards, and its vocabulary-split logits the whole ones' columns."""
    from tessel.layers import GPT, GPTConfig, load_pretrained
    from tessel.parallel.sharding import shard_like
    from tests.layers.test_context_parallel import _grid

    solo = _grid(rank, world_size, 1)[0]
    configs = [GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, bias=True, rope_theta=500.0, norm_eps=1e-6),
               GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, sliding_window=5)]  # fmt: skip
    for i, config in enumerate(configs):
        llama = _llama(config, config.sliding_window)
        path = _saved(llama, f"{root}/llama{i}", rank)
        ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
        whole = load_pretrained(GPT(config, tp_group=solo, device="meta"), path, solo).eval()
        with torch.no_grad():
            want = llama(ids).logits
            torch.testing.assert_close(whole(ids), want, rtol=1e-5, atol=1e-5)
        for sp in (False, True):
            split = load_pretrained(GPT(config, sequence_parallel=sp, device="meta"), path).eval()
            for (name, p), full in zip(split.named_parameters(), whole.parameters(), strict=True):
                assert torch.equal(p, shard_like(full, p, None)), name
            if not sp:
                with torch.no_grad():
                    v = config.vocab_size // world_size
                    torch.testing.assert_close(split(ids), want[..., rank * v : (rank + 1) * v], rtol=1e-5, atol=1e-5)
    # a checkpoint whose config computes otherwise is refused by name
    with pytest.raises(ValueError, match=r"the checkpoint.s rope_theta is 500.0, the GPT.s config asks for 10000.0"):
        load_pretrained(GPT(GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, bias=True), device="meta"),
                        f"{root}/llama0")  # fmt: skip
    with pytest.raises(ValueError, match=r"the GPT is not of Llama's design: mlp='gelu'"):
        load_pretrained(GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, mlp="gelu"), device="meta"), f"{root}/llama1")
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_tessels_gpt_loads_a_llama_checkpoint_split_or_whole(tmp_path):
    assert run_ranks(_gpt_ranks, 2, str(tmp_path), timeout=600, env=REFERENCE_KERNELS) == ["ok"] * 2


def _refusals_ranks(rank, world_size, root):
    import safetensors.torch

    from tessel.layers import load_pretrained, parallelize

    dense = _dense("llama")
    path = _saved(dense, f"{root}/llama", rank)

    def fresh():
        return parallelize(_on_meta(dense), None)

    def refused(error, match, *args, **kw):
        model = fresh()
        with pytest.raises(error, match=match):
            load_pretrained(model, *args, **kw)
        assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])  # nothing changed

    refused(ValueError, "path must be a Hugging Face checkpoint directory", f"{root}/nothing")
    refused(TypeError, "dtype must be a floating-point torch.dtype or None, received torch.int64", path,
            dtype=torch.int64)  # fmt: skip
    refused(ValueError, "device must be a torch.device or its name, received 'nowhere'", path, device="nowhere")
    refused(ValueError, "device must hold values, received the meta device", path, device="meta")
    refused(TypeError, "strict must be a bool, received 'yes'", path, strict="yes")
    with pytest.raises(ValueError, match="model must be on the meta device"):
        load_pretrained(parallelize(copy.deepcopy(dense), None), path)
    with pytest.raises(TypeError, match=r"model must be an nn.Module, received dict"):
        load_pretrained({}, path)
    state = safetensors.torch.load_file(f"{path}/model.safetensors")
    edited = f"{root}/edited-{rank}"
    import os

    os.makedirs(edited)
    # a tensor missing
    safetensors.torch.save_file({k: v for k, v in state.items() if k != "model.norm.weight"}, f"{edited}/a.safetensors")
    refused(ValueError, r"no tensor for 1 of the model's, e.g. \['model.norm.weight'\]", edited)
    # one of another shape (a config that is not the checkpoint's)
    wrong = {**state, "model.norm.weight": torch.ones(3)}
    safetensors.torch.save_file(wrong, f"{edited}/a.safetensors")
    refused(ValueError, r"model.norm.weight is \(64,\) in the model \(whole\), the checkpoint's model.norm.weight "
            r"makes \(3,\)", edited)  # fmt: skip
    # a tensor the model does not use: refused, or ignored with strict=False
    safetensors.torch.save_file({**state, "extra": torch.ones(2)}, f"{edited}/a.safetensors")
    refused(ValueError, r"holds 1 tensors the model does not use, e.g. \['extra'\]", edited)
    model = load_pretrained(fresh(), edited, strict=False, dtype=torch.float64)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    # a conversion tessel does not read by slices (rows interleaved), and a split whose pieces are not the model's
    from transformers import conversion_mapping, core_model_loading

    def convert(*operations):
        source, targets = "self_attn.qkv_proj", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
        return lambda model, *a, **kw: [core_model_loading.WeightConverter(source, targets, operations=operations)]

    attn = "model.layers.0.self_attn"
    parts = [state.pop(f"{attn}.{n}_proj.weight") for n in "qkv"]
    assert [len(part) for part in parts] == [64, 32, 32]
    safetensors.torch.save_file({**state, f"{attn}.qkv_proj.weight": torch.cat(parts)}, f"{edited}/a.safetensors")
    mapping = conversion_mapping.get_model_conversion_mapping
    try:
        conversion_mapping.get_model_conversion_mapping = convert(core_model_loading.Interleave(dim=0))
        refused(ValueError, r"q_proj.weight: transformers converts it by \['Interleave'\]", edited)
        conversion_mapping.get_model_conversion_mapping = convert(core_model_loading.Chunk(dim=0))  # not 64, 32, 32
        refused(ValueError, r"no tensor for 3 of the model's.*q_proj.weight: transformers converts it by \['Chunk'\]",
                edited)  # fmt: skip
        conversion_mapping.get_model_conversion_mapping = convert(core_model_loading.Split(dim=0))
        model = load_pretrained(fresh(), edited, dtype=torch.float64)  # read as the model's pieces
        assert torch.equal(model.model.layers[0].self_attn.k_proj.weight, parts[1].chunk(2)[rank].double())
    finally:
        conversion_mapping.get_model_conversion_mapping = mapping
    # a buffer neither the checkpoint nor the model's initialisation sets: refused after reading, undone
    model = fresh()
    model.model.norm.register_buffer("scale", torch.empty(3, device="meta"), persistent=False)
    with pytest.raises(ValueError, match=r"left the buffers \['model.norm.scale'\] unset"):
        load_pretrained(model, path)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_bad_input_is_refused_before_anything_changes(tmp_path):
    assert run_ranks(_refusals_ranks, 2, str(tmp_path), timeout=600, env=REFERENCE_KERNELS) == ["ok"] * 2


@pytest.mark.multiprocess
@needs_hf
def test_kv_heads_replicated_over_four_ranks_load_on_the_meta_device(tmp_path):
    """Llama's k_proj/v_proj and Phi-3's fused qkv_proj with 2 kv heads over 4 ranks: each kv head copied on the two
    ranks whose query heads read it (their copies' gradients summed in a process group of those two, made as the
    layers are built on the meta device), each rank reading its copy; the split dense model's tensors and gradients."""
    assert run_ranks(_families_ranks, 4, ("llama", "phi3"), str(tmp_path), timeout=600,
                     env=REFERENCE_KERNELS) == ["ok"] * 4  # fmt: skip
