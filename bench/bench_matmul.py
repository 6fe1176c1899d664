"""``pytest bench --benchmark-only``: the matmul suite's cases under pytest-benchmark.

The same shapes and closures as ``python -m tessel.bench matmul`` (GPU table on CUDA, CPU table
otherwise), tessel and torch side by side in one group per shape and op. pytest imports this file
as ``bench.bench_matmul``, outside the installed package, hence the absolute ``tessel.bench`` imports.
"""

import pytest
import torch

from tessel.bench.matmul import OPS, make_inputs, matmul_cases, max_rel_error, tolerance
from tessel.bench.runner import synced
from tessel.bench.shapes import matmul_shapes

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# The interpreter computes dots in fp32 whatever the input dtype, so the CPU run uses fp32.
DTYPE = torch.bfloat16 if CUDA else torch.float32
IMPLS = ("tessel", "torch")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", matmul_shapes(CUDA), ids=lambda s: s.label)
def test_matmul(benchmark, shape, op, impl):
    cases = matmul_cases(*make_inputs(shape, DTYPE, DEVICE))
    tessel_fn, torch_fn = cases[op]
    if impl == "tessel":  # a wrong kernel's timing means nothing
        assert max_rel_error(tessel_fn(), torch_fn()) <= tolerance(DTYPE, CUDA)
    benchmark.group = f"{op} {shape.name} {str(DTYPE).removeprefix('torch.')}"
    benchmark.extra_info.update(M=shape.m, N=shape.n, K=shape.k, flops=shape.flops)
    fn = synced(tessel_fn if impl == "tessel" else torch_fn)
    if CUDA:
        benchmark(fn)
    else:  # an interpreted call takes up to a second: a fixed, small number of rounds
        benchmark.pedantic(fn, rounds=3, warmup_rounds=1, iterations=1)
