"""Goodput arithmetic on a recorded events.jsonl of a run preempted twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.goodput import BUCKETS, attempt_timelines, compute_goodput, read_events
from tests.helpers import attempt_events

RECORDED = Path(__file__).parent / "data" / "events-three-attempts.jsonl"


def test_buckets_of_a_run_killed_once_and_preempted_once():
    events = read_events(RECORDED)  # its torn last line is skipped
    result = compute_goodput(events)
    assert result.wall_s == 151
    assert result.attempts == 3 and result.preemptions == 2
    assert result.seconds == {
        "provisioning": 10 + (70 - 50) + 5,  # the failed create counts as waiting
        "startup": (20 - 10) + (80 - 70 - 2) + (115 - 105 - 3),
        "restore": 2 + 3,
        "productive": (40 - 20) + (95 - 80) + (150 - 115),
        "lost": 45 - 40,  # SIGKILL after step 20's save
        "teardown": 1 + (96 - 95) + 1 + 1,  # with the exit after SIGTERM's save of step 30
        "idle": 151 - 144,
    }
    assert sum(result.seconds.values()) == pytest.approx(result.wall_s)
    assert result.goodput == pytest.approx(70 / 151)


def test_an_uninterrupted_run_is_all_startup_and_work():
    events = [
        {"time": 0, "attempt": 1, "event": "provision_requested"},
        {"time": 2, "attempt": 1, "event": "provision_ready"},
        {"time": 5, "attempt": 1, "event": "first_step", "step": 1, "resumed_from": 0},
        {"time": 105, "attempt": 1, "event": "finished", "step": 100},
        {"time": 105, "attempt": 1, "event": "attempt_ended", "outcome": "completed"},
        {"time": 106, "attempt": 1, "event": "deleted"},
    ]
    result = compute_goodput(events)
    assert result.preemptions == 0
    assert result.seconds["productive"] == 100 and result.seconds["lost"] == 0
    assert result.goodput == pytest.approx(100 / 106)


def test_the_wait_after_the_final_step_is_teardown_not_lost():
    # The orchestrator notices the workload's exit 3 s after its last step and deletes
    # the slice 1 s later: nothing is trained again, the chips are merely still held.
    events = [
        {"time": 0, "attempt": 1, "event": "provision_requested"},
        {"time": 2, "attempt": 1, "event": "provision_ready"},
        {"time": 5, "attempt": 1, "event": "first_step", "step": 1, "resumed_from": 0},
        {"time": 105, "attempt": 1, "event": "finished", "step": 100},
        {"time": 108, "attempt": 1, "event": "attempt_ended", "outcome": "completed"},
        {"time": 109, "attempt": 1, "event": "deleted"},
    ]
    result = compute_goodput(events)
    assert result.seconds["lost"] == 0 and result.seconds["teardown"] == 3 + 1
    assert result.seconds["productive"] == 100


def test_no_events_is_no_goodput():
    result = compute_goodput([])
    assert result.goodput is None and set(result.seconds) == set(BUCKETS)


def _startup_preemption(restored: bool) -> list[dict]:
    """Attempt 2 is preempted in start-up, before its first step (with or without having
    restored step 10 first); attempt 3 resumes from attempt 1's step 10."""
    attempt2 = [
        {"time": 20, "attempt": 2, "event": "provision_requested"},
        {"time": 22, "attempt": 2, "event": "provision_ready"},
        {"time": 23, "attempt": 2, "event": "started"},
        *([{"time": 24, "attempt": 2, "event": "restored", "step": 10}] if restored else []),
        {"time": 26, "attempt": 2, "event": "attempt_ended", "outcome": "preempted"},
        {"time": 27, "attempt": 2, "event": "deleted"},
    ]
    return [
        *attempt_events(1, 0, 0, 10, "preempted"),  # saves step 10 at 14
        *attempt2,
        *attempt_events(3, 30, 10, 20, "completed"),
    ]


@pytest.mark.parametrize("restored", [False, True])
def test_work_a_later_attempt_resumed_from_is_kept_past_a_stepless_attempt(restored):
    timelines = attempt_timelines(_startup_preemption(restored))
    assert [t.kept_step for t in timelines] == [10, None, 20]
    assert [t.steps_kept for t in timelines] == [10, 0, 10]
    result = compute_goodput(_startup_preemption(restored))
    assert result.seconds["productive"] == 9 + 9  # attempt 1's steps 1-10 were not lost
    assert result.seconds["lost"] == 0  # its save at 14 and exit at 15 lost no step


