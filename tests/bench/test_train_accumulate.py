"""``python -m tessel.bench.train --microbatches M`` without pipeline stages: gradient accumulation.

Each data-parallel rank runs its rows in M pieces, forward and backward, and its DDP/FSDP wrapper reduces the
summed gradients once. The math is the whole batch's (each piece's mean weighted by ``1/M``, or by its share of
the counted targets with documents), so the loss curves agree with the unsplit run's to fp32 rounding, and the
bytes a step sends are those of one reduction.
"""

import pytest
import torch

from tests.bench.test_train import _losses, _ok, _rank_env, _train
from tests.multiprocess import run_ranks

BASE = ["--steps", "3", "--seq-len", "32", "--batch-size", "8"]
DOCS = ["--doc-sep", "\\n\\n", "--steps", "3", "--seq-len", "64", "--batch-size", "8"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_accumulated_steps_train_like_the_whole_batch(tmp_path):
    """One process in 4 pieces, and dp=2 in 2 pieces per rank under DDP with ZeroAdam (ZeRO-2) and under FSDP: the
    unsplit run's curve. The layout line names the accumulation."""
    _ok(_train(tmp_path / "whole", *BASE))
    proc = _ok(_train(tmp_path / "acc4", *BASE, "--microbatches", "4"))
    assert "accumulation=4" in proc.stdout
    _ok(_train(tmp_path / "ddp", *BASE, "--dp", "2", "--zero", "2", "--microbatches", "2", nproc=2))
    _ok(_train(tmp_path / "fsdp", *BASE, "--dp", "2", "--zero", "3", "--microbatches", "2", nproc=2))
    whole = _losses(tmp_path / "whole")
    assert whole[-1] < whole[0]
    for run in ("acc4", "ddp", "fsdp"):
        assert _losses(tmp_path / run) == pytest.approx(whole, rel=1e-5), run


@pytest.mark.slow
@pytest.mark.multiprocess
def test_accumulated_documents_weigh_each_piece_by_its_targets(tmp_path):
    """Packed documents: the pieces count different numbers of targets (those across a boundary are ignored);
    weighted by their share of the global count, one process in 4 pieces, dp=2 and cp=2 in 2 pieces give the unsplit
    run's curve (plain means of the pieces' means would not: ~7e-5 apart here, 7x the tolerance)."""
    _ok(_train(tmp_path / "whole", *DOCS))
    _ok(_train(tmp_path / "acc4", *DOCS, "--microbatches", "4"))
    _ok(_train(tmp_path / "dp2", *DOCS, "--dp", "2", "--microbatches", "2", nproc=2))
    _ok(_train(tmp_path / "cp2", *DOCS, "--cp", "2", "--microbatches", "2", nproc=2))  # ids of whole sequences
    for run in ("acc4", "dp2", "cp2"):
        assert _losses(tmp_path / run) == pytest.approx(_losses(tmp_path / "whole"), rel=1e-5), run


@pytest.mark.slow
@pytest.mark.multiprocess
def test_accumulated_experts_weigh_the_router_loss_by_piece(tmp_path):
    """A mixture of experts trained with the router z-loss (a mean over tokens, so linear in the pieces) and no
    load-balancing loss: each piece's router loss enters with weight 1/M, and the curve is the unsplit run's."""
    moe = [*BASE, "--experts", "4", "--top-k", "2", "--aux-loss-coef", "0", "--z-loss-coef", "0.5"]
    _ok(_train(tmp_path / "whole", *moe))
    _ok(_train(tmp_path / "acc2", *moe, "--microbatches", "2"))
    assert _losses(tmp_path / "acc2") == pytest.approx(_losses(tmp_path / "whole"), rel=1e-5)


def _step_bytes(rank, world_size, zero, microbatches):
    """One training step at dp=2 in ``microbatches`` pieces: the bytes this rank sent, its loss, its gradients, and
    the bytes one piece's forward and backward send without any gradient reduction (under ``no_sync``: FSDP's
    parameter gathers, nothing under DDP)."""
    from tessel.bench.dataset import ByteDataset
    from tessel.bench.train_args import parse_args
    from tessel.bench.train_engine import build_engine
    from tessel.parallel import init_parallel
    from tessel.parallel.comm import count_bytes

    pieces = ["--microbatches", str(microbatches), "--grad-clip", "0"]  # clipping would hide a gradient's scale
    args = parse_args(["--dp", "2", "--zero", str(zero), *pieces, *BASE])
    engine = build_engine(args, init_parallel(dp=2))
    x, y = ByteDataset(args.data, seq_len=args.seq_len).batch(0, seed=args.seed, batch_size=8, dp_rank=rank, dp_size=2)
    with count_bytes() as step:
        loss = engine.train_step(x, y)
    if zero == 3:  # each unit's averaged gradient shard
        grads = [u.bucket.grad_shard.clone() for u in engine.wrapper.units]
    else:  # the averaged gradients the optimizer stepped with (Adam's first step would hide their scale)
        grads = {name: p.grad.clone() for name, p in engine.named.items()}
    piece = x.shape[0] // microbatches
    with count_bytes() as unreduced, engine.wrapper.no_sync():
        engine.wrapper(x[:piece], targets=y[:piece]).backward()
    return step.sent, float(loss), grads, unreduced.sent


@pytest.mark.multiprocess
@pytest.mark.parametrize("zero", [0, 3], ids=["ddp", "fsdp"])
def test_accumulation_reduces_the_gradients_once(zero):
    """dp=2, 4 pieces per rank: the step sends one reduction of the gradients (the unsplit step's bytes, less its
    parameter gathers under FSDP, plus four pieces' gathers), not one per piece, and ends with the unsplit step's
    loss and gradients."""
    whole, split = (
        run_ranks(_step_bytes, 2, zero, m, timeout=240, init_process_group=False, env=_rank_env({})) for m in (1, 4)
    )
    for (sent1, loss1, g1, gathers1), (sent4, loss4, g4, gathers4) in zip(whole, split, strict=True):
        assert loss4 == pytest.approx(loss1, rel=1e-5)
        torch.testing.assert_close(g4, g1, rtol=1e-5, atol=1e-7)
        reduction = sent1 - gathers1
        assert reduction > 0 and (gathers1 > 0) == (zero == 3)
        assert sent4 == reduction + 4 * gathers4
