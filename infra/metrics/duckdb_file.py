"""The DuckDB metrics file on disk: whether an existing file is a database, told from its
header, and creating a new file so that a create that fails leaves nothing behind.

DuckDB's first connect to a missing file creates it and then writes its headers. On a
full disk that left a 0-byte (or 4 KB) file at the path, which every later connect
refuses ("exists, but it is not a valid DuckDB database file!"): each later run trained,
evaluated and only then failed to land.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Callable
from glob import escape as glob_escape
from pathlib import Path

import duckdb

from workloads.pool_processes import pid_alive

# A DuckDB file starts with a 4 KB main header (a checksum, then the magic bytes "DUCK" at
# byte 8) and two 4 KB database headers: no complete database file is shorter than that.
MAGIC = b"DUCK"
MAGIC_OFFSET = 8
HEADER_BYTES = 3 * 4096

# Errors of a filesystem that has no hard links (vfat, some FUSE and SMB mounts).
_NO_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP}

# The longest name `create_database` makes beside the file: its temporary name (a pid of up
# to 7 digits, Linux's limit) with DuckDB's write-ahead log.
LONGEST_SUFFIX = ".4194304-ffffffff.creating.wal"


_FILE_LOCKS: dict[str, threading.Lock] = {}
_FILE_LOCKS_GUARD = threading.Lock()


def file_lock(path: str | os.PathLike[str]) -> threading.Lock:
    """The lock this process's threads take turns on for the database at `path`: its
    connections (`DuckDBSink`) and any other open of the file. Closing any descriptor of a
    file drops every POSIX lock the process holds on it, DuckDB's included: a header read
    beside a sweep trial's landing let another process write the file under it."""
    key = os.path.realpath(path)
    with _FILE_LOCKS_GUARD:
        return _FILE_LOCKS.setdefault(key, threading.Lock())


def lock_conflict(exc: BaseException) -> bool:
    """Whether `exc` is DuckDB refusing to open a file another process holds, the one
    error opening it that waiting can cure. ("lock" alone is in "block", which DuckDB's
    corruption errors name.)"""
    return isinstance(exc, duckdb.IOException) and "Could not set lock on file" in str(exc)


def unusable_database(exc: BaseException) -> bool:
    """Whether `exc`, raised opening or reading a DuckDB file, means the file itself cannot
    be used (torn, corrupt, another storage version, no permission): every open fails the
    same way until it is restored or moved away. Another process's lock is not that."""
    return isinstance(exc, duckdb.Error) and not lock_conflict(exc)


_READ_WHOLE: set[tuple] = set()  # versions of files read whole by this process


def read_whole(con: duckdb.DuckDBPyConnection, path: str | os.PathLike[str], tables) -> set[str]:
    """Read every value of those of `tables` that exist in the database `con` has open (at
    `path`; in its current schema), once per version of the file and its WAL in this
    process. Returns those tables.

    Why: DuckDB checks a block's checksum when it reads it, and a run's lookup of its own
    row reads few blocks. A file whose other blocks were damaged (a torn copy, bit rot)
    passed the checks before a run, which trained and then failed to land, its error
    saying to run it again, which failed the same way.

    Raises:
        duckdb.Error: a block cannot be read ("Corrupt database file: computed checksum
            ... does not match").
    """
    # Only the schema landing writes in: a user's table of the same name in another one
    # (notebook.sweeps) was read unqualified, failed, and the file was called unreadable.
    there = {
        name.lower()
        for (name,) in con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE schema_name = current_schema() "
            "AND database_name = current_database()"
        ).fetchall()
    }
    present = {table for table in tables if table.lower() in there}
    version = tuple(
        (st.st_size, st.st_mtime_ns, st.st_ino) if (st := _stat(f)) else None
        for f in (os.fspath(path), f"{os.fspath(path)}.wal")
    )
    key = (os.path.realpath(path), version)
    if key not in _READ_WHOLE:
        for table in sorted(present):  # every column's values hashed: no block left unread
            con.execute(f"SELECT bit_xor(hash(COLUMNS(*))) FROM {table}").fetchall()
        _READ_WHOLE.add(key)
    return present


def _stat(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None


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
        with file_lock(path), open(path, "rb") as f:
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


def create_database(
    path: Path, init: Callable[[duckdb.DuckDBPyConnection], None] | None = None
) -> None:
    """Create the DuckDB file at `path`, set up by `init(con)`, unless one appears first.

    The database is built under a temporary name in the same directory and hard-linked
    into place, so `path` only ever holds a complete file: a create that fails (a full
    disk) removes what it wrote. When another process creates `path` meanwhile, its file
    is kept: a link never replaces a file, whereas a rename would, with whatever rows that
    process has landed since.

    Args:
        path: the database file to create; its directory exists.
        init: what to run on the new database before it is put in place (its tables).

    Raises:
        duckdb.Error / OSError: the create failed; nothing is left at `path` by it.
    """
    _remove_abandoned(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{os.urandom(4).hex()}.creating")
    wal = tmp.with_name(tmp.name + ".wal")
    try:
        con = duckdb.connect(str(tmp))
        try:
            if init is not None:
                init(con)
        finally:
            con.close()  # checkpoints: the tables move from the WAL into the file
        # close() does not raise when its checkpoint fails: the WAL stays, holding the tables.
        if database_file_problem(tmp) is not None or os.path.lexists(wal):
            raise OSError(
                errno.EIO,
                f"could not create the metrics database {path}: DuckDB did not finish "
                f"writing it (a full disk?); {tmp.name} was removed",
            )
        _link_into_place(tmp, path)
    finally:
        for leftover in (tmp, wal):
            leftover.unlink(missing_ok=True)


def _remove_abandoned(path: Path) -> None:
    """Remove the temporary files of creates of `path` whose process is gone (a SIGKILL
    mid-create leaves `<name>.<pid>-<hex>.creating`, and its `.wal`): nothing reads them,
    and a user would wonder what they hold. A live process's are left to it."""
    for leftover in path.parent.glob(f"{glob_escape(path.name)}.*.creating*"):
        pid = leftover.name[len(path.name) + 1 :].partition("-")[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            leftover.unlink(missing_ok=True)


def _link_into_place(tmp: Path, path: Path) -> None:
    """Give the complete file `tmp` the name `path` too, unless `path` exists by now."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        return  # another process created it first: that file is the one in use
    except OSError as e:
        if e.errno not in _NO_LINKS:
            raise
        # No hard links here: a rename, which replaces a file another process created in
        # the instant between this check and it (this process's threads take turns).
        if not os.path.lexists(path):
            os.rename(tmp, path)
