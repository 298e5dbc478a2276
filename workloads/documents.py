"""Reading documents out of source files: plain text, JSONL (either maybe compressed) and Parquet.

Every reader yields each document's text as UTF-8 `bytes`, and every failure names its place:
the file, plus the line (JSONL, text lines), the row (Parquet) or the byte offset (invalid
UTF-8). With `errors="strict"` invalid UTF-8 is an error; with `errors="replace"` each bad
sequence becomes U+FFFD, as Python's `bytes.decode(errors="replace")` does.

Formats (`ReadOptions.format`, from `DatasetConfig`; "auto" picks one per file by its name,
see `file_format`):
    text: the whole file is one document (`text_unit="file"`), or each line that is not
        blank is one (`text_unit="line"`; the line break is not part of it). Lines end at
        LF ("\\n"; a CRLF ending counts as one), not at a lone CR ("\\r"): changing that
        would change the bytes of existing datasets, so `lone_cr_hint` explains instead.
    jsonl: one JSON object per line, its text in `text_field`; blank lines are skipped.
    parquet: the text is in column `text_field` (string or binary, plain, large, view or
        dictionary-encoded); a null is an error. Rows are numbered from 1, like lines.

Compression (gzip, zstd, bzip2, xz: `workloads.compression`) is detected from the content
(text and jsonl); byte offsets then count decompressed bytes. A UTF-8 byte order mark at the
start of a text or JSONL file is not part of its text (offsets still count it).

This file chooses the reader; the readers are in documents_text.py (text, JSONL and the
UTF-8 check) and documents_parquet.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO

from workloads import compression
from workloads.documents_parquet import parquet_documents
from workloads.documents_text import (
    jsonl_documents,
    line_of_document,
    refuse_binary,
    skip_bom,
    text_lines,
    utf8,
)
from workloads.sources import (
    DatasetError,
    SourceFile,
    SourceStore,
    changed,
    check_unchanged,
    open_source,
    unreadable,
)

if TYPE_CHECKING:  # not at run time: worker processes need no pydantic
    from workloads.config import DatasetConfig

# The names format "auto" reads as JSONL (also compressed: a.jsonl.zst) and as Parquet; any
# other file is text. `.json` is not among them: such a file may hold one document or JSON
# lines, so the user says which.
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
# Every name ending "auto" reads as JSONL, compressed or not, for one `endswith`: a run asks
# for each file's format several times (fingerprint, manifest, reading), in its serial part too.
_JSONL_ENDINGS = tuple(j + c for j in JSONL_SUFFIXES for c in ("", *compression.SUFFIXES))


@dataclass(frozen=True)
class ReadOptions:
    """How documents are read out of a source file: the `DatasetConfig` fields of that name."""

    format: str = "text"
    text_unit: str = "file"
    text_field: str = "text"
    errors: str = "strict"

    @classmethod
    def of(cls, cfg: DatasetConfig) -> ReadOptions:
        """The read options of a dataset config."""
        return cls(cfg.format, cfg.text_unit, cfg.text_field, cfg.errors)

    def format_of(self, uri: str) -> str:
        """The format the file at `uri` is read in (`file_format`)."""
        return file_format(uri, self.format)

    def whole_files(self, uri: str) -> bool:
        """Whether the file at `uri` is read as one single document."""
        return self.format_of(uri) == "text" and self.text_unit == "file"


def file_format(name: str, configured: str) -> str:
    """The format a file is read in: `configured`, or for "auto" the one its name ends with
    (case aside, after any compression suffix): `JSONL_SUFFIXES` are jsonl,
    `PARQUET_SUFFIXES` parquet, any other text."""
    if configured != "auto":
        return configured
    lower = name.lower()
    if lower.endswith(_JSONL_ENDINGS):
        return "jsonl"
    return "parquet" if lower.endswith(PARQUET_SUFFIXES) else "text"


def iter_documents(fh: BinaryIO, src: SourceFile, opts: ReadOptions) -> Iterator[bytes]:
    """Yield every document of one open source file, in file order.

    Args:
        fh: The file, opened in binary mode at offset 0.
        src: Which file it is (for messages).
        opts: `format`, `text_unit`, `text_field` and `errors`.

    Yields:
        Each document's text, valid UTF-8.

    Raises:
        DatasetError: naming the file and line, row or byte offset at fault.
    """
    fmt = opts.format_of(src.uri)
    try:
        if fmt == "parquet":
            yield from parquet_documents(fh, src, opts)
            return
        stream, codec = compression.open_decompressed(fh)
        where = f"of the {codec}-decompressed file" if codec else "of the file"
        start = skip_bom(stream)
        if fmt == "text":
            refuse_binary(stream, src, where)
        if fmt == "text" and opts.text_unit == "file":
            yield utf8(stream.read(), src.uri, start, opts.errors, where)
        elif fmt == "text":
            yield from text_lines(stream, src, opts, where, start)
        else:
            yield from jsonl_documents(stream, src, opts, where, start)
    except FileNotFoundError as exc:  # a store's object replaced while read: not bad data
        raise changed(src) from exc
    except compression.ERRORS as exc:  # a corrupt compressed stream; a store's refusal
        raise unreadable(src, exc) from exc


def document_place(
    src: SourceFile, index: int, opts: ReadOptions, store: SourceStore | None = None
) -> str:
    """Where document `index` (from 0) of `src` is, as the readers' own errors name it: the
    file (a whole-file document), `file:line` (JSONL, text lines) or `file: row N: column`
    (Parquet), for an error found after reading, such as the tokenizer's.

    Readers do not keep each document's line number: every document of every run would pay
    for what only an error needs. The file is read again instead, up to that line, once the
    error is raised. If that fails (the file changed meanwhile, or cannot be read now), the
    document is named by its number in the file.

    Args:
        src: The file.
        index: The document's position among the file's documents.
        opts: How the file was read.
        store: Reads `src` if it is remote.
    """
    fmt = opts.format_of(src.uri)
    if fmt == "text" and opts.text_unit == "file":
        return src.uri
    if fmt == "parquet":  # every row is a document (a null is an error)
        return f"{src.uri}: row {index + 1}: column {opts.text_field!r}"
    try:
        with open_source(src, store) as fh:
            stream = compression.open_decompressed(fh)[0]
            skip_bom(stream)
            number = line_of_document(stream, index)
            check_unchanged(fh, src)
    except (DatasetError, *compression.ERRORS):
        number = None
    return f"{src.uri}:{number}" if number else f"{src.uri}: document {index + 1}"


def lone_cr_hint(
    files: list[SourceFile], opts: ReadOptions, store: SourceStore | None = None
) -> str:
    """A note for a "too few documents" error: the first file read in line mode whose first
    64 KiB hold a CR but no LF (old Mac line endings), so it is one single line.

    Lines end at LF only, and that stays (it would change existing datasets' bytes), so
    the user is told why the lines were not split. Only called once a run has failed, and
    only its first 16 files are looked at: it must not cost a second pass over a corpus.

    Returns:
        "" or a sentence starting with "; ", to append to the error message.
    """
    for src in files[:16]:
        if opts.format_of(src.uri) != "text" or opts.text_unit != "line":
            continue
        try:
            with open_source(src, store) as fh:
                head = compression.open_decompressed(fh)[0].read(1 << 16)
        except (DatasetError, *compression.ERRORS):
            continue  # only a hint: the error it is added to stands anyway
        if b"\r" in head and b"\n" not in head:
            return (
                f"; {src.uri} has '\\r' line endings and no '\\n': with text_unit=line, lines "
                "end at '\\n' only, so it is one line (convert it, e.g. tr '\\r' '\\n')"
            )
    return ""
