"""The directory a sharding run writes (`{out_root}/{fingerprint}/`): creating it, holding
its lock, and removing what a run that failed on bad input leaves behind.

A lock file (`.lock`, flock) serialises concurrent runs on the same directory; the kernel
releases it when its holder dies, so a killed run never blocks the next one, which resumes
its work. A run that fails on bad input (`DatasetError`) instead removes the directory, and
the parents it created if they are left empty: the fingerprint names that very input, so no
later run could reuse anything in it, and clutter would only hide what went wrong.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from workloads.sources import DatasetError

LOCK = ".lock"


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
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
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
    return f"cannot write the dataset directory {directory}: {exc.strerror or exc}"
