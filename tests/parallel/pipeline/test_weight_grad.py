"""Deferred weight gradients: the store, the active-store switch, and a Function that defers its wgrad GEMM."""

import threading

import pytest
import torch

from tessel.parallel.pipeline.weight_grad import WeightGradStore, defer_weight_grads, is_deferring, submit
from tests.parallel.pipeline.models import DeferredLinear


def _layer_and_input(seed):
    layer = DeferredLinear(7, 5)
    x = torch.randn(3, 4, 7, requires_grad=True)
    grad_out = torch.randn(3, 4, 5)
    return layer, x, grad_out


def _dense_grads(layer, x, grad_out):
    """nn.Linear's own backward: the reference for the deferred one."""
    x_ref = x.detach().clone().requires_grad_()
    w, b = layer.weight.detach().clone().requires_grad_(), layer.bias.detach().clone().requires_grad_()
    torch.nn.functional.linear(x_ref, w, b).backward(grad_out)
    return x_ref.grad, w.grad, b.grad


def test_deferred_backward_splits_input_and_weight_gradients(seed):
    layer, x, grad_out = _layer_and_input(seed)
    want_x, want_w, want_b = _dense_grads(layer, x, grad_out)
    with defer_weight_grads() as store:
        assert is_deferring()
        layer(x).backward(grad_out)
    assert not is_deferring()
    # B computed the input gradient only; the weight gradient waits in the store.
    assert layer.weight.grad is None and layer.bias.grad is None and len(store) == 1
    # Same ops in the same order as the dense backward: bitwise equal is not promised, 1e-6 is fp32 noise.
    torch.testing.assert_close(x.grad, want_x, rtol=1e-6, atol=1e-6)
    assert store.run() == 1 and len(store) == 0
    torch.testing.assert_close(layer.weight.grad, want_w, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.bias.grad, want_b, rtol=1e-6, atol=1e-6)


def test_without_deferral_the_backward_is_combined(seed):
    layer, x, grad_out = _layer_and_input(seed)
    layer(x).backward(grad_out)
    _, want_w, _ = _dense_grads(layer, x, grad_out)
    torch.testing.assert_close(layer.weight.grad, want_w, rtol=1e-6, atol=1e-6)


def test_weight_closures_accumulate_over_microbatches(seed):
    layer, x, grad_out = _layer_and_input(seed)
    stores = []
    for _ in range(2):
        with defer_weight_grads() as store:
            layer(x).backward(grad_out)
        stores.append(store)
    for store in stores:
        store.run()
    _, want_w, _ = _dense_grads(layer, x, grad_out)
    torch.testing.assert_close(layer.weight.grad, 2 * want_w, rtol=1e-6, atol=1e-6)


def test_blocks_nest_and_the_innermost_store_collects():
    outer_store = WeightGradStore()
    with defer_weight_grads(outer_store) as outer:
        assert outer is outer_store
        with defer_weight_grads() as inner:
            submit(lambda: None)
        submit(lambda: None)
        submit(lambda: None)
    assert (len(inner), len(outer)) == (1, 2)
    assert len(outer.pop()) == 2 and len(outer) == 0


def test_the_active_store_is_seen_from_other_threads():
    # Autograd runs CUDA backward on its own device thread: the store must be visible there.
    seen = []
    with defer_weight_grads() as store:
        thread = threading.Thread(target=lambda: (seen.append(is_deferring()), submit(lambda: None)))
        thread.start()
        thread.join()
    assert seen == [True] and len(store) == 1


def test_closures_run_oldest_first():
    order = []
    store = WeightGradStore()
    for k in range(3):
        store.submit(lambda k=k: order.append(k))
    store.run()
    assert order == [0, 1, 2]


def test_bad_use_is_reported():
    with pytest.raises(RuntimeError, match="no weight-gradient store is active"):
        submit(lambda: None)
    with pytest.raises(TypeError, match="fn must be callable, received int"):
        WeightGradStore().submit(3)
    with pytest.raises(TypeError, match="store must be a WeightGradStore, received list"), defer_weight_grads([]):
        pass
