"""tessel.parallel.peer: buffers the ranks write into each other, and the all-gather GEMM whose chunks wait on flags.

On gloo ranks the buffers are shared-memory files every rank maps, so the protocol runs with real concurrency
between processes: a rank's gated GEMM spins on flags its peers raise while it runs (Triton's interpreter, or
the PyTorch reference waiting on the host). Results are checked against float64 over calls back to back, with a
rank held back while the others run ahead (the back-pressure of the protocol), and the bytes against the ring
formula. On a GPU, two processes share it through torch's symmetric memory.
"""

import glob
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tessel.kernels.gated_matmul import gated_matmul
from tessel.parallel.comm import count_bytes, record_events
from tessel.parallel.peer import (
    PeerAllGather,
    PeerBuffer,
    PeerReduceScatter,
    _transports,
    peer_all_gather_matmul,
    peer_matmul_all_reduce,
    peer_matmul_reduce_scatter,
    wait_at_least,
)
from tests.multiprocess import REFERENCE_KERNELS, run_ranks

M, K = 19, 13  # rows per rank, features: odd, not multiples of the interpreter's tiles
NS = (21, 6)  # two weights sharing one gather (fused QKV-style)


def _leftover_files() -> list[str]:
    return glob.glob(f"/dev/shm/tessel-peer-{os.getpid()}-*")


def _buffer_rank(rank, t):
    buf = PeerBuffer((t, 3), torch.float32)
    assert buf.local.shape == (t, 3) and buf.flags.shape == (t + 1,)  # (peers may be writing already)
    for p in range(t):  # write this rank's row of every peer's buffer, then raise its flag there
        buf.peer(p)[rank] = torch.tensor([rank, p, rank * 10 + p], dtype=torch.float32)
        buf.peer_flags(p)[rank] = 100 + rank
    dist.barrier()
    return buf.local.clone(), buf.flags.clone(), _leftover_files()


@pytest.mark.multiprocess
@pytest.mark.parametrize("t", [2, 3])
def test_every_rank_writes_every_peers_buffer_and_flags(t):
    for rank, (local, flags, leftover) in enumerate(run_ranks(_buffer_rank, t)):
        expected = torch.tensor([[q, rank, q * 10 + rank] for q in range(t)], dtype=torch.float32)
        assert torch.equal(local, expected)
        assert flags.tolist() == [100 + q for q in range(t)] + [0]
        assert leftover == []  # the files are unlinked once mapped: nothing is left behind


def _expected(shards, weights, biases):
    x = torch.cat(shards).double()
    return [x @ w.double().t() + (b.double() if b is not None else 0) for w, b in zip(weights, biases)]


def _operands(t, call, dtype, m=M, k=K):
    gen = torch.Generator().manual_seed(1000 * call)
    shards = [torch.randn(m, k, generator=gen, dtype=dtype) for _ in range(t)]
    weights = [torch.randn(n, k, generator=gen, dtype=dtype) for n in NS]
    biases = [torch.randn(NS[0], generator=gen, dtype=dtype), None]
    return shards, weights, biases


def _gather_rank(rank, t, calls, dtype, slow_rank):
    transport = PeerAllGather(M, K, dtype)
    errors = []
    for call in range(calls):
        shards, weights, biases = _operands(t, call, dtype)
        if rank == slow_rank and call == 1:
            # Held back between sending and multiplying: the others run ahead to the next call, whose writes into
            # this rank's buffer must wait until it has read this call's rows.
            x_full, ready, epoch = transport.start(shards[rank])
            time.sleep(1.0)
            outs = [gated_matmul(x_full, w.t(), ready, chunks=t, first=rank, step=max(1, t - 1), bias=b,
                                 epoch=epoch) for w, b in zip(weights, biases)]  # fmt: skip
            transport.finish()
        else:
            outs = peer_all_gather_matmul(shards[rank], weights, transport, biases=biases)
        for out, ref in zip(outs, _expected(shards, weights, biases)):
            errors.append(((out.double() - ref).abs().max() / ref.abs().max()).item())
    return errors, transport.epoch


@pytest.mark.multiprocess
@pytest.mark.parametrize("kernels", ["interpreter", "reference"])
@pytest.mark.parametrize("t", [2, 4])
def test_calls_back_to_back_equal_float64_with_a_rank_held_back(t, kernels):
    env = REFERENCE_KERNELS if kernels == "reference" else None
    results = run_ranks(_gather_rank, t, 4, torch.float32, t - 1, env=env, timeout=240)
    for errors, epoch in results:
        assert epoch == 4
        assert max(errors) < 1e-5, errors


