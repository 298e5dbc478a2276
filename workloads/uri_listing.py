"""Expanding a `scheme://` source entry (`gs://bucket/prefix`, or a glob of one) into files
by the same rules as a local directory or glob (`workloads.listing`).

An object store has only names, no directories. The entry's static prefix is listed once,
the names are split at "/" into a tree of "directories", and the glob is matched part by
part on that tree the way `local_glob.glob_local` matches it on disk: `*`, `?` and `[...]`
stay within one part, `**` is any number of directories including none, wildcards match
no leading "." unless the pattern has one, and a pattern ending in "/" matches directories
(everything below them). Matching the whole URI with `fnmatch` instead let `*` cross "/"
and made `**/` need a directory, so one glob picked other files on gs:// than locally.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Iterator

from workloads.manifest import MANIFEST
from workloads.outdir import LOCK, WORK_DIR
from workloads.sources import DatasetError, SourceFile, SourceStore, StoredObject

WILDCARDS = re.compile(r"[*?\[]")  # what makes a source entry a glob, here and locally
_SHARD_SUFFIX = ".arrayrecord"


class _Node:
    """A name in the listing: an object (`file`), a "directory" (`children`), or both."""

    __slots__ = ("children", "file")

    def __init__(self) -> None:
        self.file: StoredObject | None = None
        self.children: dict[str, _Node] = {}


Match = tuple[str, _Node]  # the path relative to the entry's root, and its node


def expand_uri(entry: str, store: SourceStore | None) -> list[SourceFile]:
    """The files a `scheme://` entry names, keyed relative to its root.

    Args:
        entry: A prefix (every object below it taken as a directory, or the object of
            exactly that name) or a glob; see the module docstring.
        store: Lists the objects.

    Returns:
        The files, unordered; hidden names and tpupipe dataset directories skipped as
        `listing._walk` skips them.

    Raises:
        DatasetError: There is no store, the listing fails, or a prefix entry is a
            tpupipe dataset directory.
    """
    if store is None:
        scheme = entry.split("://", 1)[0]
        raise DatasetError(
            f"dataset source {entry!r} needs a storage backend for {scheme}:// "
            "(the pipeline and `tpupipe shard` provide one)"
        )
    wild = WILDCARDS.search(entry)
    prefix = entry[: wild.start()] if wild else entry
    try:
        listing = list(store.list(prefix))
    except Exception as exc:  # any backend failure, named by the entry the user gave
        raise DatasetError(f"cannot list dataset source {entry!r}: {exc}") from exc
    if wild and _named_literally(entry, listing):
        # An object or prefix of exactly that name ("data [2023].jsonl") wins over the
        # pattern, as an existing local path does (`listing._expand_local`).
        wild, listing = None, [o for o in listing if o.uri.startswith(entry)]
    # Keys are relative to the prefix taken as a directory (like a local directory entry),
    # or to a pattern's last "/" before its first wildcard (`local_glob.static_prefix`).
    root = prefix.rsplit("/", 1)[0] + "/" if wild else entry.rstrip("/") + "/"
    top = _tree(listing, root)
    if wild:
        pattern = entry[len(root) :]
        matches, dirs_only = _glob(pattern, top), pattern.endswith("/")
        out = []
    else:
        if _is_dataset(top):
            raise DatasetError(
                f"dataset source {entry!r} is a tpupipe dataset directory (it has a "
                f"{MANIFEST}), not a corpus: give the files it was sharded from"
            )
        matches, dirs_only = [("", top)], True
        # "gs://b/data.txt" names one object; a name both object and prefix gives both.
        # "gs://b/corpus/" names the "directory" placeholder a console's "Create folder"
        # leaves: no text (it was read as one more, empty, document).
        out = [
            _file(o, o.uri.rsplit("/", 1)[1])
            for o in listing
            if o.uri == entry and not o.uri.endswith("/")
        ]
    for path, node in matches:
        if node.file is not None and not dirs_only:
            out.append(_file(node.file, path))
        out.extend(_file(obj, key) for key, obj in _walk(path, node))
    return out


def _file(obj: StoredObject, key: str) -> SourceFile:
    return SourceFile(obj.uri, key, int(obj.size), int(obj.generation))


def _named_literally(entry: str, listing: list) -> bool:
    """Whether an object is called `entry`, or lies below it taken as a directory."""
    below = entry.rstrip("/") + "/"
    return any(o.uri == entry or o.uri.startswith(below) for o in listing)


def _tree(listing: Iterable[StoredObject], root: str) -> _Node:
    """The objects below `root` as a tree of their names' "/"-separated parts."""
    top = _Node()
    for obj in listing:
        # "directory" placeholder objects hold no text; the prefix "gs://b/data" must not
        # take "gs://b/database.txt".
        if obj.uri.endswith("/") or not obj.uri.startswith(root):
            continue
        node = top
        for name in obj.uri[len(root) :].split("/"):
            child = node.children.get(name)
            if child is None:
                child = node.children[name] = _Node()
            node = child
        node.file = obj
    return top


