"""Hold off the Python handlers of the stop signals while a few lines must run whole.

Used where an exception in the middle would lose track of a process: between forking a
slice's workload and writing the record by which every teardown finds it. A KeyboardInterrupt
or a SIGTERM turned exception (ours or Prefect's `TerminationSignal`) may surface after any
bytecode, including between `fork` returning a pid and that pid being stored (CPython's
`Popen` does not kill a child it forked when interrupted while waiting for the exec), and
no `try`/`except` can clean up after a process whose pid it never saw.

Why not `signal.pthread_sigmask`: it masks the calling thread only. The kernel then hands
the signal to another thread (Prefect runs several), whose C-level handler flags it, and
CPython runs the Python handler in the main thread all the same, mask or not. Swapping the
Python handlers is what defers them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType

# Ctrl-C, `kill`/docker/systemd, a closed terminal: the signals that stop an orchestrator.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def signals_held(signums: tuple[signal.Signals, ...] = STOP_SIGNALS) -> Iterator[None]:
    """Run the block with `signums` held: their handlers run once it ends, however it ends.

    In a thread other than the main one this holds nothing, as nothing needs holding:
    Python runs signal handlers, and raises what they raise, in the main thread only.
    A signal with no Python handler (`None`) or ignored is left alone.

    Args:
        signums: the signals to hold.

    Yields:
        Nothing; on exit the handlers are restored, then each held signal is handed to
        its handler (one that raises ends the delivery: its exception goes on).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[tuple[int, FrameType | None]] = []
    originals: dict[int, object] = {}
    holding = True

    def hold(signum: int, frame: FrameType | None) -> None:
        if holding:
            held.append((signum, frame))
        else:  # it arrived while the handlers were being put back: deliver it now
            _deliver(originals[signum], signum, frame)

    try:
        for signum in signums:
            current = signal.getsignal(signum)
            if current is not None and current is not signal.SIG_IGN:
                # Recorded before the swap: `hold` may run as soon as it is installed.
                originals[signum] = current
                signal.signal(signum, hold)
        yield
    finally:
        holding = False
        for signum, handler in originals.items():
            signal.signal(signum, handler)
        for signum, frame in held:
            _deliver(originals[signum], signum, frame)


def _deliver(handler: object, signum: int, frame: FrameType | None) -> None:
    """What the signal would have done had it not been held."""
    if callable(handler):
        handler(signum, frame)
    elif handler is signal.SIG_DFL:
        os.kill(os.getpid(), signum)  # its default handler is back in place: e.g. terminate
