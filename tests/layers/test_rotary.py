"""Rotary embeddings against a float64 complex-number reference, and their tables' offsets and errors."""

import pytest
import torch

from tessel.layers.rotary import apply_rotary, rotary_tables


def _reference(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Dims i and i + D/2 as one complex number, multiplied by e^{i·pos·θ^(-2i/D)} (RoFormer eq. 34)."""
    d = x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    rot = torch.polar(torch.ones(len(positions), d // 2, dtype=torch.float64), torch.outer(positions.double(), freq))
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double()) * rot
    return torch.cat((z.real, z.imag), dim=-1)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float16, 1e-3)])  # fp16: output rounding
@pytest.mark.parametrize("head_dim", [8, 64])
def test_rotation_matches_the_complex_reference(seed, dtype, tol, head_dim):
    x = torch.randn(2, 3, 11, head_dim).to(dtype)
    cos, sin = rotary_tables(11, head_dim, 500.0, offset=5)
    got = apply_rotary(x, cos, sin)
    assert got.dtype == dtype and got.shape == x.shape
    want = _reference(x, torch.arange(5, 16), 500.0)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    # a rotation keeps each pair's norm
    torch.testing.assert_close(got.float().norm(dim=-1), x.float().norm(dim=-1), rtol=tol * 4, atol=tol * 4)


def test_offset_tables_are_slices_of_longer_ones():
    cos, sin = rotary_tables(20, 16)
    cos_off, sin_off = rotary_tables(6, 16, offset=9)
    torch.testing.assert_close(cos_off, cos[9:15], rtol=0, atol=0)
    torch.testing.assert_close(sin_off, sin[9:15], rtol=0, atol=0)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: (torch.zeros(2, 3, 4), *rotary_tables(3, 4)), ValueError, r"\[B, H, S, D\] with an even D"),
        (lambda: (torch.zeros(1, 1, 4, 8), *rotary_tables(5, 8)), ValueError, r"cos must be \[S, D/2\] = \[4, 4\]"),
        (lambda: (torch.zeros(1, 1, 4, 8), rotary_tables(4, 8)[0], torch.zeros(4, 3)), ValueError, "sin must be"),
        (lambda: (torch.zeros(1, 1, 4, 8), [0.0], [0.0]), TypeError, "must be tensors"),
    ],
)
def test_bad_inputs_are_refused(make, error, match):
    with pytest.raises(error, match=match):
        apply_rotary(*make())
    with pytest.raises(ValueError, match="head_dim must be even"):
        rotary_tables(4, 7)


def test_tables_at_given_positions_are_rows_of_the_contiguous_table():
    """Context parallelism rotates a rank's tokens by their global (non-contiguous) positions."""
    cos, sin = rotary_tables(12, 8)
    positions = torch.tensor([0, 1, 2, 9, 10, 11])
    cos_p, sin_p = rotary_tables(6, 8, positions=positions)
    assert torch.equal(cos_p, cos[positions]) and torch.equal(sin_p, sin[positions])


@pytest.mark.parametrize("positions", [torch.arange(5), torch.arange(6.0), [0, 1, 2, 3, 4, 5]])
def test_bad_positions_are_refused(positions):
    with pytest.raises(ValueError, match=r"positions must be an int tensor of shape \(6,\)"):
        rotary_tables(6, 8, positions=positions)
