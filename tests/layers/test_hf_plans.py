"""What Hugging Face's plans gather whole, split by tessel (:mod:`tessel.layers.hf_plans`).

Attention whose query and key norms span every head (OLMo 2 and 3, OLMoE, FlexOlmo, MiniMax-M2): Hugging Face's
plan gathers q, k and v whole and runs every head's attention on every rank, because each norm's mean of squares
spans all heads. tessel splits q/k/v by heads and keeps each norm whole by summing its squares over the ranks
(``SplitRMSNorm``, style ``colwise_norm``). Phi-3's fused qkv_proj and gate_up_proj: Hugging Face gathers both;
tessel splits q, k and v by heads (``colwise_qkv``, the attention reading its local head counts from a view of
its config) and gate/up by features (``packed_colwise``, once a probe shows the MLP pairs the halves). The tests
check

- ``SplitRMSNorm`` on 2 and 4 gloo ranks against a float64 RMS norm over the whole width (output, input and
  weight gradients; fp32 and bf16), built from Hugging Face's, torch's and tessel's norms; bad input refused;
- each family, dense against parallelized (logits, every gradient shard, fp32, 1e-4 relative as test_hf.py),
  with and without sequence parallelism, on 2 ranks and with 4 kv heads on 4; each rank holds only its
  heads' projections;
- Phi-3 likewise, with 2 and 4 kv heads; the view of the config (copies, pickles, writes, the attention
  implementation set on the model);
- which plans are rewritten (the six families') and which are not (Qwen3's per-head norms, an MLP pairing
  interleaved features, a user's plan).
"""

import copy

import pytest
import torch

from tests.layers.test_hf import REFERENCE_KERNELS, VOCAB, _assert_unchanged, _check_against_dense, _state, needs_hf
from tests.multiprocess import run_ranks

FAMILIES = {"olmo2": "Olmo2", "olmo3": "Olmo3", "olmoe": "Olmoe", "flex_olmo": "FlexOlmo", "minimax_m2": "MiniMaxM2"}
MIXTURES = ("olmoe", "flex_olmo", "minimax_m2")