def _bytes_rank(rank, t, op):
    with count_bytes() as counted, record_events() as log:
        if op == "all_gather":
            shards, weights, _ = _operands(t, 0, torch.float32)
            peer_all_gather_matmul(shards[rank], weights[0], PeerAllGather(M, K, torch.float32))
        else:
            xs, ws, _ = _rs_operands(t, 0, torch.float32)
            peer_matmul_reduce_scatter(xs[rank], ws[rank], PeerReduceScatter(M, N, torch.float32))
    return counted.sent, counted.received, [kind for kind, *_ in log.events]


@pytest.mark.multiprocess
@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_bytes_are_the_rings_and_the_events_in_order(op):
    t = 3
    for sent, received, events in run_ranks(_bytes_rank, t, op, env=REFERENCE_KERNELS):
        # (t-1)/t of the gathered input, or of the partial output
        assert sent == received == (t - 1) * M * (K if op == "all_gather" else N) * 4
        # the gather is sent before its GEMM; the reduce-scatter's partials after theirs
        assert events == (["send", "gemm", "wait"] if op == "all_gather" else ["gemm", "send", "wait"])


def test_a_world_of_one_gathers_its_own_shard():
    transport = PeerAllGather(M, K, torch.float32)
    shards, weights, biases = _operands(1, 0, torch.float32)
    for _ in range(2):
        outs = peer_all_gather_matmul(shards[0], weights, transport, biases=biases)
        for out, ref in zip(outs, _expected(shards, weights, biases)):
            assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-4)
    assert transport.epoch == 2 and transport.buffer.flags.tolist() == [0, 2]  # its own flag is never read


def test_a_torch_without_symmetric_memory_is_told_what_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.distributed._symmetric_memory", None)  # its import fails
    with pytest.raises(RuntimeError, match=r"GPU buffers need torch's symmetric memory .*use overlap=True"):
        PeerBuffer._open_symmetric(object.__new__(PeerBuffer))


