"""Where kernels run, and the interpreter versions tessel refuses with a clear message."""

import numpy
import pytest
import torch
import triton

from tessel.kernels import _dispatch
from tessel.kernels._dispatch import Backend, backend_for, check_interpreter


def test_cpu_tensors_take_the_interpreter_or_the_reference():
    expected = Backend.INTERPRETER if _dispatch.INTERPRET else Backend.REFERENCE
    assert backend_for(torch.zeros(2)) == expected


def test_the_installed_triton_and_numpy_pass_the_check():
    check_interpreter(triton.__version__, numpy.__version__)


@pytest.mark.parametrize(
    "triton_version, numpy_version",
    [("3.6.0", "2.4.0"), ("3.6.0", "2.4.6"), ("3.5.1", "2.5.0"), ("3.6.0+git1234", "2.4.0rc1")],
)
def test_triton_3_6_interpreter_with_numpy_2_4_is_refused_with_the_fix(triton_version, numpy_version):
    with pytest.raises(RuntimeError, match=r"NumPy < 2\.4 or Triton >= 3\.7") as info:
        check_interpreter(triton_version, numpy_version)
    assert triton_version in str(info.value) and numpy_version in str(info.value)


@pytest.mark.parametrize(
    "triton_version, numpy_version",
    [("3.6.0", "2.3.5"), ("3.6.0", "1.26.4"), ("3.7.0", "2.4.6"), ("3.9.0", "2.4.6"), ("4.0.0", "3.0.0")],
)
def test_compatible_versions_pass(triton_version, numpy_version):
    check_interpreter(triton_version, numpy_version)


def test_an_incompatible_interpreter_fails_before_any_kernel_runs(monkeypatch):
    monkeypatch.setattr(_dispatch, "INTERPRET", True)
    monkeypatch.setattr(_dispatch.triton, "__version__", "3.6.0")
    monkeypatch.setattr(_dispatch.numpy, "__version__", "2.4.0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        backend_for(torch.zeros(2))


def test_host_arithmetic_matches_triton():
    """The launchers' cdiv and next_power_of_2 (plain Python: Triton's are constexpr functions, microseconds
    per host call) agree with Triton's everywhere a launcher can call them."""
    import triton

    from tessel.kernels._dispatch import cdiv, next_power_of_2

    values = [*range(0, 4100), 2**31 - 1, 2**31, 2**31 + 1, 2**40 + 3]
    for n in values:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 64, 128, 1000):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
