"""Column/row-parallel linear layers with ``fp8=True`` on 2 and 4 gloo ranks, forward and backward.

fp8 quantises each tensor with one power-of-two scale from its own largest magnitude, so a tensor-parallel layer
is *not* the dense fp8 layer split up: every rank quantises its own weight shard (and, in the backward of the
column layer, its own columns of the output gradient), each with its own scale. The exact expectation is therefore
an emulation in one process: on every rank, loop over all ``t`` shards of the dense weight, call ``fp8_linear``
(no process group involved) on the inputs rank ``r`` sees, and apply the collectives by hand:

- column: output = ``fp8_linear(x, W_r, b_r)`` (all tokens; the layer gathers the sequence under sequence
  parallelism); input gradient = ``Σ_r`` of each shard's input gradient for ``dY_r`` (the upstream gradient's
  columns of rank ``r``), this rank's sequence block under sequence parallelism; weight and bias gradients: own.
- row: output = ``Σ_r fp8_linear(x[..., cols_r], W[:, cols_r]) + b`` (this rank's sequence block under sequence
  parallelism); input gradient: own columns; weight gradient: own shard; bias gradient: ``Σ dY`` over all tokens.

The emulation feeds ``fp8_linear`` the rows in the order the layer does (token-major ``(s, b)`` under sequence
parallelism), so every GEMM is the layer's own, bit for bit; what differs is only how the ranks' partial results
are summed: gloo adds partials already rounded to the parameter dtype, in its own order and precision, while the
emulation adds the same partials in float64. Tolerances (relative, plus the same fraction of the tensor's largest
magnitude for entries that cancel): fp32 1e-5 (the ranks' partials, the row layer's bias and its gradient's sum
over tokens are added in fp32, each addition rounding by 2⁻²⁴; measured ≤ 7e-8, and 0 for the column layer's
input gradient, whose partials, products of fp8 values, have so few bits that fp32 adds them exactly); bf16
1.6e-2 = 2⁻⁶, two bf16 ulps (bf16 keeps 8 bits, so each of the ``t - 1`` additions across ranks, and the row
layer's bias addition, rounds by up to 2⁻⁹ ≈ 2e-3 of the running sum: ≤ 7.8e-3 at t=4; measured ≤ 7.5e-3).
The GEMMs themselves are exact up to fp32 accumulation, so any difference in quantisation (a scale, a format, an
operand) moves entries by a fraction of an fp8 step, 2⁻⁴ (e4m3) to 2⁻³ (e5m2) relative: far outside these.

Scales are powers of two and fp8 is a floating-point format, so a scale shared by all shards would round every
value exactly as its own scale does, except where it pushes a shard's values into e4m3's subnormals (or, larger
than its own, past the largest value). The data therefore make the weight's shards differ in magnitude by up to
2¹⁶ from rank to rank (``SHARD_SCALES``; compensated in the other operand, so every partial result is O(1)): a
scale shared across ranks (as an amax all-reduced over the group would give) flushes the smaller shards' entries
to e4m3's subnormal grid or to zero (e4m3 spans 2¹⁸ from its largest value to its smallest subnormal), which the
exact comparison sees on every rank, in fp32 and bf16 alike.

The same results are then compared with the dense float64 ``nn.Linear`` on the same values (relative Frobenius
error, see ``DENSE_BOUND``), an fp8 MLP trained for 30 steps follows the same model trained densely in fp32, and a
zero-bubble schedule's deferral postpones an fp8 layer's weight gradient without changing it.
"""

import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.multiprocess import REFERENCE_KERNELS, run_ranks

