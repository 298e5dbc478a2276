"""Goodput of a run from its `events.jsonl`: productive step time ÷ wall time.

Wall time runs from the first provisioning request to the last event. Each attempt's time
is split into buckets (the vocabulary of ml-goodput-measurement's badput categories):

- provisioning: request → ready, and every failed create;
- startup: ready → the first step done (process start, compile), less the restore;
- restore: reading the checkpoint the attempt resumed from;
- productive: first step → the last checkpoint the run went on from (or the finish);
- lost: that checkpoint → the attempt's end (work done again by the next attempt);
- teardown: the attempt's end → its slice deleted;
- idle: whatever no bucket explains (waits between attempts, orchestration).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass, field

from etils import epath

BUCKETS = ("provisioning", "startup", "restore", "productive", "lost", "teardown", "idle")


@dataclass
class Goodput:
    """Seconds per bucket over the whole run, and the ratio users care about."""

    wall_s: float
    seconds: dict[str, float] = field(default_factory=dict)
    attempts: int = 0
    preemptions: int = 0

    @property
    def goodput(self) -> float | None:
        """Productive seconds ÷ wall seconds (None before any wall time exists)."""
        return self.seconds.get("productive", 0.0) / self.wall_s if self.wall_s > 0 else None


def read_events(path: str | os.PathLike) -> list[dict]:
    """Events in file order; a torn last line (a writer killed mid-line) is skipped."""
    events = []
    try:
        lines = epath.Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def compute_goodput(events: list[dict]) -> Goodput:
    """Split a run's wall time into buckets; see the module docstring for their meaning."""
    if not events:
        return Goodput(0.0, dict.fromkeys(BUCKETS, 0.0))
    events = sorted(events, key=lambda e: e["time"])
    by_attempt: dict[int, list[dict]] = defaultdict(list)
    for event in events:
        by_attempt[event.get("attempt", 0)].append(event)
    wall = events[-1]["time"] - events[0]["time"]
    seconds = dict.fromkeys(BUCKETS, 0.0)
    attempts = sorted(by_attempt)
    resumed_from = {a: _first(by_attempt[a], "first_step", "resumed_from") for a in attempts}
    preemptions = 0
    for i, attempt in enumerate(attempts):
        evs = by_attempt[attempt]
        t = {e["event"]: e["time"] for e in evs}  # the last time of each event kind
        requested = _first_time(evs, "provision_requested")
        ready = t.get("provision_ready")
        end = t.get("attempt_ended", t.get("finished", evs[-1]["time"]))
        if any(e["event"] == "attempt_ended" and e.get("outcome") == "preempted" for e in evs):
            preemptions += 1
        if requested is not None:
            seconds["provisioning"] += (ready or end) - requested
        if ready is None:
            continue
        first = _first_time(evs, "first_step")
        restore = _first(evs, "restored", "seconds") or 0.0
        seconds["restore"] += restore
        seconds["startup"] += max((first or end) - ready - restore, 0.0)
        if first is not None:
            # The run went on from the next attempt's resume point; steps after it were lost.
            keep_until = _checkpoint_time(evs, resumed_from.get(_next(attempts, i)))
            if "finished" in t:
                keep_until = t["finished"]
            kept_end = min(max(keep_until or first, first), end)
            seconds["productive"] += kept_end - first
            seconds["lost"] += end - kept_end
        if "deleted" in t:
            seconds["teardown"] += max(t["deleted"] - end, 0.0)
    seconds["idle"] = max(wall - sum(v for k, v in seconds.items() if k != "idle"), 0.0)
    return Goodput(wall, seconds, attempts=len(attempts), preemptions=preemptions)


def _first(events: list[dict], kind: str, key: str):
    return next((e.get(key) for e in events if e["event"] == kind), None)


def _first_time(events: list[dict], kind: str) -> float | None:
    return next((e["time"] for e in events if e["event"] == kind), None)


def _next(attempts: list[int], i: int) -> int | None:
    return attempts[i + 1] if i + 1 < len(attempts) else None


def _checkpoint_time(events: list[dict], step: int | None) -> float | None:
    """When this attempt saved checkpoint `step` (the one the next attempt resumed from)."""
    if step is None:
        return None
    return next(
        (
            e["time"]
            for e in events
            if e["event"] in ("checkpoint", "preempted") and e.get("step") == step
        ),
        None,
    )
