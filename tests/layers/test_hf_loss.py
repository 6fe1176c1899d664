"""fuse_lm_loss: a parallelized Hugging Face causal LM computes Hugging Face's own loss without its logits.

Two gloo ranks (reference kernels: these tests check the plumbing, tessel's kernels are proved elsewhere).
The fused call is compared with the same parallelized model's own forward (the logits path) on every
parameter's gradient shard, and with the dense model's Hugging Face loss.
"""

import importlib.util

import pytest
import torch

from tests.multiprocess import REFERENCE_KERNELS, run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")

VOCAB = 96


def _llama(**kw):
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      tie_word_embeddings=False, **kw)  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _close_all(got: dict, want: dict, what: str):
    for name, w in want.items():
        msg = lambda m, name=name: f"{what} {name}: {m}"
        torch.testing.assert_close(got[name], w, rtol=1e-4, atol=1e-6 * max(w.abs().max().item(), 1.0), msg=msg)


def _worker(rank, t):
    from tessel.layers import fuse_lm_loss, parallelize

    dense = _llama()
    ids = torch.randint(VOCAB, (2, 8), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[0, :3] = -100  # a masked prompt
    mask = torch.ones_like(ids)
    for sp in (False, True):
        split = _llama()
        split.load_state_dict(dense.state_dict())
        parallelize(split, None, sequence_parallel=sp)
        own = split(ids, attention_mask=mask, labels=labels)  # Hugging Face's forward: logits, then the loss
        own.loss.backward()
        want = _grads(split)
        split.zero_grad()
        assert fuse_lm_loss(split) is split and fuse_lm_loss(split) is split  # a second call changes nothing
        fused = split(ids, attention_mask=mask, labels=labels)
        assert fused.logits is None and own.logits is not None
        torch.testing.assert_close(fused.loss, own.loss.detach(), rtol=1e-5, atol=1e-6)
        fused.loss.backward()
        _close_all(_grads(split), want, f"sp={sp}")
        # The trainer's sum over num_items_in_batch; the tuple form; no labels: the model's own logits.
        n = torch.tensor(11)
        want = type(split).forward(split, ids, labels=labels, num_items_in_batch=n).loss  # the class's own forward
        got = split(ids, labels=labels, num_items_in_batch=n, return_dict=False, use_cache=False)
        assert isinstance(got, tuple) and len(got) == 1, got  # (loss,): no logits, no cache
        torch.testing.assert_close(got[0], want.detach(), rtol=1e-5, atol=1e-6)
        logits = split(ids).logits
        assert logits.shape == (2, 8, VOCAB)
    return "ok"


@pytest.mark.multiprocess
def test_the_fused_loss_is_hugging_faces():
    assert run_ranks(_worker, 2, timeout=240, env=REFERENCE_KERNELS) == ["ok", "ok"]


def test_what_it_refuses():
    from tessel.layers import fuse_lm_loss

    with pytest.raises(TypeError, match="model must be a Hugging Face PreTrainedModel, received Linear"):
        fuse_lm_loss(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"parallelized by tessel.layers.parallelize .* received LlamaForCausalLM "
                                          r"with Linear"):  # fmt: skip
        fuse_lm_loss(_llama())


@pytest.mark.parametrize(("name", "scaled"), [
    ("Granite", {"logits_scaling": 4.0}), ("Cohere", {"logit_scale": 0.25}), ("Cohere2", {"logit_scale": 0.25}),
    ("Gemma2", {"final_logit_softcapping": 0.5, "head_dim": 16, "attn_implementation": "eager"}),
    ("HyperCLOVAX", {"logits_scaling": 4.0, "head_dim": 16}), ("FalconH1", {"lm_head_multiplier": 4.0, "head_dim": 16,
     "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_chunk_size": 4}),
])  # fmt: skip
def test_scaled_and_capped_logits_in_the_fused_loss(name, scaled):
    """Granite divides its logits by logits_scaling and HyperCLOVA X multiplies them by it, Cohere multiplies them
    by logit_scale and Falcon-H1 by lm_head_multiplier, Gemma 2 soft-caps them (a cap the tiny model's logits reach):
    the fused loss and its gradients are the model's own (one process)."""
    import transformers

    config = getattr(transformers, f"{name}Config")(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, **scaled)  # fmt: skip
    from tessel.layers import fuse_lm_loss, parallelize

    torch.manual_seed(0)
    model = parallelize(getattr(transformers, f"{name}ForCausalLM")(config), None)
    ids = torch.randint(VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    own = model(ids, labels=ids)
    own.loss.backward()
    want = _grads(model)
    model.zero_grad()
    fused = fuse_lm_loss(model)(ids, labels=ids)
    assert fused.logits is None
    torch.testing.assert_close(fused.loss, own.loss.detach(), rtol=1e-5, atol=1e-6)
    fused.loss.backward()
    _close_all(_grads(model), want, name)


def test_a_deep_copy_computes_with_its_own_weights():
    import copy

    from tessel.layers import fuse_lm_loss, parallelize

    model = fuse_lm_loss(parallelize(_llama(), None))
    twin = copy.deepcopy(model)
    ids = torch.randint(VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(twin(ids, labels=ids).loss, model(ids, labels=ids).loss)
    with torch.no_grad():
        twin.lm_head.weight.mul_(3)
        twin.model.norm.weight.mul_(2)
    assert twin(ids, labels=ids).loss.item() != model(ids, labels=ids).loss.item()
    assert twin(ids, labels=ids).logits is None and twin(ids).logits is not None
    torch.testing.assert_close(twin(ids, labels=ids).loss, type(twin).forward(twin, ids, labels=ids).loss)


def test_label_smoothing_and_z_loss_are_added_as_for_tessels_gpt():
    """``fuse_lm_loss(label_smoothing=, z_loss=)``: F.cross_entropy's label smoothing and PaLM's z-loss (the
    coefficient times logsumexp² per token, averaged over the counted tokens) from the model's own logits; a
    one-stage pipeline's loss takes the same options from the model; bad options and router logits are refused."""
    import torch.nn.functional as F

    from tessel.layers import fuse_lm_loss, hf_pipeline_stage, parallelize

    model = parallelize(_llama(), None)
    ids = torch.randint(VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    labels[1, :4] = -100
    logits = model(ids).logits.double()[:, :-1].reshape(-1, VOCAB)  # the model's own forward, no labels
    target = labels[:, 1:].reshape(-1)
    counted = target != -100
    smoothed = F.cross_entropy(logits, target, label_smoothing=0.1)
    z = (torch.logsumexp(logits, -1)[counted] ** 2).mean()
    fuse_lm_loss(model, label_smoothing=0.1, z_loss=1e-2)
    torch.testing.assert_close(model(ids, labels=labels).loss.double(), smoothed + 1e-2 * z, rtol=1e-5, atol=1e-6)
    stage = hf_pipeline_stage(model, 0, 1, fused_loss=True)
    shifted = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
    torch.testing.assert_close(stage.loss(stage(ids), shifted).double(), smoothed + 1e-2 * z, rtol=1e-5, atol=1e-6)
    fuse_lm_loss(model)  # the options back to none: Hugging Face's loss again
    torch.testing.assert_close(model(ids, labels=labels).loss.double(), F.cross_entropy(logits, target), rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    with pytest.raises(ValueError, match="fuse_lm_loss: label_smoothing must lie in"):
        fuse_lm_loss(model, label_smoothing=1.5)
    with pytest.raises(TypeError, match="fuse_lm_loss: z_loss must be a float, received str"):
        fuse_lm_loss(model, z_loss="1e-4")
    fuse_lm_loss(model, z_loss=1e-4)
    with pytest.raises(ValueError, match=r"fuse_lm_loss: label_smoothing and z_loss .* router logits"):
        model(ids, labels=labels, output_router_logits=True)


def _replicated_head_worker(rank, t):
    """Zamba 2 split over the two ranks (its mixers, attention and MLP), its head left whole (no plan names it): a
    one-stage pipeline's loss, fused or from the logits, scores the whole vocabulary on each rank alone, not as a
    shard of a vocabulary split over the default group."""
    import torch.nn.functional as F

    from tessel.layers import hf_pipeline_stage, parallelize
    from tessel.layers.linear import ColumnParallelLinear
    from tests.layers.test_hf_mixers import planless_model

    model = parallelize(planless_model("zamba2"), None)
    assert type(model.lm_head) is torch.nn.Linear
    assert isinstance(model.model.layers[0].mamba.in_proj, ColumnParallelLinear)
    ids = torch.randint(128, (2, 8), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    labels[1, :4] = -100
    logits = model(ids).logits.double()[:, :-1].reshape(-1, 128)
    want = F.cross_entropy(logits, labels[:, 1:].reshape(-1))
    shifted = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
    for fused in (True, False):
        stage = hf_pipeline_stage(model, 0, 1, fused_loss=fused)
        torch.testing.assert_close(stage.loss(stage(ids), shifted).double(), want, rtol=1e-5, atol=1e-6)
    return "ok"


@pytest.mark.multiprocess
def test_a_head_the_model_leaves_whole_is_scored_on_each_rank_alone():
    assert run_ranks(_replicated_head_worker, 2, timeout=240, env=REFERENCE_KERNELS) == ["ok", "ok"]


def test_whole_logits_are_scored_as_a_split_heads_are():
    """``whole_logits_loss``: soft-capped, smoothed, with the z-loss, ignored targets left out: the loss
    ``vocab_parallel_cross_entropy`` computes in a world of one, and its gradient."""
    from tessel.layers.cross_entropy import vocab_parallel_cross_entropy
    from tessel.layers.hf_loss import whole_logits_loss

    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 5, 40, generator=gen, dtype=torch.float64)
    target = torch.randint(40, (3, 5), generator=gen)
    target[0, :2] = -100
    kw = dict(label_smoothing=0.2, z_loss=1e-2, softcap=3.0)
    a, b = (logits.clone().requires_grad_() for _ in range(2))
    got = whole_logits_loss(a, target, kw["softcap"], label_smoothing=0.2, z_loss=1e-2)
    want = vocab_parallel_cross_entropy(b, target, None, **kw)
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-6, atol=1e-7)
    got.backward()
    want.backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
