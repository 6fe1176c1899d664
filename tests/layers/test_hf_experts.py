"""Hugging Face mixtures of experts through ``parallelize`` (style ``moe_tp_experts``, tessel.layers.hf_experts).

Each rank builds the same tiny model (random init, no downloads), parallelizes a deep copy and compares
the logits and every parameter's gradient shard with the dense model's, fp32, at the tolerance of
tests/layers/test_hf.py (1e-4 relative). Covered layouts: Mixtral (``[gate; up]`` halves, [E, out, in]),
Llama 4 (experts fed every token once per expert, [E, in, out] without layout flags), Qwen2-MoE (a shared
expert and its gate beside the experts), Qwen3-MoE (a dense MLP layer among expert layers), GLM-4-MoE (a
shared expert split by its own plan), Qwen3-Next and Jamba (hybrids), DeepSeek-V2 (latent attention) and
-V3, GPT-OSS (interleaved gate/up, transposed [E, in, out], biases, under a user plan), and a module of
up/down experts without a gate; split by features and by whole experts. The routers' weights are scaled
up so that no token sits near a tie between two experts: the parallel model's hidden states differ from
the dense ones by fp32 reordering, which must not change a routing decision.
"""

import copy

import pytest
import torch
from torch import nn

from tests.layers.test_hf import (
    REFERENCE_KERNELS,
    VOCAB,
    B,
    S,
    _assert_unchanged,
    _batch,
    _check_against_dense,
    _close,
    _state,
    needs_hf,
)
from tests.multiprocess import run_ranks

SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
             head_dim=16, tie_word_embeddings=False)  # fmt: skip
ATTENTION_PLAN = {f"model.layers.*.self_attn.{n}_proj": "rowwise" if n == "o" else "colwise" for n in "qkvo"}


def _sharpen_routers(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight", "feed_forward.router.weight")):
                p.mul_(30)
    return model


# multi-head latent attention: a 16-wide key-value latent and a 24-wide query latent, 8 rotary + 8 plain
# features per query/key head, 8 per value head; a dense MLP in the first layer, experts with a shared one after
MLA = dict(head_dim=8, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, kv_lora_rank=16, q_lora_rank=24,
           n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
           first_k_dense_replace=1, intermediate_size=96, topk_group=1)  # fmt: skip


def _moe(family, seed=0, **kw):
    import transformers

    config_cls, model_cls, extra = {
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                    dict(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2)),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                      dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
                           num_experts_per_tok=2, intermediate_size=96)),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                      dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, intermediate_size=96,
                           mlp_only_layers=[0])),
        "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM,
                     dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, intermediate_size=96,
                          first_k_dense_replace=1, n_shared_experts=1)),
        "llama4": (transformers.Llama4TextConfig, transformers.Llama4ForCausalLM,
                   dict(intermediate_size=32, intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1,
                        interleave_moe_layer_step=2)),
        "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM, dict(MLA, n_group=None)),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(MLA, n_group=1)),
        "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
                       dict(layer_types=["linear_attention", "full_attention"], moe_intermediate_size=32,
                            num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=48,
                            intermediate_size=96, linear_num_value_heads=4, linear_num_key_heads=2,
                            linear_key_head_dim=16, linear_value_head_dim=16)),
        "jamba": (transformers.JambaConfig, transformers.JambaForCausalLM,
                  dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                       num_experts=4, num_experts_per_tok=2, intermediate_size=96, mamba_d_state=8,
                       use_mamba_kernels=False)),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM,
                    dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)),
        "ernie4_5_moe": (transformers.Ernie4_5_MoeConfig, transformers.Ernie4_5_MoeForCausalLM,
                         dict(moe_intermediate_size=32, moe_num_experts=4, moe_k=2, intermediate_size=96,
                              moe_layer_start_index=1, moe_num_shared_experts=1, use_bias=False)),
        "laguna": (transformers.LagunaConfig, transformers.LagunaForCausalLM,
                   dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                        num_experts_per_tok=2, intermediate_size=96)),
    }[family]  # fmt: skip
    torch.manual_seed(seed)
    return _sharpen_routers(model_cls(config_cls(**{**SMALL, **extra, **kw})))


