"""Steps a workload trained after its orchestrator was killed, and a rerun trained again.

An orchestrator killed outright (SIGKILL, its machine lost) leaves its workload training:
it records checkpoints in events.jsonl, not steps. The rerun deletes the left slice and
resumes from the newest checkpoint, so what the orphan trained after it is trained again.
The ledger ended the abandoned attempt at its last event (that checkpoint): that work was
neither lost nor wall time, and goodput read too high (a probe: 80% for 65%).

The synthetic run: attempt 1 (flow a) saves step 10 at t=14 and its orchestrator dies;
its workload logs steps 11..25 at t=15..29; the rerun (flow b) deletes its slice at t=40
and attempt 2 resumes from step 10 and finishes at step 30.
"""

from __future__ import annotations

import json

import pytest

from tasks.attempts import trained_after
from tasks.goodput import attempt_timelines, compute_goodput, ledger_events
from tests.helpers import attempt_events

ORPHAN_ROWS = [{"step": s, "time": 4.0 + s, "loss": 1.0} for s in range(11, 26)]  # t 15..29


def killed_then_rerun() -> list[dict]:
    killed = attempt_events(1, 0, 0, 10, "preempted", invocation="a")
    orphan = [e for e in killed if e["event"] not in ("preempted", "attempt_ended", "deleted")]
    left = {
        "time": 40.0,
        "event": "leftover_deleted",
        "attempt": 1,
        "source": "orchestrator",
        "invocation": "b",
        "state": "READY",
    }
    rerun = attempt_events(2, 40.5, 10, 30, "completed", invocation="b")
    return [*orphan, left, *rerun]


def rerun_rows() -> list[dict]:
    """Attempt 2's own rows: steps 11..30 again, from t=45.5."""
    return [{"step": s, "time": 34.5 + s, "loss": 0.5} for s in range(11, 31)]


def test_what_the_orphan_trained_after_the_checkpoint_the_rerun_resumed_from_is_lost():
    events = killed_then_rerun()
    before = compute_goodput(events)
    assert before.seconds["lost"] == 0.0  # the old reading: ended at its checkpoint, t=14

    added = trained_after(events, lambda: ORPHAN_ROWS + rerun_rows())
    assert [(e["event"], e["attempt"], e["step"], e["time"]) for e in added] == [
        ("trained", 1, 25, 29.0)
    ]
    first, second = attempt_timelines(events + added)
    assert (first.outcome, first.ended, first.kept_step) == ("abandoned", 29.0, 10)
    assert second.outcome == "completed"
    after = compute_goodput(events + added)
    # Attempt 1: productive from its first step (t=5) to the checkpoint kept (t=14), lost
    # from there to the orphan's last logged step (t=29).
    assert after.seconds["lost"] == pytest.approx(15.0)
    assert after.seconds["productive"] == pytest.approx(before.seconds["productive"])
    # Its invocation ran until then: 29 s, not 14 (the rerun's own span is unchanged).
    assert after.wall_s == pytest.approx(before.wall_s + 15.0)
    assert after.goodput < before.goodput


def test_rows_outside_the_orphan_s_window_are_not_its_own():
    events = killed_then_rerun()
    # Only rows before its last event (steps 1..10) and the rerun's: nothing was lost.
    early = [{"step": s, "time": 4.0 + s} for s in range(1, 11)]
    assert trained_after(events, lambda: early + rerun_rows()) == []
    # A row logged after the rerun deleted its slice is no row of the orphan's.
    late = [{"step": 99, "time": 40.2}]
    (added,) = trained_after(events, lambda: ORPHAN_ROWS + late)
    assert added["time"] == 29.0


def test_no_metrics_are_read_without_an_abandoned_attempt():
    def unread():
        raise AssertionError("metrics.jsonl read for nothing")

    whole = attempt_events(1, 0, 0, 10, "preempted", invocation="a") + attempt_events(
        2, 20, 10, 20, "completed", invocation="a"
    )
    assert trained_after(whole, unread) == []
    # A workload that finished alone (its orchestrator killed) trained nothing again.
    done = attempt_events(1, 0, 0, 10, "completed", invocation="a")
    finished = [e for e in done if e["event"] not in ("attempt_ended", "deleted")]
    assert trained_after(finished + attempt_events(2, 30, 10, 10, "completed", "b"), unread) == []
    # The last attempt is not abandoned (it may still be running): nothing added.
    orphan = [e for e in done if e["event"] not in ("finished", "attempt_ended", "deleted")]
    assert trained_after(orphan, unread) == []


def test_the_report_and_landing_read_it_from_the_run_directory(tmp_path):
    (tmp_path / "events.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in killed_then_rerun())
    )
    rows = sorted(ORPHAN_ROWS + rerun_rows(), key=lambda r: r["time"])
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    goodput = compute_goodput(ledger_events(str(tmp_path)))
    assert goodput.seconds["lost"] == pytest.approx(15.0)


def test_the_heartbeat_the_deleting_orchestrator_found_places_steps_the_logs_missed():
    # train.log_every large: metrics.jsonl held no row past the checkpoint, and 7.5 s the
    # orphan trained read lost 0 s. The rerun records its last heartbeat on the deletion.
    events = killed_then_rerun()
    (left,) = [e for e in events if e["event"] == "leftover_deleted"]
    left.update(beat_time=33.0, beat_step=29)
    assert trained_after(events, lambda: [])[0]["time"] == 33.0
    assert compute_goodput(events + trained_after(events, list)).seconds["lost"] == 19.0
    # The later of the two: a metrics row after the beat counts (none can be: it stopped).
    (added,) = trained_after(events, lambda: ORPHAN_ROWS)
    assert (added["time"], added["step"], added["source"]) == (33.0, 29, "heartbeat")
    # Beating when its slice's delete began (`trained_until`): it trained until then.
    left.update(trained_until=39.5)
    assert trained_after(events, lambda: ORPHAN_ROWS)[0]["time"] == 39.5
    # Another attempt's heartbeat is never recorded (`tasks.own_slice`), and a beat from
    # before the attempt's last event says nothing.
    del left["trained_until"]
    left.update(beat_time=10.0)
    assert trained_after(events, lambda: []) == []
