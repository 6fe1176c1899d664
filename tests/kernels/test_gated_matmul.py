"""tessel.kernels.gated_matmul: one GEMM launch over row chunks that arrive while it runs.

On a CPU the arithmetic is checked against float64 with every chunk in place (odd shapes, every arrival order,
epilogues, strided views, both ways of reading), and the waiting with chunks that another thread writes while
the kernel runs (Triton's interpreter shares the tensors' memory with that thread). The GPU tests make the
chunks arrive late from another stream, after the kernel has started.
"""

import sys
import threading
import time

import pytest
import torch

import tessel.kernels.gated_matmul as gated_module
from tessel.kernels._dispatch import Backend
from tessel.kernels.gated_matmul import gated_matmul
from tests.kernels.test_matmul import assert_gemm_close, reference

# (chunks, rows per chunk, N, K): rows and N not multiples of the interpreter's 32-wide tiles, K spanning blocks.
SHAPES = [(4, 19, 45, 37), (3, 40, 70, 33), (1, 7, 5, 3), (2, 33, 1, 64)]


@pytest.fixture(params=[False, True], ids=["pointers", "descriptors"])
def variant(request, monkeypatch):
    """The kernel's two ways of reading: pointer loads, or descriptors (TMA on sm_90; emulated by the interpreter)
    over all of ``a``, where a tile that ends past its chunk reads the next chunk's rows into rows it never stores."""
    monkeypatch.setattr(gated_module, "_INTERPRETER_TMA", request.param)
    return request.param


def _operands(chunks, rows, n, k, dtype, transposed_b=True):
    a = torch.randn(chunks * rows, k, dtype=dtype)
    b = torch.randn(n, k, dtype=dtype).t() if transposed_b else torch.randn(k, n, dtype=dtype)
    return a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_against_float64(seed, shape, dtype, variant):
    chunks, rows, n, k = shape
    a, b = _operands(chunks, rows, n, k, dtype)
    bias = torch.randn(n, dtype=dtype)
    ready = torch.ones(chunks, dtype=torch.int32)
    out = gated_matmul(a, b, ready, chunks=chunks, first=chunks - 1, step=max(1, chunks - 1), bias=bias)
    expected, magnitude = reference(a, b, bias)
    assert out.dtype == dtype
    assert_gemm_close(out, expected, magnitude, dtype)


def test_every_arrival_order_gives_the_same_bits(seed, variant):
    """The order decides when a chunk's tiles run, never how: each tile is the same computation whatever the order."""
    chunks, rows, n, k = 5, 21, 40, 35
    a, b = _operands(chunks, rows, n, k, torch.float32)
    ready = torch.ones(chunks, dtype=torch.int32)
    first = gated_matmul(a, b, ready, chunks=chunks)
    for start, step in [(3, 1), (2, 4), (4, 2), (1, 3)]:
        other = gated_matmul(a, b, ready, chunks=chunks, first=start, step=step)
        assert torch.equal(other, first), (start, step)


def test_epilogue_accumulates_into_a_strided_view_and_touches_nothing_else(seed, variant):
    chunks, rows, n, k = 3, 13, 30, 20
    a, b = _operands(chunks, rows, n, k, torch.float32, transposed_b=False)
    bias = torch.randn(n)
    big = torch.randn(chunks * rows + 4, n + 9)
    before = big.clone()
    view = big[2 : 2 + chunks * rows, 5 : 5 + n]  # a row block and a column band of a larger buffer
    ready = torch.ones(chunks, dtype=torch.int32)
    gated_matmul(a, b, ready, chunks=chunks, first=1, step=2, bias=bias, activation="gelu", out=view, accumulate=True)
    z, magnitude = reference(a, b, bias, "gelu")
    assert_gemm_close(view, z + before[2 : 2 + chunks * rows, 5 : 5 + n].double(), magnitude + view.abs().double(),
                      torch.float32)  # fmt: skip
    outside = torch.ones_like(big, dtype=torch.bool)
    outside[2 : 2 + chunks * rows, 5 : 5 + n] = False
    assert torch.equal(big[outside], before[outside])


def test_float32_output_for_half_operands(seed, variant):
    a, b = _operands(2, 16, 24, 40, torch.float16)
    out = torch.empty(32, 24)
    gated_matmul(a, b, torch.ones(2, dtype=torch.int32), chunks=2, out=out)
    expected, magnitude = reference(a, b)
    assert_gemm_close(out, expected, magnitude, torch.float32)