def test_wait_at_least_returns_once_the_flag_is_reached():
    flag = torch.tensor([3], dtype=torch.int32)
    wait_at_least(flag, 3)
    wait_at_least(flag, -1)


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: PeerBuffer((0, 3), torch.float32), ValueError, r"PeerBuffer: shape must be positive ints, .*\(0, 3\)"),
        (lambda: PeerBuffer((2, 3), "float32"), TypeError, r"PeerBuffer: dtype must be a torch.dtype, received str"),
        (lambda: PeerBuffer((2,), torch.float32, device="meta"), ValueError, r"device must be the CPU or a CUDA"),
        (lambda: PeerAllGather(0, 4, torch.float32), ValueError, r"rows must be a positive int, received 0"),
        (lambda: PeerAllGather(3, True, torch.float32), ValueError, r"features must be a positive int, received True"),
    ],
)
def test_bad_arguments_are_refused_naming_them(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_a_shard_unlike_the_transports_is_refused_before_anything_moves():
    transport = PeerAllGather(4, 3, torch.float32)
    with pytest.raises(ValueError, match=r"x_shard must be \(4, 3\) torch.float32 on cpu .*received \(5, 3\)"):
        transport.start(torch.zeros(5, 3))
    with pytest.raises(ValueError, match=r"received \(4, 3\) torch.float16"):
        peer_all_gather_matmul(torch.zeros(4, 3, dtype=torch.float16), torch.zeros(2, 3, dtype=torch.float16),
                               transport)  # fmt: skip
    with pytest.raises(TypeError, match=r"transport must be a PeerAllGather, received str"):
        peer_all_gather_matmul(torch.zeros(4, 3), torch.zeros(2, 3), "nccl")
    with pytest.raises(ValueError, match=r"weight must be \[out_features, 3\]"):
        peer_all_gather_matmul(torch.zeros(4, 3), torch.zeros(2, 5), transport)
    assert transport.epoch == 0 and (transport.buffer.flags == 0).all()


# ------------------------------------------------------------------------------------------------------------- GPU


def _gpu_rank(rank, t, calls):
    from tessel.kernels.fp8 import quantize_fp8

    torch.cuda.set_device(0)  # both processes on the one GPU, their buffers mapped into each other's
    transport = PeerAllGather(512, 384, torch.bfloat16, device="cuda:0")
    errors = []
    for call in range(calls):
        shards, weights, biases = _operands(t, call, torch.bfloat16, 512, 384)
        on_gpu = [None if b is None else b.cuda() for b in biases]
        shards, weights = [s.cuda() for s in shards], [w.cuda() for w in weights]
        outs = peer_all_gather_matmul(shards[rank], weights, transport, biases=on_gpu)
        torch.cuda.synchronize()
        for out, ref in zip(outs, _expected([s.cpu() for s in shards], [w.cpu() for w in weights], biases)):
            errors.append(((out.double().cpu() - ref).abs().max() / ref.abs().max()).item())
    reduce = PeerReduceScatter(512, 384, torch.bfloat16, device="cuda:0")
    for call in range(calls):
        gen = torch.Generator().manual_seed(call)
        xs = [torch.randn(t * 512, 256, generator=gen, dtype=torch.bfloat16) for _ in range(t)]
        ws = [torch.randn(384, 256, generator=gen, dtype=torch.bfloat16) for _ in range(t)]
        out = peer_matmul_reduce_scatter(xs[rank].cuda(), ws[rank].cuda(), reduce)
        torch.cuda.synchronize()
        ref = sum(x.double() @ w.double().t() for x, w in zip(xs, ws))
        errors.append(((out.double().cpu() - ref[rank * 512 : (rank + 1) * 512]).abs().max() / ref.abs().max()).item())
        whole = peer_matmul_all_reduce(xs[rank].cuda(), ws[rank].cuda())  # both transports in turn
        torch.cuda.synchronize()
        errors.append(((whole.double().cpu() - ref).abs().max() / ref.abs().max()).item())
        # fp8 operands, each rank's with its own scales, the partials into the same bf16 transport
        qs = [(quantize_fp8(x.cuda(), "e4m3"), quantize_fp8(w.cuda(), "e4m3")) for x, w in zip(xs, ws)]
        xq, wq = qs[rank]
        out = peer_matmul_reduce_scatter(xq.data, wq.data, reduce, scales=(xq.scale_inv, wq.scale_inv))
        torch.cuda.synchronize()
        dequantized = [(x.data.double() * x.scale_inv.double(), w.data.double() * w.scale_inv.double()) for x, w in qs]
        ref = sum(x @ w.t() for x, w in dequantized).cpu()
        errors.append(((out.double().cpu() - ref[rank * 512 : (rank + 1) * 512]).abs().max() / ref.abs().max()).item())
    return errors


@pytest.mark.gpu
@pytest.mark.multiprocess
def test_gpu_two_processes_share_one_gpu_through_symmetric_memory_every_way():
    # torch's symmetric memory refuses two ranks on one device unless told that this is meant (a test's setting)
    overlapping = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"}
    for errors in run_ranks(_gpu_rank, 2, 3, timeout=120, env=overlapping):  # a hang must not cost the phase
        assert max(errors) < 2e-2, errors


# --------------------------------------------------------------------------------------- the op and the layers


def _op_rank(rank, t, regather):
    from tessel.parallel.overlap import all_gather_matmul

    if rank == t - 1:  # slow right after releasing its buffer: the others' next shards land in it meanwhile
        finish = PeerAllGather.finish
        PeerAllGather.finish = lambda self: (finish(self), time.sleep(0.3))[0]

    def run(overlap):
        torch.manual_seed(0)  # the same weights on every rank
        ws = [torch.randn(n, K, requires_grad=True) for n in NS]
        bs = [torch.randn(NS[0], requires_grad=True), None]
        gen = torch.Generator().manual_seed(rank)
        xs = [torch.randn(M, K, generator=gen, requires_grad=True) for _ in range(2)]
        # two forwards before either backward: the second call through the transport rewrites its buffer (the
        # gathered input the weights' gradients read is copied before the buffer is released)
        outs = [all_gather_matmul(x, ws, biases=bs, overlap=overlap, regather=regather) for x in xs]
        loss = sum(((o * (i + 1 + j)) ** 2).sum() for i, pair in enumerate(outs) for j, o in enumerate(pair))
        loss.backward()
        return [o.detach() for pair in outs for o in pair], [x.grad for x in xs] + [w.grad for w in ws] + [bs[0].grad]

    peer = run("peer")
    # both calls went through the transports, forward (the gather) and backward (the input gradient's sum)
    assert {kind.__name__: transport.epoch for (kind, *_), (_, transport) in _transports.items()} == {
        "PeerAllGather": 2, "PeerReduceScatter": 2,
    }  # fmt: skip
    return peer, run(True)


@pytest.mark.multiprocess
@pytest.mark.parametrize("t, regather", [(2, False), (4, False), (2, True)])
def test_all_gather_matmul_through_the_transports_equals_the_ring_forward_and_backward(t, regather):
    for (peer_outs, peer_grads), (ring_outs, ring_grads) in run_ranks(_op_rank, t, regather, env=REFERENCE_KERNELS):
        for a, b in zip(peer_outs, ring_outs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for a, b in zip(peer_grads, ring_grads):  # the input gradient's partials summed in another order
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _backward_events_rank(rank, t):
    from tessel.parallel.overlap import all_gather_matmul

    x = torch.randn(M, K, requires_grad=True)
    w = torch.randn(NS[0], K, requires_grad=True)
    y = all_gather_matmul(x, w, overlap="peer")
    with record_events() as log:
        y.sum().backward()
    return [(kind, op) for kind, op, _ in log.events]


@pytest.mark.multiprocess
def test_the_weight_gradient_runs_while_the_input_gradients_partials_travel():
    for events in run_ranks(_backward_events_rank, 2, env=REFERENCE_KERNELS):
        assert events == [("gemm", "peer_reduce_scatter"), ("send", "peer_reduce_scatter"),
                          ("wgrad", "all_gather_matmul.backward"), ("wait", "peer_reduce_scatter")]  # fmt: skip


def _layer_rank(rank, t):
    from tessel.layers.linear import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    dense_up, dense_down = torch.nn.Linear(K, 16), torch.nn.Linear(16, K)
    x = torch.randn(2, 6 * t, K)  # [batch, sequence, features]; each rank holds 6 positions
    shard = x[:, 6 * rank : 6 * (rank + 1)].clone().requires_grad_()
    results = []
    for overlap in ("peer", False):
        up = ColumnParallelLinear.from_linear(dense_up, sequence_parallel=True, overlap=overlap)
        down = RowParallelLinear.from_linear(dense_down, sequence_parallel=True, overlap=overlap)
        y = down(torch.nn.functional.gelu(up(shard)))
        y.pow(2).sum().backward()
        results.append([y.detach(), shard.grad.clone(), up.weight.grad, up.bias.grad, down.weight.grad])
        shard.grad = None
        # the column layer's gather and the row layer's reduce-scatter took the transports (first, with "peer")
        assert sorted(kind.__name__ for kind, *_ in _transports) == ["PeerAllGather", "PeerReduceScatter"]
    return results


@pytest.mark.multiprocess
def test_sequence_parallel_layers_take_the_transport_with_overlap_peer():
    for peer, plain in run_ranks(_layer_rank, 2, env=REFERENCE_KERNELS):
        for a, b in zip(peer, plain):  # partials summed in another order than one reduce-scatter's
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _subgroup_rank(rank, world_size):
    """Two tensor-parallel groups of 2 among 4 ranks (tp=2, dp=2): each group's transports are its own."""
    from tessel.parallel import init_parallel
    from tessel.parallel.overlap import all_gather_matmul, matmul_reduce_scatter

    group = init_parallel(tp=2).tp_group
    torch.manual_seed(0)
    w = torch.randn(NS[0], K)
    gen = torch.Generator().manual_seed(rank)  # every rank its own rows: the groups gather different data
    x = torch.randn(M, K, generator=gen)
    results = []
    for overlap in ("peer", True):
        y = all_gather_matmul(x, w, group, overlap=overlap)
        results.append([y, matmul_reduce_scatter(y, w.t().contiguous(), group, overlap=overlap)])
    return results


@pytest.mark.multiprocess
def test_transports_over_tensor_parallel_subgroups_equal_the_ring():
    for peer, ring in run_ranks(_subgroup_rank, 4, env=REFERENCE_KERNELS):
        for a, b in zip(peer, ring):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------ reduce-scatter

N = 17  # output features of the reduce-scatter GEMM


def _rs_operands(t, call, dtype):
    gen = torch.Generator().manual_seed(500 + call)
    xs = [torch.randn(t * M, K, generator=gen, dtype=dtype) for _ in range(t)]  # every rank's x (its K features)
    ws = [torch.randn(N, K, generator=gen, dtype=dtype) for _ in range(t)]
    bias = torch.randn(N, generator=gen, dtype=dtype)
    return xs, ws, bias


def _rs_rank(rank, t, calls, slow_rank):
    transport = PeerReduceScatter(M, N, torch.float32)
    if rank == slow_rank:  # held back before summing: the others' next partials must wait for its slots
        reduce = PeerReduceScatter.reduce
        PeerReduceScatter.reduce = lambda self, *args: (time.sleep(0.3), reduce(self, *args))[1]
    errors = []
    for call in range(calls):
        xs, ws, bias = _rs_operands(t, call, torch.float32)
        out = peer_matmul_reduce_scatter(xs[rank], ws[rank], transport, bias=bias)
        total = sum(x.double() @ w.double().t() for x, w in zip(xs, ws)) + bias.double()
        ref = total[rank * M : (rank + 1) * M]
        errors.append(((out.double() - ref).abs().max() / ref.abs().max()).item())
    return errors, transport.epoch, transport.buffer.flags.tolist()


@pytest.mark.multiprocess
@pytest.mark.parametrize("kernels", ["interpreter", "reference"])
@pytest.mark.parametrize("t", [2, 4])
def test_reduce_scatter_calls_back_to_back_equal_float64_with_a_rank_held_back(t, kernels):
    env = REFERENCE_KERNELS if kernels == "reference" else None
    for errors, epoch, flags in run_ranks(_rs_rank, t, 3, 0, env=env, timeout=240):
        assert max(errors) < 1e-5, errors
        # every rank's partial flagged here by its GEMM (this rank's own too), and the slots released, at every call
        assert epoch == 3 and flags == [3] * (t + 1)


def _rs_op_rank(rank, t):
    from tessel.parallel.overlap import matmul_reduce_scatter

    def run(overlap):
        torch.manual_seed(0)
        w = torch.randn(N, K, requires_grad=True)
        bias = torch.randn(N, requires_grad=True)
        gen = torch.Generator().manual_seed(rank)
        xs = [torch.randn(t * M, K, generator=gen, requires_grad=True) for _ in range(2)]
        ys = [matmul_reduce_scatter(x, w, bias=bias, overlap=overlap) for x in xs]
        sum(((y * (i + 1)) ** 2).sum() for i, y in enumerate(ys)).backward()
        return [y.detach() for y in ys] + [x.grad for x in xs] + [w.grad, bias.grad]

    peer = run("peer")
    # forward (the partials' sum) and backward (the output gradient's gather), both calls
    assert {kind.__name__: transport.epoch for (kind, *_), (_, transport) in _transports.items()} == {
        "PeerAllGather": 2, "PeerReduceScatter": 2,
    }  # fmt: skip
    return peer, run(True)


@pytest.mark.multiprocess
@pytest.mark.parametrize("t", [2, 4])
def test_matmul_reduce_scatter_through_the_transports_equals_the_ring_forward_and_backward(t):
    for peer, ring in run_ranks(_rs_op_rank, t, env=REFERENCE_KERNELS):
        for a, b in zip(peer, ring):  # the partials summed in another order than the ring's
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# -------------------------------------------------------------------------------------------------- all-reduce


def _ar_op_rank(rank, t, rows):
    from tessel.parallel.overlap import matmul_all_reduce, matmul_grad_all_reduce

    def run(overlap):
        torch.manual_seed(0)
        w = torch.randn(N, K, requires_grad=True)
        bias = torch.randn(N, requires_grad=True)
        w2 = torch.randn(5, K, requires_grad=True)
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(rows, K, generator=gen, requires_grad=True)
        xc = torch.randn(rows, K, generator=gen, requires_grad=True)
        y = matmul_all_reduce(x, w, bias=bias, overlap=overlap)  # row-parallel, no sequence parallelism
        ys = matmul_grad_all_reduce(xc, [w, w2], overlap=overlap)  # column-parallel: the input gradient reduced
        (y.pow(2).sum() + sum((o * (i + 2)).pow(2).sum() for i, o in enumerate(ys))).backward()
        return [y.detach(), *(o.detach() for o in ys), x.grad, xc.grad, w.grad, w2.grad, bias.grad]

    peer = run("peer")
    used = {kind.__name__: transport.epoch for (kind, *_), (_, transport) in _transports.items()}
    return peer, run(True), used


@pytest.mark.multiprocess
@pytest.mark.parametrize("t, rows", [(2, 2 * M), (4, 4 * M), (2, 2 * M + 1)])
def test_all_reduce_ops_through_the_transports_equal_the_ring(t, rows):
    """A reduce-scatter then an all-gather, forward (matmul_all_reduce) and backward (matmul_grad_all_reduce's input
    gradient, its weight gradients while the partials travel); rows that do not split evenly take the ring."""
    for peer, ring, used in run_ranks(_ar_op_rank, t, rows, env=REFERENCE_KERNELS):
        # each op once through each transport (the forward's and the backward's shapes differ here: N and K)
        assert used == ({"PeerReduceScatter": 1, "PeerAllGather": 1} if rows % t == 0 else {})
        for a, b in zip(peer, ring):  # the partials summed in another order than the ring's
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_reduce_scatter_refuses_operands_unlike_its_transport():
    transport = PeerReduceScatter(4, 3, torch.float32)
    with pytest.raises(ValueError, match=r"must be \(4, 3, torch.float32, device\(type='cpu'\)\) .*received \(5, 3"):
        peer_matmul_reduce_scatter(torch.zeros(5, 2), torch.zeros(3, 2), transport)
    with pytest.raises(TypeError, match=r"transport must be a PeerReduceScatter, received PeerAllGather"):
        peer_matmul_reduce_scatter(torch.zeros(4, 2), torch.zeros(3, 2), PeerAllGather(4, 2, torch.float32))
    assert transport.epoch == 0


def test_the_ops_refuse_an_unknown_overlap():
    from tessel.parallel.overlap import all_gather_matmul, matmul_reduce_scatter

    with pytest.raises(ValueError, match=r"all_gather_matmul: overlap must be True, False or 'peer', received 'ring'"):
        all_gather_matmul(torch.zeros(3, 4), torch.zeros(2, 4), overlap="ring")
    with pytest.raises(ValueError, match=r"matmul_reduce_scatter: overlap must be True, False or 'peer', .*'auto'"):
        matmul_reduce_scatter(torch.zeros(3, 4), torch.zeros(2, 4), overlap="auto")


def _release_rank(rank, t):
    from tessel.parallel import release_transports
    from tessel.parallel.overlap import all_gather_matmul

    w = torch.randn(NS[0], K, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(rank)
    results = []
    for rows in (M, M + 2, M):  # a second shape builds a second transport
        x = torch.randn(rows, K, generator=gen)
        results.append((all_gather_matmul(x, w, overlap="peer"), all_gather_matmul(x, w, overlap=False)))
    held = sorted(transport.rows for _, transport in _transports.values())
    released = release_transports()
    x = torch.randn(M, K, generator=gen)
    again = all_gather_matmul(x, w, overlap="peer"), all_gather_matmul(x, w, overlap=False)
    rebuilt = [transport.epoch for _, transport in _transports.values()]
    return held, released, rebuilt, [*results, again]


@pytest.mark.multiprocess
def test_released_transports_are_built_again_at_the_next_call():
    """One transport per shape is held until release_transports() drops them all (every rank at the same point);
    the next call builds a fresh one, whose epochs start again, and every call equals the plain path."""
    for held, released, rebuilt, results in run_ranks(_release_rank, 2, env=REFERENCE_KERNELS):
        assert held == [M, M + 2] and released == 2 and rebuilt == [1]
        for peer, plain in results:
            torch.testing.assert_close(peer, plain, rtol=1e-5, atol=1e-5)


def test_a_cuda_graph_capture_is_refused_before_anything_moves(monkeypatch):
    """Each call's epoch is counted on the host, so a replayed capture would find its flags already up: refused."""
    transport = PeerReduceScatter(M, N, torch.float32)
    transport._stream = object()  # as on CUDA (the check comes before the stream is used)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"overlap='peer' cannot be captured in a CUDA graph .*overlap=True"):
        peer_matmul_reduce_scatter(torch.zeros(M, K), torch.zeros(N, K), transport)
    assert transport.epoch == 0 and (transport.buffer.flags == 0).all()
