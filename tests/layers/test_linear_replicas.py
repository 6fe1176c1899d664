"""Column-parallel layers whose parts are cut into fewer chunks than ranks (``max_chunks``): each chunk replicated on
consecutive ranks, as Megatron-LM replicates kv heads fewer than the ranks.

Every rank builds the same dense float64 layer, input and upstream gradients (one per rank: each rank's query heads
pull on its copy of a kv head differently) from shared seeds. The dense reference is one ``y = x Wᵀ + b`` whose
rows each rank reads (its global rows, :func:`~tessel.parallel.sharding.local_shard` of ``arange``), with the loss
``Σ_r <g_r, y[rows_r]>``: a replicated row's gradient is then the sum over the ranks holding it, which is what every
copy must hold after backward. Tolerances as in ``test_linear.py`` (fp32: 1e-4 relative).
"""

import pytest
import torch
from torch import nn

from tessel.parallel.sharding import full_tensor, global_pieces, local_shard, part_chunks, tp_chunks, uncounted_rows
from tests.multiprocess import run_ranks

B, S, K = 2, 8, 7
TOL = dict(rtol=1e-4, atol=1e-5)


def _rows(parts, chunks, rank, t):
    """The global rows rank ``rank`` holds of a fused weight of ``parts`` cut into ``chunks``."""
    return local_shard(torch.arange(sum(parts)), 0, parts, rank, t, chunks)


def _dense_reference(parts, chunks, t, dtype, seed=0):
    """Dense ``nn.Linear``, input, every rank's upstream gradient, and the float64 output, input and parameter
    gradients of ``Σ_r <g_r, y[:, :, rows_r]>``."""
    gen = torch.Generator().manual_seed(seed)
    lin = nn.Linear(K, sum(parts), dtype=torch.float64)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen, dtype=torch.float64))
        lin.bias.copy_(torch.randn(lin.bias.shape, generator=gen, dtype=torch.float64))
    lin = lin.to(dtype)
    x = torch.randn(B, S, K, generator=gen, dtype=torch.float64).to(dtype)
    held = [_rows(parts, chunks, r, t) for r in range(t)]
    grads = [torch.randn(B, S, len(rows), generator=gen, dtype=torch.float64).to(dtype) for rows in held]
    ref = nn.Linear(K, sum(parts), dtype=torch.float64)
    ref.load_state_dict({k: v.double() for k, v in lin.state_dict().items()})
    xd = x.double().requires_grad_()
    y = ref(xd)
    sum((y[..., rows] * g.double()).sum() for rows, g in zip(held, grads)).backward()
    return lin, x, grads, held, (y.detach(), xd.grad, ref.weight.grad, ref.bias.grad)


def _close(got, want, what):
    torch.testing.assert_close(got.double(), want.double(), **TOL, msg=lambda m: f"{what}: {m}")


