"""Local shards of tensor-parallel parameters against their global tensors, and resharding a fused layer."""

import itertools

import pytest
import torch
import torch.distributed as dist

from tessel.layers.linear import ColumnParallelLinear, RowParallelLinear
from tessel.parallel.sharding import flat_boxes, full_tensor, global_pieces, local_shard, shard_like, tp_spec
from tests.multiprocess import run_ranks


def test_local_shard_takes_each_parts_chunk():
    full = torch.arange(12.0).view(6, 2)  # parts of 2 and 4 rows
    torch.testing.assert_close(local_shard(full, 0, (2, 4), 0, 2), full[[0, 2, 3]])
    torch.testing.assert_close(local_shard(full, 0, (2, 4), 1, 2), full[[1, 4, 5]])
    torch.testing.assert_close(local_shard(full.t(), 1, (2, 4), 1, 2), full[[1, 4, 5]].t())
    with pytest.raises(ValueError, match="expected 7"):
        local_shard(full, 0, (3, 4), 0, 1)


def _reshard(rank, world_size):
    solo = [dist.new_group([r]) for r in range(world_size)][rank]
    torch.manual_seed(0)
    dense_col = ColumnParallelLinear(6, (8, 4, 4), tp_group=solo)
    dense_row = RowParallelLinear(8, 5, tp_group=solo)
    col = ColumnParallelLinear.from_linear(dense_col, tp_group=None, overlap=True)
    row = RowParallelLinear.from_linear(dense_row, tp_group=None)
    assert col.local_parts == (8 // world_size, 4 // world_size, 4 // world_size)
    assert tp_spec(col.weight, world_size) == (0, (8, 4, 4)) and tp_spec(row.weight, world_size) == (1, (8,))
    assert not hasattr(row.bias, "tensor_parallel")
    for p, dense in ((col.weight, dense_col.weight), (col.bias, dense_col.bias), (row.weight, dense_row.weight)):
        dim, parts = tp_spec(p, world_size)
        torch.testing.assert_close(full_tensor(p.data, dim, parts, None), dense.data)
        torch.testing.assert_close(p.data, shard_like(dense.data, p, None))
    x = torch.randn(3, 6)
    for got, want, n in zip(col(x), dense_col(x), (8, 4, 4)):
        c = n // world_size
        torch.testing.assert_close(got, want[:, rank * c : (rank + 1) * c])
    with pytest.raises(ValueError, match="already split over"):
        ColumnParallelLinear.from_linear(col)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4])
def test_fused_layer_of_one_rank_reshards_part_by_part(world_size):
    run_ranks(_reshard, world_size)


# ---------------------------------------------------------------------------------------------------- flat ranges


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3, 2), ()])
def test_flat_boxes_cover_a_range_once_in_contiguous_blocks(shape):
    gen = torch.Generator().manual_seed(len(shape))
    numel = torch.Size(shape).numel()
    index = torch.arange(numel).view(shape)
    for _ in range(40):
        start, stop = sorted(torch.randint(numel + 1, (2,), generator=gen).tolist())
        cover = torch.zeros(shape, dtype=torch.int64)
        boxes = flat_boxes(shape, start, stop)
        assert len(boxes) <= max(2 * len(shape) - 1, 1)
        for offsets, sizes, first in boxes:
            block = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
            # contiguous in row-major order, starting at flat element `first`
            assert index[block].flatten().tolist() == list(range(first, first + index[block].numel()))
            cover[block] += 1
        flat = cover.reshape(-1)
        assert flat[start:stop].eq(1).all() and flat[:start].eq(0).all() and flat[stop:].eq(0).all()


def _tagged(local: torch.Tensor, dim: int, parts: tuple[int, ...]) -> torch.nn.Parameter:
    p = torch.nn.Parameter(local.clone())
    p.tensor_parallel, p.tp_dim, p.tp_parts = True, dim, parts
    return p


@pytest.mark.parametrize(
    "global_shape, dim, parts",
    [((16, 6), 0, (8, 4, 4)), ((5, 12), 1, (12,)), ((12,), 0, (4, 8)), ((8, 3, 4), 0, (4, 4)), ((3, 8, 2), 1, (4, 4))],
)
@pytest.mark.parametrize("t", [1, 2, 4])
def test_global_pieces_of_every_ranks_flat_ranges_rebuild_the_global_tensor(global_shape, dim, parts, t):
    """ZeRO-style cuts of every TP rank's local tensor, placed by global_pieces, tile the global tensor."""
    assert all(n % t == 0 for n in parts), "every case's parts must split over every t"
    gen = torch.Generator().manual_seed(t)
    full = torch.randn(global_shape, generator=gen)
    rebuilt = torch.full_like(full, float("nan"))
    for rank in range(t):
        local = local_shard(full, dim, parts, rank, t)
        p = _tagged(local, dim, parts)
        cuts = sorted(torch.randperm(local.numel() - 1, generator=gen)[:3].add(1).tolist())
        edges = [0, *cuts, local.numel()]
        for start, stop in itertools.pairwise(edges):
            flat = local.reshape(-1)[start:stop]
            for offsets, block in global_pieces(p, flat, start, t, rank):
                where = tuple(slice(o, o + n) for o, n in zip(offsets, block.shape))
                assert rebuilt[where].isnan().all(), "two pieces overlap"
                rebuilt[where] = block
    torch.testing.assert_close(rebuilt, full, rtol=0, atol=0)


