"""Goodput of a run from its `events.jsonl`: productive step time ÷ wall time.

Wall time runs from an invocation's first provisioning request to its last event, summed
over the invocations of the run name (a rerun appends to the same ledger; the time between
invocations, when no slice and no orchestrator existed, is nobody's). Each attempt's time
is split into buckets (the vocabulary of ml-goodput-measurement's badput categories):

- provisioning: request → ready, and every failed create;
- startup: ready → the first step done (process start, compile), less the restore;
- restore: reading the checkpoint the attempt resumed from;
- productive: first step → the last checkpoint the run went on from (one that a later
  attempt, of this invocation or a rerun, restored; for the run's last attempt, also the
  step a notice stopped it at, which its workload saved before exiting), or the finish
  (unless a rerun quarantined the final checkpoint and resumed from before it);
- lost: that checkpoint → the attempt's end (work done again by a later attempt);
- teardown: the attempt's end → its slice deleted; after a finished run from its last step,
  and after a preemption notice from the step the workload saved on it (its save and exit),
  since nothing after that step is trained again;
- idle: whatever no bucket explains (waits between attempts, orchestration).

`leftover_deleted` (see `tasks.attempts`) is billed by the ledger, never timed here.

`attempt_timelines` places those buckets on the clock, attempt by attempt (the report's
timeline is drawn from it); `compute_goodput` adds them up.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

from etils import epath

from tasks.attempts import by_attempt, invocation_spans, timed, trained_after
from tasks.pricing import readable_pricing
from workloads.events import EVENTS
from workloads.rundir import MAX_TIME, RunDir

BUCKETS = ("provisioning", "startup", "restore", "productive", "lost", "teardown", "idle")


@dataclass
class Goodput:
    """Seconds per bucket over the whole run, and the ratio users care about."""

    wall_s: float
    seconds: dict[str, float] = field(default_factory=dict)
    attempts: int = 0
    preemptions: int = 0
    stalled: int = 0  # of the preemptions, attempts that were stalled (AttemptTimeline)
    invocations: int = 0  # flow runs of the run name that appended to its ledger

    @property
    def goodput(self) -> float | None:
        """Productive seconds ÷ wall seconds (None before any wall time exists)."""
        return self.seconds.get("productive", 0.0) / self.wall_s if self.wall_s > 0 else None


@dataclass(frozen=True)
class Segment:
    """One bucket's stretch of one attempt, in the events' clock (epoch seconds)."""

    bucket: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        """Its length (may be negative only if the ledger's clocks disagree)."""
        return self.end - self.start


@dataclass
class AttemptTimeline:
    """One attempt as the ledger saw it: its milestones, buckets and kept steps."""

    attempt: int
    # completed / preempted / failed; "abandoned": no attempt_ended event, yet a later
    # attempt exists (its orchestrator was killed, and a rerun took over); "finished": the
    # last attempt's workload finished training, but no attempt_ended event (its
    # orchestrator was killed, and it read "running?"); None: neither (still running, or
    # killed and not rerun)
    outcome: str | None
    requested: float | None  # first provisioning request
    ready: float | None  # slice ready (the last, if it was created more than once)
    ended: float  # attempt_ended, else finished, else its last event
    deleted: float | None  # its slice deleted by the attempt itself
    segments: list[Segment] = field(default_factory=list)
    first_step: int | None = None  # the step the attempt resumed after (0: from scratch)
    kept_step: int | None = None  # the run went on from this step of this attempt's work
    resumed_from: int | None = None  # the checkpoint it restored (0: none), if recorded
    # Preempted without a notice and no checkpoint past the one it resumed from (what
    # `resilience.max_stalled_attempts` counts): out of memory or stuck, more likely.
    stalled: bool = False
    reason: str | None = None  # its attempt_ended event's, why it ended

    @property
    def steps_kept(self) -> int:
        """Optimizer steps of this attempt that the run kept (the goodput's productive
        steps): from its resume point to the checkpoint a later attempt resumed from, or
        to the finish. Steps after that were lost and trained again."""
        if self.first_step is None or self.kept_step is None:
            return 0
        return max(self.kept_step - self.first_step, 0)


def read_events(path: str | os.PathLike) -> list[dict]:
    """Events in file order; a torn last line (a writer killed mid-line) is skipped, as
    is any line that is not JSON (bytes that are not UTF-8 included) or not an event as
    `EventLog` writes one: an object with a numeric `time`, a string `event` and an
    integer `attempt` if any. The ledger orders and groups events by those, and a line
    without them (hand-edited, another tool's) failed the run's landing with a KeyError.
    Events of a workload started by hand (`"attempt": null`) belong to no attempt and are
    left out too (`workloads.events.EventLog.from_env`)."""
    events = []
    try:
        lines = epath.Path(path).read_bytes().decode("utf-8", "replace").splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if (event := _as_event(event)) is not None:
            events.append(event)
    return events


def ledger_events(run_dir: str) -> list[dict]:
    """The events goodput and the ledger read for the run in `run_dir`: its events.jsonl
    (`read_events`), and the steps a workload whose orchestrator was killed trained after
    its attempt's last event (`tasks.attempts.trained_after`), from its metrics.jsonl."""
    events = read_events(f"{run_dir}/{EVENTS}")
    return events + trained_after(events, RunDir(run_dir).read_metrics)


def _number(value: object) -> bool:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return ok and math.isfinite(value) and value >= 0


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


# The fields the ledger reads beyond time, event and attempt, and what each must be: a
# value of another type (a hand edit, another tool's line) is dropped, as if the event had
# not recorded it; it failed landing and `tpupipe report` with a TypeError naming no file.
_FIELDS = {
    "step": _count,
    "resumed_from": _count,
    "seconds": _number,
    "invocation": lambda value: isinstance(value, str),
    "outcome": lambda value: isinstance(value, str),
}
MAX_ATTEMPT = 2**31  # attempts are numbered from 1, one more each: a larger one is no count


def _as_event(event: object) -> dict | None:
    """The event as the ledger reads it, or None if it is no event `EventLog` writes (a
    `time` past `MAX_TIME`, such as 1e300, was an idle time of 1e300 s in the report)."""
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        return None
    when, attempt = event.get("time"), event.get("attempt", 0)
    if not _number(when) or when >= MAX_TIME:
        return None
    if not isinstance(attempt, int) or isinstance(attempt, bool) or not 0 <= attempt < MAX_ATTEMPT:
        return None
    bad = {k for k, ok in _FIELDS.items() if event.get(k) is not None and not ok(event[k])}
    if not readable_pricing(event):
        bad |= {"price", "slice"}  # priced as an attempt that recorded no price
    return {k: v for k, v in event.items() if k not in bad} if bad else event


def attempt_timelines(events: list[dict]) -> list[AttemptTimeline]:
    """Each attempt's buckets as segments on the clock; see the module docstring.

    Within an attempt the segments follow each other: provisioning, start-up, restore
    (placed just before the first step), productive, lost, teardown.
    """
    # Numbered as the ledger numbers them; a leftover's deletion is no time of the attempt.
    groups = {n: evs for n, group in by_attempt(events).items() if (evs := timed(group))}
    attempts = list(groups)
    resumes = [_resume_point(groups[a]) for a in attempts]
    timelines = []
    for i, attempt in enumerate(attempts):
        evs = groups[attempt]
        t = {e["event"]: e["time"] for e in evs}  # the last time of each event kind
        requested = _first_time(evs, "provision_requested")
        ready = t.get("provision_ready")
        end = t.get("attempt_ended", t.get("finished", evs[-1]["time"]))
        outcomes = [e.get("outcome") for e in evs if e["event"] == "attempt_ended"]
        if not outcomes and i < len(attempts) - 1:
            outcomes = ["abandoned"]  # a later attempt exists: this one runs no more
        elif not outcomes and "finished" in t:
            outcomes = ["finished"]  # its workload finished; its orchestrator never said
        elif outcomes[-1:] in (["failed"], ["stopped"]) and "finished" in t:
            # Its workload finished training; its orchestrator failed or was stopped after (a
            # sweep stopped between the last step and the watch's next look): the attempt
            # did its work.
            outcomes = ["completed"]
        line = AttemptTimeline(
            attempt=attempt,
            outcome="preempted" if "preempted" in outcomes else (outcomes or [None])[-1],
            requested=requested,
            ready=ready,
            ended=end,
            deleted=t.get("deleted"),
            resumed_from=resumes[i],
            stalled=any(e.get("stalled") is True for e in evs if e["event"] == "attempt_ended"),
            reason=next(
                (e.get("reason") for e in reversed(evs) if e["event"] == "attempt_ended"), None
            ),
        )
        timelines.append(line)
        if requested is not None:
            until = end if ready is None else ready
            line.segments.append(Segment("provisioning", requested, until))
        if ready is None:
            continue
        first = _first_time(evs, "first_step")
        restore = _first(evs, "restored", "seconds") or 0.0
        startup_end = ready + max((end if first is None else first) - ready - restore, 0.0)
        line.segments.append(Segment("startup", ready, startup_end))
        if restore:
            line.segments.append(Segment("restore", startup_end, startup_end + restore))
        if first is not None:
            line.first_step = _start_step(evs, _first(evs, "first_step", "resumed_from"))
            # The run went on from the newest of this attempt's checkpoints that a later
            # attempt restored: not only the next one, which may have been preempted before
            # its first step (or restored the final step and had no step to take).
            saved = _saved_steps(evs)
            later = {step for step in resumes[i + 1 :] if step in saved}
            stopped = _last(evs, "preempted", "step")
            if i == len(attempts) - 1 and stopped in saved:
                # The run's last attempt, stopped by a notice (a SIGTERM to the run or a
                # sweep, a platform preemption on the last retry): its workload committed
                # that step before it exited, and a rerun resumes there, so its steps so far
                # are kept, not lost (they read lost, goodput 0, until a rerun restored it).
                later.add(stopped)
            line.kept_step = max(later, default=None)
            keep_until = None if line.kept_step is None else saved[line.kept_step]
            finished = _kept_finish(evs, resumes[i + 1 :])
            if finished is not None:
                keep_until, line.kept_step = t["finished"], finished
            kept_end = min(max(first if keep_until is None else keep_until, first), end)
            line.segments.append(Segment("productive", first, kept_end))
            # After the final step, or the step a preemption notice stopped the attempt at,
            # nothing is trained again: the save, the workload's exit and the orchestrator
            # noticing it hold the slice for nothing, like its deletion.
            ended_kept = stopped is not None and stopped == line.kept_step
            after = "teardown" if finished is not None or ended_kept else "lost"
            line.segments.append(Segment(after, kept_end, end))
        if "deleted" in t:
            line.segments.append(Segment("teardown", end, end + max(t["deleted"] - end, 0.0)))
    return timelines


def compute_goodput(events: list[dict]) -> Goodput:
    """Split a run's wall time into buckets; see the module docstring for their meaning."""
    if not events:
        return Goodput(0.0, dict.fromkeys(BUCKETS, 0.0))
    spans = invocation_spans(events)
    wall = sum(last - first for first, last in spans)
    seconds = dict.fromkeys(BUCKETS, 0.0)
    timelines = attempt_timelines(events)
    for line in timelines:
        for segment in line.segments:
            seconds[segment.bucket] += segment.seconds
    seconds["idle"] = max(wall - sum(v for k, v in seconds.items() if k != "idle"), 0.0)
    preemptions = sum(line.outcome == "preempted" for line in timelines)
    return Goodput(
        wall,
        seconds,
        attempts=len(timelines),
        preemptions=preemptions,
        stalled=sum(line.stalled for line in timelines),
        invocations=len(spans),
    )


def _first(events: list[dict], kind: str, key: str):
    return next((e.get(key) for e in events if e["event"] == kind), None)


def _last(events: list[dict], kind: str, key: str):
    return next((e.get(key) for e in reversed(events) if e["event"] == kind), None)


def _first_time(events: list[dict], kind: str) -> float | None:
    return next((e["time"] for e in events if e["event"] == kind), None)


def _start_step(events: list[dict], resumed_from: int | None) -> int | None:
    """The step an attempt started after: its resume point (an older workload that did
    not record one: the step before its first)."""
    if resumed_from is not None:
        return resumed_from
    step = _first(events, "first_step", "step")
    return None if step is None else step - 1


def _kept_finish(events: list[dict], later_resumes: list[int | None]) -> int | None:
    """The final step this attempt finished at, if the run kept it: not when a later
    attempt resumed from before it (the final checkpoint failed verification and was
    quarantined, so its last steps were trained again; such a rerun used to count them
    twice, in `steps`, tokens and cost per token, and none of them as lost)."""
    step = _last(events, "finished", "step")
    if step is None or any(r is not None and r < step for r in later_resumes):
        return None
    return step


def _resume_point(events: list[dict]) -> int | None:
    """The checkpoint step an attempt restored (0: it started from scratch), from its
    `restored` event or its first step's `resumed_from`; None if it never got that far."""
    step = _first(events, "restored", "step")
    return _first(events, "first_step", "resumed_from") if step is None else step


def _saved_steps(events: list[dict]) -> dict[int, float]:
    """Checkpoint steps this attempt saved, with when it first recorded each."""
    saved: dict[int, float] = {}
    for e in events:
        if e["event"] in ("checkpoint", "preempted") and e.get("step") is not None:
            saved.setdefault(e["step"], e["time"])
    return saved
