"""``python -m tessel.bench.train --tokens uint16``: training on a file of token ids (nanoGPT's ``train.bin``
layout) with a vocabulary of the data's size, packed documents ending with a token id (``--doc-token``), and
a text trained with a larger head (``--vocab-size``)."""

import json

import numpy as np
import pytest

from tests.bench.test_train import _losses, _ok, _train

RUN = ["--tokens", "uint16", "--steps", "3", "--seq-len", "32", "--batch-size", "8"]


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    """~24k uint16 ids: sentences of six words drawn from fifty, over ids below 998; one in ten ends with 999."""
    rng = np.random.default_rng(0)
    words, ids = rng.integers(0, 998, size=(50, 6)), []
    for _ in range(4000):
        ids.extend(words[rng.integers(0, 50)].tolist())
        if rng.random() < 0.1:
            ids.append(999)
    path = tmp_path_factory.mktemp("tokens") / "train.bin"
    np.array(ids, dtype="<u2").tofile(path)
    return path


def _run(out):
    return json.loads((out / "run.json").read_text())


@pytest.mark.slow
def test_a_token_file_trains_with_the_vocabulary_its_ids_need(token_file, tmp_path):
    """The largest id is 999: the vocabulary is rounded up to 1024 and the first loss is about ln 1024; the model
    learns the sentences."""
    proc = _ok(_train(tmp_path, "--data", str(token_file), *RUN, "--steps", "30"))
    assert "uint16 token ids from train.bin, vocabulary 1024" in proc.stdout
    run, losses = _run(tmp_path), _losses(tmp_path)
    assert run["model"]["vocab_size"] == 1024 and run["args"]["tokens"] == "uint16"
    assert losses[0] == pytest.approx(np.log(1024), abs=0.1)
    assert losses[-1] < losses[0] - 1.5  # measured: ~4.4 after 30 steps


@pytest.mark.slow
@pytest.mark.multiprocess
def test_token_documents_train_alike_under_tensor_data_and_pipeline_parallelism(token_file, tmp_path):
    """--doc-token 999: each document ends with it; one process, tp=2 with sequence parallelism (the head split
    over the 1024 ids), dp=2 under FSDP and pp=2 give the same curve, and the documents change it."""
    docs = ["--data", str(token_file), *RUN, "--doc-token", "999"]
    _ok(_train(tmp_path / "one", *docs))
    for name, layout in {"tp2": ["--tp", "2", "--sequence-parallel"], "fsdp": ["--dp", "2", "--zero", "3"],
                         "pp2": ["--pp", "2", "--microbatches", "2"]}.items():  # fmt: skip
        _ok(_train(tmp_path / name, *docs, *layout, nproc=2))
        assert _losses(tmp_path / name) == pytest.approx(_losses(tmp_path / "one"), rel=1e-5), name
    _ok(_train(tmp_path / "stream", "--data", str(token_file), *RUN))
    assert _losses(tmp_path / "stream")[-1] != pytest.approx(_losses(tmp_path / "one")[-1], rel=1e-4)


@pytest.mark.slow
def test_a_text_trains_with_a_larger_head(tmp_path):
    """--vocab-size 3000 on the bundled bytes: a head of 3000 rows, the first loss about ln 3000 (the ids past 255
    never appear, and training pushes their logits down)."""
    proc = _ok(_train(tmp_path, "--vocab-size", "3000", "--steps", "3", "--seq-len", "32", "--batch-size", "8"))
    assert "vocabulary 3000" in proc.stdout and _run(tmp_path)["model"]["vocab_size"] == 3000
    assert _losses(tmp_path)[0] == pytest.approx(np.log(3000), abs=0.1)
