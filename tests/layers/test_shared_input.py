"""Column-parallel layers called one by one on the same input, computed in one op (:mod:`tessel.layers.shared_input`):
one all-reduce of the input's gradient instead of one per layer, outputs and gradients unchanged.

Bytes are :func:`~tessel.parallel.comm.count_bytes`' (the ring's 2(t-1)/t·|x| of an all-reduce, each way), exact:
they depend on shapes alone. Values are checked against the dense float64 layers at fp32 tolerances (1e-4).
"""

import copy

import pytest
import torch
from torch import nn

from tests.layers.test_hf import REFERENCE_KERNELS, _check_against_dense, _model, needs_hf
from tests.multiprocess import run_ranks

B, S, K = 2, 6, 8
WIDTHS = (8, 4, 4)  # q, k, v


def _siblings(shared: bool):
    from tessel.layers.linear import ColumnParallelLinear
    from tessel.layers.shared_input import SharedInput

    torch.manual_seed(0)
    dense = [nn.Linear(K, n, dtype=torch.float64) for n in WIDTHS]
    layers = [ColumnParallelLinear.from_linear(lin.float(), overlap=True) for lin in copy.deepcopy(dense)]
    group = SharedInput(layers) if shared else None
    return dense, layers, group


def _run(layers, inputs, grads):
    """Each layer on its input (the same leaf where ``inputs`` repeats a tensor); backward of Σ <y_i, g_i>."""
    leaves = {id(i): i.clone().requires_grad_() for i in inputs}
    ys = [layer(leaves[id(i)]) for layer, i in zip(layers, inputs)]
    sum((y * g).sum() for y, g in zip(ys, grads)).backward()
    return ys, [leaves[id(i)].grad for i in inputs]


