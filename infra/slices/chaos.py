"""Chaos for the local slice provider: reproducible preemptions and capacity failures.

A monkey is attached to each attempt it is allowed to hit. It watches the attempt's run
directory and sends the configured signal to the slice's process group when the trigger
fires: after N seconds, after the attempt trained N steps (counted from where it resumed),
or right after a checkpoint save starts (so the save is still being written). Counters
live in the slice registry, so "hit the first `times` attempts" and "fail the first
`fail_creates` creates" hold across provider instances and orchestrator restarts.

The run directory may be in GCS (a gs:// storage root with local slices): it is read
through `etils.epath` (`workloads.events.event_lines`), polled less often there, since each
read is a request. Read as a
local path, it was never found, so `at_step` and `during_save` never fired (while the
attempt still counted as hit).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from etils import epath

from infra.slices.base import ProvisioningError
from workloads.events import event_lines

_POLL_S = 0.02
_REMOTE_POLL_S = 0.1  # two object reads per poll


class ChaosCapacityError(ProvisioningError):
    """An injected 'no capacity' answer to a create."""


class ChaosMonkey:
    """The chaos settings of one run and its persisted counters."""

    def __init__(self, registry_dir: Path, run_key: str, settings: dict[str, Any]) -> None:
        self.settings = settings
        self.path = registry_dir / "chaos" / f"{run_key}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def _counters(self) -> dict[str, int]:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return {"creates_failed": 0, "attempts_hit": 0}

    def _bump(self, key: str) -> int:
        counters = self._counters()
        counters[key] += 1
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(counters))
        os.replace(tmp, self.path)
        return counters[key]

    def before_create(self, name: str) -> None:
        """Fail this create if the run's first `fail_creates` have not all failed yet."""
        wanted = self.settings.get("fail_creates", 0)
        if wanted and self._counters()["creates_failed"] < wanted:
            n = self._bump("creates_failed")
            raise ChaosCapacityError(
                f"slice {name!r}: no capacity (chaos: create {n} of {wanted} fails)"
            )

    def attach(self, pgid: int, run_dir: str | None) -> threading.Thread | None:
        """Start watching an attempt if the run still has attempts to hit."""
        times = self.settings.get("times", 0)
        if not times or run_dir is None or self._counters()["attempts_hit"] >= times:
            return None
        seen = len(event_lines(run_dir))
        poll = _REMOTE_POLL_S if "://" in run_dir else _POLL_S
        thread = threading.Thread(target=self._watch, args=(pgid, run_dir, seen, poll), daemon=True)
        thread.start()
        return thread

    def _watch(self, pgid: int, run_dir: str, seen: int, poll_s: float) -> None:
        sig = signal.SIGKILL if self.settings.get("signal") == "KILL" else signal.SIGTERM
        at_step, after_s = self.settings.get("at_step"), self.settings.get("after_s")
        during_save = self.settings.get("during_save", False)
        started, base = time.monotonic(), None
        status = epath.Path(run_dir) / "status.json"
        while _alive(pgid):
            new = event_lines(run_dir)[seen:]
            for event in new:
                if event.get("event") == "first_step" and base is None:
                    base = event.get("resumed_from", 0)
            fire = after_s is not None and time.monotonic() - started >= after_s
            if during_save and any(e.get("event") == "checkpoint" for e in new):
                fire = True
            if at_step is not None and base is not None:
                step = (_read_json(status) or {}).get("step") or 0
                fire = fire or step - base >= at_step
            if fire:
                # Counted when sent: an attempt that finished before its trigger (at_step
                # near the run's end, read late from GCS) is no hit, and the next is watched.
                self._bump("attempts_hit")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, sig)
                return
            time.sleep(poll_s)


def _read_json(path: epath.Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):  # not written yet, or a failed read in GCS: the
        return None  # next poll reads again


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
