"""The production metrics sink: BigQuery tables created from the same row models as DuckDB.

Exactly-once landing, whatever is retried:

1. Each table's rows for the run are loaded into a staging table named after the run and
   the table with a load job (`WRITE_TRUNCATE`). A load job is atomic, and truncation makes
   a retried or repeated load replace the staging rows instead of adding to them. Streaming
   inserts (`insertAll`) are not used: a retry after a lost answer duplicates rows, and rows
   in the streaming buffer cannot be updated or deleted for up to 90 minutes.
2. One multi-statement transaction MERGEs every staging table into its target on the
   table's primary key: matched rows are updated, new rows inserted, and rows of this run
   that the new landing no longer has are deleted. All three tables change, or none does.
3. The staging tables are dropped (they also expire after a day, should a crash leave them).
   The rows are stored by then: a drop that fails is logged as a warning, and the landing
   succeeds (it failed, and the pipeline then rewrote a completed run's row to failed).

Running the landing twice, or again after a failure at any point, leaves the tables
holding exactly the source's rows, once. A failed run's landing MERGEs without the delete,
and its `runs` row keeps the stored results it has no value for (the landing rule in
`infra.metrics.rows`): an interrupted rerun of a finished run keeps its evaluation. A
sweep's trials (`sweeps`) land the same way as a completed run's, scoped by `sweep_id`
instead of `run_id`.

The schemas and SQL text the sink sends are built in `infra.metrics.bigquery_sql`; every
call to BigQuery, with its retries (`RETRY`) and time limits, is made here.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import io
import json
import logging
import re
from collections.abc import Iterator, Sequence
from typing import Any

from google.api_core import exceptions as gexc
from google.cloud import bigquery

from infra.gcp.retries import logged_retry
from infra.metrics.bigquery_sql import bq_schema, changed_types, dedupe, merge_sql, sql_literal
from infra.metrics.rows import (
    ROW_MODELS,
    EvalMetricRow,
    LandResult,
    RunRow,
    StepMetricRow,
    SweepRow,
    TableRow,
    one_sweep_id,
    replaces_landed,
)

log = logging.getLogger(__name__)

STAGING_TTL = dt.timedelta(days=1)
# Transient errors of one call; a landing as a whole is safe to re-run anyway. The
# BigQuery library's own predicate, not a list of status codes: BigQuery answers its rate
# limits (e.g. too many updates of one table's metadata) with 403 rateLimitExceeded, which
# a status-code list cannot tell from 403 accessDenied, and a connection reset is no API
# error at all. Permanent errors (400, 403 accessDenied, 404) are not retried.
# (`_predicate`: the library gives no public accessor, and its own `Retry` cannot log.)
RETRY = logged_retry("BigQuery call failed", bigquery.DEFAULT_RETRY._predicate)
# Each HTTP request's own limit: the library's default is none, so a request whose answer
# never came hung a landing for good (RETRY's deadline is only checked between attempts).
CALL_TIMEOUT_S = 60.0
# A load or query job's wait for its result.
JOB_TIMEOUT_S = 300.0


class SchemaError(RuntimeError):
    """A row model and its existing table disagree in a way BigQuery cannot migrate."""


class LocationError(RuntimeError):
    """The dataset exists in another location than the sink's jobs run in."""


