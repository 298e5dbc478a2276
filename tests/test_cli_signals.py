"""`tpupipe` hung up: closing its terminal or SSH session (SIGHUP) stops it as SIGTERM
does. It used to kill the process at once: `tpupipe run` left its workload training with
no teardown and no `runs` row (the whole-pipeline case is in tests/test_chaos.py)."""

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

from flows import local_run
from tests.test_data import make_corpus
from tests.test_shard_pool import running

REPO = Path(__file__).resolve().parent.parent

# `tpupipe shard` whose progress callback (in this process, with the pool's worker up)
# stalls on the first unit tokenized, so the terminal can close mid-run.
STALLED_SHARD = """
import sys, time
from pathlib import Path

import tasks.prepare
from flows.cli import main

real, marker = tasks.prepare.shard_corpus, Path(sys.argv[1])


def shard_corpus(cfg, out, progress=None):
    def stalled(stage, done, total):
        progress(stage, done, total)
        if stage == "tokenize" and done and not marker.exists():
            marker.write_text("")
            time.sleep(60)

    return real(cfg, out, progress=stalled)


tasks.prepare.shard_corpus = shard_corpus
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
