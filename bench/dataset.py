"""Training data for ``python -m tessel.bench.train``: a text file read as byte tokens (vocabulary 256), or
a file of token ids (``tokens="uint16"`` or ``"uint32"``: a flat little-endian array, as nanoGPT's data
preparation writes it), read through a memory map.

Legend: ``G`` global batch (sequences per step, all data-parallel ranks together), ``B = G / dp`` this
rank's rows, ``S`` sequence length.

Step ``k`` of a run seeded ``seed`` draws the ``G`` window starts from a generator seeded with
``(seed, k)`` alone, and data-parallel rank ``r`` takes rows ``[r·B, (r+1)·B)``. The batch of a step is
therefore a pure function of ``(seed, step, dp rank, dp size)``: a resumed run needs nothing but the
step to continue where it stopped, and every layout sees the same global batch, so the loss of a step
does not depend on how the world is split.

With ``val_fraction > 0`` the file's last tokens are held out: training windows lie wholly before the
cut, validation windows (``split="val"``, drawn the same way, batch ``j`` from ``(seed, j)``) wholly
after it, so no token a validation window reads, target included, is ever trained on.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

__all__ = ["DEFAULT_DATASET", "TOKEN_FORMATS", "ByteDataset"]

DEFAULT_DATASET = Path(__file__).with_name("data") / "python_reference.txt"

_SEED_LIMIT = 2**31  # (seed, step) are packed into one 64-bit generator seed: seed · 2³² + step


TOKEN_FORMATS = {"bytes": np.uint8, "uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


class ByteDataset:
    """A file's tokens as int64, cut into ``(inputs, targets)`` windows of ``seq_len`` tokens.

    ``tokens``: ``"bytes"`` (each byte a token: the vocabulary is 256) or ``"uint16"`` / ``"uint32"`` (the
    file is a flat little-endian array of token ids, memory-mapped: only the windows drawn are read).
    ``targets`` is ``inputs`` shifted by one token. ``val_fraction`` (in ``[0, 1)``) of the tokens, at the
    file's end, form the validation split. Raises ``ValueError`` when a split holds fewer than ``seq_len + 1``
    tokens or the file is not a whole number of tokens. ``doc_sep`` ends a document at each occurrence and
    :meth:`document_batch` gives the rows' documents as well: bytes for a text, one token id (an int, e.g.
    GPT-2's ``<|endoftext|>``, 50256) for a file of token ids.
    """

    def __init__(self, path: str | Path = DEFAULT_DATASET, *, seq_len: int, doc_sep: bytes | int | None = None,
                 val_fraction: float = 0.0, tokens: str = "bytes"):  # fmt: skip
        path = Path(path)
        if seq_len < 1:
            raise ValueError(f"ByteDataset: seq_len must be a positive int, received {seq_len}")
        if not 0 <= val_fraction < 1:
            raise ValueError(f"ByteDataset: val_fraction must be in [0, 1), received {val_fraction}")
        if tokens not in TOKEN_FORMATS:
            raise ValueError(f"ByteDataset: tokens must be one of {sorted(TOKEN_FORMATS)}, received {tokens!r}")
        width = np.dtype(TOKEN_FORMATS[tokens]).itemsize
        if path.stat().st_size % width:
            raise ValueError(f"ByteDataset: {path} holds {path.stat().st_size} bytes, not a whole number of "
                             f"{tokens} tokens ({width} bytes each)")  # fmt: skip
        if tokens == "bytes":
            data = np.frombuffer(path.read_bytes(), dtype=np.uint8).copy()
        elif path.stat().st_size:  # copy-on-write: a writable array (for torch), the file never written
            data = np.memmap(path, dtype=TOKEN_FORMATS[tokens], mode="c")
        else:
            data = np.zeros(0, dtype=TOKEN_FORMATS[tokens])
        cut = data.size - round(data.size * val_fraction)
        self.splits = {"train": (0, cut)} | ({"val": (cut, data.size)} if val_fraction else {})
        for name, (lo, hi) in self.splits.items():
            if hi - lo < seq_len + 1:
                raise ValueError(f"ByteDataset: the {name} split of {path} holds {hi - lo} tokens, fewer than "
                                 f"seq_len + 1 = {seq_len + 1}")  # fmt: skip
        self.path, self.seq_len = path, seq_len
        self._data = data
        self.tokens = torch.from_numpy(data)  # the file's dtype; widened per window
        self._offsets = torch.arange(seq_len + 1)
        self.documents, self._sep_token = None, None
        if doc_sep is not None and tokens == "bytes":
            self.documents = _document_index(data, doc_sep)
        elif doc_sep is not None:
            self._sep_token = _check_token("doc_sep", doc_sep, tokens)

    def __len__(self) -> int:
        return self._data.size

    def max_token(self) -> int:
        """The largest token id in the file (one pass over it)."""
        return int(self._data.max())

    def _windows(self, where: torch.Tensor) -> torch.Tensor:
        """The tokens at ``where`` (int64 positions) as int64, read from the file's array."""
        return torch.from_numpy(self._data[where.numpy()].astype(np.int64))

    def batch(
        self, step: int, *, seed: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(inputs [B, S], targets [B, S])`` int64 rows of step ``step``'s global batch of
        ``split`` (``"train"``, or ``"val"`` when the dataset holds one)."""
        mine = self._starts(step, seed, batch_size, dp_rank, dp_size, split)
        window = self._windows(mine[:, None] + self._offsets)  # [B, S + 1]
        return window[:, :-1], window[:, 1:]

    def document_batch(
        self, step: int, *, seed: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`batch`'s rows with their documents: ``(inputs, targets, segment_ids)``, all ``[B, S]`` int64.

        ``segment_ids`` numbers the documents along each row from 0 (the ``doc_sep`` the dataset was
        built with ends each document, itself included), for ``GPT(idx, segment_ids)``; a target that is
        the first token of the next document is ``-100`` (ignored by the loss): no token is asked to
        predict a document it cannot see.
        """
        if self.documents is None and self._sep_token is None:
            raise ValueError("ByteDataset.document_batch: the dataset was built without doc_sep")
        mine = self._starts(step, seed, batch_size, dp_rank, dp_size, split)
        where = mine[:, None] + self._offsets
        window = self._windows(where)  # [B, S + 1]
        if self._sep_token is None:
            docs = self.documents[where].long()
        else:  # a document ends with (and includes) each separator token: count those before each position
            ends = (window == self._sep_token).long()
            docs = torch.cumsum(ends, dim=1) - ends
        targets = window[:, 1:].masked_fill(docs[:, 1:] != docs[:, :-1], -100)
        return window[:, :-1], targets, docs[:, :-1] - docs[:, :1]

    def _starts(self, step: int, seed: int, batch_size: int, dp_rank: int, dp_size: int, split: str) -> torch.Tensor:
        """This rank's window starts of step ``step`` in ``split``: rows ``[r·B, (r+1)·B)`` of the global batch's."""
        if split not in self.splits:
            raise ValueError(f"ByteDataset.batch: split must be one of {sorted(self.splits)}, received {split!r}")
        if not 0 <= seed < _SEED_LIMIT:
            raise ValueError(f"ByteDataset.batch: seed must be in [0, 2**31), received {seed}")
        if not 0 <= step < 2**32:
            raise ValueError(f"ByteDataset.batch: step must be in [0, 2**32), received {step}")
        if batch_size % dp_size:
            raise ValueError(
                f"ByteDataset.batch: batch_size={batch_size} is not divisible by the data-parallel size {dp_size}"
            )
        gen = torch.Generator().manual_seed(seed * 2**32 + step)
        lo, hi = self.splits[split]
        starts = torch.randint(lo, hi - self.seq_len, (batch_size,), generator=gen)
        rows = batch_size // dp_size
        return starts[dp_rank * rows : (dp_rank + 1) * rows]


def _check_token(name: str, value, tokens: str) -> int:
    limit = 2 ** (8 * np.dtype(TOKEN_FORMATS[tokens]).itemsize)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
        raise ValueError(f"ByteDataset: {name} of a {tokens} token file must be a token id in [0, {limit}), "
                         f"received {value!r}")  # fmt: skip
    return value


def _document_index(data: np.ndarray, doc_sep: bytes) -> torch.Tensor:
    """Each byte's document number: a document ends with (and includes) each occurrence of ``doc_sep``."""
    if not isinstance(doc_sep, bytes) or not doc_sep:
        raise ValueError(f"ByteDataset: doc_sep must be non-empty bytes, received {doc_sep!r}")
    text, ends, at = data.tobytes(), [], 0
    while (found := text.find(doc_sep, at)) >= 0:
        at = found + len(doc_sep)
        ends.append(at)
    begins = np.zeros(data.size, dtype=np.int32)
    begins[[e for e in ends if e < data.size]] = 1
    return torch.from_numpy(np.cumsum(begins, dtype=np.int32))
