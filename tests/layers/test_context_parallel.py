"""tessel's GPT under context parallelism (the sequence split over cp ranks), alone and with tensor parallelism.

The dense model runs on a process group of one rank, the parallel one on a (cp × tp) grid, from the same
seed (initialisation is layout-independent). Each rank feeds its zigzag share of the sequence; the
logits gathered over tp and cp, the loss averaged over cp, and every gradient averaged over cp (what a
data-parallel wrapper over the cp ranks does) must equal the dense model's. Rotary embeddings see the
global positions, so a wrong position or a missing cross-rank key shows up in every logit.

Tolerances as in test_gpt.py: fp32, summation orders differ (the ring merges partial attention outputs
through their log-sum-exps), checked at 1e-4 relative.

The kernels run through Triton's interpreter in the first test; the others run their plain-PyTorch
references (``REFERENCE_KERNELS``): what they test is how the model composes over ranks, and the ring's use of
the kernels (log-sum-exps, documents, windows) is tested against the interpreter in tests/parallel.
"""

import pytest
import torch
import torch.distributed as dist

from tessel.layers.gpt import GPT
from tessel.parallel.sharding import shard_like
from tests.layers.test_gpt import TOL, _batch, _config
from tests.multiprocess import REFERENCE_KERNELS, run_ranks


