"""A slice that stays READY while its workload never starts is not a preemption.

The start-up of a slice can fail where nothing reports it (a wheel the workers cannot
download, no route to storage, a host that never joins): the heartbeat stays silent. That
was taken for a preemption, so the run re-created the slice up to `max_preemptions` (20)
times, each for the whole heartbeat timeout (10.5 minutes by default).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from infra.slices import SliceState, SliceStatus
from tasks.watch import (
    WatchSettings,
    WorkloadFailed,
    WorkloadNeverStarted,
    WorkloadPreempted,
    watch_slice,
)
from tests.helpers import FakeClock, tiny_config


class Ready:
    def status(self, name: str) -> SliceStatus:
        return SliceStatus(name, SliceState.READY, None)


class Heartbeats:
    """The status file: `beats(now)` is what it holds at that time."""

    def __init__(self, beats) -> None:
        self.beats, self.clock = beats, None

    def read_status(self) -> dict | None:
        return self.beats(self.clock.now)

    def host_failures(self) -> dict:
        return {}  # no host but 0 recorded a failure


def watch(beats, attempt: int | None = 2, timeout_s: float = 600):
    clock = FakeClock()
    run_dir = Heartbeats(beats)
    run_dir.clock = clock
    settings = WatchSettings(poll_s=10, heartbeat_timeout_s=timeout_s, confirm_s=30)
    return watch_slice(
        Ready(), "s", run_dir, settings, lambda m: None, None, clock, clock.sleep, attempt
    )


def test_a_ready_slice_whose_workload_never_beats_never_started():
    # The last attempt's heartbeat is still in the run directory: it is not this one's.
    with pytest.raises(WorkloadNeverStarted, match=r"never started: no heartbeat in 6\d\ds"):
        watch(lambda now: {"phase": "preempted", "attempt": 1, "time": 990.0, "step": 40})


def test_the_messages_quote_the_timeout_as_configured():
    # A timeout of 0.5 s read "slice.heartbeat_timeout_s = 0".
    with pytest.raises(WorkloadNeverStarted, match=r"slice\.heartbeat_timeout_s = 0\.5\)"):
        watch(lambda now: None, timeout_s=0.5)
    with pytest.raises(WorkloadPreempted, match=r"slice\.heartbeat_timeout_s = 0\.5,"):
        watch(lambda now: {"phase": "training", "attempt": 2, "time": 1000.0}, timeout_s=0.5)


def test_a_stale_heartbeat_without_an_attempt_is_told_by_its_time():
    with pytest.raises(WorkloadNeverStarted):
        watch(lambda now: {"phase": "training", "time": 990.0, "step": 40}, attempt=None)


def test_a_workload_that_beat_and_went_silent_was_preempted():
    def beats(now):  # beats for two minutes, then nothing
        return {"phase": "training", "attempt": 2, "time": min(now, 1120.0), "step": 3}

    with pytest.raises(WorkloadPreempted) as raised:
        watch(beats)
    assert not isinstance(raised.value, WorkloadNeverStarted)
    assert "no heartbeat" in str(raised.value)


def test_an_attempt_whose_workload_never_starts_is_retried_on_the_failure_budget(
    tmp_path, prefect_harness, monkeypatch
):
    import tasks.training
    from flows.pipeline import tpu_training_pipeline
    from tasks.goodput import read_events
    from tasks.watch import WorkloadFailed

    # A slice whose job never gets as far as the workload: READY, and silent.
    monkeypatch.setattr(
        tasks.training,
        "workload_command",
        lambda path: [sys.executable, "-c", "import time; time.sleep(600)", path],
    )
    config = tiny_config(
        tmp_path,
        "run_name=silent",
        "slice.heartbeat_timeout_s=1",
        "slice.poll_interval_s=0.2",
        "resilience.heartbeat_confirm_s=0",
        "resilience.max_failures=1",
        "resilience.max_preemptions=5",
    )
    with pytest.raises(WorkloadFailed, match=r"never started.*resilience.max_failures = 1"):
        tpu_training_pipeline(config=config)
    events = read_events(tmp_path / "runs" / "silent" / "events.jsonl")
    ended = [e for e in events if e["event"] == "attempt_ended"]
    assert [(e["attempt"], e["outcome"]) for e in ended] == [(1, "failed"), (2, "failed")]
    assert all(e["never_started"] for e in ended)
    assert list((tmp_path / "slices").glob("*.json")) == []


def watched_until_1080(beats, clock: FakeClock) -> list[str]:
    """What the watch of attempt 2 logs of the heartbeats `beats(now)` gives, its slice
    READY until 1080 s on `clock`, then TERMINATED with exit 0."""

    class EndsAt1080:
        def status(self, name: str) -> SliceStatus:
            state = SliceState.TERMINATED if clock.now >= 1080 else SliceState.READY
            return SliceStatus(name, state, 0 if clock.now >= 1080 else None)

    lines: list[str] = []
    run_dir = Heartbeats(beats)
    run_dir.clock = clock
    settings = WatchSettings(poll_s=10, heartbeat_timeout_s=600, confirm_s=30)
    watch_slice(EndsAt1080(), "s", run_dir, settings, lines.append, None, clock, clock.sleep, 2)
    return lines


def test_checkpoints_the_workload_quarantined_are_logged_once_each():
    # A resume that quarantined a damaged checkpoint said so only in the slice's log and
    # QUARANTINED.txt: the console showed a resume from an older step without a reason.
    clock = FakeClock()
    bad = [{"step": 30, "reason": "does not restore: ValueError: cut"}]

    def beats(now):
        if now < 1020:  # the last attempt's heartbeat, with a quarantine of its own
            return {"phase": "preempted", "attempt": 1, "time": 990.0, "step": 40,
                    "quarantined": [{"step": 50, "reason": "old"}]}  # fmt: skip
        later = [{"step": 20, "reason": "not finite"}] if now >= 1040 else []
        step = 20 if now < 1060 else 21
        return {"phase": "training", "attempt": 2, "time": now, "step": step,
                "quarantined": bad + later}  # fmt: skip

    lines = watched_until_1080(beats, clock)
    quarantines = [line for line in lines if "quarantined" in line]
    assert quarantines == [
        "checkpoint step 30 was quarantined, not resumed from: does not restore: ValueError: cut",
        "checkpoint step 20 was quarantined, not resumed from: not finite",
    ]


@pytest.mark.parametrize(
    ("start", "bad", "said"),
    [
        (50, [55], ["resuming from the checkpoint of step 50 (newer: step 55, quarantined)"]),
        (50, [], ["resuming from the checkpoint of step 50"]),
        (
            0,
            [40, 35, 30],
            ["training from step 0: none of the run's checkpoints restored "
             "(steps 40, 35, 30, quarantined)"],
        ),
        (0, [], []),  # a new run: nothing to say
    ],
)  # fmt: skip
def test_the_step_an_attempt_trains_from_is_logged_once(start, bad, said):
    # The console said "step 50 loss None (compiling)" after a quarantine, and nothing
    # when every checkpoint was quarantined and the run trained again from step 0: where
    # a rerun resumed was in the slice's log alone (probe Y, session 39).
    clock = FakeClock()
    quarantined = [{"step": s, "reason": "cut"} for s in bad]

    def beats(now):
        if now < 1020:  # the last attempt's heartbeat: not this attempt's start
            return {"phase": "preempted", "attempt": 1, "time": 990.0, "step": 70,
                    "resumed_from": 60}  # fmt: skip
        return {"phase": "compiling" if now < 1050 else "training", "attempt": 2,
                "time": now, "step": start if now < 1050 else start + 1,
                "resumed_from": start, "quarantined": quarantined}  # fmt: skip

    lines = watched_until_1080(beats, clock)
    assert [line for line in lines if line.startswith(("resuming", "training from"))] == said


class ExitsWith:
    """A slice whose workload has exited with `code`."""

    def __init__(self, code: int) -> None:
        self.code = code

    def status(self, name: str) -> SliceStatus:
        return SliceStatus(name, SliceState.TERMINATED, self.code)


def _failed_watch(tmp_path, heartbeat: dict | None, log_text: str | None):
    clock = FakeClock()
    run_dir = Heartbeats(lambda now: heartbeat)
    run_dir.clock, run_dir.path = clock, tmp_path
    if log_text is not None:
        (tmp_path / "logs").mkdir()
        (tmp_path / "logs" / "s.log").write_text(log_text)
    settings = WatchSettings(poll_s=10, heartbeat_timeout_s=600, confirm_s=30)
    with pytest.raises(WorkloadFailed) as raised:
        watch_slice(
            ExitsWith(1), "s", run_dir, settings, lambda m: None, None, clock, clock.sleep, 2
        )
    return str(raised.value)


def test_an_older_attempts_error_is_not_reported_as_this_ones(tmp_path):
    # Attempt 1 failed on a permission; attempt 2's workload died on a full disk before it
    # could write its heartbeat: the run reported attempt 1's PermissionError as its cause.
    old = {"phase": "failed", "attempt": 1, "time": 900.0, "error": "PermissionError: ckpt"}
    error = "OSError: [Errno 28] No space left on device: '/r/metrics.jsonl'"
    log = f"step 3\nTraceback (most recent call last):\n{error}\n"
    message = _failed_watch(tmp_path, old, log)
    assert "PermissionError" not in message
    assert "No space left on device: '/r/metrics.jsonl' (the last error in " in message
    assert str(tmp_path / "logs" / "s.log") in message


def test_a_log_cut_short_by_a_full_disk_gives_its_last_error_and_says_the_disk_is_full(
    tmp_path, monkeypatch
):
    # The log shares the full disk: it ends mid-line, and that fragment was the run's
    # error ("exited with code 1: self._checkpointer.w (the last line of ...)").
    from tasks import slice_log

    error = "OSError: [Errno 28] No space left on device: '/r/checkpoints/8/state'"
    log = (
        f'step 7\nTraceback (most recent call last):\n  File "a.py", line 1\n{error}\n\n'
        "During handling of the above exception, another exception occurred:\n\n"
        'Traceback (most recent call last):\n  File "b.py", line 9, in save\n'
        "    self._checkpointer.w"
    )

    class Full:
        f_bavail, f_frsize = 3, 4096

    monkeypatch.setattr(slice_log.os, "statvfs", lambda path: Full)
    message = _failed_watch(tmp_path, None, log)
    assert f"exited with code 1: {error} (the last error in {tmp_path / 'logs' / 's.log'}" in (
        message
    )
    assert message.endswith("; its disk is full, 12,288 bytes free)")
    # A log without an exception line is quoted by its last line, and a disk with room
    # is not called full.
    monkeypatch.undo()
    (tmp_path / "y").mkdir()
    message = _failed_watch(tmp_path / "y", None, "loading\nKilled\n")
    log = tmp_path / "y" / "logs" / "s.log"
    assert message.endswith(f"Killed (no error in {log}, which ends with this line)")


def test_an_earlier_attempts_error_in_the_same_log_is_not_this_attempts(tmp_path):
    # The local slice log is appended to by every attempt on the slice name: attempt 1's
    # ValueError was reported as "the last error in" it for attempt 2, cut off by a full disk.
    from infra.slices.procs import LOG_START

    log = (
        f"{LOG_START} s, host 0, 2026-11-27T07:00:00+0000 ---\n"
        "Traceback (most recent call last):\nValueError: attempt 1's\n"
        f"\n{LOG_START} s, host 0, 2026-11-27T07:05:00+0000 ---\n"
        "step 3\x00\x00\x00\nsaving checkpoint 4\n    self._check"
    )
    message = _failed_watch(tmp_path, None, log)
    assert "attempt 1's" not in message and "self._check (no error in" in message


def test_this_attempts_error_is_reported_and_without_one_or_a_log_the_log_is_named(tmp_path):
    ours = {"phase": "failed", "attempt": 2, "time": 1000.0, "error": "ValueError: bad batch"}
    assert "ValueError: bad batch" in _failed_watch(tmp_path, ours, "OSError: not this\n")
    assert _failed_watch(tmp_path / "x", None, None).endswith("see the slice log")


def test_a_workload_that_lost_its_lease_says_another_orchestrator_runs_the_run(tmp_path):
    # It read "exited with code 76: see the slice log".
    clock = FakeClock()
    run_dir = Heartbeats(lambda now: {"phase": "training", "attempt": 2, "time": now})
    run_dir.clock, run_dir.path = clock, tmp_path
    settings = WatchSettings(poll_s=10, heartbeat_timeout_s=600, confirm_s=30)
    with pytest.raises(WorkloadFailed, match="another orchestrator is running this run"):
        watch_slice(ExitsWith(76), "s", run_dir, settings, print, None, clock, clock.sleep, 2)


def test_a_local_slice_of_a_gs_root_logs_on_this_machine_and_its_last_line_is_quoted(
    tmp_path, monkeypatch
):
    # Its log was written under the working directory, as `./gs:/<bucket>/root/runs/...`.
    from tasks.plan import plan_run, slice_log_path
    from tests.helpers import tiny_config

    monkeypatch.chdir(tmp_path)
    config = tiny_config(tmp_path, "storage.root=gs://bucket/root", "run_name=r")
    plan = plan_run(config)
    path = slice_log_path(config, plan)
    assert path == str(tmp_path / ".tpupipe" / "logs" / "r" / "tpupipe-r.log")
    local = config.model_copy(update={"storage": config.storage.model_copy(update={"root": "s"})})
    assert slice_log_path(local, plan_run(local)) == str(tmp_path / "s/runs/r/logs/tpupipe-r.log")

    Path(path).parent.mkdir(parents=True)
    Path(path).write_text("Traceback (most recent call last):\nOSError: [Errno 28] No space\n")
    clock = FakeClock()
    run_dir = Heartbeats(lambda now: None)
    run_dir.clock, run_dir.path = clock, "gs://bucket/root/runs/r"
    settings = WatchSettings(poll_s=10, heartbeat_timeout_s=600, confirm_s=30)
    with pytest.raises(WorkloadFailed, match=rf"No space \(the last error in {path}\)"):
        watch_slice(
            ExitsWith(1), "tpupipe-r", run_dir, settings, print, None, clock, clock.sleep, 2,
            log_path=path,
        )  # fmt: skip


def test_an_earlier_attempts_heartbeat_is_not_logged_as_this_ones_progress():
    # A rerun logged the crashed attempt's last beat ("step 75 loss 2.76 (training)")
    # before its own workload restored step 50.
    logged = []
    clock = FakeClock()
    run_dir = Heartbeats(
        lambda now: (
            {"phase": "training", "attempt": 1, "time": 990.0, "step": 75, "loss": 2.76}
            if now < 1020
            else {"phase": "finished", "attempt": 2, "time": now, "step": 80}
        )
    )
    run_dir.clock = clock

    class EndsAt1030(Ready):
        def status(self, name: str) -> SliceStatus:
            if clock.now < 1030:
                return super().status(name)
            return SliceStatus(name, SliceState.TERMINATED, 0)

    settings = WatchSettings(poll_s=10, heartbeat_timeout_s=600, confirm_s=30)
    outcome = watch_slice(
        EndsAt1030(), "s", run_dir, settings, logged.append, None, clock, clock.sleep, 2
    )
    assert outcome.final_step == 80
    # No "loss None": a phase without a loss (finished, restoring, compiling) says none.
    assert [m for m in logged if m.startswith("step ")] == ["step 80 (finished)"]


def test_a_sigterm_is_a_notice_even_before_the_workload_could_save():
    # Killed by a SIGTERM that came before its handler was installed, attempts counted as
    # stalled ("lost without a preemption notice") and failed the run after 3.
    from tasks.watch import PREEMPTED_EXIT, _ended

    with pytest.raises(WorkloadPreempted) as term:
        _ended("s", -15, {}, 1.0)
    assert term.value.announced and str(term.value).endswith("before its first step")
    # Noticed in start-up, after restoring step 7: it saved nothing (probe T read 'saved
    # step 7 and exited', in the attempt's reason and the report).
    with pytest.raises(WorkloadPreempted) as early:
        _ended("s", PREEMPTED_EXIT, {"step": 7, "saved": False}, 1.0)
    said = "workload on s stopped at the notice before its first step (its newest checkpoint"
    assert str(early.value).startswith(said) and "step 7" in str(early.value)
    with pytest.raises(WorkloadPreempted, match=r"before its first step \(no checkpoint yet\)"):
        _ended("s", PREEMPTED_EXIT, {"step": 0, "saved": False}, 1.0)
    with pytest.raises(WorkloadPreempted, match=r"^workload on s saved step 9 and exited$"):
        _ended("s", PREEMPTED_EXIT, {"step": 9}, 1.0)
    with pytest.raises(WorkloadPreempted) as kill:
        _ended("s", -9, {"step": 7}, 1.0, host=1)
    assert not kill.value.announced and "(signal 9, host 1) at step 7" in str(kill.value)