def qk_norm_model(family, kv_heads=2, seed=0, **kw):
    """A tiny ``family`` model (two layers, four query heads of 16), its norms' weights random."""
    import transformers

    name = FAMILIES[family]
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=kv_heads, head_dim=16, tie_word_embeddings=False, pad_token_id=0,
                bos_token_id=1, eos_token_id=2)  # fmt: skip
    if family in MIXTURES:
        base.update(num_experts=4, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForCausalLM")(getattr(transformers, f"{name}Config")(**{**base, **kw}))
    with torch.no_grad():  # ones would hide a weight applied to the wrong features
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.uniform_(0.5, 1.5)
    return model


# ---------------------------------------------------------------------------------------------------- SplitRMSNorm


def _rms_norm_64(x, w, eps):
    x = x.double()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w.double()


def _split_norm_ranks(rank, world_size):
    import transformers
    from torch import nn

    from tessel.layers.norm import RMSNorm, SplitRMSNorm

    dim, eps = 40, 1e-5
    gen = torch.Generator().manual_seed(3)
    whole_w = torch.rand(dim, generator=gen) + 0.5
    sources = []
    hf = transformers.models.olmo2.modeling_olmo2.Olmo2RMSNorm(dim, eps)
    torch_norm, tessel_norm = nn.RMSNorm(dim, eps), RMSNorm(dim, eps)
    for m in (hf, torch_norm, tessel_norm):
        with torch.no_grad():
            m.weight.copy_(whole_w)
        sources.append(m)
    chunk = dim // world_size
    own = slice(rank * chunk, (rank + 1) * chunk)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x = (torch.randn(3, 5, dim, generator=gen) * 3).to(dtype)
        dy = torch.randn(3, 5, dim, generator=gen).to(dtype)
        x64 = x.double().requires_grad_()
        w64 = whole_w.double().requires_grad_()
        want = _rms_norm_64(x64, w64, eps)
        want.backward(dy.double())
        for source in sources:
            norm = SplitRMSNorm.from_module(source.to(dtype))
            assert norm.weight.shape == (chunk,) and norm.weight.tp_dim == 0 and norm.weight.tp_parts == (dim,)
            xr = x[..., own].clone().requires_grad_()
            y = norm(xr)
            assert y.dtype == dtype
            y.backward(dy[..., own])
            tag = f"{type(source).__name__} {dtype}"
            torch.testing.assert_close(y.double(), want[..., own].detach(), rtol=tol, atol=tol, msg=tag)
            torch.testing.assert_close(xr.grad.double(), x64.grad[..., own], rtol=tol, atol=tol, msg=tag)
            torch.testing.assert_close(norm.weight.grad.double(), w64.grad[own], rtol=tol, atol=tol * 10, msg=tag)
    norm = SplitRMSNorm(dim)
    with pytest.raises(ValueError, match=rf"expected a floating tensor \[\.\.\., {chunk}\] \(features 40 over"):
        norm(torch.zeros(2, dim))
    with pytest.raises(ValueError, match="expected a floating tensor"):
        norm(torch.zeros(2, chunk, dtype=torch.long))
    odd = 42 if world_size == 4 else 41
    with pytest.raises(ValueError, match=f"dim={odd} is not divisible by the tensor-parallel size {world_size}"):
        SplitRMSNorm(odd)
    return "ok"


@pytest.mark.multiprocess
@needs_hf
@pytest.mark.parametrize("world_size", [2, 4])
def test_split_rms_norm_matches_the_whole_norm(world_size):
    assert run_ranks(_split_norm_ranks, world_size, timeout=120) == ["ok"] * world_size


def test_split_rms_norm_refuses_what_it_cannot_copy():
    import importlib.util

    from torch import nn

    from tessel.layers.norm import SplitRMSNorm

    with pytest.raises(ValueError, match="elementwise_affine=False"):
        SplitRMSNorm.from_module(nn.RMSNorm(8, elementwise_affine=False))
    with pytest.raises(TypeError, match=r"SplitRMSNorm\.from_module: expected torch\.nn\.RMSNorm"):
        SplitRMSNorm.from_module(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="dim must be a positive int, received 0"):
        SplitRMSNorm(0)
    if importlib.util.find_spec("transformers") is not None:  # Gemma's (1 + weight) norm is not x̂·weight
        import transformers

        with pytest.raises(ValueError, match=r"SplitRMSNorm.from_module: GemmaRMSNorm does not compute"):
            SplitRMSNorm.from_module(transformers.models.gemma.modeling_gemma.GemmaRMSNorm(8))
    # one rank: the whole norm
    norm, x = SplitRMSNorm(8, eps=1e-6), torch.randn(2, 3, 8)
    torch.testing.assert_close(norm(x).double(), _rms_norm_64(x, norm.weight.detach(), 1e-6))


# ---------------------------------------------------------------------------------------------------- parallelize


def test_only_attention_with_all_head_norms_is_rewritten():
    import transformers

    from tessel.layers.hf import hf_tp_plan
    from tessel.layers.hf_plans import _SPLIT_ATTENTION, head_split_plan
    from tessel.layers.plan import glob_regex

    for family in FAMILIES:
        model = qk_norm_model(family)
        plan = head_split_plan(model, hf_tp_plan(model), glob_regex)
        for leaf, style in _SPLIT_ATTENTION.items():
            assert plan[f"model.layers.*.self_attn.{leaf}"] == style, (family, leaf)
    # Qwen3's norms are per head (16 weights): its plan splits by heads already, and is left as it is
    qwen3 = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16))  # fmt: skip
    assert head_split_plan(qwen3, hf_tp_plan(qwen3), glob_regex) == hf_tp_plan(qwen3)
    # an OLMo 2 whose norms do not span the projections' features is not rewritten
    model = qk_norm_model("olmo2")
    model.model.layers[1].self_attn.k_norm = torch.nn.Identity()
    assert head_split_plan(model, hf_tp_plan(model), glob_regex) == hf_tp_plan(model)


def phi3_model(kv_heads=2, seed=0, **kw):
    """A tiny Phi-3: fused qkv_proj (four query heads of 16) and gate_up_proj."""
    import transformers

    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=kv_heads, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                eos_token_id=2)  # fmt: skip
    torch.manual_seed(seed)
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(**{**base, **kw}))


