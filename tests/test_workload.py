"""The training workload as real processes: multi-host, preemption and exact resume."""

from __future__ import annotations

import json
import re
import resource
import signal
import time

import numpy as np
import pytest

from infra.slices import SliceState
from tasks.goodput import read_events
from tests.helpers import cut_checkpoint_data
from tests.workload_runs import WorkloadRun
from workloads import checkpoint
from workloads.events import SUPERSEDED_EXIT, grant_lease
from workloads.rundir import RunDir
from workloads.train import PREEMPTED_EXIT

pytestmark = pytest.mark.slow

# float32 compute: bit-identical resume and tight cross-layout tolerances.
EXACT = ("model.dtype=float32", "train.log_every=1")
LONG = ("train.steps=150", "train.checkpoint_every=10")


def first_losses(run: WorkloadRun, n: int) -> np.ndarray:
    by_step = {row["step"]: row["loss"] for row in run.metrics()}
    return np.array([by_step[s] for s in range(1, n + 1)])


def test_two_hosts_of_four_devices_match_one_host_of_eight_through_a_preemption(tmp_path):
    steps = ("train.steps=20",)
    one = WorkloadRun(tmp_path, "run_name=one-host", *EXACT, *steps)
    two = WorkloadRun(tmp_path, "run_name=two-hosts", "slice.hosts=2", *EXACT, *steps)
    assert one.run_to_end() == 0
    # Both hosts get the notice (a slice is preempted whole) at their own step; they agree
    # on one step to save, since a save is collective, and lose none.
    attempt = two.start()
    two.signal_at(attempt, 3, signal.SIGTERM)
    assert two.wait(attempt) == PREEMPTED_EXIT
    status = two.status()
    assert status["phase"] == "preempted" and status["step"] < 20
    assert checkpoint.latest_step(str(two.run_dir)) == status["step"]
    assert two.run_to_end() == 0
    starts = [row["resumed_from"] for row in two.metrics() if "resumed_from" in row]
    assert starts == [0, status["step"]]
    # Same global batches; rows are ordered differently across hosts, so sums round
    # differently: a relative tolerance of 1e-5 on float32 losses, across the resume.
    np.testing.assert_allclose(first_losses(two, 20), first_losses(one, 20), rtol=1e-5)
    assert list((two.run_dir / "logs").glob("*-host1.log"))


def test_a_checkpoint_only_one_host_cannot_read_is_quarantined_and_the_hosts_resume_together(
    tmp_path,
):
    # Parameters sharded over fsdp across both hosts: each host writes, and reads back, the
    # shards it holds. Host 1's files of the final step cut: only host 1's read fails.
    # The hosts used to disagree in orbax's barriers and stall until the orchestrator's
    # heartbeat timeout, which counted the stall as a preemption.
    layout = ("slice.hosts=2", "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2")
    run = WorkloadRun(tmp_path, *layout, *EXACT, "train.steps=20", "train.checkpoint_every=10")
    assert run.run_to_end() == 0
    first = {row["step"]: row["loss"] for row in run.metrics()}
    cut_checkpoint_data(run.run_dir / "checkpoints" / "20" / "state", process="1")
    assert run.wait(run.start(), timeout_s=120) == 0
    (reason,) = (run.run_dir / "quarantine").glob("20-*/QUARANTINED.txt")
    assert reason.read_text().startswith("does not restore on host 1: ")
    rows = run.metrics()
    starts = [i for i, row in enumerate(rows) if "resumed_from" in row]
    assert [rows[i]["resumed_from"] for i in starts] == [0, 10]
    again = {row["step"]: row["loss"] for row in rows[starts[1] :]}
    assert sorted(again) == list(range(11, 21))
    assert all(again[s] == first[s] for s in again)  # the same state and batches: exact
    assert checkpoint.latest_step(str(run.run_dir)) == 20


def test_a_diverging_run_stops_with_a_clear_error_and_keeps_its_last_good_save(tmp_path):
    # An absurd learning rate: step 1's loss and gradients are finite, its update is not
    # sane, and step 2's gradients are NaN. Step 1's save (still being written when step
    # 2 fails) must land; nothing of step 2 may.
    run = WorkloadRun(
        tmp_path,
        "train.learning_rate=1e30",
        "train.warmup_steps=0",
        "train.checkpoint_every=1",
        "train.log_every=1",
        "train.steps=4",
    )
    assert run.run_to_end() == 1
    status = run.status()
    assert status["phase"] == "failed"
    assert "NonFiniteError: step 2:" in status["error"] and "not finite" in status["error"]
    assert checkpoint.latest_step(str(run.run_dir)) == 1
    assert sorted(p.name for p in (run.run_dir / "checkpoints").iterdir()) == ["1"]


