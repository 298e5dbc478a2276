"""Matching a source glob on the local disk, and what a directory entry leads to, for
`workloads.listing`.

`glob_local` matches as `glob.glob(pattern, recursive=True)` does, except that `**` never
follows a directory symlink, no match enters the excluded directory or a tpupipe dataset
directory, and a directory that cannot be read is refused rather than skipped. A link that
leads nowhere (dangling, pointing at itself or into a cycle, through a file) is no match:
`target_mode` and `entry_is` answer for it as `os.path.isfile` does, so a walk, a glob and
a `file://` listing all skip it alike.
"""

from __future__ import annotations

import errno
import fnmatch
import os

from workloads.outdir import is_dataset_dir
from workloads.sources import DatasetError
from workloads.uri_listing import WILDCARDS

DirId = tuple[int, int] | None  # (st_dev, st_ino) of the excluded directory

# Why a path leads nowhere: missing, a link to itself or in a cycle (`ln -s loop loop`),
# through a file, too long. `os.path.isfile` answers False for each; `DirEntry.is_file()`
# only for the first, and raised the others out of a walk as a traceback.
_NOWHERE = frozenset({errno.ENOENT, errno.ELOOP, errno.ENOTDIR, errno.ENAMETOOLONG})


def target_mode(path: str) -> int:
    """The `st_mode` of what `path` leads to (links followed), or 0 where that is nothing:
    a looping link is skipped as a dangling one is.

    Raises:
        DatasetError: naming `path`, for any other failure (a directory on the way that
            cannot be searched), as for an unreadable file: `os.path.isfile` answers False
            and the file would be left out of the dataset without a word.
    """
    try:
        return os.stat(path).st_mode
    except OSError as exc:
        if exc.errno in _NOWHERE:
            return 0
        raise DatasetError(_unreadable(path, exc)) from exc


def entry_is(entry: os.DirEntry, directory: bool) -> bool:
    """`entry.is_dir()` (`directory`) or `entry.is_file()`, links followed, answering as
    `target_mode` does: False for a link leading nowhere. Only a link costs a `stat` (the
    listing gives any other entry's type), so only a link can fail.

    Raises:
        DatasetError: naming the entry, as `target_mode` does.
    """
    try:
        return entry.is_dir() if directory else entry.is_file()
    except OSError as exc:
        if exc.errno in _NOWHERE:
            return False
        raise DatasetError(_unreadable(entry.path, exc)) from exc


def _unreadable(path: str, exc: OSError) -> str:
    return f"dataset source {os.path.normpath(path)} is not readable: {exc.strerror or exc}"


def is_skipped(entry: os.DirEntry, skip: DirId) -> bool:
    """Whether `entry` is the excluded directory `skip` (`DirId`)."""
    # The inode comes with the directory listing; only a match costs a stat.
    if skip is None or entry.inode() != skip[1]:
        return False
    return entry.stat(follow_symlinks=False).st_dev == skip[0]


def static_prefix(pattern: str) -> str:
    """The directory part of a glob before its first wildcard: the root keys are relative to."""
    head = WILDCARDS.split(pattern, maxsplit=1)[0]
    return os.path.dirname(head) or "."


def glob_local(pattern: str, skip: DirId) -> list[str]:
    """Paths matching `pattern` as `glob.glob(pattern, recursive=True)` finds them, except
    that `**` never descends through a directory symlink (`glob` does, and loops through a
    link to an ancestor until the path is too long) nor into the `skip` directory or a
    dataset directory. As in `glob`, wildcards match no leading "." unless the pattern has
    one, and a pattern ending in "/" matches only directories.

    Raises:
        DatasetError: naming a directory on the way that cannot be read.
    """
    parts = [p for p in pattern.split(os.sep) if p]
    bases = [os.sep if pattern.startswith(os.sep) else os.curdir]
    dirs_at_end = pattern.endswith(os.sep)  # `corpus/*/`: the shell's directories only
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        matches: list[str] = []
        for base in bases:
            if part == "**":
                # The last `**` names whole directories, which the caller walks.
                matches.extend([base] if last else _subdirs(base, skip))
            elif not WILDCARDS.search(part):
                path = os.path.join(base, part)
                if os.path.isdir(path) if last and dirs_at_end else os.path.lexists(path):
                    matches.append(path)
            else:
                matches.extend(_matching(base, part, skip, dirs_only=dirs_at_end or not last))
        bases = list(dict.fromkeys(matches))  # "a/**/**/b" reaches a path more than once
    return bases


def _matching(base: str, part: str, skip: DirId, dirs_only: bool) -> list[str]:
    try:
        with os.scandir(base) as it:
            entries = list(it)
    except OSError as exc:
        if exc.errno in _NOWHERE:  # `corpus/*/x` meeting a file, or a link leading nowhere
            return []
        # `glob` skips a directory it cannot read, and its files would be left out of the
        # dataset without a word: refused, as a walk refuses one.
        where = os.path.normpath(base)
        raise DatasetError(
            f"dataset source directory {where} is not readable: {exc.strerror}"
        ) from None
    if is_dataset_dir(base, {e.name for e in entries}):
        return []  # `corpus/*/*.arrayrecord` must not reach into a dataset either
    hidden = part.startswith(".")
    return [
        e.path
        for e in entries
        if fnmatch.fnmatchcase(e.name, part)
        and (hidden or not e.name.startswith("."))
        and (not dirs_only or entry_is(e, directory=True))
        and not is_skipped(e, skip)
    ]


def scan(directory: str) -> list[os.DirEntry]:
    """The entries of a source directory, or an error naming it (`os.walk` and `glob` would
    skip a directory they cannot read, silently)."""
    try:
        with os.scandir(directory) as it:
            return list(it)
    except OSError as exc:
        raise DatasetError(
            f"dataset source directory {directory} is not readable: {exc.strerror}"
        ) from exc


def _subdirs(top: str, skip: DirId) -> list[str]:
    """`top` and every directory below it that is neither hidden nor a dataset directory,
    not through symlinks."""
    out, pending = [], [top]
    while pending:
        directory = pending.pop()
        entries = scan(directory)
        if is_dataset_dir(directory, {e.name for e in entries}):
            continue
        out.append(directory)
        pending.extend(
            e.path
            for e in entries
            if e.is_dir(follow_symlinks=False)
            and not e.name.startswith(".")
            and not is_skipped(e, skip)
        )
    return out
