"""A Hugging Face mixture's load-balancing loss from per-expert sums (router_sums, balancing_loss), and fuse_lm_loss
adding it beside the fused cross entropy, as Mixtral, Qwen2-MoE and Qwen3-MoE add it to the loss of their logits.

The sums are checked against each family's own ``load_balancing_loss_func`` (value and gradient, with and without a
padding mask, summed over groups of layers); the fused forward against the model's own forward (loss, ``aux_loss``,
every gradient), in one process and on two gloo ranks with the sequence split (the routers' logits gathered).
"""

import importlib
import importlib.util

import pytest
import torch

from tests.multiprocess import REFERENCE_KERNELS, run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")

VOCAB = 96
_MOE = {"num_experts": 4, "moe_intermediate_size": 24, "mlp_only_layers": []}
MIXTURES = {"mixtral": ("Mixtral", {"num_local_experts": 4}),
            "qwen2_moe": ("Qwen2Moe", {**_MOE, "shared_expert_intermediate_size": 24}),
            "qwen3_moe": ("Qwen3Moe", _MOE)}  # fmt: skip


_HYBRID_MOE = {"num_experts": 4, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 24,
               "full_attention_interval": 2, "linear_key_head_dim": 8,
               "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4}  # fmt: skip
# The further families whose loss adds Hugging Face's load_balancing_loss_func, their experts as their configs name
# them (Granite-MoE's logits scaled as well)
FAMILIES = {"olmoe": {"num_experts": 4}, "flex_olmo": {"num_experts": 4}, "phimoe": {"num_local_experts": 4},
            "ernie4_5_moe": {"moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 24},
            "minimax": {"num_local_experts": 4}, "minimax_m2": {"num_local_experts": 4},
            "granitemoe": {"num_local_experts": 4, "logits_scaling": 2.0, "embedding_multiplier": 12.0},
            "laguna": {"num_experts": 4, "moe_intermediate_size": 24},
            "mellum": {"num_experts": 4, "moe_intermediate_size": 24},
            "gpt_oss": {"num_local_experts": 4, "sliding_window": 4, "attn_implementation": "eager"},
            # Mamba-1 mixers, attention in the 2nd layer and experts in every other one
            "jamba": {"num_experts": 4, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
                      "expert_layer_offset": 0, "use_mamba_kernels": False, "mamba_d_state": 4},
            # Gated DeltaNet layers around full attention, experts beside a shared expert in every layer
            "qwen3_next": _HYBRID_MOE, "qwen3_5_moe_text": _HYBRID_MOE,
            # routed by sqrt-softplus scores and biases, its first layer by the token ids (whose router Hugging Face
            # leaves out of the loss), a compressed layer beside a sliding one, hyper-connections
            "deepseek_v4": {"n_routed_experts": 4, "moe_intermediate_size": 24, "num_key_value_heads": 1,
                            "head_dim": 8, "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 4, "sliding_window": 4,
                            "layer_types": ["sliding_attention", "heavily_compressed_attention", "sliding_attention"],
                            "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 2},
                            "mlp_layer_types": ["hash_moe", "moe", "moe"], "hc_mult": 2, "hc_sinkhorn_iters": 3,
                            "index_n_heads": 2, "index_head_dim": 8, "index_topk": 2, "num_nextn_predict_layers": 0,
                            "attn_implementation": "eager"}}  # fmt: skip


def family_model(kind: str, layers: int = 3, **extra):
    """A tiny ``kind`` mixture (one of FAMILIES) in eval mode (Phi-3.5-MoE jitters its routers in training), built
    through the Auto classes."""
    import transformers

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, tie_word_embeddings=False, num_experts_per_tok=2, pad_token_id=0,
              bos_token_id=1, eos_token_id=2, router_aux_loss_coef=0.3, attn_implementation="sdpa")  # fmt: skip
    config = transformers.AutoConfig.for_model(kind, **{**kw, **FAMILIES[kind], **extra})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _mixture(kind: str, **extra):
    import transformers

    name, own = MIXTURES[kind]
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, tie_word_embeddings=False, num_experts_per_tok=2,
              router_aux_loss_coef=0.3, attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    return getattr(transformers, f"{name}ForCausalLM")(getattr(transformers, f"{name}Config")(**{**kw, **own, **extra}))


def _hf_balancing_loss(kind: str):
    return importlib.import_module(f"transformers.models.{kind}.modeling_{kind}").load_balancing_loss_func


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _close_grads(got: dict, want: dict, what: str):
    assert got.keys() == want.keys(), what
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-4, atol=1e-6 * max(w.abs().max().item(), 1.0),
                                   msg=lambda m, name=name: f"{what} {name}: {m}")  # fmt: skip


