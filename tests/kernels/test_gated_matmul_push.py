"""tessel.kernels.gated_matmul with one destination per chunk: the epilogue of a fused reduce-scatter.

Each chunk's rows go to a tensor of their own (standing for the owner's buffer in a peer's memory), its ``done``
flag is one element anywhere (the owner's flag for this rank), and its ``free`` flag holds its rows back until the
owner has read the previous call's. Checked against float64 with the destinations and flags scattered over
separate allocations, and with a thread that raises the ``free`` flags one by one while the kernel runs.
"""

import threading
import time

import pytest
import torch

import tessel.kernels.gated_matmul as gated_module
from tessel.kernels._dispatch import Backend
from tessel.kernels.gated_matmul import gated_matmul
from tests.kernels.test_matmul import assert_gemm_close, reference


@pytest.fixture(params=["interpreter", "reference"])
def backend(request, monkeypatch):
    if request.param == "reference":
        monkeypatch.setattr(gated_module, "backend_for", lambda *tensors: Backend.REFERENCE)
    return request.param


def _destinations(chunks, rows, n, dtype, poison=float("nan")):
    """One allocation per chunk, each a view into a larger buffer at an odd offset (so the destinations are not
    16-byte aligned relative to each other), poisoned."""
    bufs = [torch.full((rows * n + 3 + c,), poison, dtype=dtype) for c in range(chunks)]
    return [buf[3 + c - (c % 2) :][: rows * n].view(rows, n) for c, buf in enumerate(bufs)], bufs


@pytest.mark.parametrize("dtype, out_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float32),
                                              (torch.float16, torch.float16)])  # fmt: skip
def test_each_chunk_lands_in_its_destination_and_raises_its_flag(seed, backend, dtype, out_dtype):
    chunks, rows, n, k, epoch, first = 4, 19, 45, 37, 6, 2
    a = torch.randn(chunks * rows, k, dtype=dtype)
    b = torch.randn(n, k, dtype=dtype).t()
    bias = torch.randn(n, dtype=dtype)
    dests, bufs = _destinations(chunks, rows, n, out_dtype)
    before = [buf.clone() for buf in bufs]
    # the flags: four elements of one tensor, in another order than the chunks', among others left alone
    flags = torch.full((9,), 100, dtype=torch.int32)
    signals = [flags[i : i + 1] for i in (7, 1, 4, 2)]
    free = [torch.full((1,), epoch - 1, dtype=torch.int32) for _ in range(chunks)]
    got = gated_matmul(a, b, None, chunks=chunks, first=first, step=1, bias=bias, activation="gelu", out=dests,
                       epoch=epoch, done=signals, free=free)  # fmt: skip
    assert got is dests
    expected, magnitude = reference(a, b, bias, "gelu")
    for c, dest in enumerate(dests):
        span = slice(c * rows, (c + 1) * rows)
        assert_gemm_close(dest, expected[span], magnitude[span], dtype)
    assert flags.tolist() == [100, epoch, epoch, 100, epoch, 100, 100, epoch, 100]
    for dest, buf, old in zip(dests, bufs, before):  # nothing outside the destinations is touched
        outside = torch.ones_like(buf, dtype=torch.bool)
        outside[dest.storage_offset() : dest.storage_offset() + dest.numel()] = False
        assert torch.equal(buf[outside].isnan(), old[outside].isnan())


def test_destinations_accumulate_and_a_single_output_takes_per_chunk_flags(seed, backend):
    """``accumulate=True`` adds onto each destination; a single ``[M, N]`` output with listed ``done`` flags
    writes in place and raises those flags."""
    chunks, rows, n, k = 3, 13, 30, 20
    a = torch.randn(chunks * rows, k)
    b = torch.randn(k, n)
    start = [torch.randn(rows, n) for _ in range(chunks)]
    dests = [s.clone() for s in start]
    gated_matmul(a, b, None, chunks=chunks, out=dests, accumulate=True)
    expected, magnitude = reference(a, b)
    for c in range(chunks):
        span = slice(c * rows, (c + 1) * rows)
        assert_gemm_close(dests[c], expected[span] + start[c].double(), magnitude[span] + start[c].abs().double(),
                          torch.float32)  # fmt: skip
    out = torch.full((chunks * rows, n), float("nan"))
    done = [torch.zeros(1, dtype=torch.int32) for _ in range(chunks)]
    gated_matmul(a, b, None, chunks=chunks, first=1, out=out, done=done, epoch=3)
    assert_gemm_close(out, expected, magnitude, torch.float32)
    assert [int(d) for d in done] == [3] * chunks


@pytest.mark.parametrize("order", [(0, 1, 2), (1, 0, 2)])
def test_no_chunk_is_stored_before_its_free_flag(seed, backend, order):
    """A thread stands for the owners: it raises each chunk's ``free`` flag from the previous-but-one call's value to
    the previous call's, one chunk at a time in arrival order, a while apart, each after checking that the chunk's
    destination is still untouched (NaN). The interpreter's programs spin on those flags; the reference waits on
    the host. A kernel that stored a chunk before its flag fails the check (it has long finished the others)."""
    chunks, rows, n, k, epoch = 3, 40, 48, 32, 4  # 2 x 2 tiles of the interpreter's 32 per chunk
    a = torch.randn(chunks * rows, k)
    b = torch.randn(n, k).t()
    dests, _ = _destinations(chunks, rows, n, torch.float32)
    free = [torch.full((1,), epoch - 2, dtype=torch.int32) for _ in range(chunks)]
    done = torch.zeros(chunks, dtype=torch.int32)
    untouched = []

    def owners():
        for c in order:
            time.sleep(0.2)
            untouched.append(bool(dests[c].isnan().all()))
            free[c].fill_(epoch - 1)
        for flag in free:  # whatever happened, every chunk is freed, so the call returns
            flag.fill_(epoch - 1)

    thread = threading.Thread(target=owners)
    thread.start()
    try:
        step = (order[1] - order[0]) % chunks  # the arrival order is the order the owners free the chunks in
        gated_matmul(a, b, None, chunks=chunks, first=order[0], step=step, out=dests, done=done, free=free,
                     epoch=epoch)  # fmt: skip
    finally:
        thread.join()
    assert untouched == [True] * chunks
    assert done.tolist() == [epoch] * chunks
    expected, magnitude = reference(a, b)
    for c in range(chunks):
        span = slice(c * rows, (c + 1) * rows)
        assert_gemm_close(dests[c], expected[span], magnitude[span], torch.float32)


