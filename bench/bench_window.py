"""``pytest bench --benchmark-only``: the sliding-window suite's cases under pytest-benchmark.

The same shapes and closures as ``python -m tessel.bench window`` (GPU table on CUDA, tiny CPU shapes
otherwise): tessel's windowed flash attention, torch's sliding window (FlexAttention on CUDA where
torch has it, SDPA with the window as a mask otherwise) and tessel's full causal attention on the same
inputs, side by side in one group per shape and pass. pytest imports this file as
``bench.bench_window``, outside the installed package, hence the absolute ``tessel.bench`` imports.
"""

import pytest
import torch

from tessel.bench.attention import check_case, make_inputs
from tessel.bench.runner import synced
from tessel.bench.window import PASSES, torch_window_attention, window_cases, window_flops, window_shapes

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# The interpreter computes dots in fp32 whatever the input dtype, so the CPU run uses fp32.
DTYPE = torch.bfloat16 if CUDA else torch.float32
IMPLS = ("tessel", "torch", "tessel-causal")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pass_", PASSES)
@pytest.mark.parametrize("shape", window_shapes(CUDA), ids=lambda s: s.label)
def test_window(benchmark, shape, pass_, impl):
    torch_impl, torch_attention = torch_window_attention(shape, CUDA, DEVICE)
    fns = window_cases(*make_inputs(shape, DTYPE, DEVICE), shape, torch_attention)[pass_]
    if impl == "tessel":  # a wrong kernel's timing means nothing
        check_case(f"{shape.label} {pass_} window={shape.window}", fns[:2], DTYPE, CUDA)
    benchmark.group = f"window {pass_} {shape.label} {str(DTYPE).removeprefix('torch.')}"
    benchmark.extra_info.update(B=shape.b, H=shape.h, S=shape.s, D=shape.d, window=shape.window,
                                flops=window_flops(shape, pass_), torch_impl=torch_impl)  # fmt: skip
    fn = synced(fns[IMPLS.index(impl)])
    if CUDA:
        benchmark(fn)
    else:  # an interpreted call takes up to seconds: a fixed, small number of rounds
        benchmark.pedantic(fn, rounds=3, warmup_rounds=1, iterations=1)
