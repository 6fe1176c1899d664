"""Local shards of tensor-parallel parameters against their global tensors, and resharding a fused layer."""

import pytest
import torch
import torch.distributed as dist

from tessel.layers.linear import ColumnParallelLinear, RowParallelLinear
from tessel.parallel.sharding import full_tensor, local_shard, shard_like, tp_spec
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
