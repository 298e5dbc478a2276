"""A run name that landed from another run directory is refused before anything is
sharded or provisioned (tasks/run_owner.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from flows.cli import main as cli_main
from infra.metrics import DuckDBSink, RunRow
from tasks.plan import plan_run
from tasks.run_owner import check_run_owner, earlier_life
from tests.helpers import REPO, tiny_config
from workloads.config_file import ConfigError


def _land(path, run_dir: str, name: str = "tiny") -> None:
    DuckDBSink(path).land(
        RunRow(
            run_id=name,
            run_name=name,
            status="completed",
            config_hash="h",
            config_json="{}",
            dataset_fingerprint="fp",
            started_at=datetime(2026, 11, 26, tzinfo=UTC),
            final_step=30,
            run_dir=run_dir,
        ),
        [],
        [],
    )


def test_a_run_name_landed_from_another_run_directory_is_refused(tmp_path, capsys):
    # Two runs of one name in two storage roots landing in one file replaced and mixed
    # each other's rows: the second kept the first's started_at and its later step rows.
    shared = tmp_path / "shared.duckdb"
    _land(shared, "/elsewhere/runs/tiny")
    config = tiny_config(tmp_path / "root", f"metrics.path={shared}")
    plan = plan_run(config)
    with pytest.raises(ConfigError) as err:
        check_run_owner(config, plan)
    message = str(err.value)
    assert "run_name = 'tiny'" in message and "/elsewhere/runs/tiny" in message
    assert f"metrics.path {shared}" in message and plan.run_dir in message
    args = ["validate", "--config", str(REPO / "configs" / "tiny.yaml")]
    args += ["--set", f"storage.root={tmp_path / 'root'}", "--set", f"metrics.path={shared}"]
    assert cli_main(args) == 2
    assert "/elsewhere/runs/tiny" in capsys.readouterr().err


def test_the_same_run_and_a_name_not_landed_pass(tmp_path):
    shared = tmp_path / "shared.duckdb"
    config = tiny_config(tmp_path / "root", f"metrics.path={shared}")
    plan = plan_run(config)
    check_run_owner(config, plan)  # nothing landed: the file is not created to look
    assert not shared.exists()
    _land(shared, plan.run_dir)  # a rerun of this run
    check_run_owner(config, plan)
    other = tiny_config(tmp_path / "root", f"metrics.path={shared}", "run_name=other")
    check_run_owner(other, plan_run(other))


def test_the_same_run_reached_through_a_symlinked_root_passes(tmp_path):
    # Landed from the real root, refused through a link to it as "another run directory".
    shared = tmp_path / "shared.duckdb"
    config = tiny_config(tmp_path / "root", f"metrics.path={shared}")
    plan = plan_run(config)
    (tmp_path / "root" / "runs" / "tiny").mkdir(parents=True)
    _land(shared, plan.run_dir)
    (tmp_path / "link").symlink_to(tmp_path / "root")
    linked = tiny_config(tmp_path / "link", f"metrics.path={shared}")
    check_run_owner(linked, plan_run(linked))
    (tmp_path / "root" / "runs" / "tiny").rmdir()  # gone: by where the link leads
    check_run_owner(linked, plan_run(linked))
    (tmp_path / "other").mkdir()
    elsewhere = tiny_config(tmp_path / "other", f"metrics.path={shared}")
    with pytest.raises(ConfigError, match="from another run directory"):
        check_run_owner(elsewhere, plan_run(elsewhere))


def test_a_sweep_is_refused_before_any_trial_when_a_trial_landed_from_elsewhere(tmp_path):
    # A sweep of the same name from another storage root: each trial was refused at its
    # start, and the sweep then replaced the other sweep's `sweeps` rows with failed ones.
    from tasks.sweep_plan import check_trials
    from tasks.sweep_space import SearchSpace, SweepConfig
    from tasks.sweep_trials import build_trials

    shared = tmp_path / "shared.duckdb"
    base = tiny_config(tmp_path / "root", f"metrics.path={shared}")
    trials = build_trials(SweepConfig(base=base, space=SearchSpace(grid={"seed": [1, 2]})), "sw")
    check_trials(trials, local_inputs=True)
    _land(shared, "/elsewhere/runs/sw-t01", name="sw-t01")
    with pytest.raises(ConfigError) as err:
        check_trials(trials, local_inputs=True)
    assert "trial 1 (seed=2): run_name = 'sw-t01'" in str(err.value)
    assert "/elsewhere/runs/sw-t01" in str(err.value) and "trial 0" not in str(err.value)
    # Deployed trials land from their worker, whose metrics file is not this one.
    check_trials(trials, local_inputs=False)


def test_a_row_of_an_earlier_run_whose_directory_was_deleted_is_told_apart(tmp_path):
    # `rm -rf runs/x1` and the name run again: the row still names runs/x1, but its flow
    # run is in no event of the new directory, which starts after that run ended. Its
    # landing replaced all but started_at, and a failed one kept the old run's results.
    from workloads.events import EventLog

    config = tiny_config(tmp_path, "run_name=x1")
    plan = plan_run(config, "flow-new")
    Path(plan.run_dir).mkdir(parents=True)
    ended = datetime.now(UTC) - timedelta(hours=1)
    row = RunRow(
        run_id="x1",
        run_name="x1",
        status="completed",
        config_hash="h",
        config_json="{}",
        dataset_fingerprint="fp",
        started_at=ended - timedelta(minutes=5),
        finished_at=ended,
        run_dir=plan.run_dir,
        flow_run_id="flow-old",
        attempts=1,
    )
    # No event yet (the new run stopped while sharding: its first landing): the row's run
    # had attempts, so its ledger is gone with its directory...
    assert earlier_life(plan, row)
    # ...unless the directory still holds the run's config.json: only the ledger was lost.
    (Path(plan.run_dir) / "config.json").write_text("{}")
    assert not earlier_life(plan, row)
    (Path(plan.run_dir) / "config.json").unlink()
    EventLog(plan.run_dir, 1, source="orchestrator", invocation="flow-new").emit(
        "provision_requested"
    )
    assert earlier_life(plan, row)
    assert earlier_life(plan, row.model_copy(update={"finished_at": None}))
    # The same run: its directory holds the flow run that landed the row...
    assert not earlier_life(plan, row.model_copy(update={"flow_run_id": "flow-new"}))
    # ...or events from before it ended (an older version's, with no flow run).
    old = row.model_copy(update={"finished_at": datetime.now(UTC) + timedelta(hours=1)})
    assert not earlier_life(plan, old)
    # Another directory's row is `owner_problem`'s to refuse, a row without a flow run
    # (landed by an older version) is taken as this run's.
    assert not earlier_life(plan, row.model_copy(update={"run_dir": str(tmp_path / "other")}))
    assert not earlier_life(plan, row.model_copy(update={"flow_run_id": None}))
    # An invocation stopped before it provisioned (while sharding, before this directory
    # existed) is the same run's first: its start stays the row's.
    assert not earlier_life(plan, row.model_copy(update={"attempts": 0}))
