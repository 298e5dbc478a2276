"""The chaos monkey's count of attempts hit: an attempt counts once its signal is sent.

Counted when the monkey was attached, an attempt that finished before its trigger fired
(`at_step` near the run's last step) used up `times` though nothing was sent: the run
completed with no preemption, its counter saying one attempt was hit."""

from __future__ import annotations

import signal
import subprocess
import sys

from infra.slices.chaos import ChaosMonkey
from workloads.events import EventLog
from workloads.rundir import RunDir


def sleeper(seconds: float) -> subprocess.Popen:
    code = f"import time; time.sleep({seconds})"
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def test_an_attempt_that_ends_before_its_trigger_is_not_counted(tmp_path):
    run_dir = str(tmp_path / "run")
    (tmp_path / "run").mkdir()
    monkey = ChaosMonkey(tmp_path / "slices", "r", {"signal": "TERM", "at_step": 5, "times": 1})
    events, status = EventLog(run_dir, attempt=1), RunDir(run_dir)

    done = sleeper(0.5)  # trains 3 steps and finishes: the trigger never fires
    watch = monkey.attach(done.pid, run_dir)
    events.emit("first_step", resumed_from=0)
    status.write_status("training", step=3)
    assert done.wait(timeout=20) == 0
    watch.join(5)

    hit = sleeper(60)  # so the next attempt is watched, and hit
    try:
        watch = monkey.attach(hit.pid, run_dir)
        assert watch is not None
        events.emit("first_step", resumed_from=0)
        status.write_status("training", step=5)
        assert hit.wait(timeout=20) == -signal.SIGTERM
        watch.join(5)
    finally:
        hit.kill()
        hit.wait()
    assert monkey.attach(hit.pid, run_dir) is None  # its one hit is spent
