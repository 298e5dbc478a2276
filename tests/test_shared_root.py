"""A storage root a group shares: what a teammate's run left that a run writes in place
(lock files, the DuckDB file, the run's ledger, logs and checkpoints, JAX's cache lock) is
refused before anything runs, naming its owner and mode; lock files honour the umask; and
the checks disturb nothing a live run holds (`tasks.shared_root`)."""

from __future__ import annotations

import os
import stat

import pytest

from flows.cli import main as cli_main
from infra.metrics import DuckDBSink
from tasks.plan import plan_run
from tasks.prepare import check_local_paths
from tasks.run_lock import run_held
from tests.helpers import REPO, immutable, tiny_config

TINY = str(REPO / "configs" / "tiny.yaml")


def test_a_run_lock_or_metrics_file_this_user_cannot_write_is_refused(
    tmp_path, capsys, monkeypatch
):
    # /tmp/s34/probeB/repros/r1_run_lock_mode.sh, r3_metrics_readonly.sh: a teammate's
    # lock file (mode 0644) passed validate and failed every rerun with a traceback; a
    # metrics file readable but not writable failed at landing, after the whole run.
    root = tmp_path / "root"
    args = ["validate", "--config", TINY, "--set", f"storage.root={root}"]
    config = tiny_config(root)
    with run_held(plan_run(config), config):  # made as a run makes it
        pass
    lock = root / "locks" / "tiny.lock"
    with immutable(lock):
        assert cli_main(args) == 2
        err = capsys.readouterr().err
        assert f"{lock} cannot be written (owner root, mode -rw-r--r--): " in err, err
        # Root may write by that mode: the advice is about what else stops it, not the
        # umask its owner (root itself) had (it was, before).
        assert "its mode allows writing: an immutable attribute (see lsattr)" in err, err
        assert "umask" not in err
        assert err.rstrip().endswith("lift that, or choose another run_name")
        # Another user, whom the mode does not let write: the umask advice.
        with monkeypatch.context() as patch:
            patch.setattr(os, "geteuid", lambda: 4242)
            assert cli_main(args) == 2
        err = capsys.readouterr().err
        assert "a group sharing a storage root needs umask 002" in err, err
        assert err.rstrip().endswith("or choose another run_name")
    assert cli_main(args) == 0
    DuckDBSink(root / "metrics.duckdb").ensure_tables()
    with immutable(root / "metrics.duckdb"):
        assert cli_main(args) == 2
        err = capsys.readouterr().err
        assert (
            f"storage.root = {str(root)!r}: {root}/metrics.duckdb cannot be written (owner" in err
        )
    assert cli_main(args) == 0


def test_lock_files_honour_the_umask_so_a_group_can_share_a_root(tmp_path):
    # Made 0644 whatever the umask, a run's lock and a dataset's lock let only their
    # creator run that run again or build in that datasets directory.
    from workloads.outdir import claimed

    config = tiny_config(tmp_path)
    before = os.umask(0o002)
    try:
        with run_held(plan_run(config), config), claimed(tmp_path / "datasets" / "d"):
            pass
    finally:
        os.umask(before)
    for lock in (tmp_path / "locks" / "tiny.lock", tmp_path / "datasets" / "d" / ".lock"):
        assert stat.S_IMODE(lock.stat().st_mode) == 0o664, lock


@pytest.mark.parametrize(
    "made, blocked",
    [
        ("slices/.lock", "slices/.lock"),
        ("metrics.duckdb.wal", "metrics.duckdb.wal"),
        ("compile_cache/.lockfile", "compile_cache/.lockfile"),
        ("runs/tiny/events.jsonl", "runs/tiny/events.jsonl"),
        ("runs/tiny/checkpoints/4/", "runs/tiny/checkpoints/4"),
    ],
    ids=["slice-registry-lock", "duckdb-wal", "jax-cache-lock", "ledger", "checkpoint-step"],
)
def test_what_a_teammate_left_that_a_run_writes_in_place_is_refused(
    tmp_path, capsys, monkeypatch, made, blocked
):
    # /tmp/s34/probeD/repros: each, made by a teammate with umask 022, passed validate and
    # failed the run with a traceback: at provisioning (the registry's lock), at landing
    # after training (the WAL), at the first save of a resume (a checkpoint step it
    # deleted); JAX's cache lock made every program compile again, said only in a log.
    monkeypatch.delenv("TPUPIPE_COMPILE_CACHE")
    root = tmp_path / "root"
    path = root / made
    path.parent.mkdir(parents=True, exist_ok=True)
    if made == "metrics.duckdb.wal":  # a log lives beside its database (alone, it is refused)
        DuckDBSink(root / "metrics.duckdb").ensure_tables()
    path.mkdir() if made.endswith("/") else path.write_text("")
    args = ["validate", "--config", TINY, "--set", f"storage.root={root}"]
    with immutable(path):
        assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert f"{root}/{blocked} cannot be written (owner root, mode " in err, err
    assert "an immutable attribute (see lsattr) or a security policy stops it; lift" in err
    assert cli_main(args) == 0


def test_the_checks_leave_a_metrics_file_this_process_holds_locked(tmp_path):
    # /tmp/s34/probeE/work/posix_lock2.py: a trial of a sweep validating (a thread) while
    # another lands (this process's connection): the checks' open and close of the DuckDB
    # file dropped DuckDB's lock, and another process wrote the file under it, rows lost.
    import subprocess
    import sys
    import threading
    import time

    import duckdb

    from infra.metrics.duckdb_file import file_lock

    config = tiny_config(tmp_path)
    path = plan_run(config).metrics_path
    DuckDBSink(path).ensure_tables()
    code = "import duckdb, sys; duckdb.connect(sys.argv[1]).close()"
    validating = threading.Thread(target=check_local_paths, args=(config, plan_run(config)))
    with file_lock(path):  # as DuckDBSink holds it while landing
        held = duckdb.connect(path)
        validating.start()
        time.sleep(1.0)  # the check, unlocked, was done by now
        other = subprocess.run(
            [sys.executable, "-c", code, path], capture_output=True, text=True, timeout=60
        )
        held.close()
    validating.join(timeout=60)
    assert other.returncode != 0 and "Conflicting lock is held" in other.stderr, other.stderr


def test_a_directory_its_mode_lets_this_user_write_says_what_else_stops_it(
    tmp_path, capsys, monkeypatch
):
    # Root, refused an immutable compile cache, was told "not writable (owner root, mode
    # drwxr-xr-x)": a mode that says the opposite.
    monkeypatch.delenv("TPUPIPE_COMPILE_CACHE")
    root = tmp_path / "root"
    (root / "compile_cache").mkdir(parents=True)
    args = ["validate", "--config", TINY, "--set", f"storage.root={root}"]
    with immutable(root / "compile_cache"):
        assert cli_main(args) == 2
    err = capsys.readouterr().err
    said = f"{root}/compile_cache is not writable (owner root, mode drwxr-xr-x); its mode "
    assert said + "allows writing: an immutable attribute (see lsattr)" in err, err
    assert cli_main(args) == 0