class _InterleavedMLP(torch.nn.Module):
    """gate and up interleaved feature by feature in gate_up_proj (not two halves)."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj, self.down_proj = torch.nn.Linear(8, 12), torch.nn.Linear(6, 8)

    def forward(self, x):
        y = self.gate_up_proj(x)
        return self.down_proj(torch.nn.functional.silu(y[..., ::2]) * y[..., 1::2])


def test_phi3_is_split_by_heads_and_features_and_interleaved_pairs_are_not():
    from tessel.layers.hf import hf_tp_plan
    from tessel.layers.hf_plans import head_split_plan, pairs_halves
    from tessel.layers.plan import glob_regex

    model = phi3_model()
    plan = head_split_plan(model, hf_tp_plan(model), glob_regex)
    assert {k.rpartition(".")[2]: v for k, v in plan.items() if ".layers." in k} == {
        "qkv_proj": "colwise_qkv", "o_proj": "rowwise", "gate_up_proj": "packed_colwise", "down_proj": "rowwise"
    }  # fmt: skip
    assert pairs_halves(model.model.layers[0].mlp) and not pairs_halves(_InterleavedMLP())
    assert pairs_halves(model.model.layers[0].mlp.to(torch.bfloat16))
    # an interleaving MLP in one layer keeps Hugging Face's gather for every layer of its stem
    model.model.layers[1].mlp = _InterleavedMLP()
    plan = head_split_plan(model, hf_tp_plan(model), glob_regex)
    assert plan["model.layers.*.mlp.gate_up_proj"] == "colwise_gather_output"
    assert plan["model.layers.*.self_attn.qkv_proj"] == "colwise_qkv"


def test_the_local_heads_view_of_a_config():
    import pickle

    import transformers

    from tessel.layers.hf_plans import LocalHeadsConfig

    model = phi3_model()
    config = model.config
    view = LocalHeadsConfig(config, num_attention_heads=2, num_key_value_heads=1)
    assert isinstance(view, transformers.Phi3Config) and view.num_attention_heads == 2 and view.hidden_size == 64
    model.model.layers[0].self_attn.config = view
    model.set_attn_implementation("eager")  # reaches the view: it reads the shared config
    assert view._attn_implementation == "eager"
    view.rope_theta = 123.0
    assert config.rope_theta == 123.0
    with pytest.raises(AttributeError, match="num_attention_heads is this rank's share"):
        view.num_attention_heads = 4
    copied = copy.deepcopy(model)  # the copy's view reads the copy's config
    copied_view = copied.model.layers[0].self_attn.config
    assert type(copied_view) is LocalHeadsConfig and copied_view.num_attention_heads == 2
    copied.config.rope_theta = 5.0
    assert copied_view.rope_theta == 5.0 and view.rope_theta == 123.0
    unpickled = pickle.loads(pickle.dumps(view))
    assert unpickled.num_key_value_heads == 1 and unpickled.vocab_size == VOCAB


def test_what_a_plan_leaves_whole_is_split_where_it_can_be():
    import transformers

    from tessel.layers.hf import hf_tp_plan
    from tessel.layers.hf_plans import whole_attention_plan
    from tessel.layers.plan import glob_regex

    def model(kind, **kw):
        base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts=4,
                    num_experts_per_tok=2, moe_intermediate_size=32, pad_token_id=0)  # fmt: skip
        config = transformers.AutoConfig.for_model(kind, **{**base, **kw})
        return transformers.AutoModelForCausalLM.from_config(config)

    def added(model, t=2):
        plan, own = whole_attention_plan(model, hf_tp_plan(model), glob_regex, t), hf_tp_plan(model)
        assert all(plan[k] == v for k, v in own.items())
        return {k: v for k, v in plan.items() if k not in own}

    phimoe = model("phimoe")
    attention = {f"model.layers.{i}.self_attn.{p}": "rowwise" if p == "o_proj" else "colwise"
                 for i in range(2) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}  # fmt: skip
    assert added(phimoe) == attention
    # Hunyuan's per-head q/k norms reduce their gradients
    plan = added(model("hunyuan_v1_moe"))
    assert plan["model.layers.1.self_attn.query_layernorm"] == "replicated_with_grad_allreduce"
    assert plan["model.layers.1.self_attn.key_layernorm"] == "replicated_with_grad_allreduce"
    # Afmoe: its attention's output gate splits with the heads, and its dense first MLP and the shared expert of its
    # experts' block by features; the experts keep Hugging Face's plan
    plan = added(model("afmoe"))
    assert plan["model.layers.0.self_attn.gate_proj"] == plan["model.layers.1.self_attn.gate_proj"] == "colwise"
    assert plan["model.layers.0.mlp.down_proj"] == plan["model.layers.1.mlp.shared_experts.down_proj"] == "rowwise"
    assert not any(".experts." in k for k in plan)
    # kv heads fewer than the ranks: split with the query heads, replicated over the ranks by parallelize
    assert added(phimoe, 4) == attention
    # left whole: one rank; kv heads that do not split (3 over 2) nor replicate (3 over 4); a plan that names the
    # attention already (Llama's)
    uneven = model("phimoe", num_attention_heads=12, num_key_value_heads=3)
    assert added(phimoe, 1) == {} and added(uneven, 2) == {} and added(uneven, 4) == {}
    assert added(model("llama")) == {}
    # OLMo 2's attention without its plan: its k norm over every kv head's features splits with two kv heads over two
    # ranks, and keeps them whole over four (a copy of one on each rank would need both heads' features)
    olmo2 = qk_norm_model("olmo2", kv_heads=2)
    olmo2.config.base_model_tp_plan = {}
    split = {t: whole_attention_plan(olmo2, {}, glob_regex, t) for t in (2, 4)}
    assert split[2]["model.layers.0.self_attn.k_norm"] == "colwise_norm"
    assert not any(".self_attn." in k for k in split[4])


def _phi3_ranks(rank, world_size, kv_heads):
    from tessel.layers.hf_plans import LocalHeadsConfig
    from tessel.layers.parallelize import parallelize

    t = world_size
    for sp in (False, True):
        dense = phi3_model(kv_heads=kv_heads)
        par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp, overlap=sp or "auto")
        attention, mlp = par.model.layers[1].self_attn, par.model.layers[1].mlp
        assert attention.qkv_proj.weight.shape == ((64 + 32 * kv_heads) // t, 64)
        assert type(attention.config) is LocalHeadsConfig and attention.config.num_attention_heads == 4 // t
        assert mlp.gate_up_proj.weight.shape == (192 // t, 64) and mlp.down_proj.weight.shape == (64, 96 // t)
        assert par.config.num_attention_heads == 4  # the model's own config is untouched
        _check_against_dense(dense, par, f"phi3 sp={sp}")
    return "ok"


@pytest.mark.multiprocess
@needs_hf
@pytest.mark.parametrize("world_size, kv_heads", [(2, 2), (4, 4)])
def test_phi3_split_by_heads_matches_dense(world_size, kv_heads):
    got = run_ranks(_phi3_ranks, world_size, kv_heads, timeout=300, env=REFERENCE_KERNELS)
    assert got == ["ok"] * world_size


def _families_ranks(rank, world_size, kv_heads, families, sp_options):
    from tessel.layers.hf import hf_tp_plan
    from tessel.layers.norm import SplitRMSNorm
    from tessel.layers.parallelize import parallelize

    t = world_size
    for family in families:
        for sp in sp_options:
            dense = qk_norm_model(family, kv_heads=kv_heads)
            par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp, overlap=sp or "auto")
            attention = par.model.layers[1].self_attn
            # this rank's heads only: 4/t query heads and kv/t kv heads of 16
            kv = 16 * kv_heads // t
            assert attention.q_proj.weight.shape == (64 // t, 64) and attention.v_proj.weight.shape == (kv, 64)
            assert isinstance(attention.q_norm, SplitRMSNorm) and attention.k_norm.weight.shape == (kv,)
            assert attention.o_proj.weight.shape == (64, 64 // t)
            _check_against_dense(dense, par, f"{family} sp={sp}")
    # OLMoE clamps q, k and v in place (clip_qkv): the clamp runs on each rank's heads
    dense = qk_norm_model("olmoe", kv_heads=kv_heads, clip_qkv=0.05)
    for sp in sp_options:
        _check_against_dense(dense, parallelize(copy.deepcopy(dense), None, sequence_parallel=sp), f"clip sp={sp}")
        dense.zero_grad()
    # Hugging Face's plan, given as a user plan, is followed as written: the attention gathered whole
    dense = qk_norm_model("olmo2", kv_heads=kv_heads)
    par = parallelize(copy.deepcopy(dense), None, plan=hf_tp_plan(dense))
    assert type(par.model.layers[0].self_attn.q_norm) is type(dense.model.layers[0].self_attn.q_norm)
    _check_against_dense(dense, par, "olmo2 hugging face plan")
    # a width that does not split over the ranks is refused by name, with nothing changed
    model = qk_norm_model("olmo2", kv_heads=kv_heads)
    plan = {**hf_tp_plan(model), "model.layers.*.self_attn.q_norm": "colwise_norm"}
    model.model.layers[0].self_attn.q_norm.weight = torch.nn.Parameter(torch.ones(64 + 1))
    before, types = _state(model), [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_norm .*style 'colwise_norm'.*dim=65 is not"):
        parallelize(model, None, plan=plan)
    _assert_unchanged(model, before, types)
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_all_head_norm_families_split_by_heads_match_dense_on_two_ranks():
    assert (
        run_ranks(_families_ranks, 2, 2, tuple(FAMILIES), (False, True), timeout=300, env=REFERENCE_KERNELS)
        == ["ok"] * 2
    )


@pytest.mark.multiprocess
@needs_hf
def test_all_head_norm_families_split_by_heads_match_dense_on_four_ranks():
    got = run_ranks(_families_ranks, 4, 4, ("olmo2", "olmoe"), (True,), timeout=300, env=REFERENCE_KERNELS)
    assert got == ["ok"] * 4
