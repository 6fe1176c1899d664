"""Packed documents in tessel's GPT: ``GPT(idx, segment_ids)``.

Several documents concatenated into one row must each get the logits, and give the gradients, that the
document has alone: attention stays within the document (flash attention's ``segment_ids``) and rotary
positions restart at its first token (``segment_positions``). Checked against the model run on every
document separately, in one process (with and without recomputation) and tensor-parallel on 2 gloo
ranks with sequence parallelism, against the dense model.

Tolerances: fp32; the kernel's online softmax visits different key blocks packed and alone, and the
parallel model sums row-parallel partial products in another order: ~1e-6 relative, checked at 1e-4.

The tensor-parallel runs go through the kernels in Triton's interpreter; the one-process tests of how the model
packs documents run the kernels' plain-PyTorch references (the ``reference_kernels`` fixture; tests/kernels
proves flash attention's segments against float64).
"""

import pytest
import torch

from tessel.layers.gpt import GPT, GPTConfig
from tessel.layers.rotary import apply_rotary, rotary_tables, segment_positions
from tests.multiprocess import run_ranks

TOL = dict(rtol=1e-4, atol=1e-5)
ROWS = [[4, 6, 3], [13], [1, 5, 7]]  # documents per row, 13 tokens each


def _config(**kw):
    return GPTConfig(**{**dict(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=16), **kw})


def _segments(rows=ROWS):
    return torch.stack([torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)]) for lengths in rows])


def _data(cfg, rows=ROWS, seed=3):
    gen = torch.Generator().manual_seed(seed)
    s = sum(rows[0])
    return torch.randint(cfg.vocab_size, (len(rows), s), generator=gen), torch.randn(len(rows), s, cfg.vocab_size,
                                                                                       generator=gen)  # fmt: skip


def _documents(rows=ROWS):
    """(row, start, length) of every document."""
    out = []
    for r, lengths in enumerate(rows):
        start = 0
        for n in lengths:
            out.append((r, start, n))
            start += n
    return out


# ---------------------------------------------------------------------------------------------------- positions


def test_segment_positions_restart_at_every_run():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [7, 7, 7, 7, 7, 7, 7, 7, 7], [0, 1, 0, 0, 1, 1, 1, 0, 0]])
    want = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 1, 0, 1, 2, 0, 1]])
    assert torch.equal(segment_positions(ids), want)
    for bad in (ids.float(), ids[0], 3):
        with pytest.raises(ValueError, match="segment_ids must be an integer"):
            segment_positions(bad)


def test_per_row_rotary_tables_rotate_each_row_by_its_own_positions():
    positions = segment_positions(_segments())
    cos, sin = rotary_tables(13, 16, positions=positions)
    assert cos.shape == sin.shape == (3, 13, 8)
    x = torch.randn(3, 2, 13, 16)
    got = apply_rotary(x, cos, sin)
    for r in range(3):
        row_cos, row_sin = rotary_tables(13, 16, positions=positions[r])
        assert torch.equal(cos[r], row_cos) and torch.equal(sin[r], row_sin)
        torch.testing.assert_close(got[r : r + 1], apply_rotary(x[r : r + 1], row_cos, row_sin), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"or \(B, 13\)"):
        rotary_tables(13, 16, positions=positions[:, :12])
    with pytest.raises(ValueError, match=r"\[B, S, D/2\]"):
        apply_rotary(x[:2], cos, sin)


# ---------------------------------------------------------------------------------------------------- one process


def _alone_vs_packed(model, idx, weights, segments):
    """Packed logits and gradients, and those of every document run alone (gradients summed)."""
    model.zero_grad()
    packed = model(idx, segment_ids=segments)
    (packed * weights).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    alone = torch.empty_like(packed)
    for r, start, n in _documents():
        logits = model(idx[r : r + 1, start : start + n])
        (logits * weights[r : r + 1, start : start + n]).sum().backward()
        alone[r, start : start + n] = logits[0].detach()
    return packed.detach(), packed_grads, alone, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.usefixtures("reference_kernels")
def test_packed_documents_match_each_document_alone():
    cfg = _config(n_layer=1)  # one block: the interpreter runs every kernel, for each document alone too
    torch.manual_seed(0)
    model = GPT(cfg)
    idx, weights = _data(cfg)
    packed, packed_grads, alone, alone_grads = _alone_vs_packed(model, idx, weights, _segments())
    torch.testing.assert_close(packed, alone, **TOL)
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, alone_grads[name], **TOL, msg=lambda m, n=name: f"grad of {n}: {m}")
    # without the documents' segments the same row is one sequence: the outputs differ
    assert not torch.allclose(model(idx).detach(), packed, **TOL)
    # the loss takes them too, and ignores the targets set to -100 (here: each document's last one)
    targets = torch.randint(cfg.vocab_size, idx.shape)
    for r, start, n in _documents():
        targets[r, start + n - 1] = -100
    want = torch.nn.functional.cross_entropy(packed.flatten(0, 1), targets.flatten(), ignore_index=-100)
    torch.testing.assert_close(model.loss(idx, targets, segment_ids=_segments()).detach(), want, **TOL)