@pytest.mark.parametrize("t, e", [(1, 2), (2, 2), (2, 3), (1, 1)])
def test_expert_parallel_pieces_rebuild_every_experts_tensor(t, e):
    """Experts [r·X/e, …) of each ep rank, each tp-split along dim 1: global_shape, shard_like and global_pieces
    agree on where every element sits in the [X, …] global tensor."""
    from tessel.parallel.sharding import expert_spec, global_shape

    experts, parts = 6, (4, 4)
    full = torch.randn(experts, sum(parts), 3, generator=torch.Generator().manual_seed(e))
    rebuilt = torch.full_like(full, float("nan"))
    per = experts // e
    for er, tr in itertools.product(range(e), range(t)):
        local = local_shard(full, 1, parts, tr, t).narrow(0, er * per, per).clone()
        p = _tagged(local, 1, parts)
        if e > 1:
            p.expert_parallel, p.expert_range, p.expert_count = True, (er * per, er * per + per), experts
            assert expert_spec(p) == (er * per, experts)
        assert global_shape(p, t) == full.shape
        for offsets, block in global_pieces(p, local.reshape(-1)[1:], 1, t, tr) + global_pieces(
            p, local.reshape(-1)[:1], 0, t, tr
        ):
            where = tuple(slice(o, o + n) for o, n in zip(offsets, block.shape))
            assert rebuilt[where].isnan().all(), "two pieces overlap"
            rebuilt[where] = block
    torch.testing.assert_close(rebuilt, full, rtol=0, atol=0)


def test_shard_like_cuts_an_expert_parallel_parameter_to_its_experts():
    full = torch.arange(4 * 4 * 2, dtype=torch.float32).view(4, 4, 2)
    p = torch.empty(2, 4, 2)
    p.expert_parallel, p.expert_range, p.expert_count = True, (2, 4), 4
    assert torch.equal(shard_like(full, p, None), full[2:])
    q = torch.empty(2, 4, 2)
    q.expert_range = (2, 4)  # without expert_count (Hugging Face experts under parallelize): not cut
    assert torch.equal(shard_like(full, q, None), full)


def test_global_pieces_are_views_that_write_through():
    buffer = torch.zeros(12)
    p = _tagged(torch.zeros(2, 6), 0, (2, 2))  # two fused parts of 2 rows, 1 row each per rank of 2
    for offsets, block in global_pieces(p, buffer[3:10], 3, 2, 1):
        block.fill_(offsets[0] + 1)  # global rows 1 and 3 (rank 1's row of each part)
    assert buffer.tolist() == [0, 0, 0] + [2.0] * 3 + [4.0] * 4 + [0, 0]
    plain = torch.nn.Parameter(torch.zeros(3, 4))
    assert [(o, tuple(b.shape)) for o, b in global_pieces(plain, buffer[1:7], 1, 2, 1)] == [
        ((0, 1), (1, 3)),
        ((1, 0), (1, 3)),
    ]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: local_shard(torch.zeros(4, 2), 2, (4,), 0, 2), "dim must be a dimension of a 2-d tensor"),
        (lambda: local_shard(torch.zeros(4, 2), 0, (4,), 2, 2), r"rank must be in \[0, 2\), received 2"),
        (lambda: local_shard(torch.zeros(6, 2), 0, (3, 3), 0, 2), r"parts must be sizes divisible by the group"),
        (lambda: local_shard(torch.zeros(4, 2), 0, (4,), 0, 0), "group size must be a positive int"),
        (lambda: full_tensor(torch.zeros(3, 2), 0, (4,), None), r"local shard is 3, expected 4"),
        (lambda: shard_like(torch.zeros(5, 2), _tagged(torch.zeros(4, 2), 0, (4,)), None), "expected 4"),
        (lambda: flat_boxes((2, 3), 4, 7), "stop <= 6"),
        (lambda: global_pieces(torch.zeros(4), torch.zeros(2, 2), 0, 1, 0), "flat must be 1-D"),
    ],
)
def test_bad_layouts_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()
