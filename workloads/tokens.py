"""Tokenizers: byte-level by default, or a Hugging Face `tokenizers` JSON file.

Either way a document becomes its token ids followed by one end-of-document (EOD) id. The
byte tokenizer's ids are the UTF-8 bytes (0..255) and EOD is 256. A `tokenizer.json` is
read from the given path only (never fetched from a hub); its EOD is one new id after its
whole vocabulary (added tokens included), so no id the tokenizer emits is ever mistaken for
a document boundary.

Stored ids: the byte tokenizer's as uint8, its EOD (256, which a byte cannot hold) written as
0xFF, a byte that never occurs in UTF-8 (every document reaching the tokenizer is valid UTF-8:
`errors=strict` refuses the rest, `errors=replace` substitutes U+FFFD). Half the bytes of
uint16: sharding on a corpus of files is bound by the bytes it writes (spill files, shards,
their hashes), and the shards are half the size to upload, copy and read. A tokenizer file's
ids as uint16 while the vocabulary (with EOD) fits, else uint32. Readers map the stored EOD
back to `eod_token` (`workloads.input`), so the model sees the same ids either way.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from workloads.sources import DatasetError
from workloads.vocab import BYTE_VOCAB_SIZE, EOD_TOKEN

UINT16_VOCAB = 1 << 16


class EncodeError(DatasetError):
    """The tokenizer failed on a document; `index` is its position in the batch given to
    `encode`, so the caller can name the document's place (`document_place`)."""

    def __init__(self, message: str, index: int = 0):
        super().__init__(message)
        self.index = index


@dataclass(frozen=True)
class TokenizerSpec:
    """A tokenizer as the dataset records it; small and picklable, so each worker process
    loads the file itself (once) rather than receiving it with every job.

    Attributes:
        kind: "bytes" or "huggingface".
        vocab_size: Ids in use, EOD included (the model's embedding rows before padding).
        eod_token: The end-of-document id.
        dtype: "uint8" (bytes only), "uint16" or "uint32", the stored token type.
        path: The tokenizer file (huggingface only).
        sha256: sha256 of the tokenizer file (huggingface only): what the fingerprint
            covers, and what every worker checks the file it loads against.
        ignores: the file's settings turned off ("truncation", "padding"): documents
            are encoded whole. Recorded, and fingerprinted, only when there are some, so
            other datasets keep their fingerprints, while one built before they were
            turned off (cut or padded documents) is not taken for the new one.
    """

    kind: str
    vocab_size: int
    eod_token: int
    dtype: str
    path: str | None = None
    sha256: str | None = None
    ignores: tuple[str, ...] = ()

    @property
    def stored_eod(self) -> int:
        """The id written for EOD: `eod_token`, or 0xFF where ids are stored as uint8."""
        return STORED_BYTE_EOD if self.dtype == "uint8" else self.eod_token

    def manifest_entry(self) -> dict:
        """What `manifest.json` records under `tokenizer`."""
        out = {"kind": self.kind, "vocab_size": self.vocab_size, "eod_token": self.eod_token}
        if self.kind == "huggingface":
            out.update(path=self.path, sha256=self.sha256)
        if self.ignores:
            out["ignores"] = list(self.ignores)
        return out

    def fingerprint_entry(self) -> list:
        """What changes the token ids: the kind and the file's content, not its path (and
        the settings of the file turned off, if any); as `manifest.records_fields` reads
        it from a manifest."""
        entry = [self.kind, self.vocab_size, self.eod_token, self.sha256]
        return [*entry, list(self.ignores)] if self.ignores else entry


STORED_BYTE_EOD = 0xFF  # never a byte of UTF-8 (nor are 0xC0, 0xC1, 0xF5-0xFE)
BYTES = TokenizerSpec("bytes", BYTE_VOCAB_SIZE, EOD_TOKEN, "uint8")
# Average document length from which the byte tokenizer copies documents one at a time
# rather than scattering them all at once (a numpy call per document costs ~0.6 us).
LONG_DOCUMENT_BYTES = 512


def load_tokenizer(path: str | os.PathLike | None) -> TokenizerSpec:
    """The byte tokenizer for `None`, else the Hugging Face tokenizer in file `path`.

    Raises:
        DatasetError: naming the file, if it is missing or not a tokenizers JSON file.
    """
    if path is None:
        return BYTES
    path = os.path.abspath(path)
    sha256, hf, ignored = _read(path)
    # One past the largest id, not the number of entries: a vocabulary with gaps in its
    # ids (a token removed by hand) gave EOD the id of a real token.
    ids = hf.get_vocab(with_added_tokens=True).values()
    eod = max(hf.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)
    vocab = eod + 1
    return TokenizerSpec(
        kind="huggingface",
        vocab_size=vocab,
        eod_token=eod,
        dtype="uint16" if vocab <= UINT16_VOCAB else "uint32",
        path=path,
        sha256=sha256,
        ignores=ignored,
    )


