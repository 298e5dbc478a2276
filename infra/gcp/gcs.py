"""Directory trees to and from Cloud Storage with `google-cloud-storage`.

The run directory itself is read and written through `etils.epath` (gcsfs underneath,
tensorstore for orbax), which needs no client object. These helpers are for moving a
whole tree at once, e.g. a dataset sharded on this machine published under
`{root}/datasets/{fingerprint}/`: every file first, the marker file (the manifest) last,
so a reader that sees the marker sees a complete tree — GCS has no directory rename.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import google_crc32c
from google.api_core import exceptions as gexc
from google.cloud import storage
from google.cloud.storage.retry import DEFAULT_RETRY


def split_uri(uri: str) -> tuple[str, str]:
    """("bucket", "prefix") of `gs://bucket/prefix` (prefix without a trailing slash).

    Raises:
        ValueError: not a gs:// URI with a bucket.
    """
    if not uri.startswith("gs://") or not uri[5:].split("/", 1)[0]:
        raise ValueError(f"{uri!r} is not a gs://bucket/… URI")
    bucket, _, prefix = uri[5:].partition("/")
    return bucket, prefix.rstrip("/")


def upload_tree(
    client: storage.Client, local_dir: str | os.PathLike, uri: str, last: Sequence[str] = ()
) -> int:
    """Upload every file under `local_dir` to `uri`, the names in `last` after the rest.

    Uploads are retried on transient errors; an object that already exists is replaced,
    so an interrupted upload is finished by running it again.

    Returns:
        The number of files uploaded.
    """
    root = Path(local_dir)
    names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    names.sort(key=lambda name: name in last)  # stable: last go last
    return upload_files(client, root, uri, names)


def upload_files(
    client: storage.Client, local_dir: str | os.PathLike, uri: str, names: Sequence[str]
) -> int:
    """Upload the files `names` (relative to `local_dir`) to `uri/<name>`, in that order,
    each retried on transient errors and replacing any object of that name.

    Returns:
        The number of files uploaded.
    """
    bucket_name, prefix = split_uri(uri)
    bucket = client.bucket(bucket_name)
    for relative in names:
        name = "/".join(filter(None, [prefix, relative]))
        bucket.blob(name).upload_from_filename(str(Path(local_dir) / relative), retry=DEFAULT_RETRY)
    return len(names)


class ObjectInfo(NamedTuple):
    """What a listing tells of one object."""

    size: int
    crc32c: str | None  # base64 of the big-endian CRC32C, as Cloud Storage gives it


def object_listing(client: storage.Client, uri: str) -> dict[str, ObjectInfo]:
    """Every object under `uri/` by its name relative to `uri`, with its size and CRC32C:
    one listing, however many objects there are (no object is read)."""
    bucket_name, prefix = split_uri(uri)
    blobs = client.list_blobs(bucket_name, prefix=f"{prefix}/" if prefix else None)
    return {b.name[len(prefix) :].lstrip("/"): ObjectInfo(int(b.size), b.crc32c) for b in blobs}


def file_crc32c(path: str | os.PathLike, chunk_bytes: int = 1 << 20) -> str:
    """The CRC32C of a local file as Cloud Storage lists an object's (`ObjectInfo.crc32c`),
    read in chunks of `chunk_bytes`.

    Raises:
        OSError: the file cannot be read.
    """
    checksum = google_crc32c.Checksum()
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_bytes):
            checksum.update(chunk)
    return base64.b64encode(checksum.digest()).decode("ascii")


def read_bytes(client: storage.Client, uri: str) -> bytes | None:
    """The object's bytes, or None if it does not exist."""
    bucket_name, name = split_uri(uri)
    try:
        return client.bucket(bucket_name).blob(name).download_as_bytes(retry=DEFAULT_RETRY)
    except gexc.NotFound:
        return None


def download_tree(client: storage.Client, uri: str, local_dir: str | os.PathLike) -> int:
    """Download every object under `uri/` into `local_dir`, keeping relative paths.

    Returns:
        The number of files downloaded.

    Raises:
        FileNotFoundError: nothing exists under `uri`.
    """
    bucket_name, prefix = split_uri(uri)
    root = Path(local_dir)
    count = 0
    for blob in client.list_blobs(bucket_name, prefix=f"{prefix}/" if prefix else None):
        relative = blob.name[len(prefix) :].lstrip("/") if prefix else blob.name
        if not relative or relative.endswith("/"):
            continue  # a "directory" placeholder object
        target = root / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        blob.download_to_filename(str(target), retry=DEFAULT_RETRY)
        count += 1
    if not count:
        raise FileNotFoundError(f"no objects under {uri}")
    return count


def exists(client: storage.Client, uri: str) -> bool:
    """Whether the object `uri` exists."""
    bucket_name, name = split_uri(uri)
    try:
        client.bucket(bucket_name).blob(name).reload(retry=DEFAULT_RETRY)
    except gexc.NotFound:
        return False
    return True


def bucket_exists(client: storage.Client, name: str) -> bool:
    """Whether the bucket exists. Asked by listing at most one object, which
    roles/storage.objectUser allows (a bucket metadata read would need more); a refusal
    (403) is raised to the caller.
    """
    try:
        next(iter(client.list_blobs(name, max_results=1, retry=DEFAULT_RETRY)), None)
    except gexc.NotFound:
        return False
    return True