B, S = 2, 12  # S divisible by 2 and 4 (sequence parallelism); batch above one
K, N = 40, 24  # in/out features: column shards of 12 or 6 output rows, row shards of 20 or 10 input columns
# Rank r's weight shard is scaled by SHARD_SCALES[r] (see the module's docstring): rank 1, there at tp=2 and 4, is
# 2^16 below rank 0; ranks 2 and 3 lie in between.
SHARD_SCALES = (1.0, 2.0**-16, 2.0**-5, 2.0**-11)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
EXACT_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}
# Relative Frobenius error against float64. Each GEMM operand is rounded once to fp8: e4m3 (3 mantissa bits) by up
# to 2⁻⁴ of a value, ~3% RMS; e5m2 (2 bits) by up to 2⁻³, ~6% RMS. The output (e4m3 · e4m3: ~4% expected)
# measures 0.036-0.040; the input and weight gradients (e5m2 · e4m3: ~7%) 0.055-0.070; the bias gradients take no
# fp8 (Σ dY in fp32) and measure ≤ 0.003 (bf16's rounding). Each bound leaves a margin of 1.4x or more.
DENSE_BOUND = {"output": 0.06, "input grad": 0.1, "weight grad": 0.1, "bias grad": 0.01}


def _dense(k, n, seed):
    torch.manual_seed(seed)
    return nn.Linear(k, n, dtype=torch.float64)


