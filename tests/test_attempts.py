"""Attempt numbers across invocations of one run name, and the ledgers they leave.

A rerun of a run name (after a failure, after a success, a sweep run again) appends to
the same `events.jsonl`. The synthetic run here: invocation A at t=0 is preempted twice
and fails on its preemption budget; invocation B, 1000 s later, is preempted once and
finishes. 40 steps, 10 per attempt. Expected figures are worked out by hand.
"""

from __future__ import annotations

import itertools
import signal
from pathlib import Path

import pytest

from tasks.attempts import by_attempt, next_attempt, split_invocations, stalled_in_a_row
from tasks.goodput import attempt_timelines, compute_goodput
from tests.helpers import attempt_events


def two_invocations(numbers: tuple[int, int, int, int], marks=(None, None)) -> list[dict]:
    """A's two attempts then B's two, numbered `numbers`, A/B stamped with `marks`."""
    a1, a2, b1, b2 = numbers
    return [
        *attempt_events(a1, 0, 0, 10, "preempted", marks[0]),  # ends 16
        *attempt_events(a2, 20, 10, 20, "preempted", marks[0]),  # ends 36
        *attempt_events(b1, 1000, 20, 30, "preempted", marks[1]),  # ends 1016
        *attempt_events(b2, 1020, 30, 40, "completed", marks[1]),  # ends 1036
    ]


# Today's ledger (numbers go on, flow runs stamped) and one written before the fix
# (numbers restart at 1, no invocation) must read the same.
LEDGERS = {
    "numbered-across-invocations": two_invocations((1, 2, 3, 4), ("flow-a", "flow-b")),
    "old-numbers-restart": two_invocations((1, 2, 1, 2)),
}


@pytest.mark.parametrize("kind", LEDGERS)
def test_each_invocation_keeps_its_own_attempts(kind):
    events = LEDGERS[kind]
    invocations = split_invocations(events)
    assert [list(inv) for inv in invocations] == [[1, 2], [3, 4]]
    timelines = attempt_timelines(events)
    assert [t.attempt for t in timelines] == [1, 2, 3, 4]
    assert [t.outcome for t in timelines] == ["preempted"] * 3 + ["completed"]
    # No attempt reaches into another's time: each ends before the next is requested.
    for before, after in itertools.pairwise(timelines):
        assert before.deleted < after.requested
    assert [(t.first_step, t.kept_step) for t in timelines] == [
        (0, 10),
        (10, 20),
        (20, 30),
        (30, 40),
    ]
    assert [t.steps_kept for t in timelines] == [10, 10, 10, 10]


@pytest.mark.parametrize("kind", LEDGERS)
def test_the_time_between_invocations_is_not_wall_time(kind):
    result = compute_goodput(LEDGERS[kind])
    assert (result.attempts, result.preemptions, result.invocations) == (4, 3, 2)
    assert result.wall_s == 36 + 36  # each invocation: first request to last deletion
    assert result.seconds == {
        "provisioning": 4 * 2,
        "startup": 3 + 3 * 2,  # attempt 1 restores nothing; the others restore for 1 s
        "restore": 3 * 1.0,
        "productive": 4 * 9,  # the first step done at +5, the tenth at +14
        "lost": 0,  # each preempted attempt saved the step it stopped at: nothing redone
        "teardown": 4 * 1 + 1 + 3 * 1,  # deletions, the finished run's and SIGTERMs' exits
        "idle": 2 * 4,  # between the attempts of each invocation; not the 964 s between
    }
    assert sum(result.seconds.values()) == pytest.approx(result.wall_s)


def test_next_attempt_goes_on_from_the_highest_in_the_ledger():
    assert next_attempt([]) == 1
    assert next_attempt(LEDGERS["numbered-across-invocations"]) == 5
    # An old ledger's second invocation counts as attempts 3 and 4.
    assert next_attempt(LEDGERS["old-numbers-restart"]) == 5


