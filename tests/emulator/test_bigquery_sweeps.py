"""The `sweeps` table in BigQuery (bqemulator): created on first landing, replaced per
sweep exactly once, and the `runs` rows its trials link to read back."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from infra.metrics import RunRow, SweepRow
from infra.metrics.bigquery_sink import BigQuerySink, bq_schema

pytestmark = pytest.mark.emulator

T0 = datetime(2026, 11, 22, 6, 0, tzinfo=UTC)


@pytest.fixture
def sink(bq_emulator, request):
    from infra.gcp.clients import bigquery_client

    dataset = f"s_{abs(hash(request.node.nodeid)) % 10**8}"
    return BigQuerySink(bigquery_client("test-project"), dataset, location="US")


def trial(sweep_id: str, index: int, loss: float | None, status: str = "completed") -> SweepRow:
    return SweepRow(
        sweep_id=sweep_id,
        trial=index,
        run_id=f"{sweep_id}-t{index:02d}",
        status=status,
        params_json=f'{{"seed": {index}}}',
        chips=8,
        objective="eval_loss",
        objective_value=loss,
        eval_loss=loss,
        started_at=T0 + timedelta(minutes=index),
        finished_at=T0 + timedelta(minutes=index + 1),
    )


def stored(sink: BigQuerySink) -> list[tuple]:
    return sink.query(
        f"SELECT sweep_id, trial, status, eval_loss FROM `{sink.dataset}.sweeps` "
        "ORDER BY sweep_id, trial"
    )


def test_a_sweep_lands_once_and_a_relanding_replaces_only_its_rows(sink):
    sink.land_sweep([trial("other", 0, 2.0)])
    rows = [trial("sw", 0, 3.0), trial("sw", 1, None, "failed"), trial("sw", 2, 2.5)]
    assert sink.land_sweep(rows) == 3
    assert sink.land_sweep(rows) == 3  # again: still one copy of each
    assert len(stored(sink)) == 4
    # A re-run of the sweep where trial 1 now completed and trial 2 is gone.
    assert sink.land_sweep([trial("sw", 0, 3.0), trial("sw", 1, 2.75)]) == 2
    assert stored(sink) == [
        ("other", 0, "completed", 2.0),
        ("sw", 0, "completed", 3.0),
        ("sw", 1, "completed", 2.75),
    ]
    table = sink.client.get_table(f"{sink.dataset}.sweeps")
    assert table.clustering_fields == ["sweep_id", "run_id"]
    assert table.time_partitioning.field == "started_at"
    # Only the target tables are left: the staging table went after the MERGE.
    names = {t.table_id for t in sink.client.list_tables(sink.dataset)}
    assert names == {"runs", "step_metrics", "eval_metrics", "sweeps"}


def test_read_run_of_a_dataset_nothing_landed_in_yet_is_none(sink, caplog):
    # A run's owner check reads its row before the first landing created the dataset: a
    # NotFound there is no error (it logged "could not look up run" on every first run).
    assert sink.read_run("first") is None
    assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]


def test_read_run_returns_the_landed_row_or_none(sink):
    run = RunRow(
        run_id="sw-t00",
        run_name="sw-t00",
        status="completed",
        config_hash="h",
        config_json="{}",
        dataset_fingerprint="fp",
        started_at=T0,
        eval_loss=2.5,
        run_dir="gs://b/runs/sw-t00",
        chip_hours=0.3,
        cost_usd=0.36,
        price_source="tasks/tpu_prices.yaml: v5litepod us-central1 on_demand",
        price_as_of="2026-11-22",
        tokens_trained=30_720,
        cost_per_million_tokens=11.72,
    )
    sink.land(run, [], [])
    assert sink.read_run("sw-t00") == run
    assert sink.read_run("missing") is None


def test_an_older_sweeps_table_gains_the_cost_columns(sink):
    from google.cloud import bigquery

    sink.ensure_tables()
    cost = {"goodput", "chip_hours", "cost_usd", "tokens_trained", "cost_per_million_tokens"}
    old = [f for f in bq_schema(SweepRow) if f.name not in cost]  # before the cost ledger
    sink.client.create_table(bigquery.Table(f"{sink.dataset}.sweeps", schema=old))
    row = trial("sw", 0, 3.0).model_copy(update={"chip_hours": 0.5, "cost_usd": 0.6})
    assert sink.land_sweep([row]) == 1
    got = sink.query(f"SELECT chip_hours, cost_usd, goodput FROM `{sink.dataset}.sweeps`")
    assert got == [(0.5, 0.6, None)]


def test_a_sweeps_table_that_would_refuse_the_rows_is_refused_before_any_trial(sink, tmp_path):
    # An INT64 eval_loss failed the sweep's landing once every trial had trained.
    from tasks.access import check_sweeps_table
    from tasks.plan import plan_run
    from tests.helpers import tiny_config
    from workloads.config_file import ConfigError

    project, dataset = sink.dataset.split(".")
    overrides = (
        "metrics.sink=bigquery",
        f"metrics.project={project}",
        f"metrics.dataset={dataset}",
    )
    config = tiny_config(tmp_path, *overrides)
    check_sweeps_table(config, plan_run(config))  # made as landing makes it
    sink.land_sweep([trial("sw", 0, 3.0)])
    sink.client.query(f"DROP TABLE `{sink.dataset}.sweeps`").result()
    sink.client.query(
        f"CREATE TABLE `{sink.dataset}.sweeps` (sweep_id STRING, trial INT64, eval_loss INT64)"
    ).result()
    with pytest.raises(ConfigError) as err:
        check_sweeps_table(config, plan_run(config))
    assert f"metrics.dataset = '{dataset}'" in str(err.value)
    assert "eval_loss INT" in str(err.value)