def test_a_read_through_its_transpose_takes_the_pointer_variant(seed, variant):
    """Descriptors read ``a`` by rows only: a column-major ``a`` (a transposed view) is read through pointers."""
    chunks, rows, n, k = 3, 11, 20, 36
    a = torch.randn(k, chunks * rows).t()
    b = torch.randn(k, n)
    _, tma_ok = gated_module._flags(a, b, None, None, False, torch.empty(chunks * rows, n), "interpreter")
    assert not tma_ok
    out = gated_matmul(a, b, torch.ones(chunks, dtype=torch.int32), chunks=chunks, first=2, step=2)
    expected, magnitude = reference(a, b)
    assert_gemm_close(out, expected, magnitude, torch.float32)


def test_own_chunk_is_never_waited_for(seed):
    """Position 0 (chunk ``first``: the caller's own rows) is in place at launch: its flag is not read."""
    chunks, rows, n, k = 3, 10, 12, 8
    a, b = _operands(chunks, rows, n, k, torch.float32)
    ready = torch.tensor([1, 0, 1], dtype=torch.int32)  # chunk 1's flag never set
    out = gated_matmul(a, b, ready, chunks=chunks, first=1, step=1)
    expected, magnitude = reference(a, b)
    assert_gemm_close(out, expected, magnitude, torch.float32)
    single = gated_matmul(a, b, torch.zeros(1, dtype=torch.int32), chunks=1)
    assert_gemm_close(single, expected, magnitude, torch.float32)


@pytest.mark.parametrize("backend", ["interpreter", "reference"])
@pytest.mark.parametrize("rank, epoch", [(0, 1), (2, 1), (1, 7)])
def test_starts_on_its_own_rows_and_waits_for_each_chunk_another_thread_writes(seed, monkeypatch, backend, rank, epoch):
    """A producer thread stands for the ring: once the kernel has written some of this rank's own rows, it copies
    the other chunks in, in ring order, each followed by its flag. Before a chunk arrives none of its output rows
    is written (the kernel waited for its flag; its rows of ``a`` held NaN until then), and the result is the
    plain GEMM's. The interpreter's programs spin on flags in memory this thread writes; the PyTorch reference
    waits on the host. With ``epoch`` > 1 the flags start at the previous call's value, which marks nothing."""
    if backend == "reference":
        monkeypatch.setattr(gated_module, "backend_for", lambda *tensors: Backend.REFERENCE)
    chunks, rows, n, k = 3, 40, 48, 32  # 2 x 2 tiles of the interpreter's 32 per chunk
    order = [(rank - p) % chunks for p in range(chunks)]
    span = lambda c: slice(c * rows, (c + 1) * rows)
    a, b = _operands(chunks, rows, n, k, torch.float32, transposed_b=False)
    buf = torch.full_like(a, float("nan"))
    buf[span(rank)] = a[span(rank)]
    ready = torch.full((chunks,), epoch - 1, dtype=torch.int32)
    out = torch.full((chunks * rows, n), float("nan"))
    snapshots, started = [], []

    def producer():
        deadline = time.monotonic() + 30
        while not torch.isfinite(out[span(rank)]).any() and time.monotonic() < deadline:
            time.sleep(0.005)
        started.append(torch.isfinite(out[span(rank)]).any().item())
        for c in order[1:]:  # whatever happened, every chunk arrives, so the call returns
            time.sleep(0.05)
            snapshots.append(out.clone())
            buf[span(c)] = a[span(c)]
            ready[c] = epoch
        ready.fill_(epoch)  # the own chunk's too: a kernel waiting for it by mistake fails below instead of hanging

    thread = threading.Thread(target=producer)
    thread.start()
    try:
        gated_matmul(buf, b, ready, chunks=chunks, first=rank, step=chunks - 1, out=out, epoch=epoch)
    finally:
        thread.join()
    assert started == [True]  # the own chunk's tiles ran before any other chunk had arrived
    for p, snapshot in enumerate(snapshots, start=1):
        for c in order[p:]:
            assert snapshot[span(c)].isnan().all(), (p, c)
    expected, magnitude = reference(a, b)
    assert_gemm_close(out, expected, magnitude, torch.float32)