def _read(path: str) -> tuple[str, Any, tuple[str, ...]]:
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise DatasetError(
            f"tokenizer file {path} cannot be read ({exc.strerror}); give the path of a Hugging "
            "Face tokenizer.json (hub names are not downloaded)"
        ) from None
    try:
        from tokenizers import Tokenizer  # only a tokenizer file pays for the import

        hf = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as exc:  # tokenizers raises a bare Exception for a bad file
        raise DatasetError(
            f"tokenizer file {path} is not a tokenizers JSON file: {_why(raw, exc)}"
        ) from None
    return hashlib.sha256(raw).hexdigest(), hf, _whole_documents(hf)


def _why(raw: bytes, exc: Exception) -> str:
    """Why tokenizers refused `raw`. Its parser reports a JSON object without a
    tokenizer's fields ({"hello": 1}) as "expected `,` or `}` at line 1 column 9", which
    reads as a syntax error: such a file is said to be JSON of another kind."""
    try:
        parsed = json.loads(raw)
    except ValueError:  # not JSON (or not UTF-8): tokenizers' own words say where
        return str(exc)
    if isinstance(parsed, dict) and "model" not in parsed:
        keys = ", ".join(sorted(parsed)[:8]) or "none"
        return f"it is JSON, but not a tokenizer: it has no 'model' (its keys: {keys})"
    return str(exc)


def _whole_documents(hf: Any) -> tuple[str, ...]:
    """Turn off the file's truncation and padding; returns which of them it set.

    Documents are encoded whole and packed: a file's truncation (to an inference model's
    context) cut them short, and its padding was packed as text, both without a word and
    with the packing efficiency still 1.0. Many hub tokenizer.json files set them.
    """
    ignored = tuple(name for name in ("truncation", "padding") if getattr(hf, name) is not None)
    hf.no_truncation()
    hf.no_padding()
    return ignored


_LOADED: dict[str, Any] = {}  # per process, by sha256: parsed once, not per batch


def hf_tokenizer(spec: TokenizerSpec) -> Any:
    """The `tokenizers.Tokenizer` in `spec.path`, loaded once per process.

    Raises:
        DatasetError: the file cannot be read or parsed, or its sha256 is not `spec.sha256`.
    """
    if spec.sha256 not in _LOADED:
        sha256, hf, _ = _read(spec.path)
        if sha256 != spec.sha256:
            # Shards made with another tokenizer than the fingerprint names would lie.
            raise DatasetError(f"tokenizer file {spec.path} changed during sharding; run again")
        _LOADED[sha256] = hf
    return _LOADED[spec.sha256]


def _encode_error(spec: TokenizerSpec, hf: Any, texts: list[str], exc: Exception) -> EncodeError:
    """The error for a batch the tokenizer failed on, naming its first failing document
    (found by encoding one at a time: only after a failure, so the batch stays fast)."""
    message = f"tokenizer file {spec.path} cannot encode it: {exc}"
    for index, text in enumerate(texts):
        try:
            hf.encode(text, add_special_tokens=False)
        except Exception:
            return EncodeError(message, index)
    return EncodeError(message)  # only the batch fails: name its first document


def encode(spec: TokenizerSpec, docs: list[bytes]) -> tuple[np.ndarray, int]:
    """Token ids of `docs`, each followed by EOD, concatenated.

    Args:
        spec: The tokenizer.
        docs: UTF-8 documents.

    Returns:
        (ids as a little-endian `spec.dtype` array, token count of the last document
        including its EOD, or 0 when `docs` is empty).

    Raises:
        EncodeError: the tokenizer failed on a document (its `index` says which).
    """
    dtype = np.dtype(spec.dtype).newbyteorder("<")
    if not docs:
        return np.empty(0, dtype=dtype), 0
    if spec.kind == "bytes" and sum(map(len, docs)) >= LONG_DOCUMENT_BYTES * len(docs):
        # Long documents (whole files): one copy each, no temporaries. 18x faster than
        # the scatter below for 17 KB files, and 8x slower for 50-byte lines.
        eod = np.array([spec.stored_eod], dtype=dtype)
        parts = [part for doc in docs for part in (np.frombuffer(doc, np.uint8), eod)]
        return np.concatenate(parts, dtype=dtype), len(docs[-1]) + 1
    if spec.kind == "bytes":
        lengths = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
        flat = np.frombuffer(b"".join(docs), dtype=np.uint8)
    else:
        hf = hf_tokenizer(spec)
        texts = [d.decode("utf-8") for d in docs]
        try:
            encodings = hf.encode_batch_fast(texts, add_special_tokens=False)
        except Exception as exc:  # tokenizers raises a bare Exception, e.g. no unk token
            raise _encode_error(spec, hf, texts, exc) from None
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(docs))
        flat = np.fromiter(
            itertools.chain.from_iterable(e.ids for e in encodings),
            dtype=np.int64,
            count=int(lengths.sum()),
        )
        if flat.size and int(flat.max()) >= spec.eod_token:
            raise DatasetError(
                f"tokenizer {spec.path} emitted id {int(flat.max())} outside its vocabulary "
                f"of {spec.eod_token}"
            )
    out = np.empty(int(lengths.sum()) + len(docs), dtype=dtype)
    eod_at = np.cumsum(lengths + 1) - 1
    is_token = np.ones(len(out), dtype=bool)
    is_token[eod_at] = False
    out[is_token] = flat
    out[eod_at] = spec.stored_eod
    return out, int(lengths[-1]) + 1
