"""The directory a sharding run writes (`{out_root}/{fingerprint}/`): creating it, holding
its lock, removing what a run that failed on bad input leaves behind, and recognising one
(`is_dataset_dir`) so that no corpus walk reads it.

A lock file (`.lock`, flock) serialises concurrent runs on the same directory; the kernel
releases it when its holder dies, so a killed run never blocks the next one, which resumes
its work. A run that fails on bad input (`DatasetError`) instead removes the directory, and
the parents it created if they are left empty: the fingerprint names that very input, so no
later run could reuse anything in it, and clutter would only hide what went wrong.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from workloads.manifest import MANIFEST
from workloads.sources import DatasetError

LOCK = ".lock"
WORK_DIR = ".work"  # a sharding run's units of work, until its manifest is written


@contextmanager
def claimed(directory: Path) -> Iterator[None]:
    """Create `directory` if needed and hold its lock while the body runs.

    Args:
        directory: The dataset directory, `{out_root}/{fingerprint}`.

    Raises:
        DatasetError: naming the directory, if it cannot be created or written; or the
            body's own, after the directory is removed.
    """
    created = _missing(directory)
    fd = _lock(directory)
    try:
        yield
    except DatasetError:
        shutil.rmtree(directory, ignore_errors=True)  # still holding the lock
        for parent in created[1:]:
            try:
                os.rmdir(parent)  # only if empty: another run may have put a dataset there
            except OSError:
                break
        raise
    finally:
        os.close(fd)  # releases the flock


def _missing(directory: Path) -> list[Path]:
    """`directory` and its ancestors that do not exist yet, nearest first."""
    out = []
    for path in (directory, *directory.parents):
        if path.exists():
            break
        out.append(path)
    return out


def _lock(directory: Path) -> int:
    """An fd of `directory/.lock` holding its exclusive flock.

    A failed run removes the directory while holding the lock, so a run that was waiting
    for it may hold a lock on a file that no longer exists; it then starts again, on the
    new directory, rather than run beside whoever created that.
    """
    path = directory / LOCK
    while True:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if not os.access(directory, os.W_OK | os.X_OK):  # an existing `.lock` opens anyway
                raise PermissionError(13, "Permission denied")
            # 0o666 less the umask: with 0o644, another user of a group-shared datasets
            # directory failed where the README says a run waits for the lock.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            raise DatasetError(_unwritable(directory, exc)) from exc
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _unwritable(directory: Path, exc: OSError) -> str:
    for parent in directory.parents:
        if parent.exists():
            if not parent.is_dir():
                return f"the datasets directory {parent} is not a directory"
            break
    if os.path.lexists(lock := directory / LOCK) and os.access(directory, os.W_OK | os.X_OK):
        return f"cannot open {lock}, the dataset directory's lock: {exc.strerror or exc}"
    return f"cannot write the dataset directory {directory}: {exc.strerror or exc}"


# A JAX compilation cache entry, and the `-atime` file an LRU-bounded cache gives each.
_CACHE_ENTRY = re.compile(r".+-[0-9a-f]{64}-(cache|atime)")


def is_compile_cache(names: set[str]) -> bool:
    """Whether a directory holding entries `names` is a JAX compilation cache: it holds
    entries named `<program>-<64 hex digits>-cache`, and nothing else but their `-atime`
    files and hidden ones (its `.lockfile`). Walks never enter one: a shared cache
    (TPUPIPE_COMPILE_CACHE) inside a source directory was read as corpus whenever the
    variable was not set, failing on its binary entries. Not a directory that merely holds
    one such name beside a user's files: all of them were left out, silently (probe W)."""
    # endswith first: a walk asks this of every directory, the stdlib's 8,000 names too.
    seen = False
    for name in names:
        if name.startswith("."):
            continue
        if not (name.endswith(("-cache", "-atime")) and _CACHE_ENTRY.fullmatch(name)):
            return False
        seen = seen or name.endswith("-cache")
    return seen


def is_dataset_dir(directory: str, names: set[str] | None = None) -> bool:
    """Whether `directory` is a tpupipe dataset directory (`out_root/<fingerprint>/`).

    Walks never enter one: its shards are binary token ids, not text, and reading them
    (say, a datasets directory left inside a source directory by a run with another
    `--out`) would fail on invalid UTF-8 or, with errors=replace, make a corpus of them.
    It is recognised by what only `shard_dataset` writes: a `manifest.json` holding a
    JSON object with `format_version` and `fingerprint` (another file of that name is
    corpus like any other), or, for a run killed before its manifest, a `.lock` file next
    to a `.work` directory (`WORK_DIR`).

    Args:
        directory: The directory.
        names: The names of its entries, when the caller has listed it anyway.
    """
    if names is None:
        try:
            names = set(os.listdir(directory))
        except OSError:
            return False
    if LOCK in names and WORK_DIR in names and os.path.isdir(os.path.join(directory, WORK_DIR)):
        return True
    if MANIFEST not in names:
        return False
    try:
        with open(os.path.join(directory, MANIFEST), "rb") as fh:
            manifest = json.load(fh)
    except (OSError, ValueError, RecursionError):
        return False  # unreadable or not JSON: not ours, read as corpus (which names it)
    return (
        isinstance(manifest, dict)
        and isinstance(manifest.get("format_version"), int)
        and isinstance(manifest.get("fingerprint"), str)
    )


def interrupted_builds(out_root: Path, but: Path) -> dict[Path, int]:
    """The directories under `out_root` (other than `but`) that a killed run left: a
    `.work` with no manifest, and a `.lock` that no running build holds; with the bytes of
    finished work each keeps.

    Why: a killed run's work is kept for the next run of the same sources and options,
    which resumes it; once a source changed, no run ever will, and the work stayed, unsaid
    (a probe found 12 MB behind one killed run). The caller says so; nothing is deleted:
    the sources may yet be put back, or another run be about to resume it.
    """
    found = {}
    try:
        entries = [d for d in out_root.iterdir() if d != but and (d / WORK_DIR).is_dir()]
    except OSError:
        return found
    for directory in entries:
        if (directory / MANIFEST).exists():
            continue  # complete: its next cache hit removes the `.work` a kill left
        try:
            fd = os.open(directory / LOCK, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # at once: held means running
        except OSError:
            continue
        finally:
            os.close(fd)  # closing releases the shared lock taken just above
        found[directory] = sum(
            f.stat().st_size for f in (directory / WORK_DIR).rglob("*") if f.is_file()
        )
    return found
