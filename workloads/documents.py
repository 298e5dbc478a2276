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
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO

from workloads import compression
from workloads.sources import DatasetError, SourceFile, SourceStore, changed, open_source

if TYPE_CHECKING:  # not at run time: worker processes need no pydantic
    from workloads.config import DatasetConfig

# The names format "auto" reads as JSONL (also compressed: a.jsonl.zst) and as Parquet; any
# other file is text. `.json` is not among them: such a file may hold one document or JSON
# lines, so the user says which.
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
_BOM = b"\xef\xbb\xbf"
_SURROGATE = re.compile("[\ud800-\udfff]")


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
    if compression.strip_suffix(lower).endswith(JSONL_SUFFIXES):
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
            yield from _parquet(fh, src, opts)
            return
        stream, codec = compression.open_decompressed(fh)
        where = f"of the {codec}-decompressed file" if codec else "of the file"
        start = _skip_bom(stream)
        if fmt == "text":
            _refuse_binary(stream, src, where)
        if fmt == "text" and opts.text_unit == "file":
            yield utf8(stream.read(), src.uri, start, opts.errors, where)
        elif fmt == "text":
            yield from _lines(stream, src, opts, where, start)
        else:
            yield from _jsonl(stream, src, opts, where, start)
    except FileNotFoundError as exc:  # a store's object replaced while read: not bad data
        raise changed(src) from exc
    except compression.ERRORS as exc:  # e.g. a truncated or corrupt compressed stream
        raise DatasetError(f"cannot read dataset source {src.uri}: {exc}") from exc


def _skip_bom(stream: BinaryIO) -> int:
    """Skip a byte order mark at the start of `stream` (some Windows tools write one);
    returns its length, 0 or 3. Checked once per file, not per line."""
    n = len(_BOM)
    if _peek(stream, n) != _BOM:
        return 0
    stream.read(n)
    return n


def _peek(stream: BinaryIO, n: int) -> bytes:
    """Up to the next `n` bytes of `stream`, leaving its position where it was.
    Decompressing streams cannot all seek back, but they can peek, as can files (local and
    from a store, whose buffer a seek back would discard); a stream without `peek` must
    seek."""
    if hasattr(stream, "peek"):
        return stream.peek(n)[:n]
    at = stream.tell()
    head = stream.read(n)
    stream.seek(at)
    return head


BINARY_HEAD_BYTES = 4096  # how much of a text source `_refuse_binary` looks at
BINARY_NUL_SHARE = 0.1  # the share of NUL bytes there that means "not text"


def _refuse_binary(stream: BinaryIO, src: SourceFile, where: str) -> None:
    """Refuse a text source whose first bytes are largely NUL: a tar archive (a natural
    `--source corpus.tar.gz`: gzip is unwrapped, and its 512-byte headers are mostly NUL)
    or UTF-16 text without a byte order mark is valid UTF-8 and was trained on as text,
    NUL tokens and tar headers included. Stray NUL bytes in real text stay allowed (no
    file of the stdlib corpus has any in its first 4 KiB)."""
    head = _peek(stream, BINARY_HEAD_BYTES)
    if head and head.count(0) > BINARY_NUL_SHARE * len(head):
        raise DatasetError(
            f"dataset source {src.uri} does not look like text: {head.count(0)} of the first "
            f"{len(head)} bytes {where} are NUL (an archive such as .tar, a binary file, or "
            "UTF-16 text?): extract archives, and give text as UTF-8"
        )


