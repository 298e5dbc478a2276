"""The workload started by hand (README: "the workload alone") never starts beside another
workload that is writing the same run directory: it holds no lease that would fence it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.plan import plan_run, write_workload_config
from tests.helpers import tiny_config
from workloads.events import beside_live_workload
from workloads.rundir import STATUS, RunDir


@pytest.fixture()
def run(tmp_path):
    """A run's config.json (its dataset never needed: the workload stops before reading it)."""
    config = tiny_config(tmp_path)
    plan = plan_run(config)
    path = write_workload_config(config, plan, str(tmp_path / "data"))
    return plan, path


def test_a_workload_by_hand_beside_a_live_attempt_stops_and_writes_nothing(run):
    plan, path = run
    RunDir(plan.run_dir).write_status("training", attempt=3, step=7)
    before = sorted(os.listdir(plan.run_dir)), (RunDir(plan.run_dir).path / STATUS).read_bytes()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUPIPE_")}
    out = subprocess.run(
        [sys.executable, "-m", "workloads.train", "--config", path],
        env={**env, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out.stderr[-2000:]
    assert f"{plan.run_dir} is being trained by attempt 3 of the pipeline" in out.stderr
    assert "'training' at step 7" in out.stderr
    # The live attempt's heartbeat stands, and no event, metric or checkpoint was written.
    after = sorted(os.listdir(plan.run_dir)), (RunDir(plan.run_dir).path / STATUS).read_bytes()
    assert after == before


def test_only_a_fresh_heartbeat_of_a_workload_still_running_counts(tmp_path):
    now = [1000.0]
    rd = RunDir(tmp_path, clock=lambda: now[0])
    assert beside_live_workload(str(tmp_path), 120, env={}) is None  # no heartbeat yet

    rd.write_status("training", attempt=None, step=4)
    now[0] += 119
    problem = beside_live_workload(str(tmp_path), 120, env={}, clock=lambda: now[0])
    assert problem and "a workload started by hand" in problem and "119 s ago" in problem
    # Silent for the heartbeat timeout: a dead workload, as the orchestrator takes it.
    assert beside_live_workload(str(tmp_path), 118, env={}, clock=lambda: now[0]) is None
    # A pipeline attempt is fenced by its lease, not by this check.
    lease = {"TPUPIPE_LEASE": "x", "TPUPIPE_ATTEMPT": "2"}
    assert beside_live_workload(str(tmp_path), 120, env=lease, clock=lambda: now[0]) is None

    # Written on this machine by a process that is gone (killed, or stopped by Ctrl-C,
    # which writes no last beat): not live, however fresh. Another machine's: by its age.
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    beat = json.loads((tmp_path / STATUS).read_text())
    (tmp_path / STATUS).write_text(json.dumps({**beat, "pid": int(dead.stdout)}))
    assert beside_live_workload(str(tmp_path), 120, env={}, clock=lambda: now[0]) is None
    (tmp_path / STATUS).write_text(json.dumps({**beat, "pid": int(dead.stdout), "host": "vm-2"}))
    assert beside_live_workload(str(tmp_path), 120, env={}, clock=lambda: now[0])

    for ended in ("finished", "failed", "preempted"):
        rd.write_status(ended, attempt=1, step=4)
        assert beside_live_workload(str(tmp_path), 120, env={}, clock=lambda: now[0]) is None
    (tmp_path / STATUS).write_text('{"phase": "training", "time": "soon"}')
    assert beside_live_workload(str(tmp_path), 120, env={}, clock=lambda: now[0]) is None


@pytest.mark.parametrize("tool", ["workloads.train", "workloads.evaluate"])
def test_a_config_json_of_a_copied_or_moved_root_is_refused_writing_nowhere(run, tmp_path, tool):
    """config.json names its run directory by absolute path: read from a copied root, the
    workload trained (and evaluation evaluated) the original's run directory, writing its
    status and events; from a moved one it died on a directory that no longer existed."""
    import shutil

    plan, _ = run
    RunDir(plan.run_dir).write_status("finished", attempt=1, step=30)
    copy = tmp_path / "copy"
    shutil.copytree(plan.run_dir, copy)
    before = {p.name: p.read_bytes() for p in (tmp_path / "runs" / "tiny").iterdir()}
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUPIPE_")}
    out = subprocess.run(
        [sys.executable, "-m", tool, "--config", str(copy / "config.json")],
        env={**env, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert f"names the run directory {plan.run_dir}, not the one it is in ({copy})" in out.stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / "runs" / "tiny").iterdir()} == before
    assert sorted(os.listdir(copy)) == sorted(before)


def test_a_config_json_kept_outside_any_run_directory_is_used_as_it_names(run, tmp_path):
    from workloads.config_file import load_workload_config, misplaced_config

    _, path = run
    kept = tmp_path / "elsewhere" / "config.json"
    kept.parent.mkdir()
    kept.write_bytes(Path(path).read_bytes())
    assert misplaced_config(str(kept), load_workload_config(str(kept))) is None
    assert misplaced_config(path, load_workload_config(path)) is None


def test_the_refusal_names_another_machine_and_no_missing_step(tmp_path):
    # "heartbeat 'starting' at step None", and a dead workload said to count as running
    # for slice.heartbeat_timeout_s although one on this machine stops counting at once.
    from workloads.rundir import HOST

    beat = {"pid": 7, "phase": "starting", "step": None, "age_s": 0.2, "host": HOST}
    assert RunDir.describe_beat(beat) == "pid 7: heartbeat 'starting', 0 s ago"
    beat = {**beat, "host": "tpu-vm-3", "step": 12, "phase": "training"}
    assert (
        RunDir.describe_beat(beat) == "pid 7 on tpu-vm-3: heartbeat 'training' at step 12, 0 s ago"
    )
    RunDir(tmp_path).write_status("starting", attempt=2)
    problem = beside_live_workload(str(tmp_path), 600, env={})
    assert "heartbeat 'starting', " in problem and "at step" not in problem
    assert "at once on this machine, and 600 s after its last heartbeat if it ran on another" in (
        problem
    )
