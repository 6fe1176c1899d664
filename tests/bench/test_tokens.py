"""``python -m tessel.bench.tokens``: a text written as a tokenizer's ids, for the job's ``--tokens``.

The tokenizer is a small byte-level BPE trained here on the bundled text and saved as Hugging Face saves one
(nothing is downloaded). The file must hold exactly the ids the tokenizer gives the text (each document's, then the
end-of-sequence id, with ``--doc-sep``), and the job must train on it with the printed flags.
"""

import numpy as np
import pytest

from tessel.bench.dataset import DEFAULT_DATASET, ByteDataset
from tessel.bench.tokens import load_tokenizer, main, tokenize
from tests.bench.test_train import _losses, _ok, _train

TEXT = DEFAULT_DATASET.read_text()[:6000]


def _saved_tokenizer(path, eos: bool = True):
    """A byte-level BPE of 320 ids trained on ``TEXT`` (``<s>`` first in every sequence, ``</s>`` its
    end-of-sequence token unless ``eos`` is False), saved with ``save_pretrained``."""
    import tokenizers
    import transformers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False, initial_alphabet=alphabet
    )
    tok.train_from_iterator([TEXT], trainer)
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    kw = {"eos_token": "</s>"} if eos else {}
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="<unk>", **kw)
    fast.save_pretrained(path)
    return path


def test_documents_are_written_as_the_tokenizers_ids_each_ended_by_its_eos(tmp_path, capsys):
    tok_dir = _saved_tokenizer(tmp_path / "tok")
    text = tmp_path / "a.txt"
    text.write_text(TEXT)
    out = tmp_path / "a.bin"
    assert main([str(text), str(out), "--tokenizer", str(tok_dir), "--doc-sep", "\\n\\n"]) == 0
    tokenizer = load_tokenizer(tok_dir)
    eos = tokenizer.eos_token_id
    docs = [d for d in TEXT.split("\n\n") if d]
    want = [i for d in docs for i in [*tokenizer(d)["input_ids"], eos]]
    got = np.fromfile(out, dtype="<u2")
    assert got.tolist() == want and len(docs) > 10 and want[0] == 1  # <s> first in each document
    assert capsys.readouterr().out.strip().endswith(f"--data {out} --tokens uint16 --doc-token {eos}")
    data = ByteDataset(out, seq_len=16, tokens="uint16", doc_sep=eos)  # the job's reader takes it as it is
    assert len(data) == len(want) and data.max_token() == max(want)
    # the whole text as one sequence: no end-of-sequence id
    whole = tmp_path / "b.bin"
    assert main([str(text), str(whole), "--tokenizer", str(tok_dir)]) == 0
    assert np.fromfile(whole, dtype="<u2").tolist() == tokenizer(TEXT)["input_ids"]


class _Wide:
    """The same tokenizer with a vocabulary past uint16's (as Gemma's 262144 ids are)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.eos_token_id = tokenizer, tokenizer.eos_token_id

    def __len__(self):
        return 2**16 + 1

    def __call__(self, *args, **kwargs):
        return self.tokenizer(*args, **kwargs)


def test_a_vocabulary_past_uint16_is_written_as_uint32(tmp_path):
    tokenizer = load_tokenizer(_saved_tokenizer(tmp_path / "tok"))
    text = tmp_path / "a.txt"
    text.write_text(TEXT)
    done = tokenize(text, tmp_path / "a.bin", _Wide(tokenizer), doc_sep=b"\n\n", eos_id=7)
    want = [i for d in TEXT.split("\n\n") if d for i in [*tokenizer(d)["input_ids"], 7]]
    assert done == {"tokens": "uint32", "count": len(want), "doc_token": 7}
    assert np.fromfile(tmp_path / "a.bin", dtype="<u4").tolist() == want


@pytest.mark.multiprocess
def test_the_job_trains_on_the_written_tokens(tmp_path):
    tok_dir = _saved_tokenizer(tmp_path / "tok")
    text = tmp_path / "a.txt"
    text.write_text(TEXT)
    out = tmp_path / "a.bin"
    assert main([str(text), str(out), "--tokenizer", str(tok_dir), "--doc-sep", "\\n\\n"]) == 0
    eos = str(load_tokenizer(tok_dir).eos_token_id)
    flags = ["--data", str(out), "--tokens", "uint16", "--doc-token", eos, "--vocab-size", "320"]
    _ok(_train(tmp_path / "run", "--hf", "llama", *flags, "--steps", "2", "--seq-len", "32", "--batch-size", "4"))
    losses = _losses(tmp_path / "run")
    assert len(losses) == 2 and losses[0] == pytest.approx(np.log(320), rel=0.1)  # a fresh model over 320 ids


def test_bad_input_is_refused_before_anything_is_written(tmp_path, capsys):
    tok_dir = _saved_tokenizer(tmp_path / "tok")
    text = tmp_path / "a.txt"
    text.write_text(TEXT)
    out = tmp_path / "out.bin"

    def refused(words, *argv):
        assert main(list(argv)) == 2
        assert words in capsys.readouterr().err
        assert not out.exists()

    refused("--tokenizer must be a directory", str(text), str(out), "--tokenizer", str(tmp_path / "none"))
    refused("no tokenizer could be read there", str(text), str(out), "--tokenizer", str(tmp_path))
    (tmp_path / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    refused("TEXT must be UTF-8 text", str(tmp_path / "latin.txt"), str(out), "--tokenizer", str(tok_dir))
    refused("TEXT must be a file", str(tmp_path / "missing.txt"), str(out), "--tokenizer", str(tok_dir))
    refused("--eos-id must be a token id in [0, 320), received 320", str(text), str(out), "--tokenizer",
            str(tok_dir), "--doc-sep", "\\n", "--eos-id", "320")  # fmt: skip
    no_eos = _saved_tokenizer(tmp_path / "no-eos", eos=False)
    refused("this tokenizer has none: pass --eos-id", str(text), str(out), "--tokenizer", str(no_eos), "--doc-sep",
            "\\n")  # fmt: skip
    out.write_bytes(b"")
    assert main([str(text), str(out), "--tokenizer", str(tok_dir)]) == 2
    assert "OUT must not exist" in capsys.readouterr().err and out.read_bytes() == b""
