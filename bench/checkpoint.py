"""Atomic, verified checkpoints of flat tensor dictionaries through ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory ``<root>/step_<NNNNNNNN>`` holding DCP's files plus ``manifest.json``: the
step, the size and SHA-256 of every file written, and a small JSON record of the run. A save:

1. every rank writes its part into ``<root>/.tmp-step_<N>`` (DCP: one ``.distcp`` file per rank, plus
   ``.metadata`` written by rank 0 once every rank has finished; files are fsynced);
2. rank 0 hashes the files, writes the manifest (to a temporary name, fsynced, then renamed), and
   renames the directory to ``step_<N>``, the one atomic step that makes the checkpoint visible;
3. a barrier, so that no rank runs ahead of a checkpoint that is not yet complete.

A crash anywhere before the rename leaves only a ``.tmp-*`` directory, which is never read and is
removed by the next save; the previous checkpoint is never touched until a newer one is complete.

Loading verifies the manifest first (every file present, of the recorded size and hash), so a
truncated or corrupted checkpoint fails with a :class:`CheckpointError` naming the file, before DCP
reads anything. The state holds tensors only: DCP reads them with ``torch.load(weights_only=True)``,
a key the checkpoint stores as a pickled object is refused rather than unpickled, and only DCP's own
``.metadata`` index (covered by the manifest's hash) is read with pickle.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "checkpoint_keys",
    "latest_checkpoint",
    "load_checkpoint",
    "read_manifest",
    "remove_stale",
    "save_checkpoint",
    "verify_checkpoint",
]

MANIFEST = "manifest.json"
FORMAT = "tessel-checkpoint-1"
_NAME = re.compile(r"^step_(\d{8,})$")
_TMP_PREFIX = ".tmp-"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, damaged, or does not fit the state being loaded."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast_flag(value: int) -> int:
    """Rank 0's ``value`` on every rank (a tensor on the backend's device)."""
    if not dist.is_initialized():
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(flag, src=0)
    return int(flag.item())


@contextlib.contextmanager
def _single_process_quietly():
    """DCP warns that it assumes a single process when no process group exists; that is the intent here."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _checkpoints(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return sorted(found)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint of the highest step under ``root``, or None when there is none.

    Complete means renamed into place: a directory still named ``.tmp-*`` is a save that never finished.
    """
    found = _checkpoints(Path(root))
    return found[-1][1] if found else None


def remove_stale(root: str | os.PathLike) -> None:
    """Rank 0 deletes unfinished saves (``.tmp-*`` directories) under ``root``; every rank waits for it."""
    root = Path(root)
    if _rank() == 0 and root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(_TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True)
    _barrier()


def _write_manifest(tmp: Path, step: int, meta: dict) -> None:
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(tmp.iterdir()) if p.is_file()}
    manifest = {"format": FORMAT, "step": step, "files": files, **meta}
    part = tmp / (MANIFEST + ".part")
    with open(part, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, tmp / MANIFEST)


def save_checkpoint(
    root: str | os.PathLike, step: int, state: dict[str, torch.Tensor], meta: dict | None = None, *, keep: int = 2
) -> Path:
    """Save ``state`` as checkpoint ``step`` under ``root`` atomically; a collective over the default group.

    ``state`` maps keys to tensors; a key present on several ranks must hold the same tensor on each
    (DCP writes it once). ``meta`` (JSON-serialisable) goes into the manifest. Afterwards only the
    ``keep`` newest complete checkpoints remain. Returns the checkpoint's directory.
    """
    bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(
            f"save_checkpoint: state values must be tensors, received {type(state[bad[0]]).__name__} for {bad[0]!r}"
        )
    root = Path(root)
    final, tmp = root / f"step_{step:08d}", root / f"{_TMP_PREFIX}step_{step:08d}"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    writer = FileSystemWriter(tmp, sync_files=True)
    with _single_process_quietly():
        dcp.save(state, storage_writer=writer, no_dist=not dist.is_initialized())  # returns once .metadata is written
    if _rank() == 0:
        _write_manifest(tmp, step, meta or {})
        old = root / f"{_TMP_PREFIX}old-step_{step:08d}"
        if final.exists():  # the same step saved again: moved aside, deleted once the new copy is in place
            os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(root)
        for _, old in _checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def read_manifest(path: str | os.PathLike) -> dict:
    """The parsed ``manifest.json`` of checkpoint ``path`` (not verified against the files)."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: {MANIFEST} is missing")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path} is corrupted: {MANIFEST} is not valid JSON ({exc})") from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or not isinstance(manifest.get("files"), dict)
    ):
        raise CheckpointError(f"checkpoint {path} is corrupted: {MANIFEST} is not a {FORMAT} manifest")
    return manifest


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Check every file the manifest lists (present, same size, same SHA-256); return the manifest.

    Raises :class:`CheckpointError` naming the first file that is missing, truncated or corrupted.
    """
    path = Path(path)
    manifest = read_manifest(path)
    if ".metadata" not in manifest["files"]:
        raise CheckpointError(f"checkpoint {path} is corrupted: its manifest lists no DCP .metadata file")
    for name, record in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
        size = file.stat().st_size
        if size != record["bytes"]:
            raise CheckpointError(
                f"checkpoint {path} is truncated: {name} has {size} bytes, the manifest recorded {record['bytes']}"
            )
        if _sha256(file) != record["sha256"]:
            raise CheckpointError(f"checkpoint {path} is corrupted: the SHA-256 of {name} differs from the manifest's")
    return manifest


def checkpoint_keys(path: str | os.PathLike) -> dict[str, tuple[torch.Size, torch.dtype] | None]:
    """Each key of checkpoint ``path`` with its tensor's ``(shape, dtype)``; None for a non-tensor entry."""
    metadata = FileSystemReader(path).read_metadata()
    return {
        key: (md.size, md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
        for key, md in metadata.state_dict_metadata.items()
    }


class _TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, except that an entry stored as pickled bytes is refused instead of ``torch.load``-ed."""

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; refusing to load it")


def _check_fits(path: Path, state: dict[str, torch.Tensor]) -> None:
    stored = checkpoint_keys(path)
    for key, tensor in state.items():
        if key not in stored:
            raise CheckpointError(f"checkpoint {path} has no entry {key!r} (saved from a different model?)")
        if stored[key] is None:
            raise CheckpointError(f"checkpoint entry {key!r} of {path} is a pickled object; refusing to load it")
        shape, dtype = stored[key]
        if tuple(shape) != tuple(tensor.shape) or dtype != tensor.dtype:
            raise CheckpointError(
                f"checkpoint entry {key!r} of {path} is {dtype} {tuple(shape)}, "
                f"expected {tensor.dtype} {tuple(tensor.shape)} (saved from a different model?)"
            )


def load_checkpoint(path: str | os.PathLike, state: dict[str, torch.Tensor]) -> dict:
    """Fill the tensors of ``state`` in place from checkpoint ``path``; a collective over the default group.

    Rank 0 verifies the files against the manifest first; every rank raises :class:`CheckpointError`
    when that fails, when a key is missing or when a shape or dtype differs. Returns the manifest.
    """
    path = Path(path)
    error = None
    if _rank() == 0:
        try:
            verify_checkpoint(path)
        except CheckpointError as exc:
            error = exc
    if _broadcast_flag(int(error is not None)):
        raise error or CheckpointError(f"checkpoint {path} failed verification on rank 0 (its error says why)")
    _check_fits(path, state)
    reader, planner = FileSystemReader(path), _TensorOnlyLoadPlanner()
    with _single_process_quietly():
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=not dist.is_initialized())
    return read_manifest(path)