GPT_OSS_PLAN = {**ATTENTION_PLAN, "model.layers.*.mlp.experts": "moe_tp_experts",
                "model.layers.*.mlp.experts.gate_up_proj": "rowwise",  # transposed: [E, H, 2I] split along 2I
                "model.layers.*.mlp.experts.down_proj": "colwise"}  # fmt: skip


class _UpDownExperts(nn.Module):
    """Experts without a gate (``has_gate=False``, NemotronH's layout): ``down(relu(up(x)))``, [E, out, in]."""

    has_gate = False

    def __init__(self, experts=4, hidden=24, inter=12):
        super().__init__()
        self.num_experts = experts
        self.up_proj = nn.Parameter(torch.randn(experts, inter, hidden) / hidden**0.5)
        self.up_proj_bias = nn.Parameter(torch.randn(experts, inter))
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inter) / inter**0.5)
        self.down_proj_bias = nn.Parameter(torch.randn(experts, hidden))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for slot in range(top_k_index.shape[1]):
            e = top_k_index[:, slot]
            h = torch.relu(torch.einsum("ti,toi->to", hidden_states, self.up_proj[e]) + self.up_proj_bias[e])
            y = torch.einsum("ti,toi->to", h, self.down_proj[e]) + self.down_proj_bias[e]
            out = out + top_k_weights[:, slot, None] * y
        return out


class _TinyMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(24, 4, bias=False)
        self.experts = _UpDownExperts()

    def forward(self, x):
        weights, ids = torch.topk(torch.softmax(self.router(x), -1), 2, dim=-1)
        return self.experts(x, ids, weights)


def _check_grads(dense, par):
    from tessel.parallel.sharding import shard_like

    for name, p in par.named_parameters():
        want = shard_like(dict(dense.named_parameters())[name].grad, p, None)
        _close(p.grad, want, msg=lambda m, name=name: f"grad of {name}: {m}")


