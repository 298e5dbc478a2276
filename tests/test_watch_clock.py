"""The watch times a silence on its own clock, never on the wall clock a heartbeat carries.

A wall clock stepped while a run trains (a VM resumed, NTP correcting a boot clock that was
far off) made a healthy workload, compiling between two heartbeats, look an hour silent: its
slice was deleted and provisioned again, and the attempt counted as stalled. Stepped back,
a workload that went silent would have been noticed only an hour late.
"""

from __future__ import annotations

import pytest

from infra.slices import SliceState, SliceStatus
from tasks.watch import WatchSettings, WorkloadPreempted, watch_slice
from tests.helpers import FakeClock

STEP_S = 3600.0  # the wall clock's step, at 1100 s on the watch's own clock
SETTINGS = WatchSettings(poll_s=10, heartbeat_timeout_s=60, confirm_s=1)


class Machine:
    """One machine's clocks, slice and status file: the wall clock is stepped by `step_s`
    at 1100; the workload beats every poll but is silent in [silent_from, silent_to)."""

    def __init__(self, step_s: float, silent_from: float, silent_to: float, ends_at: float):
        self.clock, self.step_s = FakeClock(), step_s
        self.silent_from, self.silent_to, self.ends_at = silent_from, silent_to, ends_at
        self.last: dict | None = None

    def wall(self) -> float:
        return 1.7e9 + self.clock.now + (self.step_s if self.clock.now >= 1100 else 0.0)

    def status(self, name: str) -> SliceStatus:
        if self.clock.now >= self.ends_at:
            return SliceStatus(name, SliceState.TERMINATED, 0)
        return SliceStatus(name, SliceState.READY, None)

    def read_status(self) -> dict | None:
        if not self.silent_from <= self.clock.now < self.silent_to:
            step = int(self.clock.now - 1000)
            self.last = {"phase": "training", "attempt": 2, "time": self.wall(), "step": step}
        return self.last

    def host_failures(self) -> dict:
        return {}

    def watch(self):
        return watch_slice(
            self, "s", self, SETTINGS, lambda m: None, None, self.clock, self.clock.sleep, 2,
            wall=self.wall,
        )  # fmt: skip


def test_a_wall_clock_stepped_forward_while_the_workload_compiles_is_not_a_silence():
    # Silent from 1090 to 1140 (a compile), the clock stepped an hour at 1100: 50 s silent.
    machine = Machine(STEP_S, silent_from=1090, silent_to=1140, ends_at=1200)
    outcome = machine.watch()
    assert outcome.exit_code == 0
    assert outcome.seconds == 200  # the watch's own time, not 3800


def test_a_workload_silent_after_the_clock_stepped_back_is_noticed_in_time():
    # Its last heartbeat, written before a step back, carries a time an hour ahead.
    machine = Machine(-STEP_S, silent_from=1091, silent_to=float("inf"), ends_at=float("inf"))
    with pytest.raises(WorkloadPreempted, match="no heartbeat from slice s for"):
        machine.watch()
    # The timeout (60 s) and the second look after it (one poll): not an hour later.
    assert machine.clock.now <= 1090 + SETTINGS.heartbeat_timeout_s + 3 * SETTINGS.poll_s
