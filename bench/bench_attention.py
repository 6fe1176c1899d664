"""``pytest bench --benchmark-only``: the attention suite's cases under pytest-benchmark.

The same shapes and closures as ``python -m tessel.bench attention`` (GPU table on CUDA, tiny CPU
shapes otherwise): tessel's flash attention and torch's ``scaled_dot_product_attention`` side by side
in one group per shape, mask and pass (forward, forward+backward). pytest imports this file as
``bench.bench_attention``, outside the installed package, hence the absolute ``tessel.bench`` imports.
"""

import pytest
import torch

from tessel.bench.attention import (
    PASSES,
    attention_cases,
    attention_flops,
    attention_shapes,
    check_case,
    make_inputs,
    sdpa_backend,
)
from tessel.bench.runner import synced

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# The interpreter computes dots in fp32 whatever the input dtype, so the CPU run uses fp32.
DTYPE = torch.bfloat16 if CUDA else torch.float32
IMPLS = ("tessel", "torch")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pass_", PASSES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", attention_shapes(CUDA), ids=lambda s: s.label)
def test_attention(benchmark, shape, causal, pass_, impl):
    backend = sdpa_backend(DTYPE, CUDA)
    fns = attention_cases(*make_inputs(shape, DTYPE, DEVICE), causal, backend)[pass_]
    if impl == "tessel":  # a wrong kernel's timing means nothing
        check_case(f"{shape.label} {pass_} causal={causal}", fns, DTYPE, CUDA)
    benchmark.group = f"attention {pass_} {shape.label} causal={causal} {str(DTYPE).removeprefix('torch.')}"
    benchmark.extra_info.update(
        B=shape.b, H=shape.h, S=shape.s, D=shape.d, flops=attention_flops(shape, causal, pass_), torch_backend=backend
    )
    fn = synced(fns[0] if impl == "tessel" else fns[1])
    if CUDA:
        benchmark(fn)
    else:  # an interpreted call takes up to seconds: a fixed, small number of rounds
        benchmark.pedantic(fn, rounds=3, warmup_rounds=1, iterations=1)
