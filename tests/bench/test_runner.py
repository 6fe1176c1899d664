"""The timing helpers every suite shares: what they return on a CPU, and how they refuse bad arguments."""

import pytest
import torch

from tessel.bench.runner import capture_graph, graph_time, host_time, time_fn

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answers")


@cpu_only
def test_time_fn_runs_the_warm_up_and_each_rep_on_a_cpu():
    calls = []
    ms = time_fn(lambda: calls.append(1), reps=4)
    assert len(calls) == 5 and ms >= 0.0


@cpu_only
def test_host_and_graph_times_are_none_on_a_cpu():
    calls = []
    assert host_time(lambda: calls.append(1), calls=3) is None
    assert graph_time(lambda: calls.append(1), label="noop") is None
    assert calls == []  # nothing ran: there is no device to time


@pytest.mark.parametrize("helper", [time_fn, host_time, graph_time, capture_graph])
@pytest.mark.parametrize("fn", [None, 3, "fn"])
def test_a_fn_that_is_not_callable_is_refused_naming_it(helper, fn):
    with pytest.raises(TypeError, match=rf"{helper.__name__}: fn must be a callable .* received {type(fn).__name__}"):
        helper(fn)


@pytest.mark.parametrize(
    ("helper", "arg", "value", "error", "received"),
    [
        (time_fn, "reps", 0, ValueError, "0"),
        (time_fn, "reps", -2, ValueError, "-2"),
        (time_fn, "reps", 2.0, TypeError, "float"),
        (time_fn, "reps", True, TypeError, "bool"),
        (host_time, "calls", 0, ValueError, "0"),
        (host_time, "calls", "50", TypeError, "str"),
    ],
)
def test_a_count_that_is_not_a_positive_int_is_refused_naming_it(helper, arg, value, error, received):
    calls = []
    with pytest.raises(error, match=rf"{helper.__name__}: {arg} must be a positive int, received {received}$"):
        helper(lambda: calls.append(1), **{arg: value})
    assert calls == []  # refused before anything ran


def test_time_fn_refuses_a_cuda_flag_that_is_not_a_bool():
    with pytest.raises(TypeError, match="time_fn: cuda must be a bool or None, received str"):
        time_fn(lambda: None, cuda="yes")


def test_graph_time_refuses_a_label_that_is_not_a_str():
    with pytest.raises(TypeError, match="graph_time: label must be a str, received int"):
        graph_time(lambda: None, label=3)