def _two_ranks(rank, world_size):
    from tessel.layers.hf import register_hf_attention
    from tessel.layers.parallelize import parallelize

    register_hf_attention()

    for family in ("mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "ernie4_5_moe"):
        for sp in (False, True):
            dense = _moe(family)
            par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp)
            experts = par.model.layers[1].mlp.experts
            assert experts.gate_up_proj.shape == (4, dense.model.layers[1].mlp.experts.gate_up_proj.shape[1] // 2, 64)
            _check_against_dense(dense, par, f"{family} sp={sp}")
    # Llama 4: experts of [E, in, out] weights without layout flags (read from the shapes), fed every token once
    # per expert with the routing scores already applied; a dense MLP in every other layer; its own plan names
    # the transposed gate_up "packed_rowwise"
    for sp in (False, True):
        dense = _moe("llama4")
        par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp)
        assert par.model.layers[1].feed_forward.experts.gate_up_proj.shape == (4, 64, 32)
        assert par.model.layers[1].feed_forward.experts.down_proj.shape == (4, 16, 64)
        _check_against_dense(dense, par, f"llama4 sp={sp}")
    # hybrids: Qwen3-Next (gated delta-net layers, replicated) and Jamba (Mamba layers, replicated) with experts
    for family in ("qwen3_next", "jamba"):
        dense = _moe(family)
        _check_against_dense(dense, parallelize(copy.deepcopy(dense), None), family)
    # DeepSeek-V2's multi-head latent attention (its own plan: 'mla_kv_a_proj'), with a low-rank query and
    # without; DeepSeek-V3 (group-limited routing, a shared expert), whose plan leaves the attention whole and tessel
    # splits as V2's. Under sequence parallelism the narrow projections of the block's input multiply each rank's
    # shard and gather their latents (RingLatentLinear); the projections they feed read the whole sequence.
    from tessel.layers.hf import RingLatentLinear

    for family, kw in (("deepseek_v2", {}), ("deepseek_v2", {"q_lora_rank": None}), ("deepseek_v3", {})):
        for sp in (False, True):
            dense = _moe(family, **kw)
            par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp)
            attention = par.model.layers[0].self_attn
            assert attention.num_heads == 2 and attention.kv_b_proj.weight.shape == (32, 16)
            latents = [attention.kv_a_proj_with_mqa] + ([attention.q_a_proj] if "q_lora_rank" not in kw else [])
            assert all(isinstance(m, RingLatentLinear) == sp for m in latents)
            _check_against_dense(dense, par, f"{family} {kw} sp={sp}")
    # expert parallelism over the group: rank r keeps experts 2r, 2r+1 whole, by the keyword or by Hugging Face's
    # expert-parallel plan ('ep_dispatch_experts', 'grouped_gemm'), under every experts implementation
    for family, impl, sp in (("mixtral", "eager", False), ("mixtral", "eager", True), ("qwen2_moe", "eager", True),
                             ("qwen3_moe", "batched_mm", False), ("glm4_moe", "grouped_mm", True)):  # fmt: skip
        dense = _moe(family)
        dense.set_experts_implementation(impl)
        par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp, expert_split="experts")
        experts, whole = par.model.layers[1].mlp.experts, dense.model.layers[1].mlp.experts
        assert experts.num_experts == 2
        assert torch.equal(experts.gate_up_proj, whole.gate_up_proj[2 * rank : 2 * rank + 2])
        _check_against_dense(dense, par, f"{family} {impl} sp={sp} split by experts")
    # ... under sequence parallelism each rank sends its routes to their experts' ranks and back (all-to-all)
    import tessel.layers.hf_experts as hf_experts

    sent, exchange = [], hf_experts.exchange_rows

    def spy(x, group, send, recv, rows=None):
        sent.append([int(c) for c in send])
        return exchange(x, group, send, recv, rows=rows)

    hf_experts.exchange_rows = spy
    try:
        dense = _moe("mixtral")
        _check_against_dense(dense, parallelize(copy.deepcopy(dense), None, sequence_parallel=True,
                                                expert_split="experts"), "mixtral all-to-all")  # fmt: skip
    finally:
        hf_experts.exchange_rows = exchange
    routes = B * S // 2 * 2  # this rank's tokens, two choices each
    # two expert layers, each there (this rank's routes, and their experts' ids) and back (the routes it received)
    assert len(sent) == 6 and sum(sent[0]) == sum(sent[1]) == sum(sent[3]) == sum(sent[4]) == routes, sent
    # a rank whose experts receive no route (every token chooses rank 0's experts) still joins every exchange,
    # forward and backward, under the eager implementation that returns a constant for no rows
    dense = _moe("mixtral")
    dense.set_experts_implementation("eager")
    for sp in (True, False):  # with and without the dispatch (without, every rank holds the same tokens)
        par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp, expert_split="experts")
        gen = torch.Generator().manual_seed(rank if sp else 0)
        hidden, weights = torch.randn(6, 64, generator=gen), torch.rand(6, 2, generator=gen)
        ids = torch.tensor([[0, 1]] * 6)
        results = []
        for model in (dense, par):
            h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
            out = model.model.layers[0].mlp.experts(h, ids, w)
            out.sum().backward()
            results.append((out.detach(), h.grad, w.grad))
        for got, want in zip(results[1], results[0]):
            _close(got, want, msg=lambda m, sp=sp: f"every route to rank 0, sp={sp}: {m}")
    dense = _moe("mixtral")
    ep_plan = {**ATTENTION_PLAN, **{"model." + k: v for k, v in dense.config.base_model_ep_plan.items()}}
    assert set(ep_plan.values()) == {"colwise", "rowwise", "grouped_gemm", "ep_dispatch_experts"}
    _check_against_dense(dense, parallelize(copy.deepcopy(dense), None, plan=ep_plan), "mixtral ep plan")
    # generation with a cache, one token at a time, under inference mode: the same tokens as the dense model
    dense = _moe("mixtral").eval()
    prompt = _batch()[0][:, :5]
    with torch.inference_mode():
        want = dense.generate(prompt, max_new_tokens=4, do_sample=False)
        for split in ("features", "experts"):
            par = parallelize(copy.deepcopy(dense), None, expert_split=split)
            assert torch.equal(par.generate(prompt, max_new_tokens=4, do_sample=False), want), split
    # Mixtral's halves: rank r keeps gate rows r·I/t… and up rows r·I/t…
    dense = _moe("mixtral")
    par = parallelize(copy.deepcopy(dense), None)
    whole, local = dense.model.layers[0].mlp.experts.gate_up_proj, par.model.layers[0].mlp.experts.gate_up_proj
    assert torch.equal(local[:, :48], whole[:, 48 * rank : 48 * rank + 48])
    assert torch.equal(local[:, 48:], whole[:, 96 + 48 * rank : 96 + 48 * rank + 48])
    # every Hugging Face experts implementation runs on the local features
    for impl in ("eager", "batched_mm", "grouped_mm"):  # transformers' default is grouped_mm
        dense = _moe("mixtral")
        dense.set_experts_implementation(impl)
        _check_against_dense(dense, parallelize(copy.deepcopy(dense), None), f"mixtral {impl}")
    # the load-balancing loss: every rank routes every token (under sequence parallelism the routers' logits are
    # gathered in the model's token order), so it is the dense model's, over a padded batch's mask as well
    ids, weights = _batch()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second row left-padded: a token order other than the model's would mask others
    for family, plan, split in (("mixtral", None, "features"), ("gpt_oss", GPT_OSS_PLAN, "features"),
                                ("mixtral", None, "experts")):  # fmt: skip
        for sp in (False, True):
            dense = _moe(family, router_aux_loss_coef=0.5)
            par = parallelize(copy.deepcopy(dense), None, plan=plan, sequence_parallel=sp, expert_split=split)
            losses = []
            for model in (dense, par):
                out = model(ids, attention_mask=mask, labels=ids, output_router_logits=True)
                (out.loss + (out.logits * weights).sum() * 1e-3).backward()
                losses.append(out.aux_loss.detach())
                assert out.router_logits[1].shape == (B * S, 4)
            _close(losses[1], losses[0], msg=lambda m, tag=f"{family} {split} sp={sp}": f"{tag} aux loss: {m}")
            _check_grads(dense, par)
            par.zero_grad()
            assert par(ids).aux_loss is None  # a forward that asks for no router logits records none
    # a model whose routers Hugging Face does not record cannot gather them: refused when asked for
    dense = _moe("mixtral")
    recorded = type(dense.model)._can_record_outputs
    type(dense.model)._can_record_outputs = {k: v for k, v in recorded.items() if k != "router_logits"}
    try:
        par = parallelize(copy.deepcopy(dense), None, sequence_parallel=True)
    finally:
        type(dense.model)._can_record_outputs = recorded
    with pytest.raises(ValueError, match=r"no router of MixtralModel is known"):
        par(ids, output_router_logits=True)
    # GPT-OSS: interleaved [g0, u0, g1, u1, ...], transposed [E, in, out], biases; down_proj_bias is added once
    dense = _moe("gpt_oss")
    with torch.no_grad():
        for layer in dense.model.layers:
            for name in ("gate_up_proj_bias", "down_proj_bias"):
                getattr(layer.mlp.experts, name).normal_()
    for impl in ("eager", "tessel"):
        for sp in (False, True):
            par = parallelize(copy.deepcopy(dense), None, plan=GPT_OSS_PLAN, sequence_parallel=sp)
            par.set_attn_implementation(impl)
            got, whole = par.model.layers[0].mlp.experts.gate_up_proj, dense.model.layers[0].mlp.experts.gate_up_proj
            assert torch.equal(got, whole[:, :, 64 * rank : 64 * rank + 64])  # 32 (gate, up) pairs per rank
            dense.zero_grad()
            _check_against_dense(dense, par, f"gpt-oss {impl} sp={sp}")
    # a plan may name per-head parameters of the attention it splits by heads, as newer Hugging Face plans
    # name attention sinks ('colwise': each rank keeps its heads' values)
    with torch.no_grad():
        for layer in dense.model.layers:
            layer.self_attn.sinks.normal_()
    par = parallelize(copy.deepcopy(dense), None, plan={**GPT_OSS_PLAN, "model.layers.*.self_attn.sinks": "colwise"})
    assert torch.equal(par.model.layers[1].self_attn.sinks, dense.model.layers[1].self_attn.sinks.chunk(2)[rank])
    dense.zero_grad()
    _check_against_dense(dense, par, "gpt-oss sinks in the plan")
    with pytest.raises(
        ValueError,
        match=r"splits model.layers.0.self_attn.sinks, a parameter of a module split by "
        r"heads, as 'rowwise'; tessel splits it by heads \('colwise'\)",
    ):
        parallelize(copy.deepcopy(dense), None, plan={**GPT_OSS_PLAN, "model.layers.*.self_attn.sinks": "rowwise"})
    # experts without a gate, with biases, in a model that is not Hugging Face's (a user plan)
    torch.manual_seed(0)
    dense = _TinyMoE()
    par = parallelize(copy.deepcopy(dense), None, plan={"experts": "moe_tp_experts"})
    assert par.experts.up_proj.shape == (4, 6, 24) and par.experts.down_proj.shape == (4, 24, 6)
    x = torch.randn(10, 24, requires_grad=True)
    x_par = x.detach().clone().requires_grad_()
    g = torch.randn(10, 24)
    (dense(x) * g).sum().backward()
    (par(x_par) * g).sum().backward()
    _close(x_par.grad, x.grad)
    _check_grads(dense, par)
    _refusals(world_size)
    return "ok"


