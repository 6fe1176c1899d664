"""Point-to-point transfers between pipeline ranks, with a bounded wait and an abort signal.

Each batch of transfers is one ``batch_isend_irecv`` on the pipeline group; bytes are counted by
:func:`tessel.parallel.comm.count_bytes`. Sends are never waited for until the end of the step
(buffered-send semantics, see :mod:`.validate`); receives are waited for before the compute that
needs them.

No hang: when a rank raises inside a step, it sets an abort key in the process group's store; a rank
waiting on gloo watches that key while it waits, and raises :class:`PipelineAbortedError` within a few
tens of milliseconds. A rank that disappears without raising (killed, or stopped running the
schedule) is caught by the wait's ``timeout`` (:class:`PipelineTimeoutError`). On NCCL ``wait()`` only
orders the CUDA streams and never blocks the host; there the process group's own timeout applies.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..comm import _account, _global_rank

__all__ = ["P2P", "PipelineAbortedError", "PipelineTimeoutError"]

_POLL_S = 0.02  # how often a waiting rank looks for the abort key and the clock


class PipelineAbortedError(RuntimeError):
    """Another rank of the pipeline raised during the step; this rank stopped waiting for it."""


class PipelineTimeoutError(TimeoutError):
    """A transfer did not complete within the schedule's timeout (a peer died or stopped running)."""


_steps: dict[str, int] = {}  # steps started per pipeline group, so abort keys never go stale


class P2P:
    """Transfers of one step on ``group``; ``abort`` / waiting share one key per group and step."""

    def __init__(self, group: dist.ProcessGroup | None, timeout: float, device: torch.device):
        self.group, self.timeout = group, timeout
        self.polling = device.type == "cpu"  # CPU tensors travel through gloo, whose waits block the host
        group = group or dist.group.WORLD
        name = f"{getattr(group, 'group_name', '')}:{'-'.join(map(str, dist.get_process_group_ranks(group)))}"
        _steps[name] = step = _steps.get(name, 0) + 1
        self._key = f"tessel/pipeline/{name}/step{step}/abort"
        self._store = _default_store()
        self.pending_sends: list[tuple[object, list[torch.Tensor]]] = []

    def post(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]):
        """Start sending and receiving ``(tensor, peer pipeline rank)`` pairs; returns the receives' works."""
        ops = [dist.P2POp(dist.isend, t, _global_rank(self.group, peer), self.group) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, t, _global_rank(self.group, peer), self.group) for t, peer in recvs]
        if not ops:
            return []
        _account(sum(_nbytes(t) for t, _ in sends), sum(_nbytes(t) for t, _ in recvs))
        works = dist.batch_isend_irecv(ops)
        per_op = len(works) == len(ops)  # gloo: one work per op; NCCL may coalesce the batch into one
        if sends:  # keep the tensors alive until their sends complete
            self.pending_sends.append((works[: len(sends)] if per_op else works, [t for t, _ in sends]))
        return works[len(sends) :] if per_op else works

    def wait(self, works, what: str) -> None:
        """Wait for ``works``; raises if the step was aborted or ``timeout`` seconds pass first.

        gloo offers no non-blocking completion test for point-to-point work (``is_completed`` stays
        False until ``wait`` returns) and a ``wait`` with a timeout breaks the connection, so a helper
        thread waits while this one watches the abort key and the clock. On an abort or a timeout the
        helper stays blocked on the dead transfer; it is a daemon and ends with the process.
        """
        if not self.polling:
            for work in works:
                work.wait()
            return
        done, errors = threading.Event(), []

        def wait_all():
            try:
                for work in works:
                    work.wait()
            except BaseException as e:  # handed to the waiting thread
                errors.append(e)
            finally:
                done.set()

        threading.Thread(target=wait_all, name="tessel-pipeline-p2p", daemon=True).start()
        deadline = time.monotonic() + self.timeout
        while not done.wait(_POLL_S):
            self._raise_if_aborted(what)
            if time.monotonic() > deadline:
                raise PipelineTimeoutError(
                    f"pipeline: {what} did not complete within {self.timeout:g} s (a peer rank died or stopped "
                    "running the schedule?)"
                )
        if errors:
            raise errors[0]

    def finish(self) -> None:
        """Wait for every send of the step."""
        for works, _ in self.pending_sends:
            self.wait(works, "sending")
        self.pending_sends.clear()

    def abort(self, message: str) -> None:
        """Tell every rank of the group that this step failed (best effort: the store may be gone)."""
        if self._store is not None:
            with contextlib.suppress(Exception):  # the original error matters more than a failed signal
                self._store.set(self._key, message)

    def _raise_if_aborted(self, what: str) -> None:
        if self._store is not None and self._store.check([self._key]):
            message = self._store.get(self._key).decode()
            raise PipelineAbortedError(f"pipeline: stopped waiting for {what}: {message}")


def _default_store():
    """The default process group's key-value store, or None where torch does not expose it."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # without a store the timeout still bounds every wait
        return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
