"""``parallelize`` on Hugging Face hybrids whose layers mix tokens other than by attention
(:mod:`tessel.layers.hf_mixers`): Mamba-2 mixers split by heads (Bamba, Falcon-H1, Granite 4.0 hybrid, Nemotron-H),
with their groups of B and C whole on each rank (``G % t == 0``) or shared by several ranks (``t % G == 0``), Jamba's
Mamba-1 mixers by channels, and LFM2's short convolutions by channels. Each tiny model dense against parallelized
on gloo ranks, with and without sequence parallelism: logits and every gradient shard (fp32, 1e-4 relative, as
test_hf.py)."""

import copy

import pytest
import torch

from tests.layers.test_hf import REFERENCE_KERNELS, VOCAB, _assert_unchanged, _check_against_dense, _state, needs_hf
from tests.multiprocess import run_ranks

MAMBA = "mamba"  # the mixer's name in the layer: Nemotron-H's is "mixer"


def mamba_model(kind: str, groups: int = 1, kv_heads: int = 2, seed: int = 0):
    """A tiny hybrid of one Mamba-2 layer (8 heads of ``P`` features, ``groups`` groups of 8 states, chunks of 4
    tokens) and one attention layer, every parameter of the mixer away from its initial value. Falcon-H1 has its
    gated norm, an input scale and per-part multipliers of ``in_proj``'s output; Granite 4.0 hybrid has experts
    beside a shared MLP of one packed projection."""
    import transformers

    config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=kv_heads, head_dim=16, tie_word_embeddings=False, pad_token_id=0,
                  attn_implementation="eager")  # fmt: skip
    if kind == "nemotron_h":
        config.update(layers_block_type=["mamba", "attention"], mamba_num_heads=8, mamba_head_dim=8, n_groups=groups,
                      ssm_state_size=8, expand=1, chunk_size=4)  # fmt: skip
    else:
        config.update(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=groups, mamba_d_state=8, mamba_expand=2,
                      mamba_chunk_size=4, mamba_proj_bias=True)  # fmt: skip
    if kind == "bamba":
        config.update(attn_layer_indices=[1])
    elif kind == "granitemoehybrid":
        config.update(layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
                      shared_intermediate_size=32)  # fmt: skip
    elif kind == "falcon_h1":  # one group: its own input scale and multipliers; two: its defaults (a scale of 1.0)
        config.update(mamba_d_ssm=128, mamba_rms_norm=True)
        if groups == 1:
            config.update(ssm_in_multiplier=0.7, ssm_multipliers=[0.5, 1.5, 0.7, 1.3, 0.9])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(kind, **config))
    return _perturbed(model, ("norm", "dt_bias", "A_log", "conv1d.bias", ".D", "in_proj.bias"), seed)


def _perturbed(model, keys: tuple[str, ...], seed: int):
    """``model`` in evaluation, every parameter whose name holds one of ``keys`` moved away from its initial value
    (by up to 0.5), which would hide wrong formulas."""
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if any(k in name for k in keys):
                p.add_(torch.rand(p.shape, generator=gen) * 0.5)
    return model.eval()


def _mixer(model):
    layer = model.model.layers[0]
    return layer.mixer if hasattr(layer, "mixer") else layer.mamba