def test_a_final_attempt_that_restored_the_last_step_keeps_the_run_s_steps():
    # SIGTERM at the last step: attempt 1 saves step 12 and exits preempted; attempt 2
    # restores step 12, has no step to take (no `first_step`) and finishes.
    events = [
        *attempt_events(1, 0, 0, 12, "preempted"),  # saves 12 at 16, ends 17, deleted 18
        {"time": 20, "attempt": 2, "event": "provision_requested"},
        {"time": 22, "attempt": 2, "event": "provision_ready"},
        {"time": 24, "attempt": 2, "event": "restored", "step": 12, "seconds": 1.0},
        {"time": 25, "attempt": 2, "event": "finished", "step": 12},
        {"time": 26, "attempt": 2, "event": "attempt_ended", "outcome": "completed"},
        {"time": 27, "attempt": 2, "event": "deleted"},
    ]
    first, second = attempt_timelines(events)
    assert (first.first_step, first.kept_step, first.steps_kept) == (0, 12, 12)
    assert (second.resumed_from, second.steps_kept) == (12, 0)
    result = compute_goodput(events)
    assert result.seconds["productive"] == 16 - 5 and result.goodput == pytest.approx(11 / 27)


def test_a_preemption_notice_s_save_and_exit_is_teardown_not_lost():
    # SIGTERM after step 10: the workload saves step 10 (its `checkpoint` event as the save
    # starts, `preempted` once it has committed) and exits; attempt 2 resumes from step 10,
    # so nothing after it was trained again. A SIGKILL after step 10's save loses the rest.
    def ledger(notice: bool) -> list[dict]:
        attempt1 = [
            {"time": 0, "attempt": 1, "event": "provision_requested"},
            {"time": 2, "attempt": 1, "event": "provision_ready"},
            {"time": 5, "attempt": 1, "event": "first_step", "step": 1, "resumed_from": 0},
            {"time": 14, "attempt": 1, "event": "checkpoint", "step": 10},
            *([{"time": 15, "attempt": 1, "event": "preempted", "step": 10}] if notice else []),
            {"time": 16, "attempt": 1, "event": "attempt_ended", "outcome": "preempted"},
            {"time": 17, "attempt": 1, "event": "deleted"},
        ]
        return [*attempt1, *attempt_events(2, 20, 10, 20, "completed")]

    noticed, killed = compute_goodput(ledger(True)), compute_goodput(ledger(False))
    assert noticed.seconds["productive"] == killed.seconds["productive"] == (14 - 5) + 9
    assert noticed.seconds["lost"] == 0 and killed.seconds["lost"] == 16 - 14
    assert noticed.seconds["teardown"] == killed.seconds["teardown"] + (16 - 14)


def test_a_run_stopped_by_a_notice_keeps_the_steps_its_last_attempt_saved():
    # probe V: a run SIGTERMed at step 101 saved it and exited; until a rerun restored it,
    # its report and row said goodput 0, every second of training lost, 0 tokens trained.
    events = [
        {"time": 0, "attempt": 1, "event": "provision_requested"},
        {"time": 2, "attempt": 1, "event": "provision_ready"},
        {"time": 5, "attempt": 1, "event": "first_step", "step": 1, "resumed_from": 0},
        {"time": 14, "attempt": 1, "event": "checkpoint", "step": 10},
        {"time": 15, "attempt": 1, "event": "preempted", "step": 10},
        {"time": 16, "attempt": 1, "event": "attempt_ended", "outcome": "stopped"},
        {"time": 17, "attempt": 1, "event": "deleted"},
    ]
    (line,) = attempt_timelines(events)
    assert (line.kept_step, line.steps_kept) == (10, 10)
    result = compute_goodput(events)
    assert result.seconds["productive"] == 14 - 5 and result.seconds["lost"] == 0
    assert result.seconds["teardown"] == (16 - 14) + 1
    # Killed without a notice instead: what it saved may not have committed, and a rerun
    # trains again from wherever it resumes: lost until then, as before.
    killed = [e for e in events if e["event"] != "preempted"]
    (line,) = attempt_timelines(killed)
    assert line.steps_kept == 0 and compute_goodput(killed).seconds["lost"] == 16 - 5
    # A rerun that resumed from the saved step keeps the same steps.
    rerun = [*events, *attempt_events(2, 30, 10, 20, "completed")]
    assert attempt_timelines(rerun)[0].steps_kept == 10


