"""The pipeline tests run tiny tensors: one intra-op thread each.

On a busy 2-core machine torch's default pool of two threads spends ~50 ms handing each 19×19 GEMM to
its other thread, against ~5 µs on one thread; the multi-rank tests pass OMP_NUM_THREADS=1 to their
processes for the same reason.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
