"""Run a function on several ranks, each in a freshly spawned process, over gloo.

Example::

    def _sum_ranks(rank, world_size, scale):
        t = torch.tensor([scale * rank])
        dist.all_reduce(t)
        return t

    @pytest.mark.multiprocess
    def test_sum_ranks():
        assert [t.item() for t in run_ranks(_sum_ranks, 2, 3.0)] == [3.0, 3.0]

``fn(rank, world_size, *args)`` must be a module-level function: processes are started with the "spawn"
method (fork is unsafe once torch has started its threads), which imports ``fn`` by name in each child.
Its arguments and return value must be picklable; return small, detached tensors.

Ranks are forked from a server process that has imported torch and tessel once (multiprocessing's
"forkserver" start method, started with one intra-op thread and the parent's ``TRITON_INTERPRET``), so a rank
starts in a fraction of a second instead of paying for those imports; each rank is still a fresh process whose
state no other test has touched. A call whose ``env`` changes a variable that torch, Triton or tessel read at
import time (``IMPORT_TIME_VARIABLES``) spawns fresh interpreters instead, except ``TRITON_INTERPRET=0`` under
a server that imported tessel with the interpreter: those ranks switch tessel's kernel dispatch to the PyTorch
references (the only import-time decision that can be taken back, since no kernel has been launched). With
CUDA present every rank is spawned: a process forked after torch has touched the driver cannot use it.

Rendezvous goes through a ``TCPStore`` that the parent opens on a port chosen by the OS, so concurrent
runs never race for a port. Each child also sees the torchrun variables (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) for code that initialises itself from the environment.

A failure in any rank raises ``AssertionError`` with each failed rank's traceback or exit status within
about a second; the other ranks, usually blocked in a collective, are killed. Every child ends with
``os._exit``: a gloo process can abort at interpreter exit even after ``destroy_process_group()``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing import forkserver
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist

from tests import _interpreter

__all__ = ["IMPORT_TIME_VARIABLES", "REFERENCE_KERNELS", "run_ranks"]

_HOST = "127.0.0.1"
_FAILURE_GRACE_S = 1.0  # after the first failure, wait this long for the others' tracebacks, then kill them
_KILL_GRACE_S = 3.0  # between SIGTERM and SIGKILL
# What the fork server imports, so that every rank finds them imported (modules that fail to import are skipped).
_PRELOAD = ["torch", "torch.distributed", "numpy", "tessel.kernels", "tessel.layers", "tessel.parallel"] + [
    # the main job's loop (with torch.distributed.checkpoint), its progress bar and its plot's backend
    "tessel.bench.train_loop", "tests._interpreter", "tqdm", "matplotlib.figure", "matplotlib.backends.backend_agg",
] + [
    f"transformers.models.{family}.modeling_{family}"  # the Hugging Face families tests/layers parallelizes
    for family in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "mixtral", "qwen2_moe", "qwen3_moe",
                   "gpt_oss", "deepseek_v2", "deepseek_v3", "glm4_moe", "jamba", "llama4", "qwen3_next")
]  # fmt: skip
# Read once when torch, Triton or tessel is imported: a rank forked from the server could not see a change.
IMPORT_TIME_VARIABLES = ("TRITON_INTERPRET", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCH_DISTRIBUTED_DEBUG")
# One intra-op thread per rank: several ranks share the cores, and oversubscribed OpenMP threads spin-wait each
# other out (a 64×64 matmul slows down ~50× on 2 cores with 2 ranks of 2 threads).
_RANK_THREADS = {"OMP_NUM_THREADS": "1"}
# ``env=`` for ranks that run tessel's kernels as their plain-PyTorch references instead of through Triton's
# interpreter: for tests of how layers and parallel algorithms compose, where the kernels are only the means
# (tests/kernels proves each kernel against float64 and against its reference, argument for argument).
REFERENCE_KERNELS = {"TRITON_INTERPRET": "0"}
_server_env: dict[str, str | None] | None = None  # the import-time variables the fork server started with


@dataclass
class _Rank:
    rank: int
    process: mp.process.BaseProcess
    conn: Connection  # parent's read end; the child sends exactly one pickled (status, value) message
    reported: bool = False


def run_ranks(
    fn,
    world_size: int,
    *args,
    timeout: float = 120.0,
    backend: str = "gloo",
    init_process_group: bool = True,
    env: dict[str, str] | None = None,
) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return their results in rank order.

    With ``init_process_group=True`` each child joins the default process group on ``backend`` before
    calling ``fn``. ``env`` adds to (or overrides) the environment the children start with. Raises
    ``AssertionError`` if a rank raises, dies, or not all ranks finish within ``timeout`` seconds.
    """
    _check_args(fn, world_size, timeout)
    store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False) if init_process_group else None
    base_env = {"WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": _HOST}
    base_env["MASTER_PORT"] = str(_free_port())
    base_env.update(_RANK_THREADS)
    store_port = store.port if store else None
    ctx = _context({**base_env, **(env or {})})
    ranks: list[_Rank] = []
    try:
        for rank in range(world_size):
            child_env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank), **(env or {})}
            ranks.append(_start_rank(ctx, fn, rank, world_size, args, backend, store_port, child_env))
        results, failures, unfinished = _collect(ranks, timeout)
    finally:
        _stop(ranks)
    failures.update(_bad_exits(ranks, results))
    _raise_on_failure(failures, unfinished, world_size, timeout)
    return [results[rank] for rank in range(world_size)]


