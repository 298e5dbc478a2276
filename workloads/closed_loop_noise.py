"""Keep stderr and logs free of what a failed checkpoint restore leaves behind.

When a restore fails on a damaged file, orbax closes the asyncio loop it ran the restore
in while the step's other reads are still in flight in TensorStore's threads; each one
that finishes then fails to hand its result to that loop (`call_soon_threadsafe` on a
closed loop), and Python reports that RuntimeError as unraisable: a traceback on stderr.
After `python -m workloads.evaluate`'s one-line error came 2-5 of them, 13-31 lines,
sooner or later depending on the reads' timing, cutting into its line.
"""

from __future__ import annotations

import logging
import sys
from typing import Any


def drop_closed_loop_noise() -> None:
    """Make this process's unraisable-exception hook skip a failed restore's leftovers
    (`drop_failed_read_leftovers`), and keep orbax's own log (absl) to what is fatal: on a
    damaged step it wrote WARNING and ERROR lines (of other steps' metadata, too) around
    the command's one line, which says what is wrong."""
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    drop_failed_read_leftovers()


# Orbax's coroutine that reads one array of a restore: when the restore has failed on
# another array, its own failure is reported as "Exception ignored in" it, with the array's
# whole TensorStore spec (60 lines), as the failed restore is garbage-collected.
_READ_ARRAY = "_read_array_index_and_device_put"


def drop_failed_read_leftovers() -> None:
    """Make this process's unraisable-exception hook skip what a failed restore leaves
    behind: the late "Event loop is closed" errors of its reads still in flight, and the
    ignored errors of its other array reads. The restore's own error says what is wrong;
    after it a rerun's terminal showed 26-50 tracebacks, and a workload's log 49. Any other
    unraisable goes to the hook there was. Installed once: a second call while it is the
    hook changes nothing."""
    if getattr(sys.unraisablehook, "drops_failed_read_leftovers", False):
        return
    before = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not _failed_read_leftover(unraisable):
            before(unraisable)

    hook.drops_failed_read_leftovers = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def _failed_read_leftover(unraisable: Any) -> bool:
    error = unraisable.exc_value
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        return True  # a read of a restore that already failed, and said why
    code = getattr(getattr(unraisable, "object", None), "cr_code", None)
    return code is not None and code.co_name == _READ_ARRAY
