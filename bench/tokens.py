"""``python -m tessel.bench.tokens TEXT OUT --tokenizer DIR [--doc-sep SEP]``: a text as a model's token ids.

The training job reads a text as bytes, or a flat little-endian file of token ids (``--tokens uint16`` or
``uint32``, nanoGPT's ``train.bin``). A run that starts from a pretrained model (``--init``) must see that model's
tokens: this writes them. ``DIR`` is a Hugging Face tokenizer saved on disk (a checkpoint's directory holds one:
``tokenizer.json`` and its config), read with ``transformers.AutoTokenizer`` and nothing downloaded.

The text (UTF-8) is tokenized as the tokenizer does by default (a Llama tokenizer puts its BOS first). With
``--doc-sep`` (backslash escapes read, as the job's ``--doc-sep``) it is cut into documents there, each tokenized
on its own and ended with the tokenizer's end-of-sequence token (or ``--eos-id``), so that ``--doc-token EOS``
packs them as documents. Token ids are written as uint16 where the tokenizer's vocabulary fits (at most 65536 ids),
else uint32. The job's flags for the file are printed last, e.g.::

    --data OUT --tokens uint16 --doc-token 2

Refused by name, before anything is written (exit 2): a tokenizer that cannot be read, a text that is not UTF-8,
``--doc-sep`` with no end-of-sequence token, an existing ``OUT``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from .train_args import _escaped_bytes

PROG = "python -m tessel.bench.tokens"
BATCH = 256  # documents tokenized per call


class TokenizeError(ValueError):
    """A bad argument: the message says which and why."""


def load_tokenizer(path):
    """The Hugging Face tokenizer saved in ``path``, read from disk alone."""
    import transformers

    path = Path(path)
    if not path.is_dir():
        raise TokenizeError(f"--tokenizer must be a directory holding a saved tokenizer, received {path}")
    try:
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise TokenizeError(f"--tokenizer {path}: no tokenizer could be read there ({exc})") from None


def tokenize(text_path, out, tokenizer, *, doc_sep: bytes | None = None, eos_id: int | None = None) -> dict:
    """Write ``text_path``'s tokens to ``out`` (see the module); returns ``{"tokens", "count", "doc_token"}``, the
    job's ``--tokens`` format, the number of tokens and the id that ends each document (None without ``doc_sep``)."""
    text_path, out = Path(text_path), Path(out)
    if out.exists():
        raise TokenizeError(f"OUT must not exist (it is not overwritten), received {out}")
    try:
        text = text_path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise TokenizeError(f"TEXT must be a file, received {text_path}") from None
    except UnicodeDecodeError as exc:
        raise TokenizeError(f"TEXT must be UTF-8 text: {text_path} is not ({exc})") from None
    vocab = len(tokenizer)
    if eos_id is None and doc_sep is not None:
        eos_id = tokenizer.eos_token_id
        if eos_id is None:
            raise TokenizeError("--doc-sep ends each document with the tokenizer's end-of-sequence token, and this "
                                "tokenizer has none: pass --eos-id")  # fmt: skip
    if eos_id is not None and not (isinstance(eos_id, int) and 0 <= eos_id < vocab):
        raise TokenizeError(f"--eos-id must be a token id in [0, {vocab}), received {eos_id!r}")
    fmt = "uint16" if vocab <= 2**16 else "uint32"
    docs = [text] if doc_sep is None else [d for d in text.split(doc_sep.decode("utf-8")) if d]
    pieces = []
    for start in range(0, len(docs), BATCH):
        for ids in tokenizer(docs[start : start + BATCH])["input_ids"]:
            pieces.append(np.asarray(ids + ([eos_id] if doc_sep is not None else []), dtype=np.int64))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2 ** (16 if fmt == "uint16" else 32)):
        raise TokenizeError(f"the tokenizer gave ids outside {fmt} (largest {tokens.max()})")
    tmp = out.with_name(out.name + ".partial")
    tokens.astype(np.dtype(fmt).newbyteorder("<")).tofile(tmp)
    tmp.replace(out)
    return {"tokens": fmt, "count": int(tokens.size), "doc_token": eos_id if doc_sep is not None else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    parser.add_argument("text", help="the UTF-8 text to tokenize")
    parser.add_argument("out", help="the token file to write (must not exist)")
    parser.add_argument("--tokenizer", required=True, help="a directory holding a saved Hugging Face tokenizer")
    parser.add_argument("--doc-sep", type=_escaped_bytes, default=None,
                        help="cut the text into documents here, each ended with the end-of-sequence token")  # fmt: skip
    parser.add_argument("--eos-id", type=int, default=None, help="the id ending each document (default: the "
                        "tokenizer's end-of-sequence token)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        done = tokenize(args.text, args.out, load_tokenizer(args.tokenizer), doc_sep=args.doc_sep, eos_id=args.eos_id)
    except TokenizeError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    flags = f"--data {args.out} --tokens {done['tokens']}"
    if done["doc_token"] is not None:
        flags += f" --doc-token {done['doc_token']}"
    print(f"wrote {done['count']} tokens to {args.out}; train on them with: {flags}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
