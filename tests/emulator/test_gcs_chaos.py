"""The local provider's chaos triggers on a run directory in GCS (a gs:// storage root with
local slices). Read as a local path, the directory was never found: `at_step` and
`during_save` never fired, and the attempt still counted as hit, so a failure schedule
given to reproduce a preemption silently reproduced nothing."""

from __future__ import annotations

import signal
import time

import pytest

from infra.slices.chaos import ChaosMonkey
from tests.test_chaos_monkey import sleeper
from workloads.events import EventLog
from workloads.rundir import RunDir

pytestmark = pytest.mark.emulator


@pytest.mark.parametrize("trigger", ["at_step", "during_save"])
def test_a_trigger_fires_on_a_run_directory_in_gcs(gcs_client, bucket, tmp_path, trigger):
    run_dir = f"gs://{bucket}/root/runs/r"
    settings = {"signal": "TERM", "times": 1, trigger: 3 if trigger == "at_step" else True}
    monkey = ChaosMonkey(tmp_path, "r", settings)
    events, status = EventLog(run_dir, attempt=1), RunDir(run_dir)
    events.emit("started")  # an earlier event: not this attempt's news
    attempt = sleeper(60)
    try:
        watch = monkey.attach(attempt.pid, run_dir)
        assert watch is not None
        events.emit("first_step", resumed_from=10)
        status.write_status("training", step=12)
        time.sleep(1.0)
        assert attempt.poll() is None  # 2 steps since it resumed, no save yet
        if trigger == "at_step":
            status.write_status("training", step=13)
        else:
            events.emit("checkpoint", step=12)
        assert attempt.wait(timeout=20) == -signal.SIGTERM
        watch.join(5)
    finally:
        attempt.kill()
        attempt.wait()
    # Its one attempt is spent: the next is not watched.
    assert monkey.attach(attempt.pid, run_dir) is None
