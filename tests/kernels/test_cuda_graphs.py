"""tessel's kernels inside CUDA graphs: a training step or a generation loop captured once and replayed.

A launcher is capturable when it neither synchronises with the host nor reads device values there, and
when everything it allocates comes from torch's allocator (the graph's private pool). Each test warms the
call up outside the capture (the autotuners time their candidates there), captures it, writes new values
into the inputs, replays, and checks the replay's output against a float64 reference of the new inputs:
a replay that kept the capture's results, or read a buffer freed since, would fail.
"""

import pytest
import torch

from tessel.bench.runner import capture_graph
from tessel.kernels.attention import flash_attention, flash_attention_backward, flash_attention_reference
from tessel.kernels.matmul import matmul

pytestmark = pytest.mark.gpu


def _refill(*tensors, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=gen, device="cuda"))


def _rel(got, want):
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("accumulate", [False, True])
def test_matmul_into_a_slice(accumulate):
    a = torch.empty(300, 200, device="cuda", dtype=torch.bfloat16)
    b = torch.empty(200, 500, device="cuda", dtype=torch.bfloat16).t().contiguous().t()  # a transposed view
    bias = torch.empty(120, device="cuda", dtype=torch.bfloat16)
    buf = torch.empty(300, 512, device="cuda", dtype=torch.float32)
    _refill(a, b, bias, buf, seed=0)
    graph, _ = capture_graph(lambda: matmul(a, b[:, 7:127], bias, "gelu", out=buf[:, 3:123], accumulate=accumulate))
    _refill(a, b, bias, buf, seed=1)
    before = buf.double().clone()
    graph.replay()
    torch.cuda.synchronize()
    z = a.double() @ b[:, 7:127].double() + bias.double()
    want = torch.nn.functional.gelu(z) + (before[:, 3:123] if accumulate else 0)
    assert _rel(buf[:, 3:123], want) < 2e-2
    assert torch.equal(buf[:, :3].double(), before[:, :3]) and torch.equal(buf[:, 123:].double(), before[:, 123:])


@pytest.mark.parametrize(
    ("sq", "num_splits"), [(1, None), (1, 1), (77, None)], ids=["decode-split", "decode", "prefill"]
)
def test_flash_attention_forward(sq, num_splits):
    q = torch.empty(2, 8, sq, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.empty(2, 2, 700, 64, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    _refill(q, k, v, seed=0)
    graph, (out, lse) = capture_graph(lambda: flash_attention(q, k, v, True, return_lse=True, num_splits=num_splits))
    _refill(q, k, v, seed=1)
    graph.replay()
    torch.cuda.synchronize()
    want = flash_attention_reference(q.double(), k.double(), v.double(), True)
    assert _rel(out, want) < 2e-2
    assert torch.isfinite(lse).all()


@pytest.mark.parametrize("deterministic", [True, False])
def test_flash_attention_backward(deterministic):
    q = torch.empty(2, 4, 150, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.empty(2, 2, 150, 64, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    dout = torch.empty_like(q)

    def step():
        out, lse = flash_attention(q, k, v, True, return_lse=True)
        return flash_attention_backward(q, k, v, out, lse, dout, True, deterministic=deterministic)

    _refill(q, k, v, dout, seed=0)
    graph, grads = capture_graph(step)
    _refill(q, k, v, dout, seed=1)
    graph.replay()
    torch.cuda.synchronize()
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    flash_attention_reference(*leaves, True).backward(dout.double())
    for got, leaf in zip(grads, leaves):
        assert _rel(got, leaf.grad) < 3e-2
