"""The embedded metrics sink: one DuckDB file with the `runs`, `step_metrics` and
`eval_metrics` tables (and `sweeps`, once a sweep lands), created from the row models.

A connection is opened per operation and closed after it: DuckDB lets one process at a
time hold a file open for writing, so sweep trials in several processes take turns, and
a connection attempt that meets another process's lock is retried for a while. Within one
process, connections to a file share one database, where two threads' concurrent DDL
(the tables' `CREATE`/`ADD COLUMN IF NOT EXISTS`) fails with a write-write conflict: so
operations on a file also take turns between threads (sweep trials run as threads).

A new file is created complete, with its tables, under a temporary name and then linked
into place (`infra.metrics.duckdb_file`): a create that fails leaves no stub behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb

from infra.metrics.duckdb_file import create_database, file_lock, lock_conflict, read_whole
from infra.metrics.duckdb_tables import prepare_table
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
    table_schema,
)


class MetricsLocked(RuntimeError):
    """Another process kept the DuckDB file open past the sink's lock timeout."""


@contextlib.contextmanager
def _transaction(con: duckdb.DuckDBPyConnection) -> Iterator[None]:
    """All of the block's statements, or (on any error) none of them."""
    con.execute("BEGIN TRANSACTION")
    try:
        yield
        con.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(duckdb.Error):
            con.execute("ROLLBACK")
        raise


