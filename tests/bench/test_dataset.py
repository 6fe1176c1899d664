"""``ByteDataset``: the training job's byte windows, and their packed documents (``doc_sep``)."""

import pytest
import torch

from tessel.bench.dataset import ByteDataset


@pytest.fixture
def text_file(tmp_path):
    gen = torch.Generator().manual_seed(0)
    pieces = []
    for n in torch.randint(1, 40, (60,), generator=gen).tolist():  # documents of 1 to 39 letters, "||" after each
        pieces.append(bytes(torch.randint(97, 123, (n,), generator=gen).tolist()) + b"||")
    path = tmp_path / "docs.txt"
    path.write_bytes(b"".join(pieces) + b"tail")
    return path


def _expected_documents(data: bytes, sep: bytes) -> list[int]:
    """Each byte's document number, counted by hand: a document ends after each separator."""
    docs, current, i = [], 0, 0
    while i < len(data):
        if data.startswith(sep, i):
            docs.extend([current] * len(sep))
            i += len(sep)
            current += 1
        else:
            docs.append(current)
            i += 1
    return docs


def test_documents_end_after_each_separator(text_file):
    data = text_file.read_bytes()
    ds = ByteDataset(text_file, seq_len=16, doc_sep=b"||")
    assert ds.documents.tolist() == _expected_documents(data, b"||")
    assert ds.documents[-1] == 60  # the 60 documents, then the unterminated tail
    assert ByteDataset(text_file, seq_len=16).documents is None


def test_document_batch_numbers_each_rows_documents_and_ignores_targets_across_them(text_file):
    ds = ByteDataset(text_file, seq_len=24, doc_sep=b"||")
    docs = torch.tensor(_expected_documents(text_file.read_bytes(), b"||"))
    for step in range(5):
        x, y = ds.batch(step, seed=3, batch_size=8)
        dx, dy, seg = ds.document_batch(step, seed=3, batch_size=8)
        assert torch.equal(dx, x) and seg.shape == x.shape and seg.dtype == torch.int64
        for row in range(8):
            start = next(s for s in range(len(docs)) if torch.equal(ds.tokens[s : s + 25].long(), torch.cat(
                [x[row], y[row, -1:]])))  # fmt: skip
            here = docs[start : start + 25]
            assert torch.equal(seg[row], here[:-1] - here[0])
            crossing = here[1:] != here[:-1]
            assert torch.equal(dy[row][crossing], torch.full((int(crossing.sum()),), -100))
            assert torch.equal(dy[row][~crossing], y[row][~crossing])
    # the rows of two data-parallel ranks are the whole batch's
    whole = ds.document_batch(1, seed=3, batch_size=8)
    halves = [ds.document_batch(1, seed=3, batch_size=8, dp_rank=r, dp_size=2) for r in range(2)]
    for i in range(3):
        assert torch.equal(torch.cat([halves[0][i], halves[1][i]]), whole[i])


def test_documents_need_a_separator(text_file):
    with pytest.raises(ValueError, match="built without doc_sep"):
        ByteDataset(text_file, seq_len=16).document_batch(0, seed=0, batch_size=2)
    for bad in (b"", "||"):
        with pytest.raises(ValueError, match="doc_sep must be non-empty bytes"):
            ByteDataset(text_file, seq_len=16, doc_sep=bad)


@pytest.fixture
def two_part_file(tmp_path):
    """300 lowercase bytes, then 100 uppercase ones: a quarter of the file, which val_fraction=0.25 holds out."""
    gen = torch.Generator().manual_seed(1)
    low, up = torch.randint(97, 123, (300,), generator=gen), torch.randint(65, 91, (100,), generator=gen)
    path = tmp_path / "two_parts.txt"
    path.write_bytes(bytes(low.tolist()) + bytes(up.tolist()))
    return path


def test_validation_windows_never_touch_the_training_bytes(two_part_file):
    ds = ByteDataset(two_part_file, seq_len=20, val_fraction=0.25)
    assert ds.splits == {"train": (0, 300), "val": (300, 400)}
    for step in range(50):  # targets included: no training window reaches past the cut, no validation one before
        x, y = ds.batch(step, seed=3, batch_size=8)
        assert bool(((x >= 97) & (y >= 97)).all())
        x, y = ds.batch(step, seed=3, batch_size=8, split="val")
        assert bool(((x < 97) & (y < 97)).all())


def test_validation_batches_are_fixed_and_split_over_ranks_like_training_ones(two_part_file):
    ds = ByteDataset(two_part_file, seq_len=20, val_fraction=0.25)
    whole = ds.batch(2, seed=3, batch_size=8, split="val")
    halves = [ds.batch(2, seed=3, batch_size=8, dp_rank=r, dp_size=2, split="val") for r in range(2)]
    assert torch.equal(torch.cat([h[0] for h in halves]), whole[0])
    assert torch.equal(ds.batch(2, seed=3, batch_size=8, split="val")[1], whole[1])
    assert not torch.equal(ds.batch(3, seed=3, batch_size=8, split="val")[0], whole[0])


