"""The DuckDB metrics file on disk: whether an existing file is a database, told from its
header without opening it.

DuckDB's first connect to a missing file creates it and then writes its headers. On a
full disk that left a 0-byte (or 4 KB) file at the path, which every later connect
refuses ("exists, but it is not a valid DuckDB database file!"): each later run trained,
evaluated and only then failed to land.
"""

from __future__ import annotations

import os
import stat

# A DuckDB file starts with a 4 KB main header (a checksum, then the magic bytes "DUCK" at
# byte 8) and two 4 KB database headers: no complete database file is shorter than that.
MAGIC = b"DUCK"
MAGIC_OFFSET = 8
HEADER_BYTES = 3 * 4096


def database_file_problem(path: str | os.PathLike[str]) -> str | None:
    """Why the existing file at `path` is not a DuckDB database, or None if it looks like one.

    Only the header and size are read: opening the file with DuckDB would take its lock,
    which another process (a landing run, a notebook) may hold. A file whose header is
    right can still fail to open (a torn later write, a newer storage version).

    Args:
        path: an existing file.

    Returns:
        The reason ("it is empty (0 bytes), ..."), or None.
    """
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return "it is not a regular file"  # and a FIFO's open() would wait for a writer
        with open(path, "rb") as f:
            head = f.read(MAGIC_OFFSET + len(MAGIC))
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        return f"it cannot be read ({e.strerror})"
    stub = "as a create that failed on a full disk leaves it; delete it"
    if size == 0:
        return f"it is empty (0 bytes), {stub}"
    if head[MAGIC_OFFSET:] != MAGIC:
        return (
            f"it has no {MAGIC.decode()!r} at byte {MAGIC_OFFSET}, so it is some other file; "
            "give another path or move it away"
        )
    if size < HEADER_BYTES:
        return f"it has {size} bytes, fewer than DuckDB's {HEADER_BYTES}-byte headers, {stub}"
    return None