def _refusals(world_size):
    """Plans tessel cannot honour raise before anything changes."""
    from tessel.layers.hf_experts import expert_blocks
    from tessel.layers.parallelize import parallelize

    shared_split = {"model.layers.*.mlp.shared_expert.gate_proj": "colwise",
                    "model.layers.*.mlp.shared_expert.up_proj": "colwise",
                    "model.layers.*.mlp.shared_expert.down_proj": "rowwise"}  # fmt: skip
    bad = [
        (_moe("mixtral", intermediate_size=91 if world_size == 2 else 90), None, False,
         r"experts \(MixtralExperts, style 'moe_tp_experts'\): the intermediate size 9[01] is not divisible"),
        (_moe("mixtral"), {**ATTENTION_PLAN, "model.layers.*.mlp.experts": "moe_tp_experts",
                           "model.layers.*.mlp.experts.down_proj": "colwise"}, False,
         r"splits the expert parameter model.layers.0.mlp.experts.down_proj as 'colwise'; tessel keeps it along dim "
         r"2: rowwise or local_rowwise in Hugging Face's terms"),
        (_moe("mixtral"), {**ATTENTION_PLAN, "model.layers.*.mlp.experts.down_proj": "rowwise"}, False,
         r"names a parameter; plans name modules, and .* \(received model.layers.0.mlp.experts.down_proj\)"),
        (_moe("mixtral"), {**ATTENTION_PLAN, "model.layers.*.mlp.experts": "grouped_gemm"}, False,
         "the Hugging Face style 'grouped_gemm' is not supported by tessel"),
        (_moe("mixtral"), {**ATTENTION_PLAN, "model.layers.*.mlp.gate": "moe_tp_experts"}, False,
         r"mlp.gate \(MixtralTopKRouter, style 'moe_tp_experts'\): expected 3-d expert parameters gate_up_proj"),
        (_moe("mixtral"), ATTENTION_PLAN, True, r"plan splits nothing in model.layers.0.mlp \(MixtralSparseMoeBlock\)"),
        (_moe("qwen2_moe"), {**ATTENTION_PLAN, "model.layers.*.mlp.experts": "moe_tp_experts",
                             "model.layers.*.mlp.shared_expert_gate": "rowwise", **shared_split}, True,
         r"cannot split model.layers.0.mlp.shared_expert_gate: model.layers.0.mlp holds split experts"),
    ]  # fmt: skip
    by_experts = [
        (_moe("mixtral", num_local_experts=6 if world_size == 4 else 3), None,
         r"experts \(MixtralExperts, style 'moe_tp_experts'\): the [36] experts do not split over the [24] ranks"),
        (_moe("llama4"), None, r"experts fed every token once per expert are split by 'features' only"),
    ]  # fmt: skip
    features_with_ep_params = {**ATTENTION_PLAN, "model.layers.*.mlp.experts": "moe_tp_experts",
                               "model.layers.*.mlp.experts.down_proj": "grouped_gemm"}  # fmt: skip
    bad.append((_moe("mixtral"), features_with_ep_params, False, r"down_proj as 'grouped_gemm'; tessel keeps it along"))
    for model, plan, sp, match in bad + [(m, p, False, match) for m, p, match in by_experts]:
        before, types = _state(model), [type(m) for m in model.modules()]
        with pytest.raises(ValueError, match=match):
            split = "experts" if any(m is model for m, _, _ in by_experts) else "features"
            parallelize(model, None, plan=plan, sequence_parallel=sp, expert_split=split)
        _assert_unchanged(model, before, types)
    with pytest.raises(ValueError, match=r"expert_split must be 'features' or 'experts', received 'rows'"):
        parallelize(_moe("mixtral"), None, expert_split="rows")
    # a shared expert may be split like any MLP (under sequence parallelism: one ring inside the experts' block)
    dense = _moe("qwen2_moe")
    plan = {**ATTENTION_PLAN, "model.layers.*.mlp.experts": "moe_tp_experts", **shared_split}
    for sp in (False, True):
        par = parallelize(copy.deepcopy(dense), None, plan=plan, sequence_parallel=sp)
        dense.zero_grad()
        _check_against_dense(dense, par, f"qwen2_moe shared split sp={sp}")
    # columns directly in the experts' block would receive the sequence ring's placeholder, as the router would
    with pytest.raises(ValueError, match=r"cannot split column projections directly in m.layers.0.mlp, which holds"):
        expert_blocks(["m.layers.0"], ["m.layers.0.mlp"], ["m.layers.0.mlp.experts"])


