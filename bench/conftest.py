"""pytest configuration for ``pytest bench --benchmark-only``; runs before any module imports Triton."""

import os

import torch

# Without a GPU the kernels run through Triton's interpreter, as in ``python -m tessel.bench``. Triton
# reads the flag when a kernel is defined, so it must be set before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_report_header(config):
    """State up front where the timings come from."""
    if torch.cuda.is_available():
        return f"tessel bench: {torch.cuda.get_device_name()}"
    runner = "Triton's interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "the PyTorch reference"
    return f"tessel bench: no GPU: timings come from {runner} on a CPU and are not performance numbers"