def _check(rank, t, dense, layers, ys, inputs, x_grads, grads, what):
    """Against the dense layers, every rank's upstream gradient of its columns being ``grads`` (drawn alike)."""
    leaves = {id(i): i.double().requires_grad_() for i in inputs}
    full = [lin(leaves[id(i)]) for lin, i in zip(dense, inputs)]
    sum((y * torch.cat([g.double()] * t, -1)).sum() for y, g in zip(full, grads)).backward()
    cols = [slice(rank * n // t, (rank + 1) * n // t) for n in WIDTHS]
    for i, (layer, lin, c) in enumerate(zip(layers, dense, cols)):
        torch.testing.assert_close(ys[i].double(), full[i][..., c].detach(), rtol=1e-4, atol=1e-5, msg=what)
        torch.testing.assert_close(layer.weight.grad.double(), lin.weight.grad[c], rtol=1e-4, atol=1e-5, msg=what)
    for got, i in zip(x_grads, inputs):
        torch.testing.assert_close(got.double(), leaves[id(i)].grad, rtol=1e-4, atol=1e-5, msg=what)


def _worker(rank, t):
    from tessel.parallel.comm import count_bytes

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, K, generator=gen)
    grads = [torch.randn(B, S, n // t, generator=gen) for n in WIDTHS]
    moved = {}
    for shared in (False, True):
        dense, layers, group = _siblings(shared)
        with count_bytes() as counter:
            ys, x_grads = _run(layers, [x] * 3, grads)
        moved[shared] = counter.sent
        _check(rank, t, dense, layers, ys, [x] * 3, x_grads, grads, f"shared={shared}")
    all_reduce = 2 * (t - 1) / t * x.numel() * 4  # one all-reduce of the input's gradient, fp32
    assert moved == {False: 3 * all_reduce, True: all_reduce}, moved
    # the model feeds the layers different tensors: the first forward computes ahead once, then each runs alone
    dense, layers, group = _siblings(True)
    others = [torch.randn(B, S, K, generator=gen) for _ in range(3)]
    for step in range(2):
        for layer in (*layers, *dense):
            layer.zero_grad()
        with count_bytes() as counter:
            ys, x_grads = _run(layers, others, grads)
        assert group.alone and counter.sent == 3 * all_reduce
        _check(rank, t, dense, layers, ys, others, x_grads, grads, f"different inputs, step {step}")
    # a forward that stops early (a recomputation), then a whole one: the next runs ahead again
    dense, layers, group = _siblings(True)
    layers[0](x), layers[1](x)
    for layer in (*layers, *dense):
        layer.zero_grad()
    with count_bytes() as counter:
        ys, x_grads = _run(layers, [others[0]] * 3, grads)
    assert not group.alone and counter.sent == all_reduce
    _check(rank, t, dense, layers, ys, [others[0]] * 3, x_grads, grads, "after a forward that stopped early")
    # a sibling the forward never calls: cleared at the block's end, then each runs alone
    layers[0](x), layers[1](x)
    group.clear()
    assert group.alone and not group._outputs
    return "ok"


def _sequence_parallel_worker(rank, t):
    """Under sequence parallelism the shared op gathers the input once (one all-gather ring forward, one
    reduce-scatter of its gradient backward) where each layer alone gathers it again; same outputs and gradients."""
    from tessel.layers.linear import ColumnParallelLinear
    from tessel.layers.shared_input import SharedInput
    from tessel.parallel.comm import count_bytes

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(B, S // t, K, generator=gen)
    grads = [torch.randn(B, S, n // t, generator=gen) for n in WIDTHS]
    results = {}
    for shared in (False, True):
        torch.manual_seed(0)
        layers = [ColumnParallelLinear(K, n, sequence_parallel=True, overlap=True) for n in WIDTHS]
        if shared:
            SharedInput(layers)
        with count_bytes() as counter:
            ys, x_grads = _run(layers, [x] * 3, grads)
        results[shared] = (counter.sent, ys, x_grads[0], [layer.weight.grad for layer in layers])
    (alone, *plain), (once, *grouped) = results[False], results[True]
    ring = (t - 1) * x.numel() * 4  # one all-gather of the input, one reduce-scatter of its gradient: fp32
    assert (alone, once) == (3 * 2 * ring, 2 * ring), (alone, once)
    for a, b in zip(plain, grouped):
        for u, v in zip(a, b) if isinstance(a, list) else [(a, b)]:
            torch.testing.assert_close(v, u, rtol=1e-5, atol=1e-6)
    return "ok"


@pytest.mark.multiprocess
def test_sequence_parallel_layers_on_one_input_share_one_ring():
    assert run_ranks(_sequence_parallel_worker, 2) == ["ok", "ok"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_layers_on_one_input_share_one_all_reduce(world):
    assert run_ranks(_worker, world) == ["ok"] * world


def test_bad_groups_are_refused():
    from tessel.layers.linear import ColumnParallelLinear, column_outputs
    from tessel.layers.shared_input import SharedInput

    x = torch.randn(2, 4)
    with pytest.raises(TypeError, match="non-empty sequence of ColumnParallelLinear, received \\[\\]"):
        column_outputs([], x)
    with pytest.raises(TypeError, match="received Linear"):
        column_outputs(nn.Linear(4, 4), x)
    with pytest.raises(ValueError, match="must share their tensor-parallel group"):
        column_outputs([ColumnParallelLinear(4, 4), ColumnParallelLinear(4, 4, overlap=False)], x)
    with pytest.raises(ValueError, match="run in fp8 all or none"):
        column_outputs([ColumnParallelLinear(4, 4, fp8=True), ColumnParallelLinear(4, 4)], x)
    fp8_pair = [ColumnParallelLinear(4, 3, fp8=True), ColumnParallelLinear(4, 5, fp8=True)]
    assert [y.shape for y in column_outputs(fp8_pair, x)] == [(2, 3), (2, 5)]
    assert [y.shape for y in column_outputs([ColumnParallelLinear(4, 3), ColumnParallelLinear(4, 5)], x)] == [
        (2, 3), (2, 5)]  # fmt: skip

    with pytest.raises(TypeError, match="two or more ColumnParallelLinear"):
        SharedInput([ColumnParallelLinear(4, 4)])
    with pytest.raises(TypeError, match=r"received \['ColumnParallelLinear', 'Linear'\]"):
        SharedInput([ColumnParallelLinear(4, 4), nn.Linear(4, 4)])
    with pytest.raises(ValueError, match="must share their tensor-parallel group, in_features"):
        SharedInput([ColumnParallelLinear(4, 4), ColumnParallelLinear(6, 4)])


def _llama_ranks(rank, world_size):
    from tessel.layers.parallelize import parallelize
    from tessel.layers.shared_input import SharedInput
    from tessel.parallel.comm import count_bytes

    dense = _model("llama")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    moved = {}
    for shared in (True, False):
        par = parallelize(copy.deepcopy(dense), None)
        groups = {id(m.shared_input): m.shared_input for m in par.modules() if getattr(m, "shared_input", None)}
        assert len(groups) == 2 * len(par.model.layers) and all(isinstance(g, SharedInput) for g in groups.values())
        for group in groups.values():
            group.alone = not shared
        with count_bytes() as counter:
            par(ids).logits.sum().backward()
        moved[shared] = counter.sent
    # per layer: q/k/v's three all-reduces of the attention input's gradient become one, gate/up's two one
    hidden = 2 * (world_size - 1) / world_size * 2 * 8 * 64 * 4
    assert moved[False] - moved[True] == 3 * hidden * len(dense.model.layers), moved
    _check_against_dense(dense, parallelize(copy.deepcopy(dense), None), "llama, shared inputs")
    # one kv head copied on both ranks: k_proj and v_proj are column layers too, in q_proj's op
    dense = _model("llama", kv_heads=1)
    par = parallelize(copy.deepcopy(dense), None)
    attention = par.model.layers[0].self_attn
    assert attention.k_proj.shared_input is attention.v_proj.shared_input is attention.q_proj.shared_input
    with count_bytes() as counter:
        par(ids).logits.sum().backward()
    copies = 2 * (world_size - 1) / world_size * 16 * 64 * 4  # a copy's gradient summed: k's or v's weight, fp32
    assert counter.sent == moved[True] + 2 * copies * len(dense.model.layers), (counter.sent, moved)
    _check_against_dense(dense, parallelize(copy.deepcopy(dense), None), "llama, one kv head, shared inputs")
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_a_hugging_face_llama_shares_its_blocks_inputs():
    """Without sequence parallelism a parallelized Llama's q/k/v and gate/up each form one op: the dense model's
    logits and gradients, with three fewer all-reduces of a layer's input gradient per layer; with one kv head copied
    on both ranks, the same, and the all-reduces that sum the copies' k and v weight gradients."""
    assert run_ranks(_llama_ranks, 2, timeout=300, env=REFERENCE_KERNELS) == ["ok", "ok"]


def _fp8_ranks(rank, world_size):
    import tessel.layers.linear as linear
    from tessel.layers.fp8 import convert_to_fp8
    from tessel.layers.parallelize import parallelize

    calls = []
    fp8 = linear.column_parallel_fp8

    def counted(x2, weights, *args, **kwargs):
        calls.append((kwargs["sequence_parallel"], 1 if isinstance(weights, torch.Tensor) else len(weights)))
        return fp8(x2, weights, *args, **kwargs)

    linear.column_parallel_fp8 = counted
    dense = _model("llama")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    want = dense(ids).logits
    want.pow(2).mean().backward()
    for sp in (False, True):
        calls.clear()
        par = convert_to_fp8(parallelize(copy.deepcopy(dense), None, sequence_parallel=sp))
        par.zero_grad()
        got = par(ids).logits
        got.pow(2).mean().backward()
        # q/k/v and gate/up of each layer, each set one fp8 op of its weights (inside the block's ring under SP)
        assert calls == [(sp, 3), (sp, 2)] * len(dense.model.layers), (sp, calls)
        assert (got - want).norm() / want.norm() < 0.1  # fp8's rounding (measured 4.2% here), not another model
        # the norms before q/k/v and gate/up: their gradients pass through the sets' summed input gradients
        for name in ("input_layernorm", "post_attention_layernorm"):
            mine = par.get_parameter(f"model.layers.0.{name}.weight").grad
            ref = dense.get_parameter(f"model.layers.0.{name}.weight").grad
            assert (mine - ref).norm() / ref.norm() < 0.15, (name, ((mine - ref).norm() / ref.norm()).item())
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_fp8_projections_sharing_an_input_run_one_fp8_op_in_and_out_of_the_ring():
    """A parallelized Llama turned to fp8: q/k/v and gate/up each run as one fp8 op of their weights (one all-reduce of
    their input gradient, or one fp8 gather of the sequence-parallel shard), near the dense model's logits and
    gradients."""
    assert run_ranks(_fp8_ranks, 2, timeout=300, env=REFERENCE_KERNELS) == ["ok", "ok"]
