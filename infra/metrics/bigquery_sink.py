"""The production metrics sink: BigQuery tables created from the same row models as DuckDB.

Exactly-once landing, whatever is retried:

1. Each table's rows for the run are loaded into a staging table named after the run and
   the table with a load job (`WRITE_TRUNCATE`). A load job is atomic, and truncation makes
   a retried or repeated load replace the staging rows instead of adding to them. Streaming
   inserts (`insertAll`) are not used: a retry after a lost answer duplicates rows, and rows
   in the streaming buffer cannot be updated or deleted for up to 90 minutes.
2. One multi-statement transaction MERGEs every staging table into its target on the
   table's primary key: matched rows are updated, new rows inserted, and rows of this run
   that the new landing does not have are deleted where the landing rule says so
   (`infra.metrics.landing_rule`). All three tables change, or none does.
3. The staging tables are dropped (they also expire after a day, should a crash leave them).
   The rows are stored by then: a drop that fails is logged as a warning, and the landing
   succeeds (it failed, and the pipeline then rewrote a completed run's row to failed).

Running the landing twice, or again after a failure at any point, leaves the tables
holding the source's rows, once. A failed run's landing MERGEs without the delete,
and its `runs` row keeps the stored results it has no value for: an interrupted rerun of a
finished run keeps its evaluation. A completed run's deletes its stored eval rows it lacks
and step rows past its final step, and keeps step rows it lacks up to there (a damaged
`metrics.jsonl`). A sweep's trials (`sweeps`) land as exactly the sweep's rows, scoped by
`sweep_id` instead of `run_id`.

The schemas and SQL text the sink sends are built in `infra.metrics.bigquery_sql`; the
dataset's location check, the tables' creation and migration and the staging loads are in
`infra.metrics.bigquery_tables`. Every call to BigQuery takes its retries (`RETRY`) and time
limits from here, read at the call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from google.api_core.exceptions import NotFound
from google.cloud import bigquery

from infra.gcp.retries import concurrent_update, logged_retry
from infra.metrics import bigquery_tables
from infra.metrics.bigquery_sql import bq_schema, dedupe, merge_sql, sql_literal
from infra.metrics.bigquery_tables import STAGING_TTL, LocationError, SchemaError
from infra.metrics.landing_rule import landing_rule
from infra.metrics.rows import (
    ROW_MODELS,
    EvalMetricRow,
    LandResult,
    RunRow,
    StepMetricRow,
    SweepRow,
    TableRow,
    one_sweep_id,
)

__all__ = ["BigQuerySink", "LocationError", "SchemaError", "bq_schema"]

log = logging.getLogger(__name__)

# Transient errors of one call; a landing as a whole is safe to re-run anyway. The
# BigQuery library's own predicate, not a list of status codes: BigQuery answers its rate
# limits (e.g. too many updates of one table's metadata) with 403 rateLimitExceeded, which
# a status-code list cannot tell from 403 accessDenied, and a connection reset is no API
# error at all. Permanent errors (400, 403 accessDenied, 404) are not retried.
# (`_predicate`: the library gives no public accessor, and its own `Retry` cannot log.)
RETRY = logged_retry("BigQuery call failed", bigquery.DEFAULT_RETRY._predicate)
# A landing's transaction that BigQuery cancelled for another changing the same table (two
# runs or sweep trials landing at once): rolled back, so the whole script runs again.
CONFLICT_RETRY = logged_retry("BigQuery landing met a concurrent one", concurrent_update)
# Each HTTP request's own limit: the library's default is none, so a request whose answer
# never came hung a landing for good (RETRY's deadline is only checked between attempts).
CALL_TIMEOUT_S = 60.0
# A load or query job's wait for its result.
JOB_TIMEOUT_S = 300.0
# The shortest time limit of a request of a sink given little patience (`patience_s`).
MIN_CALL_S = 5.0


class BigQuerySink:
    """MetricsSink writing to a BigQuery dataset; the client is built once and passed in."""

    def __init__(
        self,
        client: bigquery.Client,
        dataset: str,
        project: str | None = None,
        location: str = "US",
        models: Sequence[type[TableRow]] = ROW_MODELS,
        patience_s: float | None = None,
    ) -> None:
        """Land into `project.dataset` (project defaults to the client's).

        Args:
            client: the BigQuery client.
            dataset: dataset id; created on first use.
            project: project of the dataset.
            location: the dataset's location, used when creating it and for every job.
            models: the row models, one table each (tests pass older versions).
            patience_s: how long each call may retry (and each request and job wait, at
                least `MIN_CALL_S`), below `RETRY`'s deadline and the time limits: a run
                stopped by a signal must exit within seconds, not retry an unreachable
                BigQuery for 300 s a call. None: the full deadlines.
        """
        self.client, self.location, self.models = client, location, tuple(models)
        self.dataset = f"{project or client.project}.{dataset}"
        self.patience_s = patience_s
        self._ready = False

    def ensure_tables(self) -> None:
        """Create the dataset and tables (day-partitioned, clustered by run_id), and add
        the columns the row models gained since a table was created (as NULLABLE).

        Raises:
            SchemaError: a column's type changed (BigQuery cannot convert it in place).
            LocationError: the dataset is in another location than `location`.
        """
        # Look first: an orchestrator granted only dataset-level roles may not create
        # datasets, and a create of an existing one would answer 403, not 409.
        if not self.check_location():
            bigquery_tables.create_dataset(
                self.client, self.dataset, self.location, **self._limits()
            )
        for model in self.models:
            self._ensure_table(model)
        self._ready = True

    def ensure_sweep_table(self) -> None:
        """Create the `sweeps` table, or migrate and check it as `land_sweep` does first,
        so a sweep it would refuse stops before any trial trains.

        Raises:
            SchemaError / LocationError: as `ensure_tables`.
        """
        if not self._ready:
            self.ensure_tables()
        self._ensure_table(SweepRow)

    def check_location(self) -> bool:
        """Whether the dataset exists; one `datasets.get`, cheap enough to run before a
        slice is provisioned.

        Returns:
            True if the dataset exists (in `location`), False if it does not yet.

        Raises:
            LocationError: it exists in another location than `location`.
        """
        return bigquery_tables.dataset_exists(
            self.client, self.dataset, self.location, **self._limits()
        )

    def land(
        self,
        run: RunRow,
        steps: Sequence[StepMetricRow],
        evals: Sequence[EvalMetricRow],
        fresh: bool = False,
    ) -> LandResult:
        """Land the rows of `run.run_id`, once each, by `infra.metrics.landing_rule`: a
        completed run's replace the stored ones (stored step rows it lacks up to its final
        step stay); a failed run's are added or updated, and the stored rows and results it
        has no value for are kept; a `fresh` run's replace every stored row.

        A step given twice (re-run after a resume) keeps its last row; likewise an eval's
        (step, split). See the module docstring for why a re-run cannot duplicate rows.

        Returns:
            Rows written per table, after de-duplication.

        Raises:
            ValueError: a step or eval row belongs to another run.
        """
        strays = {r.run_id for r in [*steps, *evals]} - {run.run_id}
        if strays:
            raise ValueError(f"rows of other runs {sorted(strays)} given to land {run.run_id!r}")
        if not self._ready:
            self.ensure_tables()
        by_table = {RunRow.table: [run], **dedupe([*steps, *evals])}
        statements = []
        for model in self.models:
            rows, rule = by_table.get(model.table, []), landing_rule(model, run, fresh)
            if rows:
                self._stage(model, run.run_id, rows)
                statements.append(
                    self._merge_sql(
                        model,
                        run.run_id,
                        kept=rule.kept,
                        deletes=rule.where("T."),
                        earliest=rule.earliest,
                    )
                )
            elif (where := rule.where()) is not None:
                statements.append(
                    f"DELETE FROM `{self._table(model)}` "
                    f"WHERE run_id = {sql_literal(run.run_id)} AND {where}"
                )
        script = "BEGIN TRANSACTION;\n" + ";\n".join(statements) + ";\nCOMMIT TRANSACTION;"
        landing = f"landing run {run.run_id} into {self.dataset}"
        with bigquery_tables.naming(f"{landing} (one transaction)"):
            self._query(script)
        self._drop_staging([self._staging(m, run.run_id) for m in self.models], landing)
        counts = {m.table: len(by_table.get(m.table, [])) for m in self.models}
        return LandResult(
            runs=counts.get(RunRow.table, 0),
            steps=counts.get(StepMetricRow.table, 0),
            evals=counts.get(EvalMetricRow.table, 0),
        )

    def land_sweep(self, rows: Sequence[SweepRow]) -> int:
        """Make the stored trials of one sweep exactly `rows`, once each (staging load +
        MERGE scoped by `sweep_id`, as for runs). A trial given twice keeps its last row.

        Args:
            rows: the sweep's trials (all of one `sweep_id`).

        Returns:
            Rows written, after de-duplication.

        Raises:
            ValueError: no rows, or rows of several sweeps.
        """
        sweep_id = one_sweep_id(rows)
        self.ensure_sweep_table()
        trials = dedupe(rows)[SweepRow.table]
        self._stage(SweepRow, sweep_id, trials)
        merge = self._merge_sql(SweepRow, sweep_id, scope_column="sweep_id")
        landing = f"landing sweep {sweep_id} into {self._table(SweepRow)}"
        with bigquery_tables.naming(landing):
            self._query(f"BEGIN TRANSACTION;\n{merge};\nCOMMIT TRANSACTION;")
        self._drop_staging([self._staging(SweepRow, sweep_id)], landing)
        return len(trials)

    def read_run(self, run_id: str) -> RunRow | None:
        """The `runs` row of `run_id`, or None if it has not landed (no dataset or table
        yet included: nothing has landed there, which is no error)."""
        # The model's columns: one a user added to the table is none of the row's.
        columns = ", ".join(RunRow.model_fields)
        sql = f"SELECT {columns} FROM `{self._table(RunRow)}` WHERE run_id = @run_id"
        try:
            with bigquery_tables.naming(f"reading run {run_id} from {self.dataset}"):
                rows = list(self._query(sql, run_id))
        except NotFound:
            return None
        return RunRow.model_validate(dict(rows[0].items())) if rows else None

    def query(self, sql: str, run_id: str | None = None) -> list[tuple]:
        """Run one statement (with an optional `@run_id` parameter); rows as tuples."""
        return [tuple(row.values()) for row in self._query(sql, run_id)]

    # -- internals --------------------------------------------------------------------

    def _limits(self) -> dict[str, Any]:
        """One call's `retry` and `timeout`: the module's, or within `patience_s`."""
        if self.patience_s is None:
            return {"retry": RETRY, "timeout": CALL_TIMEOUT_S}
        return {
            "retry": RETRY.with_timeout(min(RETRY.timeout, self.patience_s)),
            "timeout": self._within_patience(CALL_TIMEOUT_S),
        }

    def _job_timeout(self) -> float:
        return self._within_patience(JOB_TIMEOUT_S)

    def _within_patience(self, limit: float) -> float:
        """A request's or job's time limit, cut to `patience_s` (at least `MIN_CALL_S`)."""
        if self.patience_s is None:
            return limit
        return min(limit, max(self.patience_s, MIN_CALL_S))

    def _table(self, model: type[TableRow]) -> str:
        return f"{self.dataset}.{model.table}"

    def _staging(self, model: type[TableRow], scope: str) -> str:
        return bigquery_tables.staging_table(self.dataset, model, scope)

    def _drop_staging(self, tables: Sequence[str], landing: str) -> None:
        """Drop the staging tables of `landing`, whose MERGE has committed.

        The rows are stored: a failed drop must not fail the landing, or the pipeline
        rewrites a completed run's row to failed and exits 1. It is logged as a warning
        instead; the tables expire on their own (`STAGING_TTL`, set at their load). The
        first failure leaves the rest too, rather than retry each for RETRY's deadline.
        """
        for i, table in enumerate(tables):
            try:
                self.client.delete_table(table, not_found_ok=True, **self._limits())
            except Exception as exc:  # any failure: the landing's outcome is decided
                log.warning(
                    "%s: the rows are stored, but dropping the staging tables failed: %s; "
                    "left: %s (they expire on their own, %.0f h after their load)",
                    landing,
                    " ".join(str(exc).split()),
                    ", ".join(tables[i:]),
                    STAGING_TTL.total_seconds() / 3600,
                )
                return

    def _ensure_table(self, model: type[TableRow]) -> None:
        """Create the model's table (day-partitioned, clustered) or add its new columns."""
        have = bigquery_tables.create_table(
            self.client, self._table(model), model, **self._limits()
        )
        for sql in bigquery_tables.migration_sql(self._table(model), model, have):
            self._query(sql)

    def _stage(self, model: type[TableRow], scope: str, rows: Sequence[TableRow]) -> None:
        bigquery_tables.load_staging(
            self.client,
            self._staging(model, scope),
            self._table(model),
            model,
            rows,
            location=self.location,
            job_timeout=self._job_timeout(),
            **self._limits(),
        )

    def _merge_sql(
        self,
        model: type[TableRow],
        scope: str,
        scope_column: str = "run_id",
        kept: Sequence[str] = (),
        deletes: str | None = "TRUE",
        earliest: bool = True,
    ) -> str:
        """The MERGE of `scope`'s staging table into the model's (`bigquery_sql.merge_sql`)."""
        staging = self._staging(model, scope)
        table = self._table(model)
        return merge_sql(model, table, staging, scope, scope_column, kept, deletes, earliest)

    def _query(self, sql: str, run_id: str | None = None) -> Any:
        timeout = min(CONFLICT_RETRY.timeout, self.patience_s or CONFLICT_RETRY.timeout)
        return CONFLICT_RETRY.with_timeout(timeout)(self._query_once)(sql, run_id)

    def _query_once(self, sql: str, run_id: str | None) -> Any:
        params = [bigquery.ScalarQueryParameter("run_id", "STRING", run_id)] if run_id else []
        config = bigquery.QueryJobConfig(query_parameters=params)
        # job_retry=None: the library's job retry wraps RETRY in its own 600 s insert retry
        # (and waits up to 2400 s on a failed job): a MERGE answered 500 went on silently
        # for 15 minutes. A landing is safe to run again; RETRY bounds each call.
        limits = self._limits()
        job = self.client.query(
            sql, job_config=config, location=self.location, job_retry=None, **limits
        )
        return job.result(retry=limits["retry"], job_retry=None, timeout=self._job_timeout())
