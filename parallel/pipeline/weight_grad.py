"""Deferred weight gradients: how a backward splits into ``B`` (input gradient) and ``W`` (weight gradient).

Zero-bubble schedules (Qi et al. 2023) run the part of the backward on the critical path, the gradient of
each stage's input, as soon as the downstream gradient arrives (``B``), and postpone the weight-gradient
GEMMs (``W``) into the bubbles. A layer's autograd Function takes part like this::

    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight
        if is_deferring():
            submit(lambda: _accumulate(weight, grad_out.t() @ x))  # runs at this microbatch's W
            return grad_x, None
        return grad_x, grad_out.t() @ x

While :func:`defer_weight_grads` is active, :func:`submit` stores the closure in the active
:class:`WeightGradStore` instead of computing it; the closure must accumulate into ``.grad`` itself
(autograd no longer does, since the Function returned ``None`` for the weight). Layers that never
defer compute everything during ``B``, which is a correct combined backward with an empty ``W``.

The active store is process-wide, not per thread: on CUDA autograd runs a Function's backward on its
own device thread, which would not see a thread-local set by the thread that called ``backward()``
(the same reason :mod:`tessel.parallel.comm` keeps its counters process-wide). One pipeline schedule
per process drives it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

__all__ = ["WeightGradStore", "defer_weight_grads", "is_deferring", "submit"]


class WeightGradStore:
    """Weight-gradient closures submitted while deferring, in submission order."""

    def __init__(self):
        self._pending: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], None]) -> None:
        if not callable(fn):
            raise TypeError(f"WeightGradStore.submit: fn must be callable, received {type(fn).__name__}")
        with self._lock:
            self._pending.append(fn)

    def pop(self) -> list[Callable[[], None]]:
        """Remove and return every stored closure (oldest first)."""
        with self._lock:
            pending, self._pending = self._pending, []
        return pending

    def run(self) -> int:
        """Run and drop every stored closure, oldest first; returns how many ran."""
        pending = self.pop()
        for fn in pending:
            fn()
        return len(pending)

    def __len__(self) -> int:
        return len(self._pending)


_active: list[WeightGradStore] = []


@contextlib.contextmanager
def defer_weight_grads(store: WeightGradStore | None = None) -> Iterator[WeightGradStore]:
    """Make ``store`` (a new one by default) the active store inside the block; yields it.

    Blocks nest: the innermost store receives the submissions.
    """
    store = WeightGradStore() if store is None else store
    if not isinstance(store, WeightGradStore):
        raise TypeError(f"defer_weight_grads: store must be a WeightGradStore, received {type(store).__name__}")
    _active.append(store)
    try:
        yield store
    finally:
        del _active[next(i for i in range(len(_active) - 1, -1, -1) if _active[i] is store)]


def is_deferring() -> bool:
    """True inside :func:`defer_weight_grads`: a layer should :func:`submit` its weight gradient."""
    return bool(_active)


def submit(fn: Callable[[], None]) -> None:
    """Store ``fn`` in the active store, to run at this microbatch's ``W``; raises outside a deferring block."""
    if not _active:
        raise RuntimeError("submit: no weight-gradient store is active; check is_deferring() first")
    _active[-1].submit(fn)
