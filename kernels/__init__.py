"""Triton kernels with host launchers and a plain-PyTorch reference for each."""

from .matmul import ACTIVATIONS, matmul, matmul_reference

__all__ = ["ACTIVATIONS", "matmul", "matmul_reference"]
