"""The temporary Prefect API server of a `tpupipe run` that has no API configured.

Prefect starts one by itself (its "ephemeral" server), but as a child in the caller's
process group: a Ctrl-C in the terminal, or a SIGTERM to the group (what systemd, a CI
time-out or `timeout` send), killed the server at the same moment as the run. The run's
own shutdown then had no API to report to: its flow run stayed Running instead of
Crashed, and the command exited 1 with "ConnectError: Connection refused" some 135 s
later, instead of 143 at once. This server runs in a session of its own, so only the run
stops it, once it has reported; and it dies with the run if the run is killed outright
(`PR_SET_PDEATHSIG`), where Prefect's own was left running with no parent.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import httpx

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child, between fork and exec
    with contextlib.suppress(Exception):  # not Linux: the server may outlive a SIGKILL
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def temporary_api(startup_timeout_s: float = 120.0) -> Iterator[str | None]:
    """Run the block against a temporary local Prefect API, unless one is configured
    (`PREFECT_API_URL`): then yield None and start nothing. Yields the API's URL.

    A server that dies during the run (the OOM killer, a stray `kill`) is started again on
    the same port and database (`_Supervisor`).

    Raises:
        RuntimeError: the server did not answer within `startup_timeout_s`, with the end
            of its error output.
    """
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if PREFECT_API_URL.value():
        yield None
        return
    supervisor = _Supervisor(_free_port(), startup_timeout_s)
    # Stopped at exit, not when the block ends: Prefect sends the run's last logs and
    # events from threads it drains at interpreter exit, before `atexit` functions
    # run. Stopped earlier, those sends retried a vanished server for ~70 s.
    atexit.register(supervisor.stop)
    supervisor.start()
    with temporary_settings(updates={PREFECT_API_URL: supervisor.url}):
        yield supervisor.url


class _Supervisor:
    """One `prefect server start` on `port`, started again whenever it dies until `stop`.

    Without it, a server killed mid-run left the run training on, blind: Prefect's client
    retried each call for ~70 s before the run noticed its end, then the summary's
    publishing failed and a completed run was landed as failed. The database (under
    PREFECT_HOME) outlives the process, so the new server knows the run's flow and task
    runs, and the client's retries reach it.
    """

    RESTARTS = 5  # a server that keeps dying is not helped by more

    def __init__(self, port: int, startup_timeout_s: float) -> None:
        self.url = f"http://127.0.0.1:{port}/api"
        self.port, self.timeout_s = port, startup_timeout_s
        self.server: subprocess.Popen | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the server and wait until it answers; then watch it from a thread."""
        self._launch()
        threading.Thread(target=self._watch, name="prefect-api-watch", daemon=True).start()

    def stop(self) -> None:
        """Stop the server for good."""
        self._stopping.set()
        with self._lock:
            if self.server is not None:
                stop_process(self.server)

    def _launch(self) -> None:
        errors = tempfile.TemporaryFile()  # noqa: SIM115 (read if the server fails)
        with self._lock:
            if self._stopping.is_set():
                return  # the run is exiting: no new server
            self.server = server = subprocess.Popen(
                [
                    *(sys.executable, "-m", "prefect", "server", "start"),
                    *("--host", "127.0.0.1", "--port", str(self.port)),
                    *("--no-services", "--no-ui", "--log-level", "error"),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=errors,
                env={**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        _wait_until_up(server, self.url, self.timeout_s, errors)

    def _watch(self) -> None:
        # This thread outlives every server it starts: PR_SET_PDEATHSIG fires when the
        # thread that forked the child ends, not the process, so returning early would
        # stop the server it just started.
        restarts = 0
        while not self._stopping.wait(0.5):
            if self.server is None or self.server.poll() is None:
                continue
            if self._stopping.is_set():
                break  # stopped by `stop` itself
            print(
                f"the temporary Prefect API server on {self.url} exited (code "
                f"{self.server.returncode}); "
                + (
                    "starting it again" if restarts < self.RESTARTS else "not again: it keeps dying"
                ),
                file=sys.stderr,
            )
            if restarts == self.RESTARTS:
                break
            restarts += 1
            try:
                self._launch()
            except RuntimeError as exc:
                print(exc, file=sys.stderr)
                break
        self._stopping.wait()


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Terminate `proc`, and kill it if it is still running `grace_s` later."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _wait_until_up(server: subprocess.Popen, url: str, timeout_s: float, errors) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and server.poll() is None:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.2)
    errors.seek(0)
    tail = errors.read().decode("utf-8", "replace")[-2000:]
    how = f"exited with code {server.poll()}" if server.poll() is not None else "never answered"
    from prefect.settings import get_current_settings

    # Its database is under PREFECT_HOME (~/.prefect): an unwritable HOME failed here with
    # SQLite's "unable to open database file" and no word of where.
    raise RuntimeError(
        f"the temporary Prefect API server on {url} {how} within {timeout_s:.0f}s (its "
        f"database is under PREFECT_HOME = {get_current_settings().home}: set PREFECT_HOME "
        f"to a writable directory, or PREFECT_API_URL to use a running server): {tail}"
    )
