"""Which invocation and which attempt each event of a run's `events.jsonl` belongs to.

A run name can be run many times (a rerun resumes it: after a failure, after a success,
a sweep run again), and every invocation appends to the same ledger. So attempt numbers
go on from the highest one the ledger already holds (`next_attempt`) instead of Prefect's
retry count, which starts again at 1 in every flow run; and the orchestrator stamps its
events with its invocation (the flow run id), so goodput can tell invocations apart and
leave the time between them out of the wall time.

Ledgers written before that restarted at attempt 1 in every invocation and carry no
invocation. They are split where an attempt number that already ended asks for a slice
again (an attempt never provisions after its `attempt_ended`), and the later
invocation's attempts are renumbered after the earlier ones, as they would be today.

One kind of event is written after its attempt's time: `leftover_deleted`, which a later
orchestrator (a rerun, or the same invocation's next attempt or teardown) appends when it
deletes a copy of the run's slice that the attempt left standing (its orchestrator was
killed, or its delete failed). It is stamped with that attempt's number, so it lands in the
attempt's group and the ledger bills the node until then; but the attempt's timeline, its
invocation's span and so the wall time and goodput leave it out (`timed`): the time between
a run and its rerun is nobody's time, though the node it left was billed.

Except while the left workload trained on: an orchestrator killed outright leaves its
workload running, and the steps it trains after its last event (the workload records
checkpoints, not steps) are trained again by the attempt that resumes from an earlier
checkpoint. `trained_after` places the last of those steps on the abandoned attempt's
clock, from `metrics.jsonl` (a row every `train.log_every` steps) and from the heartbeat
the deleting orchestrator found (`beat_time` on its `leftover_deleted`: at most a minute
apart while training): that work is lost time, and its invocation's.
"""

from __future__ import annotations

import signal
from collections import defaultdict
from collections.abc import Callable

Groups = dict[int, list[dict]]  # attempt number -> its events, in time order

LEFTOVER_DELETED = "leftover_deleted"
TRAINED = "trained"  # not written: what `trained_after` derives from metrics.jsonl
# Events that say what happened to an attempt's slice after the attempt: billed, not timed.
AFTERMATH = frozenset({LEFTOVER_DELETED})


def timed(events: list[dict]) -> list[dict]:
    """The events that place an attempt or an invocation on the clock: all but those of
    `AFTERMATH`, written later by another orchestrator (see the module docstring)."""
    return [e for e in events if e["event"] not in AFTERMATH]


def split_invocations(events: list[dict]) -> list[Groups]:
    """The run's invocations in time order, each its events grouped by attempt number.

    Args:
        events: every event of the run (any order).

    Returns:
        One dict per invocation, attempt number -> events; attempt numbers are unique
        across the whole list (an old ledger's repeated numbers are renumbered).
    """
    invocations: list[Groups] = []
    current: Groups = {}
    marker: str | None = None  # the current invocation's id, once one was seen
    ended: set[int] = set()  # raw attempt numbers that ended in the current invocation
    offset = highest = 0
    for event in sorted(events, key=lambda e: e["time"]):
        raw = event.get("attempt", 0)
        invocation = event.get("invocation")
        starts = not invocations
        # Only a request starts one: a rerun's `leftover_deleted`, written before its first
        # request, stays in the invocation of the attempt whose slice it deleted.
        if event["event"] == "provision_requested":
            # A new flow run's first request; or, in an old ledger, a number reused.
            starts = starts or (invocation is not None and invocation != marker)
            starts = starts or raw in ended
        if starts:
            current, ended = defaultdict(list), set()
            invocations.append(current)
            marker = invocation
            # Numbers of today's ledgers already go on from the last one: offset 0.
            offset = 0 if raw > highest else highest - raw + 1
        number = raw + offset
        current[number].append(event)
        highest = max(highest, number)
        if event["event"] == "attempt_ended":
            ended.add(raw)
    return [dict(sorted(groups.items())) for groups in invocations]


def by_attempt(events: list[dict]) -> Groups:
    """Events grouped by attempt number, each group in time order, attempts ascending."""
    groups: Groups = defaultdict(list)
    for invocation in split_invocations(events):
        for number, evs in invocation.items():
            groups[number].extend(evs)
    return {n: sorted(groups[n], key=lambda e: e["time"]) for n in sorted(groups)}


def next_attempt(events: list[dict]) -> int:
    """The number of a new attempt: one past the highest the ledger holds (1 if none), so
    an attempt of a rerun never shares its number with one of an earlier invocation."""
    return max(by_attempt(events), default=0) + 1


