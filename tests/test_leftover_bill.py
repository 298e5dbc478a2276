"""A slice an attempt left standing is billed until a later orchestrator deletes it.

The synthetic run: invocation A (flow-a) trains attempt 1 from t=0 and its orchestrator is
killed (SIGKILL) at t≈14, with the slice READY; invocation B (flow-b) deletes that slice at
t=999.5, before its own attempt 2 asks for a slice at t=1000, and finishes. Expected figures
are worked out by hand from `tests.helpers.attempt_events`'s times.
"""

from __future__ import annotations

import pytest

from tasks.attempts import invocation_spans, next_attempt, split_invocations
from tasks.goodput import attempt_timelines, compute_goodput
from tasks.ledger import billing_window, compute_ledger
from tasks.pricing import Price
from tests.helpers import attempt_events

LEFT = {
    "time": 999.5,
    "event": "leftover_deleted",
    "attempt": 1,
    "source": "orchestrator",
    "invocation": "flow-b",
    "name": "tpupipe-r1",
    "state": "READY",
}
PRICE = Price(8, "on-demand", "v5litepod-8", "us-central1", 2.0, "test")


def killed(ended: bool) -> list[dict]:
    """Attempt 1 of flow-a: requested 0, ready 2, steps 1..10 at 5..14 (checkpoint 10 at
    14), then its orchestrator killed: no `deleted`, and `attempt_ended` (15) only if
    `ended` (the kill came after it recorded the attempt's end)."""
    drop = {"deleted", "preempted"} | (set() if ended else {"attempt_ended"})
    return [e for e in attempt_events(1, 0, 0, 10, "preempted", "flow-a") if e["event"] not in drop]


def rerun() -> list[dict]:
    """Attempt 2 of flow-b: requested 1000, resumes step 10, finishes step 20 at 1014,
    ends 1015, deletes its slice 1016."""
    return attempt_events(2, 1000, 10, 20, "completed", "flow-b")


@pytest.mark.parametrize("ended", [False, True], ids=["abandoned", "ended-not-deleted"])
def test_a_left_slice_is_billed_until_the_rerun_deleted_it(ended):
    without = [*killed(ended), *rerun()]
    events = [*killed(ended), LEFT, *rerun()]
    ledger = compute_ledger(events, PRICE, tokens_per_step=512)

    first, second = ledger.attempts
    # On demand: from attempt 1's request (0) to the rerun's deletion of its node (999.5),
    # not to its last event (14, or its end at 15); attempt 2: 1000 -> 1016.
    assert (first.billed_from, first.billed_to) == (0, 999.5)
    assert (second.billed_from, second.billed_to) == (1000, 1016)
    assert ledger.chip_hours == pytest.approx(8 * (999.5 + 16) / 3600)
    assert ledger.cost_usd == pytest.approx(8 * (999.5 + 16) / 3600 * 2.0)
    # Spot bills from READY (2), to the same deletion.
    assert billing_window(split_invocations(events)[0][1], "spot") == (2, 999.5)

    # Goodput is as if the event were not there: the time between A and B is nobody's.
    assert compute_goodput(events) == compute_goodput(without)
    good = compute_goodput(events)
    last_a = 15 if ended else 14
    assert good.wall_s == pytest.approx(last_a + 16) and good.invocations == 2
    assert invocation_spans(events) == [(0, last_a), (1000, 1016)]
    assert attempt_timelines(events) == attempt_timelines(without)
    line = attempt_timelines(events)[0]
    assert (line.ended, line.deleted) == (last_a, None)
    assert line.outcome == ("preempted" if ended else "abandoned")


def test_the_leftover_event_stays_with_the_attempt_and_invocation_that_left_the_slice():
    # Written by flow-b before its first request: it must not start flow-b's invocation
    # early (nor a third one), nor change the next attempt's number.
    events = [*killed(False), LEFT, *rerun()]
    a, b = split_invocations(events)
    assert list(a) == [1] and list(b) == [2]
    assert a[1][-1] is LEFT
    assert next_attempt(events) == 3
    assert next_attempt([*killed(False), LEFT]) == 2


def test_an_attempt_s_own_delete_and_a_later_leftover_bill_to_the_later():
    # Its own delete (16) missed a copy that a later orchestrator deleted at 999.5.
    events = [*attempt_events(1, 0, 0, 10, "preempted", "flow-a"), LEFT]
    assert billing_window(events, "on-demand") == (0, 999.5)
    # Without a leftover, the attempt's own delete ends the window, as before.
    assert billing_window(events[:-1], "on-demand") == (0, 16)


def test_a_left_slice_found_preempted_is_billed_to_its_attempt_s_end():
    # Google had preempted the node: it was not billed until the rerun deleted it, days
    # later maybe. A TERMINATED local slice (its workload ended) stands for a node still
    # READY, billed to its deletion as before.
    state = "PREEMPTED"
    ended = [*killed(True), {**LEFT, "state": "TERMINATED"}, *rerun()]
    assert compute_ledger(ended, PRICE, tokens_per_step=512).attempts[0].billed_to == 999.5
    events = [*killed(True), {**LEFT, "state": state}, *rerun()]
    first, second = compute_ledger(events, PRICE, tokens_per_step=512).attempts
    assert (first.billed_from, first.billed_to) == (0, 15)  # its attempt_ended
    assert (second.billed_from, second.billed_to) == (1000, 1016)
    abandoned = [*killed(False), {**LEFT, "state": state}, *rerun()]
    assert compute_ledger(abandoned, PRICE, tokens_per_step=512).attempts[0].billed_to == 14
    # One recorded before the state was (no `state`) still bills to the deletion.
    old = {k: v for k, v in LEFT.items() if k != "state"}
    events = [*killed(True), old, *rerun()]
    assert compute_ledger(events, PRICE, tokens_per_step=512).attempts[0].billed_to == 999.5


@pytest.mark.parametrize("capacity", ["on-demand", "spot"])
def test_a_node_that_came_up_after_its_orchestrator_died_is_billed_until_deleted(capacity):
    # The orchestrator was killed while the create ran (or the spot request waited): no
    # provision_ready, and the ledger billed nothing for a node the reaper deleted READY an
    # hour later, after its workload had trained on it.
    def workload(t, event):
        return {"time": t, "event": event, "attempt": 1, "source": "workload"}

    events = [
        {"time": 0, "event": "provision_requested", "attempt": 1, "source": "orchestrator"},
        workload(300, "started"),
        workload(1500, "checkpoint_saved"),
        {**LEFT, "time": 3600.0, "invocation": "reaper"},
    ]
    price = Price(8, capacity, "v5litepod-8", "us-central1", 2.0, "test")
    (attempt,) = compute_ledger(events, price, tokens_per_step=512).attempts
    start = 0 if capacity == "on-demand" else 300  # spot: READY by its workload's start
    assert (attempt.billed_from, attempt.billed_to) == (start, 3600.0)
    # Deleted when no longer billed (preempted): billed nothing, as before.
    gone = [*events[:3], {**LEFT, "time": 3600.0, "state": "PREEMPTED"}]
    assert compute_ledger(gone, price, tokens_per_step=512).attempts[0].billed_from is None
