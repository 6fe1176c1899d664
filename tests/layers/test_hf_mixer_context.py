"""Hugging Face hybrids under context parallelism (:mod:`tessel.layers.hf_mixer_context`): Mamba-2 blocks, Gated
DeltaNet linear attention and LFM2's short convolutions trade the sequence split for a split of their heads
(:mod:`tessel.parallel.context_heads`) while attention runs as the ring.

Every rank builds the same tiny hybrid (one mixer layer, one attention layer, the mixer's parameters away from their
initial values) and parallelizes a copy over a (cp × tp) grid; each rank feeds its zigzag share of the batch. The
logits gathered over the cp ranks must equal the dense model's, and every gradient summed over the cp ranks its
tensor-parallel shard of the dense gradient (fp32, 1e-4 relative, as test_hf.py). A recurrence that saw only its
rank's tokens, a head read with another rank's parameters or B and C of another group show up in every logit after
the first chunk.
"""

import copy

import pytest
import torch
import torch.distributed as dist

from tests.layers.test_context_parallel import _grid
from tests.layers.test_hf import REFERENCE_KERNELS, S, _assert_unchanged, _state, needs_hf
from tests.layers.test_hf_context_parallel import _check_against_dense
from tests.multiprocess import run_ranks


def hybrid_model(kind: str):
    """``"bamba"`` (one group of B and C), ``"bamba:2"`` (two groups), and the other hybrids' tiny models."""
    from tests.layers.test_hf_families import qwen3_5_model
    from tests.layers.test_hf_mixers import jamba_model, lfm_model, mamba_model, minimax_model, planless_model

    name, _, groups = kind.partition(":")
    if name in ("kimi_linear", "bailing_hybrid"):  # Kimi Delta Attention, then multi-head latent attention
        from tests.layers.test_hf_families import BAILING, KIMI, family_model

        return family_model(name, **(KIMI if name == "kimi_linear" else BAILING))
    if name in ("bamba", "falcon_h1", "nemotron_h", "granitemoehybrid"):
        return mamba_model(name, int(groups or 1))
    if name.startswith("lfm"):
        return lfm_model(name)
    if name in ("zamba2", "mamba", "mamba2", "falcon_mamba"):
        return planless_model(name)
    if name in ("jamba", "minimax"):
        return jamba_model() if name == "jamba" else minimax_model()
    return qwen3_5_model(name)


def _mixers(model, names=None):
    """The mixers of ``model`` that run under context parallelism, by their ``names`` in the dense model."""
    from tessel.layers.hf_mixer_context import context_mixers

    return [model.get_submodule(n) for n in names or context_mixers(model)]


def _counts(mixer) -> dict:
    names = ("num_heads", "intermediate_size", "n_groups", "conv_dim", "num_k_heads", "num_v_heads", "key_dim",
             "value_dim", "num_attention_heads", "qkv_dim")  # fmt: skip
    return {n: getattr(mixer, n) for n in names if hasattr(mixer, n)}


