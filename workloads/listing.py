"""Which files a dataset is made of: expanding source entries into `SourceFile`s.

A source entry is a local file, a directory (every regular file below it, hidden ones such
as `.git/` or `.DS_Store` excepted), a glob (`**` allowed), `stdlib` (this Python's standard
library `.py` files, a corpus every machine has) or a `scheme://` URI such as
`gs://bucket/prefix` (every object under the prefix, hidden ones excepted likewise; a glob
of one matches as a local glob does, see `workloads.uri_listing`). Local paths are handled
here; URIs go through a `SourceStore` the caller passes in, so neither module imports a
cloud SDK.

Each file gets a `key`: its path relative to the root of the entry that named it (a file
entry: its base name). The key, not the absolute path, decides a document's train/eval split,
so the same corpus unpacked in another directory or on another machine gives the same shards.
Files are ordered by entry, then by key; a file reached twice (by two entries, or through a
symlink) counts once, for the first. Only regular files are read: a FIFO or device named
as a source is an error, as it could block a read forever. Neither directory walks nor `**`
follow directory symlinks, so a link to an ancestor cannot loop. A link that leads nowhere
(dangling, pointing at itself, through a file) is skipped where a walk or glob meets it, and
refused by name where an entry names it. A glob ending in "/" matches directories only, as
in the shell. No walk or glob enters a tpupipe dataset directory
(`is_dataset_dir`): its shards are not text.
"""

from __future__ import annotations

import os
import stat
import sysconfig
from collections.abc import Mapping

from workloads.local_glob import (
    DirId,
    entry_is,
    glob_local,
    is_skipped,
    scan,
    static_prefix,
    target_mode,
)
from workloads.manifest import MANIFEST
from workloads.outdir import is_compile_cache, is_dataset_dir
from workloads.owned import left_out
from workloads.owned import places as owned_places
from workloads.sources import DatasetError, SourceFile, SourceStore
from workloads.uri_listing import WILDCARDS, expand_uri

# Directories the `stdlib` entry does not enter: installed packages are not the standard
# library, and `__pycache__` holds only bytecode, two thirds of the entries a walk of it
# visited (5,283 of 8,027 here) to keep none of them.
STDLIB_SKIPPED = frozenset({"site-packages", "__pycache__"})


def resolve_sources(
    sources: list[str],
    store: SourceStore | None = None,
    exclude: str | os.PathLike | None = None,
    owned: Mapping[str, str] | None = None,
) -> list[SourceFile]:
    """Expand source entries into the ordered, de-duplicated files they name.

    Args:
        sources: Entries as described in the module docstring.
        store: Lists and opens `scheme://` entries; needed only when there are any.
        exclude: The local datasets directory: directory walks and globs never enter it, so
            shards written inside a source directory are not read back as sources by the
            next run, and it may not be a local source's directory (`check_out_root`).
        owned: What the pipeline writes besides datasets (`tasks.plan.owned_places`),
            local paths or URIs, each with the setting that places it: a directory (ending
            in "/") with everything below it, or one file. Walks, globs and prefixes leave
            them out (`workloads.owned`); a file an entry names outright is kept.

    Returns:
        The files, by entry and then by key.

    Raises:
        DatasetError: An entry is blank or matches no file, a file is not readable or not
            a regular file, a URI entry has no store to read it, or `exclude` is a
            source directory.
    """
    if not sources:
        raise DatasetError("the dataset has no sources: give at least one file, directory or glob")
    for entry in sources:
        if not entry.strip():  # "" is a path: os.path.isdir("") is False, but globs read "."
            raise DatasetError(
                f"dataset source {entry!r} is empty: give a file, directory, glob or gs:// prefix"
            )
    if exclude is not None:
        check_out_root(sources, exclude)
    skip = _dir_id(exclude)
    places = owned_places(owned)
    found: dict[str, SourceFile] = {}
    for entry in sources:
        if "://" in entry:
            files = [(_real_uri(f.uri), f) for f in expand_uri(entry, store)]
        else:
            files = _expand_local(entry, skip)
        if not files:
            raise DatasetError(f"dataset source {entry!r} matches no file")
        if places:
            files = left_out(entry, files, places)
        for real, f in sorted(files, key=lambda rf: rf[1].key):
            found.setdefault(real, f)  # by real path: a file behind two names is read once
    return list(found.values())


def _real_uri(uri: str) -> str:
    """The identity of a listed file: a `file://` URI by its real path, so a file behind a
    symlink is read once, as with a local entry; any other URI as it is."""
    if uri.startswith("file://"):
        return "file://" + os.path.realpath(uri[len("file://") :])
    return uri


def check_out_root(sources: list[str], out_root: str | os.PathLike) -> None:
    """Refuse a datasets directory that is a local source's own directory.

    Walks skip `out_root` when they meet it, and never enter a dataset directory, but with
    `--out` equal to the source directory the corpus and its datasets would share one
    directory, and anything else written there lands in the next run's corpus: refused,
    naming both. `out_root` inside a source directory is fine (the walk skips it), and so
    is one that holds a source (`--source corpus --out .`).

    Args:
        sources: The source entries; URIs are never local.
        out_root: The local datasets directory (it may not exist yet).

    Raises:
        DatasetError: naming both paths.
    """
    out = os.path.realpath(out_root)
    for entry in sources:
        if "://" in entry:
            continue
        real = os.path.realpath(_entry_root(entry))
        if real == out and os.path.isdir(real):
            raise DatasetError(
                f"the datasets directory {os.fspath(out_root)} is dataset source {entry!r} "
                f"({real}): its shards would sit among the corpus; choose a datasets "
                "directory (--out) that is not a source directory"
            )


