"""One orchestrator per run name: a second one stops before it provisions anything."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from infra.slices import build_provider
from tasks import run_lock
from tasks.plan import plan_run
from tasks.run_lock import RunInUse, lock_path, run_held
from tests.helpers import REPO, tiny_config

HOLDER = """
import sys, time
from tasks.plan import plan_run
from tasks.run_lock import run_held
from tests.helpers import tiny_config

config = tiny_config(sys.argv[1], "run_name=busy")
with run_held(plan_run(config), config):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_held_run_refuses_a_second_orchestrator_and_names_the_first(tmp_path):
    config = tiny_config(tmp_path, "run_name=busy")
    plan = plan_run(config)
    with run_held(plan, config):
        with (
            pytest.raises(RunInUse, match=rf"run 'busy' is .*pid {os.getpid()} on "),
            run_held(plan, config),
        ):
            pass
        other = tiny_config(tmp_path, "run_name=other")
        with run_held(plan_run(other), other):
            pass  # another run name is another lock
    with run_held(plan, config):  # released on exit
        pass


def test_a_killed_holder_never_blocks_the_rerun(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        config = tiny_config(tmp_path, "run_name=busy")
        plan = plan_run(config)
        with pytest.raises(RunInUse, match=f"pid {holder.pid} "), run_held(plan, config):
            pass
    finally:
        holder.send_signal(signal.SIGKILL)  # no clean-up: the kernel drops the flock
        holder.wait()
        holder.stdout.close()
    with run_held(plan, config):
        assert lock_path(plan).exists()


def test_tpupipe_run_of_a_run_being_run_exits_2_before_provisioning(
    tmp_path, prefect_harness, capsys
):
    from flows.cli import main

    config = REPO / "configs" / "tiny.yaml"
    held = tiny_config(tmp_path, "run_name=busy")
    with run_held(plan_run(held), held):
        args = ["--set", f"storage.root={tmp_path}", "--set", "run_name=busy"]
        code = main(["run", "--config", str(config), *args])
    assert code == 2
    assert "being run by another orchestrator" in capsys.readouterr().err
    assert build_provider("local", str(tmp_path)).list() == []  # nothing was created
    assert not (tmp_path / "runs" / "busy" / "config.json").exists()  # nor sharded for it
    assert not (tmp_path / "metrics.duckdb").exists()  # and no `runs` row was landed


def test_a_gs_run_is_held_whatever_directory_its_orchestrator_started_in(tmp_path, monkeypatch):
    # Its lock was under ./.tpupipe: started from two directories, two orchestrators ran
    # one gs:// run at once, the second took the first's run over and the first failed.
    # The lock object in the bucket is tried against the emulator (tests/emulator/
    # test_gcs_lock.py); here only this machine's lock, which is taken first.
    monkeypatch.setattr(run_lock, "_held_in_bucket", lambda *args: contextlib.nullcontext())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    configs, plans = [], []
    for cwd in ("a", "b"):
        (tmp_path / cwd).mkdir()
        monkeypatch.chdir(tmp_path / cwd)
        configs.append(tiny_config(tmp_path, "storage.root=gs://bucket/root", "run_name=gx"))
        plans.append(plan_run(configs[-1]))  # its slices_root: under this directory
    assert plans[0].slices_root != plans[1].slices_root  # each its own ./.tpupipe
    busy = "run 'gx' is being run by another orchestrator"
    with (
        run_held(plans[0], configs[0]),
        pytest.raises(RunInUse, match=busy),
        run_held(plans[1], configs[1]),
    ):
        pass
    assert lock_path(plans[1]) == tmp_path / "cache" / "tpupipe" / "locks" / "gx.lock"


def test_a_run_of_the_same_name_under_another_root_never_deletes_the_others_slice(
    tmp_path, monkeypatch
):
    """Two buckets' `nightly` share the slice name `tpupipe-nightly` in one project's zone,
    and the run lock (per machine, per bucket) does not keep two machines apart: the second
    run's attempt deleted the first one's live slice before creating its own."""
    import dataclasses
    import logging

    from infra.slices import SliceSpec, SliceState
    from tasks import training
    from tasks.own_slice import SliceNameTaken
    from tasks.plan import run_events, slice_labels

    monkeypatch.setattr(training, "get_run_logger", lambda: logging.getLogger("test"))
    first = tiny_config(tmp_path / "a", "run_name=nightly")
    second = tiny_config(tmp_path / "b", "run_name=nightly")
    theirs = plan_run(first)
    # Local roots keep their slice registries apart; a gs:// root's is the working
    # directory's, as the provider's zone is for every bucket.
    ours = plan_run(second).model_copy(update={"slices_root": theirs.slices_root})
    provider = build_provider("local", theirs.slices_root, first.slice)
    spec = SliceSpec(
        name=theirs.slice_name,
        labels=slice_labels(theirs),
        devices=1,
        command=[sys.executable, "-c", "import time; time.sleep(60)"],
        log_path=str(tmp_path / "theirs.log"),
    )
    provider.create(spec)
    try:
        with pytest.raises(
            SliceNameTaken,
            match=r"slice 'tpupipe-nightly' \(READY\) belongs to a run of the same name under "
            r"another storage root .*choose another run_name",
        ):
            training.provision_slice.fn(second, ours, "config.json", 1, "lease")
        assert training.teardown_slice.fn(second, ours) is False
        events = run_events(ours, 1)
        training._delete_after(provider, ours, events, logging.getLogger("test"))
        assert provider.status(theirs.slice_name).state is SliceState.READY

        # Its own run deletes it; so does a run whose slice predates the label.
        assert training.teardown_slice.fn(first, theirs) is True
        provider.create(dataclasses.replace(spec, labels={"run-id": "nightly"}))
        assert training.teardown_slice.fn(second, ours) is True
        assert provider.status(theirs.slice_name).state is SliceState.NOT_FOUND
    finally:
        provider.delete(theirs.slice_name, grace_s=0)


def test_a_moved_roots_leftover_slice_is_its_own_to_delete(tmp_path, monkeypatch):
    """A local root's slice registry moves with it, its slices labelled with the old path's
    tag: a run whose orchestrator had been killed was refused on its own leftover ("wait
    for it to end, or choose another run_name") and left it standing at teardown."""
    import logging

    from infra.slices import SliceSpec, SliceState
    from tasks import training
    from tasks.plan import slice_labels
    from tests.helpers import processes_mentioning

    monkeypatch.setattr(training, "get_run_logger", lambda: logging.getLogger("test"))
    before = plan_run(tiny_config(tmp_path / "a", "run_name=moved"))
    marker = f"left-before-the-move-{os.getpid()}"
    build_provider("local", before.slices_root).create(
        SliceSpec(
            name=before.slice_name,
            labels=slice_labels(before, attempt=1),
            devices=1,
            command=[sys.executable, "-c", "import time; time.sleep(60)", marker],
            log_path=str(tmp_path / "left.log"),
        )
    )
    (tmp_path / "a").rename(tmp_path / "b")
    config = tiny_config(tmp_path / "b", "run_name=moved")
    plan = plan_run(config)
    provider = build_provider("local", plan.slices_root)
    try:
        assert provider.status(plan.slice_name).state is SliceState.READY
        training.clear_slice_name(provider, plan, 2)  # no SliceNameTaken: ours
        assert provider.status(plan.slice_name).state is SliceState.NOT_FOUND
        assert not processes_mentioning(marker)
    finally:
        provider.delete(plan.slice_name, grace_s=0)


def test_a_run_whose_workload_runs_by_hand_is_refused_until_it_ends(tmp_path):
    from workloads.rundir import RunDir

    config = tiny_config(tmp_path, "run_name=busy")
    plan = plan_run(config)
    with run_held(plan, config):  # no run directory yet: nothing runs it
        pass
    os.makedirs(plan.run_dir)
    heartbeat = RunDir(plan.run_dir)
    # `python -m workloads.train` by hand: attempt null, this process (alive) beating now.
    heartbeat.write_status("training", attempt=None, step=12)
    hand = r"run 'busy' is being trained by a workload started by hand .*'training' at step 12"
    with pytest.raises(RunInUse, match=hand), run_held(plan, config):
        pass
    with pytest.raises(RunInUse, match=hand), run_held(plan, config):
        pass
    # An attempt of the pipeline's own (its lease fences it), or a hand run that ended: free.
    for phase, attempt in (("training", 4), ("finished", None)):
        heartbeat.write_status(phase, attempt=attempt, step=12)
        with run_held(plan, config):
            pass
