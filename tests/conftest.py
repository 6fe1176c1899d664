"""Shared fixtures. Runs before any test module imports Triton."""

import os

import torch

# Without a GPU every Triton kernel runs through Triton's interpreter. Triton reads the flag when a
# kernel is defined, so it must be set before anything imports triton (i.e. before tessel).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from tests._interpreter import install as _install_interpreter_patch

if os.environ.get("TRITON_INTERPRET") == "1":
    _install_interpreter_patch()  # a third of the interpreter's time, spent re-patching triton.language

HAS_CUDA = torch.cuda.is_available()

# Under pytest-xdist the workers share the cores: each keeps its share of intra-op threads, since OpenMP threads
# that outnumber the cores spin-wait each other out.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture
def seed():
    """Seeds torch's CPU and CUDA generators; each test that draws random data takes it."""
    torch.manual_seed(1234)
    return 1234


@pytest.fixture
def reference_kernels(monkeypatch):
    """tessel's kernels run as their plain-PyTorch references for the whole test instead of through Triton's
    interpreter (CPU tensors only; CUDA tensors still run compiled Triton). For tests of how a model composes,
    where the kernels are only the means: tests/kernels proves each kernel against float64 and its reference."""
    from tessel.kernels import _dispatch

    monkeypatch.setattr(_dispatch, "INTERPRET", False)


@pytest.fixture
def attention_launches(monkeypatch):
    """The ``(kernel name, ATOMIC_DQ)`` of every flash attention launch that goes through ``_launch``
    (the forward and the backward's dK/dV and dQ kernels), in order, for the whole test."""
    import tessel.kernels.attention as attention_module

    seen = []
    launch = attention_module._launch

    def record(kernel, tuned, blocks, backend, program_rows, rows, bh, args, flags):
        seen.append((kernel.__name__, flags.get("ATOMIC_DQ")))
        return launch(kernel, tuned, blocks, backend, program_rows, rows, bh, args, flags)

    monkeypatch.setattr(attention_module, "_launch", record)
    return seen


# Tests that keep every core busy for minutes (the sm_90 compile runs a process per core) run first: under
# pytest-xdist's work stealing a worker that reaches one late runs it alone while the others have finished.
FIRST = ("tests/kernels/test_sm90_compile.py",)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST))  # stable: the rest keep their order
