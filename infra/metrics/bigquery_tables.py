"""The BigQuery sink's dataset and tables: where the dataset is, how a table is made and
migrated to its row model, and the staging tables a landing loads.

- The dataset must be in the location the sink's jobs run in (`LocationError`).
- A target table is day-partitioned on its row model's partition field and clustered by its
  cluster fields. One created by an older version gains the columns its model added since,
  always NULLABLE (`migration_sql`); a column whose type changed, or one made or changed
  by hand that would refuse the model's rows (`_refusals`), is refused (`SchemaError`).
  Column names are matched as BigQuery matches them, ignoring case.
- A staging table holds one landing's rows of one table: named after the landing's scope (a
  run or sweep id), loaded whole by one load job (`WRITE_TRUNCATE`), and expiring after
  `STAGING_TTL` should a crash leave it. The sink drops it once its MERGE has committed.

An API error of a call here, as of the sink's own, names what was being done (`naming`).
The calls take their retry policy and time limits as arguments: the sink
(`infra.metrics.bigquery_sink`) passes its `RETRY`, `CALL_TIMEOUT_S` and `JOB_TIMEOUT_S`, read
there at each call, so a test that patches `bigquery_sink.RETRY` changes these calls too.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import io
import json
import re
from collections.abc import Iterator, Sequence

from google.api_core import exceptions as gexc
from google.api_core.retry import Retry
from google.cloud import bigquery

from infra.gcp.retries import doing
from infra.metrics.bigquery_sql import bq_schema, changed_types
from infra.metrics.rows import TableRow, table_schema

STAGING_TTL = dt.timedelta(days=1)


class SchemaError(RuntimeError):
    """A row model and its existing table disagree in a way BigQuery cannot migrate."""


class LocationError(RuntimeError):
    """The dataset exists in another location than the sink's jobs run in."""


def create_dataset(
    client: bigquery.Client, dataset: str, location: str, *, retry: Retry, timeout: float
) -> None:
    """Create `dataset` (`project.dataset`) in `location` unless it exists."""
    ds = bigquery.Dataset(dataset)
    ds.location = location
    with naming(f"creating BigQuery dataset {dataset} in {location}"):
        client.create_dataset(ds, exists_ok=True, retry=retry, timeout=timeout)


def dataset_exists(
    client: bigquery.Client, dataset: str, location: str, *, retry: Retry, timeout: float
) -> bool:
    """Whether `dataset` exists; one `datasets.get`.

    Args:
        client: the BigQuery client.
        dataset: the dataset's full id, `project.dataset`.
        location: the location the sink's jobs run in.
        retry: the call's retry policy.
        timeout: the request's own time limit, in seconds.

    Returns:
        True if the dataset exists (in `location`), False if it does not yet.

    Raises:
        LocationError: it exists in another location than `location`.
    """
    try:
        with naming(f"looking up BigQuery dataset {dataset}"):
            existing = client.get_dataset(dataset, retry=retry, timeout=timeout)
    except gexc.NotFound:
        return False
    # A job runs in one location: every load and MERGE would fail with "Not found:
    # Dataset ... in location US" for a dataset that exists, after the whole run.
    if (existing.location or location).lower() != location.lower():
        raise LocationError(
            f"BigQuery dataset {dataset} is in {existing.location}, but "
            f"metrics.location is {location}: set metrics.location to "
            f"{existing.location}"
        )
    return True


def create_table(
    client: bigquery.Client, table_id: str, model: type[TableRow], *, retry: Retry, timeout: float
) -> dict[str, str]:
    """Create the model's table (day-partitioned, clustered) unless it exists.

    Args:
        client: the BigQuery client.
        table_id: the table's full id, `project.dataset.table`.
        model: its row model.
        retry: the call's retry policy.
        timeout: the request's own time limit, in seconds.

    Returns:
        The table's columns, lower-case name -> type as the API answered it (an existing
        table's may be older than the model's: see `migration_sql`).

    Raises:
        SchemaError: the name holds a view, or the table would refuse rows the model
            lands (`_refusals`).
    """
    table = bigquery.Table(table_id, schema=bq_schema(model))
    table.time_partitioning = bigquery.TimePartitioning(
        type_=bigquery.TimePartitioningType.DAY, field=model.partition_field
    )
    table.clustering_fields = list(model.cluster_fields)
    with naming(f"creating BigQuery table {table_id}"):
        existing = client.create_table(table, exists_ok=True, retry=retry, timeout=timeout)
    if existing.table_type not in (None, "TABLE"):
        # The migration's ALTER TABLE failed on it with a parser error naming nothing.
        raise SchemaError(
            f"{table_id} is a {existing.table_type.lower().replace('_', ' ')}, not a table: "
            "landing merges rows into it; rename it, or land into another metrics.dataset"
        )
    if problems := _refusals(existing, model):
        raise SchemaError(
            f"{table_id}: {'; '.join(problems)}: landing would fail after the whole training "
            "run; change the table so, or land into another metrics.dataset"
        )
    # By lower-case name: BigQuery's column names ignore case, so `Eval_Loss` is the
    # model's `eval_loss` (looked up as spelled, its type went unchecked, and a FLOAT64
    # landed in an INT64 column of that spelling).
    return {f.name.lower(): f.field_type for f in existing.schema}


