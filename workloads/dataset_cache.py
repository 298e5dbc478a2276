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

MANIFEST = "manifest.json"


def cache_root() -> str:
    """Where remote datasets are copied: $TPUPIPE_DATASET_CACHE or ~/.cache/tpupipe."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "tpupipe", "datasets")
    return os.environ.get("TPUPIPE_DATASET_CACHE", default)


def local_dataset(dataset_dir: str | os.PathLike, root: str | None = None) -> str:
    """A local directory holding `dataset_dir`: itself if local, else a verified copy."""
    from workloads.data import verify_shards

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
    manifest = json.loads((remote / MANIFEST).read_text())
    names = [shard["name"] for split in manifest["splits"].values() for shard in split["shards"]]
    for name in [*names, MANIFEST]:  # the manifest last: its presence means complete
        (remote / name).copy(partial / name)
    verify_shards(os.fspath(partial))  # raises naming a shard whose bytes differ
    if target.exists():  # another process finished first: keep its copy
        shutil.rmtree(partial)
    else:
        partial.rename(target)
    return os.fspath(target)
