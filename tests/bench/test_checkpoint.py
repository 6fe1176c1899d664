"""Checkpoints of tensor dictionaries: round trip, atomic visibility, damage detection, no unpickling, and
tensors saved and loaded in pieces (each rank's blocks) under different cuts and numbers of ranks."""

import itertools
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from tessel.bench import checkpoint as ckpt
from tessel.bench.checkpoint import (
    CheckpointError,
    Pieces,
    latest_checkpoint,
    load_checkpoint,
    read_manifest,
    remove_stale,
    save_checkpoint,
)
from tests.multiprocess import run_ranks


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
    with pytest.raises(TypeError, match="must be tensors or Pieces, received int for 'step'"):
        save_checkpoint(tmp_path, 1, {"step": 3})
    assert not any(p.name.startswith("step_") for p in tmp_path.iterdir())


def test_manifest_is_written_atomically(tmp_path):
    path = save_checkpoint(tmp_path, 5, _state())
    assert not list(path.glob("*.part")) and os.path.getsize(path / "manifest.json") > 0


# ---------------------------------------------------------------------------------------------------- pieces


def _cut(full: torch.Tensor, rows: list[int], cols: list[int]) -> list[tuple[tuple[int, int], torch.Tensor]]:
    """The blocks of a 2-D tensor cut at the given row and column edges (views of ``full``)."""
    blocks = []
    for r0, r1 in itertools.pairwise(rows):
        for c0, c1 in itertools.pairwise(cols):
            blocks.append(((r0, c0), full[r0:r1, c0:c1]))
    return blocks


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_pieces_load_under_any_other_cut(tmp_path):
    full = torch.randn(7, 5, generator=torch.Generator().manual_seed(3))
    # saved as 6 uneven blocks, with a whole tensor beside them
    state = {"w": Pieces(full.shape, full.dtype, _cut(full, [0, 2, 7], [0, 1, 4, 5])), "b": torch.arange(3.0)}
    path = save_checkpoint(tmp_path, 1, state)
    whole = {"w": torch.full((7, 5), float("nan")), "b": torch.zeros(3)}
    load_checkpoint(path, whole)
    assert torch.equal(whole["w"], full) and torch.equal(whole["b"], torch.arange(3.0))
    # loaded into other blocks, which are views of one buffer: the buffer is filled in place
    buffer = torch.full((7, 5), float("nan"))
    load_checkpoint(path, {"w": Pieces((7, 5), torch.float32, _cut(buffer, [0, 3, 4, 7], [0, 5]))})
    assert torch.equal(buffer, full)
    # a whole tensor saved, loaded as strided blocks (columns of a transposed view)
    path = save_checkpoint(tmp_path, 2, {"w": full})
    buffer = torch.full((5, 7), float("nan"))
    load_checkpoint(path, {"w": Pieces((7, 5), torch.float32, _cut(buffer.t(), [0, 7], [0, 2, 5]))})
    assert torch.equal(buffer.t(), full)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_pieces_that_miss_part_of_a_tensor_are_refused(tmp_path):
    full = torch.randn(4, 3)
    path = save_checkpoint(tmp_path, 1, {"w": Pieces((4, 3), torch.float32, _cut(full, [0, 1, 3], [0, 3]))})
    with pytest.raises(CheckpointError, match=r"'w' .* holds 9 of its 12 elements"):
        load_checkpoint(path, {"w": torch.zeros(4, 3)})


@pytest.mark.parametrize(
    "args, error, match",
    [
        (((4, 3), torch.float32, [((0, 0), torch.zeros(2, 3, dtype=torch.float64))]), TypeError, "float32 tensor"),
        (((4, 3), torch.float32, [((3, 0), torch.zeros(2, 3))]), ValueError, r"at offsets \(3, 0\) does not fit"),
        (((4, 3), torch.float32, [((0,), torch.zeros(2, 3))]), ValueError, "does not fit in a tensor of shape"),
        (((4, 3), torch.float32, [((0, 0), [1.0])]), TypeError, "received list"),
    ],
)
def test_bad_pieces_are_refused(args, error, match):
    with pytest.raises(error, match=match):
        Pieces(*args)


def _save_rows_load_columns(rank, world_size, root):
    """Each rank saves its own rows of the tensors (no rank holds a whole one), then loads its columns."""
    from tessel.parallel.comm import count_bytes

    gen = torch.Generator().manual_seed(5)
    full = {"w": torch.randn(9, 6, generator=gen), "m": torch.randn(6, 4, generator=gen)}
    rows = {k: torch.linspace(0, v.shape[0], world_size + 1).round().long().tolist() for k, v in full.items()}
    mine = {k: Pieces(v.shape, v.dtype, [((rows[k][rank], 0), v[rows[k][rank] : rows[k][rank + 1]].clone())])
            for k, v in full.items()}  # fmt: skip
    with count_bytes() as moved:
        path = save_checkpoint(root, 3, {**mine, "step": torch.tensor(3)})
    assert moved.sent == 0  # nothing gathered through tessel's collectives
    files = sorted(p.name for p in path.glob("*.distcp"))
    col = [0, 3, 6][rank : rank + 2] if world_size == 2 else [0, 6]
    got = {"w": torch.full((9, col[1] - col[0]), float("nan")), "step": torch.tensor(0)}
    load_checkpoint(path, {"w": Pieces((9, 6), torch.float32, [((0, col[0]), got["w"])]), "step": got["step"]})
    assert torch.equal(got["w"], full["w"][:, col[0] : col[1]]) and int(got["step"]) == 3
    return files


@pytest.mark.multiprocess
def test_each_rank_writes_its_own_pieces_and_another_layout_reads_them(tmp_path):
    files = run_ranks(_save_rows_load_columns, 2, tmp_path)
    assert files[0] == files[1] and len(files[0]) == 2  # one file per rank: each wrote its own rows
    # and a world of one reads them back whole
    state = {"w": torch.zeros(9, 6), "m": torch.zeros(6, 4)}
    load_checkpoint(latest_checkpoint(tmp_path), state)
    gen = torch.Generator().manual_seed(5)
    assert torch.equal(state["w"], torch.randn(9, 6, generator=gen)) and torch.equal(
        state["m"], torch.randn(6, 4, generator=gen)
    )