def _grid(rank, world_size, cp):
    """(own group, tp group, cp group) with tp innermost: rank = cp_rank · tp + tp_rank."""
    tp = world_size // cp
    solo = [dist.new_group([r]) for r in range(world_size)][rank]
    tp_groups = [dist.new_group(list(range(c * tp, (c + 1) * tp))) for c in range(cp)]
    cp_groups = [dist.new_group(list(range(t, world_size, tp))) for t in range(tp)]
    return solo, tp_groups[rank // tp], cp_groups[rank % tp]


def _gather(x, group, dim):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _documents(s: int) -> torch.Tensor:
    """[2, s] segment ids: row 0 packs documents that cross the chunk and rank boundaries (lengths 3, s-7,
    1, 3), row 1 is one document."""
    lengths = torch.tensor([3, s - 7, 1, 3])
    return torch.stack((torch.repeat_interleave(torch.arange(4), lengths), torch.zeros(s, dtype=torch.int64)))


def _cp_vs_dense(rank, world_size, cp, sequence_parallel, cfg_kw, via_parallelize=False, documents=False):
    from tessel.layers.parallelize import parallelize
    from tessel.parallel.context import gather_sequence, split_sequence

    cfg = _config(**{"n_layer": 1, **cfg_kw})
    solo, tp_group, cp_group = _grid(rank, world_size, cp)
    torch.manual_seed(0)
    dense = GPT(cfg, tp_group=solo)
    torch.manual_seed(0)
    if via_parallelize:  # a dense GPT made parallel in place: the same model as one built parallel
        par = parallelize(GPT(cfg, tp_group=solo), tp_group, cp_group=cp_group, sequence_parallel=sequence_parallel,
                          overlap=True)  # fmt: skip
        assert all(m.cp_group is cp_group for m in par.modules() if hasattr(m, "cp_group"))
    else:
        par = GPT(cfg, tp_group=tp_group, cp_group=cp_group, sequence_parallel=sequence_parallel, overlap=True)
    idx, targets = _batch(cfg, s=cfg.block_size)
    ids = _documents(cfg.block_size) if documents else None  # the whole sequence's, on every rank
    dense_logits = dense(idx, ids)
    dense_loss = dense.loss_from_logits(dense_logits, targets)
    dense_loss.backward()

    import tessel.parallel.context as context

    built, build = [], context._build_segment_tables
    context._build_segment_tables = lambda *a: built.append(1) or build(*a)
    try:
        par_logits = par(split_sequence(idx, cp_group), ids)
        par_loss = par.loss_from_logits(par_logits, split_sequence(targets, cp_group))
        par_loss.backward()
    finally:
        context._build_segment_tables = build
    assert len(built) == (0 if ids is None else 1)  # the ring's tables: once for all layers
    logits = gather_sequence(_gather(par_logits.detach(), tp_group, -1), cp_group)
    torch.testing.assert_close(logits, dense_logits.detach(), **TOL)
    loss = par_loss.detach().clone()
    dist.all_reduce(loss, group=cp_group)
    torch.testing.assert_close(loss / cp, dense_loss.detach(), **TOL)
    dense_grads = dict(dense.named_parameters())
    for name, p in par.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=cp_group)
        want = shard_like(dense_grads[name].grad, p, tp_group)
        torch.testing.assert_close(grad / cp, want, **TOL, msg=lambda m, name=name: f"grad of {name}: {m}")

    with pytest.raises(ValueError, match=f"sequence length {cfg.block_size + 2 * cp} .* on each of {cp} cp ranks"):
        par(torch.zeros(1, cfg.block_size // cp + 2, dtype=torch.int64))
    local = split_sequence(idx, cp_group)
    whole = f"\\[B, S\\] of the whole sequence \\({cp} cp ranks\\) \\(2, {cfg.block_size}\\)"
    with pytest.raises(ValueError, match=f"segment_ids must be an integer tensor of {whole}"):
        par(local, segment_ids=torch.zeros_like(local))  # this rank's share instead of the whole sequence's
    x = torch.randn(local.shape[0], local.shape[1] // (tp_group.size() if sequence_parallel else 1), cfg.n_embd)
    with pytest.raises(ValueError, match=f"segment_ids must be an integer \\[B, S\\] = \\[2, {cfg.block_size}\\]"):
        par.blocks[0].attn(x, torch.zeros_like(local))
    return par_loss.item()


@pytest.mark.multiprocess
@pytest.mark.parametrize("cfg_kw", [{}, dict(n_layer=2, recompute=True)], ids=["one-block", "recompute"])
def test_context_parallel_gpt_matches_dense(cfg_kw):
    env = REFERENCE_KERNELS if cfg_kw else None
    losses = run_ranks(_cp_vs_dense, 2, 2, False, cfg_kw, timeout=300, env=env)
    assert losses[0] != losses[1]  # each rank's loss is over its own tokens


@pytest.mark.multiprocess
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_context_and_tensor_parallel_gpt_matches_dense(sequence_parallel):
    run_ranks(_cp_vs_dense, 4, 2, sequence_parallel, {}, timeout=300, env=REFERENCE_KERNELS)


@pytest.mark.multiprocess
def test_parallelize_with_a_cp_group_makes_a_dense_gpt_context_and_tensor_parallel():
    run_ranks(_cp_vs_dense, 4, 2, True, {}, True, timeout=300, env=REFERENCE_KERNELS)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world_size", "cp", "sequence_parallel"), [(2, 2, False), (4, 2, True), (4, 4, False)],
                         ids=["cp2", "cp2-tp2-sp", "cp4"])  # fmt: skip
def test_context_parallel_packed_documents_match_dense(world_size, cp, sequence_parallel):
    """segment_ids of the whole sequence: ring attention within documents, rotary positions restarting."""
    run_ranks(_cp_vs_dense, world_size, cp, sequence_parallel, dict(block_size=24, n_layer=2), False, True,
              timeout=300, env=REFERENCE_KERNELS)  # fmt: skip


@pytest.mark.multiprocess
def test_four_context_parallel_ranks_match_dense():
    run_ranks(_cp_vs_dense, 4, 4, False, dict(block_size=24), timeout=300, env=REFERENCE_KERNELS)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("world_size", "cp", "sequence_parallel", "via_parallelize", "documents", "window"),
    [(4, 4, False, False, True, 4), (4, 2, True, True, False, 7)],
    ids=["cp4-documents-window4", "parallelize-cp2-tp2-sp-window7"],
)
def test_context_parallel_sliding_window_matches_dense(world_size, cp, sequence_parallel, via_parallelize, documents,
                                                       window):  # fmt: skip
    """GPTConfig.sliding_window under cp: the ring runs the window (4 ranks, chunks of 3 tokens: the blocks
    travel one link each way), and parallelize(cp_group=) keeps the model's window."""
    cfg = dict(block_size=24, n_layer=2, sliding_window=window)
    args = (world_size, cp, sequence_parallel, cfg, via_parallelize, documents)
    run_ranks(_cp_vs_dense, *args, timeout=300, env=REFERENCE_KERNELS)
