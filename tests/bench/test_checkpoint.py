"""Checkpoints of tensor dictionaries: round trip, atomic visibility, damage detection, no unpickling."""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from tessel.bench import checkpoint as ckpt
from tessel.bench.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    read_manifest,
    remove_stale,
    save_checkpoint,
)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model.w": torch.randn(7, 5, generator=gen),
        "model.b": torch.randn(5, generator=gen, dtype=torch.float64),
        "train.step": torch.tensor(42, dtype=torch.int64),
        "rng.0.cpu": torch.get_rng_state(),
    }


def _empty_like(state):
    return {k: torch.full_like(v, 7) if v.is_floating_point() else torch.zeros_like(v) for k, v in state.items()}


def test_round_trip_is_exact_and_manifest_records_every_file(tmp_path):
    state = _state()
    path = save_checkpoint(tmp_path, 3, state, {"note": "hello"})
    assert path == tmp_path / "step_00000003" and latest_checkpoint(tmp_path) == path
    loaded = _empty_like(state)
    manifest = load_checkpoint(path, loaded)
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key
    assert manifest["step"] == 3 and manifest["note"] == "hello"
    written = {p.name for p in path.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == written and ".metadata" in written


def test_unfinished_save_is_invisible_and_old_checkpoints_are_pruned(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, _state(step), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000003"]
    (tmp_path / ".tmp-step_00000004").mkdir()  # a save that crashed before its rename
    (tmp_path / ".tmp-step_00000004" / "__0_0.distcp").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000003"
    remove_stale(tmp_path)
    assert not (tmp_path / ".tmp-step_00000004").exists()
    assert latest_checkpoint(tmp_path / "nothing-here") is None


def _data_file(path):
    (file,) = path.glob("*.distcp")
    return file


def test_truncated_file_is_detected(tmp_path):
    path = save_checkpoint(tmp_path, 1, _state())
    file = _data_file(path)
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size - 10)
    with pytest.raises(CheckpointError, match=rf"truncated: {file.name} has \d+ bytes"):
        load_checkpoint(path, _empty_like(_state()))


def test_corrupted_byte_is_detected(tmp_path):
    path = save_checkpoint(tmp_path, 1, _state())
    file = _data_file(path)
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"corrupted: the SHA-256 of {file.name}"):
        load_checkpoint(path, _empty_like(_state()))


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda p: (p / "manifest.json").unlink(), "incomplete: manifest.json is missing"),
        (lambda p: (p / "manifest.json").write_text('{"format": "tessel-checkp'), "not valid JSON"),
        (lambda p: (p / ".metadata").unlink(), r"incomplete: \.metadata is missing"),
    ],
)
def test_damaged_manifest_or_missing_file_is_detected(tmp_path, damage, match):
    path = save_checkpoint(tmp_path, 1, _state())
    damage(path)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path, _empty_like(_state()))


def test_missing_key_and_wrong_shape_are_refused_before_reading(tmp_path):
    path = save_checkpoint(tmp_path, 1, _state())
    with pytest.raises(CheckpointError, match=r"no entry 'model\.extra'"):
        load_checkpoint(path, {"model.extra": torch.zeros(3)})
    with pytest.raises(
        CheckpointError, match=r"'model.w' .* is torch.float32 \(7, 5\), expected torch.float32 \(5, 7\)"
    ):
        load_checkpoint(path, {"model.w": torch.zeros(5, 7)})


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP's note that it runs in one process
def test_pickled_entry_is_refused_not_unpickled(tmp_path):
    path = tmp_path / "step_00000001"
    path.mkdir()
    # A checkpoint written by someone else's code, holding an arbitrary object under a key we ask for.
    dcp.save({"model.w": torch.zeros(2), "evil": "os.system('echo pwned')"}, storage_writer=FileSystemWriter(path))
    ckpt._write_manifest(path, 1, {})
    assert read_manifest(path)["step"] == 1
    with pytest.raises(CheckpointError, match=r"'evil' .* pickled object; refusing"):
        load_checkpoint(path, {"evil": torch.zeros(1)})


def test_non_tensor_state_is_refused(tmp_path):
    with pytest.raises(TypeError, match="must be tensors, received int for 'step'"):
        save_checkpoint(tmp_path, 1, {"step": 3})
    assert not any(p.name.startswith("step_") for p in tmp_path.iterdir())


def test_manifest_is_written_atomically(tmp_path):
    path = save_checkpoint(tmp_path, 5, _state())
    assert not list(path.glob("*.part")) and os.path.getsize(path / "manifest.json") > 0
