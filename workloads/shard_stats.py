"""Whether a complete dataset's shards are still the bytes its manifest vouches for, without
hashing them on every cache hit.

A cache hit used to check only that each shard exists with the manifest's size. A
same-named shard from another build passes that (ArrayRecord pads files to 64 KiB), and
one with the same record count was then read as this dataset: training went on over other
data, with no error. Hashing every shard on every hit would cost a large dataset minutes,
so a build records each shard's `os.stat` signature (size, mtime, ctime, inode, device)
beside the manifest (`SHARD_STATS`), and a hit hashes only the shards whose signature
changed since: a file copied, moved or restored over a shard gets a new inode or ctime,
which no user tool can set back. A shard whose hash still matches gets its new signature
recorded (a dataset directory copied elsewhere is hashed once there).

A directory without the record (built before it existed, the record deleted, or the
directory copied without its dot-files: `cp dir/*`, `rsync --exclude '.*'`) has every shard
hashed once, then its signatures recorded: recording them as they were blessed a shard
damaged before, which a slice then failed on, on every attempt.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from workloads.manifest import SPLITS, TMP_PREFIX, file_sha256

SHARD_STATS = ".shard-stats.json"


def record_shard_stats(dataset_dir: str | os.PathLike, manifest: dict) -> None:
    """Record the signature of every shard `manifest` lists as verified, as the shards are
    now: right after they were written and hashed, or hashed again (`changed_shards`).
    Best effort: a directory this process may not write is simply hashed next time."""
    try:
        stats = {name: _signature(path) for name, path in _shards(dataset_dir, manifest)}
    except OSError:
        return
    _write(Path(dataset_dir), stats)


def changed_shards(dataset_dir: str | os.PathLike, manifest: dict) -> list[str]:
    """Paths of the shards whose bytes are no longer those the manifest's sha256 vouches for
    (hashing only those whose signature changed since it was recorded); [] if none.

    A shard that cannot be read counts as changed. Call with every shard present (see
    `manifest.shards_present`)."""
    directory = Path(dataset_dir)
    try:
        known = json.loads((directory / SHARD_STATS).read_text())
        if not isinstance(known, dict):
            raise ValueError("not an object")
    except (OSError, ValueError):
        known = {}  # every shard hashed (see the module docstring)
    sha256 = {
        s["name"]: s["sha256"] for split in SPLITS for s in manifest["splits"][split]["shards"]
    }
    changed, rehashed = [], False
    for name, path in _shards(directory, manifest):
        try:
            signature = _signature(path)
            if known.get(name) == signature:
                continue
            same = file_sha256(path) == sha256[name]
        except OSError:
            same = False
        if not same:
            changed.append(str(path))
            continue
        known[name], rehashed = signature, True
    if rehashed and not changed:
        _write(directory, known)
    return changed


def _shards(dataset_dir: str | os.PathLike, manifest: dict) -> list[tuple[str, Path]]:
    return [
        (s["name"], Path(dataset_dir) / s["name"])
        for split in SPLITS
        for s in manifest["splits"][split]["shards"]
    ]


def _signature(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _write(directory: Path, stats: dict) -> None:
    """Replace the record; best effort (a read-only directory is hashed again next time)."""
    # A temporary name of this process: concurrent cache hits may record at once.
    tmp = directory / f"{TMP_PREFIX}{os.getpid()}{SHARD_STATS}"
    with contextlib.suppress(OSError):
        try:
            tmp.write_text(json.dumps(stats, sort_keys=True))
            os.replace(tmp, directory / SHARD_STATS)
        finally:
            tmp.unlink(missing_ok=True)