def _is_dataset(node: _Node) -> bool:
    """`outdir.is_dataset_dir` on a listing: its manifest is not read (a request per
    directory), so a `manifest.json` counts only next to `.arrayrecord` shards, which
    only `shard_dataset` writes there; or a killed run's `.lock` next to `.work/`."""
    kids = node.children
    lock, work, manifest = kids.get(LOCK), kids.get(WORK_DIR), kids.get(MANIFEST)
    if lock is not None and lock.file is not None and work is not None and work.children:
        return True
    return (
        manifest is not None
        and manifest.file is not None
        and any(n.endswith(_SHARD_SUFFIX) and c.file is not None for n, c in kids.items())
    )


def _join(path: str, name: str) -> str:
    return f"{path}/{name}" if path else name


def _glob(pattern: str, top: _Node) -> list[Match]:
    """What `local_glob.glob_local` finds for `pattern` (relative to `top`), on the tree."""
    parts = [p for p in pattern.split("/") if p]
    dirs_at_end = pattern.endswith("/")
    bases: list[Match] = [("", top)]
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        matches: list[Match] = []
        for path, node in bases:
            if part == "**":
                # The last `**` names whole directories, which the caller walks.
                matches.extend([(path, node)] if last else _subdirs(path, node))
            elif not WILDCARDS.search(part):
                child = node.children.get(part)
                if child is not None and (child.children or not (last and dirs_at_end)):
                    matches.append((_join(path, part), child))
            else:
                matches.extend(_matching(path, node, part, dirs_only=dirs_at_end or not last))
        bases = list(dict(matches).items())  # "a/**/**/b" reaches a path more than once
    return bases


def _matching(path: str, node: _Node, part: str, dirs_only: bool) -> list[Match]:
    if _is_dataset(node):
        return []  # `corpus/*/*.arrayrecord` must not reach into a dataset either
    hidden = part.startswith(".")
    return [
        (_join(path, name), child)
        for name, child in node.children.items()
        if fnmatch.fnmatchcase(name, part)
        and (hidden or not name.startswith("."))
        and (not dirs_only or child.children)
    ]


def _subdirs(path: str, node: _Node) -> list[Match]:
    """`node` and every directory below it that is neither hidden nor a dataset directory."""
    out, pending = [], [(path, node)]
    while pending:
        path, node = pending.pop()
        if _is_dataset(node):
            continue
        out.append((path, node))
        pending.extend(
            (_join(path, name), child)
            for name, child in node.children.items()
            if child.children and not name.startswith(".")
        )
    return out


def _walk(path: str, node: _Node) -> Iterator[tuple[str, StoredObject]]:
    """Objects below directory `node` with their paths, as `listing._walk` takes files:
    no hidden names, no dataset directory (`node` itself included)."""
    pending = [(path, node)]
    while pending:
        path, node = pending.pop()
        if _is_dataset(node):
            continue  # e.g. the datasets of a gs:// storage root inside the prefix
        for name, child in node.children.items():
            if name.startswith("."):  # an uploaded .git/ or .DS_Store is not corpus
                continue
            if child.file is not None:
                yield _join(path, name), child.file
            if child.children:
                pending.append((_join(path, name), child))
