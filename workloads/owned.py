"""What a run's source walks leave out: the places the pipeline itself writes.

A storage root may sit inside a source directory or prefix (`storage.root:
gs://bucket/tpupipe` with `sources: [gs://bucket/]`), and so may a shared compilation cache
or the metrics file. A run then sharded its own lock file into its dataset, and every rerun
was refused, its compile cache and checkpoints "added" sources. The caller
(`tasks.plan.owned_places`) names each place, with the setting that put it there, so a
source lying wholly inside one is refused naming that setting.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from workloads.sources import DatasetError, SourceFile

log = logging.getLogger(__name__)

# A place: (its real path or URI, whether it is a directory, the setting that places it).
Place = tuple[str, bool, str]


def places(owned: Mapping[str, str] | None) -> list[Place]:
    """`owned` (place -> setting; a directory ends in "/", any other place is one file)
    with local places by their real path, as walks name the files they find."""
    out = []
    for place, setting in (owned or {}).items():
        directory = place.endswith(("/", os.sep))
        real = place if "://" in place else os.path.realpath(place)
        if real := real.rstrip("/" + os.sep):  # never all of "/"
            out.append((real, directory, setting))
    return out


def left_out(
    entry: str, files: list[tuple[str, SourceFile]], owned: list[Place]
) -> list[tuple[str, SourceFile]]:
    """`files` (real path or URI, file) that source `entry` gave, less those in an owned
    place, unless the entry names the file itself.

    Raises:
        DatasetError: every file lies in an owned place (the entry is one, or inside one),
            naming it and the setting that places it.
    """
    named = entry if "://" in entry else os.path.realpath(entry)
    kept, hit = [], None
    for real, f in files:
        place = None if real == named else _owner(real, owned)
        if place is None:
            kept.append((real, f))
        hit = hit or place
    if kept and hit is not None:
        log.info(
            "dataset source %r: %d file(s) the pipeline wrote left out (in %s)",
            entry, len(files) - len(kept), hit[0],
        )  # fmt: skip
    if files and not kept and hit is not None:
        path, _, setting = hit
        raise DatasetError(
            f"dataset source {entry!r} lies in {path}, which the pipeline writes (placed by "
            f"{setting}) and no run reads as corpus: move the corpus elsewhere, or change "
            f"{setting}"
        )
    return kept


def _owner(real: str, owned: list[Place]) -> Place | None:
    for place in owned:
        path, directory, _ = place
        sep = "/" if "://" in path else os.sep
        if real == path or (directory and real.startswith(path + sep)):
            return place
    return None