def _check(layer, rank, t, sp, x, grads, rows, ref, tag):
    y_ref, dx_ref, dw_ref, db_ref = ref
    seq = slice(rank * S // t, (rank + 1) * S // t)
    x_in = (x[:, seq] if sp else x).clone().requires_grad_()
    out = layer(x_in)
    y = torch.cat(out, -1) if isinstance(out, tuple) else out
    y.backward(grads[rank])
    _close(y, y_ref[..., rows], f"{tag} output")
    _close(x_in.grad, dx_ref[:, seq] if sp else dx_ref, f"{tag} input grad")
    _close(layer.weight.grad, dw_ref[rows], f"{tag} weight grad")
    _close(layer.bias.grad, db_ref[rows], f"{tag} bias grad")


CASES = [((12, 6, 6), (None, 2, 2)), ((12, 3, 3), (None, 1, 1)), ((8, 4), (None, 4))]


def _layers_worker(rank, t):
    from tessel.layers.linear import ColumnParallelLinear

    for parts, max_chunks in CASES:
        chunks = tuple(t if m is None else min(t, m) for m in max_chunks)
        lin, x, grads, held, ref = _dense_reference(parts, chunks, t, torch.float32)
        rows = held[rank]
        for sp in (False, True):
            for overlap in (True, False):
                tag = f"parts {parts} max_chunks {max_chunks} tp={t} sp={sp} overlap={overlap}"
                packed = ColumnParallelLinear.from_packed(lin, parts, sequence_parallel=sp, overlap=overlap,
                                                          max_chunks=max_chunks)  # fmt: skip
                assert packed.chunks == chunks and tp_chunks(packed.weight, t) == chunks, tag
                _check(packed, rank, t, sp, x, grads, rows, ref, f"from_packed {tag}")
                split = [nn.Linear(K, n, dtype=torch.float32) for n in parts]
                with torch.no_grad():
                    for part, w, b in zip(split, lin.weight.split(parts), lin.bias.split(parts)):
                        part.weight.copy_(w), part.bias.copy_(b)
                fused = ColumnParallelLinear.from_linears(split, sequence_parallel=sp, overlap=overlap,
                                                          max_chunks=max_chunks)  # fmt: skip
                _check(fused, rank, t, sp, x, grads, rows, ref, f"from_linears {tag}")
                # the local layout is the sharding module's: full_tensor rebuilds the dense weight
                _close(full_tensor(fused.weight.data, 0, parts, None, chunks), lin.weight, f"{tag} full_tensor")
                # frozen: the input's gradient alone, the weight used as it is (no copy, no sum)
                fused.weight.requires_grad_(False), fused.bias.requires_grad_(False)
                assert fused.replica_summed(fused.weight) is fused.weight
                x_in = (x[:, rank * S // t : (rank + 1) * S // t] if sp else x).clone().requires_grad_()
                out = fused(x_in)
                torch.cat(out, -1).backward(grads[rank])
                _close(x_in.grad, ref[1][:, rank * S // t : (rank + 1) * S // t] if sp else ref[1], f"{tag} frozen")
    return "ok"


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_replicated_parts_match_the_dense_layer_read_by_every_rank(world):
    """Output, input gradient and every copy's summed weight and bias gradients, ± sequence parallelism, overlapped
    and plain, for kv parts of 2 and 1 heads (replicated over 2 and 4 ranks) and one part of 4 chunks."""
    assert run_ranks(_layers_worker, world, timeout=300) == ["ok"] * world


def _bytes_worker(rank, t):
    """The copies' gradients are summed over the ranks holding them alone: with 2 kv heads over 4 ranks, an all-reduce
    over 2 ranks of this rank's k and v rows (weight and bias), beside the all-reduce of the input's gradient over
    the 4."""
    from tessel.layers.linear import ColumnParallelLinear
    from tessel.parallel.comm import count_bytes

    lin, x, grads, held, ref = _dense_reference((8, 4, 4), (4, 2, 2), t, torch.float32)
    layer = ColumnParallelLinear.from_packed(lin, (8, 4, 4), max_chunks=(None, 2, 2), overlap=False)
    assert [torch.distributed.get_process_group_ranks(g) for g in layer.replica_groups.values()] == [
        [0, 1] if rank < 2 else [2, 3]]  # fmt: skip
    with count_bytes() as counted:
        _check(layer, rank, t, False, x, grads, held[rank], ref, "2 kv heads over 4 ranks")
    ring = lambda size, n: 2 * (n - 1) / n * size * 4  # an all-reduce of `size` fp32 elements over n ranks
    assert counted.sent == ring(B * S * K, t) + ring((2 + 2) * (K + 1), 2), counted.sent
    return "ok"


@pytest.mark.multiprocess
def test_copies_gradients_are_summed_over_their_ranks_alone():
    assert run_ranks(_bytes_worker, 4) == ["ok"] * 4


def _fp16_and_reshard_worker(rank, t):
    from tessel.layers.linear import ColumnParallelLinear

    parts, max_chunks = (8, 2, 2), (None, 1, 1)
    chunks = (t, 1, 1)
    lin, x, grads, held, ref = _dense_reference(parts, chunks, t, torch.float16, seed=3)
    layer = ColumnParallelLinear.from_packed(lin, parts, max_chunks=max_chunks, sequence_parallel=True)
    seq = slice(rank * S // t, (rank + 1) * S // t)
    x_in = x[:, seq].clone().requires_grad_()
    layer(x_in).backward(grads[rank])
    torch.testing.assert_close(layer.weight.grad.double(), ref[2][held[rank]], rtol=1e-2, atol=1e-2)
    # a layer of a world of one keeps its max_chunks when it is split
    solo = ColumnParallelLinear(K, parts, max_chunks=max_chunks, tp_group=torch.distributed.new_group([rank]))
    split = ColumnParallelLinear.from_linear(solo)
    assert split.max_chunks == max_chunks and split.local_parts == (8 // t, 2, 2)
    _close(split.weight, solo.weight[held[rank]], "from_linear of a world of one")
    return "ok"


@pytest.mark.multiprocess
def test_fp16_multi_query_and_a_world_of_one_resplit():
    assert run_ranks(_fp16_and_reshard_worker, 2) == ["ok"] * 2


def test_replicated_chunks_are_placed_read_back_and_counted_once():
    parts, chunks, t = (8, 4, 4), (4, 2, 2), 4
    full = torch.arange(16.0 * 3).view(16, 3)
    locals_ = [local_shard(full, 0, parts, r, t, chunks) for r in range(t)]
    # rank r holds q rows [2r, 2r+2), and kv chunk r // 2 of each kv part
    assert locals_[3][:, 0].div(3).tolist() == [6, 7, 10, 11, 14, 15]
    assert torch.equal(locals_[2][2:], locals_[3][2:]) and not torch.equal(locals_[2][:2], locals_[3][:2])
    rebuilt = torch.full_like(full, float("nan"))
    seen = torch.zeros(16, dtype=torch.int64)
    for r, local in enumerate(locals_):
        p = nn.Parameter(local.clone())
        p.tensor_parallel, p.tp_dim, p.tp_parts, p.tp_max_chunks = True, 0, parts, (None, 2, 2)
        assert tp_chunks(p, t) == chunks and tp_chunks(p, 2) == (2, 2, 2) and tp_chunks(p, 8) == (8, 2, 2)
        for offsets, block in global_pieces(p, local.reshape(-1)[1:], 1, t, r) + global_pieces(
            p, local.reshape(-1)[:1], 0, t, r
        ):
            where = tuple(slice(o, o + n) for o, n in zip(offsets, block.shape))
            rebuilt[where] = block
        # a norm counts each replicated chunk on the first rank holding it
        assert uncounted_rows(p, t, r) == ([] if r % 2 == 0 else [(2, 4), (4, 6)])
        counted = torch.ones(len(local), dtype=torch.bool)
        for lo, hi in uncounted_rows(p, t, r):
            counted[lo:hi] = False
        seen.index_add_(0, local[counted, 0].div(3).long(), torch.ones(int(counted.sum()), dtype=torch.int64))
    torch.testing.assert_close(rebuilt, full, rtol=0, atol=0)
    assert seen.eq(1).all(), "every global row counted exactly once"
    assert uncounted_rows(nn.Parameter(torch.zeros(2)), t, 1) == []


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: local_shard(torch.zeros(6, 2), 0, (4, 2), 0, 4, (4, 3)), ValueError, r"chunks \(4, 3\)"),
        (lambda: local_shard(torch.zeros(6, 2), 0, (4, 2), 0, 4, (4,)), ValueError, "chunk counts"),
        (lambda: full_tensor(torch.zeros(3, 2), 0, (4, 2), None, (1, 1)), ValueError, "expected 6"),
        (lambda: part_chunks((4, 2), (None,), 4), ValueError, r"one entry per part of \(4, 2\), received \(None,\)"),
    ],
)
def test_bad_chunk_layouts_are_refused(call, error, match):
    with pytest.raises(error, match=match):
        call()


def _bad_worker(rank, t):
    from tessel.layers.linear import ColumnParallelLinear

    cases = [
        (lambda: ColumnParallelLinear(4, (8, 4), max_chunks=3), TypeError, "max_chunks must be None or a sequence"),
        (lambda: ColumnParallelLinear(4, (8, 4), max_chunks=(None,)), ValueError,
         r"each of the 2 parts .*received \(None,\)"),
        (lambda: ColumnParallelLinear(4, (8, 4), max_chunks=(None, 0)), ValueError, "positive int or None"),
        (lambda: ColumnParallelLinear(4, (8, 6), max_chunks=(None, 3)), ValueError,
         "a part cut into 3 chunks is replicated over the tensor-parallel size 4 only if 3 divides it"),
        (lambda: ColumnParallelLinear(4, (8, 3), max_chunks=(None, 2)), ValueError,
         "out_features=3 does not split into its max_chunks=2 chunks"),
        (lambda: ColumnParallelLinear(4, (8, 4), max_chunks=(None, 2), gather_output=True), ValueError,
         "gather_output=True cannot gather parts replicated"),
        (lambda: ColumnParallelLinear.from_packed(nn.Linear(4, 11), (8, 3), max_chunks=(None, 2)), ValueError,
         r"parts \(8, 3\) do not each split"),
    ]  # fmt: skip
    for make, error, words in cases:
        with pytest.raises(error, match=words):
            make()
    ColumnParallelLinear(4, (8, 4), max_chunks=(None, 8))  # at most 8 chunks: split over the 4 ranks as usual
    return "ok"


@pytest.mark.multiprocess
def test_bad_max_chunks_are_refused_by_name():
    assert run_ranks(_bad_worker, 4) == ["ok"] * 4


def test_subgroup_refuses_ranks_outside_the_group():
    from tessel.parallel.comm import subgroup

    with pytest.raises(ValueError, match=r"must lie in the group's 1 ranks, received first=0, size=2"):
        subgroup(None, 0, 2)
    with pytest.raises(ValueError, match="received first=-1, size=1"):
        subgroup(None, -1, 1)
    with pytest.raises(TypeError, match="size must be an int, received float"):
        subgroup(None, 0, 1.0)
    assert subgroup(None, 0, 1) is None  # all of a world of one: the group itself
