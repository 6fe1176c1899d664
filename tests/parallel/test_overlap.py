"""The overlapped ops really overlap, and move exactly the ring's bytes.

Overlap is shown without timing: each op logs when it issues a transfer, starts a GEMM, and waits for a
transfer. A transfer overlaps a GEMM when the GEMM starts after the transfer was issued and before it was
waited for. Byte counts come from tessel's own collectives (parallel/comm.py).

Every test runs the ops eagerly and compiled whole (``torch.compile(fullgraph=True)``, where each op is its
custom operator, whose node runs the same ring): the overlap and the bytes must hold in both.
"""

import importlib

import pytest
import torch

from tests.multiprocess import run_ranks

M, K, N = 6, 10, 8  # rows per rank, input and output features (N divisible by 2 and 4)


def _inputs(rank, t, seed=0):
    g = torch.Generator().manual_seed(seed + rank)
    x_shard = torch.randn(M, K, generator=g, requires_grad=True)
    x_full = torch.randn(t * M, K, generator=g, requires_grad=True)
    w = torch.randn(N, K, generator=g, requires_grad=True)
    w2 = torch.randn(N // 2, K, generator=g, requires_grad=True)
    return x_shard, x_full, w, w2


def _run_ops(rank, t, compiled):
    """Every op forward and backward with overlap on, recording events and bytes for each phase; ``compiled``:
    each call compiled whole first (aot_eager: the graphs as AOTAutograd builds them, without inductor's code
    generation, which tests/layers/test_compile.py covers)."""
    from tessel.parallel import (
        all_gather_matmul,
        count_bytes,
        matmul_all_reduce,
        matmul_grad_all_reduce,
        matmul_reduce_scatter,
        record_events,
    )  # fmt: skip

    x_shard, x_full, w, w2 = _inputs(rank, t)
    calls = {
        "all_gather_matmul": lambda: all_gather_matmul(x_shard, [w, w2], overlap=True),  # two weights, one ring
        "matmul_reduce_scatter": lambda: [matmul_reduce_scatter(x_full, w, overlap=True)],
        "matmul_all_reduce": lambda: [matmul_all_reduce(x_full, w, overlap=True)],
        "matmul_grad_all_reduce": lambda: matmul_grad_all_reduce(x_full, [w, w2], overlap=True),
    }
    if compiled:
        calls = {op: torch.compile(call, backend="aot_eager", fullgraph=True) for op, call in calls.items()}
    matmul_module = importlib.import_module("tessel.kernels.matmul")
    checks, validate = [], matmul_module._validate
    matmul_module._validate = lambda *args: (checks.append(args), validate(*args))[1]  # matmul's argument checks
    result = {}
    for op, call in calls.items():
        start = len(checks)
        with record_events() as fwd_log, count_bytes() as fwd_bytes:
            outs = call()
        middle = len(checks)
        with record_events() as bwd_log, count_bytes() as bwd_bytes:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        result[op] = dict(fwd=fwd_log.events, bwd=bwd_log.events, fwd_bytes=(fwd_bytes.sent, fwd_bytes.received),
                          bwd_bytes=(bwd_bytes.sent, bwd_bytes.received),
                          checks=(middle - start, len(checks) - middle))  # fmt: skip
    return result


def _transfers_overlapping_gemms(events):
    """For every transfer: (issued before some GEMM starts, and waited for only after that GEMM started)."""
    found = {}
    for i, (kind, op, step) in enumerate(events):
        if kind != "send":
            continue
        wait = events.index(("wait", op, step), i)
        found[step] = any(k in ("gemm", "wgrad") for k, _, _ in events[i + 1 : wait])
    return found


@pytest.fixture(
    scope="module",
    params=[(2, False), (4, False), (2, True), (4, True)],
    ids=lambda p: f"{p[0]}-{'compiled' if p[1] else 'eager'}",
)
def traces(request):
    t, compiled = request.param
    return t, run_ranks(_run_ops, t, compiled, timeout=300)


# The phases in which each op communicates.
OVERLAPPED_PHASES = [
    ("all_gather_matmul", ["fwd", "bwd"]),
    ("matmul_reduce_scatter", ["fwd", "bwd"]),
    ("matmul_all_reduce", ["fwd"]),  # its backward needs no communication
    ("matmul_grad_all_reduce", ["bwd"]),  # its forward needs no communication
]


def check_transfers_overlap(results, op, phases, chunked_all_reduce=False):
    """Every transfer of ``op`` in ``phases`` was issued before a GEMM started and waited for after it, on every
    rank; with ``chunked_all_reduce`` (the forward of a chunked all-reduce) the last chunk's is exempt."""
    for rank, result in enumerate(results):
        for phase in phases:
            events = result[op][phase]
            overlapped = _transfers_overlapping_gemms(events)
            assert overlapped, f"rank {rank} {op} {phase}: no transfer issued: {events}"
            if chunked_all_reduce and phase == "fwd":
                # Chunk j's all-reduce runs during chunk j+1's GEMM; the last chunk's has no GEMM after it.
                overlapped.pop(max(overlapped))
            assert all(overlapped.values()), f"rank {rank} {op} {phase}: a transfer overlaps no GEMM: {events}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("op, phases", OVERLAPPED_PHASES)
def test_every_transfer_overlaps_a_gemm(traces, op, phases):
    check_transfers_overlap(traces[1], op, phases, chunked_all_reduce=op == "matmul_all_reduce")


@pytest.mark.multiprocess
def test_all_gather_issues_next_shard_before_current_gemm(traces):
    """The acceptance statement itself: the transfer of chunk i+1 is issued before the GEMM of chunk i."""
    t, results = traces
    for result in results:
        events = result["all_gather_matmul"]["fwd"]
        for i in range(t - 1):
            assert events.index(("send", "all_gather_matmul", i + 1)) < events.index(("gemm", "all_gather_matmul", i))
            assert events.index(("gemm", "all_gather_matmul", i)) < events.index(("wait", "all_gather_matmul", i + 1))


def hidden_weight_grads(events) -> int:
    """How many weight-gradient GEMMs started while some transfer was in flight (issued, not yet waited for)."""
    in_flight, hidden = set(), 0
    for kind, _, step in events:
        if kind == "send":
            in_flight.add(step)
        elif kind == "wait":
            in_flight.discard(step)
        elif kind == "wgrad" and in_flight:
            hidden += 1
    return hidden


@pytest.mark.multiprocess
def test_weight_gradients_run_while_transfers_are_in_flight(traces):
    _, results = traces
    for result in results:
        for op in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_grad_all_reduce"):
            events = result[op]["bwd"]
            assert hidden_weight_grads(events) > 0, f"{op}: no weight-gradient GEMM ran during a transfer: {events}"


@pytest.mark.multiprocess
def test_ring_steps_skip_the_checks_of_matmul(traces, request):
    """An op checks its operands once (as matmul would) and its ring steps then run matmul unchecked: the host
    time of the checks would show beside a short step's GEMM. Only GEMMs outside the rings check, the same
    number at every group size. Compiled, the GEMMs outside the rings are graph operators (checked by their
    fake implementations while tracing, never when the graph runs); the weight gradients of
    matmul_grad_all_reduce's backward node, computed while the last chunk travels, run through matmul."""
    t, results = traces
    compiled = request.node.callspec.params["traces"][1]
    expected = {  # (forward, backward)
        "all_gather_matmul": (0, 0),
        "matmul_reduce_scatter": (0, 0),
        "matmul_all_reduce": (0, 0 if compiled else 2),  # backward: dX = dY·W and dW = dYᵀ·X, no communication
        "matmul_grad_all_reduce": (0 if compiled else 2, 2),  # forward: one GEMM per weight; backward: their dW
    }
    for result in results:
        assert {op: result[op]["checks"] for op in expected} == expected, t


@pytest.mark.multiprocess
def test_bytes_are_the_ring_formulas(traces):
    t, results = traces
    f = 4  # fp32
    gathered_x = t * M * K * f  # |X| of the gathered input
    partial_y = t * M * N * f  # |Y| of each rank's full partial output
    ring = (t - 1) / t
    expected = {
        ("all_gather_matmul", "fwd"): ring * gathered_x,  # AG of X
        ("all_gather_matmul", "bwd"): ring * gathered_x,  # RS of dX
        ("matmul_reduce_scatter", "fwd"): ring * partial_y,  # RS of Y
        ("matmul_reduce_scatter", "bwd"): ring * partial_y,  # AG of dY
        ("matmul_all_reduce", "fwd"): 2 * ring * partial_y,  # AR of Y
        ("matmul_all_reduce", "bwd"): 0,
        ("matmul_grad_all_reduce", "fwd"): 0,
        ("matmul_grad_all_reduce", "bwd"): 2 * ring * gathered_x,  # AR of dX
    }
    for result in results:
        for (op, phase), want in expected.items():
            sent, received = result[op][f"{phase}_bytes"]
            for got in (sent, received):
                assert abs(got - want) <= 0.01 * want, f"{op} {phase}: {got} bytes, expected {want:.0f} ± 1%"


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda o, x, w: o.all_gather_matmul([[1.0]], w), TypeError, "x_shard must be a torch.Tensor"),
        (lambda o, x, w: o.all_gather_matmul(x[None], w), ValueError, "x_shard must be a 2-D"),
        (
            lambda o, x, w: o.all_gather_matmul(x, [w, w[:, :3]]),
            ValueError,
            r"weights\[1\] must be \[out_f",
        ),
        (lambda o, x, w: o.matmul_reduce_scatter(x, w.double()), ValueError, "weight must share x's dtype"),
        (lambda o, x, w: o.matmul_all_reduce(x, w, bias=torch.zeros(4)), ValueError, r"must have shape \(7,\)"),
        (lambda o, x, w: o.matmul_grad_all_reduce(x, [w], biases=[None, None]), ValueError, "one bias .or None. per"),
        (
            lambda o, x, w: o.all_gather_matmul(x.double(), w.double()),
            TypeError,
            "x_shard must be float32, float16 or bfloat16, received torch.float64",
        ),
        (
            lambda o, x, w: o.matmul_all_reduce(x, w, bias=torch.zeros(7, dtype=torch.float16)),
            ValueError,
            r"the bias of weight must share x's dtype and device \(torch.float32, cpu\), received torch.float16",
        ),
    ],
)
def test_bad_operands_are_named(call, error, match):
    from tessel.parallel import overlap

    x, w = torch.randn(6, 5), torch.randn(7, 5)
    with pytest.raises(error, match=match):
        call(overlap, x, w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_ops_never_synchronise_the_host_on_cuda():
    """The overlapped paths order their work with streams and events only: forward and backward of every op (a
    world of one, whose ring steps run as on several ranks, each exchange a copy) under
    ``torch.cuda.set_sync_debug_mode("error")``, which raises at any call that waits for the device. The first
    call autotunes the GEMMs (timing them does synchronise) and runs outside the check."""
    from tessel.parallel import all_gather_matmul, matmul_all_reduce, matmul_grad_all_reduce, matmul_reduce_scatter

    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()

    x, w, w2, b = rand(256, 128), rand(192, 128), rand(64, 128), rand(192)
    calls = {
        "all_gather_matmul": lambda: all_gather_matmul(x, [w, w2], biases=[b, None], overlap=True, regather=True),
        "matmul_reduce_scatter": lambda: [matmul_reduce_scatter(x, w, bias=b, overlap=True)],
        "matmul_all_reduce": lambda: [matmul_all_reduce(x, w, bias=b, overlap=True)],
        "matmul_grad_all_reduce": lambda: matmul_grad_all_reduce(x, [w, w2], biases=[b, None], overlap=True),
    }

    def step(call):
        outs = call()
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    for op, call in calls.items():
        step(call)  # autotunes
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(call)
        except RuntimeError as error:
            raise AssertionError(f"{op} synchronised the host: {error}") from error
        finally:
            torch.cuda.set_sync_debug_mode("default")