def _data(shape, seed):
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _block(size, t, r):
    return slice(r * size // t, (r + 1) * size // t)


def _spread(size, t):
    """``[size]`` float64: ``SHARD_SCALES[r]`` on rank r's block of ``size``."""
    return torch.cat([torch.full((size // t,), SHARD_SCALES[r], dtype=torch.float64) for r in range(t)])


def _exact(got, want, dtype, what):
    rtol = EXACT_RTOL[dtype]
    want = want.double()
    torch.testing.assert_close(
        got.double(), want, rtol=rtol, atol=rtol * want.abs().max().item(), msg=lambda m: f"{what}: {m}"
    )
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def _dense_error(got, want, name, tag):
    err = (torch.linalg.norm(got.double() - want) / torch.linalg.norm(want)).item()
    assert err < DENSE_BOUND[name], f"{tag} {name}: relative error {err:.3g} against the dense float64 layer"
    return err


def _dense_grads(w, b, x, gy):
    """The dense float64 layer on the values the sharded layer sees: output and the three gradients."""
    x = x.double().requires_grad_()
    w, b = w.double().requires_grad_(), b.double().requires_grad_()
    y = nn.functional.linear(x, w, b)
    y.backward(gy.double())
    return y.detach(), x.grad, w.grad, b.grad


def _fp8(x, w, b, gy):
    """``fp8_linear`` forward and backward in this process: ``(y, dx, dw, db)`` (db None without a bias)."""
    from tessel.layers.fp8 import fp8_linear

    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    b = None if b is None else b.detach().clone().requires_grad_()
    y = fp8_linear(x, w, b)
    y.backward(gy)
    return y.detach(), x.grad, w.grad, None if b is None else b.grad


def _column_case(t, dtype):
    """Dense weight, bias, input and upstream gradient, rounded to ``dtype``: rank r's output rows (and bias)
    scaled by ``SHARD_SCALES[r]``, their upstream gradient divided by it, so each shard's input gradient is O(1)."""
    lin = _dense(K, N, 1)
    g = _spread(N, t)
    w, b = lin.weight.detach() * g[:, None], lin.bias.detach() * g
    return w.to(dtype), b.to(dtype), _data((B, S, K), 2).to(dtype), (_data((B, S, N), 3) / g).to(dtype)


def _row_case(t, dtype):
    """As ``_column_case`` for the row layer: rank r's input columns of the weight scaled by ``SHARD_SCALES[r]``,
    of the input divided by it, so every partial output is O(1)."""
    lin = _dense(K, N, 4)
    g = _spread(K, t)
    w, b = lin.weight.detach() * g, lin.bias.detach()
    return w.to(dtype), b.to(dtype), (_data((B, S, K), 5) / g).to(dtype), _data((B, S, N), 6).to(dtype)


def _compare(got, want, dense_want, dtype, tag):
    """Per result: the exact comparison with the emulation, then the error against the dense float64 layer."""
    return {
        name: (_exact(got[name], want[name], dtype, f"{tag} {name}"),
               _dense_error(got[name], dense_want[name], name, tag))
        for name in got
    }  # fmt: skip


def _linear(w, b, dtype):
    """A dense ``nn.Linear`` holding ``w`` and ``b``: what ``from_linear`` shards."""
    dense = nn.Linear(K, N, dtype=dtype)
    with torch.no_grad():
        dense.weight.copy_(w), dense.bias.copy_(b)
    return dense


def _token_major(x, sp):
    """The rows in the order the layer feeds them to its GEMM: ``(s, b)`` under sequence parallelism."""
    return x.transpose(0, 1) if sp else x


def _check_column(rank, t, dtype, sp, overlap):
    from tessel.layers.linear import ColumnParallelLinear

    w, b, x, gy = _column_case(t, dtype)
    seq, rows = _block(S, t, rank), _block(N, t, rank)
    dense = _linear(w, b, dtype)
    layer = ColumnParallelLinear.from_linear(dense, fp8=True, sequence_parallel=sp, overlap=overlap)
    x_in = (x[:, seq] if sp else x).clone().requires_grad_()
    y = layer(x_in)
    y.backward(gy[..., rows])
    got = {"output": y, "input grad": x_in.grad, "weight grad": layer.weight.grad, "bias grad": layer.bias.grad}

    # Emulation: every shard's fp8_linear in this process, the input gradients summed as the collective does.
    dx = 0
    for r in range(t):
        part = _block(N, t, r)
        y_r, dx_r, dw_r, db_r = _fp8(_token_major(x, sp), w[part], b[part], _token_major(gy[..., part], sp))
        dx = dx + dx_r.double()
        if r == rank:
            want = {"output": _token_major(y_r, sp), "weight grad": dw_r, "bias grad": db_r}
    dx = _token_major(dx, sp)
    want["input grad"] = dx[:, seq] if sp else dx

    y_ref, dx_ref, dw_ref, db_ref = _dense_grads(w, b, x, gy)
    dense_want = {"output": y_ref[..., rows], "input grad": dx_ref[:, seq] if sp else dx_ref,
                  "weight grad": dw_ref[rows], "bias grad": db_ref[rows]}  # fmt: skip
    tag = f"column tp={t} {dtype} sp={sp} overlap={overlap}"
    return _compare(got, want, dense_want, dtype, tag)


def _check_row(rank, t, dtype, sp, overlap):
    from tessel.layers.linear import RowParallelLinear

    w, b, x, gy = _row_case(t, dtype)
    seq, cols = _block(S, t, rank), _block(K, t, rank)
    dense = _linear(w, b, dtype)
    layer = RowParallelLinear.from_linear(dense, fp8=True, sequence_parallel=sp, overlap=overlap)
    x_in = x[..., cols].clone().requires_grad_()
    y = layer(x_in)
    y.backward(gy[:, seq] if sp else gy)
    got = {"output": y, "input grad": x_in.grad, "weight grad": layer.weight.grad, "bias grad": layer.bias.grad}

    # Emulation: every shard's partial output in this process, summed as the collective does, then the bias.
    y_sum = 0
    for r in range(t):
        part = _block(K, t, r)
        y_r, dx_r, dw_r, _ = _fp8(_token_major(x[..., part], sp), w[:, part], None, _token_major(gy, sp))
        y_sum = y_sum + y_r.double()
        if r == rank:
            want = {"input grad": _token_major(dx_r, sp), "weight grad": dw_r}
    y_sum = _token_major(y_sum, sp) + b.double()
    want["output"] = y_sum[:, seq] if sp else y_sum
    want["bias grad"] = gy.double().sum((0, 1))

    y_ref, dx_ref, dw_ref, db_ref = _dense_grads(w, b, x, gy)
    dense_want = {"output": y_ref[:, seq] if sp else y_ref, "input grad": dx_ref[..., cols],
                  "weight grad": dw_ref[:, cols], "bias grad": db_ref}  # fmt: skip
    tag = f"row tp={t} {dtype} sp={sp} overlap={overlap}"
    return _compare(got, want, dense_want, dtype, tag)


def _layers_worker(rank, t, dtype_name):
    """``{(kind, sp, overlap, tensor): (exact error, dense error)}``: the largest error against the emulation,
    relative to the tensor's largest magnitude, and the relative Frobenius error against float64; the layers'
    overlapped rings (``overlap=True``) and their plain path alike."""
    dtype = DTYPES[dtype_name]
    errors = {}
    for sp, overlap in itertools.product((False, True), (False, True)):
        for kind, check in (("column", _check_column), ("row", _check_row)):
            for name, err in check(rank, t, dtype, sp, overlap).items():
                errors[(kind, sp, overlap, name)] = err
    return errors


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_fp8_layers_equal_the_per_shard_emulation_and_stay_near_dense(world, dtype_name):
    """Each rank's output and gradients equal fp8_linear on its own shard with the collectives applied by hand,
    and are within fp8's rounding of the dense float64 layer."""
    results = run_ranks(_layers_worker, world, dtype_name, timeout=300)
    assert len(results) == world and all(len(r) == 32 for r in results)


# ---------------------------------------------------------------------------------------------------- MLP training

D, H = 24, 40  # model width, hidden width (20 or 10 hidden units per rank)
STEPS, LR = 30, 0.5
# The fp8 model's loss at each of the 30 steps, relative to the dense fp32 model's. fp8 rounds the forward's
# operands by ~3% RMS and the gradients by ~6%, errors without a direction, so the loss itself moves little (0.25%
# at step 0) and the two trajectories drift apart slowly: measured at most 1.24% (step 28; the loss falls 4x).
LOSS_RTOL = 0.03


def _mlp_task():
    """Seeded dense fp32 weights and a regression task: the outputs of another random MLP, scaled up."""
    up, down = _dense(D, H, 40).float(), _dense(H, D, 41).float()
    x = _data((B, S, D), 42).float()
    teacher_up, teacher_down = _dense(D, H, 43).float(), _dense(H, D, 44).float()
    with torch.no_grad():
        target = teacher_down(nn.functional.gelu(teacher_up(x))) * 3.0
    return up, down, x, target


def _mlp_worker(rank, t, sp):
    """The loss before each SGD step of column(+bias) → GELU → row(+bias) in fp8, on the whole batch each step,
    the shards built from the same seeded dense weights on every rank."""
    from tessel.layers.linear import ColumnParallelLinear, RowParallelLinear

    up, down, x, target = _mlp_task()
    col = ColumnParallelLinear.from_linear(up, fp8=True, sequence_parallel=sp)
    row = RowParallelLinear.from_linear(down, fp8=True, sequence_parallel=sp)
    opt = torch.optim.SGD([*col.parameters(), *row.parameters()], lr=LR)
    seq = _block(S, t, rank)
    x_in, want = (x[:, seq], target[:, seq]) if sp else (x, target)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        y = row(nn.functional.gelu(col(x_in)))
        loss = ((y - want) ** 2).sum() / target.numel()  # under sp: this rank's tokens' share of the mean
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        if sp:
            dist.all_reduce(total)
        losses.append(total.item())
    return losses


def _dense_losses():
    up, down, x, target = _mlp_task()
    opt = torch.optim.SGD([*up.parameters(), *down.parameters()], lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = ((down(nn.functional.gelu(up(x))) - target) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.multiprocess
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("world", [2, 4])
def test_fp8_mlp_trains_like_the_dense_model(world, sp):
    """30 SGD steps of the fp8 tensor-parallel MLP follow the same MLP trained densely in fp32 in one process.

    The ranks run tessel's kernels as their PyTorch references (``REFERENCE_KERNELS``: the same fp8 rounding and
    scaled products, ~10x faster than Triton's interpreter): this test is about how the layers compose and train;
    the test above runs the Triton kernels inside the same layers, and through them the losses are the same (the
    same fp8 values; their products are exact in fp32).
    """
    results = run_ranks(_mlp_worker, world, sp, timeout=300, env=REFERENCE_KERNELS)
    assert all(losses == results[0] for losses in results), "the ranks saw different losses"
    losses, dense = torch.tensor(results[0]), torch.tensor(_dense_losses())
    assert losses[-1] < 0.5 * losses[0], f"the loss did not fall: {losses.tolist()}"
    torch.testing.assert_close(losses, dense, rtol=LOSS_RTOL, atol=0, msg=lambda m: f"fp8 against dense: {m}")


# ---------------------------------------------------------------------------------------------------- zero bubble


def _backward(layer, x):
    x = x.clone().requires_grad_()
    y = layer(x)
    (y * y).sum().backward()
    return x.grad


def _deferral_worker(rank, t):
    """Inside ``defer_weight_grads()`` an fp8 layer's backward leaves its weight gradient to the store and
    produces the combined backward's input and bias gradients; running the store gives the combined backward's
    weight gradient, bit for bit. Parameters a data-parallel wrapper manages are never deferred."""
    from tessel.layers.fp8 import Fp8Linear
    from tessel.layers.linear import ColumnParallelLinear, RowParallelLinear
    from tessel.parallel.ddp import OWNER_ATTR
    from tessel.parallel.pipeline.weight_grad import defer_weight_grads

    same = dict(rtol=0, atol=0)
    cases = [("fp8 nn.Linear (no group)", Fp8Linear.from_linear, K)]
    for sp, overlap in itertools.product((False, True), (False, True)):
        parallel = dict(fp8=True, sequence_parallel=sp, overlap=overlap)
        tag = f"sp={sp} overlap={overlap}"
        cases.append((f"column {tag}", lambda lin, kw=parallel: ColumnParallelLinear.from_linear(lin, **kw), K))
        cases.append((f"row {tag}", lambda lin, kw=parallel: RowParallelLinear.from_linear(lin, **kw), K // t))
    for name, make, width in cases:
        tokens = S // t if name.startswith("column sp=True") else S
        x = _data((B, tokens, width), 50 + rank).float()
        for managed in (False, True):
            ref, layer = make(_dense(K, N, 51).float()), make(_dense(K, N, 51).float())
            dx_ref = _backward(ref, x)
            for p in layer.parameters() if managed else ():
                setattr(p, OWNER_ATTR, object())  # as DDP and FSDP mark the parameters they manage
            with defer_weight_grads() as store:
                dx = _backward(layer, x)
            tag = f"{name} managed={managed}"
            torch.testing.assert_close(dx, dx_ref, **same, msg=lambda m, tag=tag: f"{tag} input grad: {m}")
            torch.testing.assert_close(layer.bias.grad, ref.bias.grad, **same, msg=lambda m, tag=tag: f"{tag}: {m}")
            if managed:
                assert len(store) == 0, f"{tag}: a managed weight's gradient was deferred"
            else:
                assert layer.weight.grad is None, f"{tag}: the weight gradient must wait for the store"
                assert store.run() == 1, f"{tag}: expected one deferred weight gradient"
            torch.testing.assert_close(layer.weight.grad, ref.weight.grad, **same, msg=lambda m, tag=tag: f"{tag}: {m}")
    return "ok"


@pytest.mark.multiprocess
def test_fp8_weight_grads_wait_for_the_zero_bubble_store():
    assert run_ranks(_deferral_worker, 2, timeout=300) == ["ok", "ok"]
