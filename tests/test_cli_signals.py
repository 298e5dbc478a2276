"""`tpupipe` hung up: closing its terminal or SSH session (SIGHUP) stops it as SIGTERM
does. It used to kill the process at once: `tpupipe run` left its workload training with
no teardown and no `runs` row (the whole-pipeline case is in tests/test_chaos.py). And a
signal to a `tpupipe shard`'s whole process group stops it with one line."""

from __future__ import annotations

import contextlib
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows import cli, local_run
from tests.test_data import make_corpus
from tests.test_shard_pool import running

REPO = Path(__file__).resolve().parent.parent

# `tpupipe shard` whose progress callback (in this process, with the pool's worker up)
# stalls on the first unit tokenized, so the terminal can close mid-run.
STALLED_SHARD = """
import sys, time
from pathlib import Path

import tasks.corpus
from flows.cli import main

real, marker = tasks.corpus.shard_corpus, Path(sys.argv[1])


def shard_corpus(cfg, out, progress=None):
    def stalled(stage, done, total):
        progress(stage, done, total)
        if stage == "tokenize" and done and not marker.exists():
            marker.write_text("")
            time.sleep(60)

    return real(cfg, out, progress=stalled)


# Guarded, as the `tpupipe` script is: a worker runs this file again before its first job,
# and once its imports were fast enough (no Prefect) it started a second run of its own.
if __name__ == "__main__":
    tasks.corpus.shard_corpus = shard_corpus
    sys.exit(main(sys.argv[2:]))
"""