@pytest.mark.parametrize("backend", ["interpreter", "reference"])
def test_done_flags_are_raised_once_each_chunks_rows_are_final(seed, monkeypatch, variant, backend):
    """``done[c]`` becomes ``epoch`` only after every row of chunk ``c`` is written: a thread watching the flags
    copies a chunk's rows the moment its flag is up, and each copy equals the final result (the output started as
    NaN, so a flag raised after the chunk's first tile would catch unwritten rows). ``ready=None``: nothing is
    waited for."""
    if backend == "reference":
        monkeypatch.setattr(gated_module, "backend_for", lambda *tensors: Backend.REFERENCE)
        into = gated_module._reference_into  # each chunk takes a while, as the interpreter's do: the watcher runs
        monkeypatch.setattr(gated_module, "_reference_into", lambda *args: (time.sleep(0.02), into(*args)))
    chunks, rows, n, k, epoch = 3, 40, 80, 32, 5  # 2 x 3 tiles of the interpreter's 32 per chunk
    span = lambda c: slice(c * rows, (c + 1) * rows)
    a, b = _operands(chunks, rows, n, k, torch.float32)
    out = torch.full((chunks * rows, n), float("nan"))
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the watcher gets the interpreter's lock between the kernel's block operations
    done = torch.full((chunks,), epoch - 1, dtype=torch.int32)  # the previous call's flags
    seen, finished = {}, threading.Event()

    def watcher():
        while len(seen) < chunks and not finished.is_set():
            for c in range(chunks):
                if c not in seen and int(done[c]) == epoch:
                    seen[c] = out[span(c)].clone()

    thread = threading.Thread(target=watcher)
    thread.start()
    try:
        gated_matmul(a, b, None, chunks=chunks, first=1, step=1, out=out, done=done, epoch=epoch)
    finally:
        finished.set()
        thread.join()
        sys.setswitchinterval(switch)
    assert done.tolist() == [epoch] * chunks
    assert seen  # (every chunk, unless the watcher was not scheduled in time)
    for c, rows_then in seen.items():
        assert torch.equal(rows_then, out[span(c)]), c
    expected, magnitude = reference(a, b)
    assert_gemm_close(out, expected, magnitude, torch.float32)