def invocation_spans(events: list[dict]) -> list[tuple[float, float]]:
    """(first, last) event time of each invocation, in time order. A `leftover_deleted`
    event is left out: grouped with the attempt whose slice it deleted, in that attempt's
    invocation, it would stretch the span to the rerun that wrote it."""
    spans = []
    for invocation in split_invocations(events):
        times = [e["time"] for evs in invocation.values() for e in timed(evs)]
        if times:  # none: only a leftover's deletion, of an attempt whose events are gone
            spans.append((min(times), max(times)))
    return spans


def stalled_in_a_row(events: list[dict], invocation: str | None) -> int:
    """How many of `invocation`'s attempts, counting back from its last that ended, were
    lost without a preemption notice before committing a checkpoint past the one they
    resumed from (`"stalled": true` on their `attempt_ended`)."""
    ended = [
        e
        for e in sorted(events, key=lambda e: e["time"])
        if e["event"] == "attempt_ended" and e.get("invocation") == invocation
    ]
    count = 0
    for event in reversed(ended):
        if event.get("stalled") is not True:
            break
        count += 1
    return count


def trained_after(events: list[dict], rows: Callable[[], list[dict]]) -> list[dict]:
    """For each abandoned attempt (no `attempt_ended` and no `finished`, a later attempt
    exists) whose workload logged steps after the attempt's last event, a `trained` event
    at the last of them (see the module docstring), in that attempt's invocation.

    Args:
        events: every event of the run.
        rows: reads the run's metrics rows (each with `step` and `time`); called only when
            an abandoned attempt exists.

    Returns:
        The events to add to `events` for goodput and the ledger (none are written).
    """
    groups = by_attempt(events)
    numbers = list(groups)
    windows = []  # (its last event, when it stopped at the latest, its recorded beats)
    for i, number in enumerate(numbers[:-1]):
        own = timed(groups[number])
        if not own or any(e["event"] in ("attempt_ended", "finished") for e in own):
            continue
        # Its workload trained until the next orchestrator deleted its slice, or at the
        # latest until the next attempt began.
        later = [e["time"] for n in numbers[i + 1 :] for e in timed(groups[n])]
        left = [e for e in groups[number] if e["event"] == LEFTOVER_DELETED]
        stop = min(later + [e["time"] for e in left], default=float("inf"))
        windows.append((own[-1], stop, [b for e in left if (b := _beat(e)) is not None]))
    if not windows:
        return []
    logged = rows()
    added = []
    for last, stop, beats in windows:
        after = [r for r in [*logged, *beats] if last["time"] < r["time"] < stop]
        if after:
            row = max(after, key=lambda r: r["time"])
            # The raw attempt number and invocation of the attempt's own events, so that the
            # ledger groups it as it groups them (old ledgers renumber attempts).
            event = {"event": TRAINED, "attempt": last.get("attempt", 0), "time": row["time"]}
            if "invocation" in last:
                event["invocation"] = last["invocation"]
            if row.get("step") is not None:
                event["step"] = row["step"]
            added.append({**event, "source": row.get("source", "metrics")})
    return added


def _beat(event: dict) -> dict | None:
    """The heartbeat a `leftover_deleted` event recorded, as a metrics row's time and step:
    its `trained_until` when the workload was training then (`tasks.own_slice`)."""
    when, step = event.get("trained_until", event.get("beat_time")), event.get("beat_step")
    if not isinstance(when, int | float) or isinstance(when, bool):
        return None
    return {"time": when, "step": step if isinstance(step, int) else None, "source": "heartbeat"}


def describe_error(exc: BaseException) -> str:
    """What a failed run's `runs.error` says: the exception's type and message, or for a
    termination signal (Prefect's `TerminationSignal`, which has no message, or a bare
    KeyboardInterrupt) its name."""
    signum = getattr(exc, "signal", None)
    if isinstance(signum, int):
        name = signal.Signals(signum).name
        # Prefect's worker cancels a flow run (the UI's Cancel) by SIGTERM to its process.
        how = " (a stop, or a cancel from the Prefect UI or API)" if name == "SIGTERM" else ""
        return f"{type(exc).__name__}: the orchestrator received {name}{how}"
    if isinstance(exc, KeyboardInterrupt) and not str(exc):
        # Python raises it bare for a SIGINT: "KeyboardInterrupt" alone told no one how.
        return "KeyboardInterrupt: the orchestrator received SIGINT (Ctrl-C)"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def ended_by(exc: BaseException, stopped: bool = False) -> tuple[str, str]:
    """The outcome and reason of the `attempt_ended` an attempt gets when `exc` ends it
    (not a preemption): "stopped" for a stop of its orchestrator (a signal, Ctrl-C, a
    cancel from the Prefect UI) or one the caller says `exc` is (a sweep's), whose
    workload saves its step and exits as preempted; "failed" otherwise. A stop read
    "failed", with the reason "TerminationSignal: "."""
    stop = isinstance(exc, KeyboardInterrupt) or isinstance(getattr(exc, "signal", None), int)
    return ("stopped" if stop or stopped else "failed"), describe_error(exc)
