"""Keep a command's stderr free of TensorStore's late "Event loop is closed" tracebacks.

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
    """Make this process's unraisable-exception hook skip those RuntimeErrors; any other
    goes to the hook there was. And keep orbax's own log (absl) to what is fatal: on a
    damaged step it wrote WARNING and ERROR lines (of other steps' metadata, too) around
    the command's one line, which says what is wrong."""
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    before = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            return  # a read of a restore that already failed, and said why
        before(unraisable)

    sys.unraisablehook = hook
