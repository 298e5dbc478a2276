"""Watching a slice whose status cannot be read: a flaky read is read again, but an error
the provider types as permanent (a SliceError: a permission, a refused read) ends the
watch instead of looping on it forever, past the workload's end and the heartbeat check,
and so does any error that lasts longer than the heartbeat timeout."""

from __future__ import annotations

import pytest

from infra.slices import SliceError, SliceState, SliceStatus
from infra.slices.gcp_api import TpuPermissionError
from tasks.watch import WatchSettings, watch_slice
from tests.helpers import FakeClock


class RunDirStub:
    def read_status(self) -> dict:
        return {}

    def host_failures(self) -> dict:
        return {}  # no host but 0 recorded a failure


class Provider:
    """Raises `errors` in turn (the last one for good with `forever`), then has exited."""

    def __init__(self, errors: list[Exception], forever: bool = False) -> None:
        self.errors, self.forever = list(errors), forever

    def status(self, name: str) -> SliceStatus:
        if self.errors:
            raise self.errors[0] if self.forever else self.errors.pop(0)
        return SliceStatus(name, SliceState.TERMINATED, 0)


def watch(provider: Provider) -> object:
    clock = FakeClock(0.0, limit=1e5)
    settings = WatchSettings(poll_s=10, heartbeat_timeout_s=600, confirm_s=60)
    return watch_slice(
        provider, "s", RunDirStub(), settings, lambda m: None, None, clock, clock.sleep
    )


def test_a_flaky_status_read_is_read_again():
    assert watch(Provider([ConnectionError("reset"), RuntimeError("503")])).exit_code == 0


@pytest.mark.parametrize(
    "error",
    [TpuPermissionError("the Cloud TPU API refused to read TPUs"), SliceError("403 on gs://b")],
)
def test_a_permanent_status_error_ends_the_watch(error):
    with pytest.raises(SliceError, match=str(error)):
        watch(Provider([error], forever=True))


def test_an_untyped_status_error_that_lasts_ends_the_watch_naming_it():
    """An error the provider did not type (a raw 400 from a client library, a provider's
    bug) was read again forever, the slice running all the while."""
    with pytest.raises(SliceError, match=r"kept failing for 6\d\ds .*ValueError: 400 bad"):
        watch(Provider([ValueError("400 bad field")], forever=True))


def test_a_read_that_recovers_starts_the_count_again():
    """Failures with a good read between them never add up to the limit."""
    clock = FakeClock(0.0, limit=1e5)

    class Beating:  # the workload's heartbeat stays fresh throughout
        def read_status(self) -> dict:
            return {"time": clock.now, "step": 1}

    class Recovers:
        reads = 0

        def status(self, name: str) -> SliceStatus:
            self.reads += 1
            if self.reads in (51, 102):  # 500 s of 503s, a good read, again, then the end
                return SliceStatus(name, SliceState.READY, None)
            if self.reads > 102:
                return SliceStatus(name, SliceState.TERMINATED, 0)
            raise RuntimeError("503")

    settings = WatchSettings(poll_s=10, heartbeat_timeout_s=600, confirm_s=60)
    outcome = watch_slice(
        Recovers(), "s", Beating(), settings, lambda m: None, None, clock, clock.sleep
    )
    assert outcome.exit_code == 0 and clock.now > 1000


def test_a_watch_stops_once_its_sweep_is_stopping_and_only_then():
    import threading

    from tasks.watch import STOPPING, WatchStopped

    stopping = threading.Event()
    token = STOPPING.set(stopping)
    try:

        class Running:
            polls = 0

            def status(self, name: str) -> SliceStatus:
                self.polls += 1
                if self.polls == 3:
                    stopping.set()  # the sweep got Ctrl-C while this trial trained
                return SliceStatus(name, SliceState.READY, None)

        provider = Running()
        with pytest.raises(WatchStopped, match="stopped before its first step: the sweep"):
            watch(provider)
        assert provider.polls == 3  # at the next poll, not after the workload's end

        # Once it has beaten: its step is the last heard of, not where the workload stops
        # (it saves the step it is at when its slice is deleted). "after step 60" was read
        # as where it stopped, beside a checkpoint of step 75.
        class Training:
            def read_status(self) -> dict:
                return {"state": "training", "step": 60, "time": 1e12}

            def host_failures(self) -> dict:
                return {}

        stopping.clear()
        provider.polls = 0
        clock = FakeClock(0.0, limit=1e5)
        settings = WatchSettings(poll_s=10, heartbeat_timeout_s=600, confirm_s=60)
        with pytest.raises(WatchStopped) as stopped:
            watch_slice(provider, "s", Training(), settings, print, None, clock, clock.sleep)
        assert str(stopped.value) == (
            "stopped while training, at step 60 or past it: the sweep was interrupted"
        )
    finally:
        STOPPING.reset(token)
    assert watch(Provider([])).exit_code == 0  # outside a stopping sweep: watched to the end