def test_a_new_invocation_after_an_old_ledger_is_numbered_after_it():
    events = [*LEDGERS["old-numbers-restart"], *attempt_events(5, 2000, 40, 40, "completed", "c")]
    assert list(by_attempt(events)) == [1, 2, 3, 4, 5]
    assert [list(inv) for inv in split_invocations(events)] == [[1, 2], [3, 4], [5]]


def test_provisioning_retries_within_an_attempt_stay_one_attempt():
    events = attempt_events(1, 10, 0, 5, "completed", "a")
    failed = [
        {"time": 0, "attempt": 1, "event": "provision_requested", "invocation": "a"},
        {"time": 1, "attempt": 1, "event": "provision_failed", "invocation": "a"},
    ]
    assert [list(inv) for inv in split_invocations(failed + events)] == [[1]]
    (line,) = attempt_timelines(failed + events)
    assert line.requested == 0 and line.ready == 12 and line.steps_kept == 5


def test_a_workload_started_by_hand_is_no_attempt_of_the_ledger(tmp_path):
    # The README runs the workload alone with `python -m workloads.train`. Its events were
    # numbered attempt 0: the report listed an "abandoned" attempt 0, and the next landing
    # counted the hand run's time (wall 24.9 -> 51.2 s, goodput 0.42 -> 0.20 in a probe).
    import json

    from tasks.goodput import read_events
    from workloads.events import EVENTS, EventLog

    ledger = attempt_events(1, 10, 0, 5, "completed", "a")
    (tmp_path / EVENTS).write_text("".join(json.dumps(e) + "\n" for e in ledger))
    by_hand = EventLog.from_env(str(tmp_path), env={})
    for event in ("started", "restored", "finished"):
        by_hand.emit(event, step=5)
    lines = (tmp_path / EVENTS).read_text().splitlines()
    assert [json.loads(line)["attempt"] for line in lines[-3:]] == [None, None, None]
    assert read_events(tmp_path / EVENTS) == ledger
    assert compute_goodput(read_events(tmp_path / EVENTS)) == compute_goodput(ledger)
    assert EventLog.from_env(str(tmp_path), env={"TPUPIPE_ATTEMPT": "2"}).attempt == 2


def test_stalled_attempts_are_counted_back_from_this_invocations_last():
    def ended(t: float, invocation: str, **fields) -> dict:
        return {"time": t, "event": "attempt_ended", "invocation": invocation, **fields}

    events = [
        ended(1, "a", outcome="preempted", stalled=True),  # an earlier invocation's
        ended(2, "b", outcome="preempted", stalled=True),
        ended(3, "b", outcome="preempted"),  # it saved a checkpoint: the count starts again
        ended(5, "b", outcome="preempted", stalled=True),
        {"time": 5.5, "event": "provision_requested", "invocation": "b"},
        ended(4, "b", outcome="preempted", stalled=True),  # time order, not file order
    ]
    assert stalled_in_a_row(events, "b") == 2
    assert stalled_in_a_row(events, "a") == 1
    assert stalled_in_a_row(events, "c") == 0
    assert stalled_in_a_row([*events, ended(6, "b", outcome="completed")], "b") == 0


def test_an_attempt_that_saved_past_the_step_it_resumed_from_is_not_stalled(tmp_path, monkeypatch):
    # Its newest step (10) was quarantined as it started, it resumed from 5 and saved a
    # new 10 before it was killed: counted as stalled ("not past step 10"), it failed the run.
    import json

    from tasks import training
    from tasks.plan import plan_run
    from tasks.watch import WorkloadPreempted
    from tests.helpers import tiny_config

    plan = plan_run(tiny_config(tmp_path))
    Path(plan.run_dir).mkdir(parents=True)
    first = {"time": 1.0, "event": "first_step", "attempt": 2, "step": 6, "resumed_from": 5}
    Path(plan.run_dir, "events.jsonl").write_text(json.dumps(first) + "\n")
    killed = WorkloadPreempted("killed (signal 9)")
    monkeypatch.setattr(training, "_newest_step", lambda plan: 10)
    assert training._stalled(killed, plan, 2, 10) == {}
    monkeypatch.setattr(training, "_newest_step", lambda plan: 5)
    assert training._stalled(killed, plan, 2, 10) == {"stalled": True, "stalled_at": 5}
    # Lost before its first step: measured against the newest step before it.
    assert training._stalled(killed, plan, 3, 5) == {"stalled": True, "stalled_at": 5}
    assert training._stalled(WorkloadPreempted("PREEMPTED", announced=True), plan, 3, 5) == {}


