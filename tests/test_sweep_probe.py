"""Sweep faults an acceptance probe of the user interface found: search spaces that ran
something other than what they said, tracebacks from the plan, and a sweep run again that
took chips for trials it would refuse and overwrote the finished sweep's rows."""

from __future__ import annotations

import pytest

from tests.helpers import REPO, tiny_config
from workloads.config_file import ConfigError, load_config


def _space_error(space: dict) -> str:
    """The error a sweep of configs/tiny.yaml over `space` stops with before any trial."""
    from pydantic import ValidationError

    from tasks.sweep_space import SweepConfig
    from tasks.sweep_trials import build_trials

    with pytest.raises((ValidationError, ConfigError)) as err:
        build_trials(SweepConfig(base=load_config(REPO / "configs/tiny.yaml"), space=space), "s")
    return str(err.value)


@pytest.mark.parametrize(
    ("low", "high", "said"),
    [(0.5, 0.7, "no integer"), (float("nan"), 3, "finite"), (0, float("inf"), "finite")],
)
def test_a_distribution_with_nothing_to_draw_is_named_not_a_traceback(low, high, said):
    """An int_uniform over [0.5, 0.7] raised randint's 'empty range for randrange()', and a
    NaN bound 'cannot convert float NaN to integer', from inside the sweep's plan."""
    space = {"random": {"seed": {"kind": "int_uniform", "low": low, "high": high}}}
    message = _space_error(space)
    assert said in message and "space.random.seed" in message


@pytest.mark.parametrize(
    ("space", "said"),
    [
        ({}, "varies no field"),
        ({"grid": {}, "random": {}}, "varies no field"),
        ({"grid": {"run_name": ["a", "b"]}}, "run_name"),
        ({"grid": {"train.learning_rate": [0.1]}, "samples": 4}, "space.random"),
    ],
)
def test_a_space_that_cannot_mean_what_it_says_is_refused(space, said):
    """An empty space ran the base config once as a 'sweep'; a searched run_name was
    silently replaced by each trial's name; samples without random draws were ignored."""
    assert said in _space_error(space)


def test_trials_that_would_train_the_same_config_are_refused():
    """A value listed twice in a grid (or 1 and 1.0 for a float field) gave two trials
    that train the same model on the same data: twice the chips for one result."""
    message = _space_error({"grid": {"train.learning_rate": [0.1, 1, 1.0]}})
    assert "trials 1 and 2" in message and "the same config" in message
    assert "trial 0" not in message
    # The base (configs/tiny.yaml) gives every dimension: a size changes none of them,
    # and three trials trained one model under three size labels.
    message = _space_error({"grid": {"model.size": ["tiny", "small", "base"]}})
    assert "trials 0 and 1" in message and "trials 0 and 2" in message


def test_a_space_of_more_trials_than_max_trials_is_refused_before_any_runs():
    """A grid typo multiplies the trials, each a real training run holding real chips: a
    value list pasted 20 times over five seeds made 300 trials and the sweep ran them."""
    from pydantic import ValidationError

    from tasks.sweep_space import SweepConfig, expand_space

    base = load_config(REPO / "configs/tiny.yaml")
    space = {"grid": {"train.learning_rate": [1e-3, 2e-3, 3e-3] * 20, "seed": list(range(5))}}
    with pytest.raises(ValidationError) as err:
        SweepConfig(base=base, space=space)
    message = str(err.value)
    assert "300 trials" in message and "max_trials = 100" in message
    assert "train.learning_rate 60 × seed 5" in message
    draws = {"random": {"seed": {"kind": "int_uniform", "low": 0, "high": 9**9}}, "samples": 101}
    with pytest.raises(ValidationError, match="101 trials"):
        SweepConfig(base=base, space=draws)
    # Asked for, it is allowed: the limit guards against mistakes, not big sweeps.
    big = SweepConfig(base=base, space=draws, max_trials=101)
    assert len(expand_space(big.space)) == 101


