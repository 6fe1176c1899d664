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
        ({"val_fraction": 0.01}, "the val split of .* holds 4 bytes, fewer than seq_len \\+ 1 = 21"),
        ({"val_fraction": 0.99}, "the train split of .* holds 4 bytes, fewer than seq_len \\+ 1 = 21"),
    ],
)
def test_bad_splits_are_refused(two_part_file, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ByteDataset(two_part_file, seq_len=20, **kwargs)
