"""The fp8 tensor-parallel ops (parallel/overlap_fp8.py): overlapped and plain agree, the rings overlap, the gathers
move one byte per element.

Overlapped and plain paths run the same fp8 GEMMs on the same quantised operands (a gathered tensor's shards share
the scale of the whole, so quantising a shard is quantising its rows of the whole); they differ only in the order
in which partial sums are added (the reduce-scatter ring adds the ranks' partials one by one, gloo's collective
in its own order) and where the bias enters the sum. In fp32 that is a few roundings of 2⁻²⁴: checked at 1e-5 of
the largest magnitude; in bf16 a few roundings of 2⁻⁹: checked at 2⁻⁶ (two ulps).

Overlap is shown as in tests/parallel/test_overlap.py, from the events each op logs (no timing), and the bytes
from tessel's byte counter: the fp8 gathers move the ring's (t-1)/t of the gathered tensor at one byte per element
(half of bf16's, a quarter of fp32's) plus one all-reduced amax (4 bytes) that gives the shards one scale.
"""

import pytest
import torch

from tests.multiprocess import run_ranks
from tests.parallel.test_overlap import OVERLAPPED_PHASES, check_transfers_overlap, hidden_weight_grads

M, K, N = 6, 32, 16  # rows per rank, input and output features
TOL = {"fp32": 1e-5, "bf16": 2.0**-6}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OPS = ("fp8_all_gather_matmul", "fp8_matmul_reduce_scatter", "fp8_matmul_all_reduce", "fp8_matmul_grad_all_reduce")


def _case(op, rank, t, dtype, regather=False):
    """``(call(overlap) -> output, leaves)``: the op on seeded per-rank inputs, with a bias (the same on every
    rank, as a row-parallel layer's whole bias is)."""
    from tessel.parallel import overlap_fp8

    g = torch.Generator().manual_seed(10 + rank)
    rows = M if op == "fp8_all_gather_matmul" else t * M
    x = torch.randn(rows, K, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(N, K, generator=g) / 4).to(dtype).requires_grad_()
    b = torch.randn(N, generator=torch.Generator().manual_seed(9)).to(dtype).requires_grad_()  # row ops: whole
    fn = getattr(overlap_fp8, op)
    extra = {"regather": regather} if op == "fp8_all_gather_matmul" else {}
    column = op in ("fp8_all_gather_matmul", "fp8_matmul_grad_all_reduce")  # (whose weights may be several)
    bias = {"biases" if column else "bias": b}
    return (lambda overlap: fn(x, w, overlap=overlap, **bias, **extra)), (x, w, b)


def _run(op, rank, t, dtype, overlap, regather=False):
    """Output, input/weight/bias gradients, and the events and bytes of forward and backward."""
    from tessel.parallel import count_bytes, record_events

    call, leaves = _case(op, rank, t, dtype, regather)
    with record_events() as fwd_log, count_bytes() as fwd_bytes:
        y = call(overlap)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(20 + rank)).to(dtype)
    with record_events() as bwd_log, count_bytes() as bwd_bytes:
        y.backward(grad)
    return dict(
        values=[y.detach(), *(leaf.grad for leaf in leaves)], fwd=fwd_log.events, bwd=bwd_log.events,
        fwd_bytes=(fwd_bytes.sent, fwd_bytes.received), bwd_bytes=(bwd_bytes.sent, bwd_bytes.received),
    )  # fmt: skip


def _worker(rank, t, dtype_name):
    dtype = DTYPES[dtype_name]
    result = {}
    for op in OPS:
        plain, ring = _run(op, rank, t, dtype, False), _run(op, rank, t, dtype, True)
        errors = [
            ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
            for a, b in zip(ring["values"], plain["values"], strict=True)
        ]
        result[op] = dict(errors=errors, **{k: v for k, v in ring.items() if k != "values"})
    regathered = _run("fp8_all_gather_matmul", rank, t, dtype, True, regather=True)
    kept = _run("fp8_all_gather_matmul", rank, t, dtype, True)
    result["regather"] = [torch.equal(a, b) for a, b in zip(regathered["values"], kept["values"], strict=True)]
    return result


@pytest.fixture(scope="module", params=[(2, "fp32"), (4, "fp32"), (2, "bf16")], ids=lambda p: f"{p[0]}-{p[1]}")
def traces(request):
    t, dtype_name = request.param
    return t, dtype_name, run_ranks(_worker, t, dtype_name, timeout=300)