def test_an_empty_sweep_name_means_a_new_one_as_its_description_says():
    from tasks.sweep_space import SweepConfig

    assert "Empty: a new name" in SweepConfig.model_fields["sweep_name"].description
    assert SweepConfig(sweep_name="").sweep_name is None


def _sweep_of(root, grid: dict):
    from tasks.sweep_space import SweepConfig

    return SweepConfig(base=tiny_config(root), space={"grid": grid}, sweep_name="s")


def test_a_sweep_rerun_that_would_train_other_configs_is_refused_before_any_trial(tmp_path):
    """Rerunning a sweep name with another space let every trial take its chips and then
    fail its own validation ('already exists with a different training config'); the sweep
    then replaced the finished sweep's `sweeps` rows with failed ones."""
    from tasks.plan import plan_run, write_workload_config
    from tasks.sweep import check_trials
    from tasks.sweep_trials import build_trials

    for trial in build_trials(_sweep_of(tmp_path, {"train.learning_rate": [0.1, 0.2]}), "s"):
        write_workload_config(trial.config, plan_run(trial.config), str(tmp_path / "ds"))
    again = build_trials(_sweep_of(tmp_path, {"train.learning_rate": [0.1, 0.3]}), "s")
    with pytest.raises(ConfigError) as err:
        check_trials(again, local_inputs=False)
    assert "trial 1 (train.learning_rate=0.3): run 's-t01' already exists" in str(err.value)
    assert "trial 0" not in str(err.value)
    check_trials(again[:1], local_inputs=False)  # the same point again resumes it: fine


def test_every_trials_inputs_are_checked_as_validate_checks_them_before_any_trial(tmp_path):
    """A trial whose source matched no file failed only once the trials before it had
    trained; a missing tokenizer or price table likewise."""
    from tasks.sweep import check_trials
    from tasks.sweep_trials import build_trials

    nothing = str(tmp_path / "nodata" / "*.txt")
    grid = {
        "dataset.sources": [["stdlib"], [nothing]],
        "dataset.tokenizer": [None, str(tmp_path / "tok.json")],
    }
    trials = build_trials(_sweep_of(tmp_path, grid), "s")
    with pytest.raises(ConfigError) as err:
        check_trials(trials, local_inputs=True)
    said = str(err.value)
    assert "trial 0" not in said
    assert f"trial 1 (dataset.sources=['stdlib'], dataset.tokenizer='{tmp_path}/tok.json')" in said
    assert f"'{nothing}' matches no file" in said and "tok.json cannot be read" in said
    check_trials(trials, local_inputs=False)  # deployed trials check their inputs on a worker
    priced = _sweep_of(tmp_path, {"cost.price_table": [str(tmp_path / "prices.yaml")]})
    with pytest.raises(ConfigError, match=r"trial 0 .*prices\.yaml"):
        check_trials(build_trials(priced, "p"), local_inputs=False)


