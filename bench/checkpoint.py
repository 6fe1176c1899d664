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

A state maps keys to tensors (whole; DCP writes a key held by several ranks once) or to
:class:`Pieces`: the blocks of one global tensor that this rank holds, each written by the rank that
holds it, so a sharded model or optimizer is saved without any rank gathering a whole tensor. DCP
records every block's place in the global tensor; loading asks for any blocks (or the whole tensor)
and reads the overlapping parts of what was saved, so a checkpoint written under one layout loads
under another. A key's saved blocks must cover its tensor exactly once: a checkpoint that misses part
of a tensor is refused.

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
import math
import os
import re
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "Pieces",
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


@dataclass
class Pieces:
    """Blocks of one global tensor of ``shape`` and ``dtype`` held by this rank: ``(offsets, block)`` pairs.

    ``offsets`` is where ``block`` starts in the global tensor; blocks may be views (of parameters, of
    optimizer shards). Saving writes each block; loading fills each block in place with its part of
    the saved tensor, whatever blocks it was saved in. A rank may hold no block of a key (a replica
    that leaves the writing to another rank).
    """

    shape: torch.Size
    dtype: torch.dtype
    blocks: list[tuple[tuple[int, ...], torch.Tensor]] = field(default_factory=list)

    def __post_init__(self):
        self.shape = torch.Size(self.shape)
        for offsets, block in self.blocks:
            if not isinstance(block, torch.Tensor) or block.dtype != self.dtype:
                got = block.dtype if isinstance(block, torch.Tensor) else type(block).__name__
                raise TypeError(f"Pieces: every block must be a {self.dtype} tensor, received {got}")
            if (
                len(offsets) != len(self.shape)
                or block.dim() != len(self.shape)
                or any(o < 0 or o + n > size for o, n, size in zip(offsets, block.shape, self.shape))
            ):
                raise ValueError(
                    f"Pieces: a block of shape {tuple(block.shape)} at offsets {tuple(offsets)} does not fit in a "
                    f"tensor of shape {tuple(self.shape)}"
                )

    def chunks(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=b.shape) for o, b in self.blocks]

    def block_at(self, index: MetadataIndex) -> torch.Tensor:
        i = index.index
        if i is None or i >= len(self.blocks) or tuple(self.blocks[i][0]) != tuple(index.offset):
            i = next(j for j, (o, _) in enumerate(self.blocks) if tuple(o) == tuple(index.offset))
        return self.blocks[i][1]


class _PiecesSavePlanner(DefaultSavePlanner):
    """DCP's planner, plus a write item per block of each :class:`Pieces` value."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        whole = {k: v for k, v in self.state_dict.items() if not isinstance(v, Pieces)}
        items = list(create_default_local_save_plan(whole, self.is_coordinator).items)
        for fqn, value in self.state_dict.items():
            if isinstance(value, Pieces):
                for (offsets, _), chunk in zip(value.blocks, value.chunks()):
                    data = TensorWriteData(
                        chunk=chunk, properties=TensorProperties(dtype=value.dtype), size=value.shape
                    )
                    index = MetadataIndex(fqn, torch.Size(offsets))
                    items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        value = self.state_dict[index.fqn]
        return value.block_at(index).detach() if isinstance(value, Pieces) else super().lookup_object(index)


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
    root: str | os.PathLike, step: int, state: dict, meta: dict | None = None, *, keep: int = 2
) -> Path:
    """Save ``state`` as checkpoint ``step`` under ``root`` atomically; a collective over the default group.

    ``state`` maps keys to tensors or :class:`Pieces`; a key present on several ranks as a tensor must
    hold the same tensor on each (DCP writes it once); a key's pieces over all ranks must cover its
    tensor once. ``meta`` (JSON-serialisable) goes into the manifest. Afterwards only the ``keep`` newest
    complete checkpoints remain. Returns the checkpoint's directory.
    """
    bad = [k for k, v in state.items() if not isinstance(v, (torch.Tensor, Pieces))]
    if bad:
        raise TypeError(
            f"save_checkpoint: state values must be tensors or Pieces, received {type(state[bad[0]]).__name__} "
            f"for {bad[0]!r}"
        )
    root = Path(root)
    final, tmp = root / f"step_{step:08d}", root / f"{_TMP_PREFIX}step_{step:08d}"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    writer = FileSystemWriter(tmp, sync_files=True)
    with _single_process_quietly():
        dcp.save(state, storage_writer=writer, planner=_PiecesSavePlanner(), no_dist=not dist.is_initialized())
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
    """DCP's planner, plus reads into the blocks of :class:`Pieces` values; an entry stored as pickled bytes
    is refused instead of ``torch.load``-ed."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DCP's set-up rewrites values of types it does not know (to None), in place: keep Pieces out of it
        pieces = {k: v for k, v in state_dict.items() if isinstance(v, Pieces)}
        super().set_up_planner({k: v for k, v in state_dict.items() if k not in pieces}, metadata, is_coordinator)
        self.state_dict = {**self.state_dict, **pieces}

    def create_local_plan(self) -> LoadPlan:
        whole = {k: v for k, v in self.state_dict.items() if not isinstance(v, Pieces)}
        items = list(create_default_local_load_plan(whole, self.metadata, not self.allow_partial_load).items)
        for fqn, value in self.state_dict.items():
            if isinstance(value, Pieces):
                items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], value.chunks())
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict[index.fqn]
        return value.block_at(index) if isinstance(value, Pieces) else super().lookup_tensor(index)

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; refusing to load it")


def _check_fits(path: Path, state: dict) -> None:
    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    for key, value in state.items():
        md = metadata.get(key)
        if md is None:
            raise CheckpointError(f"checkpoint {path} has no entry {key!r} (saved from a different model?)")
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint entry {key!r} of {path} is a pickled object; refusing to load it")
        shape, dtype = (value.shape, value.dtype)
        if tuple(md.size) != tuple(shape) or md.properties.dtype != dtype:
            raise CheckpointError(
                f"checkpoint entry {key!r} of {path} is {md.properties.dtype} {tuple(md.size)}, "
                f"expected {dtype} {tuple(shape)} (saved from a different model?)"
            )
        stored = sum(math.prod(chunk.sizes) for chunk in md.chunks)
        if stored != math.prod(md.size):
            raise CheckpointError(
                f"checkpoint entry {key!r} of {path} holds {stored} of its {math.prod(md.size)} elements "
                "(its pieces do not cover the tensor once)"
            )


def load_checkpoint(path: str | os.PathLike, state: dict) -> dict:
    """Fill the tensors and :class:`Pieces` blocks of ``state`` in place from checkpoint ``path``; a collective
    over the default group.

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
