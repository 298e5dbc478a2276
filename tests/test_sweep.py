"""Sweeps: the search space, ranking and landing (unit), and a real sweep of four tiny
trials under a chip limit of two trials' worth (integration)."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from infra.metrics import DuckDBSink, RunRow, SweepRow
from tasks.sweep import SweepError, SweepPlan, TrialResult, ensure_chip_limit
from tasks.sweep_results import (
    SweepFailed,
    leaderboard,
    leaderboard_description,
    ranks,
    summarize,
    sweep_rows,
)
from tasks.sweep_space import Distribution, SearchSpace, SweepConfig, expand_space
from tasks.sweep_trials import build_trials
from tests.helpers import tiny_config
from workloads.config import CostConfig, PipelineConfig
from workloads.config_file import ConfigError

T0 = datetime(2026, 11, 22, 6, 0, tzinfo=UTC)


def test_grid_is_every_combination_in_order():
    space = SearchSpace(grid={"train.learning_rate": [0.1, 0.2], "seed": [0, 1, 2]})
    assert expand_space(space) == [
        {"train.learning_rate": lr, "seed": s} for lr in (0.1, 0.2) for s in (0, 1, 2)
    ]


def test_random_draws_are_seeded_and_within_bounds():
    space = SearchSpace(
        grid={"seed": [0, 1]},
        random={
            "train.learning_rate": Distribution(kind="log_uniform", low=1e-4, high=1e-1),
            "model.n_layers": Distribution(kind="int_uniform", low=1, high=3),
            "model.dtype": Distribution(kind="choice", values=["float32", "bfloat16"]),
        },
        samples=5,
        seed=7,
    )
    trials = expand_space(space)
    assert len(trials) == 10 and [t["seed"] for t in trials] == [0] * 5 + [1] * 5
    assert trials == expand_space(space)  # same seed, same trials
    assert trials != expand_space(space.model_copy(update={"seed": 8}))
    assert all(1e-4 <= t["train.learning_rate"] <= 1e-1 for t in trials)
    assert {t["model.n_layers"] for t in trials} <= {1, 2, 3}
    assert len({t["train.learning_rate"] for t in trials}) == 10


def test_every_trial_is_validated_before_any_runs(tmp_path):
    config = SweepConfig(
        base=tiny_config(tmp_path),
        space=SearchSpace(grid={"train.batch_size": [16, 30], "train.steps": [5]}),
    )
    with pytest.raises(ConfigError) as err:
        build_trials(config, "sw")
    # Only the bad point is reported, with its overrides and the rule it breaks.
    assert "trial 1 (train.batch_size=30, train.steps=5)" in str(err.value)
    assert "mesh.data*mesh.fsdp" in str(err.value) and "trial 0" not in str(err.value)
    with pytest.raises(ConfigError, match=r"train\.stepz: Extra inputs"):
        build_trials(
            config.model_copy(update={"space": SearchSpace(grid={"train.stepz": [1]})}), "sw"
        )


def test_trials_get_their_own_run_names_and_chip_counts(tmp_path):
    config = SweepConfig(
        base=tiny_config(tmp_path, "run_name=ignored"),
        space=SearchSpace(grid={"seed": [3, 4]}),
    )
    trials = build_trials(config, "sw")
    assert [(t.run_name, t.config.run_name, t.config.seed, t.chips) for t in trials] == [
        ("sw-t00", "sw-t00", 3, 8),
        ("sw-t01", "sw-t01", 4, 8),
    ]


def test_a_base_mesh_axis_of_minus_one_fills_each_trials_devices(tmp_path):
    base = tiny_config(tmp_path, "mesh.data=-1", "mesh.fsdp=1", "mesh.tensor=1")
    assert base.mesh.data == 8  # resolved for the base's own 8 devices
    grid = {"slice.devices": [1, 2, 4]}
    trials = build_trials(SweepConfig(base=base, space=SearchSpace(grid=grid)), "sw")
    assert [(t.config.mesh.data, t.chips) for t in trials] == [(1, 1), (2, 2), (4, 4)]
    # A trial that sets the axis itself keeps it, and a -1 the devices do not fit is named.
    grid = {"slice.devices": [4], "mesh.data": [2], "mesh.fsdp": [2]}
    (trial,) = build_trials(SweepConfig(base=base, space=SearchSpace(grid=grid)), "sw")
    assert (trial.config.mesh.data, trial.config.mesh.fsdp) == (2, 2)
    grid = {"slice.devices": [4], "mesh.fsdp": [3]}
    with pytest.raises(ConfigError, match=r"mesh\.data = -1: slice\.devices = 4 is not divisible"):
        build_trials(SweepConfig(base=base, space=SearchSpace(grid=grid)), "sw")
    # A base given with every axis set is taken as it is.
    fixed = tiny_config(tmp_path, "mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1")
    with pytest.raises(ConfigError, match=r"8\*1\*1 = 8 does not equal slice\.devices = 2"):
        build_trials(SweepConfig(base=fixed, space=SearchSpace(grid={"slice.devices": [2]})), "sw")


def test_a_trial_fills_in_again_what_its_base_s_sections_filled_in(tmp_path):
    # Built on the validated base, every trial of a size sweep trained tiny's dimensions,
    # and a trial on the user's own corpus read it with the stdlib corpus's lenient
    # `errors: replace`. As a file gives it, and as a deployment's JSON parameter does
    # (every field, the filled-in ones too):
    written = {"model": {"size": "tiny"}, "storage": {"root": str(tmp_path)}}
    as_file = PipelineConfig.model_validate(written)
    as_json = PipelineConfig.model_validate(as_file.model_dump(mode="json"))
    grid = {"model.size": ["tiny", "small"], "dataset.sources": [["stdlib"], [str(tmp_path)]]}
    for base in (as_file, as_json):
        trials = build_trials(SweepConfig(base=base, space=SearchSpace(grid=grid)), "sw")
        assert [
            (t.config.model.d_model, t.config.model.n_layers, t.config.dataset.errors)
            for t in trials
        ] == [(128, 2, "replace"), (128, 2, "strict"), (512, 4, "replace"), (512, 4, "strict")]
    # A base with no size at all: its default dimensions give way to the trial's size.
    no_size = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    for base in (no_size, PipelineConfig.model_validate(no_size.model_dump(mode="json"))):
        space = SearchSpace(grid={"model.size": ["small"]})
        (trial,) = build_trials(SweepConfig(base=base, space=space), "sw")
        assert (trial.config.model.d_model, trial.config.model.n_layers) == (512, 4)
    # What the base gives itself stays, for every trial: in its file, or set in Python
    # (a first version of this dropped those, and the trials trained the defaults).
    written["model"]["d_model"] = 64
    written["dataset"] = {"errors": "strict"}
    base = PipelineConfig.model_validate(written)
    base.train.grad_clip_norm = 0.5
    base = base.model_copy(
        update={"cost": CostConfig(priced_as="v5litepod-8", region="us-central1")}
    )
    trials = build_trials(SweepConfig(base=base, space=SearchSpace(grid=grid)), "sw")
    assert {
        (t.config.model.d_model, t.config.dataset.errors, t.config.train.grad_clip_norm)
        for t in trials
    } == {(64, "strict", 0.5)}
    assert {t.config.cost.priced_as for t in trials} == {"v5litepod-8"}


def test_a_base_s_shard_workers_reach_every_trial_also_through_json(tmp_path):
    # `dataset.workers` was left out of the config's dump: a sweep whose base set it failed
    # in plan-sweep with a bare KeyError, and a config sent as JSON (a deployed sweep's
    # trials, a deployment's parameter) fell back to the default.
    base = PipelineConfig.model_validate(
        {"dataset": {"workers": 2}, "storage": {"root": str(tmp_path)}}
    )
    assert PipelineConfig.model_validate(base.model_dump(mode="json")).dataset.workers == 2
    space = SearchSpace(grid={"train.learning_rate": [1e-3, 3e-3]})
    trials = build_trials(SweepConfig(base=base, space=space), "sw")
    assert [t.config.dataset.workers for t in trials] == [2, 2]
    # Still no training field: a rerun with other workers resumes the same run, and a
    # sweep over it trains one config twice.
    one = base.dataset.model_copy(update={"workers": 1})
    assert base.model_copy(update={"dataset": one}).config_hash() == base.config_hash()
    space = SearchSpace(grid={"dataset.workers": [1, 2]})
    with pytest.raises(ConfigError, match=r"trials 0 and 1 .* train the same config"):
        build_trials(SweepConfig(base=base, space=space), "sw")


def test_a_sweep_over_tpu_types_gives_each_trial_its_type_s_devices(tmp_path):
    # It was refused: every trial kept the base type's 8 devices, a field the user never set.
    gcp = {"provider": "gcp", "project": "my-project-1", "zone": "us-central1-a"}
    gcp |= {"accelerator_type": "v5litepod-8", "runtime_version": "v2-alpha-tpuv5-lite"}
    gcp |= {"wheel": "gs://my-bucket/tpupipe-0-py3-none-any.whl"}
    base = tiny_config(tmp_path, "mesh.data=-1", "mesh.fsdp=1", "mesh.tensor=1")
    base = PipelineConfig.model_validate(
        {**base.without_fill_ins(), "slice": gcp, "storage": {"root": "gs://my-bucket/root"}}
    )
    grid = {"slice.accelerator_type": ["v5litepod-8", "v5litepod-4", "v5litepod-16"]}
    trials = build_trials(SweepConfig(base=base, space=SearchSpace(grid=grid)), "sw")
    assert [(t.config.slice.devices, t.config.slice.hosts, t.config.mesh.data) for t in trials] == [
        (8, 1, 8),
        (4, 1, 4),
        (16, 4, 16),
    ]


class FakeLimits:
    """The three client calls `ensure_chip_limit` makes, against a dict."""

    def __init__(self, **limits):
        self.limits = dict(limits)

    def upsert_global_concurrency_limit_by_name(self, name, limit):
        self.limits[name] = limit

    def read_global_concurrency_limit_by_name(self, name):
        from types import SimpleNamespace

        from prefect.exceptions import ObjectNotFound

        if name not in self.limits:
            raise ObjectNotFound(http_exc=None)
        return SimpleNamespace(limit=self.limits[name], active=True, active_slots=self.held)

    held = 0


def test_chip_limit_is_created_from_the_quota_or_must_exist():
    client = FakeLimits(shared=64)
    assert ensure_chip_limit("shared", None, 8, client) == 64  # used as it is
    assert ensure_chip_limit("new", 16, 8, client) == 16 and client.limits["new"] == 16
    with pytest.raises(SweepError, match="prefect gcl create missing"):
        ensure_chip_limit("missing", None, 8, client)
    with pytest.raises(SweepError, match=r"needs 32 chips .* holds 16: it would wait forever"):
        ensure_chip_limit("new", None, 32, client)
    # Chips held already (maybe left by a sweep killed outright): said, with the way out.
    warnings: list[str] = []
    assert ensure_chip_limit("new", None, 8, client, warnings.append) == 16
    assert warnings == []
    client.held = 12
    assert ensure_chip_limit("new", None, 8, client, warnings.append) == 16
    assert warnings == [
        "12 of the 16 chips of limit 'new' are held now: by sweeps running, or left by one "
        "killed outright; if none runs, free them with `prefect gcl update new --active-slots 0`"
    ]


def _result(index, status="completed", loss=None, error=None):
    run = None
    if loss is not None:
        run = RunRow(
            run_id=f"sw-t{index:02d}",
            run_name=f"sw-t{index:02d}",
            status="completed",
            config_hash="h",
            config_json="{}",
            dataset_fingerprint="fp",
            started_at=T0,
            eval_loss=loss,
            run_dir="/r",
        )
    return TrialResult(
        index=index,
        run_id=f"sw-t{index:02d}",
        params={"train.learning_rate": index / 10},
        chips=8,
        status=status,
        error=error,
        run=run,
        started_at=T0 + timedelta(minutes=index),
        finished_at=T0 + timedelta(minutes=index + 1),
        waited_s=0.0,
    )


def _plan(tmp_path, sweep_id="sw"):
    return SweepPlan(
        sweep_id=sweep_id,
        trials=[],
        via="subflow",
        trial_deployment="x/y",
        chip_limit="c",
        chips=16,
        objective="eval_loss",
        max_parallel=2,
        base=tiny_config(tmp_path),
    )


def test_leaderboard_ranks_completed_trials_and_lists_failures_last(tmp_path):
    results = [
        _result(0, loss=3.0),
        _result(1, status="failed", error="WorkloadFailed: loss is not finite"),
        _result(2, loss=2.5),
        _result(3, loss=float("nan")),  # landed as NULL: nothing to rank by
        _result(4, loss=3.0),
    ]
    assert ranks(results, "eval_loss") == {2: 1, 0: 2, 4: 3}
    board = leaderboard(results, "eval_loss")
    assert [(r["trial"], r["rank"]) for r in board] == [(2, 1), (0, 2), (4, 3), (1, ""), (3, "")]
    assert board[3]["error"].startswith("WorkloadFailed") and board[0]["eval_loss"] == 2.5
    summary = summarize(_plan(tmp_path), results)
    assert (summary.best_trial, summary.best_run_id, summary.best_value) == (2, "sw-t02", 2.5)
    with pytest.raises(SweepFailed, match="trial 1: WorkloadFailed"):
        summarize(_plan(tmp_path), [results[1]])


def test_sweep_landing_replaces_one_sweeps_rows_and_leaves_others(tmp_path):
    sink = DuckDBSink(tmp_path / "m.duckdb")
    results = [_result(0, loss=3.0), _result(1, status="failed", error="boom"), _result(2, loss=2)]
    sink.land_sweep(sweep_rows(_plan(tmp_path, "other"), results[:1]))
    sink.land_sweep(sweep_rows(_plan(tmp_path), results))
    assert sink.land_sweep(sweep_rows(_plan(tmp_path), results[::2])) == 2  # trial 1 dropped
    rows = sink.query("SELECT sweep_id, trial, rank, is_best, status FROM sweeps ORDER BY 1, 2")
    assert rows == [
        ("other", 0, 1, True, "completed"),
        ("sw", 0, 2, False, "completed"),
        ("sw", 2, 1, True, "completed"),
    ]
    with pytest.raises(ValueError, match="exactly one sweep"):
        sink.land_sweep(
            [*sweep_rows(_plan(tmp_path), results), *sweep_rows(_plan(tmp_path, "b"), results)]
        )


def test_an_invocation_that_started_no_trial_leaves_the_sweeps_rows_as_they_were(tmp_path):
    # probe V: a rerun stopped while it waited for chips landed every trial "not started",
    # over the rows that said which had failed, why, and what they spent.
    from prefect.logging import disable_run_logger

    from tasks.sweep_models import NOT_STARTED
    from tasks.sweep_results import land_sweep

    plan = _plan(tmp_path)
    sink = DuckDBSink(tmp_path / "metrics.duckdb")
    landed = [_result(0, loss=3.0), _result(1, status="failed", error="boom")]
    sink.land_sweep(sweep_rows(plan, landed))

    def rows() -> list[tuple]:
        return sink.query("SELECT trial, status, error FROM sweeps ORDER BY trial")

    before = rows()
    never = [r.model_copy(update=NOT_STARTED.model_dump()) for r in landed]
    with disable_run_logger():
        assert land_sweep.fn(plan, never) == 0
        assert rows() == before == [(0, "completed", None), (1, "failed", "boom")]
        # One trial started: this invocation's rows replace the old ones, as before.
        assert land_sweep.fn(plan, [landed[0], never[1]]) == 2
    assert rows() == [(0, "completed", None), (1, "cancelled", NOT_STARTED.error)]


def test_a_cancelled_trial_s_row_says_what_its_run_says_stopped_it(tmp_path):
    # A deployed trial cancelled by its stopped sweep read Prefect's "Flow run was
    # cancelled successfully." in its sweeps row; its runs row named the stop (probe X).
    stopped = "TerminationSignal: the orchestrator received SIGTERM (a stop, or a cancel)"
    prefect_s = "Flow run was cancelled successfully."
    cancelled = _result(0, status="cancelled", error=prefect_s, loss=3.0)
    run = cancelled.run.model_copy(update={"status": "failed", "error": stopped})
    cancelled = cancelled.model_copy(update={"run": run})
    failed = _result(1, status="failed", error="WorkloadFailed: exit 1", loss=3.0)
    run = failed.run.model_copy(update={"error": "WorkloadFailed: exit 1 (its log's end)"})
    failed = failed.model_copy(update={"run": run})
    never = _result(2, status="cancelled", error="not started: the sweep was stopped")
    rows = sweep_rows(_plan(tmp_path), [cancelled, failed, never])
    assert [r.error for r in rows] == [
        stopped,
        "WorkloadFailed: exit 1",  # the flow run's own account, as before
        "not started: the sweep was stopped",
    ]


def test_sweep_rows_carry_each_trials_cost_and_the_summary_totals_them(tmp_path):
    results = [_result(0, loss=3.0), _result(1, status="failed", error="boom"), _result(2, loss=2)]
    priced = {0: (0.5, 0.6), 2: (0.25, None)}  # trial 2 ran unpriced
    for index, (chip_hours, cost) in priced.items():
        run = results[index].run.model_copy(update={"chip_hours": chip_hours, "cost_usd": cost})
        results[index] = results[index].model_copy(update={"run": run})
    rows = sweep_rows(_plan(tmp_path), results)
    assert [(r.chip_hours, r.cost_usd) for r in rows] == [(0.5, 0.6), (None, None), (0.25, None)]
    summary = summarize(_plan(tmp_path), results)
    assert summary.chip_hours == 0.75 and summary.cost_usd == 0.6
    assert leaderboard(results, "eval_loss")[1]["cost_usd"] == 0.6  # trial 0, ranked second
    assert "0.750 chip-hours, $0.60." in leaderboard_description(_plan(tmp_path), results)


def max_overlap(intervals: list[tuple[datetime, datetime]]) -> int:
    """Most intervals open at one instant (an end and a start at the same time don't meet)."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


@pytest.mark.integration
def test_sweep_admits_two_trials_at_a_time_and_survives_a_failing_one(tmp_path, prefect_harness):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.sweep import sweep
    from tasks.sweep_results import artifact_key

    base = tiny_config(tmp_path)
    # All four trials are submitted at once (no max_parallel): only the chip limit, two
    # trials' worth, holds the others back. 1e30 makes trial 2 diverge.
    config = SweepConfig(
        base=base,
        space=SearchSpace(grid={"train.learning_rate": [0.01, 0.02, 1e30, 0.005]}),
        sweep_name="lr",
        chip_limit=f"chips-{uuid.uuid4().hex[:8]}",
        chip_quota=2 * base.slice.devices,
    )
    summary = sweep(config=config)

    sink = DuckDBSink(tmp_path / "metrics.duckdb")
    trials = sink.query(
        "SELECT trial, run_id, status, flow_run_id, started_at, finished_at, objective_value, "
        "rank, error FROM sweeps WHERE sweep_id = 'lr' ORDER BY trial"
    )
    assert [t[2] for t in trials] == ["completed", "completed", "failed", "completed"]
    assert "not finite" in trials[2][8]
    # Every trial's chip-hours are in its row, the failed one's too (its run landed a row).
    hours = [h for (h,) in sink.query("SELECT chip_hours FROM sweeps WHERE sweep_id = 'lr'")]
    assert len(hours) == 4 and all(h > 0 for h in hours)
    assert summary.chip_hours == pytest.approx(sum(hours)) and summary.cost_usd is None
    intervals = [(t[4], t[5]) for t in trials]
    assert max_overlap(intervals) == 2  # never more than the limit, and really parallel

    # The trials' own flow runs (subflows of the sweep) ended as the table says.
    async def states():
        async with get_client() as client:
            runs = [await client.read_flow_run(uuid.UUID(t[3])) for t in trials]
            key = ArtifactFilterKey(any_=[artifact_key("lr")])
            (art,) = await client.read_artifacts(artifact_filter=ArtifactFilter(key=key))
            return [r.state.type.value for r in runs], [r.parent_task_run_id for r in runs], art

    types, parents, artifact = asyncio.run(states())
    assert types == ["COMPLETED", "COMPLETED", "FAILED", "COMPLETED"]
    assert all(parents)  # linked to the sweep's trial tasks

    # The leaderboard ranks by the landed eval losses; the best trial is named.
    losses = dict(
        sink.query("SELECT run_id, eval_loss FROM runs WHERE run_id LIKE 'lr-%' AND eval_loss > 0")
    )
    ranked = sorted(losses, key=losses.get)
    board = json.loads(artifact.data)
    assert [row["run"] for row in board] == [*ranked, "lr-t02"]
    assert board[0]["eval_loss"] == pytest.approx(losses[ranked[0]], abs=1e-5)
    assert summary.best_run_id == ranked[0] and f"run `{ranked[0]}`" in artifact.description
    assert [t[7] for t in trials if t[1] in ranked] == [
        ranked.index(t[1]) + 1 for t in trials if t[1] in ranked
    ]
    # Two trials waited for chips: the limit, not the thread pool, held them back.
    assert sum(row["waited_s"] > 1 for row in board) >= 2


def test_sweep_row_flags_a_nonfinite_objective():
    row = SweepRow(
        sweep_id="s",
        trial=0,
        run_id="r",
        status="completed",
        params_json="{}",
        chips=8,
        objective="eval_loss",
        objective_value=float("inf"),
        started_at=T0,
    )
    assert row.objective_value is None and row.nonfinite


def test_a_second_sweep_of_a_running_sweep_name_stops_before_any_trial(tmp_path, prefect_harness):
    """Two sweeps of one name at once each recorded the other's running trial as failed
    (RunInUse), and the last to land replaced the `sweeps` rows: a completed trial was
    listed failed, without its chip-hours."""
    import logging

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    from flows.sweep import sweep
    from tasks.plan import plan_run
    from tasks.run_lock import RunInUse, sweep_held
    from tasks.sweep_plan import plan_sweep, sweep_lock

    config = SweepConfig(
        base=tiny_config(tmp_path),
        space=SearchSpace(grid={"train.learning_rate": [0.01, 0.02]}),
        sweep_name="busy",
        chip_limit=f"chips-{uuid.uuid4().hex[:8]}",
        chip_quota=8,
    )
    first = build_trials(config, "busy")[0].config
    # The running sweep holds chips of the limit: the refused one told the user to free them.
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(
            GlobalConcurrencyLimitCreate(name=config.chip_limit, limit=8, active_slots=8)
        )
    said: list[str] = []
    keep = logging.Handler()
    keep.emit = lambda record: said.append(record.getMessage())
    loggers = [logging.getLogger(f"prefect.{kind}_runs") for kind in ("task", "flow")]
    for logger in loggers:
        logger.addHandler(keep)
    busy = pytest.raises(RunInUse, match=r"sweep 'busy' is being run by another orchestrator")
    try:
        with sweep_held(plan_run(first), "busy", first), busy:  # as another orchestrator would
            sweep(config=config)
    finally:
        for logger in loggers:
            logger.removeHandler(keep)
    assert not (tmp_path / "runs").exists()  # no trial started
    assert any("trials as subflows" in m for m in said)  # planned, then refused
    assert not any("are held now" in m for m in said), said

    @flow
    def planned_and_held() -> None:  # a sweep that gets its name says it, once it has it
        with sweep_lock(plan_sweep(config, None, deployed=False)):
            pass

    for logger in loggers:
        logger.addHandler(keep)
    try:
        planned_and_held()
    finally:
        for logger in loggers:
            logger.removeHandler(keep)
    assert sum("8 of the 8 chips of limit" in m and "are held now" in m for m in said) == 1
    with sweep_held(plan_run(first), "other", first):  # another sweep name: no conflict
        pass
