"""Hugging Face Llama, Mistral and Qwen2 (tiny, random init) under context parallelism: ``parallelize(cp_group=)``.

Mistral also with a sliding window shorter than the sequence (the ring runs the window, alone and within
packed documents).

Every rank builds the same dense model from one seed and parallelizes a deep copy over a (cp × tp) grid
(tp innermost); each rank feeds its zigzag share of the batch (``split_sequence``). The logits gathered
over the cp ranks must equal the dense model's, and every gradient summed over the cp ranks (the loss is
a sum over tokens, each rank holding its own) must equal the dense gradient's tensor-parallel shard.
Rotary embeddings see the global positions, and every attention runs as the ring, so a wrong position,
a missing cross-rank key or a local causal mask shows up in every logit past the first chunk.

Tolerances as in test_hf.py (fp32, 1e-4 relative): the ring merges partial attention outputs through
their log-sum-exps, reordering the softmax sums. The ranks run tessel's kernels through their
plain-PyTorch references (``TRITON_INTERPRET=0``), as in test_hf.py: the kernels are proven in
tests/kernels, the ring in tests/parallel/test_context.py.
"""

import copy

import pytest
import torch
import torch.distributed as dist

from tests.layers.test_context_parallel import _grid
from tests.layers.test_hf import (
    REFERENCE_KERNELS,
    VOCAB,
    B,
    S,
    _batch,
    _close,
    _forward_backward,
    _gemma2,
    _model,
    needs_hf,
)
from tests.layers.test_hf_plans import FAMILIES as QK_NORM_FAMILIES
from tests.layers.test_hf_plans import phi3_model, qk_norm_model
from tests.multiprocess import run_ranks


def _check_against_dense(dense, par, tp_group, cp_group, tag):
    from tessel.parallel.context import gather_sequence, split_sequence
    from tessel.parallel.sharding import shard_like

    ids, weights = _batch()
    want = _forward_backward(dense, ids, weights)
    got = _forward_backward(par, split_sequence(ids, cp_group), split_sequence(weights, cp_group))
    _close(gather_sequence(got, cp_group), want, msg=lambda m: f"{tag} logits: {m}")
    dense_params = dict(dense.named_parameters())
    for name, p in par.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=cp_group)
        expected = shard_like(dense_params[name].grad, p, tp_group)
        _close(grad, expected, msg=lambda m, name=name: f"{tag} grad of {name}: {m}")


def _family_model(family: str):
    """A tiny model of ``family``; ``"mistral-windowW"`` is Mistral with ``sliding_window=W``; ``"gemma2"``
    is test_hf's (soft-capped logits, a window of 3 in every other layer)."""
    if family.startswith("mistral-window"):
        return _model("mistral", sliding_window=int(family.removeprefix("mistral-window")))
    if family.startswith("gemma2"):  # "gemma2-head256": at Gemma 2's real head dim
        return _gemma2(int(family.removeprefix("gemma2").removeprefix("-head") or 16))
    if family == "deepseek_v3":  # multi-head latent attention: values of 8 dims beside queries and keys of 16
        from tests.layers.test_hf_experts import _moe

        return _moe("deepseek_v3")
    if family in QK_NORM_FAMILIES:  # q/k norms over all heads, split with their heads (SplitRMSNorm)
        return qk_norm_model(family)
    if family == "phi3":  # fused qkv_proj and gate_up_proj, split by heads and by features
        return phi3_model()
    if family == "gpt_oss":  # attention sinks, a window of 3 in every other layer, experts with biases
        from tests.layers.test_hf_families import gpt_oss_model

        return gpt_oss_model()
    if family == "llama-head24":  # a head dim the kernel lacks: widened to 32 with zeros
        return _model("llama", kv_heads=2, head_dim=24)
    if family in ("qwen3_5_text", "bamba"):  # hybrids: their recurrences split by heads
        from tests.layers.test_hf_mixer_context import hybrid_model

        return hybrid_model(family)
    return _model(family, kv_heads=2)


def _layer_windows(family: str) -> tuple:
    """The sliding window of each of the 2 layers (None: full attention)."""
    if family.startswith("mistral-window"):
        return (int(family.removeprefix("mistral-window")),) * 2
    return (3, None) if family.startswith(("gemma2", "gpt_oss")) else (None, None)


