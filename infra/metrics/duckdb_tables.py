"""The DuckDB sink's tables: created from the row models, migrated when an older version
made them, and checked against the models before anything lands in them.

A metrics file outlives the code that made it, and users open it (a notebook, a
dashboard) and may change its tables. Landing once trusted whatever it found: a `runs`
table made by hand without `config_hash`, keyed otherwise, or a view failed only when the
run landed, after the whole training run, with DuckDB's own words ("Referenced update
column config_hash not found in table!"), and a column of another type (an INTEGER
`eval_loss`) silently changed the values stored (3.8 landed as 4). Now a missing column is
added (nullable, as BigQuery's migration does), and an object that is not a table, a
column of another type, another primary key or a constraint that would refuse a row (a
NOT NULL, UNIQUE or CHECK made by hand) is refused (`SchemaError`) naming the table,
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
    cannot migrate: not a table, a column of another type, another primary key, or a
    constraint that would refuse the model's rows."""


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

    Names are matched as DuckDB matches them, ignoring case: a table made by hand as
    `"Runs"` with a column `"Run_Id"` is the model's (a case-sensitive look-up found no
    `run_id` and tried to add it, which DuckDB refused).

    Raises:
        SchemaError: the name holds a view, a column's type or the primary key differs,
            or the table would refuse rows the model lands (see `_refusals`).
    """
    kinds = con.execute(
        "SELECT table_type FROM information_schema.tables "
        "WHERE lower(table_name) = ? AND table_schema = current_schema()",
        [model.table],
    ).fetchall()
    if kinds and kinds[0][0] != "BASE TABLE":
        # CREATE TABLE IF NOT EXISTS passes over a view of the name, and landing then failed.
        raise SchemaError(
            f"{model.table} is a {kinds[0][0].lower()}, not a table: landing upserts rows "
            f"into it; rename it, or land into another metrics file"
        )
    con.execute(create_table_sql(model))
    found = {
        name.lower(): (kind, nullable == "YES", default)
        for name, kind, nullable, default in con.execute(
            "SELECT column_name, data_type, is_nullable, column_default "
            "FROM information_schema.columns "
            "WHERE lower(table_name) = ? AND table_schema = current_schema()",
            [model.table],
        ).fetchall()
    }
    for column in table_schema(model):
        wanted = _CATALOG_TYPES.get(column.type, column.type)
        if column.name not in found:  # an older version's table, or one made by hand
            con.execute(f"ALTER TABLE {model.table} ADD COLUMN {column.name} {column.type}")
        elif found[column.name][0] != wanted:
            raise SchemaError(
                f"{model.table}.{column.name} is {found[column.name][0]}, not {wanted}: values "
                f"landed in it would be converted (a loss of 3.8 stored as 4 in an "
                f"INTEGER); change the column's type, or land into another metrics file"
            )
    constraints = con.execute(
        "SELECT constraint_type, constraint_column_names, constraint_text "
        "FROM duckdb_constraints() "
        "WHERE lower(table_name) = ? AND schema_name = current_schema()",
        [model.table],
    ).fetchall()
    keys = [cols for kind, cols, _ in constraints if kind == "PRIMARY KEY"]
    key = tuple(c.lower() for c in keys[0]) if keys else ()
    if key != model.primary_key:
        said = f"primary key ({', '.join(key)})" if key else "no primary key"
        raise SchemaError(
            f"{model.table} has {said}, not ({', '.join(model.primary_key)}): landing "
            "replaces a run's rows by that key; recreate the table with it, or land into "
            "another metrics file"
        )
    if problems := _refusals(model, found, constraints) + _refusals_beside(con, model):
        raise SchemaError(
            f"{model.table}: {'; '.join(problems)}: landing would fail after the whole "
            "training run; drop them (ALTER TABLE), or land into another metrics file"
        )


def _refusals(model: type[TableRow], found: dict, constraints: list) -> list[str]:
    """What of a table made or changed by hand would refuse rows the model lands: a NOT
    NULL on a column the model leaves empty, a NOT NULL column it does not know with no
    default, a UNIQUE, CHECK or FOREIGN KEY constraint. Each passed the check before
    provisioning, and the run failed at landing ("NOT NULL constraint failed:
    runs.cost_usd" for an unpriced run)."""
    nullable = {c.name: c.nullable for c in table_schema(model)}
    problems = []
    for name, (_, may_be_null, default) in found.items():
        if may_be_null or nullable.get(name) is False:
            continue
        if name in nullable:
            problems.append(f"column {name} is NOT NULL, and rows may leave it empty")
        elif default is None:
            problems.append(f"column {name} is NOT NULL with no default, and rows do not set it")
    problems += [
        f"constraint {text}"
        for kind, _, text in constraints
        if kind in ("UNIQUE", "CHECK", "FOREIGN KEY")
    ]
    return problems


def _refusals_beside(con: duckdb.DuckDBPyConnection, model: type[TableRow]) -> list[str]:
    """What outside the table's own definition would refuse its rows: a UNIQUE index on
    it, or a foreign key of another table referring to it (landing replaces a run's rows,
    and a completed run's rerun then landed `failed` on "violates foreign key")."""
    unique = con.execute(
        "SELECT sql FROM duckdb_indexes() WHERE lower(table_name) = ? "
        "AND schema_name = current_schema() AND is_unique",
        [model.table],
    ).fetchall()
    referring = con.execute(
        "SELECT table_name, constraint_text FROM duckdb_constraints() "
        "WHERE constraint_type = 'FOREIGN KEY' AND lower(referenced_table) = ? "
        "AND schema_name = current_schema()",
        [model.table],
    ).fetchall()
    return [f"unique index {sql.rstrip(';')}" for (sql,) in unique] + [
        f"table {table} refers to it ({text})" for table, text in referring
    ]
