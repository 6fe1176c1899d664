"""Process groups, collectives, communication/GEMM overlap (and, to come: DDP, FSDP, ZeRO, pipeline)."""

from .comm import ByteCounter, EventLog, count_bytes, record_events
from .dims import ParallelDims, init_parallel, shutdown
from .overlap import all_gather_matmul, matmul_all_reduce, matmul_grad_all_reduce, matmul_reduce_scatter

__all__ = [
    "ByteCounter",
    "EventLog",
    "ParallelDims",
    "all_gather_matmul",
    "count_bytes",
    "init_parallel",
    "matmul_all_reduce",
    "matmul_grad_all_reduce",
    "matmul_reduce_scatter",
    "record_events",
    "shutdown",
]