@pytest.mark.parametrize("element_size", [4, 2])
def test_every_dtype_has_candidate_tiles_that_fit_in_shared_memory(element_size):
    """Tuning times the largest tiles whose pipeline fits in sm_90's shared memory for the operands' dtype (fp32's
    widest tiles do not fit), both variants where descriptors can read the operands."""
    limit = 232448
    configs = gated_module._candidates(element_size, limit, tma_ok=True)
    assert len(configs) == 2 * gated_module._CANDIDATES
    for config in configs:
        assert gated_module._shared_bytes(config.kwargs, config.num_stages, element_size) <= limit
    assert [c.kwargs["TMA"] for c in configs[:2]] == [False, True]
    assert len(gated_module._candidates(element_size, limit, tma_ok=False)) == gated_module._CANDIDATES


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(chunks=5), ValueError, r"a's rows must split into chunks=5 equal blocks, received 12 rows"),
        (dict(chunks=0), ValueError, r"chunks must be at least 1, received 0"),
        (dict(chunks=True), TypeError, r"chunks must be an int, received bool"),
        (dict(chunks=4, first=4), ValueError, r"first must be a chunk index below chunks=4, received 4"),
        (dict(chunks=4, first=-1), ValueError, r"first must be at least 0, received -1"),
        (dict(chunks=4, step=2), ValueError, r"step must be coprime with chunks=4 .*received 2"),
        (dict(chunks=4, step=0), ValueError, r"step must be at least 1, received 0"),
        (dict(chunks=4, reserve_sms=-1), ValueError, r"reserve_sms must be at least 0, received -1"),
        (dict(chunks=4, epoch=0), ValueError, r"epoch must be at least 1, received 0"),
        (dict(chunks=4, epoch=2**31), ValueError, r"epoch must fit an int32 flag .*received 2147483648"),
        (dict(chunks=4, epoch=1.0), TypeError, r"epoch must be an int, received float"),
        (dict(chunks=4, done=torch.ones(4, dtype=torch.int64)), ValueError, r"done must be a contiguous \(4,\) int32"),
        (dict(chunks=4, done=(1, 1, 1, 1)), TypeError, r"done\[0\] must be a torch.Tensor, received int"),
        (
            dict(chunks=4, done=[torch.ones(1, dtype=torch.int32)] * 3),
            ValueError,
            r"done must hold one flag per chunk \(4\), received 3",
        ),
        (
            dict(chunks=4, free=[torch.ones(2, dtype=torch.int32)] * 4),
            ValueError,
            r"free\[0\] must be a one-element int32 tensor .*received \(2,\) torch.int32",
        ),
        (dict(chunks=4, free=torch.ones(4)), ValueError, r"free must be a contiguous \(4,\) int32 tensor"),
        (
            dict(chunks=4, out=[torch.empty(3, 5)] * 3),
            ValueError,
            r"out must hold one destination per chunk \(4\), received 3",
        ),
        (
            dict(chunks=4, out=[torch.empty(3, 5)] * 3 + [torch.empty(5, 3).t()]),
            ValueError,
            r"out\[3\] must be a \(3, 5\) tensor .*received \(3, 5\) torch.float32 with strides \(1, 3\)",
        ),
        (
            dict(chunks=4, out=[torch.empty(3, 5)] * 3 + [torch.empty(3, 5).half()]),
            ValueError,
            r"out\[3\] .*received \(3, 5\) torch.float16",
        ),
        (
            dict(chunks=4, out=[torch.empty(3, 5)] * 3 + ["x"]),
            TypeError,
            r"out\[3\] must be a torch.Tensor, received str",
        ),
        (
            dict(chunks=4, out=[torch.empty(3, 5)] * 4, accumulate=1),
            TypeError,
            r"accumulate must be a bool, received int",
        ),
        (dict(chunks=4, ready=torch.ones(4)), ValueError, r"ready must be a contiguous \(4,\) int32 tensor.*float32"),
        (dict(chunks=4, ready=torch.ones(3, dtype=torch.int32)), ValueError, r"received \(3,\) torch.int32"),
        (dict(chunks=4, ready=torch.ones(8, dtype=torch.int32)[::2]), ValueError, r"with strides \(2,\)"),
        (dict(chunks=4, ready=[1, 1, 1, 1]), TypeError, r"ready must be a torch.Tensor, received list"),
        (dict(chunks=4, ready=torch.ones(4, dtype=torch.int32, device="meta")), ValueError, r"ready must be on a's"),
        (dict(chunks=4, b=torch.randn(9, 5)), ValueError, r"^gated_matmul: inner dimensions differ"),
        (dict(chunks=4, activation="tanh"), ValueError, r"^gated_matmul: activation must be one of"),
        (dict(chunks=4, out=torch.empty(12, 4)), ValueError, r"^gated_matmul: out must have shape \(12, 5\)"),
        (dict(chunks=4, b=torch.randn(8, 5).half()), TypeError, r"^gated_matmul: b must have a's dtype"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs, error, match):
    args = dict(a=torch.randn(12, 8), b=torch.randn(8, 5), ready=torch.ones(4, dtype=torch.int32))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        gated_matmul(args.pop("a"), args.pop("b"), args.pop("ready"), **args)


# ------------------------------------------------------------------------------------------------------------- GPU


def _load_producer_kernels():
    """Run the producers' kernels once: CUDA loads a kernel at its first launch, and loading may wait for the
    running kernels, among them a gated GEMM spinning on the flags those producers set."""
    torch.cuda._sleep(1)
    torch.ones(1, dtype=torch.int32, device="cuda").fill_(1)
    torch.cuda.synchronize()


def _late_chunks(a, chunks, order, side, delay_cycles):
    """A buffer whose chunks other than ``order[0]`` hold NaN until ``side`` (after sleeping) copies each chunk in
    and sets its flag, chunk by chunk in ``order``; returns (buffer, flags, enqueue), enqueue issuing the copies."""
    rows = a.shape[0] // chunks
    buf = torch.full_like(a, float("nan"))
    buf[order[0] * rows : (order[0] + 1) * rows] = a[order[0] * rows : (order[0] + 1) * rows]
    ready = torch.zeros(chunks, dtype=torch.int32, device=a.device)

    def enqueue():
        with torch.cuda.stream(side):
            for c in order[1:]:
                torch.cuda._sleep(delay_cycles)  # the GEMM has started long before this chunk arrives
                buf[c * rows : (c + 1) * rows].copy_(a[c * rows : (c + 1) * rows])
                ready[c : c + 1].fill_(1)

    return buf, ready, enqueue


