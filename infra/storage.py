"""Reading source files by URI: a small `Storage` Protocol, local and Cloud Storage backends.

Dataset sharding (`workloads.data`) reads `scheme://` sources only through an object with
this shape, so the workload code never imports a cloud SDK. Generations make reads exact:
a listing records each object's generation (a local file's `st_mtime_ns`), and `open` with
that generation fails with `FileNotFoundError` once the object has been replaced, instead
of silently reading other bytes than the dataset fingerprint covers. Any other failure to
read is an `OSError` too (`PermissionError` for a refusal), never a cloud SDK's exception:
the workload code names the source with it, in whichever process it was read.

Storage objects travel to sharding worker processes by pickling. A `GCSStorage` does not
pickle its client (clients hold sockets and locks); the copy in a worker builds its own from
the same project on first use: one client per process.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

FILE_SCHEME = "file://"

# Bytes asked for per GET of a `gs://` object: a reader going line by line then makes one
# request per 8 MiB, where google-cloud-storage's bare BlobReader (no `peek`/`readline`)
# was iterated one `read(1)` per byte.
READ_CHUNK = 8 * 2**20


class ObjectChangedError(FileNotFoundError):
    """The object being read was replaced or deleted since it was opened."""


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object."""

    uri: str
    size: int
    generation: int


class Storage(Protocol):
    """Lists and opens objects by URI."""

    def list(self, prefix: str) -> Iterable[ObjectInfo]:
        """Every object whose URI starts with `prefix` (not only direct children)."""
        ...

    def open(self, uri: str, generation: int | None = None) -> BinaryIO:
        """A binary, seekable, buffered reader of `uri` (it has `peek`).

        Raises:
            FileNotFoundError: no such object, or not of `generation`; also raised by
                the reader's reads (`ObjectChangedError`) if the object changes under it.
            OSError: the object cannot be read (`PermissionError`: refused), by `open` or
                by the reader's reads; `strerror` says why, `filename` is the URI.
        """
        ...


class LocalStorage:
    """Files on this machine, as `file:///abs/path` URIs; generation = `st_mtime_ns`."""

    def list(self, prefix: str) -> list[ObjectInfo]:
        """Files under directory `prefix`, the file `prefix`, or files whose path starts
        with `prefix`, sorted by URI."""
        path = _path(prefix)
        if os.path.isdir(path):
            found = [os.path.join(d, n) for d, _, names in os.walk(path) for n in names]
        elif os.path.isfile(path):
            found = [path]
        else:
            parent = os.path.dirname(path) or "."
            found = []
            if os.path.isdir(parent):
                for d, _, names in os.walk(parent):
                    found += [os.path.join(d, n) for n in names]
            found = [p for p in found if p.startswith(path)]
        out = []
        for p in sorted(found):
            if os.path.isfile(p):
                st = os.stat(p)
                out.append(ObjectInfo(FILE_SCHEME + os.path.abspath(p), st.st_size, st.st_mtime_ns))
        return out

    def open(self, uri: str, generation: int | None = None) -> BinaryIO:
        """Open a file; `FileNotFoundError` if its mtime is no longer `generation`."""
        fh = open(_path(uri), "rb")  # noqa: SIM115 - returned to the caller
        if generation is not None and os.fstat(fh.fileno()).st_mtime_ns != generation:
            fh.close()
            raise FileNotFoundError(f"{uri} is no longer generation {generation}")
        return fh


def _path(uri: str) -> str:
    return uri[len(FILE_SCHEME) :] if uri.startswith(FILE_SCHEME) else uri


class GCSStorage:
    """Cloud Storage through `google-cloud-storage`; the client is built once and passed in."""

    def __init__(self, client: Any, project: str | None = None, read_chunk: int = READ_CHUNK):
        """Args:
        client: A `google.cloud.storage.Client` (None: built on first use from `project`).
        project: The client's project, for rebuilding it in a worker process.
        read_chunk: Bytes per GET while reading an object.
        """
        self._client = client
        self._project = project if project is not None else getattr(client, "project", None)
        self._read_chunk = read_chunk

    def __reduce__(self) -> tuple[Callable, tuple]:
        return GCSStorage, (None, self._project, self._read_chunk)

    @property
    def client(self) -> Any:
        """The storage client (built here only in a worker process that received a copy)."""
        if self._client is None:
            from infra.gcp.clients import storage_client

            self._client = storage_client(self._project)
        return self._client

    def list(self, prefix: str) -> list[ObjectInfo]:
        """Objects whose name starts with the prefix's path, sorted by URI."""
        from google.api_core import exceptions

        bucket, name = _split(prefix)
        blobs = self.client.list_blobs(bucket, prefix=name or None)
        try:
            found = [
                ObjectInfo(f"gs://{bucket}/{b.name}", int(b.size), int(b.generation)) for b in blobs
            ]
        except exceptions.NotFound:  # a listing 404s only for its bucket; the raw error was a URL
            raise FileNotFoundError(f"bucket {bucket} does not exist") from None
        return sorted(found, key=lambda o: o.uri)

    def open(self, uri: str, generation: int | None = None) -> BinaryIO:
        """A buffered reader of the object (of exactly `generation` when given): one GET
        per `read_chunk` bytes, each byte downloaded once if read front to back."""
        from google.api_core import exceptions

        from infra.gcp.storage_errors import FINAL_ERRORS, read_error

        bucket, name = _split(uri)
        blob = self.client.bucket(bucket).blob(name, generation=generation)
        try:
            blob.reload()  # fails now, not mid-read, if that generation is gone; gives the size
        except exceptions.NotFound as exc:
            raise FileNotFoundError(f"{uri} (generation {generation}) not found") from exc
        except FINAL_ERRORS as exc:  # a 403, say: an OSError naming the object
            raise read_error(uri, exc) from exc
        reader = io.BufferedReader(_ObjectReader(blob, uri), buffer_size=self._read_chunk)
        return reader  # type: ignore[return-value]


