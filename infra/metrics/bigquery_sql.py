"""What the BigQuery sink sends besides its API calls: the tables' columns in BigQuery's
types (and which of them a table has with another type), the rows of each table
de-duplicated, and the SQL text of a landing (the MERGE of a staging table into its
target, a run id as a literal).

Pure functions, no client: the calls are in `infra.metrics.bigquery_sink` (with their retries
and time limits) and `infra.metrics.bigquery_tables`, which build on these (the sink
re-exports `bq_schema`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from google.cloud import bigquery

from infra.metrics.rows import TableRow, table_schema

# The row models speak DuckDB types; these are their BigQuery names.
BQ_TYPES = {
    "VARCHAR": "STRING",
    "BIGINT": "INT64",
    "DOUBLE": "FLOAT64",
    "BOOLEAN": "BOOL",
    "TIMESTAMPTZ": "TIMESTAMP",
}
# The API may answer with the legacy SQL names of the types.
_LEGACY = {"INTEGER": "INT64", "FLOAT": "FLOAT64", "BOOLEAN": "BOOL"}
_SAFE_RUN_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,256}$")


def bq_schema(model: type[TableRow]) -> list[bigquery.SchemaField]:
    """BigQuery columns of a row model's table, in field order."""
    return [
        bigquery.SchemaField(
            c.name, BQ_TYPES[c.type], mode="NULLABLE" if c.nullable else "REQUIRED"
        )
        for c in table_schema(model)
    ]


def changed_types(model: type[TableRow], have: dict[str, str]) -> list[str]:
    """The model's columns whose type differs from its table's, as `name OLD -> NEW`.

    Args:
        model: the row model.
        have: the table's columns, lower-case name -> type as the API answered it.
    """
    return [
        f"{f.name} {have[f.name]} -> {f.field_type}"
        for f in bq_schema(model)
        if f.name in have and _LEGACY.get(have[f.name], have[f.name]) != f.field_type
    ]


def merge_sql(
    model: type[TableRow],
    table: str,
    staging: str,
    scope: str,
    scope_column: str = "run_id",
    kept: Sequence[str] = (),
    deletes: str | None = "TRUE",
    earliest: bool = True,
) -> str:
    """The MERGE of the staging table into its target on the model's primary key.

    Args:
        model: the row model of both tables.
        table: the target table's full id.
        staging: the staging table's full id.
        scope: the value of `scope_column` whose rows this landing owns.
        scope_column: `run_id`, or `sweep_id` for a sweep's trials.
        kept: columns a NULL in the staging row does not overwrite.
        deletes: which target rows of `scope` absent from the staging table are deleted:
            a condition on the target row `T` ("TRUE": every one), or None for none
            (`infra.metrics.landing_rule.LandingRule.where`).
        earliest: whether the model's `earliest_fields` keep an earlier stored value.

    Returns:
        One MERGE statement.
    """
    # An earliest column (the run's `started_at`) never moves later, but in a fresh landing.
    columns = [c.name for c in table_schema(model)]
    key = " AND ".join(f"T.{k} = S.{k}" for k in model.primary_key)
    updates = ", ".join(
        f"{c} = LEAST(S.{c}, T.{c})"
        if earliest and c in model.earliest_fields
        else f"{c} = COALESCE(S.{c}, T.{c})"
        if c in kept
        else f"{c} = S.{c}"
        for c in columns
        if c not in model.primary_key
    )
    names = ", ".join(columns)
    values = ", ".join(f"S.{c}" for c in columns)
    delete = ""
    if deletes is not None:
        condition = "" if deletes == "TRUE" else f" AND {deletes}"
        delete = (
            f"\nWHEN NOT MATCHED BY SOURCE AND T.{scope_column} = {sql_literal(scope)}"
            f"{condition} THEN DELETE"
        )
    return (
        f"MERGE `{table}` T\n"
        f"USING `{staging}` S\nON {key}\n"
        f"WHEN MATCHED THEN UPDATE SET {updates}\n"
        f"WHEN NOT MATCHED BY TARGET THEN INSERT ({names}) VALUES ({values})"
        f"{delete}"
    )


def sql_literal(run_id: str) -> str:
    """`run_id` as a SQL string literal, for the transaction script.

    Query parameters would be the usual way, and BigQuery accepts them in scripts, but
    the emulator does not; a run id restricted to characters that need no escaping is as
    safe (run names are `[a-z0-9-]` anyway).

    Raises:
        ValueError: the run id holds other characters.
    """
    if not _SAFE_RUN_ID.fullmatch(run_id):
        raise ValueError(f"run id {run_id!r} must match {_SAFE_RUN_ID.pattern} to be landed")
    return f"'{run_id}'"


def dedupe(rows: Sequence[TableRow]) -> dict[str, list[TableRow]]:
    """Rows per table, the last one per primary key kept (the re-run after a resume is
    the one that counted), in key order."""
    out: dict[str, dict[tuple, TableRow]] = {}
    for row in rows:
        out.setdefault(row.table, {})[tuple(getattr(row, k) for k in row.primary_key)] = row
    return {table: [keyed[k] for k in sorted(keyed)] for table, keyed in out.items()}