def _children(pid: int) -> list[int]:
    """Live descendants of `pid` (the forkserver and the pool's workers)."""
    parents = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
            if fields[0] not in "ZX":
                parents[int(entry)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        frontier = [p for p, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def test_a_shard_run_whose_terminal_hangs_up_stops_its_workers_and_exits_129(tmp_path):
    # Its output goes to the terminal, which is gone: every write fails (EIO), and the
    # progress bar's last one on the way out had `tpupipe shard` exit 1 instead of 129.
    script, marker = tmp_path / "stalled.py", tmp_path / "stalled"
    script.write_text(STALLED_SHARD)
    corpus = make_corpus(tmp_path)
    argv = ["shard", "--source", str(corpus), "--out", str(tmp_path / "ds"), "--workers", "2"]
    master, terminal = pty.openpty()
    run = subprocess.Popen(
        [sys.executable, str(script), str(marker), *argv],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.DEVNULL,
        stdout=terminal,
        stderr=terminal,
    )
    os.close(terminal)
    try:
        deadline = time.monotonic() + 60
        while not (marker.exists() and len(workers := _children(run.pid)) >= 2):
            assert run.poll() is None and time.monotonic() < deadline, "never sharded"
            if select.select([master], [], [], 0.05)[0]:
                os.read(master, 65536)  # the progress bar: a full terminal would block it
        os.close(master)  # the terminal goes away (its writes now fail), then the hang-up
        run.send_signal(signal.SIGHUP)
        assert run.wait(timeout=30) == 128 + signal.SIGHUP
        deadline = time.monotonic() + 10
        while alive := [pid for pid in workers if running(pid)]:
            assert time.monotonic() < deadline, f"workers {alive} outlived the run"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(OSError):
            os.close(master)
        if run.poll() is None:
            run.kill()
            run.wait()


def test_a_hang_up_that_nohup_ignores_stays_ignored():
    hang_up, term = signal.getsignal(signal.SIGHUP), signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        local_run.exit_on_signals()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, hang_up)
        signal.signal(signal.SIGTERM, term)


@pytest.mark.parametrize(
    ("signum", "status", "said"),
    [
        (signal.SIGINT, -signal.SIGINT, "Ctrl-C"),  # killed by it, as Python ends on Ctrl-C
        (signal.SIGTERM, 128 + signal.SIGTERM, "SIGTERM"),
        (signal.SIGHUP, 128 + signal.SIGHUP, "SIGHUP"),
    ],
    ids=["ctrl-c", "sigterm", "sighup"],
)
def test_a_signal_to_a_shard_runs_group_stops_it_with_one_line(tmp_path, signum, status, said):
    # As a terminal sends Ctrl-C or its hang-up, to every process of the group. Ctrl-C
    # printed a KeyboardInterrupt traceback, and an idle worker one of its own; SIGHUP
    # killed multiprocessing's resource tracker, which the exit relaunched ("Some resources
    # might leak") to a `KeyError: '/mp-...'` traceback per semaphore.
    script, marker = tmp_path / "stalled.py", tmp_path / "stalled"
    script.write_text(STALLED_SHARD)
    corpus, out = make_corpus(tmp_path), tmp_path / "ds"
    argv = ["shard", "--source", str(corpus), "--out", str(out), "--seq-len", "16"]
    run = subprocess.Popen(
        [sys.executable, str(script), str(marker), *argv, "--workers", "2"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        # The resource tracker and the forkserver, children of the run, and the worker.
        while not (marker.exists() and len(helpers := _children(run.pid)) >= 3):
            assert run.poll() is None and time.monotonic() < deadline, "never sharded"
            time.sleep(0.05)
        os.killpg(run.pid, signum)
        _, err = run.communicate(timeout=30)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    bars = ("tokenize (bytes)", "write (records)")  # the progress bars' lines
    lines = [line for line in err.decode().splitlines() if line.strip()]
    lines = [line for line in lines if not line.strip().startswith(bars)]
    assert lines == [
        f"sharding stopped by {said}; run it again to go on (finished work is reused)"
    ], err.decode()
    assert run.returncode == status
    deadline = time.monotonic() + 10
    while alive := [pid for pid in helpers if running(pid)]:
        assert time.monotonic() < deadline, f"processes {alive} outlived the run"
        time.sleep(0.05)
    assert cli.main([*argv, "--workers", "1"]) == 0  # the next run finishes the dataset


# `tpupipe shard` interrupted while it imports its sharding code: pydantic, run by such an
# import (Prefect's, when it was imported there), turns a KeyboardInterrupt raised in its
# serializers into a PydanticSerializationError, as this import hook turns it into a
# RuntimeError.
CTRL_C_IN_IMPORT = """
import os, signal, sys, time

from flows.cli import main


class CtrlCInImport:
    def find_spec(self, name, path=None, target=None):
        if name == "tasks.corpus":
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.5)
            except KeyboardInterrupt as exc:
                raise RuntimeError("serializer failed") from exc
        return None


sys.modules.pop("tasks.corpus", None)
sys.meta_path.insert(0, CtrlCInImport())
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_while_the_sharding_code_is_imported_waits_for_the_import(tmp_path):
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C_IN_IMPORT)
    corpus = make_corpus(tmp_path)
    argv = ["shard", "--source", str(corpus), "--out", str(tmp_path / "ds"), "--workers", "1"]
    out = subprocess.run(
        [sys.executable, str(script), *argv],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stderr.splitlines() == [
        "sharding stopped by Ctrl-C; run it again to go on (finished work is reused)"
    ]
    assert out.returncode == -signal.SIGINT


# A signal whose handler's exception meets a garbage-collection callback (JAX installs
# one in every process that imports it): CPython printed "Exception ignored" and dropped
# it, so a `tpupipe run` SIGTERMed then landed `completed` and exited 0.
SIGNAL_DURING_GC = """
import gc, os, signal, sys, time

import jax  # noqa: F401  (its gc callback, as every tpupipe run process has)

from flows.local_run import exit_on_signals

exit_on_signals()
if sys.argv[2] == "prefect":  # Prefect's bridge, as during a flow run
    from prefect.exceptions import TerminationSignal
    from prefect.utilities.engine import _prefect_sigterm_handler

    signal.signal(signal.SIGTERM, _prefect_sigterm_handler)


def deliver_during_gc(phase, info):
    if phase == "start":
        os.kill(os.getpid(), int(sys.argv[1]))


gc.callbacks.insert(0, deliver_during_gc)
try:
    gc.collect()
    gc.callbacks.remove(deliver_during_gc)
    time.sleep(20)
    print("the signal was lost")
except BaseException as exc:
    print(f"raised {type(exc).__name__}")
    raise
"""


@pytest.mark.parametrize(
    ("signum", "handler", "status", "raised"),
    [
        (signal.SIGTERM, "ours", 143, "SystemExit"),
        (signal.SIGHUP, "ours", 129, "SystemExit"),
        (signal.SIGINT, "ours", -signal.SIGINT, "KeyboardInterrupt"),
        (signal.SIGTERM, "prefect", 1, "TerminationSignal"),
    ],
)
def test_a_signal_that_meets_a_gc_callback_is_not_lost(signum, handler, status, raised):
    done = subprocess.run(
        [sys.executable, "-c", SIGNAL_DURING_GC, str(int(signum)), handler],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == status, done.stderr[-2000:]
    assert done.stdout.strip() == f"raised {raised}"
