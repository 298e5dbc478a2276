"""The run directory: the only channel between the workload and the orchestrator.

The workload writes `status.json` (a heartbeat, replaced atomically so a reader never sees
half a file) and appends `metrics.jsonl`; the orchestrator reads both. Paths are
`etils.epath` paths so the same code serves a local directory and `gs://`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import stat
import sys
import time
from typing import Any

from etils import epath

STATUS = "status.json"
HOST_STATUS = "status-host{host}.json"  # a failure of a host other than 0 (`write_host_failure`)
METRICS = "metrics.jsonl"
CONFIG = "config.json"
EVAL = "eval.json"
ENDED = ("finished", "failed", "preempted")  # heartbeat phases after which nothing writes
HOST = socket.gethostname()  # in the heartbeat: the machine its pid is a process of

log = logging.getLogger(__name__)


class UnreadableFile(ValueError):
    """A run-directory file exists but is not the JSON object it must hold (torn, garbage,
    not UTF-8, edited by hand); the message names the file."""


@contextlib.contextmanager
def naming(path: os.PathLike | str):
    """Give an OSError raised inside that names no file (a write or flush that found the
    disk full: "[Errno 28] No space left on device", and nothing more) `path` as its file."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from exc


def append_lines(path: os.PathLike, lines: str) -> None:
    """Append whole lines to a local file, in one write.

    A writer killed mid-line leaves a torn last line without its newline: that line is
    ended first, or the first line appended now would be glued to it, unreadable, and
    lost (an attempt's first metrics row or its `started` event).
    """
    with naming(path), open(path, "a+b") as f:  # "a": every write lands at the end
        if f.seek(0, os.SEEK_END):  # not empty
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                lines = "\n" + lines
        f.write(lines.encode())
        f.flush()


def write_json_atomic(path: epath.Path, payload: dict[str, Any]) -> None:
    """Write JSON so a concurrent reader sees the old or the new file, never a torn one."""
    text = json.dumps(payload, indent=2, sort_keys=True, default=_jsonable)
    write_bytes_atomic(path, text.encode())


