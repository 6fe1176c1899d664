"""VocabParallelEmbedding against nn.Embedding on 2 and 4 ranks, with and without sequence parallelism.

A lookup copies table rows and the reduction adds exactly one non-zero row to zeros, so outputs and
weight gradients are exact in fp32 except where a row id repeats: its gradient sums the repeated tokens'
output gradients in another order than the dense backward (one fp32 rounding per term, ~1e-7 relative),
checked at 1e-6.
"""

import copy

import pytest
import torch
from torch import nn

from tests.multiprocess import run_ranks

B, S, H = 2, 12, 7  # S divisible by 2 and 4; H odd
TOL = dict(rtol=1e-6, atol=1e-6)


def _dense(vocab, padding_idx=None):
    torch.manual_seed(1)
    return nn.Embedding(vocab, H, padding_idx=padding_idx, dtype=torch.float64)


def _ids(vocab, t):
    """Random ids plus every rank's first and last row, so each shard's edges are looked up."""
    ids = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(2))
    edges = [e for r in range(t) for e in (r * vocab // t, (r + 1) * vocab // t - 1)]
    ids.view(-1)[: len(edges)] = torch.tensor(edges)
    return ids


def _check(rank, t, vocab, sp, padding_idx=None):
    from tessel.layers.embedding import VocabParallelEmbedding

    dense, ids = _dense(vocab, padding_idx), _ids(vocab, t)
    if padding_idx is not None:
        ids[1, :3] = padding_idx
    dy = torch.randn(B, S, H, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ref = copy.deepcopy(dense).float().double()
    y_ref = ref(ids)
    y_ref.backward(dy.float().double())

    layer = VocabParallelEmbedding.from_embedding(copy.deepcopy(dense).float(), sequence_parallel=sp)
    seq = slice(rank * S // t, (rank + 1) * S // t) if sp else slice(None)
    rows = slice(rank * vocab // t, (rank + 1) * vocab // t)
    y = layer(ids)
    y.backward(dy[:, seq].float())
    tag = f"tp={t} sp={sp} padding_idx={padding_idx}"
    assert y.shape == (B, S // t if sp else S, H) and y.dtype == torch.float32, tag
    torch.testing.assert_close(y.double(), y_ref.detach()[:, seq], **TOL, msg=lambda m: f"{tag} output: {m}")
    torch.testing.assert_close(layer.weight.grad.double(), ref.weight.grad[rows], **TOL,
                               msg=lambda m: f"{tag} weight grad: {m}")  # fmt: skip
    if sp:  # token-major underneath: what the column-parallel layer reads without a copy
        assert y.transpose(0, 1).is_contiguous(), tag
    assert layer.weight.tensor_parallel and layer.weight.tp_dim == 0 and layer.weight.tp_parts == (vocab,)


def _embedding_worker(rank, t):
    from tessel.layers.embedding import VocabParallelEmbedding

    vocab = 5 * t  # 5 rows per rank
    for sp in (False, True):
        _check(rank, t, vocab, sp)
    _check(rank, t, vocab, True, padding_idx=vocab - 2)  # owned by the last rank
    with pytest.raises(
        ValueError, match=f"num_embeddings={vocab + 1} is not divisible by the tensor-parallel size {t}"
    ):
        VocabParallelEmbedding(vocab + 1, H)
    layer = VocabParallelEmbedding(vocab, H, sequence_parallel=True)
    with pytest.raises(ValueError, match=f"sequence length {t + 1} is not divisible by the tensor-parallel size {t}"):
        layer(torch.zeros(2, t + 1, dtype=torch.long))
    return "ok"


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_embedding_matches_dense(world):
    assert run_ranks(_embedding_worker, world, timeout=120) == ["ok"] * world


# ---------------------------------------------------------------------------------------------------- one process


def test_world_of_one_is_nn_embedding(seed):
    from tessel.layers.embedding import VocabParallelEmbedding

    dense = nn.Embedding(11, 5, padding_idx=3)
    layer = VocabParallelEmbedding.from_embedding(dense)
    ids = torch.randint(0, 11, (2, 3, 4), dtype=torch.int32)  # int32 and three dims, as nn.Embedding allows
    ids[0, 0] = 3
    y, y_ref = layer(ids), dense(ids)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    assert torch.equal(y, y_ref)
    torch.testing.assert_close(layer.weight.grad, dense.weight.grad, rtol=1e-6, atol=1e-6)
    assert torch.equal(layer.weight.grad[3], torch.zeros(5))  # padding row gets no gradient


def test_initialisation_like_nn_embedding(seed):
    from tessel.layers.embedding import VocabParallelEmbedding

    layer = VocabParallelEmbedding(1000, 16, padding_idx=7, dtype=torch.float64)
    w = layer.weight.detach()
    assert torch.equal(w[7], torch.zeros(16, dtype=torch.float64))
    # normal(0, 1): with 16k samples the mean is within 4 standard errors (4/128) of 0, the std within 3%.
    assert abs(w.mean().item()) < 0.04 and abs(w.std().item() - 1) < 0.03


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda E: E(10, 4)(torch.zeros(2, 3)), TypeError, "ids must be an integer tensor .* received torch.float32"),
        (lambda E: E(10, 4)([1, 2]), TypeError, "ids must be a torch.Tensor, received list"),
        (lambda E: E(10, 4)(torch.tensor([[1, 10]])), ValueError, r"ids must lie in \[0, 10\), received 10"),
        (lambda E: E(10, 4)(torch.tensor([[-1, 2]])), ValueError, r"received -1"),
        (lambda E: E(10, 4)(torch.tensor([1]).to("meta")), ValueError, "ids must be on the weight's device cpu"),
        (lambda E: E(10, 4, sequence_parallel=True)(torch.tensor([1, 2])), ValueError, r"needs \[batch, seq\] ids"),
        (lambda E: E(0, 4), ValueError, "num_embeddings must be a positive int, received 0"),
        (lambda E: E(10, 4, padding_idx=10), ValueError, r"padding_idx must lie in \[0, 10\)"),
        (lambda E: E.from_embedding(nn.Linear(2, 2)), TypeError, "expected an nn.Embedding"),
        (lambda E: E.from_embedding(nn.Embedding(4, 2, max_norm=1.0)), ValueError, "max_norm is not supported"),
    ],
)
def test_bad_input(call, error, words):
    from tessel.layers.embedding import VocabParallelEmbedding

    with pytest.raises(error, match=words):
        call(VocabParallelEmbedding)