def _entry_root(entry: str) -> str:
    """The local path a source entry reads below: itself, or a glob's static directory."""
    if entry == "stdlib":
        return sysconfig.get_paths()["stdlib"]
    if os.path.lexists(entry) or not WILDCARDS.search(entry):
        return entry
    return static_prefix(entry)


# A local file with its real path (symlinks resolved), the identity duplicates share.
Located = tuple[str, SourceFile]


def _dir_id(path: str | os.PathLike | None) -> DirId:
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None  # not there yet: nothing in it to skip
    return (st.st_dev, st.st_ino)


def _expand_local(entry: str, skip: DirId = None) -> list[Located]:
    if entry == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        return _walk(root, root, skip, names=STDLIB_SKIPPED, suffix=".py")
    if os.path.isdir(entry):
        if is_dataset_dir(entry):
            raise DatasetError(
                f"dataset source {entry!r} is a tpupipe dataset directory (it has a "
                f"{MANIFEST}), not a corpus: give the files it was sharded from"
            )
        if is_compile_cache({e.name for e in scan(entry)}):
            raise DatasetError(
                f"dataset source {entry!r} is a JAX compilation cache (its entries are "
                "compiled programs, as TPUPIPE_COMPILE_CACHE holds), not a corpus"
            )
        return _walk(entry, entry, skip)
    if os.path.lexists(entry):  # also a FIFO, dangling or looping link: refused in _local
        base = _base(os.path.dirname(os.path.abspath(entry)))
        return [(os.path.realpath(entry), _local(os.path.abspath(entry), base))]
    root = static_prefix(entry)
    base, out, real_dirs = _base(root), [], {}
    for match in sorted(glob_local(entry, skip)):
        mode = target_mode(match)
        if stat.S_ISDIR(mode):
            out.extend(_walk(match, root, skip))
        elif stat.S_ISREG(mode):  # sockets, fifos and links leading nowhere are not documents
            out.append((_real(match, real_dirs), _local(os.path.abspath(match), base)))
    return out


def _real(path: str, real_dirs: dict[str, str]) -> str:
    """`os.path.realpath(path)`, resolving each directory once rather than once per file."""
    head, name = os.path.split(os.path.abspath(path))
    if os.path.islink(path):
        return os.path.realpath(path)
    if head not in real_dirs:
        real_dirs[head] = os.path.realpath(head)
    return os.path.join(real_dirs[head], name)


def _walk(
    top: str,
    root: str,
    skip: DirId = None,
    names: frozenset[str] | set[str] = frozenset(),
    suffix: str = "",
) -> list[Located]:
    """Regular files below directory `top` (not following directory links, not entering
    the `skip` directory, a dataset directory nor ones called one of `names`, skipping
    hidden files and directories as globs do), keyed relative to `root`.
    `os.scandir` knows each entry's type without a `stat`, which matters for corpora of
    many small files; for the same reason a file's real path is `top`'s plus its
    relative path, unless the file is itself a link."""
    top = os.path.abspath(top)
    real_top, base = os.path.realpath(top), _base(root)
    out, pending = [], [top]
    while pending:
        directory = pending.pop()
        entries = scan(directory)
        listed = {e.name for e in entries}
        if is_dataset_dir(directory, listed) or is_compile_cache(listed):
            continue  # e.g. a datasets directory an earlier run left in the corpus
        for e in entries:
            if e.name.startswith("."):  # .git, .DS_Store, editors' swap files: not corpus
                continue
            if e.is_dir(follow_symlinks=False):
                if e.name not in names and not is_skipped(e, skip):
                    pending.append(e.path)
            elif e.name.endswith(suffix) and entry_is(e, directory=False):
                real = os.path.realpath(e.path) if e.is_symlink() else real_top + e.path[len(top) :]
                out.append((real, _local(e.path, base, e)))
    return out


def _base(root: str) -> str:
    """The prefix `_local` strips from a file's absolute path to key it relative to `root`."""
    return os.path.abspath(root) + os.sep


def _local(path: str, base: str, entry: os.DirEntry | None = None) -> SourceFile:
    """The SourceFile of the file at absolute `path`, keyed relative to `base` (`_base`);
    `entry`, its directory entry if listed, spares a `stat` call's path lookup."""
    try:
        st = entry.stat() if entry is not None else os.stat(path)
        # os.access does not see every reason a read fails, but it is the cheap, early check;
        # the read itself reports anything it misses, also naming the file.
        if not os.access(path, os.R_OK):
            raise PermissionError("permission denied")
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise DatasetError(f"dataset source file {path} is not readable: {reason}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise DatasetError(_not_regular(path, st.st_mode))
    rel = path[len(base) :] if path.startswith(base) else os.path.relpath(path, base)
    return SourceFile(path, rel.replace(os.sep, "/"), st.st_size, st.st_mtime_ns)


def _not_regular(path: str, mode: int) -> str:
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    return f"dataset source {path} is {kind}, not a regular file; only files are read"