@pytest.mark.multiprocess
def test_overlapped_and_plain_paths_agree(traces):
    _, dtype_name, results = traces
    for rank, result in enumerate(results):
        for op in OPS:
            names = ("output", "input grad", "weight grad", "bias grad")
            for name, err in zip(names, result[op]["errors"], strict=True):
                assert err <= TOL[dtype_name], f"rank {rank} {op} {name}: {err:.3g} > {TOL[dtype_name]:.3g}"
        # Gathering the fp8 shard again in backward gives the very gradients of keeping the gathered input.
        assert all(result["regather"]), result["regather"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("op, phases", OVERLAPPED_PHASES)
def test_every_transfer_overlaps_a_gemm(traces, op, phases):
    check_transfers_overlap(traces[2], f"fp8_{op}", phases, chunked_all_reduce=op == "matmul_all_reduce")


@pytest.mark.multiprocess
def test_the_next_shard_travels_during_the_current_gemm_and_weight_gradients_hide_transfers(traces):
    t, _, results = traces
    for result in results:
        events = result["fp8_all_gather_matmul"]["fwd"]
        for i in range(t - 1):
            assert events.index(("send", "all_gather_matmul", i + 1)) < events.index(("gemm", "all_gather_matmul", i))
        for op in ("fp8_all_gather_matmul", "fp8_matmul_reduce_scatter", "fp8_matmul_grad_all_reduce"):
            assert hidden_weight_grads(result[op]["bwd"]) > 0, f"{op}: no weight-gradient GEMM hid a transfer"


@pytest.mark.multiprocess
def test_gathers_move_one_byte_per_element(traces):
    t, dtype_name, results = traces
    f = DTYPES[dtype_name].itemsize
    ring = lambda nbytes: (t - 1) * nbytes // t  # a ring all-gather or reduce-scatter's bytes each way
    amax = 2 * (t - 1) * 4 // t  # the all-reduce of one fp32 number (a maximum) before an fp8 gather
    expected = {
        ("fp8_all_gather_matmul", "fwd"): ring(t * M * K) + amax,  # AG of X in fp8
        ("fp8_all_gather_matmul", "bwd"): ring(t * M * K * f),  # RS of dX (partial sums in the model's dtype)
        ("fp8_matmul_reduce_scatter", "fwd"): ring(t * M * N * f),  # RS of Y
        ("fp8_matmul_reduce_scatter", "bwd"): ring(t * M * N) + amax + 2 * ring(N * 4),  # AG of dY in fp8; AR of db
        ("fp8_matmul_all_reduce", "fwd"): 2 * ring(t * M * N * f),  # AR of Y
        ("fp8_matmul_all_reduce", "bwd"): 0,
        ("fp8_matmul_grad_all_reduce", "fwd"): 0,
        ("fp8_matmul_grad_all_reduce", "bwd"): 2 * ring(t * M * K * f),  # AR of dX
    }
    for rank, result in enumerate(results):
        for (op, phase), want in expected.items():
            sent, received = result[op][f"{phase}_bytes"]
            assert abs(sent - want) <= 0.01 * want and abs(received - want) <= 0.01 * want, (
                rank,
                op,
                phase,
                sent,
                want,
            )


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda o, x, w: o.fp8_all_gather_matmul([[1.0]], w), TypeError, "x_shard must be a torch.Tensor"),
        (lambda o, x, w: o.fp8_matmul_reduce_scatter(x, w.double()), ValueError, "weight must share x's dtype"),
        (lambda o, x, w: o.fp8_matmul_all_reduce(x, w, bias=torch.zeros(4)), ValueError, r"must have shape \(7,\)"),
        (lambda o, x, w: o.fp8_all_gather_matmul(x, []), ValueError, "weights must be a tensor or a non-empty list"),
        (
            lambda o, x, w: o.fp8_matmul_grad_all_reduce(x, [w, w], biases=[None]),
            ValueError,
            "expected one bias .or None. per weight, received 1 for 2",
        ),
        (
            lambda o, x, w: o.fp8_matmul_grad_all_reduce(x.double(), w.double()),
            TypeError,
            r"x must be float32, float16 or bfloat16, received torch\.float64",
        ),
        (lambda o, x, w: o.fp8_matmul_grad_all_reduce(x[None], w), ValueError, "x must be a 2-D"),
    ],
)
def test_bad_operands_are_named(call, error, match):
    from tessel.parallel import overlap_fp8

    with pytest.raises(error, match=match):
        call(overlap_fp8, torch.randn(6, 5), torch.randn(7, 5))
