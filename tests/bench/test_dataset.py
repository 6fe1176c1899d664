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
