"""``pytest bench --benchmark-only``: the experts suite's cases under pytest-benchmark.

The same shapes and closures as ``python -m tessel.bench experts`` (GPU table on CUDA, small odd shapes
otherwise): tessel's grouped GEMM and one ``torch.matmul`` per expert, forward and weight gradient, side by
side in one group per shape and pass. pytest imports this file as ``bench.bench_experts``, outside the
installed package, hence the absolute ``tessel.bench`` imports.
"""

import pytest
import torch

from tessel.bench.experts import check_pass, expert_cases, expert_shapes, make_inputs, references
from tessel.bench.runner import synced

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32


@pytest.mark.parametrize("impl", ("tessel", "torch"))
@pytest.mark.parametrize("step", ("fwd", "wgrad"))
@pytest.mark.parametrize("shape", expert_shapes(CUDA), ids=lambda s: s.label)
def test_experts(benchmark, shape, step, impl):
    a, w, g, offsets, bounds = make_inputs(shape, DTYPE, DEVICE)
    impls = expert_cases(a, w, g, offsets, bounds)[step]
    check_pass(shape.label, step, impls, references(a, w, g, offsets)[step], DTYPE)  # no timing of a wrong result
    benchmark.group = f"experts {shape.label} {step} {str(DTYPE).removeprefix('torch.')}"
    benchmark.extra_info.update(rows=shape.rows, experts=shape.experts, k=shape.k, n=shape.n,
                                flops=2 * shape.rows * shape.k * shape.n)  # fmt: skip
    fn = synced(impls[impl])
    if CUDA:
        benchmark(fn)
    else:  # an interpreted call takes up to seconds: a fixed, small number of rounds
        benchmark.pedantic(fn, rounds=3, warmup_rounds=1, iterations=1)