def write_bytes_atomic(path: epath.Path, data: bytes) -> None:
    """Write a file so a reader sees the old or the new one, never a torn or empty one."""
    if str(path).startswith("gs://"):
        path.write_bytes(data)  # a GCS object write is already all-or-nothing
        return
    # Through a symlink: the link stays, the file it names is replaced.
    path = epath.Path(os.path.realpath(path))
    if _special(path):
        # A device or a FIFO (`tpupipe report --out /dev/null`) is written to, never
        # replaced: run as root, the replace made /dev/null a regular file holding a PNG,
        # for every process on the machine.
        with open(path, "wb") as out:
            out.write(data)
        return
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        with naming(path):
            tmp.write_bytes(data)
            os.replace(tmp, path)
    except BaseException:
        # A full disk or a signal mid-write: the old file stands, and no stray half-written
        # temporary is left beside it (the run directory is the user's to read).
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _special(path: epath.Path) -> bool:
    """Whether `path` is there and neither a regular file nor a directory (epath's
    `is_file` is true of a FIFO)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def read_json(
    path: epath.Path, attempts: int = 5, *, unreadable_as_missing: bool = False
) -> dict[str, Any] | None:
    """The parsed file, or None if it does not exist (yet).

    On gs:// a read racing a rewrite can come back cut short: gcsfs takes the object's
    size from one request (possibly cached) and its bytes from another, so the old size
    with the new, longer content is a torn text. Writers replace whole objects, so reading
    again gets a whole one.

    Args:
        path: The file.
        attempts: Reads of a gs:// object before a torn one counts as unreadable.
        unreadable_as_missing: For a file that is only a cache or is rewritten before it
            is read for anything that matters (`peak.json`, the heartbeat): an unreadable
            one is logged as a warning naming it and read as absent. Otherwise it raises,
            so a file whose content matters never passes for a missing one.

    Raises:
        UnreadableFile: the file is not a JSON object, naming it (unless
            `unreadable_as_missing`).
    """
    for attempt in range(attempts):
        try:
            value = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            if str(path).startswith("gs://") and attempt < attempts - 1:
                time.sleep(0.05 * (attempt + 1))
                continue
            problem = f"not valid JSON ({exc})"
        else:
            if isinstance(value, dict):
                return value
            problem = f"holds a JSON {type(value).__name__}, not an object"
        if unreadable_as_missing:
            log.warning("%s: %s; read as absent (it is rewritten)", path, problem)
            return None
        raise UnreadableFile(f"{path}: {problem}")
    return None


def finite_or_none(value: float | None) -> float | None:
    """JSON has no NaN: non-finite floats are written as null."""
    if value is None or not math.isfinite(value):
        return None
    return float(value)


class RunDir:
    """Reads and writes the files of one run directory."""

    def __init__(self, path: str | os.PathLike, clock=time.time):
        self.path = epath.Path(path)
        self._clock = clock
        self._warned_status = False  # the watch reads the heartbeat every poll: warn once

    def write_status(self, phase: str, **fields: Any) -> None:
        """Replace the heartbeat: phase (starting, training, saving, finished, failed,
        preempted), step, loss, last checkpoint and the time it was written."""
        payload = {"phase": phase, "time": self._clock(), "pid": os.getpid(), "host": HOST}
        payload.update(fields)
        write_json_atomic(self.path / STATUS, payload)

    def read_status(self) -> dict[str, Any] | None:
        """The latest heartbeat, or None before the workload wrote one.

        An unreadable `status.json` (an edit, a disk that filled) is read as none: the
        workload rewrites it as it starts. Raising here made every rerun provision a slice
        and then fail watching it, naming no file.
        """
        try:
            return read_json(self.path / STATUS)
        except UnreadableFile as exc:
            if not self._warned_status:
                log.warning("%s; read as no heartbeat (the workload rewrites it)", exc)
                self._warned_status = True
            return None

    def live_workload(self, timeout_s: float) -> dict[str, Any] | None:
        """The heartbeat, if it says a workload is writing this run directory now: its phase
        is not an end (finished, failed, preempted), it was written within `timeout_s` (after
        which the orchestrator, too, takes a silent workload for a lost one), and, written
        on this machine, by a process still alive (one killed, or stopped by Ctrl-C, leaves
        its last beat behind)."""
        beat = self.read_status() or {}
        when = beat.get("time")
        if not _is_number(when) or beat.get("phase") in ENDED:
            return None
        age = self._clock() - when
        if age >= timeout_s or (beat.get("host") == HOST and not _alive(beat.get("pid"))):
            return None
        return {**beat, "age_s": age}

    @staticmethod
    def describe_beat(live: dict[str, Any]) -> str:
        """A live heartbeat (`live_workload`) in words, for a message: the machine named
        when it is another, the step when it has one."""
        host = live.get("host")
        where = f"pid {live.get('pid')}" + (f" on {host}" if host and host != HOST else "")
        step = "" if live.get("step") is None else f" at step {live['step']}"
        return f"{where}: heartbeat {live.get('phase')!r}{step}, {live['age_s']:.0f} s ago"

    def write_host_failure(self, host: int, error: str, **fields: Any) -> None:
        """Record why host `host` (not 0) stopped, beside the heartbeat, never in it: host 0
        writes the heartbeat, and a host whose collective broke because another host was
        killed would otherwise replace it with that error (and no step)."""
        payload = {"phase": "failed", "error": error, "time": self._clock(), **fields}
        write_json_atomic(self.path / HOST_STATUS.format(host=host), payload)

    def host_failures(self) -> dict[int, dict[str, Any]]:
        """The failures `write_host_failure` recorded, by host (any attempt's: the caller
        tells its own); unreadable ones left out."""
        found = {}
        for path in self.path.glob(HOST_STATUS.format(host="*")):
            host = path.name.removeprefix("status-host").removesuffix(".json")
            with contextlib.suppress(UnreadableFile, OSError):
                record = read_json(path)
                if host.isdigit() and record is not None:
                    found[int(host)] = record
        return dict(sorted(found.items()))

    def append_metrics(self, rows: list[dict[str, Any]]) -> None:
        """Append step metrics, one JSON object a line, flushed before returning."""
        if not rows:
            return
        lines = "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows)
        path = self.path / METRICS
        if str(path).startswith("gs://"):
            # A GCS object cannot be appended to: rewrite it whole (one writer, process 0;
            # the file is small, and an object write is all-or-nothing, so never torn).
            old = path.read_text() if path.exists() else ""
            path.write_text(old + lines)
            return
        append_lines(path, lines)

    def read_metrics(self) -> list[dict[str, Any]]:
        """Every complete metrics row; a torn last line (killed mid-write) is skipped, as
        is any line that is not a row the workload writes (not JSON, not UTF-8, or not an
        object with a 64-bit `step`, numbers (or null) for its metrics and a `time` a clock
        gives): landing keys every row by its step, and a loss "oops" or a step past 64
        bits failed the landing of the run's `runs` row, naming neither file nor line."""
        path = self.path / METRICS
        if not path.exists():
            return []
        rows = []
        for line in path.read_bytes().decode("utf-8", "replace").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and _is_row(row):
                rows.append(row)
        return rows

    def step_metrics(self) -> list[dict[str, Any]]:
        """One metrics row per step, in step order: the last one written, as landing keeps
        (a step trained again after a resume is written again, and the earlier attempt's
        row no longer counts)."""
        return sorted({m["step"]: m for m in self.read_metrics()}.values(), key=_step)


def same_directory(a: str, b: str) -> bool:
    """Whether two run directories are one: the same path (a trailing slash aside), or
    local paths to one directory (a storage root reached through a symlink, `~/proj`
    against `/home/u/proj`). The run of a symlinked root was refused as another
    directory's, its own row in the way."""
    if a.rstrip("/") == b.rstrip("/"):
        return True
    if "://" in a or "://" in b:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:  # one is gone (deleted, or not made yet): by where the links lead
        return os.path.realpath(a) == os.path.realpath(b)


def _alive(pid: Any) -> bool:
    """Whether process `pid` of this machine exists."""
    if not _is_int(pid) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _step(row: dict[str, Any]) -> int:
    return row["step"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# What the workload writes in a metrics row as numbers (NaN, a diverged step's loss, too).
_NUMERIC = (
    "loss",
    "grad_norm",
    "learning_rate",
    "step_time_s",
    "tokens_per_s",
    "model_flops_per_token",
    "mfu",
    "startup_s",
    "compile_s",
)
MAX_TIME = 10.0**10  # epoch seconds (the year 2286): a later `time` is no clock's reading


def _is_row(row: dict[str, Any]) -> bool:
    step, when = row.get("step"), row.get("time")
    if not _is_int(step) or not 0 <= step < 2**63:
        return False
    for key in _NUMERIC:
        value = row.get(key)
        if value is None or isinstance(value, float):
            continue
        # An int past what a float holds (valid JSON) failed landing's float conversion.
        if not _is_int(value) or abs(value) > sys.float_info.max:
            return False
    if when is None:
        return True
    return _is_number(when) and 0 <= when < MAX_TIME