def test_preempted_then_killed_run_ends_bit_identical(tmp_path, monkeypatch):
    monkeypatch.delenv("TPUPIPE_COMPILE_CACHE")  # the root's own cache, cold at first
    every = 10
    reference = WorkloadRun(tmp_path, "run_name=uninterrupted", *EXACT, *LONG)
    assert reference.run_to_end() == 0

    run = WorkloadRun(tmp_path, "run_name=interrupted", *EXACT, *LONG)
    # A SIGTERM is a preemption notice: save the current step, exit 75, lose nothing.
    attempt = run.start()
    run.signal_at(attempt, 25, signal.SIGTERM)
    assert run.wait(attempt) == PREEMPTED_EXIT
    status = run.status()
    assert status["phase"] == "preempted"
    assert checkpoint.latest_step(str(run.run_dir)) == status["step"]  # 0 lost steps
    preempted_at = status["step"]

    # A SIGKILL is a hard loss: the steps since the last committed checkpoint, at most
    # checkpoint_every (a kill while a save is written goes back to the one before).
    attempt = run.start()
    committed = (preempted_at // every + 2) * every
    seen = run.signal_at(attempt, committed + 3, signal.SIGKILL, committed=committed)
    run.wait(attempt)
    resumed_from = checkpoint.latest_step(str(run.run_dir))
    assert resumed_from == committed
    assert 0 < seen - resumed_from <= every

    assert run.run_to_end() == 0
    steps = 150
    ref = checkpoint.verify_checkpoint(str(reference.run_dir), steps, reference.plan.config_hash)
    got = checkpoint.verify_checkpoint(str(run.run_dir), steps, run.plan.config_hash)
    assert got.params_sha256 == ref.params_sha256

    # Each resumed attempt started where a checkpoint was, and reused compiled programs.
    starts = [row for row in run.metrics() if "resumed_from" in row]
    assert [row["resumed_from"] for row in starts] == [0, preempted_at, resumed_from]
    (cold,) = [row for row in reference.metrics() if "resumed_from" in row]
    assert cold["compile_cache_hits"] == 0 < cold["compile_cache_misses"]
    for row in starts:
        # The programs came from the cache: only the restore path's own check is new to a
        # resumed attempt (which also skips the peak measurement, reusing the run's).
        assert row["compile_cache_hits"] >= cold["compile_cache_misses"] - 10 > 0
        assert row["compile_cache_misses"] <= 1

    # Another learning rate, warmup and length compile nothing new: the schedule is an
    # argument of the step. As constants in it, each trial of a sweep compiled its step.
    hyper = ("train.steps=20", "train.learning_rate=0.003", "train.warmup_steps=5")
    other = WorkloadRun(tmp_path, "run_name=other", *EXACT, *hyper)
    assert other.run_to_end() == 0
    (first,) = [row for row in other.metrics() if "resumed_from" in row]
    assert first["compile_cache_misses"] == 0 and first["compile_cache_hits"] > 0


@pytest.mark.parametrize("bound", [None, 8])
def test_a_kill_while_a_save_is_written_loses_at_most_the_bound(tmp_path, bound):
    # Tiny steps take milliseconds and a save tens of them: unchecked, training ran many
    # steps past a save still being written, and a kill then went back to the save before.
    every = 4
    extra = [] if bound is None else [f"train.max_lost_steps={bound}"]
    run = WorkloadRun(tmp_path, *EXACT, "train.steps=40", f"train.checkpoint_every={every}", *extra)
    attempt = run.start()
    seen = run.signal_at(attempt, 3 * every + 2, signal.SIGKILL)
    run.wait(attempt)
    assert 0 <= seen - checkpoint.latest_step(str(run.run_dir)) <= (bound or every)


def test_a_host_whose_checkpoint_write_fails_ends_the_attempt_with_the_error(tmp_path):
    # Host 1 alone cannot write files past 64 KB (a full disk, a quota): its part of step
    # 5's save fails. Orbax's hosts then waited for each other at barriers, silent, for 20
    # minutes; the orchestrator took it for a preemption, and every attempt did the same.
    steps = ("train.steps=30", "train.checkpoint_every=5")
    run = WorkloadRun(tmp_path, "slice.hosts=2", *EXACT, *steps)
    attempt = run.start()
    registry = run.provider.registry_dir / f"{attempt}.json"
    host1 = json.loads(registry.read_text())["pids"][1]
    resource.prlimit(host1, resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))  # before step 5
    started = time.monotonic()
    assert run.wait(attempt, timeout_s=120) == 1
    assert time.monotonic() - started < 90
    # Host 1 records its error beside host 0's heartbeat, which the orchestrator quotes.
    error = RunDir(run.run_dir).host_failures()[1]["error"]
    # Step 5's, unless this process set the limit only after host 1 had written it (a busy
    # machine): then step 10's. Either way the failed save is never committed.
    failed = re.match(r"SaveFailed: saving checkpoint step (\d+) failed on host 1: ", error)
    assert failed, error
    latest = checkpoint.latest_step(str(run.run_dir))  # nothing half-written is trusted
    assert latest is None or latest < int(failed[1])