class DuckDBSink:
    """MetricsSink writing to a DuckDB file."""

    def __init__(self, path: str | os.PathLike[str], lock_timeout_s: float = 30.0) -> None:
        """Use the DuckDB file at `path`, creating its parent directories.

        Args:
            path: the database file (created on first use).
            lock_timeout_s: how long to keep retrying while another process holds the file.
        """
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.lock_timeout_s = lock_timeout_s

    def ensure_tables(self) -> None:
        """Create the three tables if they do not exist yet."""
        with self._connect() as con:
            self._create_tables(con)

    def land(
        self,
        run: RunRow,
        steps: Sequence[StepMetricRow],
        evals: Sequence[EvalMetricRow],
        fresh: bool = False,
    ) -> LandResult:
        """Land the rows of `run.run_id`, atomically, by `infra.metrics.landing_rule`: a
        completed run's replace the stored ones (stored step rows it lacks up to its final
        step stay); a failed run's are added or updated, and the stored rows and results it
        has no value for are kept; a `fresh` run's replace every stored row.

        Landing the same run again leaves one copy of each row. A step given twice (re-run
        after a resume) keeps its last row; likewise an eval's (step, split).

        Args:
            run: the run's summary row.
            steps: its step metrics, in the order they were recorded.
            evals: its evaluation rows, in the order they were recorded.

        Returns:
            Rows written per table, after de-duplication.

        Raises:
            ValueError: a step or eval row belongs to another run.
        """
        strays = {r.run_id for r in [*steps, *evals]} - {run.run_id}
        if strays:
            raise ValueError(f"rows of other runs {sorted(strays)} given to land {run.run_id!r}")
        # Dicts keep the last row per key: the re-run after a resume is the one that counted.
        step_rows = sorted({r.step: r for r in steps}.values(), key=lambda r: r.step)
        eval_rows = sorted({(r.step, r.split): r for r in evals}.values(), key=_eval_key)
        with self._connect() as con:
            self._create_tables(con)
            # In one transaction, as BigQuery's MERGE with "WHEN NOT MATCHED BY SOURCE AND
            # <the rule's condition> THEN DELETE" does it.
            with _transaction(con):
                rule = landing_rule(RunRow, run, fresh)
                tables: list[tuple[type[TableRow], Sequence[TableRow]]] = [
                    (RunRow, [_keep_stored(con, run, rule.kept, rule.earliest)]),
                    (StepMetricRow, step_rows),
                    (EvalMetricRow, eval_rows),
                ]
                for model, rows in tables:
                    where = landing_rule(model, run, fresh).where()
                    if where is not None:
                        con.execute(
                            f"DELETE FROM {model.table} WHERE run_id = ? AND {where}", [run.run_id]
                        )
                    self._upsert(con, model, rows)
        return LandResult(runs=1, steps=len(step_rows), evals=len(eval_rows))

    def land_sweep(self, rows: Sequence[SweepRow]) -> int:
        """Make the stored trials of one sweep exactly `rows`, atomically.

        Landing the same sweep again leaves one row per trial; a trial given twice keeps
        its last row.

        Args:
            rows: the sweep's trials (all of one `sweep_id`).

        Returns:
            Rows written, after de-duplication.

        Raises:
            ValueError: no rows, or rows of several sweeps.
        """
        sweep_id = one_sweep_id(rows)
        trials = sorted({r.trial: r for r in rows}.values(), key=lambda r: r.trial)
        with self._connect() as con:
            self._create_table(con, SweepRow)
            with _transaction(con):
                con.execute("DELETE FROM sweeps WHERE sweep_id = ?", [sweep_id])
                self._insert(con, SweepRow, trials)
        return len(trials)

    def ensure_sweep_table(self) -> None:
        """Create the `sweeps` table, or check it as `land_sweep` does first, so a sweep
        it would refuse stops before any trial trains (`tasks.access.check_sweeps_table`).

        Raises:
            SchemaError: the table would refuse the sweep's rows (`prepare_table`).
        """
        with self._connect() as con:
            self._create_table(con, SweepRow)

    def check_readable(self, run_id: str) -> None:
        """Read every value of the tables landing writes (`duckdb_file.read_whole`), then
        land a row of `run_id` in each in a transaction rolled back: its delete and upsert
        read the primary keys' indexes along that key (a damaged index block passed the
        values' read, and the landing failed on it after training).

        Raises:
            duckdb.Error: a block of the file cannot be read.
        """
        now = datetime.now(UTC)
        probes = {
            RunRow: RunRow(
                run_id=run_id, run_name=run_id, status="failed", config_hash="",
                config_json="{}", dataset_fingerprint="", started_at=now, run_dir="",
            ),
            StepMetricRow: StepMetricRow(run_id=run_id, step=0, recorded_at=now),
            EvalMetricRow: EvalMetricRow(run_id=run_id, step=0, tokens=0, recorded_at=now),
        }  # fmt: skip
        with self._connect() as con:
            tables = read_whole(con, self.path, [m.table for m in (*ROW_MODELS, SweepRow)])
            con.execute("BEGIN TRANSACTION")
            try:
                for model, row in probes.items():
                    if model.table in tables:
                        con.execute(f"DELETE FROM {model.table} WHERE run_id = ?", [run_id])
                        self._upsert(con, model, [row])
            except BaseException:
                with contextlib.suppress(duckdb.Error):  # the read's error is the one to tell
                    con.execute("ROLLBACK")
                raise
            con.execute("ROLLBACK")

    def read_run(self, run_id: str) -> RunRow | None:
        """The `runs` row of `run_id`, or None if it has not landed."""
        with self._connect() as con:
            self._create_tables(con)
            # The model's columns: one a user added to the table is none of the row's.
            columns = ", ".join(RunRow.model_fields)
            cur = con.execute(f"SELECT {columns} FROM runs WHERE run_id = ?", [run_id])
            row = cur.fetchone()
        # By the model's names: DuckDB names a result column as the table spells it ("Run_Id").
        if row is None:
            return None
        return RunRow.model_validate(dict(zip(RunRow.model_fields, row, strict=True)))

    def query(self, sql: str, params: Sequence[Any] | None = None) -> list[tuple]:
        """Run one SQL statement and return all its rows (timestamps come back in UTC).

        Args:
            sql: the statement, with `?` or `$n` placeholders.
            params: their values.

        Returns:
            The result rows as tuples.
        """
        with self._connect() as con:
            return con.execute(sql, params or []).fetchall()

    # -- internals --------------------------------------------------------------------

    @contextlib.contextmanager
    def _connect(self) -> Iterator[duckdb.DuckDBPyConnection]:
        with file_lock(self.path):
            if not os.path.lexists(self.path):
                # Not DuckDB's own create: on a full disk it left a stub at the path that
                # every later connect refuses (see `infra.metrics.duckdb_file`).
                create_database(self.path, self._create_tables)
            with self._open() as con:
                yield con

    @contextlib.contextmanager
    def _open(self) -> Iterator[duckdb.DuckDBPyConnection]:
        deadline = time.monotonic() + self.lock_timeout_s
        delay = 0.02
        while True:
            try:
                con = duckdb.connect(str(self.path))
                break
            except duckdb.IOException as e:
                # Only the other-process file lock is worth waiting for; re-raise the rest.
                if not lock_conflict(e):
                    raise
                if time.monotonic() >= deadline:
                    raise MetricsLocked(self._locked_message(str(e))) from e
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
        try:
            con.execute("SET TimeZone = 'UTC'")
            yield con
        finally:
            con.close()

    def _locked_message(self, error: str) -> str:
        holder = re.search(r"held in (.+?) \(PID (\d+)\)", error)
        who = f"process {holder[2]} ({holder[1]})" if holder else "another process"
        return (
            f"metrics database {self.path} is held open by {who} for over "
            f"{self.lock_timeout_s:.0f} s: DuckDB lets one process at a time open a file "
            "while another writes it, read-only connections too. Close that connection (a "
            "notebook, a duckdb shell) and run the same command again: a run whose training "
            "finished lands its metrics without training again"
        )

    @classmethod
    def _create_tables(cls, con: duckdb.DuckDBPyConnection) -> None:
        for model in ROW_MODELS:
            cls._create_table(con, model)

    @staticmethod
    def _create_table(con: duckdb.DuckDBPyConnection, model: type[TableRow]) -> None:
        prepare_table(con, model)

    @staticmethod
    def _insert(
        con: duckdb.DuckDBPyConnection, model: type[TableRow], rows: Sequence[TableRow]
    ) -> None:
        if rows:
            con.execute(*_insert_sql(model, rows))

    @staticmethod
    def _upsert(
        con: duckdb.DuckDBPyConnection, model: type[TableRow], rows: Sequence[TableRow]
    ) -> None:
        if rows:
            sql, values = _insert_sql(model, rows)
            con.execute(sql + _on_conflict_update(model), values)