def test_the_alignment_the_kernel_is_told_divides_every_destinations_offset():
    """Destinations 16 bytes apart let the epilogue store whole vectors; others are told a smaller alignment."""
    flags = [torch.zeros(1, dtype=torch.int32)] * 2
    for dtype, gap, align in [(torch.float16, 64, 8), (torch.float16, 37, 1), (torch.float16, 36, 4),
                              (torch.float32, 8, 4), (torch.float32, 6, 2)]:  # fmt: skip
        buf = torch.zeros(200, dtype=dtype)
        dests = [buf[:40].view(4, 10), buf[gap : gap + 40].view(4, 10)]
        table, base, got = gated_module._table(dests, flags, None, 2)
        assert got == align, (dtype, gap)
        assert table[0].tolist() == [0, gap] and base is flags[0]


@pytest.mark.gpu
# the kernel spins on flags: a missed one would hang, not fail (the first call also compiles its candidate tiles)
@pytest.mark.timeout(300, method="thread")
def test_gpu_chunks_wait_for_flags_freed_late_and_land_in_their_destinations(seed):
    """On one GPU: each chunk's ``free`` flag is raised late by another stream (after a sleep, in arrival order) while
    the GEMM runs; each chunk's rows land in a destination of their own, every ``done`` flag is raised, and a
    destination's rows are the float64 reference's."""
    chunks, rows, n, k, epoch = 4, 1000, 1536, 2048, 9
    a = torch.randn(chunks * rows, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
    expected, magnitude = reference(a.cpu(), b.cpu())
    gated_matmul(a, b, None, chunks=chunks, out=[torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
                                                 for _ in range(chunks)])  # tunes; loads the kernel # fmt: skip
    torch.cuda._sleep(1)  # loads the side stream's kernels before any GEMM spins
    flags = torch.zeros(2 * chunks, dtype=torch.int32, device="cuda")
    flags[chunks:].fill_(epoch - 1)
    torch.cuda.synchronize()
    dests = [torch.full((rows, n), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(chunks)]
    free = [torch.full((1,), epoch - 2, device="cuda", dtype=torch.int32) for _ in range(chunks)]
    done = [flags[c : c + 1] for c in range(chunks)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the destinations and flags are written before the side's work
    gated_matmul(a, b, None, chunks=chunks, first=1, step=1, out=dests, done=done, free=free, epoch=epoch)
    with torch.cuda.stream(side):
        for c in (1, 2, 3, 0):
            torch.cuda._sleep(20_000_000)  # the GEMM has been waiting for this chunk's owner a while
            free[c].copy_(flags[chunks + c : chunks + c + 1])  # a copy engine raises it to epoch - 1
    torch.cuda.synchronize()
    assert flags[:chunks].tolist() == [epoch] * chunks
    for c in range(chunks):
        span = slice(c * rows, (c + 1) * rows)
        assert_gemm_close(dests[c].cpu(), expected[span], magnitude[span], torch.bfloat16)


@pytest.mark.parametrize("split_accumulator", [True, False])
def test_fp8_operands_with_their_scales_push_like_the_fp8_gemm(seed, backend, split_accumulator):
    """e5m2 × e4m3 operands (a backward's dY·W) with their inverse scales, into bf16 destinations with a bias: each
    chunk equals fp8_matmul_reference's exact product of the fp8 values, to one bf16 unit in the last place (the
    interpreter's bf16 casts truncate)."""
    from tessel.kernels.fp8 import fp8_matmul_reference, quantize_fp8
    from tessel.kernels.gated_matmul import gated_matmul_unchecked

    chunks, rows, n, k = 3, 21, 40, 48
    aq = quantize_fp8(torch.randn(chunks * rows, k), "e5m2")
    bq = quantize_fp8(torch.randn(n, k), "e4m3")
    bias = torch.randn(n, dtype=torch.bfloat16)
    dests, _ = _destinations(chunks, rows, n, torch.bfloat16)
    done = [torch.zeros(1, dtype=torch.int32) for _ in range(chunks)]
    gated_matmul_unchecked(aq.data, bq.data.t(), None, chunks, 2, 1, dests, bias, done=done, epoch=2,
                           scales=(aq.scale_inv, bq.scale_inv), split_accumulator=split_accumulator)  # fmt: skip
    expected = fp8_matmul_reference(aq.data, bq.data.t(), aq.scale_inv, bq.scale_inv, bias, out_dtype=torch.float64)
    for c in range(chunks):
        got = dests[c].double()
        want = expected[c * rows : (c + 1) * rows]
        assert torch.allclose(got, want, rtol=2**-7, atol=1e-6 * want.abs().max()), (got - want).abs().max()
    assert [int(d) for d in done] == [2] * chunks