def _ring_links(family: str, cp: int, seq_len: int) -> int:
    """The links the ring's key/value blocks travel in the attention calls of the 2 layers (fewer under a
    short window)."""
    from tessel.parallel.context import _ring_plan

    return sum(sum(_ring_plan(cp, 0, True, seq_len // (2 * cp), w).hops) for w in _layer_windows(family))


def _shifted(ids):
    """Labels shifted left by one over the whole sequence, -100 (ignored) after the last token."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)


def _grid_vs_dense(rank, world_size, cp, families, sp_options, kv_heads):
    from tessel.layers.parallelize import parallelize
    from tessel.parallel.comm import record_events

    _, tp_group, cp_group = _grid(rank, world_size, cp)
    for family in families:
        for sp in sp_options:
            dense = _family_model(family) if kv_heads == 2 else _model(family, kv_heads=kv_heads)
            par = parallelize(copy.deepcopy(dense), tp_group, cp_group=cp_group, sequence_parallel=sp)
            assert par.config._attn_implementation == "tessel"
            with record_events() as log:
                _check_against_dense(dense, par, tp_group, cp_group, f"{family} cp={cp} sp={sp}")
            # the ring ran in every layer: c-1 key/value sends forward and again backward (fewer under a
            # window shorter than the sequence), in each of 2 layers
            sends = [e for e in log.events if e[:2] == ("send", "ring_attention")]
            assert len(sends) == 2 * _ring_links(family, cp, S), log.events
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_hf_models_under_context_parallelism_match_dense_on_two_ranks():
    families = (
        "llama",
        "mistral",
        "qwen2",
        "mistral-window3",
        "gemma2",
        "deepseek_v3",
        "llama-head24",
        "gemma2-head256",
        "gpt_oss",
    )
    run_ranks(_grid_vs_dense, 2, 2, families, (False,), 2, timeout=300, env=REFERENCE_KERNELS)


@pytest.mark.multiprocess
@needs_hf
def test_hf_models_under_context_and_tensor_parallelism_match_dense_on_four_ranks():
    # cp2 x tp2, with and without sequence parallelism (the tp ranks split each cp share again); OLMo 2's q/k
    # norms over all heads sum their squares over the tp ranks; Phi-3's fused projections split by heads;
    # DeepSeek-V3's latent attention gathers its latents under sequence parallelism; GPT-OSS's sinks split by heads
    families = ("llama", "qwen2", "olmo2", "phi3", "deepseek_v3", "gpt_oss")
    run_ranks(_grid_vs_dense, 4, 2, families, (False, True), 2, timeout=300, env=REFERENCE_KERNELS)


@pytest.mark.multiprocess
@needs_hf
def test_one_kv_head_replicated_over_the_tensor_parallel_ranks_under_context_parallelism():
    # cp2 x tp2 of one kv head: each tp rank computes it (under sequence parallelism from its tokens, gathered), and
    # the ring passes this rank's copy round the cp ranks
    run_ranks(_grid_vs_dense, 4, 2, ("llama", "qwen2"), (False, True), 1, timeout=300, env=REFERENCE_KERNELS)


@pytest.mark.multiprocess
@needs_hf
def test_hf_model_on_four_context_parallel_ranks_matches_dense():
    # Mistral's window of 2 over chunks of one token: the blocks travel one link each way, not round the ring
    assert _ring_links("mistral-window2", 4, S) == 2 * 2  # in each of the 2 layers
    run_ranks(_grid_vs_dense, 4, 4, ("llama", "mistral-window2"), (False,), 2, timeout=300, env=REFERENCE_KERNELS)


def _loss_and_refusals(rank, world_size):
    from tessel.layers.parallelize import parallelize
    from tessel.parallel.context import split_sequence

    _, tp_group, cp_group = _grid(rank, world_size, 2)
    ids, _ = _batch()
    local = split_sequence(ids, cp_group)
    # the loss through shift_labels: each rank's sum over its labelled tokens divided by the whole batch's
    # count adds up over the cp ranks to the dense model's mean (which shifts the labels itself)
    dense = _model("llama")
    par = parallelize(copy.deepcopy(dense), tp_group, cp_group=cp_group)
    want = dense(ids, labels=ids).loss
    shift = split_sequence(_shifted(ids), cp_group)
    loss = par(local, labels=shift, shift_labels=shift, num_items_in_batch=torch.tensor(B * (S - 1))).loss
    total = loss.detach().clone()
    dist.all_reduce(total, group=cp_group)
    _close(total, want.detach())
    want.backward()
    loss.backward()
    dense_params = dict(dense.named_parameters())
    for name, p in par.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=cp_group)
        _close(grad, dense_params[name].grad, msg=lambda m, name=name: f"loss grad of {name}: {m}")

    # what the local view would compute wrongly is refused
    with pytest.raises(ValueError, match=r"cannot shift labels itself .* pass shift_labels"):
        par(local, labels=local)
    # position ids are the whole sequence's, not this rank's share
    with pytest.raises(
        ValueError,
        match=r"position_ids must be the whole sequence's integer positions \[2 or 1, 8\] "
        r"\(the same on every rank.*received torch.int64 tensor of shape \[1, 4\]",
    ):
        par(local, position_ids=torch.arange(local.shape[1])[None])
    with pytest.raises(ValueError, match=r"received torch.float32 tensor of shape \[1, 8\]"):
        par(local, position_ids=torch.arange(S, dtype=torch.float32)[None])
    with pytest.raises(ValueError, match=r"\[2 or 1, 8\] .* received torch.int64 tensor of shape \[3, 8\]"):
        par(local, position_ids=torch.arange(S).expand(3, -1))  # another batch size
    with pytest.raises(ValueError, match=r"\[2 or 1, 8\] .* received list"):
        par(local, position_ids=list(range(S)))
    # the whole sequence's mask of ones (what a tokenizer returns without padding) is no mask
    with torch.no_grad():
        torch.testing.assert_close(par(local, attention_mask=torch.ones(B, S, dtype=torch.long)).logits,
                                   par(local).logits, rtol=0, atol=0)  # fmt: skip
    # a mask of the local share is refused even of ones (another rank's share may pad), and a 4-D one
    for bad, what in ((torch.ones_like(local), r"a 2-D torch.int64 mask of shape \[2, 4\]"),
                      (torch.ones(B, 1, S // 2, S // 2, dtype=torch.bool), r"a 4-D torch.bool mask")):  # fmt: skip
        with pytest.raises(
            ValueError,
            match="LlamaModel under context parallelism over 2 ranks: an attention mask "
            rf"that pads must be the whole sequence's .*\[2, 8\].* received {what}",
        ):
            par(local, attention_mask=bad)
    # a Mistral whose window is shorter than a rank's tokens builds a local sliding-window mask itself:
    # the ring runs the global window instead (checked against the dense model in _grid_vs_dense)
    short = parallelize(_model("mistral", sliding_window=2), tp_group, cp_group=cp_group)
    with torch.no_grad():
        assert torch.isfinite(short(local).logits).all()
    with pytest.raises(ValueError, match="its length must be even, received 3"):
        par(local[:, :3])
    with torch.no_grad():
        cache = par(local, use_cache=True).past_key_values
        with pytest.raises(ValueError, match="LlamaAttention under context parallelism over 2 ranks"):
            par(local[:, :2], past_key_values=cache)
    # attention sinks (GPT-OSS's) join the ring's softmax, one logit per query head: others are refused
    from tessel.layers.hf_attention import tessel_attention_forward

    q, kv = torch.randn(B, 4, S // 2, 16), torch.randn(B, 2, S // 2, 16)
    with pytest.raises(
        ValueError,
        match=r"LlamaAttention under context parallelism over 2 ranks: attention sinks "
        r"must be one float logit per query head .* received torch.float32 \(3,\)",
    ):
        tessel_attention_forward(par.model.layers[0].self_attn, q, kv, kv, None, s_aux=torch.zeros(3))
    # a window as long as the sequence is no window at all (shorter ones: _grid_vs_dense)
    wide = _model("mistral", sliding_window=S)
    _check_against_dense(wide, parallelize(copy.deepcopy(wide), tp_group, cp_group=cp_group), tp_group, cp_group,
                         "mistral window=S")  # fmt: skip

    # bad groups change nothing
    model = _model("qwen2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    types = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=r"tp_group and cp_group share the ranks \[0, 1\]"):
        parallelize(model, None, cp_group=cp_group)  # None: the world, which holds the cp ranks too
    with pytest.raises(TypeError, match=r"cp_group must be None or a torch\.distributed ProcessGroup, received int"):
        parallelize(model, tp_group, cp_group=2)
    assert [type(m) for m in model.modules()] == types
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model.config._attn_implementation != "tessel"
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"cp_group needs tessel's GPT-style attention .* Sequential has neither"):
        parallelize(mlp, tp_group, plan={"0": "colwise", "1": "rowwise"}, cp_group=cp_group)
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_hf_loss_through_shift_labels_and_what_context_parallelism_refuses():
    run_ranks(_loss_and_refusals, 2, timeout=300, env=REFERENCE_KERNELS)


# ---------------------------------------------------------------------------------------------------- packed documents

# The caller passes the whole sequence's position ids, restarting at each document; the dense model
# (without a cache) builds its block-diagonal mask from them, the parallel one runs the ring within the
# documents. Qwen3 (per-head q/k norms) and Gemma (scaled embeddings, 1 + weight norms) as well.
PACKED_S = 16  # 4 chunks of 4 on 2 ranks, 8 chunks of 2 on 4


def _packed_position_ids(rows):
    """``[len(rows), PACKED_S]`` position ids of documents of the given lengths, each restarting at 0."""
    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])


def _packed_vs_dense(rank, world_size, cp, families, sequence_parallel=False, recompute=False):
    from tessel.layers.parallelize import parallelize
    from tessel.parallel.context import gather_sequence, split_sequence
    from tessel.parallel.sharding import shard_like

    solo, tp_group, cp_group = _grid(rank, world_size, cp)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(VOCAB, (B, PACKED_S), generator=gen)
    weights = torch.randn(B, PACKED_S, VOCAB, generator=gen)
    layouts = {
        # documents inside a chunk, across a rank's chunks and across ranks; one-token documents
        "per row": _packed_position_ids([[3, 1, 6, 5, 1], [9, 7]]),
        "one row for all": _packed_position_ids([[1, 2, 10, 3]]),
        # one document that starts at position 5: rotary positions from the caller, no segments
        "offset": torch.arange(5, 5 + PACKED_S)[None],
    }
    for family in families:
        dense = _family_model(family)
        par = parallelize(copy.deepcopy(dense), tp_group, cp_group=cp_group, sequence_parallel=sequence_parallel)
        if recompute:  # each recomputed layer must get the documents again
            par.gradient_checkpointing_enable()
        for tag, positions in layouts.items():
            dense.zero_grad()
            par.zero_grad()
            # without a cache: Hugging Face reads packed documents from position ids only then
            want = _forward_backward(dense, ids, weights, position_ids=positions, use_cache=False)
            got = _forward_backward(par, split_sequence(ids, cp_group), split_sequence(weights, cp_group),
                                    position_ids=positions, use_cache=False)  # fmt: skip
            _close(gather_sequence(got, cp_group), want, msg=lambda m, tag=f"{family} {tag}": f"{tag} logits: {m}")
            dense_params = dict(dense.named_parameters())
            for name, p in par.named_parameters():
                grad = p.grad.clone()
                dist.all_reduce(grad, group=cp_group)
                _close(grad, shard_like(dense_params[name].grad, p, tp_group),
                       msg=lambda m, name=name, tag=f"{family} {tag}": f"{tag} grad of {name}: {m}")  # fmt: skip
        # documents matter: the packed logits differ from the same tokens as one sequence
        plain = _forward_backward(par, split_sequence(ids, cp_group), split_sequence(weights, cp_group))
        packed = _forward_backward(par, split_sequence(ids, cp_group), split_sequence(weights, cp_group),
                                   position_ids=layouts["per row"])  # fmt: skip
        assert not torch.allclose(plain, packed, rtol=1e-3, atol=1e-3)
    # a context-parallel group of one: the model reads the documents from the position ids itself
    dense = _family_model(families[0])
    one = parallelize(copy.deepcopy(dense), solo, cp_group=solo)
    want = _forward_backward(dense, ids, weights, position_ids=layouts["per row"], use_cache=False)
    _close(_forward_backward(one, ids, weights, position_ids=layouts["per row"], use_cache=False), want)
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_hf_packed_documents_under_context_parallelism_match_dense_on_two_ranks():
    families = ("llama", "mistral", "qwen2", "qwen3", "gemma", "mistral-window5")  # the window within documents
    run_ranks(_packed_vs_dense, 2, 2, families, timeout=300, env=REFERENCE_KERNELS)
    run_ranks(_packed_vs_dense, 2, 2, ("llama",), False, True, timeout=300, env=REFERENCE_KERNELS)  # recompute


@pytest.mark.multiprocess
@needs_hf
def test_hf_packed_documents_on_four_context_parallel_ranks_and_under_tensor_parallelism_match_dense():
    run_ranks(_packed_vs_dense, 4, 4, ("llama",), timeout=300, env=REFERENCE_KERNELS)
    run_ranks(_packed_vs_dense, 4, 2, ("qwen2",), True, timeout=300, env=REFERENCE_KERNELS)  # cp2 x tp2, with SP


# ---------------------------------------------------------------------------------------------------- padding


def _padded_vs_dense(rank, world_size, cp, families):
    """Left- and right-padded rows (the whole sequence's mask on every rank): the real tokens' logits and every
    gradient match the dense model given the same mask; padding is left out of the loss (zero weights)."""
    from tessel.layers.parallelize import parallelize
    from tessel.parallel.context import gather_sequence, split_sequence
    from tessel.parallel.sharding import shard_like

    _, tp_group, cp_group = _grid(rank, world_size, cp)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(VOCAB, (B, PACKED_S), generator=gen)
    mask = torch.ones(B, PACKED_S, dtype=torch.long)
    mask[0, :5] = 0  # left padding across a chunk boundary
    mask[1, 11:] = 0  # right padding
    weights = torch.randn(B, PACKED_S, VOCAB, generator=gen) * mask[..., None]
    real = mask.bool()
    for family in families:
        dense = _family_model(family)
        par = parallelize(copy.deepcopy(dense), tp_group, cp_group=cp_group)
        want = _forward_backward(dense, ids, weights, attention_mask=mask)
        got = _forward_backward(par, split_sequence(ids, cp_group), split_sequence(weights, cp_group),
                                attention_mask=mask)  # fmt: skip
        _close(gather_sequence(got, cp_group)[real], want[real], msg=lambda m, f=family: f"{f} padded logits: {m}")
        dense_params = dict(dense.named_parameters())
        for name, p in par.named_parameters():
            grad = p.grad.clone()
            dist.all_reduce(grad, group=cp_group)
            _close(grad, shard_like(dense_params[name].grad, p, tp_group),
                   msg=lambda m, name=name, f=family: f"{f} padded grad of {name}: {m}")  # fmt: skip
        # position ids with a mask: rotary positions only (Hugging Face reads documents from them only without one)
        positions = _packed_position_ids([[7, 9], [4, 12]])
        dense.zero_grad()
        par.zero_grad()
        want = _forward_backward(dense, ids, weights, attention_mask=mask, position_ids=positions, use_cache=False)
        got = _forward_backward(par, split_sequence(ids, cp_group), split_sequence(weights, cp_group),
                                attention_mask=mask, position_ids=positions, use_cache=False)  # fmt: skip
        _close(gather_sequence(got, cp_group)[real], want[real], msg=lambda m, f=family: f"{f} positions+padded: {m}")
    # what the ring cannot express is refused: a gap inside a row, a row of padding only, the local share
    local = split_sequence(ids, cp_group)
    for bad, words in (
        (torch.tensor([[1] * 6 + [0] * 2 + [1] * 8, [1] * PACKED_S]), "one run in each row"),
        (torch.tensor([[0] * PACKED_S, [1] * PACKED_S]), "with at least one token"),
        (split_sequence(mask, cp_group), r"must be the whole sequence's .* mask \[2, 16\]"),
    ):
        with pytest.raises(ValueError, match=words):
            par(local, attention_mask=bad)
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_hf_padded_batches_under_context_parallelism_match_dense():
    run_ranks(_padded_vs_dense, 2, 2, ("llama", "mistral-window3", "gemma2"), timeout=300, env=REFERENCE_KERNELS)
    run_ranks(_padded_vs_dense, 4, 4, ("qwen2",), timeout=300, env=REFERENCE_KERNELS)
