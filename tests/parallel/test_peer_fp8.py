"""The fp8 tensor-parallel ops through the device-signalled transports (``overlap="peer"``) against their rings.

Both run the same fp8 GEMMs on the same quantised operands (the gathered tensors' shards share one scale); they
differ in the order partial sums are added (the ring adds the ranks' partials one by one into its output, the
transport sums them in fp32 once they have arrived). In fp32 that is a few roundings of 2⁻²⁴: checked at 1e-5 of
the largest magnitude; in bf16 at 2⁻⁶ (two ulps), as tests/parallel/test_overlap_fp8.py does. Each op's forward and
backward must go through the transports (their call counts), the all-reduce ones only where the rows split evenly
over the ranks (the chunked all-reduce otherwise). Calls back to back with a rank held back check that the fp8
buffers are reused safely.
"""

import time

import pytest
import torch

from tests.multiprocess import REFERENCE_KERNELS, run_ranks
from tests.parallel.test_overlap_fp8 import DTYPES, OPS, TOL, _case

# the transports each op's forward and backward go through: the gather's shards are fp8, the partials are not
USES = {
    "fp8_all_gather_matmul": {("PeerAllGather", "fp8"): 1, ("PeerReduceScatter", "out"): 1},
    "fp8_matmul_reduce_scatter": {("PeerReduceScatter", "out"): 1, ("PeerAllGather", "fp8"): 1},
    "fp8_matmul_all_reduce": {("PeerReduceScatter", "out"): 1, ("PeerAllGather", "out"): 1},
    "fp8_matmul_grad_all_reduce": {("PeerReduceScatter", "out"): 1, ("PeerAllGather", "out"): 1},
}


def _used(transports) -> dict:
    return {
        (kind.__name__, "fp8" if dtype.itemsize == 1 else "out"): transport.epoch
        for (kind, _, _, _, dtype, _), (_, transport) in transports.items()
    }


def _worker(rank, t, dtype_name, slow):
    from tessel.parallel.peer import PeerAllGather, PeerReduceScatter, _transports

    if slow and rank == t - 1:  # held back after releasing each buffer: the others' next writes land meanwhile
        for kind in (PeerAllGather, PeerReduceScatter):
            finish = kind.finish
            kind.finish = lambda self, finish=finish: (finish(self), time.sleep(0.1))[0]
    dtype = DTYPES[dtype_name]
    result = {}
    for op in OPS:
        _transports.clear()
        call, leaves = _case(op, rank, t, dtype)
        outs, grads = [], []
        for overlap in ("peer", True):
            y = call(overlap)
            y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(20 + rank)).to(dtype))
            outs.append([y.detach(), *(leaf.grad.clone() for leaf in leaves)])
            for leaf in leaves:
                leaf.grad = None
            if overlap == "peer":
                grads.append(_used(_transports))
        errors = [((a.double() - b.double()).abs().max() / b.double().abs().max()).item() for a, b in zip(*outs)]
        result[op] = errors, grads[0]
    return result


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "t, dtype_name, slow, kernels",
    [(2, "fp32", False, "interpreter"), (4, "fp32", True, "reference"), (2, "bf16", True, "reference")],
)
def test_every_fp8_op_through_the_transports_equals_its_ring(t, dtype_name, slow, kernels):
    env = REFERENCE_KERNELS if kernels == "reference" else None
    for rank, result in enumerate(run_ranks(_worker, t, dtype_name, slow, env=env, timeout=300)):
        for op in OPS:
            errors, used = result[op]
            names = ("output", "input grad", "weight grad", "bias grad")
            for name, err in zip(names, errors, strict=True):
                assert err <= TOL[dtype_name], f"rank {rank} {op} {name}: {err:.3g} > {TOL[dtype_name]:.3g}"
            assert used == USES[op], (op, used)


def _uneven_worker(rank, t):
    from tessel.parallel.overlap_fp8 import fp8_matmul_all_reduce
    from tessel.parallel.peer import _transports

    _transports.clear()
    x = torch.randn(2 * t + 1, 8, requires_grad=True)  # rows that do not split over the ranks
    w = torch.randn(5, 8, requires_grad=True)
    y = fp8_matmul_all_reduce(x, w, overlap="peer")
    y.sum().backward()
    ring = fp8_matmul_all_reduce(x.detach(), w.detach(), overlap=True)
    return len(_transports), torch.equal(y.detach(), ring)


@pytest.mark.multiprocess
def test_rows_that_do_not_split_take_the_chunked_all_reduce():
    for count, same in run_ranks(_uneven_worker, 2, env=REFERENCE_KERNELS):
        assert count == 0 and same


def test_an_unknown_overlap_is_refused_by_name():
    from tessel.parallel.overlap_fp8 import fp8_all_gather_matmul, fp8_matmul_reduce_scatter

    with pytest.raises(ValueError, match=r"fp8_all_gather_matmul: overlap must be True, False or 'peer', .*'ring'"):
        fp8_all_gather_matmul(torch.zeros(3, 4), torch.zeros(2, 4), overlap="ring")
    with pytest.raises(ValueError, match=r"fp8_matmul_reduce_scatter: overlap must be .*received 'auto'"):
        fp8_matmul_reduce_scatter(torch.zeros(3, 4), torch.zeros(2, 4), overlap="auto")
