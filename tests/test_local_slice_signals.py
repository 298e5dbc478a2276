"""A signal or an error in the middle of a local slice's create leaves no process that
teardown cannot find: it is either recorded (and deleted through the record) or killed.

The orchestrator used to die of a SIGTERM (or Ctrl-C) that landed after the workload was
forked and before its record was written: the workload trained on with no record, so
neither teardown nor the reaper (both read the registry) could see it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import infra.slices.local as local
from infra.slices import LocalSliceProvider, SliceSpec
from infra.slices.held_signals import signals_held
from tests.helpers import processes_mentioning


class Stopped(BaseException):
    """What this test's SIGTERM handler raises (as Prefect's raises TerminationSignal)."""


def _raise_stopped(signum, frame):
    raise Stopped(signum)


@pytest.fixture
def sigterm_raises():
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    yield
    signal.signal(signal.SIGTERM, previous)


def _spec(tmp_path: Path, hosts: int) -> tuple[SliceSpec, str]:
    marker = str(tmp_path / "create-window-marker")  # in every host's command line
    command = [sys.executable, "-c", "import time; time.sleep(60)", marker]
    spec = SliceSpec(
        name="window", devices=2, hosts=hosts, command=command, log_path=str(tmp_path / "w.log")
    )
    return spec, marker


def _signal_in_fork(monkeypatch, host: int, sig: signal.Signals, forked: list[int]) -> None:
    """Signal this process right after host `host` is forked, before Popen stores its pid
    (the pids forked go to `forked`: one not yet exec'd shows no marker to clean up by)."""
    real = subprocess._fork_exec

    def fork_exec(*args, **kwargs):
        pid = real(*args, **kwargs)
        forked.append(pid)
        if len(forked) == host + 1:
            os.kill(os.getpid(), sig)  # its handler runs here, before `return pid`
        return pid

    monkeypatch.setattr(subprocess, "_fork_exec", fork_exec)


def _signal_at_record(monkeypatch, sig: signal.Signals) -> None:
    """Signal this process once every host runs, before the record is written (the
    window the acceptance probe hit: reading the leader's start time)."""
    real, fired = local.start_ticks, []

    def start_ticks(pid):
        if not fired and pid != os.getpid():
            fired.append(pid)
            os.kill(os.getpid(), sig)
        return real(pid)

    monkeypatch.setattr(local, "start_ticks", start_ticks)


def _kill(pids: list[int]) -> None:
    """Clean up after a failed assertion (the old code leaked these)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _gone(marker: str) -> bool:
    deadline = time.monotonic() + 10
    while processes_mentioning(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize(
    ("where", "hosts", "sig"),
    [
        ("fork:0", 1, signal.SIGINT),  # the only host forked, its pid not yet stored
        ("fork:1", 2, signal.SIGTERM),  # host 0 running, host 1 just forked
        ("record", 1, signal.SIGTERM),
        ("record", 2, signal.SIGINT),
    ],
)
def test_a_signal_during_create_leaves_every_host_recorded(
    tmp_path, monkeypatch, sigterm_raises, where, hosts, sig
):
    spec, marker = _spec(tmp_path, hosts)
    provider = LocalSliceProvider(tmp_path / "registry")
    forked: list[int] = []
    if where == "record":
        _signal_at_record(monkeypatch, sig)
    else:
        _signal_in_fork(monkeypatch, int(where.split(":")[1]), sig, forked)
    try:
        with pytest.raises(KeyboardInterrupt if sig == signal.SIGINT else Stopped):
            provider.create(spec)
        monkeypatch.undo()
        # What teardown and the reaper do: another instance, reading the registry only.
        teardown = LocalSliceProvider(tmp_path / "registry")
        assert [s.name for s in teardown.list()] == ["window"], "a host ran unrecorded"
        assert teardown.delete("window", grace_s=0.2) is True
        assert _gone(marker), "a host outlived the delete of its slice"
    finally:
        _kill(forked + processes_mentioning(marker))


def test_an_error_before_the_record_kills_and_reaps_every_host(tmp_path, monkeypatch):
    spec, marker = _spec(tmp_path, hosts=2)
    provider = LocalSliceProvider(tmp_path / "registry")

    def unreadable(pid):
        raise OSError("/proc unreadable")

    monkeypatch.setattr(local, "start_ticks", unreadable)
    try:
        with pytest.raises(OSError, match="unreadable"):
            provider.create(spec)
        assert processes_mentioning(marker) == []  # killed and reaped before it raised
        assert LocalSliceProvider(tmp_path / "registry").list() == []
    finally:
        _kill(processes_mentioning(marker))


def test_held_signals_run_their_handlers_after_the_block(sigterm_raises):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    ran = []
    with pytest.raises(Stopped), signals_held():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        ran.append("the whole block")
    assert ran == ["the whole block"]
    assert {s: signal.getsignal(s) for s in before} == before
    # Elsewhere than the main thread there is nothing to hold (nor a handler to swap).
    seen = []
    worker = threading.Thread(
        target=lambda: seen.append(signals_held().__enter__() or signal.getsignal(signal.SIGTERM))
    )
    worker.start()
    worker.join()
    assert seen == [_raise_stopped]
