"""The small models, batches and loss shared by the DDP / ZeRO / FSDP / memory tests."""

import torch
from torch import nn

BATCH = 6


class Block(nn.Module):
    """A residual GELU MLP block, the unit the FSDP tests wrap."""

    def __init__(self, h):
        super().__init__()
        self.fc, self.proj = nn.Linear(h, 2 * h + 1), nn.Linear(2 * h + 1, h)

    def forward(self, x):
        return x + self.proj(torch.nn.functional.gelu(self.fc(x)))


def batch(step, dtype=torch.float32):
    """Step ``step``'s inputs ``[BATCH, 7]`` and targets ``[BATCH, 5]``, the same on every rank."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 7, generator=g).to(dtype), torch.randn(BATCH, 5, generator=g).to(dtype)


def probe(dtype=torch.float32):
    """A fixed input on which trained models' outputs are compared."""
    return torch.randn(4, 7, generator=torch.Generator().manual_seed(7)).to(dtype)


def mse(model, x, y):
    return (model(x) - y).float().pow(2).mean()
