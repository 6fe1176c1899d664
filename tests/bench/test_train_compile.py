"""The training job with ``--compile``: each transformer block runs compiled, under every layout.

Each test trains the same few steps eagerly and compiled and compares the losses. ``aot_eager`` traces the
blocks (forward and backward through AOTAutograd, tessel's kernels as graph operators, the collectives of the
tensor-parallel ranks as functional collectives) without generating code; AOTAutograd's decompositions
reorder a few fp32 sums, hence a relative tolerance instead of bit equality. One test generates code with
inductor itself (C++ on the CPU).
"""

import json
import shutil

import pytest

from tessel.bench.train_args import ArgumentError, parse_args
from tests.bench.test_train import _losses, _ok, _train

pytestmark = pytest.mark.slow
SMALL = ["--steps", "3", "--seq-len", "32"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("layout", "nproc"),
    [
        ([], 1),
        (["--tp", "2", "--sequence-parallel"], 2),
        (["--zero", "3", "--recompute"], 2),
        (["--pp", "2", "--schedule", "zb"], 2),
        (["--cp", "2"], 2),
    ],
    ids=["one-rank", "tp2-sp", "fsdp-recompute", "pp2-zb", "cp2"],
)
def test_compiled_blocks_train_like_eager_blocks(tmp_path, layout, nproc):
    """Tensor and sequence parallelism (collectives inside the compiled blocks), FSDP (parameters gathered by hooks
    around them, again for the recomputation) and a zero-bubble pipeline (weight gradients computed in the
    input-gradient pass instead of deferred), context parallelism (the ring attention in its all-gather form): the
    same losses as the eager run."""
    _ok(_train(tmp_path / "eager", *layout, *SMALL, nproc=nproc))
    proc = _ok(_train(tmp_path / "compiled", *layout, *SMALL, "--compile", "aot_eager", nproc=nproc))
    assert "compile=aot_eager" in proc.stdout
    assert _losses(tmp_path / "compiled") == pytest.approx(_losses(tmp_path / "eager"), rel=1e-5)
    record = json.loads((tmp_path / "compiled" / "run.json").read_text())
    assert record["args"]["compile"] == "aot_eager" and record["summary"]["layout"].endswith("compile=aot_eager")


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor's CPU code needs a C++ compiler")
def test_inductor_compiled_blocks_train_like_eager_blocks(tmp_path):
    """``--compile`` alone means inductor: generated code for the blocks (C++ here), the same losses to fp32
    rounding."""
    _ok(_train(tmp_path / "eager", *SMALL))
    proc = _ok(_train(tmp_path / "compiled", *SMALL, "--compile", timeout=540))
    assert "compile=inductor" in proc.stdout
    assert _losses(tmp_path / "compiled") == pytest.approx(_losses(tmp_path / "eager"), rel=1e-4)


def test_an_unknown_compile_backend_is_refused():
    with pytest.raises(ArgumentError, match=r"--compile: invalid choice: 'eager'"):
        parse_args(["--compile", "eager"])