def _check_mixer_shapes(mixer, t: int, heads: int, width: int, groups: int, states: int = 8):
    local_groups = groups // t if groups % t == 0 else 1
    assert (mixer.num_heads, mixer.intermediate_size, mixer.n_groups) == (heads // t, width // t, local_groups)
    assert mixer.conv_dim == width // t + 2 * local_groups * states
    # every parameter a shard of the whole: B and C too where ranks share their groups
    assert mixer.in_proj.weight.shape[0] == (2 * width + 2 * groups * states + heads) // t
    assert mixer.conv1d.weight.shape[0] == (width + 2 * groups * states) // t
    assert mixer.A_log.shape == mixer.dt_bias.shape == mixer.D.shape == (heads // t,)
    assert mixer.norm.weight.shape == (width // t,) and mixer.out_proj.weight.shape == (64, width // t)


def _never_fused(mixer, kind, name="mamba2_split_conv1d_scan_combined"):
    """Hugging Face's fused training kernel (``mamba_ssm``'s, ``name`` in the mixer's module) reads out_proj's weight
    itself, skipping the row layer's reduction: the split mixer must never call it. Made to raise when given a split
    weight, as if the package were installed (the dense model gets the fallback's None)."""
    import importlib

    module = importlib.import_module(type(mixer).__module__)
    original = getattr(module, name)

    def fused(*args, **kwargs):
        if any(getattr(a, "tensor_parallel", False) for a in (*args, *kwargs.values())):
            raise AssertionError(f"{kind}: the split mixer called the fused training kernel")
        return original(*args, **kwargs)

    setattr(module, name, fused)
    return lambda: setattr(module, name, original)


def _mamba_ranks(rank, world_size, cases):
    from tessel.layers.parallelize import parallelize

    for kind, groups, kv_heads in cases:
        heads, width = 8, 64 if kind == "nemotron_h" else 128
        for sp in (False, True):
            dense = mamba_model(kind, groups, kv_heads)
            par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp)
            _check_mixer_shapes(_mixer(par), world_size, heads, width, groups)
            _check_against_dense(dense, par, f"{kind} G={groups} sp={sp}")
        # in training, on the unfused path: the same logits and gradients
        dense, par = mamba_model(kind, groups, kv_heads), parallelize(mamba_model(kind, groups, kv_heads), None)
        restore = _never_fused(_mixer(par), kind)
        try:
            _check_against_dense(dense.train(), par.train(), f"{kind} G={groups} training", use_cache=False)
        finally:
            restore()
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_mamba2_mixers_split_by_heads():
    """Bamba with one group (each rank holds a share of its B and C and of the convolution's channels: gathered,
    the gated norm's squares summed over the ranks) and with two (a group on each rank); Nemotron-H with two groups and
    its relu² MLP; Falcon-H1 with one group, its gated norm, input scale and per-part multipliers, and with two groups
    and its defaults (an input scale of 1.0, which multiplies into another tensor all the same); Granite 4.0 hybrid
    with its experts and shared packed MLP."""
    cases = [
        ("bamba", 1, 2),
        ("bamba", 2, 2),
        ("nemotron_h", 2, 2),
        ("falcon_h1", 1, 2),
        ("falcon_h1", 2, 2),
        ("granitemoehybrid", 1, 2),
    ]
    assert run_ranks(_mamba_ranks, 2, cases, timeout=900, env=REFERENCE_KERNELS) == ["ok", "ok"]


@pytest.mark.multiprocess
@needs_hf
def test_mamba2_groups_shared_by_pairs_of_four_ranks():
    """Four ranks, two groups: ranks 0 and 1 share group 0's B and C, ranks 2 and 3 group 1's (each rank's shard
    gathered, only its group kept, the norm's squares summed over the pair); and four groups, one on each rank."""
    cases = [("bamba", 2, 4), ("bamba", 4, 4)]
    assert run_ranks(_mamba_ranks, 4, cases, timeout=1200, env=REFERENCE_KERNELS) == ["ok"] * 4


_MAMBA = dict(state_size=8, expand=2, time_step_rank=8, use_bias=True)
PLANLESS = {"mamba2": dict(num_heads=8, head_dim=16, n_groups=2, state_size=8, expand=2, chunk_size=4),
            "mamba": _MAMBA, "falcon_mamba": _MAMBA,
            "zamba2": dict(num_attention_heads=4, n_mamba_heads=8, mamba_headdim=16, mamba_ngroups=2, mamba_d_state=8,
                           mamba_expand=2, chunk_size=4, layers_block_type=["mamba", "hybrid"])}  # fmt: skip


def planless_model(kind: str, seed: int = 0, **overrides):
    """A tiny Mamba-2 (two mixers), Mamba or Falcon-Mamba (two Mamba-1 mixers) or Zamba 2 (a Mamba-2 layer, then a
    hybrid layer whose shared attention block reads the hidden states beside the embeddings), which have no
    tensor-parallel plan of their own; ``overrides`` of the config."""
    import transformers

    config = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, tie_word_embeddings=False, **PLANLESS[kind])
    config.update(overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(kind, **config))
    return _perturbed(model, ("norm", "dt_bias", "A_log", "conv1d.bias", ".D"), seed)


def _planless_ranks(rank, world_size):
    from tessel.layers.hf_mixers import SharedRowLinear
    from tessel.layers.parallelize import parallelize

    for kind, layouts in (("mamba2", (False, True)), ("mamba", (False, True)), ("falcon_mamba", (False,)),
                          ("zamba2", (False, True))):  # fmt: skip
        for sp in layouts:
            dense = planless_model(kind)
            par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp)
            mixer = par.model.layers[0].mamba if kind == "zamba2" else par.backbone.layers[0].mixer
            if kind in ("mamba", "falcon_mamba"):
                assert isinstance(mixer.x_proj, SharedRowLinear) and mixer.A_log.shape == (128 // world_size, 8)
            else:
                _check_mixer_shapes(mixer, world_size, 8, 128, 2)
            if kind == "zamba2":  # the shared attention, which reads [hidden | embeddings], by heads
                attention = par.model.layers[1].shared_transformer.self_attn
                assert attention.q_proj.weight.shape == (128 // world_size, 128)
                _check_adapted_mlp(par.model.layers[1].shared_transformer.feed_forward, world_size, 1, sp)
            _check_against_dense(dense, par, f"{kind} sp={sp}")
        if kind == "zamba2":  # two hybrid layers, the block of each holding both layers' adapters
            dense = planless_model(kind, num_hidden_layers=4, layers_block_type=["mamba", "hybrid"] * 2)
            for sp in (False, True):
                par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp)
                for layer in par.model.layers[1::2]:
                    _check_adapted_mlp(layer.shared_transformer.feed_forward, world_size, 2, sp)
                _check_against_dense(copy.deepcopy(dense), par, f"{kind} with two hybrid layers sp={sp}")
        if kind == "mamba":  # in training, off Hugging Face's fused kernel (which would skip x_proj's reduction)
            dense, par = planless_model(kind), parallelize(planless_model(kind), None)
            restore = _never_fused(par.backbone.layers[0].mixer, kind, "mamba_inner_fn")
            try:
                _check_against_dense(dense.train(), par.train(), f"{kind} training", use_cache=False)
            finally:
                restore()
    return "ok"


def _check_adapted_mlp(mlp, t: int, adapters: int, sequence_parallel: bool = False) -> None:
    """Zamba 2's MLP split by its intermediate features: gate_up_proj and each adapter's second projection this rank's
    share of each half, down_proj its input columns, the adapters' first projections (to their rank) whole. Under
    sequence parallelism gate_up_proj is fed by its block's ring and each adapter's first projection multiplies the
    shard and gathers its latent, which the second reads whole."""
    from tessel.layers.hf import RingColumnLinear, RingLatentLinear
    from tessel.layers.linear import ColumnParallelLinear, RowParallelLinear

    assert isinstance(mlp.gate_up_proj, ColumnParallelLinear) and mlp.gate_up_proj.weight.shape == (512 // t, 64)
    assert isinstance(mlp.gate_up_proj, RingColumnLinear) == sequence_parallel
    assert isinstance(mlp.down_proj, RowParallelLinear) and mlp.down_proj.weight.shape == (64, 256 // t)
    assert mlp.down_proj.sequence_parallel == sequence_parallel
    assert len(mlp.gate_up_proj_adapter_list) == adapters
    for first, second in mlp.gate_up_proj_adapter_list:
        assert isinstance(first, torch.nn.Linear) and first.weight.shape == (128, 64)
        assert isinstance(first, RingLatentLinear) == sequence_parallel
        assert type(second) is ColumnParallelLinear and second.weight.shape == (512 // t, 128)
        assert not second.sequence_parallel  # it reads the gathered latent


@pytest.mark.multiprocess
@needs_hf
def test_models_without_a_plan_split_what_tessel_finds():
    """Mamba-2, Mamba, Falcon-Mamba and Zamba 2 have no tensor-parallel plan: parallelize splits the mixers and
    attention it recognises (:func:`~tessel.layers.hf_plans.whole_attention_plan`), with and without sequence
    parallelism for Mamba-2, Mamba and Zamba 2, and Mamba in training off the fused kernel; Zamba 2's shared MLP with
    the adapters its hybrid layers add (each adapter split with it). Under sequence parallelism Zamba 2's hybrid layer
    holds two decoder layers (its shared attention block, its Mamba layer) whose norms and blocks see the shard, and
    its embeddings, which the attention block reads beside the hidden states, are split with them."""
    assert run_ranks(_planless_ranks, 2, timeout=900, env=REFERENCE_KERNELS) == ["ok", "ok"]


def jamba_model(seed: int = 0):
    """A tiny Jamba: Mamba-1 mixers (64 channels, 8 states, a time step of rank 8, biased projections) in layers 0 and
    2, attention in 1 and 3, experts in 1 and 3; every norm, the convolution's and dt_proj's biases and D away from
    their initial values."""
    import transformers

    config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=0, attn_implementation="eager",
                  attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                  mamba_dt_rank=8, mamba_proj_bias=True)  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("jamba", **config))
    return _perturbed(model, ("norm", "conv1d.bias", ".D", "dt_proj.bias"), seed)


def _jamba_ranks(rank, world_size):
    from tessel.layers.hf_mixers import SharedRowLinear
    from tessel.layers.parallelize import parallelize

    for sp in (False, True):
        dense = jamba_model()
        par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp)
        mixer = par.model.layers[0].mamba
        assert mixer.in_proj.weight.shape == (2 * 128 // world_size, 64) and mixer.conv1d.weight.shape[0] == 64
        assert isinstance(mixer.x_proj, SharedRowLinear) and mixer.x_proj.weight.shape == (24, 128 // world_size)
        assert mixer.dt_proj.weight.shape == (128 // world_size, 8) and mixer.A_log.shape == (64, 8)
        assert mixer.D.shape == (64,) and mixer.out_proj.weight.shape == (64, 64)
        _check_against_dense(dense, par, f"jamba sp={sp}")
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_jamba_mamba1_mixers_split_by_channels():
    """Jamba's Mamba-1 mixers by channels: ``in_proj``'s x and z halves, the convolution, ``dt_proj``, ``A_log``'s and
    ``D``'s rows, ``out_proj``; ``x_proj`` over every channel as a row layer whose sum every rank reads (the ranks'
    gradients of it summed back), its time-step and B/C norms whole with their gradients summed; with and without
    sequence parallelism (``x_proj`` and ``dt_proj`` then read the whole sequence inside the block)."""
    assert run_ranks(_jamba_ranks, 2, timeout=900, env=REFERENCE_KERNELS) == ["ok", "ok"]


def minimax_model(seed: int = 0):
    """A tiny MiniMax: lightning attention (4 heads of 16, blocks of 4 tokens) then softmax attention, experts in
    both layers; its norms away from their initial values."""
    import transformers

    config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, pad_token_id=0,
                  attn_implementation="eager", layer_types=["linear_attention", "full_attention"], block_size=4,
                  num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("minimax", **config))
    return _perturbed(model, ("norm",), seed)


def _minimax_ranks(rank, world_size):
    from tessel.layers.norm import SplitRMSNorm
    from tessel.layers.parallelize import parallelize

    for sp in (False, True):
        dense = minimax_model()
        par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp)
        mine, whole = par.model.layers[0].self_attn, dense.model.layers[0].self_attn
        assert mine.num_attention_heads == 4 // world_size and isinstance(mine.norm, SplitRMSNorm)
        assert mine.qkv_proj.weight.shape == (3 * 64 // world_size, 64) and mine.out_proj.weight.shape == (64, 32)
        own = slice(rank * 2, rank * 2 + 2)  # this rank's heads' decay rates and tables
        assert torch.equal(mine.slope_rate, whole.slope_rate[own])
        for name in ("query_decay", "key_decay"):
            torch.testing.assert_close(getattr(mine, name), getattr(whole, name)[own], rtol=0, atol=0)
        torch.testing.assert_close(mine.diagonal_decay, whole.diagonal_decay[:, own], rtol=0, atol=0)
        _check_against_dense(dense, par, f"minimax sp={sp}")
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_minimax_lightning_attention_splits_by_heads():
    """MiniMax's lightning attention, which its plan leaves whole: q/k/v (packed head by head) and the output gate by
    heads, the norm over every head as SplitRMSNorm, each rank its heads' decay rates and tables; over several blocks
    of tokens, with and without sequence parallelism."""
    assert run_ranks(_minimax_ranks, 2, timeout=900, env=REFERENCE_KERNELS) == ["ok", "ok"]


def lfm_model(kind: str, seed: int = 0):
    """A tiny LFM2 (LFM2-MoE, LFM3): short convolution, attention, short convolution, every convolution's bias and
    norm away from its initial value. LFM2's attention names its output projection ``out_proj`` and its per-head
    norms ``q_layernorm``/``k_layernorm``; its MLP is ``w1``/``w3``/``w2``; LFM3 gates its attention head by head
    (``g_proj``)."""
    import transformers

    config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=0, attn_implementation="eager",
                  layer_types=["conv", "full_attention", "conv"], conv_bias=True)  # fmt: skip
    if kind == "lfm2_moe":
        config.update(num_dense_layers=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    if kind != "lfm3":
        config.update(block_auto_adjust_ff_dim=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(kind, **config))
    return _perturbed(model, ("norm", "conv.bias"), seed)


def _lfm_ranks(rank, world_size):
    from tessel.layers.linear import ColumnParallelLinear, RowParallelLinear
    from tessel.layers.parallelize import parallelize

    for kind in ("lfm2", "lfm2_moe", "lfm3"):
        for sp in (False, True):
            dense = lfm_model(kind)
            par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp)
            conv, attention = par.model.layers[0].conv, par.model.layers[1].self_attn
            assert conv.in_proj.weight.shape == (3 * 64 // world_size, 64) and conv.out_proj.weight.shape == (64, 32)
            assert conv.conv.weight.shape[0] == 64 // world_size
            out = attention.o_proj if kind == "lfm3" else attention.out_proj
            assert isinstance(attention.q_proj, ColumnParallelLinear) and isinstance(out, RowParallelLinear)
            if kind == "lfm3":  # one gate per head: this rank's heads'
                assert attention.g_proj.weight.shape == (4 // world_size, 64)
            if kind != "lfm2_moe":
                assert par.model.layers[0].feed_forward.w2.weight.shape == (64, 96 // world_size)
            _check_against_dense(dense, par, f"{kind} sp={sp}")
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_lfm2_short_convolutions_and_attention_split():
    """LFM2's short convolution by channels (``in_proj`` over its three parts B, C, x; the depthwise convolution;
    ``out_proj``), its attention by heads and its MLP by features; LFM2-MoE's experts beside them (their block receives
    a contiguous shard under sequence parallelism, which it views as tokens); LFM3's per-head output gate."""
    assert run_ranks(_lfm_ranks, 2, timeout=900, env=REFERENCE_KERNELS) == ["ok", "ok"]


def _refusals(rank, world_size):
    from tessel.layers.parallelize import parallelize

    model = mamba_model("bamba")
    before, types = _state(model), [type(m) for m in model.modules()]
    plan = {"model.layers.0.mamba.in_proj": "colwise_qkv", "model.layers.0.mamba.out_proj": "rowwise"}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mamba is a Mamba-2 mixer whose plan splits some of it; "
                                         r"it must also split .*'conv1d': 'colwise_conv'"):  # fmt: skip
        parallelize(model, None, plan=plan)
    _assert_unchanged(model, before, types)
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_a_mixer_split_in_part_is_refused_before_anything_changes():
    assert run_ranks(_refusals, 2, timeout=300) == ["ok", "ok"]


def test_the_mixer_helpers_refuse_what_they_do_not_split():
    from tessel.layers.hf_mixers import SplitGatedRMSNorm, mamba_updates

    with pytest.raises(ValueError, match=r"mamba_updates: expected a Mamba-2 mixer .* received Linear"):
        mamba_updates(torch.nn.Linear(2, 2), 2)
    with pytest.raises(TypeError, match=r"SplitGatedRMSNorm\.from_module: expected a Mamba-2 gated RMS norm over 1 "
                                        r"groups .* received LayerNorm"):  # fmt: skip
        SplitGatedRMSNorm.from_module(torch.nn.LayerNorm(8), 1, None)
    with pytest.raises(ValueError, match=r"SplitGatedRMSNorm: expected kind 'grouped' or 'falcon' .* received "
                                         r"kind='layer'"):  # fmt: skip
        SplitGatedRMSNorm(torch.ones(4), 1, 1e-6, "layer", False, None)


def _generate_ranks(rank, world_size):
    from tessel.layers.parallelize import parallelize

    makers = {"bamba": lambda: mamba_model("bamba"), "falcon_h1": lambda: mamba_model("falcon_h1"),
              "jamba": jamba_model, "mamba": lambda: planless_model("mamba"), "lfm2": lambda: lfm_model("lfm2"),
              "minimax": minimax_model}  # fmt: skip
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    for kind, make in makers.items():
        dense = make()
        par = parallelize(copy.deepcopy(dense), None)
        with torch.no_grad():
            want, got = (m.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True) for m in (dense, par))  # fmt: skip
        assert torch.equal(got.sequences, want.sequences), kind
        for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"{kind} step {step}")
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_split_mixers_generate_as_the_dense_model():
    """Greedy generation over the cache (each rank's convolution and recurrent states of its heads or channels, one
    token at a time after the prompt): the dense model's tokens and logits, for Mamba-2 with its groups shared by the
    ranks, Falcon-H1, Jamba's and Mamba's Mamba-1, LFM2's short convolutions and MiniMax's lightning attention."""
    assert run_ranks(_generate_ranks, 2, timeout=900, env=REFERENCE_KERNELS) == ["ok", "ok"]
