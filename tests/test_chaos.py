"""Chaos: the whole flow under injected preemptions, capacity errors and a dead orchestrator.

Each case asserts the outcome a user relies on, not just "no exception".
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.metrics import DuckDBSink
from infra.slices import build_provider
from tasks.goodput import read_events
from tests.helpers import (
    REPO,
    cut_checkpoint_data,
    processes_mentioning,
    tiny_config,
)
from workloads.rundir import RunDir

pytestmark = pytest.mark.chaos

EXACT = ("model.dtype=float32", "train.log_every=1", "train.steps=60", "train.checkpoint_every=10")


def run_flow(root: Path, name: str, *overrides: str):
    from flows.pipeline import tpu_training_pipeline

    return tpu_training_pipeline(config=tiny_config(root, f"run_name={name}", *EXACT, *overrides))


def attempts_of(run_dir: Path) -> list[list[dict]]:
    """Metrics rows split per attempt (each attempt's first row says where it resumed)."""
    attempts: list[list[dict]] = []
    for row in RunDir(run_dir).read_metrics():
        if "resumed_from" in row:
            attempts.append([])
        attempts[-1].append(row)
    return attempts


@pytest.fixture(scope="module")
def reference(tmp_path_factory, prefect_harness):
    root = tmp_path_factory.mktemp("chaos")
    return root, run_flow(root, "reference")


@pytest.mark.parametrize(
    ("sig", "trigger", "max_lost"),
    [
        ("TERM", "at_step", 0),  # a preemption notice: the workload saves first
        # A hard loss goes back to the last committed checkpoint: at most checkpoint_every
        # steps, even while a newer save is still being written.
        ("KILL", "at_step", 10),
        ("KILL", "during_save", 10),
    ],
)
def test_preempted_runs_finish_with_the_uninterrupted_parameters(reference, sig, trigger, max_lost):
    root, ref = reference
    rng = random.Random(f"{sig}-{trigger}")
    chaos = [f"slice.chaos.signal={sig}", "slice.chaos.times=2"]
    if trigger == "at_step":
        chaos.append(f"slice.chaos.at_step={rng.randint(3, 25)}")
    else:  # keeping 2, the oldest is deleted before the save: one complete one is left
        chaos += ["slice.chaos.during_save=true", "train.keep_checkpoints=2"]
    run = run_flow(root, f"{sig.lower()}-{trigger.replace('_', '-')}", *chaos)

    assert run.status == "completed" and run.final_step == 60
    assert run.params_sha256 == ref.params_sha256  # as if nothing had happened
    assert (run.attempts, run.preemptions) == (3, 2)
    attempts = attempts_of(Path(run.run_dir))
    assert len(attempts) == 3
    for before, after in itertools.pairwise(attempts):
        lost = max(r["step"] for r in before) - after[0]["resumed_from"]
        assert 0 <= lost <= max_lost, (before[-1], after[0])
    assert 0 < run.goodput < 1 and run.lost_s >= 0


def test_a_step_trigger_fires_however_rarely_the_run_logs(reference):
    # The monkey reads the step from status.json; with log and checkpoint steps further
    # apart than the run is long, it never saw step 5 and the run finished unhit, its hit
    # counted all the same.
    root, ref = reference
    rare = ("train.log_every=1000", "train.checkpoint_every=1000")
    chaos = ("slice.chaos.times=1", "slice.chaos.at_step=5", *rare)
    run = run_flow(root, "rare-logs", *chaos)
    assert run.status == "completed" and run.params_sha256 == ref.params_sha256
    assert (run.attempts, run.preemptions) == (2, 1)
    _, second = attempts_of(Path(run.run_dir))
    assert 5 <= second[0]["resumed_from"] <= 15  # saved at the notice, soon after step 5


def test_capacity_errors_back_off_then_succeed_with_one_slice(reference):
    root, ref = reference
    run = run_flow(root, "no-capacity", "slice.chaos.fail_creates=2", "resilience.backoff_s=0.2")
    assert run.status == "completed" and run.params_sha256 == ref.params_sha256
    events = [e for e in read_events(Path(run.run_dir) / "events.jsonl")]
    kinds = [e["event"] for e in events if e["source"] == "orchestrator"]
    assert kinds[:5] == [
        "provision_requested",
        "provision_failed",
        "provision_requested",
        "provision_failed",
        "provision_requested",
    ]
    failed = [e["time"] for e in events if e["event"] == "provision_failed"]
    retried = [e["time"] for e in events if e["event"] == "provision_requested"][1:]
    # Backed off: exponential from backoff_s, with Prefect's jitter of up to ±50% around it.
    gaps = [r - f for f, r in zip(failed, retried, strict=True)]
    assert gaps[0] >= 0.2 * 0.5 and gaps[1] >= 0.4 * 0.5, gaps
    assert run.attempts == 1 and run.preemptions == 0
    assert build_provider("local", str(root)).list({"run-id": "no-capacity"}) == []


def test_capacity_errors_beyond_the_budget_fail_naming_it(reference):
    from infra.slices import ProvisioningError

    root, _ = reference
    overrides = ["slice.chaos.fail_creates=2", "resilience.max_failures=1"]
    spent = r"max_failures = 1 retries of a failed create, all used"
    with pytest.raises(ProvisioningError, match=spent):
        run_flow(root, "never-capacity", *overrides, "resilience.backoff_s=0.1")
    assert build_provider("local", str(root)).list({"run-id": "never-capacity"}) == []


def _orchestrator(tmp_path: Path, name: str, steps: int = 100_000) -> subprocess.Popen:
    """`tpupipe run` of a tiny run (long by default), in a session of its own with its
    ephemeral API server (as on a user's laptop); returns once the workload is training."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home")}
    env.pop("PREFECT_API_URL", None)
    overrides = [f"storage.root={tmp_path}", f"run_name={name}", f"train.steps={steps}"]
    command = [
        sys.executable,
        "-m",
        "flows.cli",
        "run",
        "--config",
        str(REPO / "configs/tiny.yaml"),
    ]
    orchestrator = subprocess.Popen(
        [*command, *(arg for o in overrides for arg in ("--set", o))],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / f"{name}.stderr").open("wb"),
        start_new_session=True,
    )
    status = tmp_path / "runs" / name / "status.json"
    deadline = time.monotonic() + 240
    while not (status.exists() and json.loads(status.read_text()).get("phase") == "training"):
        if time.monotonic() > deadline or orchestrator.poll() is not None:
            os.killpg(orchestrator.pid, signal.SIGKILL)
            raise AssertionError("never trained")
        time.sleep(0.2)
    return orchestrator


def test_a_killed_orchestrator_leaves_a_slice_that_one_reaper_run_deletes(
    tmp_path, prefect_harness
):
    orchestrator = _orchestrator(tmp_path, "orphan")
    try:
        _kill_the_orchestrator_then_reap(orchestrator, tmp_path)
    finally:
        # The slice runs in a process group of its own, which this does not touch.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(orchestrator.pid, signal.SIGKILL)


def _kill_the_orchestrator_then_reap(orchestrator: subprocess.Popen, tmp_path: Path) -> None:
    from flows.reaper import reap_orphans

    servers = _api_servers(orchestrator.pid)
    orchestrator.send_signal(signal.SIGKILL)  # no finally, no hooks: only the reaper is left
    orchestrator.wait()
    # Its temporary API server goes with it (it was left running with no parent).
    deadline = time.monotonic() + 30
    while [pid for pid in servers if Path(f"/proc/{pid}").exists()]:
        assert time.monotonic() < deadline, "the API server outlived a killed run"
        time.sleep(0.1)
    config_path = str(tmp_path / "runs" / "orphan" / "config.json")
    assert processes_mentioning(config_path), "the slice should have outlived its orchestrator"

    config = tiny_config(tmp_path)
    reaped = reap_orphans(config=config)
    assert [name for name, _ in reaped] == ["tpupipe-orphan"]
    assert build_provider("local", str(tmp_path)).list() == []
    deadline = time.monotonic() + 30
    while processes_mentioning(config_path):
        assert time.monotonic() < deadline, "slice processes survived the reaper"
        time.sleep(0.1)
    assert reap_orphans(config=config) == []  # idempotent
    # The deletion is the killed attempt's, billed until then, and recorded once.
    events = read_events(str(tmp_path / "runs" / "orphan" / "events.jsonl"))
    (left,) = [e for e in events if e["event"] == "leftover_deleted"]
    assert (left["attempt"], left["name"], left["state"]) == (1, "tpupipe-orphan", "READY")


def _api_servers(pid: int) -> list[int]:
    """Live `prefect server` processes started by `pid` (its slice's processes are not)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if stat[1] == str(pid) and stat[0] != "Z" and b"prefect\0server" in cmdline:
            found.append(int(entry))
    return found


def _flow_run_states(prefect_home: Path) -> list[str]:
    import sqlite3

    with contextlib.closing(sqlite3.connect(prefect_home / "prefect.db")) as db:
        return [row[0] for row in db.execute("SELECT state_type FROM flow_run")]


@pytest.mark.parametrize(
    ("group", "sig"),
    [
        (False, signal.SIGTERM),
        (True, signal.SIGTERM),
        (True, signal.SIGINT),
        (False, signal.SIGHUP),
    ],
    ids=["sigterm", "sigterm-to-group", "sigint-to-group", "sighup"],
)
def test_a_signal_ends_the_run_its_slice_and_its_api_server(tmp_path, prefect_harness, group, sig):
    # What docker stop, systemd, Kubernetes and CI time-outs send. The orchestrator once
    # died of a SIGTERM at once and left its temporary Prefect server running with no
    # parent. Ctrl-C in a terminal (SIGINT), systemd, `timeout` and CI time-outs signal
    # every process of the group: Prefect's own temporary server, a child in that group,
    # died at once, so the flow run stayed Running, and a SIGTERM ended the run with exit
    # 1 ("ConnectError: Connection refused") about 135 s later instead of 143. A closed
    # terminal or SSH session (SIGHUP) killed it at once: no teardown, no runs row, the
    # workload trained on until a reaper found its slice.
    name = f"{'group-' if group else ''}{sig.name.lower()}"
    orchestrator = _orchestrator(tmp_path, name)
    try:
        servers = _api_servers(orchestrator.pid)
        assert servers, "no API server started by the run"
        if group:
            os.killpg(orchestrator.pid, sig)
        else:
            orchestrator.send_signal(sig)
        code = orchestrator.wait(timeout=90)
        assert code == (-sig if sig == signal.SIGINT else 128 + sig)
        assert _flow_run_states(tmp_path / "prefect-home") == ["CRASHED"]
        config_path = str(tmp_path / "runs" / name / "config.json")
        deadline = time.monotonic() + 30
        while processes_mentioning(config_path):
            assert time.monotonic() < deadline, "the slice outlived the run"
            time.sleep(0.1)
        while [pid for pid in servers if Path(f"/proc/{pid}").exists()]:
            assert time.monotonic() < deadline, "the API server outlived the run"
            time.sleep(0.1)
        assert build_provider("local", str(tmp_path)).list() == []
        sink = DuckDBSink(str(tmp_path / "metrics.duckdb"))
        ((status, error),) = sink.query(f"SELECT status, error FROM runs WHERE run_id = '{name}'")
        said = "KeyboardInterrupt" if sig == signal.SIGINT else sig.name
        assert status == "failed" and said in error, error
        # Its attempt was stopped, not failed ("TerminationSignal: ", said no more).
        events = read_events(str(tmp_path / "runs" / name / "events.jsonl"))
        (ended,) = [e for e in events if e["event"] == "attempt_ended"]
        assert ended["outcome"] == "stopped" and said in ended["reason"], ended
        if sig == signal.SIGINT:  # one line, not the traceback of where it landed
            told = (tmp_path / f"{name}.stderr").read_text().rstrip().splitlines()
            assert told[-1] == f"run {name} stopped by Ctrl-C; run it again to resume it"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(orchestrator.pid, signal.SIGKILL)
        # A slice the run failed to delete is in a group of its own: not left training.
        for pid in processes_mentioning(str(tmp_path / "runs" / name / "config.json")):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_run_whose_api_server_is_killed_completes_and_lands_completed(tmp_path, prefect_harness):
    # The OOM killer or a stray kill may take the run's temporary Prefect server. The run
    # then trained on blind: its end was noticed ~70 s late (each Prefect call retried a
    # vanished server), publishing its summary failed, and a completed run was landed as
    # failed. The server is started again on the same port and database.
    orchestrator = _orchestrator(tmp_path, "lost-api", steps=400)
    try:
        (server,) = _api_servers(orchestrator.pid)
        os.kill(server, signal.SIGKILL)
        assert orchestrator.wait(timeout=240) == 0
        assert _flow_run_states(tmp_path / "prefect-home") == ["COMPLETED"]
        sink = DuckDBSink(str(tmp_path / "metrics.duckdb"))
        ((status, steps),) = sink.query(
            "SELECT status, final_step FROM runs WHERE run_id = 'lost-api'"
        )
        assert (status, steps) == ("completed", 400)
        deadline = time.monotonic() + 30
        while _api_servers(orchestrator.pid):  # the second server stopped with the run
            assert time.monotonic() < deadline, "the restarted API server outlived the run"
            time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(orchestrator.pid, signal.SIGKILL)


def test_a_truncated_newest_checkpoint_is_quarantined_and_the_run_resumes(reference):
    from tasks.watch import WorkloadPreempted

    root, ref = reference
    name = "truncated"
    # An attempt preempted with no retry budget left: the run stops after saving a step.
    with pytest.raises(WorkloadPreempted):
        run_flow(
            root,
            name,
            "slice.chaos.times=1",
            "slice.chaos.at_step=25",
            "resilience.max_preemptions=0",
        )
    checkpoints = root / "runs" / name / "checkpoints"
    newest = max(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    cut_checkpoint_data(checkpoints / str(newest) / "state")

    run = run_flow(root, name)  # the same run, resumed
    assert run.status == "completed" and run.params_sha256 == ref.params_sha256
    (moved,) = (root / "runs" / name / "quarantine").iterdir()
    assert moved.name.startswith(f"{newest}-")
    events = read_events(Path(run.run_dir) / "events.jsonl")
    restored = [e for e in events if e["event"] == "restored"]
    assert restored[-1]["step"] < newest  # resumed from the checkpoint before the bad one
    # Its heartbeat says so, for the orchestrator's console (`tasks.watch._log_start`).
    assert RunDir(run.run_dir).read_status()["resumed_from"] == restored[-1]["step"]
    # The ledger says why, not only the slice log and QUARANTINED.txt.
    (quarantined,) = [e for e in events if e["event"] == "quarantined"]
    assert quarantined["step"] == newest and "does not restore" in quarantined["reason"]
    assert quarantined["attempt"] == restored[-1]["attempt"]
