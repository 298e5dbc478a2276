"""Which files a dataset is made of: expanding source entries and opening them.

A source entry is a local file, a directory (every regular file below it), a glob (`**`
allowed), `stdlib` (this Python's standard library `.py` files, a corpus every machine has) or
a `scheme://` URI such as `gs://bucket/prefix` (every object under the prefix; `*`, `?` and
`[...]` match within the listing). Local paths are handled here; URIs go through a
`SourceStore` the caller passes in, so this module never imports a cloud SDK.

Each file gets a `key`: its path relative to the root of the entry that named it (a file
entry: its base name). The key, not the absolute path, decides a document's train/eval split,
so the same corpus unpacked in another directory or on another machine gives the same shards.
Files are ordered by entry, then by key; a file named by two entries counts once, for the
first.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from typing import BinaryIO, Protocol

_GLOB = re.compile(r"[*?\[]")


class DatasetError(ValueError):
    """Bad input for sharding or reading a dataset; the message names the place at fault."""


class StoredObject(Protocol):
    """One object of a listing (what `infra.storage.ObjectInfo` provides)."""

    uri: str
    size: int
    generation: int


class SourceStore(Protocol):
    """Reads `scheme://` sources; `infra.storage` has the implementations."""

    def list(self, prefix: str) -> Iterable[StoredObject]:
        """Every object whose URI starts with `prefix`, with its size and generation."""
        ...

    def open(self, uri: str, generation: int | None = None) -> BinaryIO:
        """A binary, seekable reader of `uri`, of exactly `generation` when given."""
        ...


@dataclass(frozen=True)
class SourceFile:
    """One source file and what the dataset fingerprint covers of it.

    Attributes:
        uri: Absolute local path, or the URI given by the store.
        key: Path relative to the root of the entry that named the file.
        size: Bytes.
        version: `st_mtime_ns` for a local file, the object generation for a URI.
    """

    uri: str
    key: str
    size: int
    version: int

    @property
    def remote(self) -> bool:
        """True when the file is read through a `SourceStore`."""
        return "://" in self.uri


def resolve_sources(sources: list[str], store: SourceStore | None = None) -> list[SourceFile]:
    """Expand source entries into the ordered, de-duplicated files they name.

    Args:
        sources: Entries as described in the module docstring.
        store: Lists and opens `scheme://` entries; needed only when there are any.

    Returns:
        The files, by entry and then by key.

    Raises:
        DatasetError: An entry matches no file, a file is not readable, or a URI entry
            has no store to read it.
    """
    if not sources:
        raise DatasetError("the dataset has no sources: give at least one file, directory or glob")
    found: dict[str, SourceFile] = {}
    for entry in sources:
        files = _expand_uri(entry, store) if "://" in entry else _expand_local(entry)
        if not files:
            raise DatasetError(f"dataset source {entry!r} matches no file")
        for f in sorted(files, key=lambda f: f.key):
            found.setdefault(f.uri, f)
    return list(found.values())


def _expand_local(entry: str) -> list[SourceFile]:
    if entry == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        return _walk(root, root, skip={"site-packages"}, suffix=".py")
    if os.path.isdir(entry):
        return _walk(entry, entry)
    if os.path.isfile(entry) or os.path.islink(entry):
        return [_local(entry, os.path.dirname(os.path.abspath(entry)))]
    root = _static_prefix(entry)
    out = []
    for match in sorted(glob.glob(entry, recursive=True)):
        if os.path.isdir(match):
            out.extend(_walk(match, root))
        elif os.path.isfile(match):  # sockets, fifos and dangling links are not documents
            out.append(_local(match, root))
    return out


def _static_prefix(pattern: str) -> str:
    """The directory part of a glob before its first wildcard: the root keys are relative to."""
    head = _GLOB.split(pattern, maxsplit=1)[0]
    return os.path.dirname(head) or "."


def _walk(
    top: str, root: str, skip: frozenset[str] | set[str] = frozenset(), suffix: str = ""
) -> list[SourceFile]:
    """Regular files below directory `top` (not following directory links), keyed relative
    to `root`. `os.scandir` knows each entry's type without a `stat`, which matters for
    corpora of many small files."""
    out, pending = [], [top]
    while pending:
        directory = pending.pop()
        try:
            with os.scandir(directory) as it:
                entries = list(it)
        except OSError as exc:  # os.walk would skip the directory silently
            raise DatasetError(
                f"dataset source directory {directory} is not readable: {exc.strerror}"
            ) from exc
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                if e.name not in skip:
                    pending.append(e.path)
            elif e.name.endswith(suffix) and e.is_file():
                out.append(_local(e.path, root, e))
    return out


def _local(path: str, root: str, entry: os.DirEntry | None = None) -> SourceFile:
    path = os.path.abspath(path)
    try:
        st = entry.stat() if entry is not None else os.stat(path)
        # os.access does not see every reason a read fails, but it is the cheap, early check;
        # the read itself reports anything it misses, also naming the file.
        if not os.access(path, os.R_OK):
            raise PermissionError("permission denied")
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise DatasetError(f"dataset source file {path} is not readable: {reason}") from exc
    base = os.path.abspath(root) + os.sep
    rel = path[len(base) :] if path.startswith(base) else os.path.relpath(path, base)
    return SourceFile(path, rel.replace(os.sep, "/"), st.st_size, st.st_mtime_ns)


def _expand_uri(entry: str, store: SourceStore | None) -> list[SourceFile]:
    if store is None:
        scheme = entry.split("://", 1)[0]
        raise DatasetError(
            f"dataset source {entry!r} needs a storage backend for {scheme}:// "
            "(the pipeline and `tpupipe shard` provide one)"
        )
    pattern = entry if _GLOB.search(entry) else None
    prefix = entry if pattern is None else _GLOB.split(entry, maxsplit=1)[0]
    # Keys are relative to the prefix taken as a directory (like a local directory entry),
    # or to a pattern's last "/" before its first wildcard.
    root = entry.rstrip("/") + "/" if pattern is None else prefix.rsplit("/", 1)[0] + "/"
    try:
        listing = list(store.list(prefix))
    except Exception as exc:  # any backend failure, named by the entry the user gave
        raise DatasetError(f"cannot list dataset source {entry!r}: {exc}") from exc
    out = []
    for obj in listing:
        if obj.uri.endswith("/"):
            continue  # "directory" placeholder objects hold no text
        if pattern is None and obj.uri != entry and not _under(obj.uri, entry):
            continue  # prefix "gs://b/data" must not take "gs://b/database.txt"
        if pattern is not None and not fnmatch.fnmatchcase(obj.uri, pattern):
            continue
        key = obj.uri.rsplit("/", 1)[1] if obj.uri == entry else obj.uri[len(root) :]
        out.append(SourceFile(obj.uri, key, int(obj.size), int(obj.generation)))
    return out


def _under(uri: str, prefix: str) -> bool:
    return uri.startswith(prefix if prefix.endswith("/") else prefix + "/")


def open_source(src: SourceFile, store: SourceStore | None) -> BinaryIO:
    """Open a source for reading, refusing one that changed since it was listed.

    The fingerprint promised these bytes; shards made of others would lie about them.

    Raises:
        DatasetError: naming the file, if it cannot be opened or has changed.
    """
    changed = f"dataset source {src.uri} changed since it was listed; run again"
    if src.remote:
        if store is None:
            raise DatasetError(f"dataset source {src.uri} needs a storage backend to read")
        try:
            return store.open(src.uri, generation=src.version)
        except FileNotFoundError as exc:
            raise DatasetError(changed) from exc
        except Exception as exc:
            raise DatasetError(f"cannot read dataset source {src.uri}: {exc}") from exc
    try:
        fh = open(src.uri, "rb")  # noqa: SIM115 - the caller closes it
    except OSError as exc:
        raise DatasetError(f"cannot read dataset source {src.uri}: {exc.strerror}") from exc
    st = os.fstat(fh.fileno())
    if (st.st_size, st.st_mtime_ns) != (src.size, src.version):
        fh.close()
        raise DatasetError(changed)
    return fh


def select_by_size(files: list[SourceFile], max_bytes: int | None) -> list[SourceFile]:
    """Whole files in order until their sizes reach `max_bytes` (at least one file)."""
    if max_bytes is None:
        return list(files)
    chosen, total = [], 0
    for f in files:
        if chosen and total >= max_bytes:
            break
        chosen.append(f)
        total += f.size
    return chosen