def _check_args(fn, world_size, timeout) -> None:
    if not callable(fn):
        raise TypeError(f"run_ranks: fn must be a callable, got {type(fn).__name__}")
    try:
        pickle.dumps(fn)
    except Exception as e:
        raise TypeError(f"run_ranks: fn must be a module-level (picklable) function, got {fn!r}: {e}") from e
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"run_ranks: world_size must be an int, got {type(world_size).__name__} {world_size!r}")
    if world_size < 1:
        raise ValueError(f"run_ranks: world_size must be a positive int, got {world_size}")
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(f"run_ranks: timeout must be a number of seconds, got {type(timeout).__name__}")
    if not timeout > 0:
        raise ValueError(f"run_ranks: timeout must be a positive number of seconds, got {timeout!r}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_HOST, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _environ(overrides: dict[str, str]):
    """Set variables in this process while a child is started; the child copies the environment at exec."""
    saved = {key: os.environ.get(key) for key in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _import_time(env: dict[str, str | None], *, interpret: str | None = None) -> dict[str, str | None]:
    values = {key: env.get(key) for key in IMPORT_TIME_VARIABLES}
    values["TRITON_INTERPRET"] = interpret or ("1" if values["TRITON_INTERPRET"] == "1" else "0")
    return values


def _context(child_env: dict[str, str]):
    """The fork server's context when the ranks' import-time variables are the server's (or differ only in
    asking for the reference kernels), else "spawn"."""
    global _server_env
    if torch.cuda.is_available():
        return mp.get_context("spawn")
    wanted = _import_time({**os.environ, **child_env})
    if _server_env is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        with _environ(_RANK_THREADS):  # the server's environment is this process's, when it starts
            forkserver.ensure_running()
            _server_env = _import_time(dict(os.environ))
    forked = wanted in (_server_env, _import_time(_server_env, interpret="0"))
    return mp.get_context("forkserver" if forked else "spawn")


def _start_rank(ctx, fn, rank, world_size, args, backend, store_port, child_env) -> _Rank:
    # A spawned rank sees the environment from its start, so variables read when torch is imported take
    # effect; a forked one has the server's, so the child also applies ``child_env`` before anything else.
    reader, writer = ctx.Pipe(duplex=False)
    child_args = (fn, rank, world_size, args, backend, store_port, child_env, writer)
    process = ctx.Process(target=_rank_main, args=child_args, name=f"rank{rank}", daemon=True)
    with _environ(child_env):
        process.start()
    writer.close()  # the child holds the only write end, so its exit shows as EOF here
    return _Rank(rank, process, reader)


# ----------------------------------------------------------------------------------------------- child


def _rank_main(fn, rank, world_size, args, backend, store_port, child_env, conn: Connection) -> None:
    os.environ.update(child_env)
    dispatch = sys.modules.get("tessel.kernels._dispatch")  # imported already: forked from the server
    if dispatch is not None and child_env.get("TRITON_INTERPRET") == "0":
        dispatch.INTERPRET = False
    if os.environ.get("TRITON_INTERPRET") == "1":
        _interpreter.install()  # as in the test process (tests/conftest.py)
    try:
        message, status = ("ok", _run_fn(fn, rank, world_size, args, backend, store_port)), 0
    except BaseException:
        message, status = ("error", traceback.format_exc()), 1
    try:
        # Plain pickle copies tensors by value. Connection.send would use torch's shared-memory reducers,
        # whose file descriptors the parent fetches from this process after it has already exited.
        data = pickle.dumps(message)
    except Exception:
        data, status = pickle.dumps(("error", "result could not be pickled:\n" + traceback.format_exc())), 1
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send_bytes(data)
    conn.close()
    os._exit(status)


def _run_fn(fn, rank, world_size, args, backend, store_port):
    if store_port is not None:
        store = dist.TCPStore(_HOST, store_port, world_size, is_master=False)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        del store
    result = fn(rank, world_size, *args)
    if dist.is_initialized():  # also when fn joined a group itself
        dist.barrier()
        dist.destroy_process_group()
    return result


# ---------------------------------------------------------------------------------------------- parent


def _collect(ranks: list[_Rank], timeout: float):
    """Wait for one message or exit per rank; stop early, after a short grace, once a rank has failed."""
    results, failures = {}, {}
    pending = {r.rank: r for r in ranks}
    deadline = time.monotonic() + timeout
    while pending and (remaining := deadline - time.monotonic()) > 0:
        waitables = {obj: r for r in pending.values() for obj in (r.conn, r.process.sentinel)}
        for obj in wait(list(waitables), remaining):
            r = waitables[obj]
            outcome = _read_outcome(r) if r.rank in pending else None
            if outcome is None:
                continue
            del pending[r.rank]
            r.reported = True
            (results if outcome[0] == "ok" else failures)[r.rank] = outcome[1]
        if failures:
            deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
    return results, failures, sorted(pending)


def _read_outcome(r: _Rank):
    """The rank's (status, value) message, an error if it exited without one, or None if still running."""
    if r.conn.poll():
        with contextlib.suppress(EOFError):
            return pickle.loads(r.conn.recv_bytes())
    r.process.join(0.5)  # the sentinel can fire slightly before the exit status is available
    if r.process.exitcode is None:
        return None
    status = _describe_exit(r.process.exitcode)
    return "error", f"process exited without reporting a result: {status} (its stderr may say more)"


def _describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by signal {signal.Signals(-code).name} (exit code {code})"
    return f"exit code {code}"


def _stop(ranks: list[_Rank]) -> None:
    """Terminate what is still running, SIGKILL what survives the grace period, reap everything."""
    for r in ranks:
        if not r.reported and r.process.is_alive():
            r.process.terminate()
    deadline = time.monotonic() + _KILL_GRACE_S
    for r in ranks:
        r.process.join(max(0.0, deadline - time.monotonic()))
        if r.process.is_alive():
            r.process.kill()
            r.process.join()
        r.conn.close()


def _bad_exits(ranks: list[_Rank], results: dict) -> dict[int, str]:
    """Ranks that returned a result but then did not exit with status 0."""
    return {
        r.rank: f"returned a result but then exited abnormally: {_describe_exit(r.process.exitcode)}"
        for r in ranks
        if r.rank in results and r.process.exitcode != 0
    }


def _raise_on_failure(failures: dict[int, str], unfinished: list[int], world_size: int, timeout: float) -> None:
    if failures:
        parts = [f"----- rank {rank} failed:\n{text}" for rank, text in failures.items()]
        if unfinished:
            parts.append(f"still running and killed after the failure: {_ranks(unfinished)}")
        raise AssertionError(f"run_ranks: {len(failures)} of {world_size} ranks failed\n" + "\n".join(parts))
    if unfinished:
        raise AssertionError(
            f"run_ranks: {_ranks(unfinished)} of {world_size} did not finish within the timeout of "
            f"{timeout:g} s and were killed (a collective that not every rank entered?)"
        )


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