def test_an_attempt_that_lost_its_lease_stops_without_writing(tmp_path):
    run = WorkloadRun(tmp_path, "run_name=fenced", *EXACT, *LONG)
    zombie = run.start(lease="first")
    run.signal_at(zombie, 5, signal.SIGCONT)  # harmless: just wait until it is training
    granted = time.time()
    grant_lease(str(run.run_dir), 2, "second")  # the orchestrator moved on to attempt 2
    assert run.wait(zombie) == SUPERSEDED_EXIT
    # The fence is a lease check before each write, not a lock: a write whose check came
    # just before the grant may land after it, stamped right after its check (it failed
    # the test once under load); a heartbeat the zombie began later would be stamped later.
    last = json.loads((run.run_dir / "status.json").read_text())
    assert last["attempt"] == 1 and last["time"] < granted + 0.2, (last, granted)
    assert checkpoint.latest_step(str(run.run_dir)) in (None, 10)  # nothing after the grant
    events = [e["event"] for e in read_events(run.run_dir / "events.jsonl")]
    assert "finished" not in events and "failed" not in events


def test_a_notice_at_the_last_step_ends_finished_not_preempted(tmp_path):
    # The notice lands while the only step compiles: that step is the last, so once it is
    # saved the run is done. Exiting "preempted" would make the orchestrator provision a
    # slice only to restore the final step, and spend one of its preemption retries.
    run = WorkloadRun(tmp_path, "train.steps=1", "train.warmup_steps=0")
    attempt = run.start()
    run.signal_in_phase(attempt, "compiling", signal.SIGTERM)
    assert run.wait(attempt) == 0
    assert run.status()["phase"] == "finished"
    assert checkpoint.latest_step(str(run.run_dir)) == 1


def test_the_heartbeat_beats_between_rare_log_steps(tmp_path):
    # Metrics every 1000 steps, a heartbeat timeout of 2 s: the status must still be
    # rewritten well within the timeout, or the orchestrator takes a healthy run for a
    # lost one, kills it and starts it again (forever, when a log step never comes in time).
    run = WorkloadRun(
        tmp_path,
        "slice.heartbeat_timeout_s=2",
        "train.steps=200",
        "train.log_every=1000",
        "train.checkpoint_every=1000",
    )
    attempt = run.start()
    run.signal_in_phase(attempt, "training", signal.SIGCONT)  # harmless: wait for step 1
    beats, status = [], run.run_dir / "status.json"
    while run.provider.status(attempt).state is SliceState.READY:
        beat = json.loads(status.read_text())
        # From step 3: the first steps compile (step 2 again, for the layouts step 1
        # returned), which blocks the loop. Up to the last step: the final save follows.
        if beat["phase"] == "training" and beat["step"] >= 3 and beat["time"] not in beats:
            beats.append(beat["time"])
        time.sleep(0.02)
    assert run.wait(attempt) == 0
    assert run.status()["phase"] == "finished"
    assert len(beats) > 3 and max(np.diff(beats)) < 1.0, np.diff(beats)