def _grid_ranks(rank, world_size, cp, kinds, sp_options):
    from tessel.layers.hf_mixer_context import context_mixers
    from tessel.layers.parallelize import parallelize
    from tessel.parallel.comm import count_bytes

    _, tp_group, cp_group = _grid(rank, world_size, cp)
    t = world_size // cp
    for kind in kinds:
        for sp in sp_options:
            dense = hybrid_model(kind)
            tp_only = parallelize(copy.deepcopy(dense), tp_group, sequence_parallel=sp) if t > 1 else dense
            par = parallelize(copy.deepcopy(dense), tp_group, cp_group=cp_group, sequence_parallel=sp)
            names = context_mixers(dense)
            assert names, kind
            for before, after in zip(_mixers(tp_only, names), _mixers(par, names), strict=True):
                local = _counts(before)  # each rank runs 1/c of its tensor-parallel heads (a group or key head
                want = {n: v // cp for n, v in local.items() if n not in ("n_groups", "num_k_heads", "key_dim")}
                for n in ("n_groups", "num_k_heads"):  # read by several ranks where there are fewer than ranks)
                    if n in local:
                        want[n] = max(local[n] // cp, 1)
                if "key_dim" in local:
                    want["key_dim"] = want["num_k_heads"] * before.head_k_dim
                if "conv_dim" in local and "qkv_dim" in local:  # Kimi Delta Attention's q, k and v alike
                    want["conv_dim"] = 3 * want["qkv_dim"]
                elif "conv_dim" in local:
                    states = getattr(before, "ssm_state_size", 0)
                    want["conv_dim"] = (want["intermediate_size"] + 2 * want["n_groups"] * states if states
                                        else 2 * want["key_dim"] + want["value_dim"])  # fmt: skip
                assert _counts(after) == want, (kind, _counts(after), want)
            with count_bytes() as moved:
                _check_against_dense(dense, par, tp_group, cp_group, f"{kind} cp={cp} tp={t} sp={sp}")
            assert moved.sent > 0
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_hybrids_under_context_parallelism_match_dense_on_two_ranks():
    """cp=2 alone. Bamba with one group of B and C (each rank's heads read it whole) and with two (one each);
    Falcon-H1 (its input scale, its per-part multipliers sliced with their heads, its gated norm); Granite 4.0 hybrid
    and Nemotron-H (attention without positions); Qwen3.5, Qwen3-Next (q, k, v, z packed key head by key head) and
    OLMo-hybrid's Gated DeltaNet; LFM2's short convolution; Jamba's Mamba-1 (x_proj summed over the ranks' channels);
    MiniMax's lightning attention (its norm over every head on this rank's tokens, its output gate too); the
    state-space models without attention, Mamba, Falcon-Mamba and Mamba-2, and Zamba 2 (which have no plan); Kimi
    Linear's Kimi Delta Attention (both gates' first projections on this rank's tokens, their second ones' outputs
    sent to the heads, the per-channel decay bias and per-head rate sliced with the heads), and Bailing's (its gates
    at full rank sent with q, k and v, its forget gate's head count set too)."""
    kinds = ("bamba", "bamba:2", "falcon_h1", "granitemoehybrid", "nemotron_h", "qwen3_5_text", "qwen3_next",
             "olmo_hybrid", "lfm2", "jamba", "minimax", "mamba", "falcon_mamba", "mamba2", "zamba2",
             "kimi_linear", "bailing_hybrid")  # fmt: skip
    run_ranks(_grid_ranks, 2, 2, kinds, (False,), timeout=600, env=REFERENCE_KERNELS)


@pytest.mark.multiprocess
@pytest.mark.slow
@needs_hf
def test_hybrids_under_context_and_tensor_parallelism_on_four_ranks():
    """tp=2 × cp=2, with and without sequence parallelism: each rank's tensor-parallel heads split again over the
    cp ranks (the Gated DeltaNets' one key head on each tensor-parallel rank read whole by both cp ranks), Zamba 2's
    hybrid layers (its shared attention block's embeddings split with the hidden states) among them."""
    kinds = ("bamba", "falcon_h1", "qwen3_next", "olmo_hybrid", "lfm2", "jamba", "minimax", "mamba", "zamba2",
             "kimi_linear", "bailing_hybrid")  # fmt: skip
    run_ranks(_grid_ranks, 4, 2, kinds, (False, True), timeout=600, env=REFERENCE_KERNELS)


@pytest.mark.multiprocess
@pytest.mark.slow
@needs_hf
def test_hybrids_over_four_context_parallel_ranks():
    """cp=4: two groups of B and C, each read by two ranks; Qwen3.5's two key heads, each read by two ranks; Kimi
    Delta Attention's four heads, one a rank."""
    run_ranks(_grid_ranks, 4, 4, ("bamba:2", "qwen3_5_text", "qwen3_next", "kimi_linear"), (False,), timeout=600,
              env=REFERENCE_KERNELS)  # fmt: skip


def _traffic_ranks(rank, world_size):
    """What one Mamba-2 block moves on each of c ranks holding L tokens of B rows: (c-1)·B·L features of each kind
    it exchanges. Bamba's z (I features) stays on the rank for the gated norm, which runs on the rank's tokens:
    x (I/c), B and C (the one group, N each) and dt (H/c) go to the heads, the scan's output (I/c) comes back. Falcon-H1
    scales z with the heads' multipliers: z goes to the heads and comes back with the output."""
    from tessel.layers.parallelize import parallelize
    from tessel.parallel.comm import count_bytes

    solo, _, cp_group = _grid(rank, world_size, world_size)
    c, b, length, width, heads, states = world_size, 2, 4, 128, 8, 8
    for kind, features in (("bamba", width // c + 2 * states + heads // c + width // c),
                           ("falcon_h1", 2 * width // c + 2 * states + heads // c + 2 * width // c)):  # fmt: skip
        par = parallelize(hybrid_model(kind), solo, cp_group=cp_group)
        mixer = par.model.layers[0].mamba
        x = torch.randn(b, length, 64, requires_grad=True)
        with count_bytes() as moved:
            out = mixer(hidden_states=x)
        assert out.shape == x.shape
        assert moved.sent == moved.received == (c - 1) * b * length * features * 4, (kind, moved.sent)
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_a_mamba2_block_moves_only_what_its_heads_read():
    run_ranks(_traffic_ranks, 2, timeout=300, env=REFERENCE_KERNELS)


def _joined_ranks(rank, world_size):
    """The exchanges of one forward of a mixer with several input projections: one all-to-all takes them all to the
    heads (Qwen3.5's q/k/v, z, b and a; OLMo-hybrid's six; Kimi Delta Attention's q, k, v and β, its gates' second
    projections apart, each after its first; Bailing's six, its gates at full rank), one brings the output back (the
    backward reverses each). The same bytes as one exchange each, in fewer messages; the logits and gradients are
    _grid_ranks'."""
    import tessel.parallel.context_heads as context_heads
    from tessel.layers.parallelize import parallelize
    from tessel.parallel.comm import count_bytes

    solo, _, cp_group = _grid(rank, world_size, world_size)
    calls = []
    exchange = context_heads.exchange_rows
    context_heads.exchange_rows = lambda *a, **k: calls.append(a[0].shape) or exchange(*a, **k)
    try:
        for kind, name, want in (("qwen3_5_text", "linear_attn", 2), ("olmo_hybrid", "linear_attn", 2),
                                 ("kimi_linear", "self_attn", 4), ("bailing_hybrid", "self_attn", 2)):  # fmt: skip
            mixer = parallelize(hybrid_model(kind), solo, cp_group=cp_group).model.layers[0].get_submodule(name)
            x = torch.randn(2, 4, 64, requires_grad=True)
            calls.clear()
            with count_bytes() as moved:
                out = mixer(hidden_states=x)
            assert len(calls) == want, (kind, calls)
            (out[0] if isinstance(out, tuple) else out).sum().backward()
            assert moved.sent > 0 and x.grad is not None
    finally:
        context_heads.exchange_rows = exchange
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_a_mixers_input_projections_travel_to_the_heads_in_one_exchange():
    assert run_ranks(_joined_ranks, 2, timeout=300, env=REFERENCE_KERNELS) == ["ok"] * 2


def _training_ranks(rank, world_size):
    """In training Hugging Face calls mamba_ssm's fused kernel where installed, which reads out_proj's weight itself:
    under context parallelism it would scan this rank's heads' share of the sequence as if it were all of it. Made to
    raise whenever the parallelized model calls it (the dense model gets the fallback's None)."""
    import importlib

    from tessel.layers.parallelize import parallelize

    solo, _, cp_group = _grid(rank, world_size, world_size)
    dense = hybrid_model("bamba")
    par = parallelize(copy.deepcopy(dense), solo, cp_group=cp_group)
    names = [n for n, _ in dense.named_modules() if n.endswith(".mamba")]
    module = importlib.import_module(type(_mixers(dense, names)[0]).__module__)
    original = module.mamba2_split_conv1d_scan_combined
    calls = []

    def fused(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    module.mamba2_split_conv1d_scan_combined = fused
    try:
        from tessel.parallel.context import gather_sequence, split_sequence
        from tests.layers.test_hf import _batch, _close, _forward_backward

        ids, weights = _batch()
        want = _forward_backward(dense.train(), ids, weights, use_cache=False)
        assert calls, "the dense model in training calls the fused kernel"
        calls.clear()
        got = _forward_backward(par.train(), split_sequence(ids, cp_group), split_sequence(weights, cp_group),
                                use_cache=False)  # fmt: skip
        assert not calls, "the context-parallel mixer called the fused training kernel"
        _close(gather_sequence(got, cp_group), want, msg=lambda m: f"training logits: {m}")
        assert _mixers(par, names)[0].training  # the mixer's own flag is restored after its forward
    finally:
        module.mamba2_split_conv1d_scan_combined = original
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_mamba_mixers_never_call_the_fused_training_kernel():
    run_ranks(_training_ranks, 2, timeout=300, env=REFERENCE_KERNELS)


@pytest.mark.multiprocess
@needs_hf
def test_packed_documents_in_hybrids_under_context_parallelism():
    """The whole sequence's position ids, restarting at each document: the attention layers' ring attends within
    the documents as the dense model's mask does, and the recurrences run over the row as Hugging Face's do; Qwen3.5's
    multimodal rotary embedding takes the documents' positions in its three rows. Recomputed in backward too
    (Hugging Face's gradient checkpointing): each layer's mixer exchanges its heads again."""
    from tests.layers.test_hf_context_parallel import _packed_vs_dense

    run_ranks(_packed_vs_dense, 2, 2, ("qwen3_5_text", "bamba"), timeout=300, env=REFERENCE_KERNELS)
    run_ranks(_packed_vs_dense, 2, 2, ("bamba",), False, True, timeout=300, env=REFERENCE_KERNELS)


def _padding_ranks(rank, world_size):
    """Right padding needs nothing (no token reads what comes after it): the tokens' logits are the dense model's
    with its mask. Left padding is refused by name: the recurrence would carry the padding into the tokens."""
    from tessel.layers.parallelize import parallelize
    from tessel.parallel.context import gather_sequence, split_sequence
    from tests.layers.test_hf import _batch, _close

    solo, _, cp_group = _grid(rank, world_size, world_size)
    ids, _ = _batch()
    mask = torch.ones_like(ids)
    mask[0, S - 3 :] = 0  # the first row ends in 3 pads
    for kind in ("bamba", "qwen3_5_text", "lfm2", "jamba", "minimax"):
        dense = hybrid_model(kind)
        par = parallelize(copy.deepcopy(dense), solo, cp_group=cp_group)
        with torch.no_grad():
            want = dense(ids, attention_mask=mask, use_cache=False).logits
            got = gather_sequence(par(split_sequence(ids, cp_group), attention_mask=mask, use_cache=False).logits,
                                  cp_group)  # fmt: skip
        real = mask.bool()
        _close(got[real], want[real], msg=lambda m, kind=kind: f"{kind} right-padded logits: {m}")
        left = torch.ones_like(ids)
        left[1, :2] = 0
        with pytest.raises(ValueError, match="left padding"):
            par(split_sequence(ids, cp_group), attention_mask=left, use_cache=False)
        if kind == "jamba":  # its layers hand their mixers no keywords
            continue
        lengths = torch.tensor([0, 3, S // world_size], dtype=torch.int32)  # a collator's, of the local view
        with pytest.raises(ValueError, match="not cu_seq_lens_q"):
            par(split_sequence(ids, cp_group), cu_seq_lens_q=lengths, cu_seq_lens_k=lengths, use_cache=False)
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_padding_under_context_parallelism():
    run_ranks(_padding_ranks, 2, timeout=300, env=REFERENCE_KERNELS)


def recurrent_gemma_model():
    """A tiny RecurrentGemma, whose recurrent blocks (a convolution and the RG-LRU) tessel does not split."""
    import transformers

    config = transformers.AutoConfig.for_model("recurrent_gemma", vocab_size=128, hidden_size=64,
                                               intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=1, head_dim=16, lru_width=64)  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _refusal_ranks(rank, world_size):
    from tessel.layers.parallelize import parallelize
    from tests.layers.test_hf_families import qwen3_5_model
    from tests.layers.test_hf_mixers import jamba_model

    solo, _, cp_group = _grid(rank, world_size, world_size)
    biased = jamba_model()
    for name, m in biased.named_modules():
        if name.endswith("mamba"):  # x_proj with a bias: the ranks' sum would add it once each
            x_proj = torch.nn.Linear(m.x_proj.in_features, m.x_proj.out_features)
            m.x_proj = x_proj
    cases = (
        # one key head read by both ranks, but its 3 value heads do not split over them
        (qwen3_5_model(linear_num_key_heads=1, linear_num_value_heads=3), "do not split over the 2 context-parallel"),
        (biased, "x_proj has a bias"),
        (recurrent_gemma_model(), r"also mixes tokens in model\.layers\.0\.temporal_block\.conv_1d"),
    )
    for model, match in cases:
        before, types = _state(model), [type(m) for m in model.modules()]
        with pytest.raises(ValueError, match=match):
            parallelize(model, solo, cp_group=cp_group)
        _assert_unchanged(model, before, types)
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_what_does_not_split_is_refused_before_anything_changes():
    run_ranks(_refusal_ranks, 2, timeout=300, env=REFERENCE_KERNELS)


# ---------------------------------------------------------------------------------------------------- the exchange


def _exchange_ranks(rank, world_size):
    from tessel.parallel.comm import count_bytes
    from tessel.parallel.context import split_sequence
    from tessel.parallel.context_heads import heads_to_sequence, sequence_to_heads, split_features

    c, b, s, f = world_size, 3, 4 * world_size, 6 * world_size
    gen = torch.Generator().manual_seed(0)
    whole = torch.randn(b, s, f, generator=gen, dtype=torch.float64)
    grad = torch.randn(b, s, f // c, generator=gen, dtype=torch.float64)
    x = split_sequence(whole, None).requires_grad_()
    with count_bytes() as moved:
        heads = sequence_to_heads(x, None)
    own = split_features(f, c)[rank]
    torch.testing.assert_close(heads, whole[..., own], rtol=0, atol=0)  # the whole sequence, in order
    assert moved.sent == moved.received == (c - 1) * x.numel() // c * 8  # (c-1)/c of what the rank holds
    (heads * grad).sum().backward()
    # the gradient of this rank's tokens, every feature: each rank's [grad of its features] at these tokens
    parts = [torch.empty_like(grad) for _ in range(c)]
    dist.all_gather(parts, grad)
    torch.testing.assert_close(x.grad, split_sequence(torch.cat(parts, -1), None), rtol=0, atol=0)
    back = heads_to_sequence(heads.detach(), None)
    torch.testing.assert_close(back, x.detach(), rtol=0, atol=0)
    # shared groups: 2 groups of 3 over 4 ranks, each group owned by 2; a rank's gradient sums those of its owners
    if c == 4:
        index = split_features(6, c, 3)
        assert index.tolist() == [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]]
    for bad, match in ((x[0], "batch, sequence, features"), (x[:, :3], "even")):
        with pytest.raises(ValueError, match=match):
            sequence_to_heads(bad, None)
    with pytest.raises(ValueError, match="int64 tensor"):
        sequence_to_heads(x, None, torch.zeros(c, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="pick features"):
        sequence_to_heads(x, None, torch.full((c, 2), f))
    with pytest.raises(ValueError, match="divisible"):
        heads_to_sequence(heads[:, :-1], None)
    return "ok"


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_sequence_to_heads_and_back(world):
    run_ranks(_exchange_ranks, world, timeout=120)


def test_split_features_refuses_what_does_not_split():
    from tessel.parallel.context_heads import split_features

    assert split_features(6, 2).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert split_features(8, 2, 2).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]  # whole groups each
    assert split_features(4, 4, 2).tolist() == [[0, 1], [0, 1], [2, 3], [2, 3]]  # a group read by two ranks
    for args, error in (((5, 2), ValueError), ((6, 4, 2), ValueError), ((6, 2, 4), ValueError),
                        ((6.0, 2), TypeError), ((0, 2), ValueError)):  # fmt: skip
        with pytest.raises(error):
            split_features(*args)