def test_an_attempt_that_saves_when_its_slice_is_deleted_is_not_stalled(
    tmp_path, monkeypatch, prefect_harness
):
    # A workload silent past the heartbeat timeout (a paused VM) but alive saves at the
    # SIGTERM of its slice's delete. Judged before that delete, each such attempt was
    # called stalled beside its own new checkpoint, and three in a row failed a run that
    # advanced every time ("... before committing a checkpoint past step 15", step 23 saved).
    from prefect import flow

    from tasks import training
    from tasks.goodput import read_events
    from tasks.plan import plan_run
    from tasks.watch import WorkloadPreempted
    from tests.helpers import tiny_config

    @flow
    def attempt():
        training.train_attempt(tiny_config(tmp_path), plan, "config.json")

    plan = plan_run(tiny_config(tmp_path))
    Path(plan.run_dir).mkdir(parents=True)
    newest = {"step": 10}

    class Provision:
        def with_options(self, **kwargs):
            return lambda *args: plan.slice_name

    def silent(*args, **kwargs):
        raise WorkloadPreempted(f"no heartbeat from slice {plan.slice_name} for 16s")

    def delete_and_save(provider, plan, logger, running=None):
        newest["step"] = 15  # the SIGTERM's save
        return True

    monkeypatch.setattr(training, "provision_slice", Provision())
    monkeypatch.setattr(training, "watch_slice", silent)
    monkeypatch.setattr(training, "_newest_step", lambda plan: newest["step"])
    monkeypatch.setattr(training, "delete_own_slice", delete_and_save)
    with pytest.raises(WorkloadPreempted, match="no heartbeat"):
        attempt()
    events = read_events(Path(plan.run_dir) / "events.jsonl")
    assert [e["event"] for e in events] == ["deleted", "attempt_ended"]
    assert "stalled" not in events[-1]
    # It ended when it fell silent: the deletion after that is teardown, not lost time.
    assert events[1]["time"] < events[0]["time"]

    # Silent, and still nothing past its step after the delete: stalled, deleted once.
    newest["step"] = 15
    monkeypatch.setattr(training, "delete_own_slice", lambda *args, **kwargs: True)
    with pytest.raises(WorkloadPreempted, match="no heartbeat"):
        attempt()
    events = read_events(Path(plan.run_dir) / "events.jsonl")
    assert [e["event"] for e in events[2:]] == ["deleted", "attempt_ended"]
    assert events[-1]["stalled"] is True and events[-1]["stalled_at"] == 15

    # The orchestrator stopped (Ctrl-C, SIGTERM) while the slice is deleted: the attempt
    # still ended, preempted; it read "running?", then "abandoned", its deletion lost time.
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(training, "delete_own_slice", interrupted)
    with pytest.raises(KeyboardInterrupt):
        attempt()
    events = read_events(Path(plan.run_dir) / "events.jsonl")
    assert [(e["event"], e["outcome"]) for e in events[4:]] == [("attempt_ended", "preempted")]


def test_an_attempt_ended_by_a_stop_reads_stopped_naming_the_signal():
    from prefect.exceptions import TerminationSignal

    from tasks.attempts import ended_by

    # Prefect's TerminationSignal has no message: the reason read "TerminationSignal: ".
    outcome, reason = ended_by(TerminationSignal(signal.SIGTERM))
    assert outcome == "stopped" and "received SIGTERM" in reason
    assert ended_by(KeyboardInterrupt()) == (
        "stopped",
        "KeyboardInterrupt: the orchestrator received SIGINT (Ctrl-C)",
    )
    assert ended_by(RuntimeError("disk full")) == ("failed", "RuntimeError: disk full")