def utf8(data: bytes, place: str, offset: int, errors: str, where: str = "of the file") -> bytes:
    """Return `data` if it is valid UTF-8, else its repaired form or an error.

    Args:
        data: Raw bytes of a document or line.
        place: Where it comes from, e.g. `corpus/a.txt` or `corpus/a.jsonl:17`.
        offset: Byte offset of `data` in its file, so the message points into the file.
        errors: "strict" or "replace".
        where: How the offset is counted, for the message.

    Raises:
        DatasetError: `errors="strict"` and `data` holds invalid UTF-8.
    """
    if data.isascii():  # the common case, checked far faster than a decode
        return data
    try:
        data.decode("utf-8")
        return data
    except UnicodeDecodeError as exc:
        if errors == "replace":
            return data.decode("utf-8", "replace").encode("utf-8")
        raise DatasetError(
            f"{place}: invalid UTF-8 at byte offset {offset + exc.start} {where} "
            "(set dataset.errors=replace to substitute U+FFFD)"
        ) from None


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


def _numbered_lines(stream: BinaryIO, offset: int) -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset of the line, line without its line break), the first
    line at `offset`."""
    for number, raw in enumerate(stream, start=1):
        line = raw.rstrip(b"\r\n") if raw.endswith(b"\n") else raw
        yield number, offset, line
        offset += len(raw)


def _lines(
    stream: BinaryIO, src: SourceFile, cfg: ReadOptions, where: str, start: int
) -> Iterator[bytes]:
    for number, offset, line in _numbered_lines(stream, start):
        if line.strip():
            yield utf8(line, f"{src.uri}:{number}", offset, cfg.errors, where)


def _jsonl(
    stream: BinaryIO, src: SourceFile, cfg: ReadOptions, where: str, start: int
) -> Iterator[bytes]:
    field = cfg.text_field
    for number, offset, line in _numbered_lines(stream, start):
        if not line.strip():
            continue
        place = f"{src.uri}:{number}"
        text = utf8(line, place, offset, cfg.errors, where).decode("utf-8")
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            # Lines end at LF only: a file of CR-ended records is one line of many objects.
            hint = (
                "; the line holds '\\r' line breaks: lines end at '\\n' only (convert it, "
                "e.g. tr '\\r' '\\n')"
                if "\r" in text.rstrip("\r")
                else ""
            )
            raise DatasetError(
                # Some of json's messages end in "at" ("Unterminated string starting at").
                f"{place}: malformed JSON: {exc.msg.removesuffix(' at')} at column {exc.colno}"
                f"{hint}"
            ) from None
        except ValueError as exc:  # an integer longer than int() converts (4300 digits)
            reason = str(exc).split(";")[0]  # not the advice to raise Python's limit
            raise DatasetError(f"{place}: unreadable JSON: {reason}") from None
        except RecursionError:
            raise DatasetError(f"{place}: unreadable JSON: nested too deeply") from None
        if not isinstance(obj, dict):
            raise DatasetError(f"{place}: expected a JSON object, got {_json_type(obj)}")
        value = obj[field] if field in obj else _nested(obj, field)
        if value is _MISSING:
            keys = ", ".join(sorted(obj)[:10]) or "none"
            raise DatasetError(f"{place}: no field {field!r} (fields: {keys}); set text_field")
        if not isinstance(value, str):
            raise DatasetError(f"{place}: field {field!r} is {_json_type(value)}, not a string")
        yield _encode(value, place, field, cfg.errors)


_MISSING = object()


def _nested(obj: dict, field: str) -> object:
    """The value at a dotted `field` such as `meta.text` (obj["meta"]["text"]), or _MISSING.
    Only reached when no key is `field` itself, so a key holding a dot still wins."""
    node: object = obj
    for part in field.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _encode(value: str, place: str, field: str, errors: str) -> bytes:
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError:
        # Only a lone surrogate escape such as "\ud800" gets here: JSON allows it, UTF-8 not.
        if errors == "replace":
            return _SURROGATE.sub("\ufffd", value).encode("utf-8")
        raise DatasetError(
            f"{place}: field {field!r} holds an unpaired surrogate escape, which is not "
            "valid UTF-8 (set dataset.errors=replace to substitute U+FFFD)"
        ) from None


def _json_type(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return names.get(type(value), "a number")


def _parquet(fh: BinaryIO, src: SourceFile, cfg: ReadOptions) -> Iterator[bytes]:
    import pyarrow as pa  # only Parquet sources pay for the import
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    field = cfg.text_field
    try:
        pf = pq.ParquetFile(fh)
    except FileNotFoundError:
        raise  # the object changed while read (iter_documents says so)
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{src.uri}: not a readable Parquet file: {exc}") from None
    schema = pf.schema_arrow
    path = _column_path(schema, field, src.uri)
    if path is None:
        columns = ", ".join(schema.names[:10])
        raise DatasetError(f"{src.uri}: no column {field!r} (columns: {columns}); set text_field")
    kind = path[-1].type
    if pa.types.is_dictionary(kind):  # e.g. a low-cardinality column written by pandas
        kind = kind.value_type
    t = pa.types
    is_text = t.is_string(kind) or t.is_large_string(kind) or t.is_string_view(kind)
    is_binary = t.is_binary(kind) or t.is_large_binary(kind) or t.is_binary_view(kind)
    if not (is_text or is_binary):
        raise DatasetError(f"{src.uri}: column {field!r} has type {kind}, not text")
    # The column is read by its index among the file's leaf columns, not by name: pyarrow
    # takes a name as a dotted path prefix, so "meta.text" would also select the child of
    # a struct `meta` (and read it first), and a name given twice has no single column.
    # `column_paths` splits each leaf's path into its names, so a dot inside one is kept.
    names = [f.name for f in path]
    leaves = [i for i, p in enumerate(pf.reader.column_paths) if p == names]
    if len(leaves) != 1:  # not expected once the names are unique, but never a KeyError
        raise DatasetError(f"{src.uri}: column {field!r} is not one Parquet column")
    leaf = leaves[0]
    row = 1
    for group in range(pf.num_row_groups):
        try:
            column = pf.reader.read_row_group(group, column_indices=[leaf]).column(0)
            for child in path[1:]:  # a nested column is read as its parents' structs
                column = pc.struct_field(column, child.name)
        except FileNotFoundError:
            raise
        except (pa.ArrowException, OSError) as exc:
            raise DatasetError(
                f"{src.uri}: cannot read column {field!r} of row group {group}: {exc}"
            ) from None
        # Pyarrow reads a string column without checking its UTF-8: one vectorised check
        # per row group, and only a group that fails is checked value by value.
        checked = is_text and _valid_utf8(column)
        for value in column.cast(pa.large_binary()).to_pylist():
            if value is None:
                raise DatasetError(f"{src.uri}: row {row}: column {field!r} is null")
            if not checked:
                place = f"{src.uri}: row {row}: column {field!r}"
                value = utf8(value, place, 0, cfg.errors, "of the value")
            yield value
            row += 1


def _column_path(schema: object, field: str, uri: str) -> list | None:
    """The fields from the top-level column down to `field`: one for a column of that name
    (taken first), more for a dotted path into struct columns (`meta.text`); None if there
    is none.

    Raises:
        DatasetError: naming the file and the column, if a name on the way is given twice
            (a file may hold two columns of one name; which is the text is unknowable).
    """
    import pyarrow as pa

    parts = [field] if field in schema.names else field.split(".")
    path: list = []
    parent = schema  # then each struct type on the way down; None below a leaf
    for part in parts:
        found = parent.get_all_field_indices(part) if parent is not None else []
        if not found:
            return None
        if len(found) > 1:
            name = ".".join([*(f.name for f in path), part])
            raise DatasetError(
                f"{uri}: column {name!r} appears {len(found)} times; the text column must "
                "have a name of its own"
            )
        path.append(parent.field(found[0]))
        parent = path[-1].type if pa.types.is_struct(path[-1].type) else None
    return path


def _valid_utf8(column: object) -> bool:
    import pyarrow as pa

    try:
        column.cast(pa.large_string()).validate(full=True)  # also decodes a dictionary
    except pa.ArrowInvalid:
        return False
    return True
