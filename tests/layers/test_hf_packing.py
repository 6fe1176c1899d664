"""Packed sequences through tessel's Hugging Face attention implementation.

Documents concatenated into one row, their ``position_ids`` restarting at each document (what
``DataCollatorWithFlattening`` produces): Hugging Face builds a boolean block-diagonal causal mask, and
:func:`tessel.layers.hf_attention.mask_segments` must recognise it exactly (and nothing else), so that
the kernel runs with ``segment_ids`` and every document's outputs are those of the document alone.

The mask analysis is checked on hand-built masks, entry by entry (flipping any single entry of a packed
mask must make it unrecognisable); the models are tiny random Llama, Mistral and Qwen2 (fp32, no
downloads), run through the Triton kernel (the interpreter on a CPU) and compared with Hugging Face's
eager attention at 1e-4 relative (the kernel's online softmax reorders the sums, ~1e-6).
"""

import importlib.util

import pytest
import torch

import tessel.layers.hf_attention as hf_attention
from tessel.layers.hf_attention import mask_segments

needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
VOCAB = 128


def _segments(lengths):
    return torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])


def _packed_mask(rows, causal=True, window=None):
    """[B, 1, S, S] boolean mask of documents of the given lengths per row (all rows the same total)."""
    seg = torch.stack([_segments(lengths) for lengths in rows])
    n = seg.shape[1]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    mask = seg[:, :, None] == seg[:, None, :]
    if causal:
        mask &= j <= i
    if window is not None:
        mask &= i - j < window
    return mask[:, None], seg


# ---------------------------------------------------------------------------------------------------- the mask


@pytest.mark.parametrize("causal", [True, False])
def test_packed_masks_give_their_segments(causal):
    mask, seg = _packed_mask([[5, 4, 3], [1, 8, 2, 1]], causal)
    assert mask_segments(mask, causal)[0]
    assert torch.equal(mask_segments(mask, causal)[1], seg)
    one, one_seg = _packed_mask([[2, 7, 3]], causal)  # a mask shared by the whole batch
    exact, got = mask_segments(one.expand(3, -1, -1, -1), causal)
    assert exact and torch.equal(got, one_seg.expand(3, -1))
    # a single run per row is the plain mask: no segments needed
    assert mask_segments(_packed_mask([[12], [12]], causal)[0], causal) == (True, None)


def _mask_of(segment_ids, shape, causal=True, window=None):
    """The boolean [B, 1, Sq, Sk] mask that flash attention computes with ``segment_ids`` (None, [B, S] or a pair)."""
    b, _, sq, sk = shape
    pos, key = torch.arange(sq)[:, None] + (sk - sq), torch.arange(sk)[None, :]
    if segment_ids is None:
        mask = torch.ones(b, sq, sk, dtype=torch.bool)
    else:
        q_ids, k_ids = segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)
        assert q_ids.dtype == k_ids.dtype == torch.int32
        assert (q_ids[:, 1:] >= q_ids[:, :-1]).all() and (k_ids[:, 1:] >= k_ids[:, :-1]).all() and (q_ids >= 0).all()
        mask = (q_ids[:, :, None] == k_ids[:, None, :]).expand(b, sq, sk)
    if causal:
        mask = mask & (key <= pos)
    if window is not None:
        mask = mask & (pos - key < window)
    return mask[:, None]


def _read_exactly(mask, causal=True, window=None):
    """mask_segments' ids for ``mask``, checked to reproduce it entry by entry (None when refused)."""
    exact, ids = mask_segments(mask, causal, window)
    if not exact:
        assert ids is None
        return None
    assert torch.equal(_mask_of(ids, mask.shape, causal, window), mask)
    return ids


def test_a_single_flipped_entry_is_refused_or_read_exactly():
    """Flipping one entry of a packed mask gives a pattern the ids express only when a query loses its only
    key (it then sees nothing) or a key that nobody else reads is dropped; every other flip is refused."""
    mask, _ = _packed_mask([[3, 1, 3]])
    accepted = []
    for i in range(7):
        for j in range(7):
            bad = mask.clone()
            bad[0, 0, i, j] = ~bad[0, 0, i, j]
            if _read_exactly(bad) is not None:
                accepted.append((i, j))
    # only diagonal entries: a document's first query loses its only key (it then sees nothing: 0, 3, 4), or
    # a document's last key, which only its last query reads, is read by nobody (2, 3, 6)
    assert accepted == [(0, 0), (2, 2), (3, 3), (4, 4), (6, 6)], accepted


