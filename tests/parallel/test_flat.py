"""Flat buffers: bucket cuts, padding to the data-parallel size, shard arithmetic, parameters as views."""

import pytest
import torch
from torch import nn

from tessel.parallel.flat import (
    backward_order,
    flatten_into_buffers,
    make_buckets,
    padded_numel,
    shard_tensors,
)


def _net(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.GELU(), nn.Linear(13, 5), nn.Linear(5, 3, bias=False)).to(dtype)


@pytest.mark.parametrize(("numel", "world", "want"), [(1, 1, 1), (7, 2, 8), (8, 2, 8), (9, 4, 12), (1, 4, 4)])
def test_padded_numel(numel, world, want):
    assert padded_numel(numel, world) == want


def test_backward_order_is_reverse_registration_without_frozen_or_duplicates():
    net = _net()
    net[2].bias.requires_grad_(False)
    names = [name for name, _ in backward_order(net)]
    assert names == ["3.weight", "2.weight", "0.bias", "0.weight"]
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    assert [name for name, _ in backward_order(tied)] == ["1.bias", "0.bias", "0.weight"]


def test_buckets_respect_size_dtype_and_never_split_a_parameter():
    net = _net()
    named = backward_order(net)  # numels: 15, 5, 65, 13, 91
    buckets = make_buckets(named, world_size=2, rank=0, bucket_bytes=80 * 4)
    assert [[s.name for s in b.slots] for b in buckets] == [
        ["3.weight", "2.bias"],
        ["2.weight", "0.bias"],
        ["0.weight"],
    ]
    assert [b.numel for b in buckets] == [20, 78, 91]
    assert [b.padded for b in buckets] == [20, 78, 92]
    assert [s.offset for s in buckets[1].slots] == [0, 65]
    one = make_buckets(named, 3, 2, bucket_bytes=None)
    assert len(one) == 1 and one[0].padded == 189 and one[0].shard_offset == 126 and one[0].shard_numel == 63
    mixed = [("a", nn.Parameter(torch.zeros(3))), ("b", nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)))]
    assert [b.dtype for b in make_buckets(mixed, 2, 0, None)] == [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_flatten_keeps_values_makes_views_and_zero_pads(world):
    net = _net()
    before = {name: p.detach().clone() for name, p in net.named_parameters()}
    buckets = make_buckets(backward_order(net), world, world - 1, bucket_bytes=70 * 4)
    buffers = flatten_into_buffers(buckets)
    assert len(buffers) == 1
    (flat,) = buffers.values()
    assert flat.numel() == sum(b.padded for b in buckets)
    for name, p in net.named_parameters():
        torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0)
        assert p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr(), name
    for b in buckets:
        assert b.params.numel() == b.padded and b.params[b.numel :].eq(0).all()
        assert b.param_shard.data_ptr() == b.params[b.shard_offset :].data_ptr()
    with torch.no_grad():  # a write into the buffer is a write into the module
        buckets[0].params.fill_(2.0)
    assert net[3].weight.eq(2.0).all()


def test_shard_slices_and_segments():
    params = [
        ("a", nn.Parameter(torch.zeros(5))),
        ("b", nn.Parameter(torch.zeros(2))),
        ("c", nn.Parameter(torch.zeros(4))),
    ]
    (b1,) = make_buckets(params, 3, 1, None)  # numel 11 -> padded 12, rank 1 owns [4, 8)
    assert [(s.name, lo, hi) for s, lo, hi in b1.shard_slices()] == [("a", 0, 1), ("b", 1, 3), ("c", 3, 4)]
    groups = {"a": 0, "b": 0, "c": 1}
    key = {id(p): groups[n] for n, p in params}
    assert b1.shard_segments(lambda p: key[id(p)]) == [(0, 3, 0), (3, 4, 1)]
    assert b1.shard_segments(lambda p: None if key[id(p)] == 0 else 7) == [(3, 4, 7)]
    (b2,) = make_buckets(params, 3, 2, None)  # rank 2 owns [8, 12): c's last 3 elements, then padding
    assert [(s.name, lo, hi) for s, lo, hi in b2.shard_slices()] == [("c", 0, 3)]


def test_shard_tensors_cut_one_flat_per_dtype():
    params = [("a", nn.Parameter(torch.zeros(5))), ("b", nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)))]
    buckets = make_buckets(params, 2, 0, None)
    shards = shard_tensors(buckets, lambda b: torch.float32)
    assert [s.numel() for s in shards] == [3, 2]
    assert shards[0].untyped_storage().data_ptr() == shards[1].untyped_storage().data_ptr()
    assert all(s.dtype == torch.float32 and s.eq(0).all() for s in shards)
    own = shard_tensors(buckets, lambda b: b.dtype)
    assert [s.dtype for s in own] == [torch.float32, torch.bfloat16]
