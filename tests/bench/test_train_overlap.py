"""``python -m tessel.bench.train --overlap``: the tensor-parallel layers' communication, chosen for the whole run.

``--overlap peer`` trains through the device-signalled transports (tessel.parallel.peer): on gloo ranks their
buffers are shared-memory files the ranks write into each other's, and the loss curve is the single process's (the
partials are summed in another order than one reduce-scatter's, hence 1e-4 rather than fp32's rounding).
"""

import importlib.util
import json

import pytest

from tests.bench.test_train import _losses, _ok, _train
from tests.multiprocess import REFERENCE_KERNELS, run_ranks

RUN = ["--steps", "3", "--seq-len", "32", "--batch-size", "4"]


def _layers_overlap(rank, world_size, run):
    """The ``overlap`` of every tensor-parallel linear layer of the job's model built from ``run``."""
    from tessel.bench.train_args import parse_args
    from tessel.bench.train_engine import build_engine
    from tessel.layers import ColumnParallelLinear, RowParallelLinear
    from tessel.parallel import init_parallel

    model = build_engine(parse_args(run), init_parallel(tp=2)).gpt
    return {m.overlap for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("model, sp", [("gpt", True), ("gpt", False), ("llama", True)])
def test_tp2_through_the_transports_follows_the_single_process(tmp_path, model, sp):
    """With sequence parallelism the gathers and reduce-scatters go through the transports; without, the
    all-reductions (a reduce-scatter then an all-gather each)."""
    if model == "llama" and importlib.util.find_spec("transformers") is None:
        pytest.skip("needs transformers")
    run = RUN if model == "gpt" else ["--hf", "llama", *RUN]
    tp = ["--tp", "2", "--sequence-parallel"] if sp else ["--tp", "2"]
    assert run_ranks(_layers_overlap, 2, [*run, *tp, "--overlap", "peer"], env=REFERENCE_KERNELS) == [{"peer"}] * 2
    _ok(_train(tmp_path / "one", *run))
    assert "overlap=peer" in _ok(_train(tmp_path / "peer", *run, *tp, "--overlap", "peer", nproc=2)).stdout
    _ok(_train(tmp_path / "off", *run, *tp, "--overlap", "off", nproc=2))
    assert json.loads((tmp_path / "peer" / "run.json").read_text())["args"]["overlap"] == "peer"
    assert _losses(tmp_path / "peer") == pytest.approx(_losses(tmp_path / "one"), rel=1e-4)
    assert _losses(tmp_path / "off") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fp8_at_tp2_through_the_transports_follows_the_fp8_rings(tmp_path):
    """``--fp8 --overlap peer``: the fp8 GEMMs' gathers (fp8 shards) and reduce-scatters go through the transports;
    the curve is the fp8 rings' up to the order in which partials are summed (which can move an fp8 rounding: 2e-3,
    as the fp8 layouts are compared in tests/bench/test_train_fp8.py)."""
    run, tp = [*RUN, "--fp8"], ["--tp", "2", "--sequence-parallel"]
    assert run_ranks(_layers_overlap, 2, [*run, *tp, "--overlap", "peer"], env=REFERENCE_KERNELS) == [{"peer"}] * 2
    assert "overlap=peer" in _ok(_train(tmp_path / "peer", *run, *tp, "--overlap", "peer", nproc=2)).stdout
    _ok(_train(tmp_path / "ring", *run, *tp, "--overlap", "on", nproc=2))
    peer, ring = _losses(tmp_path / "peer"), _losses(tmp_path / "ring")
    assert max(abs(p - r) / abs(r) for p, r in zip(peer, ring, strict=True)) < 2e-3
