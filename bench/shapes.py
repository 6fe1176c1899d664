"""Shape tables shared by the benchmark CLI (``python -m tessel.bench``) and ``pytest bench``.

GEMM shapes are ``(M, N, K)`` for ``out[M, N] = a[M, K] @ b[K, N]``. The core GPU shapes are the
projections of one Llama-3-70B layer (hidden 8192, MLP 28672, 64 query heads and 8 KV heads of 128)
at tensor-parallel size 8 with 8192 tokens per rank; rows marked ``extra`` are smaller shapes that
show how the kernel scales down. The CPU table holds small, odd shapes: on a CPU the kernels run
through Triton's interpreter, where a 256³ GEMM already costs about a second.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MATMUL_SHAPES_CPU", "MATMUL_SHAPES_GPU", "MatmulShape", "matmul_shapes", "select_shapes"]


@dataclass(frozen=True)
class MatmulShape:
    """One GEMM ``a[M, K] @ b[K, N]`` with a short label; ``extra`` shapes are left out of ``--quick``."""

    label: str
    m: int
    n: int
    k: int
    extra: bool = False

    @property
    def flops(self) -> int:
        """Multiply-adds counted as two operations: ``2·M·N·K``."""
        return 2 * self.m * self.n * self.k

    @property
    def name(self) -> str:
        return f"{self.label} {self.m}x{self.n}x{self.k}"


# Llama-3-70B at TP=8: QKV is (64 + 2·8)·128 / 8 = 1280 columns, the attention output projection
# reads 8192 / 8 = 1024 inputs, gate+up is 2·28672 / 8 = 7168 columns, down reads 28672 / 8 = 3584.
MATMUL_SHAPES_GPU: tuple[MatmulShape, ...] = (
    MatmulShape("square-8k", 8192, 8192, 8192),
    MatmulShape("attn-qkv", 8192, 1280, 8192),
    MatmulShape("attn-out", 8192, 8192, 1024),
    MatmulShape("mlp-gate-up", 8192, 7168, 8192),
    MatmulShape("mlp-down", 8192, 8192, 3584),
    MatmulShape("square-4k", 4096, 4096, 4096, extra=True),
    MatmulShape("square-2k", 2048, 2048, 2048, extra=True),
    MatmulShape("decode-m16", 16, 7168, 8192, extra=True),
)

# Not multiples of the interpreter's 32-wide blocks, so edge tiles and the K tail are exercised.
MATMUL_SHAPES_CPU: tuple[MatmulShape, ...] = (
    MatmulShape("cube-128", 128, 128, 128),
    MatmulShape("odd", 37, 53, 29),
    MatmulShape("rect", 256, 96, 160, extra=True),
)


def select_shapes(gpu: tuple, cpu: tuple, cuda: bool, quick: bool = False) -> tuple:
    """A suite's ``gpu`` or ``cpu`` table of shapes (each with an ``extra`` flag); with ``quick`` only the
    core (non-extra) ones."""
    return tuple(s for s in (gpu if cuda else cpu) if not (quick and s.extra))


def matmul_shapes(cuda: bool, quick: bool = False) -> tuple[MatmulShape, ...]:
    """The GPU or CPU table; with ``quick`` only its core (non-extra) shapes."""
    return select_shapes(MATMUL_SHAPES_GPU, MATMUL_SHAPES_CPU, cuda, quick)