@pytest.mark.parametrize("kind", list(MIXTURES))
@pytest.mark.parametrize("masked", [False, True], ids=["all-tokens", "padded"])
def test_the_sums_give_each_familys_balancing_loss_and_gradient(kind, masked):
    """Five layers of [3·7, 6] logits, top-2: the loss and its gradient with respect to every layer's logits are
    Hugging Face's; sums of the layers taken in groups (as pipeline stages take them) add up to the same loss."""
    from tessel.layers.hf_router_loss import balancing_loss, router_sums, router_z_loss

    experts, top_k = 6, 2
    gen = torch.Generator().manual_seed(3)
    logits = [torch.randn(21, experts, generator=gen, dtype=torch.float64).float().requires_grad_() for _ in range(5)]
    mask = torch.ones(3, 7, dtype=torch.long)
    if masked:
        mask[0, 5:] = 0  # right padding
        mask[2, :2] = 0  # left padding
    mask_arg = mask if masked else None
    want = _hf_balancing_loss(kind)(tuple(logits), experts, top_k, mask_arg)
    want_grads = torch.autograd.grad(want, logits)
    got = balancing_loss(router_sums(tuple(logits), experts, top_k, mask_arg), experts)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for layer, (g, w) in enumerate(zip(torch.autograd.grad(got, logits), want_grads, strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-8, msg=f"layer {layer}")
    grouped = sum(router_sums(tuple(logits[a:b]), experts, top_k, mask_arg) for a, b in ((0, 2), (2, 3), (3, 5)))
    torch.testing.assert_close(balancing_loss(grouped, experts), want, rtol=1e-6, atol=0)
    sums = router_sums(tuple(logits), experts, top_k, mask_arg)
    rows = 5 * (mask.sum().item() if masked else 21)
    assert sums[-1].item() == rows and sums[:experts].sum().item() == top_k * rows
    counted = torch.autograd.grad(sums[:experts].sum() + sums[-1], logits, retain_graph=True, materialize_grads=True)
    assert all(not g.any() for g in counted)  # the counts and rows carry no gradient: the probabilities and z do
    # ST-MoE's router z-loss: the mean squared log-sum-exp over every layer's (unpadded) rows, as tessel's MoE's
    weights = mask.reshape(-1).double() if masked else torch.ones(21, dtype=torch.float64)
    squares = torch.stack([torch.logsumexp(x.double(), -1).square() for x in logits])
    want_z = (squares * weights).sum() / (5 * weights.sum())
    torch.testing.assert_close(router_z_loss(grouped, experts).double(), want_z, rtol=1e-6, atol=0)
    if not masked:
        from tessel.layers.moe import router_z_loss as moe_z_loss

        per_layer = torch.stack([moe_z_loss(x) for x in logits]).mean()
        torch.testing.assert_close(router_z_loss(sums, experts), per_layer, rtol=1e-6, atol=0)
    z_grads = torch.autograd.grad(router_z_loss(sums, experts), logits)
    want_z_grads = torch.autograd.grad((squares * weights).sum() / (5 * weights.sum()), logits)
    for g, w in zip(z_grads, want_z_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-8)


def test_bad_sums_are_refused():
    from tessel.layers.hf_router_loss import balancing_loss, router_sums, router_z_loss

    logits = (torch.randn(6, 4),)
    with pytest.raises(TypeError, match="router_logits must be a tuple of tensors, received Tensor"):
        router_sums(logits[0], 4, 2)
    with pytest.raises(ValueError, match=r"router_logits\[0\] must be \[rows, 5\], received \(6, 4\)"):
        router_sums(logits, 5, 2)
    with pytest.raises(ValueError, match=r"attention_mask holds 8 tokens, but router_logits\[0\] holds 6 rows"):
        router_sums(logits, 4, 2, torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"balancing_loss: sums must be \[10\] \(2 · experts \+ 2\), received \(9,\)"):
        balancing_loss(torch.zeros(9), 4)
    with pytest.raises(ValueError, match=r"router_z_loss: sums must be \[10\]"):
        router_z_loss(torch.zeros(9), 4)
    assert router_sums((), 3, 1).tolist() == [0.0] * 8


@pytest.mark.parametrize("kind", list(MIXTURES))
def test_the_fused_loss_adds_the_balancing_loss_as_the_model_does(kind):
    """With the router logits asked for (by the call, or by the config), the fused forward holds no logits and gives
    the model's own loss (cross entropy plus router_aux_loss_coef times the balancing loss over the unpadded
    tokens), its aux_loss and every gradient; with label smoothing and z-loss, those add to the cross entropy."""
    from tessel.layers import fuse_lm_loss, parallelize

    ids = torch.randint(VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    for by_config in (False, True):
        model = parallelize(_mixture(kind, output_router_logits=by_config), None)
        asked = {} if by_config else {"output_router_logits": True}
        own = model(ids, attention_mask=mask, labels=labels, **asked)
        own.loss.backward()
        want = _grads(model)
        model.zero_grad(set_to_none=True)
        fuse_lm_loss(model)
        fused = model(ids, attention_mask=mask, labels=labels, **asked)
        assert fused.logits is None and own.logits is not None and fused.router_logits is not None
        torch.testing.assert_close(fused.aux_loss, own.aux_loss.detach(), rtol=1e-6, atol=0)
        torch.testing.assert_close(fused.loss, own.loss.detach(), rtol=1e-5, atol=1e-6)
        fused.loss.backward()
        _close_grads(_grads(model), want, f"{kind} by_config={by_config}")
    # tessel's loss options beside the balancing loss: the smoothed cross entropy (the model's own logits) plus it
    import torch.nn.functional as F

    logits = model(ids, attention_mask=mask).logits.double()[:, :-1].reshape(-1, VOCAB)
    target = labels[:, 1:].reshape(-1)
    fuse_lm_loss(model, label_smoothing=0.1)
    fused = model(ids, attention_mask=mask, labels=labels)
    want = F.cross_entropy(logits, target, label_smoothing=0.1) + 0.3 * fused.aux_loss.double()
    torch.testing.assert_close(fused.loss.double(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"balancing loss weighs its tokens by a \[batch, sequence\] attention_mask"):
        model(ids, attention_mask=mask[:, None, None, :].bool(), labels=labels)


def _split(rank, world_size):
    """tp=2 with the sequence split: the fused loss with its balancing loss against the same split model's own
    forward (which gathers the routers' logits over the group), on every gradient shard."""
    from tessel.layers import fuse_lm_loss, parallelize

    ids = torch.randint(VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
    model = parallelize(_mixture("mixtral", output_router_logits=True), None, sequence_parallel=True)
    own = model(ids, labels=ids)
    own.loss.backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    fused = fuse_lm_loss(model)(ids, labels=ids)
    assert fused.logits is None
    torch.testing.assert_close(fused.loss, own.loss.detach(), rtol=1e-5, atol=1e-6)
    fused.loss.backward()
    _close_grads(_grads(model), want, f"rank {rank}")
    return fused.aux_loss.item()


@pytest.mark.multiprocess
def test_split_routers_balance_every_token():
    """Both ranks compute the balancing loss of every token (their routers' logits gathered), the same value."""
    first, second = run_ranks(_split, 2, timeout=240, env=REFERENCE_KERNELS)
    assert first == second


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_every_balanced_family_fuses_the_loss_of_its_own_forward(kind):
    """Every further family of BALANCED_TYPES, asked for its router logits with a padded batch: the fused forward
    gives its own forward's loss, aux_loss and every gradient, without logits."""
    from tessel.layers import fuse_lm_loss, parallelize
    from tessel.layers.hf_loss import BALANCED_TYPES

    assert set(BALANCED_TYPES) == set(MIXTURES) | set(FAMILIES)  # each listed family is checked here or above
    model = parallelize(family_model(kind, output_router_logits=True), None)
    assert model.config.model_type == kind
    ids = torch.randint(VOCAB, (2, 9), generator=torch.Generator().manual_seed(9))
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    own = model(ids, attention_mask=mask, labels=labels)
    own.loss.backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    fused = fuse_lm_loss(model)(ids, attention_mask=mask, labels=labels)
    assert fused.logits is None and own.logits is not None and own.aux_loss > 0
    torch.testing.assert_close(fused.aux_loss, own.aux_loss.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(fused.loss, own.loss.detach(), rtol=1e-5, atol=1e-6)
    fused.loss.backward()
    _close_grads(_grads(model), want, kind)