@pytest.mark.multiprocess
@needs_hf
def test_hf_experts_match_dense_on_two_ranks():
    assert run_ranks(_two_ranks, 2, timeout=400, env=REFERENCE_KERNELS) == ["ok", "ok"]


def _four_ranks(rank, world_size):
    from tessel.layers.parallelize import parallelize

    for family in ("mixtral", "qwen2_moe", "llama4"):
        for sp in (False, True):
            dense = _moe(family)
            par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp, overlap=sp or "auto")
            _check_against_dense(dense, par, f"{family} sp={sp}")
    for sp in (False, True):  # one whole expert per rank
        dense = _moe("qwen2_moe")
        par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp, expert_split="experts")
        _check_against_dense(dense, par, f"qwen2_moe sp={sp} split by experts")
    _refusals(world_size)
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_hf_experts_match_dense_on_four_ranks():
    assert run_ranks(_four_ranks, 4, timeout=400, env=REFERENCE_KERNELS) == ["ok"] * 4


def _experts(**params):
    m = nn.Module()
    for name, shape in params.items():
        setattr(m, name, nn.Parameter(torch.zeros(shape)))
    return m


def test_expert_layouts_are_read_from_flags_or_shapes_and_odd_ones_refused():
    from tessel.layers.hf_experts import ExpertSplit, expert_splits

    # no flags: [E, out, in] (Mixtral's) or [E, in, out] (Llama 4's), told apart by the shapes
    assert expert_splits(_experts(gate_up_proj=(4, 12, 8), down_proj=(4, 8, 6)), 2) == [
        ExpertSplit("gate_up_proj", 1, (6, 6)), ExpertSplit("down_proj", 2, (6,))]  # fmt: skip
    assert expert_splits(_experts(gate_up_proj=(4, 8, 12), down_proj=(4, 6, 8)), 3) == [
        ExpertSplit("gate_up_proj", 2, (6, 6)), ExpertSplit("down_proj", 1, (6,))]  # fmt: skip
    interleaved = _experts(gate_up_proj=(4, 8, 12), gate_up_proj_bias=(4, 12), down_proj=(4, 6, 8),
                           down_proj_bias=(4, 8))  # fmt: skip
    interleaved.is_transposed, interleaved.is_concatenated = True, False
    assert expert_splits(interleaved, 2) == [
        ExpertSplit("gate_up_proj", 2, (12,)), ExpertSplit("down_proj", 1, (6,)),
        ExpertSplit("gate_up_proj_bias", 1, (12,)), ExpertSplit("down_proj_bias", None)]  # fmt: skip
    square = _experts(up_proj=(4, 4, 4), down_proj=(4, 4, 4))  # no gate, hidden = intermediate: either layout fits
    square.has_gate = False
    with pytest.raises(ValueError, match=r"is ambiguous: set is_transposed on the module"):
        expert_splits(square, 2)
    square.is_transposed = True
    assert expert_splits(square, 2) == [ExpertSplit("up_proj", 2, (4,)), ExpertSplit("down_proj", 1, (4,))]
    bad = [
        (_experts(gate_up_proj=(4, 12, 8), down_proj=(4, 7, 6)), r"is unknown: set is_transposed"),
        (_experts(gate_up_proj=(4, 12, 8), down_proj=(4, 8, 6), extra=(3,)), r"unexpected parameter extra \(3,\)"),
        (_experts(gate_up_proj=(4, 12, 8)), r"expected 3-d expert parameters gate_up_proj and down_proj"),
        (_experts(gate_up_proj=(4, 12, 8), down_proj=(4, 8, 6)), r"intermediate size 6 is not divisible by .* 4"),
    ]
    for module, match in bad:
        with pytest.raises(ValueError, match=match):
            expert_splits(module, 4)
    normed = _experts(gate_up_proj=(4, 12, 8), down_proj=(4, 8, 6))
    normed.has_post_expert_norm = True
    with pytest.raises(ValueError, match="has_post_expert_norm=True"):
        expert_splits(normed, 2)


