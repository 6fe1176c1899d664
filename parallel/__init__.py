"""Process groups, collectives, communication/GEMM overlap, DDP, FSDP, ZeRO (pipeline: ``tessel.parallel.pipeline``)."""

from .comm import ByteCounter, EventLog, count_bytes, record_events
from .context import gather_sequence, ring_attention, split_sequence, zigzag_order, zigzag_positions
from .context_heads import heads_to_sequence, sequence_to_heads
from .context_shared import shared_keys_attention
from .ddp import DDP
from .dims import ParallelDims, init_parallel, shutdown
from .fsdp import FSDP
from .memory import MemoryAccount, memory_account, zero_memory_bytes, zero_traffic_bytes
from .overlap import all_gather_matmul, matmul_all_reduce, matmul_grad_all_reduce, matmul_reduce_scatter
from .peer import (
    PeerAllGather,
    PeerBuffer,
    PeerReduceScatter,
    peer_all_gather_matmul,
    peer_matmul_reduce_scatter,
    release_transports,
)
from .zero import ZeroAdam

__all__ = [
    "DDP",
    "FSDP",
    "ByteCounter",
    "EventLog",
    "MemoryAccount",
    "ParallelDims",
    "PeerAllGather",
    "PeerBuffer",
    "PeerReduceScatter",
    "ZeroAdam",
    "all_gather_matmul",
    "count_bytes",
    "gather_sequence",
    "heads_to_sequence",
    "init_parallel",
    "matmul_all_reduce",
    "matmul_grad_all_reduce",
    "matmul_reduce_scatter",
    "memory_account",
    "peer_all_gather_matmul",
    "peer_matmul_reduce_scatter",
    "record_events",
    "release_transports",
    "ring_attention",
    "sequence_to_heads",
    "shared_keys_attention",
    "shutdown",
    "split_sequence",
    "zero_memory_bytes",
    "zero_traffic_bytes",
    "zigzag_order",
    "zigzag_positions",
]
