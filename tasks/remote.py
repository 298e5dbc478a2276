"""What a run checks and writes in Cloud Storage before a slice exists.

A slice costs money from its create on. Each thing here, when a worker was the first to
find it wrong, cost a slice and a failed start-up and ended in an error that named neither
the config field nor the object: the bucket of `storage.root`, the wheel of `slice.wheel`,
and a published dataset whose manifest lists a shard the bucket no longer holds, or holds
with other bytes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from typing import Any

from workloads import data
from workloads.config import PipelineConfig
from workloads.config_file import ConfigError
from workloads.data import DatasetError
from workloads.manifest import SPLITS, TMP_PREFIX

logger = logging.getLogger(__name__)
# In the local dataset directory: each shard's CRC32C, by the size and mtime it had then.
CRC_CACHE = ".crc32c.json"


def storage_client(config: PipelineConfig) -> Any:
    """The Cloud Storage client of the run's storage settings (no API call).

    Raises:
        ConfigError: no credentials, or no project could be determined, naming
            storage.project / storage.credentials_block and the fix.
    """
    from infra.gcp import clients

    storage = config.storage
    try:
        return clients.storage_client(storage.project, storage.credentials_block)
    except (clients.CredentialsError, OSError) as exc:  # OSError: no project determined
        raise ConfigError(
            f"storage.root {storage.root!r} with storage.project={storage.project!r} and "
            f"storage.credentials_block={storage.credentials_block!r}: {exc}"
        ) from None


def check_gcs_places(config: PipelineConfig, client: Any = None) -> None:
    """The bucket of a `gs://` storage root exists, and so does a gcp slice's wheel.

    Args:
        config: The validated config.
        client: A Cloud Storage client (default: built from `config.storage`).

    Raises:
        ConfigError: naming `storage.root` or `slice.wheel`, the bucket or object, and
            what to do.
    """
    root = config.storage.root
    wheel = config.slice.wheel if config.slice.provider == "gcp" else None
    if not root.startswith("gs://") and not wheel:
        return
    from google.api_core import exceptions as gexc

    from infra.gcp import gcs

    client = client or storage_client(config)
    if root.startswith("gs://"):
        bucket, _ = gcs.split_uri(root)
        try:
            found = gcs.bucket_exists(client, bucket)
        except gexc.Forbidden as exc:
            raise ConfigError(
                f"storage.root = {root!r}: Cloud Storage refused to list gs://{bucket} "
                f"({exc.message}); grant the orchestrator's identity roles/storage.objectUser "
                "on that bucket (docs/gcp.md)"
            ) from None
        if not found:
            raise ConfigError(
                f"storage.root = {root!r}: bucket {bucket} does not exist; create it "
                "(docs/gcp.md, step 3) or correct storage.root"
            )
    if wheel:
        try:
            found = gcs.exists(client, wheel)
        except gexc.Forbidden as exc:
            # The workers read it with their own account, which may be allowed to.
            logger.warning("slice.wheel %s could not be checked: %s", wheel, exc.message)
            return
        if not found:
            raise ConfigError(
                f"slice.wheel = {wheel!r} does not exist: every worker installs it at "
                "start-up; upload the wheel there (docs/gcp.md, step 3) or correct slice.wheel"
            )


def publish_dataset(
    local_dir: str,
    datasets_root: str,
    config: PipelineConfig | None,
    client: Any = None,
    name: str | None = None,
) -> str:
    """Make the dataset under `datasets_root` (gs://) whole: upload it, manifest last, if
    it has no manifest there (or one that does not parse); otherwise check, from one
    listing, that every shard the remote manifest lists exists with its recorded size and,
    where `local_dir` holds the same file (same sha256 and size in both manifests, the file
    of that size), with the CRC32C of that file. Shards missing, of another size or of
    other bytes are uploaded again from `local_dir`, each only if the local copy is the
    same file.

    A shard with no such local copy is checked by size only: the manifest vouches for its
    bytes by sha256, which Cloud Storage does not compute, so there is nothing to compare
    its CRC32C with short of reading it; other bytes there are left as they are (never
    replaced by another file's), for the worker's sha256 check to find. The local CRC32Cs
    are cached in `local_dir/.crc32c.json`, so only the first check reads the local shards.

    Args:
        local_dir: The orchestrator's complete copy of the dataset.
        datasets_root: `<storage.root>/datasets`.
        config: For the storage client's settings (unused when `client` is given).
        client: A Cloud Storage client (`tpupipe shard --out gs://...` has no config).
        name: The remote dataset's name, if not `local_dir`'s: a rerun over touched
            sources goes on over the dataset it trained on, whose shards `local_dir` holds
            under the new fingerprint (`tasks.rerun.same_records_result`). That dataset
            is never published anew under another name's manifest: it must be there.

    Returns:
        The remote dataset directory.

    Raises:
        DatasetError: a shard is missing or of another size in GCS and `local_dir` has no
            copy of it with the manifest's size and sha256; naming the dataset directory
            and every such shard. Or, with another `name`, that dataset has no manifest.
    """
    from infra.gcp import gcs

    own = os.path.basename(local_dir.rstrip("/"))
    remote = f"{datasets_root.rstrip('/')}/{name or own}"
    client = client or storage_client(config)
    text = gcs.read_bytes(client, f"{remote}/{data.MANIFEST}")
    try:
        manifest = json.loads(text) if text is not None else None
        listing = gcs.object_listing(client, remote) if manifest else {}
        bad = damaged_shards(manifest, {n: o.size for n, o in listing.items()}) if manifest else []
    except (ValueError, KeyError, TypeError):
        manifest = None
    local = data.load_manifest(local_dir)
    if not manifest and name not in (None, own):
        raise DatasetError(
            f"dataset {remote}, which the run trained on, has no readable {data.MANIFEST} "
            "any more (deleted?): restore it, or choose a new run_name"
        )
    if not manifest:  # none, or one no reader accepts: publish anew
        # The dataset's files alone, manifest last: not the local lock and statistics
        # beside them (`.lock`, `.shard-stats.json`), which nothing remote reads.
        gcs.upload_files(client, local_dir, remote, [*_shard_names(local), data.MANIFEST])
        return remote
    copies = [n for n in _shard_names(manifest) if _local_copy(local_dir, local, manifest, n)]
    crc32cs = _local_crc32cs(local_dir, [n for n in copies if n not in bad])
    # Cloud Storage lists a crc32c for every object; one without keeps the size check alone.
    rewritten = [n for n, crc in crc32cs.items() if listing[n].crc32c not in (None, crc)]
    if bad or rewritten:
        unfixable = [name for name in bad if name not in copies]
        if unfixable:
            raise DatasetError(
                f"dataset {remote} lacks {', '.join(unfixable)} (missing or of another size "
                f"than its {data.MANIFEST} records), and {local_dir} has no copy to restore "
                f"from; delete {remote}/{data.MANIFEST} so the next run publishes it anew"
            )
        # The remote manifest stays as it is: it already lists these shards with these
        # sizes and sha256s, and the local one may differ in entries of shards not repaired.
        gcs.upload_files(client, local_dir, remote, bad + rewritten)
        why = {n: "missing" if n not in listing else "of another size" for n in bad}
        why |= {n: "damaged: other bytes of the same size, its crc32c differs" for n in rewritten}
        logger.warning(
            "dataset %s repaired: uploaded %s again from %s",
            remote,
            ", ".join(f"{name} ({what})" for name, what in why.items()),
            local_dir,
        )
    return remote


def damaged_shards(manifest: dict, sizes: dict[str, int]) -> list[str]:
    """The shards `manifest` lists that `sizes` (name → size, one listing of the dataset
    directory) lacks or has with another size than the manifest's `bytes`."""
    shards = [s for split in SPLITS for s in manifest["splits"][split]["shards"]]
    # A manifest that records no `bytes` (older formats): being there is all we can check.
    return [
        s["name"]
        for s in shards
        if s["name"] not in sizes or sizes[s["name"]] != s.get("bytes", sizes[s["name"]])
    ]


def _shard_names(manifest: dict) -> list[str]:
    return [s["name"] for split in SPLITS for s in manifest["splits"][split]["shards"]]


def _local_copy(local_dir: str, local: dict, remote: dict, name: str) -> bool:
    # The local shard may replace the remote one only if it is the same file: same entry
    # (size and sha256) in both manifests, and the file on disk of that size.
    def entry(manifest: dict) -> dict | None:
        shards = (s for split in SPLITS for s in manifest["splits"][split]["shards"])
        return next((s for s in shards if s["name"] == name), None)

    mine, theirs = entry(local), entry(remote)
    if mine is None or theirs is None or mine.get("sha256") != theirs.get("sha256"):
        return False
    try:
        size = os.path.getsize(os.path.join(local_dir, name))
    except OSError:
        return False
    return size == mine.get("bytes", size)


def _local_crc32cs(local_dir: str, names: list[str]) -> dict[str, str]:
    """The CRC32C (as Cloud Storage lists it) of each local shard of `names` that can be
    read, from `CRC_CACHE` where the file's size and mtime are those cached with it."""
    from infra.gcp import gcs

    # Checksumming reads the whole dataset, as long as uploading it; a dataset directory is
    # complete and immutable once its manifest exists (and `workloads.shard_stats` rehashes
    # a shard whose inode or ctime changed), so each shard is read once, not per run.
    path = os.path.join(local_dir, CRC_CACHE)
    try:
        with open(path, encoding="utf-8") as fh:
            cached = json.load(fh)
        if not isinstance(cached, dict):
            raise ValueError("not an object")
    except (OSError, ValueError):  # none yet, or torn or edited: read the shards again
        cached = {}
    found, read = {}, False
    for name in names:
        try:
            st = os.stat(os.path.join(local_dir, name))
            key = [st.st_size, st.st_mtime_ns]
            entry = cached.get(name)
            if not (
                isinstance(entry, dict)
                and entry.get("key") == key
                and isinstance(entry.get("crc32c"), str)
            ):
                entry = {"key": key, "crc32c": gcs.file_crc32c(os.path.join(local_dir, name))}
                cached[name], read = entry, True
        except OSError:  # gone since `_local_copy` saw it: no copy to compare with
            continue
        found[name] = entry["crc32c"]
    if read:
        _write_atomically(path, json.dumps(cached, sort_keys=True))
    return found


def _write_atomically(path: str, text: str) -> None:
    # Best effort: a directory this process may not write is read again next time. The
    # temporary name is unique, as two runs may check the same dataset at once.
    directory, name = os.path.split(path)
    with contextlib.suppress(OSError):
        fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{name}.", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


def publish_shards(result: Any, out: str, client: Any) -> Any:
    """`tpupipe shard --out gs://...`: the `ShardResult` once its dataset is whole under
    `out`: uploaded, manifest last, or checked and repaired where one is there already
    (`publish_dataset`).

    Raises:
        DatasetError: naming the dataset, when Cloud Storage refused or failed the upload.
    """
    from google.api_core import exceptions as gexc

    try:
        published = publish_dataset(result.dataset_dir, out, None, client)
    except (gexc.GoogleAPICallError, gexc.RetryError) as exc:
        raise DatasetError(f"cannot publish {result.dataset_dir} to {out}: {exc}") from None
    return type(result)(published, result.manifest, result.cached)


def out_bucket(out: str) -> Any:
    """A Cloud Storage client for `--out gs://bucket/...`, once the bucket is known to
    exist (before anything is read or sharded).

    Raises:
        CredentialsError: no usable credentials.
        DatasetError: naming the bucket, when it does not exist or cannot be listed.
    """
    from google.api_core import exceptions as gexc

    from infra.gcp import clients, gcs

    client = clients.storage_client()
    name, _ = gcs.split_uri(out)
    try:
        found = gcs.bucket_exists(client, name)
    except gexc.GoogleAPICallError as exc:
        raise DatasetError(f"--out {out}: cannot look up bucket gs://{name}: {exc}") from None
    if not found:
        raise DatasetError(f"--out {out}: bucket gs://{name} does not exist")
    return client
