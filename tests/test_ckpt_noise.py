"""A damaged checkpoint is reported once, by what read it: the restore's other reads, still
in flight when it failed, printed 26-50 tracebacks ("Event loop is closed", and "Exception
ignored in <coroutine _read_array_index_and_device_put>" with each array's TensorStore
spec) into a rerun's terminal and the workload's log (probe Y, session 39)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.helpers import REPO, cut_checkpoint_data
from tests.workload_runs import WorkloadRun

pytestmark = pytest.mark.slow

# Restores a step as the orchestrator's verification does, then waits for the reads'
# leftovers (they come within about a second of the failure).
VERIFY = """
import sys, time
from workloads.ckpt_restore import restore_on_host
try:
    restore_on_host(sys.argv[1], int(sys.argv[2]), with_data=True)
except Exception as exc:
    print("refused:", type(exc).__name__)
time.sleep(3)
"""


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> WorkloadRun:
    """A finished tiny run with checkpoints every 5 steps up to 40."""
    run = WorkloadRun(
        tmp_path_factory.mktemp("noise"), "train.steps=40", "train.checkpoint_every=5"
    )
    assert run.run_to_end() == 0
    return run


def test_a_cut_step_s_verification_prints_one_error_and_no_tracebacks(finished, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished.run_dir, run_dir)
    cut_checkpoint_data(run_dir / "checkpoints" / "40" / "state")
    done = subprocess.run(
        [sys.executable, "-c", VERIFY, str(run_dir), "40"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert done.returncode == 0 and "refused: " in done.stdout, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_a_resume_past_a_cut_step_logs_its_warning_and_no_tracebacks(finished):
    cut_checkpoint_data(finished.run_dir / "checkpoints" / "40" / "state")
    name = finished.start()
    assert finished.wait(name) == 0
    log = (finished.run_dir / "logs" / f"{name}.log").read_text()
    assert "checkpoint step 40 does not restore" in log  # quarantined, then step 5 resumed
    assert "Traceback" not in log and "Exception ignored" not in log, log[-3000:]
