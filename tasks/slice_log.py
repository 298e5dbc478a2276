"""What a slice's log says of a workload that failed without saying so in its heartbeat.

A workload that cannot write its heartbeat (a full disk) leaves its error in the log the
slice provider keeps of its output (a local slice's, on this machine). Often that disk is
the log's too: the log then ends mid-line, and its last line was quoted as the run's
error (`self._checkpointer.w`), naming neither the disk nor the file.
"""

from __future__ import annotations

import os
import re

from etils import epath

from infra.slices.procs import LOG_START

# The last line of a Python traceback: a dotted exception class name, then its message
# (`OSError: [Errno 28] No space left on device: '/r/ckpt'`, `pkg.mod.SaveFailed: ...`);
# or the first of a crash's (`Fatal Python error: Segmentation fault`, by faulthandler).
_EXCEPTION_LINE = re.compile(
    r"(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Failed|Interrupt|Exit)(?::\s.*)?"
    r"|Fatal Python error: .+"
)
# A crash's stack and list of extension modules follow its first line: read past them.
_TAIL_BYTES = 16384
_NEARLY_FULL = 1 << 20  # bytes free below which the log's disk is called full


def log_error(path: epath.Path) -> str | None:
    """The error the log at `path` ends with, saying where it was read, or None (no log,
    or nothing in it): its last exception line when it has one near its end, else its
    last line, saying that it holds no error; with a note when the log's (local) disk is
    full."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(max(size - _TAIL_BYTES, 0))
            tail = f.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    # This attempt's lines only: the log is appended to by every attempt on the slice
    # name, and an earlier attempt's error was reported as this one's.
    tail = tail.rsplit(LOG_START, 1)[-1].split("\n", 1)[-1] if LOG_START in tail else tail
    lines = [line.strip() for line in tail.replace("\0", "").splitlines() if line.strip()]
    if not lines:
        return None
    raised = [line for line in lines if _EXCEPTION_LINE.fullmatch(line)]
    line = raised[-1] if raised else lines[-1]
    if len(line) > 400:
        line = line[:400] + " ..."
    if raised:
        return f"{line} (the last error in {path}{_full_disk_note(path)})"
    # Said as such: a workload that exited with a code and no error (`os._exit(3)`) had a
    # routine library line quoted as if it were the cause.
    return f"{line} (no error in {path}, which ends with this line{_full_disk_note(path)})"


def _full_disk_note(path: epath.Path) -> str:
    if "://" in str(path):
        return ""
    try:
        stat = os.statvfs(os.path.dirname(os.fspath(path)))
    except OSError:
        return ""
    free = stat.f_bavail * stat.f_frsize
    return f"; its disk is full, {free:,} bytes free" if free < _NEARLY_FULL else ""
