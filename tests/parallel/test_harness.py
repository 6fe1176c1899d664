"""Tests of the multi-process harness itself: results, failures, hard exits, timeouts, env:// init."""

import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist

from tests.multiprocess import run_ranks

pytestmark = pytest.mark.multiprocess


def _rank_tensor(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1234 + rank))


def _all_reduce_and_gather(rank, world_size, numel):
    x = _rank_tensor(rank, numel)
    summed = x.clone()
    dist.all_reduce(summed)
    gathered = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(gathered, x)
    return rank, summed, torch.stack(gathered)


def test_two_ranks_all_reduce_and_all_gather():
    numel = 257 * 1024  # ~1 MB per tensor: larger than a pipe buffer, so results must be drained while waiting
    results = run_ranks(_all_reduce_and_gather, 2, numel)
    expected = [_rank_tensor(rank, numel) for rank in range(2)]
    assert [rank for rank, _, _ in results] == [0, 1]
    for _, summed, gathered in results:
        # Two fp32 addends: a + b is commutative, so the gloo sum is bit-identical to the local one.
        torch.testing.assert_close(summed, expected[0] + expected[1], rtol=0, atol=0)
        torch.testing.assert_close(gathered, torch.stack(expected), rtol=0, atol=0)


def _report_identity(rank, world_size):
    env = {key: os.environ[key] for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "TESSEL_TEST_VAR")}
    env["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET")  # inherited from the parent
    time.sleep(0.05 * (world_size - rank))  # finish in reverse rank order
    return rank, world_size, dist.get_rank(), dist.get_world_size(), env


def test_four_ranks_see_rank_world_size_and_env():
    results = run_ranks(_report_identity, 4, env={"TESSEL_TEST_VAR": "set-by-parent"})
    assert "TESSEL_TEST_VAR" not in os.environ
    ports = {env["MASTER_PORT"] for *_, env in results}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for rank, (arg_rank, arg_world, pg_rank, pg_world, env) in enumerate(results):
        assert (arg_rank, arg_world, pg_rank, pg_world) == (rank, 4, rank, 4)
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == "4"
        assert env["TESSEL_TEST_VAR"] == "set-by-parent"
        assert env["TRITON_INTERPRET"] == os.environ.get("TRITON_INTERPRET")


def _rank1_raises(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # never completes: rank 1 does not enter it


def test_failing_rank_reports_traceback_without_waiting_for_timeout():
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_ranks(_rank1_raises, 2, timeout=120)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "rank 1" in message and "ValueError" in message and "boom from rank 1" in message
    assert "_rank1_raises" in message  # the child's traceback, not just the exception
    assert elapsed < 30, f"failure took {elapsed:.1f} s to surface"


def _rank0_never_returns(rank, world_size):
    if rank == 0:
        time.sleep(3600)
    return rank


def test_hung_rank_times_out():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank 0 of 2 did not finish within the timeout of 5 s"):
        run_ranks(_rank0_never_returns, 2, timeout=5, init_process_group=False)
    assert time.monotonic() - start < 5 + 10


def _rank1_hard_exits(rank, world_size, how):
    if rank == 1 and how == "exit":
        os._exit(7)
    if rank == 1 and how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


@pytest.mark.parametrize(
    ("how", "status"), [("exit", "exit code 7"), ("sigkill", "killed by signal SIGKILL (exit code -9)")]
)
def test_hard_exit_is_reported_with_exit_status(how, status):
    expected = f"rank 1 failed:\nprocess exited without reporting a result: {status}"
    with pytest.raises(AssertionError, match=re.escape(expected)):
        run_ranks(_rank1_hard_exits, 2, how, timeout=120)


def _init_from_env(rank, world_size):
    dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def test_child_initialises_process_group_from_env():
    assert run_ranks(_init_from_env, 2, init_process_group=False) == [(0, 2, 3.0), (1, 2, 3.0)]


def _noop(rank, world_size):
    return rank


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"world_size": 0}, ValueError, "world_size must be a positive int, got 0"),
        ({"world_size": "2"}, TypeError, "world_size must be an int, got str"),
        ({"world_size": True}, TypeError, "world_size must be an int, got bool"),
        ({"fn": None}, TypeError, "fn must be a callable, got NoneType"),
        ({"fn": lambda rank, world_size: rank}, TypeError, "fn must be a module-level"),
        ({"timeout": 0}, ValueError, "timeout must be a positive number"),
        ({"timeout": "5"}, TypeError, "timeout must be a number of seconds, got str"),
    ],
)
def test_arguments_are_validated(kwargs, error, match):
    call = {"fn": _noop, "world_size": 2, **kwargs}
    timeout = call.pop("timeout", 120.0)
    with pytest.raises(error, match=match):
        run_ranks(call["fn"], call["world_size"], timeout=timeout)


def _how_started(rank, world_size):
    import sys

    preloaded = "tessel.kernels._dispatch" in sys.modules  # before this function imports anything of tessel
    from tessel.kernels._dispatch import backend_for

    return preloaded, backend_for(torch.zeros(1)), os.environ.get("TRITON_INTERPRET"), torch.get_num_threads()


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA every rank is spawned")
def test_ranks_are_forked_from_a_server_that_imported_tessel_and_may_ask_for_the_reference_kernels():
    """Without CUDA the ranks start from the fork server, tessel already imported; ``REFERENCE_KERNELS`` switches
    their kernel dispatch to the PyTorch references (and the environment says so); either way one thread each.
    A variable read at import time that the server cannot honour (here MKL_NUM_THREADS) makes fresh processes."""
    from tests.multiprocess import REFERENCE_KERNELS

    interpreter = "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "reference"
    assert run_ranks(_how_started, 2) == [(True, interpreter, os.environ.get("TRITON_INTERPRET", "0"), 1)] * 2
    assert run_ranks(_how_started, 2, env=REFERENCE_KERNELS) == [(True, "reference", "0", 1)] * 2
    spawned = run_ranks(_how_started, 2, env={**REFERENCE_KERNELS, "MKL_NUM_THREADS": "1"})
    assert spawned == [(False, "reference", "0", 1)] * 2