def _context_parallel(rank, world_size):
    """Experts under context parallelism (tp=2 × cp=2): each rank routes its share of the tokens."""
    from tessel.layers.parallelize import parallelize
    from tests.layers.test_context_parallel import _grid
    from tests.layers.test_hf_context_parallel import _check_against_dense as _check_cp

    _, tp_group, cp_group = _grid(rank, world_size, 2)
    for family, split in (("mixtral", "features"), ("qwen2_moe", "features"), ("mixtral", "experts")):
        for sp in (False, True):
            dense = _moe(family)
            par = parallelize(copy.deepcopy(dense), tp_group, cp_group=cp_group, sequence_parallel=sp,
                              expert_split=split)  # fmt: skip
            _check_cp(dense, par, tp_group, cp_group, f"{family} {split} cp=2 sp={sp}")
    _load_balancing_under_context_parallelism(tp_group, cp_group)
    return "ok"


def _load_balancing_under_context_parallelism(tp_group, cp_group):
    """The load-balancing loss under cp: every rank gathers every token's router logits in the sequence's order
    (row 0's left padding crosses a chunk boundary: the whole sequence's mask must line up with them) and
    computes the whole loss, equal to the dense model's. Each rank's loss weighs its own tokens' logits times c
    (the mean of c ranks' losses is the dense loss, as with data parallelism), and the gradients averaged over
    cp are the dense ones: the gather's backward sums every rank's gradient of each rank's router logits."""
    import torch.distributed as dist

    from tessel.layers.parallelize import parallelize
    from tessel.parallel.comm import group_size
    from tessel.parallel.context import split_sequence
    from tessel.parallel.sharding import shard_like

    c = group_size(cp_group)
    ids, weights = _batch()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    weights = weights * mask[..., None]  # a padded position's logits are nobody's (as in test_hf_context_parallel)
    for sp, split in ((False, "features"), (True, "features"), (False, "experts")):
        dense = _moe("mixtral", router_aux_loss_coef=0.5)
        par = parallelize(copy.deepcopy(dense), tp_group, cp_group=cp_group, sequence_parallel=sp, expert_split=split)
        out = dense(ids, attention_mask=mask, output_router_logits=True)
        ((out.logits * weights).sum() + out.aux_loss).backward()
        got = par(split_sequence(ids, cp_group), attention_mask=mask, output_router_logits=True)
        (c * (got.logits * split_sequence(weights, cp_group)).sum() + got.aux_loss).backward()
        tag = f"load balancing under cp, sp={sp} {split}"
        _close(got.aux_loss.detach(), out.aux_loss.detach(), msg=lambda m, tag=tag: f"{tag}: aux loss: {m}")
        dense_params = dict(dense.named_parameters())
        for name, p in par.named_parameters():
            grad = p.grad.clone()
            dist.all_reduce(grad, group=cp_group)
            want = shard_like(dense_params[name].grad, p, tp_group)
            _close(grad / c, want, msg=lambda m, name=name, tag=tag: f"{tag}: grad of {name}: {m}")


@pytest.mark.multiprocess
@needs_hf
def test_hf_experts_under_context_parallelism():
    assert run_ranks(_context_parallel, 4, timeout=400, env=REFERENCE_KERNELS) == ["ok"] * 4
