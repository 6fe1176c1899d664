"""``pytest bench --benchmark-only``: the decode suite's cases under pytest-benchmark.

The same shapes and closures as ``python -m tessel.bench decode`` (GPU table on CUDA, tiny CPU shapes
otherwise): tessel's flash attention with its own choice (split-KV on CUDA), tessel forced to one pass,
and torch's ``scaled_dot_product_attention``, side by side in one group per shape. pytest imports this
file as ``bench.bench_decode``, outside the installed package, hence the absolute ``tessel.bench`` imports.
"""

import pytest
import torch

from tessel.bench.decode import check_case, decode_bytes, decode_cases, decode_shapes, make_inputs
from tessel.bench.runner import synced

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32  # the interpreter computes dots in fp32 anyway
IMPLS = ("tessel", "one_pass", "torch")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", decode_shapes(CUDA), ids=lambda s: s.label)
def test_decode(benchmark, shape, impl):
    cases = decode_cases(*make_inputs(shape, DTYPE, DEVICE), CUDA)
    if impl != "torch":  # a wrong kernel's timing means nothing
        check_case(shape.label, cases, DTYPE, CUDA)
    benchmark.group = f"decode {shape.label} {str(DTYPE).removeprefix('torch.')}"
    benchmark.extra_info.update(
        B=shape.b, Hq=shape.hq, Hkv=shape.hkv, Sk=shape.sk, D=shape.d, bytes=decode_bytes(shape, DTYPE)
    )
    fn = synced(cases[impl])
    if CUDA:
        benchmark(fn)
    else:  # an interpreted call takes up to seconds: a fixed, small number of rounds
        benchmark.pedantic(fn, rounds=3, warmup_rounds=1, iterations=1)