class _ObjectReader(io.RawIOBase):
    """Ranged GETs of one object of known size and generation.

    Nothing past the object's end is asked for (BlobReader asked, and got HTTP 416, at
    every read at the end). A range that comes back 404 (real GCS's media URL names the
    generation), 412 (`ifGenerationMatch`), 416 or short means the object was replaced
    while read: `ObjectChangedError`, never a silent end of file that would cut the
    dataset at a chunk boundary; any other error the library gives up on (a 403) is an
    `OSError` naming the object (`storage_errors.read_error`). Stored bytes are read as
    stored (`raw_download`), so a gzip-encoded object is not transcoded and ranges count
    the object's own bytes.
    """

    def __init__(self, blob: Any, uri: str):
        self._blob = blob
        self._uri = uri
        self._size = int(blob.size)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        data = self._fetch(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        # RawIOBase's default would loop over 8 KiB reads: one GET each.
        return self._fetch(self._size - self._pos)

    def _fetch(self, n: int) -> bytes:
        n = min(n, self._size - self._pos)
        if n <= 0:
            return b""
        from google.api_core import exceptions

        from infra.gcp.storage_errors import FINAL_ERRORS, read_error

        generation = self._blob.generation
        try:
            data = self._blob.download_as_bytes(
                start=self._pos,
                end=self._pos + n - 1,  # inclusive
                checksum=None,  # a range has no checksum of its own
                raw_download=True,
                if_generation_match=generation,
            )
        except (
            exceptions.NotFound,
            exceptions.PreconditionFailed,
            exceptions.RequestRangeNotSatisfiable,
        ) as exc:
            raise ObjectChangedError(f"{self._uri} (generation {generation}) changed") from exc
        except FINAL_ERRORS as exc:
            raise read_error(self._uri, exc) from exc
        if len(data) != n:
            raise ObjectChangedError(
                f"{self._uri} (generation {generation}) changed: {len(data)} bytes at offset "
                f"{self._pos} where {n} were listed"
            )
        self._pos += n
        return data


def _split(uri: str) -> tuple[str, str]:
    if not uri.startswith("gs://") or not uri[5:].split("/", 1)[0]:
        raise ValueError(f"{uri!r} is not a gs://bucket/... URI")
    bucket, _, name = uri[5:].partition("/")
    return bucket, name


class SchemeStorage:
    """Routes each URI to the backend of its scheme (`gs`, `file`)."""

    def __init__(self, backends: dict[str, Storage]):
        self.backends = backends

    def _for(self, uri: str) -> Storage:
        scheme = uri.split("://", 1)[0]
        if scheme not in self.backends:
            known = ", ".join(f"{s}://" for s in sorted(self.backends))
            raise ValueError(f"no storage backend for {scheme}:// (known: {known})")
        return self.backends[scheme]

    def list(self, prefix: str) -> Iterable[ObjectInfo]:
        """`Storage.list` of the prefix's backend."""
        return self._for(prefix).list(prefix)

    def open(self, uri: str, generation: int | None = None) -> BinaryIO:
        """`Storage.open` of the URI's backend."""
        return self._for(uri).open(uri, generation)


def source_storage(
    sources: list[str], gcs_client: Callable[[], Any] | None = None
) -> SchemeStorage | None:
    """The storage that reads these dataset sources, or None if all are local paths.

    Args:
        sources: `DatasetConfig.sources`.
        gcs_client: Builds the Cloud Storage client (default: `infra.gcp.clients.
            storage_client`, ADC or the emulator); called only if a source is `gs://`.
    """
    schemes = {s.split("://", 1)[0] for s in sources if "://" in s}
    if not schemes:
        return None
    backends: dict[str, Storage] = {"file": LocalStorage()}
    if "gs" in schemes:
        if gcs_client is None:
            from infra.gcp.clients import storage_client as gcs_client
        backends["gs"] = GCSStorage(gcs_client())
    return SchemeStorage(backends)
