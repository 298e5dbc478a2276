"""What a process that runs flows itself needs around them: `tpupipe run`, and a sweep run
from a Python script (`flows.sweep.run_sweep`).

A flow called straight from a script with no `PREFECT_API_URL` set runs against Prefect's
own temporary API server, a child that only an exit hook stops. SIGTERM skipped that hook
(once the flow run is crashed, Prefect's bridge sends the signal again to its default
action) and SIGHUP killed the process at once: each sweep stopped so left one more server
running with no parent, and a hang-up also left the sweep's trials and rows unfinished.
Here both signals unwind as Ctrl-C does, and the API is the one `flows.api_server` runs,
which dies with the process.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def orchestrate_here() -> Iterator[str | None]:
    """Run the block's flows as `tpupipe run` runs its pipeline: SIGTERM and SIGHUP stop
    them as Ctrl-C does (`exit_on_signals`: exit 143 or 129), and with no
    `PREFECT_API_URL` they report to a temporary API server that is stopped at exit and
    dies with this process if it is killed (`flows.api_server.temporary_api`). The signal
    handlers it replaced are put back after the block.

    Yields:
        The temporary API's URL, or None when `PREFECT_API_URL` names one.

    Raises:
        RuntimeError: the temporary API server did not answer in time.
    """
    from flows.api_server import temporary_api

    timeout_s = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120"))
    restore = exit_on_signals()
    try:
        with temporary_api(timeout_s) as url:
            yield url
    finally:
        restore()


def exit_on_signals() -> Callable[[], None]:
    """Make SIGTERM (docker stop, systemd, Kubernetes, CI time-outs) and SIGHUP (the
    terminal or SSH session closed) end the process as Ctrl-C does, by unwinding:
    `finally` blocks and exit hooks run, so the slice is deleted, the temporary Prefect
    server stopped and a sharding pool shut down. Their default action ended the process
    at once: the server ran on with no parent and, for SIGHUP, the workload trained on
    until a reaper found it. Exit status 128 + the signal: 143, 129.

    A SIGHUP that `nohup` (or a parent) set ignored stays ignored: that run was meant to
    outlive its terminal.

    Returns:
        What puts back the handlers it replaced. Off the main thread, where Python sets no
        handlers, it changes nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGTERM, _exit_with_signal)
    if before[signal.SIGHUP] is not signal.SIG_IGN:
        terminals = [fd for fd in (1, 2) if os.isatty(fd)]
        signal.signal(signal.SIGHUP, functools.partial(_hang_up, terminals))
    hook = sys.unraisablehook
    sys.unraisablehook = functools.partial(_signal_not_lost, hook)

    def restore() -> None:
        for sig, handler in before.items():
            if handler is not None:  # None: set outside Python, which cannot set it back
                signal.signal(sig, handler)
        sys.unraisablehook = hook

    return restore


RESEND_S = 0.05  # a collection's callbacks take microseconds; this hook returns at once


def _signal_not_lost(hook: Callable[[Any], None], unraisable: Any) -> None:
    """`sys.unraisablehook`: a signal's exception that Python could not raise is sent
    again, and so raised once Python can.

    A handler's exception (ours, SystemExit; Prefect's bridge, TerminationSignal; Ctrl-C's
    KeyboardInterrupt) raised while a garbage-collection callback runs (JAX installs one
    in every process that imports it) is printed as "Exception ignored" and dropped: the
    run carried on, landed `completed` and exited 0 after a SIGTERM or SIGHUP. Sent again,
    the signal reaches its handler (the one in place by then) outside the collector.
    """
    signum = _signal_of(unraisable.exc_value)
    if signum is None:
        hook(unraisable)
        return
    # From another thread, to the main one, once this hook and the collector are done:
    # handled in here, its exception would be dropped again (an unraisable hook's own).
    # One that meets the collector again comes back here and is sent again.
    main = threading.main_thread().ident
    resend = threading.Timer(RESEND_S, signal.pthread_kill, (main, signum))
    resend.daemon = True
    resend.start()


def _signal_of(exc: BaseException | None) -> int | None:
    """The signal a handler's exception stands for, or None."""
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    if isinstance(exc, SystemExit) and exc.code in SIGNAL_EXITS:
        return int(exc.code) - 128
    received = getattr(exc, "signal", None)  # prefect's TerminationSignal
    if type(exc).__name__ == "TerminationSignal" and isinstance(received, int):
        return received
    return None


# The exit codes `exit_on_signals` gives SIGTERM and SIGHUP (128 + signal), by name.
SIGNAL_EXITS = {128 + signal.SIGTERM: "SIGTERM", 128 + signal.SIGHUP: "SIGHUP"}


def _exit_with_signal(signum: int, frame: object) -> None:
    sys.exit(128 + signum)


def _hang_up(terminals: list[int], signum: int, frame: object) -> None:
    """SIGHUP goes to whoever handles SIGTERM now. During a flow that is Prefect's bridge:
    it raises `TerminationSignal` (the flow run crashes, teardown runs, the `runs` row
    names SIGHUP), then re-sends the signal to the handler it replaced, ours, which
    exits. Prefect installs a bridge for SIGTERM only.

    Output that went to a terminal now hung up goes to /dev/null first: every write to it
    fails (EIO), and the OSError of one made on the way out (the progress bar's last
    refresh) replaced the exit: `tpupipe shard` exited 1.
    """
    gone = [fd for fd in terminals if not os.isatty(fd)]  # hung up: no longer a terminal
    if gone:
        null = os.open(os.devnull, os.O_WRONLY)
        for fd in gone:
            os.dup2(null, fd)
        os.close(null)
    handler = signal.getsignal(signal.SIGTERM)
    (handler if callable(handler) else _exit_with_signal)(signum, frame)


def quiet_interrupt(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    """`sys.excepthook` once a command said in one line that Ctrl-C stopped it: nothing
    more for it (the traceback of wherever the interrupt landed), the default for any
    other exception."""
    if not issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, tb)