def test_trials_of_one_corpus_list_it_once(tmp_path, monkeypatch):
    from tasks import prepare
    from tasks.sweep import check_trials
    from tasks.sweep_trials import build_trials

    calls = []
    real = prepare.data.resolve_dataset
    monkeypatch.setattr(
        prepare.data, "resolve_dataset", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    trials = build_trials(_sweep_of(tmp_path, {"train.learning_rate": [0.1, 0.2, 0.3]}), "s")
    check_trials(trials, local_inputs=True)
    assert len(calls) == 1


def test_a_failed_trial_is_not_credited_with_an_earlier_runs_row(tmp_path):
    """A trial that failed before landing anything was given the `runs` row an earlier run
    of its name had landed: the sweep's rows and totals showed that run's eval loss and
    chip-hours as this failed trial's."""
    from datetime import UTC, datetime

    from infra.metrics import RunRow, build_sink
    from tasks.plan import metrics_path
    from tasks.sweep import SweepPlan, TrialResult
    from tasks.sweep_results import attach_landed_runs

    base = tiny_config(tmp_path)
    now = datetime.now(UTC)
    row = RunRow(
        run_id="s-t00", run_name="s-t00", flow_run_id="earlier", status="completed",
        config_hash="h", config_json="{}", dataset_fingerprint="fp", started_at=now,
        eval_loss=3.0, chip_hours=0.5, run_dir="/r",
    )  # fmt: skip
    build_sink("duckdb", metrics_path(base)).land(row, [], [])
    plan = SweepPlan(
        sweep_id="s", trials=[], via="subflow", trial_deployment="x/y", chip_limit="c",
        chips=8, objective="eval_loss", max_parallel=1, base=base,
    )  # fmt: skip

    def result(flow_run_id):
        return TrialResult(
            index=0, run_id="s-t00", params={}, chips=8, status="failed", error="refused",
            flow_run_id=flow_run_id, started_at=now, finished_at=now, waited_s=0.0,
        )  # fmt: skip

    for earlier_or_none in ("now", None):
        assert attach_landed_runs.fn(plan, [result(earlier_or_none)])[0].run is None
    assert attach_landed_runs.fn(plan, [result("earlier")])[0].run.chip_hours == 0.5


def test_an_unreadable_sink_is_read_once_not_once_a_trial(tmp_path, monkeypatch, prefect_harness):
    """With BigQuery unreachable, a stopped sweep read each trial's row in turn, each for
    the call's full 300 s: 15 minutes after its SIGTERM it was still reading."""
    from datetime import UTC, datetime

    from prefect import flow

    from tasks import sweep_results
    from tasks.sweep import SweepPlan, TrialResult

    reads = []

    def unreachable(base, run_id, wait_s=None):
        reads.append((run_id, wait_s))
        raise ConnectionError("Remote end closed connection without response")

    monkeypatch.setattr(sweep_results, "read_run", unreachable)
    now = datetime.now(UTC)
    plan = SweepPlan(
        sweep_id="s", trials=[], via="subflow", trial_deployment="x/y", chip_limit="c",
        chips=8, objective="eval_loss", max_parallel=1, base=tiny_config(tmp_path),
    )  # fmt: skip
    stopped = dict(params={}, chips=8, status="failed", error="stopped", waited_s=0.0)
    results = [
        TrialResult(
            index=i,
            run_id=f"s-t0{i}",
            flow_run_id=f"fr{i}",
            started_at=now,
            finished_at=now,
            **stopped,
        )
        for i in range(3)
    ]

    @flow
    def stopped_sweep():
        return sweep_results.attach_landed_runs(plan, results, 5.0)

    assert [r.run for r in stopped_sweep()] == [None, None, None]
    assert reads == [("s-t00", 5.0)]


@pytest.mark.parametrize(
    "fields",
    [
        {"space": {"grid": {"seed": [1, 2]}, "samples": True}},
        {"space": {"grid": {"seed": [1, 2]}, "seed": 1.0}},
        {"chip_quota": "16"},
        {"max_parallel": 2.0},
        {"space": {"random": {"seed": {"kind": "int_uniform", "low": False, "high": 3}}}},
    ],
)
def test_sweep_numbers_are_numbers_of_their_type_as_in_a_pipeline_config(fields):
    """The README promises integer fields take integers only; a sweep's took True, 2.0 and
    "16" (and a bound False) silently, as numbers."""
    from pydantic import ValidationError

    from tasks.sweep_space import SweepConfig

    with pytest.raises(ValidationError):
        SweepConfig(**fields)


def test_a_typo_in_a_space_field_names_the_field_meant():
    assert "(did you mean 'train'?)" in _space_error({"grid": {"trian.steps": [1]}})
    assert "(did you mean 'learning_rate'?)" in _space_error({"grid": {"train.learning_rte": [1]}})
    # A field named as a section: no hint that names the field itself.
    said = _space_error({"grid": {"train.steps.x": [1]}})
    assert "'steps' is not a config section" in said and "did you mean" not in said


def test_trials_via_a_deployment_that_does_not_exist_stop_the_plan():
    """A mistyped trial_deployment let every trial take its chips and crash in
    run_deployment, and the sweep replaced a finished sweep's rows with crashed ones."""
    from prefect.exceptions import ObjectNotFound

    from tasks.sweep import SweepError, ensure_trial_deployment
    from tasks.sweep_space import SweepConfig

    class Client:
        def read_deployment_by_name(self, name):
            if name != "tpu-training-pipeline/train":
                raise ObjectNotFound(http_exc=None)
            return object()

    ensure_trial_deployment("tpu-training-pipeline/train", Client())
    with pytest.raises(SweepError, match=r"no deployment 'tpu-training-pipeline/trian'"):
        ensure_trial_deployment("tpu-training-pipeline/trian", Client())
    with pytest.raises(ValueError, match="flow name/deployment name"):
        SweepConfig(trial_deployment="train")


def test_the_plan_s_log_counts_the_trials_the_chip_limit_admits_at_once(
    tmp_path, prefect_harness, monkeypatch
):
    # Three trials of 8 chips under a quota of 8 run one at a time: the plan said "at most
    # 3 at once".
    import uuid

    from prefect import flow

    from tasks import sweep_plan
    from tasks.sweep_space import SearchSpace, SweepConfig

    said = []

    class Logger:
        def info(self, message, *args):
            said.append(message % args)

        warning = info

    monkeypatch.setattr(sweep_plan, "get_run_logger", Logger)
    config = SweepConfig(
        base=tiny_config(tmp_path),
        space=SearchSpace(grid={"seed": [1, 2, 3]}),
        sweep_name="quota",
        chip_limit=f"chips-{uuid.uuid4().hex[:8]}",
        chip_quota=8,
    )
    flow(lambda: sweep_plan.plan_sweep.fn(config, None, False), name="plan")()
    assert any("3 trials as subflows, at most 1 at once" in line for line in said), said
    # Trials of mixed sizes: two of 4 chips fit a quota of 12 beside each other (it said
    # 12 // 8 = 1).
    assert sweep_plan._most_at_once(12, [8, 4, 8, 4]) == 2
    assert sweep_plan._most_at_once(12, [4, 4, 4, 8]) == 3
    assert sweep_plan._most_at_once(8, [16]) == 1


def test_the_plan_refuses_a_sweeps_table_that_would_refuse_the_rows(tmp_path, prefect_harness):
    # It failed the sweep's landing, once every trial had trained.
    import duckdb
    from prefect import flow

    from infra.metrics.duckdb_tables import create_table_sql
    from infra.metrics.rows import SweepRow
    from tasks.access import check_sweeps_table
    from tasks.plan import plan_run
    from tasks.sweep_plan import plan_sweep
    from tasks.sweep_space import SearchSpace, SweepConfig

    shared = tmp_path / "shared.duckdb"
    config = tiny_config(tmp_path / "root", f"metrics.path={shared}")
    check_sweeps_table(config, plan_run(config))  # no file yet: nothing to check, none made
    assert not shared.exists()
    # Made by hand: every trial's error NOT NULL. (No connection left in this frame: the
    # failed flow run's traceback keeps it alive, and DuckDB then warns of leaks at exit.)
    made_by_hand = create_table_sql(SweepRow).replace("error VARCHAR", "error VARCHAR NOT NULL")
    duckdb.connect(str(shared)).execute(made_by_hand).close()
    with pytest.raises(ConfigError) as err:
        check_sweeps_table(config, plan_run(config))
    assert f"metrics.path = '{shared}'" in str(err.value)
    assert "sweeps: column error is NOT NULL" in str(err.value)
    # The sweep's plan checks it, before any trial is admitted.
    sweep = SweepConfig(base=config, space=SearchSpace(grid={"seed": [1]}), sweep_name="sw")
    with pytest.raises(ConfigError, match="sweeps: column error is NOT NULL"):
        flow(lambda: plan_sweep.fn(sweep, None, False), name="plan")()
