"""``pytest bench --benchmark-only``: the adam suite's cases under pytest-benchmark.

The same shards and closures as ``python -m tessel.bench adam`` (GPU shards on CUDA, small odd
shards on a CPU): tessel's fused step, torch.optim.AdamW(fused=True) plus the cast to the param copy,
and the device-to-device copy of the same byte count, side by side in one group per shard. pytest
imports this file as ``bench.bench_adam``, outside the installed package, hence the absolute imports.
"""

import pytest
import torch

from tessel.bench.adam import adam_shards, bytes_per_element, check_step, copy_fn, make_state, tessel_fn, torch_fn
from tessel.bench.runner import synced

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
IMPLS = ("tessel", "torch", "copy")


def _case(n, impl):
    if impl == "copy":
        return copy_fn(bytes_per_element(DTYPE) * n, DEVICE)
    state = make_state(n, DTYPE, DEVICE)
    torch_step, torch_param, torch_copy = torch_fn(state)
    check_step(state, torch_step, torch_param, torch_copy)  # raises when tessel disagrees: no timing then
    if impl == "torch":
        return torch_step
    del torch_step, torch_param, torch_copy
    return tessel_fn(state, step=2)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shard", adam_shards(CUDA), ids=lambda s: s[0])
def test_adam(benchmark, shard, impl):
    label, n = shard
    fn = synced(_case(n, impl))
    benchmark.group = f"adam {label} {str(DTYPE).removeprefix('torch.')}"
    benchmark.extra_info.update(n=n, bytes=bytes_per_element(DTYPE) * n)
    if CUDA:
        benchmark(fn)
    else:  # an interpreted step takes up to a second: a fixed, small number of rounds
        benchmark.pedantic(fn, rounds=3, warmup_rounds=1, iterations=1)