def _insert_sql(model: type[TableRow], rows: Sequence[TableRow]) -> tuple[str, list[list]]:
    """One INSERT of `rows` and its parameters: one list per column, unnested side by side
    (~0.05 s for 10k rows where executemany, a prepared INSERT per row, took ~10 s)."""
    columns = table_schema(model)
    select = ", ".join(f"unnest(${i}::{c.type}[])" for i, c in enumerate(columns, 1))
    names = ", ".join(c.name for c in columns)
    values = [[getattr(r, c.name) for r in rows] for c in columns]
    return f"INSERT INTO {model.table} ({names}) SELECT {select}", values


def _on_conflict_update(model: type[TableRow]) -> str:
    """The upsert clause: a stored row with the same key takes the new values (the stored
    values a landing keeps are put into the new row first: `_keep_stored`)."""
    sets = [
        f"{c.name} = excluded.{c.name}"
        for c in table_schema(model)
        if c.name not in model.primary_key
    ]
    keys = ", ".join(model.primary_key)
    return f" ON CONFLICT ({keys}) DO UPDATE SET {', '.join(sets)}"


def _keep_stored(
    con: duckdb.DuckDBPyConnection, run: RunRow, kept: Sequence[str], earliest: bool = True
) -> RunRow:
    """`run` with each of `RunRow.earliest_fields` no later than the stored row's (unless
    not `earliest`), and each column of `kept` it has no value for taken from the stored
    row."""
    names = [*(RunRow.earliest_fields if earliest else ()), *kept]
    if not names:
        return run
    query = f"SELECT {', '.join(names)} FROM {RunRow.table} WHERE run_id = ?"
    stored = con.execute(query, [run.run_id]).fetchone()
    if stored is None:
        return run
    update = {}
    for name, old in zip(names, stored, strict=True):
        new = getattr(run, name)
        if old is not None and (
            new is None or (earliest and name in RunRow.earliest_fields and old < new)
        ):
            update[name] = old
    return run.model_copy(update=update) if update else run


def _eval_key(row: EvalMetricRow) -> tuple[int, str]:
    return row.step, row.split