@pytest.mark.parametrize("resumed", [10, 0])
def test_steps_trained_again_after_the_final_checkpoint_was_quarantined_are_lost(resumed):
    # A rerun found step 12 corrupt, quarantined it and resumed from step 10 (or, keeping
    # one checkpoint, from scratch): attempt 1's steps after that were done again. They
    # counted twice (24 steps for a 12-step run) and none of attempt 1's time as lost.
    attempt1 = attempt_events(1, 0, 0, 12, "completed", invocation="a")
    attempt1.insert(3, {"time": 14, "attempt": 1, "event": "checkpoint", "step": 10})
    events = [*attempt1, *attempt_events(2, 30, resumed, 12, "completed", invocation="b")]
    first, second = attempt_timelines(events)
    kept = resumed or None
    assert (first.kept_step, first.steps_kept) == (kept, resumed)
    assert second.steps_kept == 12 - resumed
    result = compute_goodput(events)
    # attempt 1: first step at 5, its step 10 saved at 14, step 12 at 16, ended at 17;
    # attempt 2: first step at 35, one step a second to step 12
    assert result.seconds["productive"] == (14 - 5 if resumed else 0) + (12 - resumed - 1)
    assert result.seconds["lost"] == (17 - 14 if resumed else 17 - 5)


def test_a_line_that_is_not_utf8_is_skipped_like_a_torn_one(tmp_path):
    # `tpupipe report` crashed with a UnicodeDecodeError traceback on such a ledger.
    ledger = tmp_path / "events.jsonl"
    ledger.write_bytes(RECORDED.read_bytes() + b"\xff\xfe garbage\n")
    assert read_events(ledger) == read_events(RECORDED)


def test_an_attempt_a_killed_orchestrator_left_reads_abandoned_once_a_rerun_took_over():
    # The orchestrator of attempt 1 was SIGKILLed: no attempt_ended. Before, the report
    # showed it "running?" for good, after the rerun's attempt 2 had finished the run.
    killed = attempt_events(1, 0, 0, 10, "preempted", invocation="a")
    orphan = [e for e in killed if e["event"] not in ("attempt_ended", "deleted")]
    rerun = attempt_events(2, 30, 10, 20, "completed", invocation="b")
    assert [t.outcome for t in attempt_timelines(orphan)] == [None]  # maybe still running
    assert [t.outcome for t in attempt_timelines([*orphan, *rerun])] == ["abandoned", "completed"]
    assert compute_goodput([*orphan, *rerun]).preemptions == 0


def test_a_finished_workload_whose_orchestrator_was_killed_reads_finished():
    # Its workload trained to the end alone; the report showed it "running?".
    done = attempt_events(1, 0, 0, 10, "completed", invocation="a")
    orphan = [e for e in done if e["event"] not in ("attempt_ended", "deleted")]
    assert any(e["event"] == "finished" for e in orphan)
    assert [t.outcome for t in attempt_timelines(orphan)] == ["finished"]
    assert compute_goodput(orphan).preemptions == 0


def test_an_attempt_whose_workload_finished_before_its_orchestrator_failed_completed():
    # A sweep stopped 0.4 s after a trial's workload finished, before the watch looked
    # again: its attempt read "failed" in the report, beside the run's "completed".
    done = attempt_events(1, 0, 0, 10, "completed", invocation="a")
    stopped = [
        {**e, "outcome": "failed", "reason": "WatchStopped: stopped while training"}
        if e["event"] == "attempt_ended"
        else e
        for e in done
    ]
    (line,) = attempt_timelines(stopped)
    assert (line.outcome, line.steps_kept) == ("completed", 10)
    # One that failed without finishing still reads failed.
    failed = [e for e in stopped if e["event"] != "finished"]
    assert [t.outcome for t in attempt_timelines(failed)] == ["failed"]
