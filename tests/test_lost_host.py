"""A slice of two hosts that loses one: host 0, the one that writes the run's reports,
killed outright is a preemption at the step it reached, and the host left (whose
collectives then fail) writes no "failed" heartbeat or event over it; a host that fails
alone is still named in the attempt's error."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from infra.slices import SliceState, SliceStatus
from infra.slices.procs import live_members
from tasks.goodput import read_events
from tasks.watch import WatchSettings, WorkloadFailed, WorkloadPreempted, watch_slice
from tests.workload_runs import WorkloadRun
from workloads.rundir import RunDir

SETTINGS = WatchSettings(poll_s=0.05, heartbeat_timeout_s=600, confirm_s=60)


class Ended:
    """A provider whose slice has ended with `code`."""

    def __init__(self, code: int) -> None:
        self.code = code

    def status(self, name: str) -> SliceStatus:
        return SliceStatus(name, SliceState.TERMINATED, self.code)


@pytest.mark.slow
def test_host_0_killed_is_a_preemption_at_its_step_and_host_1_records_no_failure(tmp_path):
    run = WorkloadRun(tmp_path, "slice.hosts=2", "train.steps=2000", "train.log_every=5")
    name = run.start()
    record = json.loads((run.provider.registry_dir / f"{name}.json").read_text())
    deadline = time.monotonic() + 120
    while not (run.run_dir / "status.json").exists() or (run.status().get("step") or 0) < 10:
        assert time.monotonic() < deadline, "the hosts never reached step 10"
        assert run.provider.status(name).state is SliceState.READY, "attempt ended early"
        time.sleep(0.02)
    os.kill(record["pids"][0], signal.SIGKILL)
    # Host 1 goes on until its next collective breaks, then records what it saw: let it
    # finish before the watch reads the heartbeat, as a slower orchestrator would.
    while live_members(record["pgid"]):
        assert time.monotonic() < deadline + 60, "host 1 outlived host 0 by a minute"
        time.sleep(0.05)
    status = run.status()
    assert status["phase"] == "training" and status["step"] >= 10, status
    assert "failed" not in [e["event"] for e in read_events(run.run_dir / "events.jsonl")]
    with pytest.raises(
        WorkloadPreempted, match=rf"killed \(signal 9, host 0\) at step {status['step']}$"
    ):
        watch_slice(run.provider, name, RunDir(run.run_dir), SETTINGS, lambda m: None, attempt=1)
    run.provider.delete(name)


def test_a_kill_after_a_heartbeat_without_a_step_names_the_last_step_seen(tmp_path):
    rd = RunDir(tmp_path)
    beats = iter([{"phase": "training", "step": 40}, {"phase": "failed", "error": "gloo"}])

    def read_status() -> dict:
        return {"attempt": 1, "time": time.time(), **next(beats, {"phase": "failed"})}

    rd.read_status = read_status

    class KilledOnSecondLook(Ended):
        looks = 0

        def status(self, name: str) -> SliceStatus:
            self.looks += 1
            return SliceStatus(name, SliceState.READY) if self.looks == 1 else super().status(name)

    with pytest.raises(WorkloadPreempted, match=r"killed \(signal 9\) at step 40$"):
        watch_slice(KilledOnSecondLook(-9), "s", rd, SETTINGS, lambda m: None, attempt=1)


def test_a_failure_of_host_1_alone_is_named_in_the_attempts_error(tmp_path):
    rd = RunDir(tmp_path)
    rd.write_status("training", step=5, attempt=2)
    rd.write_host_failure(1, "OSError: shard 7 is unreadable", attempt=2)
    rd.write_host_failure(2, "an older attempt's error", attempt=1)
    with pytest.raises(WorkloadFailed, match=r"code 1: host 1: OSError: shard 7 is unreadable$"):
        watch_slice(Ended(1), "s", rd, SETTINGS, lambda m: None, attempt=2)


CRASHES = """
import ctypes, faulthandler, os, time
faulthandler.enable(all_threads=False)  # as workloads.train does
if os.environ["TPUPIPE_PROCESS_ID"] == "1":
    time.sleep(0.3)
    ctypes.string_at(0)  # a crash in native code: SIGSEGV
time.sleep(60)  # host 0 would wait in its collective
"""


def test_a_host_that_crashes_is_named_with_its_signal_and_its_own_log(tmp_path):
    # It read "exited with code -11: " and host 0's reaction (a collective's "Connection
    # reset by peer"), or host 0's last log line, an unrelated orbax message.
    import sys

    from infra.slices import LocalSliceProvider, SliceSpec

    provider = LocalSliceProvider(tmp_path / "slices")
    log_path = str(tmp_path / "logs" / "s.log")
    provider.create(
        SliceSpec(
            name="s", devices=2, hosts=2, command=[sys.executable, "-c", CRASHES], log_path=log_path
        )
    )
    rd = RunDir(tmp_path)
    host0 = "JaxRuntimeError: UNKNOWN: Gloo AllGather failed: Connection reset by peer"
    rd.write_status("failed", step=5, attempt=2, error=host0)
    try:
        with pytest.raises(WorkloadFailed) as raised:
            watch_slice(provider, "s", rd, SETTINGS, lambda m: None, attempt=2, log_path=log_path)
    finally:
        provider.delete("s", grace_s=0.5)
    message = str(raised.value)
    assert message.startswith("workload on slice s: host 1 was killed by SIGSEGV (signal 11): ")
    assert (
        f"Fatal Python error: Segmentation fault (the last error in {tmp_path}/logs/s-host1.log"
        in message
    )
    assert message.endswith(f"; host 0 then: {host0}")


class EndedOn(Ended):
    """A provider whose slice has ended with `code`, host `host`'s exit."""

    def __init__(self, code: int, host: int) -> None:
        super().__init__(code)
        self.host = host

    def status(self, name: str) -> SliceStatus:
        return SliceStatus(name, SliceState.TERMINATED, self.code, host=self.host)


def test_a_host_that_failed_with_its_own_record_is_named_by_it_and_logs_stay_where_they_are(
    tmp_path, monkeypatch
):
    from tasks import watch

    rd = RunDir(tmp_path)
    rd.write_status("training", step=5, attempt=2)
    rd.write_host_failure(1, "OSError: shard 7 is unreadable", attempt=2)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "s-host1.log").write_text("OSError: shard 7 is unreadable\n")
    with pytest.raises(WorkloadFailed) as raised:
        watch_slice(EndedOn(1, 1), "s", rd, SETTINGS, lambda m: None, attempt=2)
    assert str(raised.value) == (
        "workload on slice s: host 1 exited with code 1: host 1: OSError: shard 7 is unreadable"
    )
    # A gcp slice's log is read where it is (gs://), not as a local path; a worker's is not.
    read = []
    monkeypatch.setattr(watch, "log_error", lambda path: read.append(str(path)))
    log_path = "gs://b/runs/r/logs/s.log"
    assert watch._last_log_line(rd, "s", log_path) is None
    assert watch._last_log_line(rd, "s", log_path, host=1) is None
    assert read == [log_path]