def test_patterns_no_segmentation_expresses_are_refused():
    causal_mask, _ = _packed_mask([[4, 4]])
    # the same packing with the other causality
    assert not mask_segments(causal_mask, causal=False)[0]
    assert not mask_segments(_packed_mask([[4, 4]], causal=False)[0], causal=True)[0]
    # a padding hole inside a document, and a key hidden from some of its document's queries only
    hole = _packed_mask([[8]])[0].clone()
    hole[..., 3] = False
    partial = _packed_mask([[8]])[0].clone()
    partial[..., 5:, 2] = False
    assert mask_segments(hole, True) == (False, None) and mask_segments(partial, True) == (False, None)
    # a sliding window shorter than a document, unless the window is asked for
    windowed, seg = _packed_mask([[5, 3]], window=2)
    assert not mask_segments(windowed, True)[0]
    exact, got = mask_segments(windowed, True, window=2)
    assert exact and torch.equal(got, seg)
    assert not mask_segments(windowed, True, window=3)[0]  # another window
    assert not mask_segments(_packed_mask([[5, 3]])[0], True, window=2)[0]  # no window in the mask
    assert mask_segments(_packed_mask([[5, 3]], window=5)[0], True)[0]  # a window the documents fit in
    # what is not a boolean [B, 1, Sq, Sk] mask with Sq <= Sk
    full = _packed_mask([[6]])[0]
    for other in (None, full.float(), full[:, 0], full.expand(1, 2, 6, 6), full[..., :4], full[..., :0, :0]):
        assert mask_segments(other, True) == (False, None)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_padded_masks_give_ids_of_queries_and_keys(causal):
    """Hugging Face's masks of padded batches: the padding keys are masked for every query (and under a causal
    mask, left padding's queries see nothing); read as a pair of ids that reproduces the mask exactly."""
    s = 9
    real = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0, 0, 0], [1] * 9], dtype=torch.bool)
    pos = torch.arange(s)
    mask = real[:, None, None, :] & ((pos[None, :] <= pos[:, None]) if causal else torch.ones(s, s, dtype=torch.bool))
    ids = _read_exactly(mask, causal)
    assert isinstance(ids, tuple) and [t.shape for t in ids] == [(3, s), (3, s)]
    q_ids, k_ids = ids
    assert (q_ids[:, :, None] == k_ids[:, None, :])[~real[:, None, :].expand(-1, s, -1)].sum() == 0  # pads unread
    if causal:  # left padding's queries see nothing: ids no key has
        assert not (q_ids[0, :2, None] == k_ids[0, None, :]).any()


def test_queries_over_a_cache():
    """The last 5 of 14 positions as queries: a plain cache mask needs no ids; with left padding, with packed
    documents (the cache's first document is read by nobody), and in a window, the ids reproduce the mask."""
    sq, sk = 5, 14
    pos, key = torch.arange(sq)[:, None] + (sk - sq), torch.arange(sk)[None, :]
    causal = (key <= pos)[None, None]
    assert mask_segments(causal, True) == (True, None)
    assert mask_segments(causal & (pos - key < 4), True, window=4) == (True, None)
    padded = causal.expand(2, -1, -1, -1).clone()
    padded[1, ..., :6] = False
    assert isinstance(_read_exactly(padded), tuple)
    doc = torch.tensor([0] * 4 + [1] * 7 + [2] * 3)  # documents of keys 0-3, 4-10, 11-13
    packed = causal & (doc[sk - sq :, None] == doc[None, :])[None, None]
    q_ids, k_ids = _read_exactly(packed)
    assert not (q_ids[0, :, None] == k_ids[0, None, :4]).any()
    windowed = packed & (pos - key < 3)
    assert isinstance(_read_exactly(windowed, window=3), tuple)
    assert not mask_segments(windowed, True)[0]  # without the window it is no segmentation


def test_chunked_analysis_and_the_cached_result(monkeypatch):
    monkeypatch.setattr(hf_attention, "MASK_CHUNK_ENTRIES", 20)  # two rows of 12 at a time
    mask, seg = _packed_mask([[5, 4, 3], [12]])
    exact, got = mask_segments(mask, True)
    assert exact and torch.equal(got, seg)
    assert mask_segments(mask, True)[1] is got  # kept on the mask: the next layer reads it
    mask[1, 0, 11, 10] = False  # modified in place, in the last chunk: analysed again
    assert mask_segments(mask, True) == (False, None)


def test_masks_made_in_inference_mode_are_read_every_time():
    with torch.inference_mode():
        mask, seg = _packed_mask([[5, 4, 3]])
        first = mask_segments(mask, True)
        assert first[0] and torch.equal(first[1], seg)
        assert mask_segments(mask, True)[1] is not first[1]  # not kept: no version counter to tell a change
        mask[0, 0, 11, 10] = False
        assert mask_segments(mask, True) == (False, None)


# ---------------------------------------------------------------------------------------------------- models


