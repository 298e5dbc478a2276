"""A real `prefect server` and process worker for tests, on loopback, with their own
PREFECT_HOME, stopped (with their children) whatever the tests did."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PREFECT = str(Path(sys.executable).with_name("prefect"))


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class PrefectServer:
    """A running server: its URLs and the environment that points the CLI at it."""

    url: str  # the UI, e.g. http://127.0.0.1:4321
    env: dict[str, str]
    logs: Path

    @property
    def api_url(self) -> str:
        """The REST API's base URL."""
        return f"{self.url}/api"

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """Run `prefect ARGS` against this server from the repository; raise on failure
        with its output."""
        proc = subprocess.run(
            [PREFECT, "--no-prompt", *args],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode:
            raise AssertionError(
                f"prefect {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
            )
        return proc


def server_env(home: Path, port: int, scheduler: bool = False) -> dict[str, str]:
    """The environment of the server, the CLI, the worker and its flow runs; with
    `scheduler`, the server's scheduler service runs, every second."""
    url = f"http://127.0.0.1:{port}"
    return {
        **os.environ,
        "PWD": str(REPO),  # prefect.yaml's pull step: `{{ $PWD }}` at deploy time
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": f"{url}/api",
        "PREFECT_UI_API_URL": f"{url}/api",
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # No scheduled runs (train-nightly, reap-orphans) competing with the tests' runs;
        # the schedules themselves are still deployed and checked.
        "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": str(scheduler).lower(),
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "1",
        # The worker asks for work every 2 s instead of 10.
        "PREFECT_WORKER_QUERY_SECONDS": "2",
    }


@contextlib.contextmanager
def running_server(
    home: Path, timeout_s: float = 180.0, scheduler: bool = False
) -> Iterator[PrefectServer]:
    """`prefect server start` on a free loopback port until the block exits (`scheduler`:
    see `server_env`)."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = server_env(home, port, scheduler)
    logs = home / "server.log"
    server = PrefectServer(url=f"http://127.0.0.1:{port}", env=env, logs=logs)
    with logs.open("w") as out:
        proc = subprocess.Popen(
            [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            cwd=home,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: stopping it stops its children
        )
        try:
            _wait_healthy(server, proc, timeout_s)
            yield server
        finally:
            stop_group(proc)


@contextlib.contextmanager
def running_worker(server: PrefectServer, pool: str) -> Iterator[subprocess.Popen]:
    """`prefect worker start --pool POOL` until the block exits."""
    with (server.logs.parent / "worker.log").open("w") as out:
        proc = subprocess.Popen(
            [PREFECT, "worker", "start", "--pool", pool, "--type", "process"],
            cwd=REPO,
            env=server.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield proc
        finally:
            stop_group(proc)


def stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """Stop a process group started with `start_new_session`: SIGINT first (a worker
    ignores SIGTERM once its server is gone), SIGKILL for whatever is left."""
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        break
    # Children that outlived the leader (a flow run the worker started) go too.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _wait_healthy(server: PrefectServer, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"prefect server exited {proc.returncode}: see {server.logs}")
        try:
            with urllib.request.urlopen(f"{server.api_url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"prefect server not healthy after {timeout_s:.0f}s: see {server.logs}")
