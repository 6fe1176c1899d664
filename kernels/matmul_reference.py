"""The plain-PyTorch definition of :func:`tessel.kernels.matmul` (and of its scaled fp8 form), which the tests
compare the Triton kernel with and which runs on a CPU when Triton's interpreter is off."""

from __future__ import annotations

import math

import torch

__all__ = ["matmul_reference"]


def _activation_reference(z: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation == "relu":
        return torch.relu(z)
    if activation == "gelu":
        return torch.nn.functional.gelu(z, approximate="none")
    if activation == "silu":
        return torch.nn.functional.silu(z)
    return z


def _activation_grad(z: torch.Tensor, activation: str | None) -> torch.Tensor:
    """d activation / dz, computed in z's dtype (the backward passes fp32)."""
    if activation == "relu":
        return (z > 0).to(z.dtype)
    if activation == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(z * (1.0 / math.sqrt(2.0))))
        pdf = torch.exp(-0.5 * z * z) * (1.0 / math.sqrt(2.0 * math.pi))
        return cdf + z * pdf
    if activation == "silu":
        s = torch.sigmoid(z)
        return s * (1.0 + z * (1.0 - s))
    raise AssertionError(f"no derivative for activation {activation!r}")


def _reference_into(a, b, bias, activation, out, accumulate, preact, scales=None) -> None:
    """What the kernel computes, in fp32: ``scales`` (two one-element fp32 tensors) multiply the product first."""
    z = a.float() @ b.float()
    if scales is not None:
        z = z * (scales[0].float() * scales[1].float())
    if bias is not None:
        z = z + bias.float()
    if preact is not None:
        preact.copy_(z)
    y = _activation_reference(z, activation)
    if accumulate:
        y = y + out.float()
    out.copy_(y)


def matmul_reference(a, b, bias=None, activation=None, out=None, accumulate=False) -> torch.Tensor:
    """Plain-PyTorch definition of :func:`matmul`.

    Computes in fp32 (in float64 when the inputs are float64, which is how tests build their exact
    reference) and rounds once to the output dtype.
    """
    compute = torch.float64 if a.dtype == torch.float64 else torch.float32
    z = a.to(compute) @ b.to(compute)
    if bias is not None:
        z = z + bias.to(compute)
    y = _activation_reference(z, activation)
    if out is None:
        return y.to(a.dtype)
    if accumulate:
        y = y + out.to(compute)
    with torch.no_grad():
        out.copy_(y)
    return out
