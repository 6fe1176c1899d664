"""Small models for the pipeline tests: a chain of stages, each a Linear + GELU, and a deferring linear.

A stage takes ``(h, aux)``: ``h [B, T, H]`` float, ``aux [B, T, 1]`` int64 carried along unchanged, so
every boundary carries two tensors, one without a gradient. The first stage takes the schedule's two
inputs, the last returns ``[B, T, C]`` for the loss. The same seed builds the same weights on every
rank, so each rank can cut its stages out of a full model and the test can rebuild the full model.
"""

import torch
from torch import nn

from tessel.parallel.pipeline.weight_grad import is_deferring, submit

HIDDEN, CLASSES, TOKENS = 19, 5, 3
DEFERRED_RUNS = [0]  # weight-gradient closures of DeferredLinear run so far in this process


class DeferredLinearFunction(torch.autograd.Function):
    """``y = x Wᵀ + b``; while deferring, the weight gradient is submitted as a closure instead of returned."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight, bias)
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias = ctx.saved_tensors
        x2, g2 = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_out @ weight
        if not is_deferring():
            return grad_x, g2.t() @ x2, g2.sum(0)

        def weight_grad():
            DEFERRED_RUNS[0] += 1
            for param, grad in ((weight, g2.t() @ x2), (bias, g2.sum(0))):
                param.grad = grad if param.grad is None else param.grad + grad

        submit(weight_grad)
        return grad_x, None, None


class DeferredLinear(nn.Linear):
    def forward(self, x):
        return DeferredLinearFunction.apply(x, self.weight, self.bias)


class Stage(nn.Module):
    def __init__(self, width_in: int, width_out: int, last: bool, deferred: bool):
        super().__init__()
        self.linear = (DeferredLinear if deferred else nn.Linear)(width_in, width_out)
        self.last = last

    def forward(self, h, aux):
        y = self.linear(h)
        if self.last:
            return y
        return torch.nn.functional.gelu(y) + 0.1 * aux, aux


class FailingStage(nn.Module):
    """Wraps a stage; its forward raises ``RuntimeError`` on call number ``fail_at`` (counting from 0)."""

    def __init__(self, stage: nn.Module, fail_at: int):
        super().__init__()
        self.stage, self.fail_at, self.calls = stage, fail_at, 0

    def forward(self, *args):
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            raise RuntimeError(f"injected failure in forward call {self.fail_at}")
        return self.stage(*args)


def build_stages(num_stages: int, deferred: bool = False, seed: int = 0) -> list[Stage]:
    torch.manual_seed(seed)
    return [
        Stage(HIDDEN, CLASSES if s == num_stages - 1 else HIDDEN, s == num_stages - 1, deferred)
        for s in range(num_stages)
    ]


def make_batch(batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, TOKENS, HIDDEN, generator=g)
    aux = torch.randint(0, 3, (batch, TOKENS, 1), generator=g)
    target = torch.randn(batch, TOKENS, CLASSES, generator=g)
    return x, aux, target


def loss_fn(out, target):
    return torch.nn.functional.mse_loss(out, target)


def reference(stages: list[Stage], x, aux, target, n_microbatches: int):
    """Unpipelined: the whole chain on each microbatch, loss = mean of the microbatch losses; grads by name."""
    losses = []
    for xm, am, tm in zip(x.chunk(n_microbatches), aux.chunk(n_microbatches), target.chunk(n_microbatches)):
        h, a = xm, am
        for stage in stages[:-1]:
            h, a = stage(h, a)
        losses.append(loss_fn(stages[-1](h, a), tm))
    torch.stack(losses).mean().backward()
    grads = {f"{s}.{n}": p.grad.clone() for s, st in enumerate(stages) for n, p in st.named_parameters()}
    return torch.stack(losses).detach(), grads
