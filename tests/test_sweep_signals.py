"""A sweep run from a Python script as the README shows it, stopped by SIGTERM or a hang-up:
it stops as Ctrl-C stops it and leaves nothing running. The README's example called the
flow itself (`sweep(config=...)`) with no `PREFECT_API_URL`: a SIGTERM during training
exited 143 but left Prefect's temporary API server (uvicorn) running for good, with no
parent, one more per interrupted sweep; a SIGHUP killed the script at once, trials
unstopped and rows unlanded, and left the server too."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.metrics import DuckDBSink
from tasks.goodput import read_events
from tests.helpers import REPO, processes_mentioning
from tests.test_cli_signals import _children
from tests.test_shard_pool import running

pytestmark = pytest.mark.slow

# The README's sweep example, two trials of configs/tiny.yaml one at a time.
SWEEP = """
import sys
from flows.sweep import run_sweep
from tasks.sweep_space import SweepConfig
from workloads.config_file import load_config

if __name__ == "__main__":
    run_sweep(
        SweepConfig(
            base=load_config(sys.argv[2], sys.argv[3:]),
            space={"grid": {"train.learning_rate": [0.01, 0.02]}},
            sweep_name=sys.argv[1],
            chip_quota=8,
            max_parallel=1,
        )
    )
"""


def test_the_readme_runs_its_sweep_with_run_sweep():
    example = re.search(r"### Sweeps.*?```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert "run_sweep(" in example.group(1) and "sweep(config" not in example.group(1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["sigterm", "sighup"])
def test_a_signalled_sweep_stops_its_trials_lands_them_and_leaves_no_process(tmp_path, sig):
    name = f"sw-{sig.name.lower()}"
    sweep = start_sweep(tmp_path, name, ["train.steps=100000"])
    started: list[int] = []
    try:
        status = tmp_path / "runs" / f"{name}-t00" / "status.json"
        deadline = time.monotonic() + 240
        while not (status.exists() and json.loads(status.read_text()).get("phase") == "training"):
            assert sweep.poll() is None and time.monotonic() < deadline, "never trained"
            time.sleep(0.2)
        started = _children(sweep.pid)  # its API server and the trial's slice among them
        servers = [pid for pid in started if b"prefect" in _cmdline(pid)]
        assert servers, "no API server started by the sweep"
        sweep.send_signal(sig)
        assert sweep.wait(timeout=90) == 128 + sig
        deadline = time.monotonic() + 30
        while left := _alive(started, tmp_path):
            assert time.monotonic() < deadline, f"{left} outlived the sweep"
            time.sleep(0.1)
        rows = DuckDBSink(str(tmp_path / "metrics.duckdb")).query(
            f"SELECT trial, status FROM sweeps WHERE sweep_id = '{name}' ORDER BY trial"
        )
        assert rows == [(0, "failed"), (1, "cancelled")]  # stopped, and never started
        # The stopped trial's attempt reads stopped in its ledger, not failed.
        events = read_events(str(tmp_path / "runs" / f"{name}-t00" / "events.jsonl"))
        ended = [e["outcome"] for e in events if e["event"] == "attempt_ended"]
        assert ended == ["stopped"], ended
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(sweep.pid, signal.SIGKILL)
        for pid in _alive(started, tmp_path):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_sweep_signalled_while_its_trial_evaluates_stops_the_evaluation(tmp_path):
    # Only the watch of a training slice looked at the sweep's stop: a trial evaluating
    # went on to the end of its evaluation (minutes on a large split) before the sweep
    # could stop, and its run then landed completed under a `sweeps` row of the stop.
    name = "sw-eval"
    overrides = [
        "train.steps=4",
        "dataset.max_bytes=3000000",
        "dataset.eval_fraction=0.4",  # tens of thousands of eval sequences,
        "eval.batch_size=1",  # one per batch: minutes of evaluation
        "eval.max_batches=1000000",
    ]
    sweep = start_sweep(tmp_path, name, overrides)
    try:
        status = tmp_path / "runs" / f"{name}-t00" / "status.json"
        deadline = time.monotonic() + 240
        while not (status.exists() and json.loads(status.read_text()).get("phase") == "finished"):
            assert sweep.poll() is None and time.monotonic() < deadline, "never finished training"
            time.sleep(0.2)
        time.sleep(5)  # the orchestrator verifies the final checkpoint and starts evaluating
        sweep.send_signal(signal.SIGTERM)
        assert sweep.wait(timeout=60) == 128 + signal.SIGTERM
        sink = DuckDBSink(str(tmp_path / "metrics.duckdb"))
        ((status_, error),) = sink.query(
            f"SELECT status, error FROM runs WHERE run_id = '{name}-t00'"
        )
        assert status_ == "failed"
        assert re.search(r"stopped (after \d+ eval batches of step 4|before evaluation)", error)
        assert not (tmp_path / "runs" / f"{name}-t00" / "eval.json").exists()
        rows = sink.query(
            f"SELECT trial, status FROM sweeps WHERE sweep_id = '{name}' ORDER BY trial"
        )
        assert rows == [(0, "failed"), (1, "cancelled")]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(sweep.pid, signal.SIGKILL)


def start_sweep(root: Path, name: str, overrides: list[str]) -> subprocess.Popen:
    """The README's sweep script, run from `root` (its storage root) as on a laptop: no
    `PREFECT_API_URL`, so it starts its own API."""
    script = root / "sweep.py"
    script.write_text(SWEEP)
    env = {**os.environ, "PREFECT_HOME": str(root / "prefect-home"), "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)
    base = [str(REPO / "configs/tiny.yaml"), f"storage.root={root}"]
    return subprocess.Popen(
        [sys.executable, str(script), name, *base, *overrides],
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _alive(pids: list[int], root: Path) -> list[int]:
    """Those of `pids` still running, and any process naming `root` (a trial's workload)."""
    return [pid for pid in pids if running(pid)] + processes_mentioning(str(root))


def _cmdline(pid: int) -> bytes:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    return b""
