"""The JAX persistent compilation cache a workload shares with the runs before it, and the
repair of entries that a write cut short left behind."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import zlib

import filelock
import jax

log = logging.getLogger(__name__)

_ENTRY, _ATIME = "-cache", "-atime"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def configure_compile_cache(cache_dir: str | None, max_gb: float | None = None) -> None:
    """Share compiled programs between attempts: a resumed attempt skips recompiling.

    With `max_gb`, a local cache keeps at most that much, deleting the least recently used
    programs first (JAX's own LRU, under a file lock every process of a slice shares).
    Every run of another model, batch, mesh or dtype compiles its own step (the learning
    rate's schedule is an argument of it, `workloads.trainer.LRSchedule`), so a storage
    root used nightly and by sweeps grew its cache without end. The bound is the
    directory's: of the runs writing to one cache, the smallest bound governs. A `gs://`
    cache is left unbounded here: JAX would lock it with a lock object that a killed worker
    leaves behind; a bucket lifecycle rule bounds it.
    """
    if not cache_dir:
        return
    local = "://" not in cache_dir
    repair_cache_entries(cache_dir)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    # No bound (None) on a local cache is a bound no disk reaches, not JAX's -1: with -1
    # JAX takes no lock and writes no `-atime` files, and a bounded run's eviction, which
    # reads every entry's `-atime`, then failed every write to a cache the two shared.
    # It costs what any bound does: each read takes the lock and stamps an `-atime`, each
    # write lists every entry under it (JAX's `LRUCache`).
    max_bytes = sys.maxsize if max_gb is None else int(max_gb * 1e9)
    jax.config.update("jax_compilation_cache_max_size", max_bytes if local else -1)


def repair_cache_entries(cache_dir: str) -> None:
    """Delete the entries of a local compilation cache that a write cut short left (empty,
    or not a whole compressed stream), and give every other entry an `-atime` file.

    Why: JAX writes an entry in place and never writes one whose file exists. An entry a
    full disk or a kill cut short (empty, or 12 kB of a 147 kB program) made every later
    run, of any run name, warn "truncated stream" and compile that program again, for good.
    JAX writes an entry's `-atime` file only after the entry itself, so only entries
    without one are read here, once each. Its eviction (`storage.compile_cache_gb`) reads
    every entry's `-atime`, and an entry written while eviction was off (by an earlier
    tpupipe, given no bound) had none, so every later write to the cache failed. (A GCS
    object is written whole or not at all.)

    Runs under JAX's own lock of the cache: a write under way is never taken for a cut one.
    """
    if "://" in cache_dir or not os.path.isdir(cache_dir):
        return
    # Not repaired (cannot lock, busy for 30 s): JAX still reads and writes the cache.
    with (
        contextlib.suppress(filelock.Timeout, OSError),
        filelock.FileLock(os.path.join(cache_dir, ".lockfile"), timeout=30),
    ):
        entries = {e.name: e for e in os.scandir(cache_dir)}
        for name, entry in entries.items():
            key = name.removesuffix(_ENTRY)
            if key == name or f"{key}{_ATIME}" in entries:
                continue  # not an entry, or one JAX finished writing
            with contextlib.suppress(OSError):  # another run may be at it too
                _check_entry(entry, os.path.join(cache_dir, f"{key}{_ATIME}"))


def _check_entry(entry: os.DirEntry, atime_path: str) -> None:
    st = entry.stat()
    with open(entry.path, "rb") as fh:
        data = fh.read()
    if not whole_stream(data):
        os.unlink(entry.path)
        log.warning(
            "deleted the compilation cache entry %s: its write was cut short (%d bytes)",
            entry.path,
            len(data),
        )
        return
    with open(atime_path, "xb") as fh:
        fh.write(st.st_mtime_ns.to_bytes(8, "little"))


def whole_stream(data: bytes) -> bool:
    """True unless `data` is empty or a zlib or zstd stream cut short (a zstd one is taken
    as whole where `zstandard`, which JAX would have written it with, is not installed)."""
    if not data:
        return False
    if data.startswith(_ZSTD_MAGIC):
        try:
            import zstandard
        except ImportError:
            return True
        try:
            zstandard.ZstdDecompressor().decompress(data)
        except zstandard.ZstdError:
            return False
        return True
    stream = zlib.decompressobj()
    try:
        stream.decompress(data)
    except zlib.error:
        return False
    return stream.eof
