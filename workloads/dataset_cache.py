"""A `gs://` dataset copied to local disk before grain reads it, checked against its manifest.

ArrayRecord reads local files, so a worker (or the orchestrator's evaluation) copies the
dataset it is given into a local cache once: shards first, the manifest last, then every
shard's sha256 is checked against the manifest. A cache entry without its manifest is an
interrupted copy and is redone. Paths go through `etils.epath` (no cloud SDK here).
"""

from __future__ import annotations

import json
import os
import shutil

from etils import epath

from workloads.sources import DatasetError

MANIFEST = "manifest.json"


DATASET_CACHE_ENV = "TPUPIPE_DATASET_CACHE"


def cache_root() -> str:
    """Where remote datasets are copied: $TPUPIPE_DATASET_CACHE or ~/.cache/tpupipe."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "tpupipe", "datasets")
    return os.environ.get(DATASET_CACHE_ENV, default)


def local_dataset(dataset_dir: str | os.PathLike, root: str | None = None) -> str:
    """A local directory holding `dataset_dir`: itself if local, else a verified copy.

    Raises:
        DatasetError: the remote dataset has no manifest (an interrupted publish), lacks a
            shard its manifest lists, or a shard's sha256 differs; naming the gs:// object.
    """
    source = str(dataset_dir)
    if "://" not in source:
        return source
    remote = epath.Path(source)
    target = epath.Path(root or cache_root()) / remote.name
    if (target / MANIFEST).exists():
        return os.fspath(target)
    partial = target.parent / f".partial-{remote.name}-{os.getpid()}"
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    try:
        _copy_verified(remote, partial)
    except BaseException:
        # Another process has another pid: a failed copy left here would stay forever.
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if target.exists():  # another process finished first: keep its copy
        shutil.rmtree(partial)
    else:
        partial.rename(target)
    return os.fspath(target)


def _copy_verified(remote: epath.Path, local: epath.Path) -> None:
    """Copy every shard the remote manifest lists, check each one's sha256, then write that
    same manifest (read once: what was checked is what the copy says it holds)."""
    from workloads.manifest import file_sha256

    try:
        text = (remote / MANIFEST).read_text()
    except FileNotFoundError:
        raise DatasetError(
            f"dataset {remote} has no {remote / MANIFEST}: its upload was interrupted or it "
            "was deleted; shard the dataset again"
        ) from None
    manifest = json.loads(text)
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            source, copy = remote / shard["name"], local / shard["name"]
            try:
                source.copy(copy)
            except FileNotFoundError:
                raise DatasetError(
                    f"dataset shard {source} is missing, though {remote / MANIFEST} lists it"
                ) from None
            if file_sha256(copy) != shard["sha256"]:
                raise DatasetError(f"dataset shard {source} does not match its manifest sha256")
    (local / MANIFEST).write_text(text)  # last: its presence means complete
