"""Source files: what the fingerprint covers of each (`SourceFile`), the storage protocol
for `scheme://` sources, and opening a file while refusing one that changed since it was
listed. `workloads.listing` expands source entries into these files.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from typing import BinaryIO, Protocol


class DatasetError(ValueError):
    """Bad input for sharding or reading a dataset; the message names the place at fault."""


class DatasetWriteError(DatasetError):
    """A dataset file could not be written (a full disk, no permission): the machine's
    trouble, not the input's, so a pipeline run reports it as a failure (exit 1), not as
    input to change (exit 2). The message names the file."""


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
        """A binary, seekable reader of `uri`, of exactly `generation` when given; its
        reads raise `FileNotFoundError` if the object changes while it is read. Any
        other failure, by `open` or a read, is an `OSError` whose `strerror` says why
        (`PermissionError`: refused), never a cloud SDK's own exception."""
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


def open_source(src: SourceFile, store: SourceStore | None) -> BinaryIO:
    """Open a source for reading, refusing one that changed since it was listed.

    The fingerprint promised these bytes; shards made of others would lie about them.

    Raises:
        DatasetError: naming the file, if it cannot be opened or has changed.
    """
    if src.remote:
        if store is None:
            raise DatasetError(f"dataset source {src.uri} needs a storage backend to read")
        try:
            return store.open(src.uri, generation=src.version)
        except FileNotFoundError as exc:
            raise changed(src) from exc
        except Exception as exc:
            raise unreadable(src, exc) from exc
    try:
        # O_NONBLOCK: a FIFO put in the file's place since the listing must not block the
        # open (it then fails the regular-file check); regular files ignore the flag.
        fd = os.open(src.uri, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise DatasetError(f"cannot read dataset source {src.uri}: {exc.strerror}") from exc
    fh = os.fdopen(fd, "rb")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (st.st_size, st.st_mtime_ns) != (src.size, src.version):
        fh.close()
        raise changed(src)
    return fh


def changed(src: SourceFile) -> DatasetError:
    """The error for a source that is no longer the one listed: when opened, or when a
    store's reader raises `FileNotFoundError` mid-read (the object was replaced)."""
    return DatasetError(f"dataset source {src.uri} changed since it was listed; run again")


def unreadable(src: SourceFile, exc: Exception) -> DatasetError:
    """The error for a source that cannot be read: a store's refusal or failure, when
    opened or mid-read (an `OSError` naming the object, its `strerror` the reason: "permission
    denied (403): ..."), or a corrupt compressed stream."""
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
    return DatasetError(f"cannot read dataset source {src.uri}: {reason}")


def check_unchanged(fh: BinaryIO, src: SourceFile) -> None:
    """Refuse a local source that changed while it was read (a log still being appended
    to, say): the bytes read may then be neither the old file nor the new one, and the
    manifest would record the size and mtime of the old. One `fstat` per file, after its
    last read. Remote sources are checked by the store's reader at every read instead
    (`SourceStore.open`; the caller turns its `FileNotFoundError` into `changed`).

    Raises:
        DatasetError: naming the file, if its size or mtime differ from the listing's.
    """
    if src.remote:
        return
    st = os.fstat(fh.fileno())
    if (st.st_size, st.st_mtime_ns) != (src.size, src.version):
        raise DatasetError(
            f"dataset source {src.uri} changed while reading (size {src.size} -> "
            f"{st.st_size} bytes); run again once it is no longer written to"
        )


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
