"""Goodput arithmetic on a recorded events.jsonl of a run preempted twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.goodput import BUCKETS, compute_goodput, read_events

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
        "lost": (45 - 40) + (96 - 95),  # SIGKILL after step 20's save; SIGTERM lost ~nothing
        "teardown": 1 + 1 + 1,
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
