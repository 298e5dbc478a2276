"""Runs on every worker of a TPU slice: the workload, then its exit record in GCS.

`python -m infra.gcp.launcher`, started by the slice's start-up script
(`infra.slices.gcp_node.STARTUP_SCRIPT`). It reads what to run from the instance metadata
(`tpupipe-argv`, `tpupipe-env`), runs it with this interpreter, passes SIGTERM on (a
preemption notice: the workload saves and exits 75), and when the workload has exited
uploads its log and writes `worker-N.json` with the exit code under `tpupipe-exit-uri`.
The TPU API cannot tell the orchestrator that a program ended; this record does.

The metadata server is `metadata.google.internal`; `GCE_METADATA_HOST` (as google-auth
honours it) names another, which is how the tests run this module unchanged.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

METADATA_HOST = "metadata.google.internal"
ATTRIBUTES = "computeMetadata/v1/instance/attributes"


def metadata(key: str, default: str | None = None) -> str:
    """One instance attribute of this VM.

    Raises:
        KeyError: the attribute is absent and no default was given.
    """
    host = os.environ.get("GCE_METADATA_HOST", METADATA_HOST)
    request = urllib.request.Request(
        f"http://{host}/{ATTRIBUTES}/{key}", headers={"Metadata-Flavor": "Google"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.read().decode()
    except urllib.error.HTTPError as e:
        if e.code == 404 and default is not None:
            return default
        if e.code == 404:
            raise KeyError(key) from None
        raise


def run_workload(argv: list[str], env: dict[str, str], log_path: Path) -> int:
    """Run `python <argv>` to its end, SIGTERM passed on; returns its exit code."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, *argv],
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

        def forward(signum: int, frame: object) -> None:
            proc.send_signal(signum)

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        return proc.wait()


def report(exit_uri: str, worker: int, code: int, log_path: Path) -> None:
    """Upload the worker's log, then its exit record (the record last: it means "done")."""
    from infra.gcp.clients import storage_client

    bucket_name, _, prefix = exit_uri.removeprefix("gs://").partition("/")
    bucket = storage_client().bucket(bucket_name)
    base = f"{prefix.rstrip('/')}/worker-{worker}"
    if log_path.exists():
        bucket.blob(f"{base}.log").upload_from_filename(str(log_path))
    record = {"worker": worker, "exit_code": code, "finished_at": time.time()}
    bucket.blob(f"{base}.json").upload_from_string(
        json.dumps(record), content_type="application/json"
    )


def main() -> int:
    """Run this worker's share of the slice's workload; returns its exit code."""
    worker = int(metadata("agent-worker-number", "0"))
    argv = json.loads(metadata("tpupipe-argv"))
    env = json.loads(metadata("tpupipe-env", "{}"))
    exit_uri = metadata("tpupipe-exit-uri")
    log_dir = Path(os.environ.get("TPUPIPE_LOG_DIR") or tempfile.mkdtemp(prefix="tpupipe-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"worker-{worker}.log"
    try:
        code = run_workload(argv, env, log_path)
    except OSError as e:
        log_path.write_text(f"cannot start the workload: {e}\n")
        code = 127
    report(exit_uri, worker, code, log_path)
    return code


if __name__ == "__main__":
    sys.exit(main())