def test_compilation_cache_entries_a_write_cut_short_are_deleted(tmp_path, caplog):
    # JAX writes an entry in place and skips a key whose file exists: 25 entries a full
    # disk left empty, or one cut at 12 kB, made every later run warn "truncated stream"
    # and compile again, for good.
    import zlib

    from workloads.compile_cache import repair_cache_entries

    program = zlib.compress(np.random.default_rng(0).bytes(40_000))
    (tmp_path / "jit_step-abc-cache").write_bytes(b"")
    (tmp_path / "jit_eval-cut-cache").write_bytes(program[: len(program) // 2])
    (tmp_path / "jit_loss-def-cache").write_bytes(program)
    (tmp_path / "jit_adam-old-cache").write_bytes(b"not read")  # JAX finished it: its
    (tmp_path / "jit_adam-old-atime").write_bytes(b"\0" * 8)  # -atime came after it
    repair_cache_entries(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "jit_adam-old-atime",
        "jit_adam-old-cache",
        "jit_loss-def-atime",  # read once, whole: not read again
        "jit_loss-def-cache",
    ]
    assert "jit_step-abc-cache" in caplog.text and "jit_eval-cut-cache" in caplog.text
    repair_cache_entries(str(tmp_path / "none-yet"))  # no cache yet: nothing to do


BOUNDED_CACHE = """
import sys, jax, numpy as np
from workloads.compile_cache import configure_compile_cache
configure_compile_cache(sys.argv[1], float(sys.argv[2]))
for k in range(30):  # 30 programs of about 2.5 kB each
    jax.jit(lambda x, k=k: x * k + 1)(np.arange(7.0)).block_until_ready()
"""


def test_a_local_compilation_cache_keeps_within_storage_compile_cache_gb(tmp_path):
    # Every run with new hyperparameters compiles its own step: a storage root used nightly
    # and by sweeps grew its cache without end. Its entries from before the bound have no
    # `-atime` file, which JAX's eviction reads: every write to such a cache failed.
    import subprocess
    import sys
    import zlib

    from tests.helpers import REPO

    program = zlib.compress(np.random.default_rng(0).bytes(50_000))
    (tmp_path / "from-before-cache").write_bytes(program)  # no atime file
    out = subprocess.run(
        [sys.executable, "-W", "always", "-c", BOUNDED_CACHE, str(tmp_path), "0.00008"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "Error writing persistent compilation cache" not in out.stderr
    entries = [p for p in tmp_path.iterdir() if p.name.endswith("-cache")]
    assert sum(p.stat().st_size for p in entries) <= 80_000  # 0.00008 GB
    assert len(entries) > 20  # the new programs kept, the oldest entry deleted first
    assert not (tmp_path / "from-before-cache").exists()


MIXED_BOUNDS = """
import subprocess, sys, jax, numpy as np
from workloads.compile_cache import configure_compile_cache
cache, gb, first, *alongside = sys.argv[1:]
configure_compile_cache(cache, None if gb == "null" else float(gb))
if alongside:  # another run writes to the cache after this one has started
    subprocess.run([sys.executable, __file__, cache, *alongside], check=True)
for k in range(int(first), int(first) + 5):
    jax.jit(lambda x, k=k: x * k + 1)(np.arange(7.0)).block_until_ready()
"""


def test_runs_with_and_without_a_bound_share_a_compilation_cache(tmp_path):
    # A run with no bound wrote entries without `-atime` files (JAX's -1 turns its LRU
    # off), and a bounded run at the same time on the same cache (TPUPIPE_COMPILE_CACHE, or
    # one storage root) failed every write: its eviction reads every entry's `-atime`.
    import os
    import subprocess
    import sys

    from tests.helpers import REPO

    script, cache = tmp_path / "writer.py", tmp_path / "cache"
    script.write_text(MIXED_BOUNDS)
    # The bounded run starts (its repair of the cache done), then the unbounded one writes.
    out = subprocess.run(
        [sys.executable, "-W", "always", script, cache, "20", "0", "null", "100"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "Error writing persistent compilation cache" not in out.stderr
    entries = sorted(p.name.removesuffix("-cache") for p in cache.glob("*-cache"))
    assert len(entries) == 10  # the five programs of each run
    assert sorted(p.name.removesuffix("-atime") for p in cache.glob("*-atime")) == entries
