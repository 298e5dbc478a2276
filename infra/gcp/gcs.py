"""Directory trees to and from Cloud Storage with `google-cloud-storage`.

The run directory itself is read and written through `etils.epath` (gcsfs underneath,
tensorstore for orbax), which needs no client object. These helpers are for moving a
whole tree at once, e.g. a dataset sharded on this machine published under
`{root}/datasets/{fingerprint}/`: every file first, the marker file (the manifest) last,
so a reader that sees the marker sees a complete tree — GCS has no directory rename.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

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
    bucket_name, prefix = split_uri(uri)
    bucket = client.bucket(bucket_name)
    root = Path(local_dir)
    files = sorted(p for p in root.rglob("*") if p.is_file())
    files.sort(key=lambda p: p.relative_to(root).as_posix() in last)  # stable: last go last
    for path in files:
        name = "/".join(filter(None, [prefix, path.relative_to(root).as_posix()]))
        bucket.blob(name).upload_from_filename(str(path), retry=DEFAULT_RETRY)
    return len(files)


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
