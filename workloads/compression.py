"""Compressed source files: gzip, zstd, bzip2 and xz, recognised by their content.

Corpora are often shipped compressed (`.jsonl.gz`, The Pile's `.jsonl.zst`, `.txt.xz`), and
a compressed file read as text fails with an error about invalid UTF-8 that does not say
why. The codec is taken from the file's first bytes, not its name, so a misnamed file still
reads. gzip, bzip2 and xz come from the standard library; zstd from pyarrow (already a
dependency, for Parquet), which also reads multi-frame files.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import re
import zlib
from typing import BinaryIO

# Magic numbers. bzip2's includes the first block's own magic ("1AY&SY", the digits of pi),
# or that of an empty stream, so a text file that merely starts with "BZh" stays text.
_GZIP = b"\x1f\x8b"
_ZSTD = b"\x28\xb5\x2f\xfd"
# A zstd skippable frame (magic 0x184D2A50-5F, little-endian): pzstd starts every file with
# one, holding the frame sizes it reads back in parallel.
_ZSTD_SKIPPABLE = re.compile(rb"[\x50-\x5f]\x2a\x4d\x18")
_XZ = b"\xfd7zXZ\x00"
_BZIP2 = re.compile(rb"BZh[1-9](\x31\x41\x59\x26\x53\x59|\x17\x72\x45\x38\x50\x90)")

# File name endings of compressed files: format "auto" looks through them (a.jsonl.zst is
# JSONL); reading itself goes by content.
SUFFIXES = (".gz", ".zst", ".zstd", ".bz2", ".xz")

# What a truncated or corrupt compressed stream raises while it is read (pyarrow's zstd
# reader raises OSError).
ERRORS = (OSError, EOFError, zlib.error, lzma.LZMAError)


def codec_of(head: bytes) -> str | None:
    """The compression whose magic number `head` (a file's first 10 bytes) starts with."""
    if head.startswith(_GZIP):
        return "gzip"
    if head.startswith(_ZSTD) or _ZSTD_SKIPPABLE.match(head):
        return "zstd"
    if head.startswith(_XZ):
        return "xz"
    return "bzip2" if _BZIP2.match(head) else None


def open_decompressed(fh: BinaryIO) -> tuple[BinaryIO, str | None]:
    """`fh` (binary, at offset 0) as a stream of its decompressed bytes, and the codec's
    name; `fh` itself and None when it is not compressed. A decompressing stream has
    `peek` (not every one can seek back)."""
    if hasattr(fh, "peek"):
        # Peeked bytes stay in the buffer: reading and seeking back would discard the
        # buffer of a store's reader and fetch the object's first chunk again.
        head = fh.peek(10)[:10]
    else:
        head = fh.read(10)
        fh.seek(0)
    codec = codec_of(head)
    if codec == "gzip":
        return gzip.GzipFile(fileobj=fh, mode="rb"), codec
    if codec == "zstd":
        import pyarrow as pa  # only zstd sources pay for the import

        raw = pa.CompressedInputStream(pa.PythonFile(_Borrowed(fh), mode="r"), "zstd")
        return io.BufferedReader(raw), codec
    if codec == "xz":
        return lzma.LZMAFile(fh), codec
    if codec == "bzip2":
        return bz2.BZ2File(fh), codec
    return fh, None


class _Borrowed:
    """`fh` lent to pyarrow, whose reader closes the file under it when it is done: the
    caller still needs `fh` afterwards (to check the file did not change while read)."""

    def __init__(self, fh: BinaryIO):
        self._fh = fh
        self.closed = False

    def __getattr__(self, name: str) -> object:
        return getattr(self._fh, name)

    def close(self) -> None:
        self.closed = True


def strip_suffix(name: str) -> str:
    """`name` without a compression suffix: `a.jsonl.zst` -> `a.jsonl` (case kept)."""
    lower = name.lower()
    for suffix in SUFFIXES:
        if lower.endswith(suffix):
            return name[: -len(suffix)]
    return name