@pytest.mark.gpu
# the kernel spins on flags: a missed one would hang, not fail (the first call also compiles its candidate tiles)
@pytest.mark.timeout(300, method="thread")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_waits_for_chunks_that_arrive_late(seed, dtype):
    chunks, rows, n, k = 4, 1000, 1536, 1024  # rows not a multiple of any tile
    a = torch.randn(chunks * rows, k, device="cuda", dtype=dtype)
    b = torch.randn(n, k, device="cuda", dtype=dtype).t()
    bias = torch.randn(n, device="cuda", dtype=dtype)
    expected, magnitude = reference(a.cpu(), b.cpu(), bias.cpu())
    gated_matmul(a, b, torch.ones(chunks, dtype=torch.int32, device="cuda"), chunks=chunks, bias=bias)  # tunes
    side = torch.cuda.Stream()
    _load_producer_kernels()
    for first in range(chunks):
        order = [(first + p * (chunks - 1)) % chunks for p in range(chunks)]  # the all-gather ring on rank `first`
        buf, ready, enqueue = _late_chunks(a, chunks, order, side, delay_cycles=20_000_000)
        side.wait_stream(torch.cuda.current_stream())  # the buffer and flags are written before the copies run
        out = gated_matmul(buf, b, ready, chunks=chunks, first=first, step=chunks - 1, bias=bias)
        enqueue()  # after the launch, as a ring enqueues its transfers
        torch.cuda.synchronize()
        tol = torch.bfloat16 if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else dtype
        assert_gemm_close(out.cpu(), expected, magnitude, tol)


@pytest.mark.gpu
@pytest.mark.timeout(300, method="thread")
def test_gpu_flags_cleared_on_the_stream_serve_every_call(seed):
    """Calls back to back on one flag tensor, cleared by ``ready.zero_()`` on the launching stream each time, never
    read a previous call's flags (the next call's chunks hold other values)."""
    chunks, rows, n, k = 3, 512, 768, 512
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    ready = torch.zeros(chunks, dtype=torch.int32, device="cuda")
    buf = torch.empty(chunks * rows, k, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    _load_producer_kernels()
    for _ in range(3):
        a = torch.randn(chunks * rows, k, device="cuda", dtype=torch.bfloat16)
        ready.zero_()
        buf[:rows].copy_(a[:rows])
        side.wait_stream(torch.cuda.current_stream())
        out = gated_matmul(buf, b, ready, chunks=chunks)
        with torch.cuda.stream(side):
            for c in range(1, chunks):
                torch.cuda._sleep(10_000_000)
                buf[c * rows : (c + 1) * rows].copy_(a[c * rows : (c + 1) * rows])
                ready[c : c + 1].fill_(1)
        torch.cuda.current_stream().wait_stream(side)
        expected, magnitude = reference(a.cpu(), b.cpu())
        assert_gemm_close(out.cpu(), expected, magnitude, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.timeout(300, method="thread")
def test_gpu_done_flags_let_another_stream_take_each_chunk_as_it_is_final(seed):
    """The reduce-scatter's pattern on one GPU: a side stream waits (on the device) for each chunk's done flag and
    copies its rows out while the GEMM goes on; every copy equals the final rows. The output starts as NaN, so a
    flag raised before the chunk's last tile is stored shows as NaN or partial rows in the copy."""
    from tessel.parallel.peer import wait_at_least

    chunks, rows, n, k, epoch = 4, 1000, 1536, 2048, 3
    a = torch.randn(chunks * rows, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
    out = torch.full((chunks * rows, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    done = torch.zeros(chunks, dtype=torch.int32, device="cuda")
    gated_matmul(a, b, None, chunks=chunks, out=torch.empty_like(out), done=done)  # tunes; loads the kernel
    wait_at_least(done[:1], 1)  # loads the wait kernel
    copies = torch.full_like(out, float("nan"))
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    side.wait_stream(torch.cuda.current_stream())  # the NaN output and the flags are written
    gated_matmul(a, b, None, chunks=chunks, first=2, step=1, out=out, done=done, epoch=epoch)
    with torch.cuda.stream(side):
        for c in (2, 3, 0, 1):
            span = slice(c * rows, (c + 1) * rows)
            wait_at_least(done[c : c + 1], epoch)
            copies[span].copy_(out[span])
    torch.cuda.synchronize()
    assert done.tolist() == [epoch] * chunks
    assert torch.equal(copies, out)
    expected, magnitude = reference(a.cpu(), b.cpu())
    assert_gemm_close(out.cpu(), expected, magnitude, torch.bfloat16)