def _refusals(table: bigquery.Table, model: type[TableRow]) -> list[str]:
    """What of a table made or changed by hand would refuse rows the model lands, each
    passing the check before provisioning and failing the landing after the training:
    a REQUIRED column a run may leave empty, or one the model does not know with no
    default; a REPEATED (ARRAY) column the model lands one value in; a required
    partition filter, which landing's MERGE and reads do not give."""
    nullable = {c.name: c.nullable for c in table_schema(model)}
    problems = []
    for field in table.schema:
        name = field.name.lower()
        # Each with its fix: one fixed hint named SET OPTIONS for a column's default too.
        drop = f"(ALTER TABLE ... ALTER COLUMN {field.name} DROP NOT NULL"
        if field.mode == "REPEATED" and name in nullable:
            problems.append(
                f"column {field.name} is REPEATED (an ARRAY), and rows land one value (no "
                "ALTER makes it a single value: drop it, or copy the table without it)"
            )
        elif field.mode == "REQUIRED" and nullable.get(name, False):
            problems.append(f"column {field.name} is REQUIRED, and rows may leave it empty {drop})")
        elif (
            field.mode == "REQUIRED" and name not in nullable and not field.default_value_expression
        ):
            problems.append(
                f"column {field.name} is REQUIRED with no default, and rows do not set it "
                f"{drop}, or ALTER COLUMN {field.name} SET DEFAULT ...)"
            )
    if table.require_partition_filter:
        problems.append(
            "it requires a partition filter, which landing's MERGE does not give (ALTER TABLE "
            "... SET OPTIONS (require_partition_filter = false))"
        )
    return problems


def migration_sql(table_id: str, model: type[TableRow], have: dict[str, str]) -> list[str]:
    """The statements adding the model's columns the table `table_id` lacks.

    Args:
        table_id: the table's full id.
        model: its row model.
        have: the table's columns, lower-case name -> type as the API answered it.

    Raises:
        SchemaError: a column's type changed (BigQuery cannot convert it in place).
    """
    changed = changed_types(model, have)
    if changed:
        raise SchemaError(
            f"{table_id}: column types changed ({', '.join(changed)}); BigQuery "
            "cannot convert them in place: add a new column instead"
        )
    # Always NULLABLE, even for a field the model requires: the rows already in the
    # table have no value for it. DDL rather than a schema patch, and IF NOT EXISTS,
    # so a concurrent or repeated migration is harmless.
    return [
        f"ALTER TABLE `{table_id}` ADD COLUMN IF NOT EXISTS {field.name} {field.field_type}"
        for field in bq_schema(model)
        if field.name not in have
    ]


def staging_table(dataset: str, model: type[TableRow], scope: str) -> str:
    """The full id of the staging table of `scope`'s (a run's or a sweep's) rows of the
    model's table in `dataset`."""
    # Table names allow letters, digits and '_': the hash keeps distinct ids apart.
    safe = re.sub(r"[^A-Za-z0-9_]", "_", scope)[:200]
    digest = hashlib.sha256(scope.encode()).hexdigest()[:12]
    return f"{dataset}._staging_{model.table}_{safe}_{digest}"


def load_staging(
    client: bigquery.Client,
    staging: str,
    table_id: str,
    model: type[TableRow],
    rows: Sequence[TableRow],
    *,
    location: str,
    retry: Retry,
    timeout: float,
    job_timeout: float,
) -> None:
    """Make the staging table `staging` hold exactly `rows`, expiring after `STAGING_TTL`.

    An API error names the load ("loading 5 rows for <table> into <staging>: ...").

    Args:
        client: the BigQuery client.
        staging: the staging table's full id (`staging_table`).
        table_id: the full id of the table `rows` are for, to name in an error.
        model: the row model of `rows`.
        rows: the rows, all of one table.
        location: the location the load job runs in.
        retry: each call's retry policy.
        timeout: each request's own time limit, in seconds.
        job_timeout: the load job's wait for its result, in seconds.
    """
    data = "".join(json.dumps(r.model_dump(mode="json")) + "\n" for r in rows).encode()
    config = bigquery.LoadJobConfig(
        schema=bq_schema(model),
        source_format=bigquery.SourceFormat.NEWLINE_DELIMITED_JSON,
        write_disposition=bigquery.WriteDisposition.WRITE_TRUNCATE,
        create_disposition=bigquery.CreateDisposition.CREATE_IF_NEEDED,
    )
    with naming(f"loading {len(rows)} rows for {table_id} into {staging}"):
        # Dropped first: one a crash left (it lives a day) may have an older schema, which
        # the emulator keeps through WRITE_TRUNCATE, and the MERGE then misses columns.
        client.delete_table(staging, not_found_ok=True, retry=retry, timeout=timeout)
        job = client.load_table_from_file(
            io.BytesIO(data),
            staging,
            job_config=config,
            rewind=True,
            location=location,
            timeout=timeout,
        )
        job.result(retry=retry, timeout=job_timeout)
        table = client.get_table(staging, retry=retry, timeout=timeout)
        table.expires = dt.datetime.now(dt.UTC) + STAGING_TTL  # a crash's leftovers go away
        client.update_table(table, ["expires"], retry=retry, timeout=timeout)


@contextlib.contextmanager
def naming(place: str) -> Iterator[None]:
    """Put `place` (the run, the table) in front of an API error's message, keeping its
    type: the library's own names only a URL ("503 POST .../jobs?uploadType=resumable")."""
    try:
        with doing(place):  # and in the warnings of the retries on the way
            yield
    except (gexc.GoogleAPICallError, gexc.RetryError) as exc:
        exc.message = f"{place}: {exc.message}"
        raise
