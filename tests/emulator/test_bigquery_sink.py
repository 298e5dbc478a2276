"""The BigQuery sink through the real `bigquery.Client` against bqemulator."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import ClassVar

import pytest
from google.api_core import exceptions as gexc

from infra.metrics import EvalMetricRow, RunRow, StepMetricRow
from infra.metrics.bigquery_sink import BigQuerySink, SchemaError
from infra.metrics.rows import TableRow

pytestmark = pytest.mark.emulator

T0 = datetime(2026, 11, 22, 6, 0, tzinfo=UTC)


@pytest.fixture
def sink(bq_emulator, request):
    from infra.gcp.clients import bigquery_client

    dataset = f"m_{abs(hash(request.node.nodeid)) % 10**8}"
    return BigQuerySink(bigquery_client("test-project"), dataset, location="US")


def rows(run_id="r1", steps=range(1, 6), loss_offset=0.0, status="completed"):
    run = RunRow(
        run_id=run_id,
        run_name=run_id,
        status=status,
        config_hash="h",
        config_json="{}",
        dataset_fingerprint="fp",
        started_at=T0,
        finished_at=T0 + timedelta(minutes=5),
        final_step=max(steps),
        train_loss_first=5.0,
        train_loss_last=2.0,
        run_dir="gs://b/r",
    )
    step_rows = [
        StepMetricRow(
            run_id=run_id,
            step=s,
            loss=5.0 / s + loss_offset,
            learning_rate=1e-3,
            recorded_at=T0 + timedelta(seconds=s),
        )
        for s in steps
    ]
    evals = [
        EvalMetricRow(
            run_id=run_id, step=max(steps), loss=2.5, bits_per_byte=1.2, tokens=1000, recorded_at=T0
        )
    ]
    return run, step_rows, evals


def count(sink, table, run_id):
    ((n,),) = sink.query(
        f"SELECT COUNT(*) FROM `{sink.dataset}.{table}` WHERE run_id = @run_id", run_id
    )
    return n


def test_tables_are_partitioned_by_day_and_clustered_by_run_id(sink):
    sink.ensure_tables()
    for table in ("runs", "step_metrics", "eval_metrics"):
        t = sink.client.get_table(f"{sink.dataset}.{table}")
        assert t.time_partitioning.type_ == "DAY"
        assert t.clustering_fields == ["run_id"]
    step = sink.client.get_table(f"{sink.dataset}.step_metrics")
    assert step.time_partitioning.field == "recorded_at"
    modes = {f.name: (f.field_type, f.mode) for f in step.schema}
    assert modes["step"] == ("INTEGER", "REQUIRED") or modes["step"] == ("INT64", "REQUIRED")
    assert modes["loss"][1] == "NULLABLE"


def test_landing_twice_leaves_one_copy_of_every_row(sink):
    run, steps, evals = rows()
    sink.land(run, steps, evals)
    result = sink.land(run, steps, evals)

    assert (result.runs, result.steps, result.evals) == (1, 5, 1)
    assert count(sink, "runs", "r1") == 1
    assert count(sink, "step_metrics", "r1") == 5
    assert count(sink, "eval_metrics", "r1") == 1
    # The staging tables are gone.
    names = {t.table_id for t in sink.client.list_tables(sink.dataset)}
    assert names == {"runs", "step_metrics", "eval_metrics"}


def test_a_relanding_replaces_the_runs_rows_and_leaves_other_runs_alone(sink):
    sink.land(*rows("other"))
    sink.land(*rows("r1", steps=range(1, 6)))
    # After a resume, steps 4-5 were re-run with other losses and step 6 is new; the run
    # rolled back past nothing else. Duplicates in the source keep their last row.
    run, steps, evals = rows("r1", steps=range(1, 7), loss_offset=1.0)
    sink.land(run, [*steps[:2], *steps], evals)

    got = sink.query(
        f"SELECT step, loss FROM `{sink.dataset}.step_metrics` WHERE run_id = @run_id "
        "ORDER BY step",
        "r1",
    )
    assert [s for s, _ in got] == [1, 2, 3, 4, 5, 6]
    assert all(math.isclose(loss, 5.0 / s + 1.0) for s, loss in got)
    assert count(sink, "step_metrics", "other") == 5


def test_a_landing_that_failed_midway_changes_nothing_and_a_rerun_completes_it(sink, monkeypatch):
    run, steps, evals = rows()
    sink.land(run, steps[:2], [])  # an earlier, partial landing
    real_merge = sink._merge_sql

    def merge_breaking_on_evals(model, run_id, **kwargs):
        sql = real_merge(model, run_id, **kwargs)
        # The third MERGE of the transaction fails after the first two have run.
        return sql.replace("_staging_eval_metrics", "_gone") if model is EvalMetricRow else sql

    monkeypatch.setattr(sink, "_merge_sql", merge_breaking_on_evals)
    with pytest.raises(gexc.NotFound):
        sink.land(run, steps, evals)
    monkeypatch.undo()
    # The transaction rolled back: the runs and step MERGEs that ran left no trace.
    assert count(sink, "step_metrics", "r1") == 2
    assert count(sink, "eval_metrics", "r1") == 0

    sink.land(run, steps, evals)
    assert count(sink, "step_metrics", "r1") == 5
    assert count(sink, "eval_metrics", "r1") == 1
    assert count(sink, "runs", "r1") == 1


def test_a_landing_cancelled_for_a_concurrent_one_runs_again(sink, monkeypatch):
    # Real BigQuery cancels one of two transactions changing a table at once (two runs or
    # sweep trials landing together); the emulator runs them one after the other, so the
    # cancellation is played here. The trial's run failed after training.
    run, steps, evals = rows()
    real_query = sink._query_once
    cancelled = []

    def cancel_the_first_transaction(sql, run_id):
        if "BEGIN TRANSACTION" in sql and not cancelled:
            cancelled.append(sql)
            raise gexc.BadRequest(
                "Transaction is aborted due to concurrent update against table p.d.runs"
            )
        return real_query(sql, run_id)

    monkeypatch.setattr(sink, "_query_once", cancel_the_first_transaction)
    sink.land(run, steps, evals)
    assert cancelled
    assert count(sink, "step_metrics", "r1") == 5
    assert count(sink, "runs", "r1") == 1
    # Any other bad request is no conflict: not run again.
    tries = []

    def bad(sql, run_id):
        tries.append(sql)
        raise gexc.BadRequest("Syntax error")

    monkeypatch.setattr(sink, "_query_once", bad)
    with pytest.raises(gexc.BadRequest, match="Syntax error"):
        sink.read_run("r1")
    assert len(tries) == 1


def test_a_failed_landing_keeps_the_rows_and_results_landed_before(sink):
    # An interrupted rerun of a finished run MERGEd its failed row with the delete of
    # every row it lacked: the run's evaluation (eval rows, eval loss) was gone.
    run, steps, evals = rows()
    sink.land(run.model_copy(update={"eval_loss": 2.5, "params_sha256": "abc"}), steps, evals)
    failed, fewer, _ = rows(steps=range(1, 4), loss_offset=1.0, status="failed")
    failed = failed.model_copy(update={"error": "TerminationSignal: SIGTERM", "final_step": 5})
    for _ in range(2):  # idempotent: no row twice
        sink.land(failed, fewer, [])
        assert [count(sink, t, "r1") for t in ("runs", "step_metrics", "eval_metrics")] == [1, 5, 1]
    row = sink.read_run("r1")
    assert (row.status, row.error) == ("failed", "TerminationSignal: SIGTERM")
    assert (row.eval_loss, row.params_sha256, row.train_loss_first) == (2.5, "abc", 5.0)
    got = sink.query(
        f"SELECT step, loss FROM `{sink.dataset}.step_metrics` WHERE run_id = @run_id "
        "ORDER BY step",
        "r1",
    )
    # Rows it has are updated, rows it lacks are kept.
    assert [round(loss - 5.0 / s, 6) for s, loss in got] == [1.0, 1.0, 1.0, 0.0, 0.0]
    sink.land(*rows(steps=range(1, 3)))  # a completed landing is exact again
    assert [count(sink, t, "r1") for t in ("runs", "step_metrics", "eval_metrics")] == [1, 2, 1]
    assert sink.read_run("r1").eval_loss is None


def test_a_completed_landing_keeps_stored_steps_it_lacks_up_to_its_final_step(sink):
    # A rerun of a finished run over a metrics.jsonl cut short MERGEd with the delete of
    # every row it lacked: the steps the file had lost were gone, and train_loss_last.
    sink.land(*rows("other"))
    run, steps, evals = rows(steps=range(1, 13))
    sink.land(run, steps, evals)
    cut, fewer, _ = rows(steps=range(1, 6), loss_offset=1.0)
    cut = cut.model_copy(
        update={"final_step": 12, "train_loss_first": 6.0, "train_loss_last": None}
    )
    sink.land(cut, fewer, evals)
    got = sink.query(
        f"SELECT step, loss FROM `{sink.dataset}.step_metrics` WHERE run_id = @run_id "
        "ORDER BY step",
        "r1",
    )
    assert [(s, round(loss - 5.0 / s, 6)) for s, loss in got] == [
        (s, 1.0 if s <= 5 else 0.0) for s in range(1, 13)
    ]
    stored = sink.read_run("r1")
    assert (stored.train_loss_first, stored.train_loss_last) == (6.0, 2.0)
    # Stored steps past the final step go, with step rows given and without; evals it
    # lacks go; other runs stay.
    sink.land(cut.model_copy(update={"final_step": 8}), fewer, [])
    assert [count(sink, t, "r1") for t in ("step_metrics", "eval_metrics")] == [8, 0]
    sink.land(cut.model_copy(update={"final_step": 2}), [], [])
    assert count(sink, "step_metrics", "r1") == 2
    assert count(sink, "step_metrics", "other") == 5


def test_a_runs_started_at_stays_its_first_start_over_later_landings(sink):
    run, steps, evals = rows()
    sink.land(run, steps, evals)
    later = {"started_at": T0 + timedelta(hours=3)}
    sink.land(run.model_copy(update=later), steps, evals)  # completed again
    failed, _, _ = rows(status="failed")
    sink.land(failed.model_copy(update={**later, "error": "SIGTERM"}), [], [])
    assert sink.read_run("r1").started_at == T0


def test_a_fresh_landing_replaces_every_row_an_earlier_run_of_the_name_left(sink):
    # The run directory was deleted and the name run again: its rows are the new run's
    # alone, its start included, even when it failed (results and rows not kept).
    run, steps, evals = rows(steps=range(1, 13))
    sink.land(run.model_copy(update={"eval_loss": 2.5}), steps, evals)
    new, new_steps, _ = rows(steps=range(1, 4), status="failed")
    later = {"started_at": T0 + timedelta(days=2), "error": "SIGTERM", "train_loss_last": None}
    sink.land(new.model_copy(update=later), new_steps, [], fresh=True)
    row = sink.read_run("r1")
    assert (row.started_at, row.status, row.final_step) == (T0 + timedelta(days=2), "failed", 3)
    assert (row.eval_loss, row.train_loss_last) == (None, None)
    assert count(sink, "step_metrics", "r1") == 3
    assert count(sink, "eval_metrics", "r1") == 0


def test_a_run_id_that_would_need_escaping_is_refused(sink):
    run, steps, evals = rows(run_id="r1'; DROP TABLE runs; --")
    with pytest.raises(ValueError, match="must match"):
        sink.land(run, steps, evals)


def test_nonfinite_metrics_land_as_null_with_a_flag(sink):
    run, steps, evals = rows(steps=range(1, 3))
    bad = StepMetricRow(run_id="r1", step=3, loss=float("nan"), recorded_at=T0)
    sink.land(run, [*steps, bad], evals)
    ((loss, flag),) = sink.query(
        f"SELECT loss, nonfinite FROM `{sink.dataset}.step_metrics` "
        "WHERE run_id = @run_id AND step = 3",
        "r1",
    )
    assert loss is None and flag is True


class OldStepRow(TableRow):
    """step_metrics as an earlier version of the row model had it."""

    table: ClassVar[str] = "step_metrics"
    primary_key: ClassVar[tuple[str, ...]] = ("run_id", "step")
    partition_field: ClassVar[str] = "recorded_at"

    run_id: str
    step: int
    loss: float | None = None
    recorded_at: datetime


def test_tables_gain_the_new_nullable_columns_of_grown_row_models(sink):
    old = BigQuerySink(
        sink.client, sink.dataset.split(".")[1], models=(RunRow, OldStepRow, EvalMetricRow)
    )
    old.ensure_tables()
    old_row = OldStepRow(run_id="old", step=1, loss=1.0, recorded_at=T0)
    old.land(rows("old")[0], [old_row], [])

    sink.ensure_tables()
    sink.land(*rows("r1"))

    got = sink.query(
        "SELECT run_id, step, grad_norm, tokens_per_s, nonfinite "
        f"FROM `{sink.dataset}.step_metrics` ORDER BY run_id, step"
    )
    assert got[0] == ("old", 1, None, None, None)  # the old row, new columns NULL
    assert [r[0] for r in got[1:]] == ["r1"] * 5 and got[1][4] is False


class TextStepRow(TableRow):
    """step_metrics with `loss` as text: a change BigQuery cannot make in place."""

    table: ClassVar[str] = "step_metrics"
    primary_key: ClassVar[tuple[str, ...]] = ("run_id", "step")
    partition_field: ClassVar[str] = "recorded_at"

    run_id: str
    step: int
    loss: str | None = None
    recorded_at: datetime


def test_a_changed_column_type_is_refused_with_a_reason(sink):
    dataset = sink.dataset.split(".")[1]
    BigQuerySink(sink.client, dataset, models=(TextStepRow,)).ensure_tables()
    with pytest.raises(SchemaError, match="loss STRING -> FLOAT64"):
        sink.ensure_tables()


def test_a_view_or_a_required_column_a_run_may_not_fill_is_refused_by_name(sink):
    # Tables made by hand: a view answered the migration with a parser error naming
    # nothing, and a REQUIRED column a run may leave empty would fail the MERGE of its
    # row on BigQuery, after the whole training run.
    from google.cloud import bigquery

    client, dataset = sink.client, sink.dataset
    client.create_dataset(dataset, exists_ok=True)
    client.query(f"CREATE VIEW `{dataset}.runs` AS SELECT 'x' AS run_id").result()
    with pytest.raises(SchemaError, match=r"\.runs is a view, not a table"):
        sink.ensure_tables()
    other = BigQuerySink(client, dataset.split(".")[1] + "_required")
    client.create_dataset(other.dataset, exists_ok=True)
    schema = [
        bigquery.SchemaField("run_id", "STRING", mode="REQUIRED"),
        bigquery.SchemaField("error", "STRING", mode="REQUIRED"),
    ]
    client.create_table(bigquery.Table(f"{other.dataset}.runs", schema=schema))
    with pytest.raises(SchemaError, match=r"column error is REQUIRED, and rows may leave it"):
        other.ensure_tables()


@pytest.mark.parametrize(
    "field, refused",
    [
        # BigQuery's names ignore case: this is the model's eval_loss, of another type.
        (("Eval_Loss", "INT64", "NULLABLE"), r"column types changed \(eval_loss INT"),
        (("Cost_USD", "FLOAT64", "REQUIRED"), "column Cost_USD is REQUIRED, and rows may leave"),
        (("team", "STRING", "REQUIRED"), "column team is REQUIRED with no default, and rows"),
        (("error", "STRING", "REPEATED"), r"column error is REPEATED \(an ARRAY\)"),
    ],
)
def test_a_column_made_by_hand_that_would_refuse_the_rows_is_refused_by_name(sink, field, refused):
    # Each passed the check before provisioning, and the run trained and then landed
    # nothing ("NOT NULL constraint failed: runs.team"), or landed a FLOAT64 as an INT64.
    from google.cloud import bigquery

    name, kind, mode = field
    sink.client.create_dataset(sink.dataset, exists_ok=True)
    schema = [bigquery.SchemaField("run_id", "STRING", mode="REQUIRED")]
    schema.append(bigquery.SchemaField(name, kind, mode=mode))
    sink.client.create_table(bigquery.Table(f"{sink.dataset}.runs", schema=schema))
    with pytest.raises(SchemaError, match=refused):
        sink.ensure_tables()


def test_what_a_table_made_by_hand_may_differ_in(sink):
    # Another case of a column's name, an extra column: the model's columns are not added
    # a second time. (A REQUIRED column with a default may be too: see the test below, as
    # the emulator keeps no defaults.)
    from google.cloud import bigquery

    sink.client.create_dataset(sink.dataset, exists_ok=True)
    schema = [
        bigquery.SchemaField("Run_Id", "STRING", mode="REQUIRED"),
        bigquery.SchemaField("Eval_Loss", "FLOAT64"),
        bigquery.SchemaField("notes", "STRING"),
    ]
    sink.client.create_table(bigquery.Table(f"{sink.dataset}.runs", schema=schema))
    sink.ensure_tables()
    # The model's other columns were added, and its rows land.
    sink.land(*rows("r1"))
    got = sink.client.query(f"SELECT Run_Id, status, eval_loss, notes FROM `{sink.dataset}.runs`")
    assert [tuple(r) for r in got.result()] == [("r1", "completed", None, None)]


def test_a_required_column_with_a_default_or_a_partition_filter_as_bigquery_reports_them():
    # What the emulator does not keep or enforce, on tables as the API describes them.
    from google.cloud import bigquery

    from infra.metrics import RunRow
    from infra.metrics.bigquery_tables import _refusals

    def table(*fields, **props):
        made = bigquery.Table(
            "p.d.runs", schema=[bigquery.SchemaField(*f[:2], **f[2]) for f in fields]
        )
        made._properties.update(props)
        return made

    team = ("team", "STRING", {"mode": "REQUIRED", "default_value_expression": "'ml'"})
    assert _refusals(table(team), RunRow) == []
    assert _refusals(table(team, requirePartitionFilter=True), RunRow) == [
        "it requires a partition filter, which landing's MERGE does not give (ALTER TABLE "
        "... SET OPTIONS (require_partition_filter = false))"
    ]
    # Each refusal says its own fix (one hint named SET OPTIONS for them all: probe S).
    note = ("note", "STRING", {"mode": "REQUIRED"})
    (said,) = _refusals(table(note), RunRow)
    assert said.endswith(
        "(ALTER TABLE ... ALTER COLUMN note DROP NOT NULL, or ALTER COLUMN note SET DEFAULT ...)"
    ), said
    (said,) = _refusals(table(("error", "STRING", {"mode": "REQUIRED"})), RunRow)
    assert said.endswith("may leave it empty (ALTER TABLE ... ALTER COLUMN error DROP NOT NULL)")
