"""Text and JSONL documents out of a (decompressed) byte stream, for `iter_documents` in
workloads/documents.py, and the UTF-8 check every reader uses (Parquet's too).

Lines end at LF only, and every failure names the file and the line or byte offset at
fault; see workloads/documents.py for the formats and their options.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, BinaryIO

from workloads.sources import DatasetError, SourceFile

if TYPE_CHECKING:
    from workloads.documents import ReadOptions

_BOM = b"\xef\xbb\xbf"
_SURROGATE = re.compile("[\ud800-\udfff]")

# Both ways of giving the option: a config's field and `tpupipe shard`'s flag.
REPLACE_HINT = (
    "set dataset.errors=replace, or --errors replace with tpupipe shard, to substitute U+FFFD"
)


def skip_bom(stream: BinaryIO) -> int:
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


BINARY_HEAD_BYTES = 4096  # how much of a text source `refuse_binary` looks at
BINARY_NUL_SHARE = 0.1  # the share of NUL bytes there that means "not text"


def refuse_binary(stream: BinaryIO, src: SourceFile, where: str) -> None:
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
    if _valid_utf8(data):
        return data
    try:
        data.decode("utf-8")  # the invalid byte's offset, and the replacement below
        return data
    except UnicodeDecodeError as exc:
        if errors == "replace":
            return data.decode("utf-8", "replace").encode("utf-8")
        raise DatasetError(
            f"{place}: invalid UTF-8 at byte offset {offset + exc.start} {where} ({REPLACE_HINT})"
        ) from None


# Bytes checked per decode: a document decoded whole was a str of up to 4 bytes per
# character (an emoji makes every character 4 bytes), so a 200 MB single-line document of
# mixed text needed 818 MB to shard, against 509 MB for ASCII. Checked by the megabyte, the
# str made is at most 4 MB, whatever the document's size.
_UTF8_CHUNK = 1 << 20


def _valid_utf8(data: bytes) -> bool:
    """Whether `data` is valid UTF-8, decoded a chunk at a time (only whether: where it is
    not is found by `utf8` with one whole decode, on that rare path)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    view, last = memoryview(data), max(len(data) - _UTF8_CHUNK, 0)
    try:
        for start in range(0, len(data), _UTF8_CHUNK):
            decoder.decode(view[start : start + _UTF8_CHUNK], final=start >= last)
    except UnicodeDecodeError:
        return False
    return True


def _numbered_lines(stream: BinaryIO, offset: int) -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset of the line, line without its line break), the first
    line at `offset`. The break is the "\n" and at most one "\r" before it: a "\r\n"
    ending counts as "\n", any other "\r" is text ("a\r\r\n" is the line "a\r")."""
    for number, raw in enumerate(stream, start=1):
        line = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1] if raw.endswith(b"\n") else raw
        yield number, offset, line
        offset += len(raw)


def line_of_document(stream: BinaryIO, index: int) -> int | None:
    """The line number of document `index` (from 0) of a JSONL or line-per-document text
    `stream` (positioned after any byte order mark): its `index`-th non-blank line, blank
    lines being skipped by both readers alike. None if the stream has fewer."""
    for number, _, line in _numbered_lines(stream, 0):
        if line.strip():
            if not index:
                return number
            index -= 1
    return None


def text_lines(
    stream: BinaryIO, src: SourceFile, cfg: ReadOptions, where: str, start: int
) -> Iterator[bytes]:
    """Each line of `stream` that is not blank, as one document (text_unit="line")."""
    for number, offset, line in _numbered_lines(stream, start):
        if line.strip():
            yield utf8(line, f"{src.uri}:{number}", offset, cfg.errors, where)


def jsonl_documents(
    stream: BinaryIO, src: SourceFile, cfg: ReadOptions, where: str, start: int
) -> Iterator[bytes]:
    """The `text_field` of each JSON object in `stream`, one per line; blank lines skipped."""
    field = cfg.text_field
    for number, offset, line in _numbered_lines(stream, start):
        if not line.strip():
            continue
        place = f"{src.uri}:{number}"
        text = utf8(line, place, offset, cfg.errors, where).decode("utf-8")
        try:
            obj = _loads(text)
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


def _loads(text: str) -> object:
    """`json.loads`, taking integers of any length, as JSON does: Python refuses int() of
    over 4300 digits (a ValueError), and a line was refused for such a number in a field
    other than the text. Only then is it parsed again, keeping such integers as floats
    (a number all the same, and float() has no such limit): a parse_int for every line
    would cost a Python call per integer."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except ValueError:
        return json.loads(text, parse_int=_any_int)


def _any_int(digits: str) -> int | float:
    return int(digits) if len(digits) < 4000 else float(digits)


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
            f"valid UTF-8 ({REPLACE_HINT})"
        ) from None


def _json_type(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return names.get(type(value), "a number")
