"""Zero-bubble split of the linear layers' backward: B computes the input gradient, W the weight gradient.

Inside ``defer_weight_grads()`` a backward must leave every weight's ``.grad`` untouched and produce
exactly the input gradient of the combined backward; running the store afterwards must produce exactly
the combined backward's weight gradients. Checked on 2 gloo ranks for every path of both layers.
"""

import pytest
import torch

from tessel.layers.linear import ColumnParallelLinear, RowParallelLinear
from tessel.parallel.pipeline.weight_grad import defer_weight_grads
from tests.multiprocess import run_ranks


def _layer(kind, sp, overlap):
    torch.manual_seed(3)
    if kind == "column":
        return ColumnParallelLinear(6, (4, 8), sequence_parallel=sp, overlap=overlap)
    return RowParallelLinear(8, 5, sequence_parallel=sp, overlap=overlap)


def _backward(layer, x, defer):
    x = x.clone().requires_grad_()
    out = layer(x)
    loss = sum((o * o).sum() for o in out) if isinstance(out, tuple) else (out * out).sum()
    if not defer:
        loss.backward()
        return x.grad, None
    with defer_weight_grads() as store:
        loss.backward()
    return x.grad, store


def _deferred_against_combined(rank, world_size, kind, sp, overlap, managed=False):
    """``(ref, dx_ref, layer, dx, store)``: the combined backward of one layer, and the backward inside
    ``defer_weight_grads()`` of an identical one (its parameters marked as a data-parallel wrapper's with
    ``managed``)."""
    from tessel.parallel.ddp import OWNER_ATTR

    width = 6 if kind == "column" else 8 // world_size
    x = torch.randn(2, 4 // world_size if sp else 4, width, generator=torch.Generator().manual_seed(rank))
    ref = _layer(kind, sp, overlap)
    dx_ref, _ = _backward(ref, x, defer=False)
    layer = _layer(kind, sp, overlap)
    for p in layer.parameters() if managed else ():
        setattr(p, OWNER_ATTR, object())  # as DDP and FSDP mark the parameters they manage
    dx, store = _backward(layer, x, defer=True)
    return ref, dx_ref, layer, dx, store


def _check(rank, world_size, kind, sp, overlap):
    ref, dx_ref, layer, dx, store = _deferred_against_combined(rank, world_size, kind, sp, overlap)
    assert layer.weight.grad is None, "the weight gradient must wait for W"
    assert len(store) == 1
    torch.testing.assert_close(dx, dx_ref)
    if layer.bias is not None:
        torch.testing.assert_close(layer.bias.grad, ref.bias.grad)
    store.run()
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad)


def _check_owned(rank, world_size, kind, sp, overlap):
    """Weights a data-parallel wrapper manages are never deferred: their gradients must reach its hooks in the
    backward that produced them."""
    ref, dx_ref, layer, dx, store = _deferred_against_combined(rank, world_size, kind, sp, overlap, managed=True)
    assert len(store) == 0, "a managed weight's gradient was deferred"
    torch.testing.assert_close(dx, dx_ref)
    assert layer.weight.grad is not None, "the managed weight lost its gradient"
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad)


@pytest.mark.multiprocess
@pytest.mark.parametrize("managed", [False, True], ids=["deferred", "managed"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("kind", ["column", "row"])
def test_weight_grads_under_deferral_equal_the_combined_backward(kind, sp, overlap, managed):
    """Deferred: B leaves the weight gradient to W. Managed by a data-parallel wrapper: never deferred."""
    run_ranks(_check_owned if managed else _check, 2, kind, sp, overlap)


def _check_replicated(rank, world_size, sp, overlap):
    """A column layer whose parts are replicated over the ranks (kv heads fewer than them) multiplies a tensor computed
    from its weight, whose copies' gradients are summed over the group in backward: never deferred (its gradient would
    stop at that tensor), the combined backward's gradients."""
    torch.manual_seed(3)
    make = lambda: ColumnParallelLinear(6, (4, 2, 2), max_chunks=(None, 1, 1), sequence_parallel=sp, overlap=overlap)
    x = torch.randn(2, 4 // world_size if sp else 4, 6, generator=torch.Generator().manual_seed(rank))
    state = make().state_dict()
    ref, layer = make(), make()
    ref.load_state_dict(state)
    layer.load_state_dict(state)
    dx_ref, _ = _backward(ref, x, defer=False)
    dx, store = _backward(layer, x, defer=True)
    assert len(store) == 0, "the replicated weight's gradient was deferred"
    torch.testing.assert_close(dx, dx_ref)
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad)


@pytest.mark.multiprocess
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_replicated_parts_are_never_deferred(sp, overlap):
    run_ranks(_check_replicated, 2, sp, overlap)