def _model(family, **kw):
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, use_cache=False)  # fmt: skip
    torch.manual_seed(0)
    return model_cls(config_cls(**{**base, **kw}))


ROWS = [[5, 4, 3], [1, 6, 5]]  # documents per row, 12 tokens each


def _packed_batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(VOCAB, (len(ROWS), 12), generator=gen)
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in ROWS])
    return ids, positions, torch.randn(len(ROWS), 12, VOCAB, generator=gen)


def _run(model, impl, ids, positions, weights):
    model.set_attn_implementation(impl)
    model.zero_grad()
    logits = model(ids, position_ids=positions).logits
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _close(got, want, msg=None):
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * max(want.abs().max().item(), 1.0), msg=msg)


@needs_hf
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_packed_documents_run_the_kernel_and_match_each_document_alone(family, monkeypatch):
    import tessel.kernels.attention as attention
    from tessel.layers.hf import register_hf_attention

    register_hf_attention()
    calls = []
    kernel = attention.flash_attention
    monkeypatch.setattr(attention, "flash_attention", lambda *a, **k: calls.append(k) or kernel(*a, **k))
    model = _model(family)
    ids, positions, weights = _packed_batch()
    want = _run(model, "eager", ids, positions, weights)
    got = _run(model, "tessel", ids, positions, weights)
    assert len(calls) == 1 and calls[0]["causal"]  # the forward ran the kernel, with the documents' segments
    assert torch.equal(calls[0]["segment_ids"], torch.stack([_segments(lengths) for lengths in ROWS]))
    _close(got[0], want[0], msg=lambda m: f"logits: {m}")
    for name, grad in got[1].items():
        _close(grad, want[1][name], msg=lambda m, n=name: f"grad of {n}: {m}")
    # each document's logits are those of the document run alone
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        for r, lengths in enumerate(ROWS):
            start = 0
            for n in lengths:
                alone = model(ids[r : r + 1, start : start + n]).logits[0]
                _close(got[0][r, start : start + n], alone, msg=lambda m, r=r, s=start: f"row {r} doc at {s}: {m}")
                start += n


def test_every_single_flipped_entry_of_a_windowed_mask_is_refused_or_read_exactly():
    mask, _ = _packed_mask([[6, 3]], window=3)
    assert mask_segments(mask, True, window=3)[0]
    accepted = []
    for i in range(9):
        for j in range(9):
            bad = mask.clone()
            bad[0, 0, i, j] = ~bad[0, 0, i, j]
            if _read_exactly(bad, window=3) is not None:
                accepted.append((i, j))
    # the documents' first queries left without a key (0, 6) and their last keys read by nobody (5, 8)
    assert accepted == [(0, 0), (5, 5), (6, 6), (8, 8)], accepted


@needs_hf
@pytest.mark.parametrize("packed", [False, True], ids=["one-document", "packed"])
def test_sliding_windows_that_bite_run_the_kernel(monkeypatch, packed):
    """Mistral with a window of 3 over rows of 12 tokens: the kernel runs with window=3 (and the documents'
    segments when packed), and the logits and gradients are those of eager attention."""
    import tessel.kernels.attention as attention
    from tessel.layers.hf import register_hf_attention

    register_hf_attention()
    calls = []
    kernel = attention.flash_attention
    monkeypatch.setattr(attention, "flash_attention", lambda *a, **k: calls.append(k) or kernel(*a, **k))
    model = _model("mistral", sliding_window=3)
    ids, positions, weights = _packed_batch()
    positions = positions if packed else torch.arange(12).expand(2, -1)
    want = _run(model, "eager", ids, positions, weights)
    got = _run(model, "tessel", ids, positions, weights)
    assert len(calls) == 1 and calls[0]["window"] == 3 and ("segment_ids" in calls[0]) == packed
    _close(got[0], want[0])
    for name, grad in got[1].items():
        _close(grad, want[1][name], msg=lambda m, n=name: f"grad of {n}: {m}")


@needs_hf
@pytest.mark.gpu
def test_packed_documents_in_bf16_on_cuda():
    from tessel.layers.hf import register_hf_attention

    register_hf_attention()
    model = _model("llama").to("cuda", torch.bfloat16)
    ids, positions, weights = (t.cuda() for t in _packed_batch())
    results = {}
    for impl in ("sdpa", "tessel"):
        logits, grads = _run(model, impl, ids, positions, weights.bfloat16())
        results[impl] = logits.float(), grads["model.layers.0.self_attn.q_proj.weight"].float()
    # bf16 (8-bit mantissa): both kernels round P to bf16 before P·V, in different blocks; 2e-2 of the max
    for got, want in zip(results["tessel"], results["sdpa"]):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