@pytest.mark.usefixtures("reference_kernels")
def test_pipeline_stages_pass_the_segment_ids_on():
    """A stage that is not the last returns (activation, segment_ids); chained, the stages are the model."""
    cfg = _config(n_layer=2)
    torch.manual_seed(0)
    model = GPT(cfg)
    idx, _ = _data(cfg)
    ids = _segments()
    first, last = model.pipeline_stage(0, 2), model.pipeline_stage(1, 2)
    hidden, passed = first(idx, ids)
    assert passed is ids
    torch.testing.assert_close(last(hidden, passed), model(idx, ids), rtol=0, atol=0)
    assert isinstance(first(idx), torch.Tensor)  # without documents: the activation alone, as before


@pytest.mark.usefixtures("reference_kernels")
def test_recomputed_packed_documents_give_the_same_gradients():
    """Activation checkpointing hands each block the segment ids again when it recomputes the block."""
    grads = {}
    idx, weights = _data(_config())
    for recompute in (False, True):
        torch.manual_seed(0)
        model = GPT(_config(recompute=recompute))
        (model(idx, segment_ids=_segments()) * weights).sum().backward()
        grads[recompute] = {n: p.grad for n, p in model.named_parameters()}
    for name, grad in grads[True].items():
        assert torch.equal(grad, grads[False][name]), name


def _counting(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.usefixtures("reference_kernels")
@pytest.mark.parametrize("recompute", [False, True])
def test_document_tables_are_built_once_per_forward_not_per_layer(monkeypatch, recompute):
    """Every layer gets the same segment ids: the kernel's segment tables and the rotary tables are built
    once for the whole model (forward, recomputation and backward), and again after the ids change."""
    import tessel.kernels.attention_inputs as attention_inputs
    import tessel.layers.attention as attention_layer

    bounds = _counting(monkeypatch, attention_inputs, "_self_segment_bounds")
    positions = _counting(monkeypatch, attention_layer, "segment_positions")
    cfg = _config(n_layer=3, recompute=recompute)
    idx, weights = _data(cfg)
    torch.manual_seed(0)
    model = GPT(cfg)
    segments = _segments()
    (model(idx, segment_ids=segments) * weights).sum().backward()
    assert (len(bounds), len(positions)) == (1, 1)
    # an in-place change of the ids is seen: the tables are rebuilt and the logits are those of new ids
    segments[0] = 0
    got = model(idx, segment_ids=segments)
    assert (len(bounds), len(positions)) == (2, 2)
    torch.testing.assert_close(got, model(idx, segment_ids=segments.clone()), rtol=0, atol=0)


@pytest.mark.usefixtures("reference_kernels")
def test_rotary_tables_without_documents_are_shared_by_the_layers_and_survive_inference_mode():
    import tessel.layers.attention as attention_layer

    cfg = _config(n_layer=3)
    idx, weights = _data(cfg)
    torch.manual_seed(0)
    model = GPT(cfg)
    attention_layer._plain_rotary_tables.cache_clear()
    with torch.inference_mode():
        model(idx)
    (model(idx) * weights).sum().backward()  # tables made under inference mode are not used here
    info = attention_layer._plain_rotary_tables.cache_info()
    assert (info.misses, info.hits) == (2, 2 * (cfg.n_layer - 1))


def test_bad_segment_ids_are_refused():
    cfg = _config()
    model = GPT(cfg)
    idx, _ = _data(cfg)
    for bad in (_segments()[:, :12], _segments().float(), _segments() > 0, "0 0 1"):
        with pytest.raises(ValueError, match="segment_ids must be an integer tensor of idx's shape"):
            model(idx, segment_ids=bad)
        with pytest.raises(ValueError, match=r"segment_ids must be an integer \[B, S\] = \[3, 13\]"):
            model.blocks[0].attn(torch.randn(3, 13, 64), bad)


# ---------------------------------------------------------------------------------------------------- tensor parallel


def _tp_documents(rank, world_size, sequence_parallel):
    import torch.distributed as dist

    from tessel.parallel.sharding import shard_like

    cfg = _config(n_layer=1)
    rows = [[6, 2, 8], [16]]  # 16 tokens: divisible by the sequence-parallel size
    solo = [dist.new_group([r]) for r in range(world_size)][rank]
    torch.manual_seed(0)
    dense = GPT(cfg, tp_group=solo)
    torch.manual_seed(0)
    par = GPT(cfg, sequence_parallel=sequence_parallel, overlap=True)
    idx, weights = _data(cfg, rows)
    segments = _segments(rows)
    local = weights.chunk(world_size, dim=-1)[rank]
    want = dense(idx, segment_ids=segments)
    (want * weights).sum().backward()
    got = par(idx, segment_ids=segments)
    (got * local).sum().backward()
    torch.testing.assert_close(got.detach(), want.detach().chunk(world_size, dim=-1)[rank], **TOL)
    dense_params = dict(dense.named_parameters())
    for name, p in par.named_parameters():
        torch.testing.assert_close(p.grad, shard_like(dense_params[name].grad, p, None), **TOL,
                                   msg=lambda m, name=name: f"grad of {name}: {m}")  # fmt: skip
    # under sequence parallelism the block sees S/t tokens; segment_ids still cover the whole sequence
    attn = par.blocks[0].attn
    x = torch.randn(2, 16 // world_size if sequence_parallel else 16, 64)
    with pytest.raises(ValueError, match=r"\[B, S\] = \[2, 16\] tensor on cpu \(S: the whole sequence\)"):
        attn(x, segments[:, : x.shape[1]] if sequence_parallel else segments[:, :8])


@pytest.mark.multiprocess
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_tensor_parallel_packed_documents_match_dense(sequence_parallel):
    run_ranks(_tp_documents, 2, sequence_parallel, timeout=300)
