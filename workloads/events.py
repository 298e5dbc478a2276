"""The run's event ledger (`events.jsonl`) and the lease that fences off zombie attempts.

Both the orchestrator and the workload append events: provisioning, start, restore, first
step, checkpoints, preemption, finish, deletion. Goodput is computed from this ledger.
Every event carries its attempt's number (the workload's come from `TPUPIPE_ATTEMPT`, set
by the orchestrator, so both sides agree); the orchestrator's also carry its invocation.

Every attempt gets a lease token. The orchestrator writes the current one to `lease.json`
before it starts the attempt; the workload checks it before each write to the run
directory, so an attempt the orchestrator has given up on (a zombie on a slice that was
not deleted yet) stops instead of writing over the live attempt's status or checkpoints.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

from etils import epath

from workloads.rundir import RunDir, append_lines, read_json, write_json_atomic

EVENTS = "events.jsonl"
LEASE = "lease.json"
SUPERSEDED_EXIT = 76  # this attempt's lease was taken over: stop, write nothing more


class LeaseLost(RuntimeError):
    """The run directory belongs to a newer attempt now."""


def new_lease() -> str:
    """A fresh, unguessable lease token for one attempt."""
    return secrets.token_hex(8)


def grant_lease(run_dir: str, attempt: int, lease: str) -> None:
    """Make (attempt, lease) the only attempt allowed to write to the run directory."""
    write_json_atomic(epath.Path(run_dir) / LEASE, {"attempt": attempt, "lease": lease})


class EventLog:
    """Appends events of one attempt, stamped with time, attempt and source (and the
    invocation, when one is given: the orchestrator's flow run, which tells the attempts
    of one run of a run name from those of a rerun)."""

    def __init__(
        self,
        run_dir: str,
        attempt: int | None = 0,
        lease: str | None = None,
        source: str = "workload",
        clock: Callable[[], float] = time.time,
        invocation: str | None = None,
    ) -> None:
        self.run_dir = epath.Path(run_dir)
        self.attempt = attempt
        self.lease = lease
        self.source = source
        self.invocation = invocation
        self.clock = clock  # what times its events

    @classmethod
    def from_env(cls, run_dir: str, env: Mapping[str, str] = os.environ) -> EventLog:
        """The workload's log: attempt and lease come from the slice's environment.

        A workload started by hand (no `TPUPIPE_ATTEMPT`) is no attempt of the pipeline:
        its events say `"attempt": null`, which the ledger and `tpupipe report` leave out.
        Numbered 0, they were read as an attempt that never ended (`abandoned`), and the
        next landing counted its time in the run's wall time and goodput.
        """
        attempt = env.get("TPUPIPE_ATTEMPT")
        return cls(run_dir, int(attempt) if attempt else None, env.get("TPUPIPE_LEASE"))

    def emit(self, event: str, at: float | None = None, **fields: Any) -> None:
        """Append one event as a single line (one write, so lines never interleave), timed
        now or `at` (a moment this log's clock gave earlier)."""
        payload = {
            "time": self.clock() if at is None else at,
            "event": event,
            "attempt": self.attempt,
            "source": self.source,
            **({"invocation": self.invocation} if self.invocation else {}),
            **fields,
        }
        line = json.dumps(payload, sort_keys=True) + "\n"
        path = self.run_dir / EVENTS
        if str(path).startswith("gs://"):
            # GCS objects cannot be appended to: rewrite (events are few, writers serial).
            old = path.read_text() if path.exists() else ""
            path.write_text(old + line)
            return
        append_lines(path, line)

    def check_lease(self) -> None:
        """Raise LeaseLost if another attempt holds the run directory's lease.

        No lease file, or no lease of our own (the workload started by hand), means no
        fencing: the single-attempt case stays as simple as running a script.
        """
        if self.lease is None:
            return
        current = read_json(self.run_dir / LEASE)
        if current is not None and current.get("lease") != self.lease:
            raise LeaseLost(
                f"attempt {self.attempt} lost its lease on {self.run_dir} to attempt "
                f"{current.get('attempt')}; stopping without writing"
            )


def event_lines(run_dir: str) -> list[dict]:
    """Every JSON object line of the run's `events.jsonl`, as written; [] without one.
    Unlike the ledger's reader (`tasks.goodput.read_events`), no field is checked: the
    callers look for one field each."""
    try:
        text = (epath.Path(run_dir) / EVENTS).read_bytes().decode("utf-8", "replace")
    except OSError:
        return []
    found = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            found.append(event)
    return found


def trained_by_hand(run_dir: str) -> bool:
    """Whether a workload started by hand (`EventLog.from_env`) reached a step here."""
    return any(
        e.get("attempt", 0) is None
        and e.get("source") == "workload"
        and e.get("event") in ("first_step", "checkpoint", "finished")
        for e in event_lines(run_dir)
    )


def beside_live_workload(
    run_dir: str,
    timeout_s: float,
    env: Mapping[str, str] = os.environ,
    clock: Callable[[], float] = time.time,
) -> str | None:
    """Why a workload started by hand must not start now: another workload's heartbeat in
    `run_dir` is live (`RunDir.live_workload`), or None.

    A workload started by hand holds no lease, so nothing fenced it off: beside a running
    attempt of the pipeline it overwrote that attempt's heartbeat as it started, then both
    wrote the same checkpoint steps and metrics. An attempt of the pipeline (a lease in
    `env`) is not checked: the lease fences a newer attempt from an older one already.
    """
    if env.get("TPUPIPE_LEASE"):
        return None
    live = RunDir(run_dir, clock=clock).live_workload(timeout_s)
    if live is None:
        return None
    who = "a workload started by hand"
    if live.get("attempt") is not None:
        who = f"attempt {live['attempt']} of the pipeline"
    return (
        f"{run_dir} is being trained by {who} ({RunDir.describe_beat(live)}); the "
        "workload alone beside it would write into the same checkpoints, metrics and "
        "heartbeat. Wait for it to end: a workload that died stops counting as running at "
        f"once on this machine, and {timeout_s:g} s after its last heartbeat if it ran on "
        "another (slice.heartbeat_timeout_s)"
    )