class BigQuerySink:
    """MetricsSink writing to a BigQuery dataset; the client is built once and passed in."""

    def __init__(
        self,
        client: bigquery.Client,
        dataset: str,
        project: str | None = None,
        location: str = "US",
        models: Sequence[type[TableRow]] = ROW_MODELS,
    ) -> None:
        """Land into `project.dataset` (project defaults to the client's).

        Args:
            client: the BigQuery client.
            dataset: dataset id; created on first use.
            project: project of the dataset.
            location: the dataset's location, used when creating it and for every job.
            models: the row models, one table each (tests pass older versions).
        """
        self.client, self.location, self.models = client, location, tuple(models)
        self.dataset = f"{project or client.project}.{dataset}"
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
            ds = bigquery.Dataset(self.dataset)
            ds.location = self.location
            self.client.create_dataset(ds, exists_ok=True, retry=RETRY, timeout=CALL_TIMEOUT_S)
        for model in self.models:
            self._ensure_table(model)
        self._ready = True

    def check_location(self) -> bool:
        """Whether the dataset exists; one `datasets.get`, cheap enough to run before a
        slice is provisioned.

        Returns:
            True if the dataset exists (in `location`), False if it does not yet.

        Raises:
            LocationError: it exists in another location than `location`.
        """
        try:
            existing = self.client.get_dataset(self.dataset, retry=RETRY, timeout=CALL_TIMEOUT_S)
        except gexc.NotFound:
            return False
        # A job runs in one location: every load and MERGE would fail with "Not found:
        # Dataset ... in location US" for a dataset that exists, after the whole run.
        if (existing.location or self.location).lower() != self.location.lower():
            raise LocationError(
                f"BigQuery dataset {self.dataset} is in {existing.location}, but "
                f"metrics.location is {self.location}: set metrics.location to "
                f"{existing.location}"
            )
        return True

    def land(
        self, run: RunRow, steps: Sequence[StepMetricRow], evals: Sequence[EvalMetricRow]
    ) -> LandResult:
        """Land the rows of `run.run_id`, once each: a completed run's become exactly
        these; a failed run's are added or updated, and the stored rows and results it has
        no value for are kept.

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
        replace = replaces_landed(run)
        statements = []
        for model in self.models:
            rows = by_table.get(model.table, [])
            if rows:
                self._stage(model, run.run_id, rows)
                statements.append(self._merge_sql(model, run.run_id, replace=replace))
            elif replace:
                statements.append(
                    f"DELETE FROM `{self._table(model)}` WHERE run_id = {sql_literal(run.run_id)}"
                )
        script = "BEGIN TRANSACTION;\n" + ";\n".join(statements) + ";\nCOMMIT TRANSACTION;"
        landing = f"landing run {run.run_id} into {self.dataset}"
        with _naming(f"{landing} (one transaction)"):
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
        if not self._ready:
            self.ensure_tables()
        self._ensure_table(SweepRow)
        trials = dedupe(rows)[SweepRow.table]
        self._stage(SweepRow, sweep_id, trials)
        merge = self._merge_sql(SweepRow, sweep_id, scope_column="sweep_id")
        landing = f"landing sweep {sweep_id} into {self._table(SweepRow)}"
        with _naming(landing):
            self._query(f"BEGIN TRANSACTION;\n{merge};\nCOMMIT TRANSACTION;")
        self._drop_staging([self._staging(SweepRow, sweep_id)], landing)
        return len(trials)

    def read_run(self, run_id: str) -> RunRow | None:
        """The `runs` row of `run_id`, or None if it has not landed."""
        rows = list(
            self._query(f"SELECT * FROM `{self._table(RunRow)}` WHERE run_id = @run_id", run_id)
        )
        return RunRow.model_validate(dict(rows[0].items())) if rows else None

    def query(self, sql: str, run_id: str | None = None) -> list[tuple]:
        """Run one statement (with an optional `@run_id` parameter); rows as tuples."""
        return [tuple(row.values()) for row in self._query(sql, run_id)]

    # -- internals --------------------------------------------------------------------

    def _table(self, model: type[TableRow]) -> str:
        return f"{self.dataset}.{model.table}"

    def _staging(self, model: type[TableRow], scope: str) -> str:
        # Table names allow letters, digits and '_': the hash keeps distinct ids apart.
        safe = re.sub(r"[^A-Za-z0-9_]", "_", scope)[:200]
        digest = hashlib.sha256(scope.encode()).hexdigest()[:12]
        return f"{self.dataset}._staging_{model.table}_{safe}_{digest}"

    def _drop_staging(self, tables: Sequence[str], landing: str) -> None:
        """Drop the staging tables of `landing`, whose MERGE has committed.

        The rows are stored: a failed drop must not fail the landing, or the pipeline
        rewrites a completed run's row to failed and exits 1. It is logged as a warning
        instead; the tables expire on their own (`STAGING_TTL`, set at their load). The
        first failure leaves the rest too, rather than retry each for RETRY's deadline.
        """
        for i, table in enumerate(tables):
            try:
                self.client.delete_table(
                    table, not_found_ok=True, retry=RETRY, timeout=CALL_TIMEOUT_S
                )
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
        table = bigquery.Table(self._table(model), schema=bq_schema(model))
        table.time_partitioning = bigquery.TimePartitioning(
            type_=bigquery.TimePartitioningType.DAY, field=model.partition_field
        )
        table.clustering_fields = list(model.cluster_fields)
        existing = self.client.create_table(
            table, exists_ok=True, retry=RETRY, timeout=CALL_TIMEOUT_S
        )
        self._add_columns(model, {f.name: f.field_type for f in existing.schema})

    def _add_columns(self, model: type[TableRow], have: dict[str, str]) -> None:
        """Add the model's columns the table lacks; refuse a column whose type changed."""
        changed = changed_types(model, have)
        if changed:
            raise SchemaError(
                f"{self._table(model)}: column types changed ({', '.join(changed)}); BigQuery "
                "cannot convert them in place: add a new column instead"
            )
        for field in (f for f in bq_schema(model) if f.name not in have):
            # Always NULLABLE, even for a field the model requires: the rows already in the
            # table have no value for it. DDL rather than a schema patch, and IF NOT EXISTS,
            # so a concurrent or repeated migration is harmless.
            self._query(
                f"ALTER TABLE `{self._table(model)}` "
                f"ADD COLUMN IF NOT EXISTS {field.name} {field.field_type}"
            )

    def _stage(self, model: type[TableRow], scope: str, rows: Sequence[TableRow]) -> None:
        data = "".join(json.dumps(r.model_dump(mode="json")) + "\n" for r in rows).encode()
        config = bigquery.LoadJobConfig(
            schema=bq_schema(model),
            source_format=bigquery.SourceFormat.NEWLINE_DELIMITED_JSON,
            write_disposition=bigquery.WriteDisposition.WRITE_TRUNCATE,
            create_disposition=bigquery.CreateDisposition.CREATE_IF_NEEDED,
        )
        staging = self._staging(model, scope)
        with _naming(f"loading {len(rows)} rows for {self._table(model)} into {staging}"):
            self._load(staging, data, config)

    def _load(self, staging: str, data: bytes, config: bigquery.LoadJobConfig) -> None:
        # Dropped first: one a crash left (it lives a day) may have an older schema, which
        # the emulator keeps through WRITE_TRUNCATE, and the MERGE then misses columns.
        self.client.delete_table(staging, not_found_ok=True, retry=RETRY, timeout=CALL_TIMEOUT_S)
        job = self.client.load_table_from_file(
            io.BytesIO(data),
            staging,
            job_config=config,
            rewind=True,
            location=self.location,
            timeout=CALL_TIMEOUT_S,
        )
        job.result(retry=RETRY, timeout=JOB_TIMEOUT_S)
        table = self.client.get_table(staging, retry=RETRY, timeout=CALL_TIMEOUT_S)
        table.expires = dt.datetime.now(dt.UTC) + STAGING_TTL  # a crash's leftovers go away
        self.client.update_table(table, ["expires"], retry=RETRY, timeout=CALL_TIMEOUT_S)

    def _merge_sql(
        self,
        model: type[TableRow],
        scope: str,
        scope_column: str = "run_id",
        replace: bool = True,
    ) -> str:
        """The MERGE of `scope`'s staging table into the model's (`bigquery_sql.merge_sql`)."""
        staging = self._staging(model, scope)
        return merge_sql(model, self._table(model), staging, scope, scope_column, replace)

    def _query(self, sql: str, run_id: str | None = None) -> Any:
        params = [bigquery.ScalarQueryParameter("run_id", "STRING", run_id)] if run_id else []
        config = bigquery.QueryJobConfig(query_parameters=params)
        # job_retry=None: the library's job retry wraps RETRY in its own 600 s insert retry
        # (and waits up to 2400 s on a failed job): a MERGE answered 500 went on silently
        # for 15 minutes. A landing is safe to run again; RETRY bounds each call.
        job = self.client.query(
            sql,
            job_config=config,
            location=self.location,
            retry=RETRY,
            job_retry=None,
            timeout=CALL_TIMEOUT_S,
        )
        return job.result(retry=RETRY, job_retry=None, timeout=JOB_TIMEOUT_S)


@contextlib.contextmanager
def _naming(place: str) -> Iterator[None]:
    """Put `place` (the run, the table) in front of an API error's message, keeping its
    type: the library's own names only a URL ("503 POST .../jobs?uploadType=resumable")."""
    try:
        yield
    except (gexc.GoogleAPICallError, gexc.RetryError) as exc:
        exc.message = f"{place}: {exc.message}"
        raise
