"""The DuckDB sink's tables: created from the row models, migrated when an older version
made them, and checked against the models before anything lands in them.

A metrics file outlives the code that made it, and users open it (a notebook, a
dashboard) and may change its tables. Landing once trusted whatever it found: a `runs`
table made by hand without `config_hash`, keyed otherwise, or a view failed only when the
run landed, after the whole training run, with DuckDB's own words ("Referenced update
column config_hash not found in table!"), and a column of another type (an INTEGER
`eval_loss`) silently changed the values stored (3.8 landed as 4). Now a missing column is
added (nullable, as BigQuery's migration does), and an object that is not a table, a
column of another type or another primary key is refused (`SchemaError`) naming the table,
the column and what to do; the run checks this before it provisions anything
(`tasks.run_owner`). Columns the models do not know are left alone: reading a row picks
the models' own columns.
"""

from __future__ import annotations

import duckdb

from infra.metrics.rows import TableRow, table_schema

# How DuckDB's catalog names the types `rows.DUCKDB_TYPES` creates.
_CATALOG_TYPES = {"TIMESTAMPTZ": "TIMESTAMP WITH TIME ZONE"}


class SchemaError(RuntimeError):
    """An existing table of the metrics file differs from its row model in a way landing
    cannot migrate: not a table, a column of another type, another primary key."""


def create_table_sql(model: type[TableRow]) -> str:
    """`CREATE TABLE IF NOT EXISTS` for a row model: its columns, NOT NULLs and primary key.

    Args:
        model: a row model (RunRow, StepMetricRow, EvalMetricRow or SweepRow).

    Returns:
        The DDL statement.
    """
    columns = [f"{c.name} {c.type}{'' if c.nullable else ' NOT NULL'}" for c in table_schema(model)]
    columns.append(f"PRIMARY KEY ({', '.join(model.primary_key)})")
    return f"CREATE TABLE IF NOT EXISTS {model.table} (\n  " + ",\n  ".join(columns) + "\n)"


def prepare_table(con: duckdb.DuckDBPyConnection, model: type[TableRow]) -> None:
    """Create `model`'s table, or add the columns an older one lacks, and check it.

    Raises:
        SchemaError: the name holds a view, or a column's type or the primary key differs.
    """
    kinds = con.execute(
        "SELECT table_type FROM information_schema.tables "
        "WHERE table_name = ? AND table_schema = current_schema()",
        [model.table],
    ).fetchall()
    if kinds and kinds[0][0] != "BASE TABLE":
        # CREATE TABLE IF NOT EXISTS passes over a view of the name, and landing then failed.
        raise SchemaError(
            f"{model.table} is a {kinds[0][0].lower()}, not a table: landing upserts rows "
            f"into it; rename it, or land into another metrics file"
        )
    con.execute(create_table_sql(model))
    found = dict(
        con.execute(
            "SELECT column_name, data_type FROM information_schema.columns "
            "WHERE table_name = ? AND table_schema = current_schema()",
            [model.table],
        ).fetchall()
    )
    for column in table_schema(model):
        wanted = _CATALOG_TYPES.get(column.type, column.type)
        if column.name not in found:  # an older version's table, or one made by hand
            con.execute(f"ALTER TABLE {model.table} ADD COLUMN {column.name} {column.type}")
        elif found[column.name] != wanted:
            raise SchemaError(
                f"{model.table}.{column.name} is {found[column.name]}, not {wanted}: values "
                f"landed in it would be converted (a loss of 3.8 stored as 4 in an "
                f"INTEGER); change the column's type, or land into another metrics file"
            )
    keys = con.execute(
        "SELECT constraint_column_names FROM duckdb_constraints() "
        "WHERE table_name = ? AND schema_name = current_schema() "
        "AND constraint_type = 'PRIMARY KEY'",
        [model.table],
    ).fetchall()
    key = tuple(keys[0][0]) if keys else ()
    if key != model.primary_key:
        said = f"primary key ({', '.join(key)})" if key else "no primary key"
        raise SchemaError(
            f"{model.table} has {said}, not ({', '.join(model.primary_key)}): landing "
            "replaces a run's rows by that key; recreate the table with it, or land into "
            "another metrics file"
        )