def test_without_a_validation_split_the_training_windows_are_unchanged(two_part_file):
    ds = ByteDataset(two_part_file, seq_len=20)
    gen = torch.Generator().manual_seed(3 * 2**32 + 4)
    starts = torch.randint(0, 400 - 20, (8,), generator=gen)  # what every earlier run drew
    assert torch.equal(ds.batch(4, seed=3, batch_size=8)[0][:, 0], ds.tokens[starts].long())
    with pytest.raises(ValueError, match=r"split must be one of \['train'\], received 'val'"):
        ds.batch(0, seed=3, batch_size=8, split="val")


def test_validation_document_batches_number_their_own_documents(text_file):
    """A validation window's documents are numbered from its first byte's, as a training window's are, and the
    windows start past the cut (the same generator as training, over the validation bytes)."""
    ds = ByteDataset(text_file, seq_len=16, doc_sep=b"||", val_fraction=0.3)
    lo, hi = ds.splits["val"]
    assert (lo, hi) == (len(ds) - round(len(ds) * 0.3), len(ds))
    x, y, ids = ds.document_batch(1, seed=0, batch_size=4, split="val")
    starts = torch.randint(lo, hi - 16, (4,), generator=torch.Generator().manual_seed(1))
    where = starts[:, None] + torch.arange(17)
    docs = ds.documents[where]
    assert torch.equal(x, ds.tokens[where[:, :-1]].long())
    assert torch.equal(ids, docs[:, :-1] - docs[:, :1])
    assert torch.equal(y == -100, docs[:, 1:] != docs[:, :-1])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"val_fraction": 1.0}, r"val_fraction must be in \[0, 1\), received 1.0"),
        ({"val_fraction": -0.1}, r"val_fraction must be in \[0, 1\), received -0.1"),
        ({"val_fraction": 0.01}, "the val split of .* holds 4 tokens, fewer than seq_len \\+ 1 = 21"),
        ({"val_fraction": 0.99}, "the train split of .* holds 4 tokens, fewer than seq_len \\+ 1 = 21"),
    ],
)
def test_bad_splits_are_refused(two_part_file, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ByteDataset(two_part_file, seq_len=20, **kwargs)


@pytest.fixture(params=["uint16", "uint32"])
def token_file(tmp_path, request):
    """1000 random token ids below 70000 (below 60000 for uint16), one in ten the separator 7."""
    gen = torch.Generator().manual_seed(2)
    limit = 60000 if request.param == "uint16" else 70000
    ids = torch.randint(0, limit, (1000,), generator=gen)
    ids[torch.rand(1000, generator=gen) < 0.1] = 7
    array = ids.numpy().astype("<u2" if request.param == "uint16" else "<u4")
    path = tmp_path / f"tokens.{request.param}.bin"
    array.tofile(path)
    return path, request.param, ids


def test_token_files_are_read_as_their_ids(token_file):
    """Windows of a token file are its ids (wider than a byte), drawn as a byte file's windows are."""
    path, fmt, ids = token_file
    ds = ByteDataset(path, seq_len=20, tokens=fmt, val_fraction=0.2)
    assert len(ds) == 1000 and ds.max_token() == int(ids.max()) and ds.splits["val"] == (800, 1000)
    for split, (lo, hi) in ds.splits.items():
        x, y = ds.batch(5, seed=9, batch_size=6, split=split)
        starts = torch.randint(lo, hi - 20, (6,), generator=torch.Generator().manual_seed(9 * 2**32 + 5))
        window = ids[starts[:, None] + torch.arange(21)]
        assert x.dtype == torch.int64 and torch.equal(x, window[:, :-1]) and torch.equal(y, window[:, 1:])


def test_token_files_end_a_document_at_each_separator_token(token_file):
    path, fmt, ids = token_file
    ds = ByteDataset(path, seq_len=30, tokens=fmt, doc_sep=7)
    docs = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum((ids == 7).long(), 0)[:-1]])  # by hand
    x, y, seg = ds.document_batch(3, seed=1, batch_size=5)
    starts = torch.randint(0, 1000 - 30, (5,), generator=torch.Generator().manual_seed(2**32 + 3))
    where = starts[:, None] + torch.arange(31)
    assert torch.equal(x, ids[where[:, :-1]])
    assert torch.equal(seg, docs[where[:, :-1]] - docs[where[:, :1]])
    crossing = docs[where[:, 1:]] != docs[where[:, :-1]]
    assert torch.equal(y, ids[where[:, 1:]].masked_fill(crossing, -100)) and bool(crossing.any())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tokens": "int8"}, r"tokens must be one of \['bytes', 'uint16', 'uint32'\], received 'int8'"),
        ({"tokens": "uint16", "doc_sep": 70000}, r"doc_sep of a uint16 token file must be a token id in \[0, 65536\)"),
        ({"tokens": "uint16", "doc_sep": b"\n"}, "must be a token id in"),
        ({"tokens": "uint32"}, "holds 1001 bytes, not a whole number of uint32 tokens"),
    ],
)
def test_bad_token_files_are_refused(tmp_path, kwargs, match):
    path = tmp_path / "odd.bin"
    path.write_bytes(bytes(1000 if kwargs.get("tokens") != "uint32" else 1001))
    with pytest.raises(ValueError, match=match):
        ByteDataset(path, seq_len=8, **kwargs)
