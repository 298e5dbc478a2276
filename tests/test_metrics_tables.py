"""DuckDB metrics tables a user (or another version) made or changed: each either lands as
it should or is refused before the run, naming the table and column, never after training
with DuckDB's own words or with values converted on the way in."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

from infra.metrics import DuckDBSink
from infra.metrics.duckdb_tables import SchemaError
from tasks.plan import plan_run
from tasks.run_owner import check_run_owner
from tests.helpers import tiny_config
from tests.test_metrics_sink import evals, run_row, steps
from workloads.config_file import ConfigError


def _file(tmp_path, *statements: str) -> str:
    path = str(tmp_path / "metrics.duckdb")
    DuckDBSink(path).ensure_tables()
    with duckdb.connect(path) as con:
        for statement in statements:
            con.execute(statement)
    return path


def test_a_column_a_user_added_is_left_alone_and_rows_still_read(tmp_path):
    # Reading a run's row took every column: "notes: Extra inputs are not permitted", and
    # a rerun of a landed run failed at its landing after training.
    sink = DuckDBSink(_file(tmp_path, "ALTER TABLE runs ADD COLUMN notes VARCHAR"))
    sink.land(run_row(), steps(), evals())
    assert sink.read_run("run-1").final_step == run_row().final_step
    sink.land(run_row(), steps(), evals())  # a rerun lands over it
    assert sink.query("SELECT count(*) FROM runs") == [(1,)]


def test_names_match_as_duckdb_matches_them_whatever_their_case(tmp_path):
    # A table made as "Runs" with "Run_Id": the check looked up run_id case-sensitively,
    # tried to add it, and DuckDB refused ("Column with name run_id already exists!").
    path = str(tmp_path / "metrics.duckdb")
    with duckdb.connect(path) as con:
        con.execute(
            'CREATE TABLE "Runs" ("Run_Id" VARCHAR PRIMARY KEY, "Status" VARCHAR, '
            "note VARCHAR NOT NULL DEFAULT 'none')"  # a column with a default takes any row
        )
    sink = DuckDBSink(path)
    sink.land(run_row(), steps(), evals())
    sink.land(run_row(), steps(), evals())
    assert sink.read_run("run-1").status == run_row().status
    assert sink.query("SELECT count(*), min(note) FROM runs") == [(1, "none")]


def test_a_table_made_without_a_column_gets_it(tmp_path):
    path = str(tmp_path / "metrics.duckdb")
    with duckdb.connect(path) as con:  # by hand: config_hash missing, as the probe's was
        con.execute("CREATE TABLE runs (run_id VARCHAR PRIMARY KEY, status VARCHAR)")
    sink = DuckDBSink(path)
    sink.land(run_row(), steps(), evals())
    assert sink.read_run("run-1").config_hash == run_row().config_hash


@pytest.mark.parametrize(
    ("statements", "said"),
    [
        (
            [
                "DROP TABLE runs",
                "CREATE TABLE runs (run_id VARCHAR PRIMARY KEY, eval_loss INTEGER)",
            ],
            r"runs\.eval_loss is INTEGER, not DOUBLE",
        ),
        (
            ["DROP TABLE step_metrics", "CREATE TABLE step_metrics (run_id VARCHAR, step BIGINT)"],
            r"step_metrics has no primary key, not \(run_id, step\)",
        ),
        (
            ["DROP TABLE eval_metrics", "CREATE TABLE eval_metrics (run_id VARCHAR PRIMARY KEY)"],
            r"eval_metrics has primary key \(run_id\), not \(run_id, step, split\)",
        ),
        (["DROP TABLE runs", "CREATE VIEW runs AS SELECT 1 AS run_id"], r"runs is a view"),
        # Each of these passed the check and failed the landing, after training.
        (
            ["ALTER TABLE runs ALTER COLUMN cost_usd SET NOT NULL"],
            r"runs: column cost_usd is NOT NULL, and rows may leave it empty",
        ),
        (
            [
                "DROP TABLE runs",
                "CREATE TABLE runs (run_id VARCHAR PRIMARY KEY, note TEXT NOT NULL)",
            ],
            r"column note is NOT NULL with no default, and rows do not set it",
        ),
        (
            [
                "DROP TABLE runs",
                "CREATE TABLE runs (run_id VARCHAR PRIMARY KEY, config_hash VARCHAR UNIQUE)",
            ],
            r"runs: constraint UNIQUE\(config_hash\): landing would fail",
        ),
        (
            [
                "DROP TABLE runs",
                "CREATE TABLE runs (run_id VARCHAR PRIMARY KEY, "
                "status VARCHAR CHECK (status = 'completed'))",
            ],
            r"runs: constraint CHECK\(\(status = 'completed'\)\)",
        ),
        # Outside the table's definition, they passed too: the second failed a completed
        # run's rerun at landing, which turned its row into `failed`.
        (["CREATE UNIQUE INDEX one_per_hash ON runs (config_hash)"], r"unique index CREATE"),
        (
            ["CREATE TABLE notes (run_id VARCHAR REFERENCES runs (run_id), note VARCHAR)"],
            r"runs: table notes refers to it \(FOREIGN KEY \(run_id\) REFERENCES runs",
        ),
    ],
    ids=[
        "column-type",
        "no-key",
        "other-key",
        "view",
        "not-null",
        "extra-not-null",
        "unique",
        "check",
        "unique-index",
        "referred-to",
    ],
)
def test_a_table_landing_cannot_use_is_refused_by_name(tmp_path, statements, said):
    sink = DuckDBSink(_file(tmp_path, *statements))
    with pytest.raises(SchemaError, match=said):
        sink.land(run_row(), steps(), evals())


def test_the_run_refuses_such_a_file_before_it_provisions(tmp_path):
    # The check before the run read the row, met the error, logged a warning and went on:
    # the run trained, then failed to land.
    config = tiny_config(tmp_path, "run_name=r1")
    plan = plan_run(config)
    sink = DuckDBSink(plan.metrics_path)
    sink.ensure_tables()
    with duckdb.connect(plan.metrics_path) as con:
        con.execute("DROP TABLE runs")
        con.execute("CREATE TABLE runs (run_id VARCHAR PRIMARY KEY, eval_loss INTEGER)")
    with pytest.raises(ConfigError, match=r"metrics\.path = .*runs\.eval_loss is INTEGER"):
        check_run_owner(config, plan)


def _torn(path: str) -> None:
    """Cut the file short after its headers, as a full disk or a copy cut short leaves it."""
    with open(path, "r+b") as f:
        f.truncate(16384)


def _bit_rot(path: str) -> None:
    """Overwrite every block after the headers: their checksums no longer match."""
    with open(path, "r+b") as f:
        size = f.seek(0, 2)
        f.seek(12288)
        f.write(b"\x5a" * (size - 12288))


@pytest.mark.parametrize("damage", [_torn, _bit_rot])
def test_a_metrics_file_duckdb_cannot_read_is_refused_before_the_run(tmp_path, damage):
    # It passed the checks with a warning: the run provisioned and trained, then failed to
    # land and said to run it again, which failed the same way after training again.
    from tasks.access import check_sweeps_table

    config = tiny_config(tmp_path, "run_name=r1")
    plan = plan_run(config)
    sink = DuckDBSink(plan.metrics_path)
    sink.land(run_row(), steps(), evals())
    damage(plan.metrics_path)
    for check in (check_run_owner, check_sweeps_table):
        with pytest.raises(ConfigError) as refused:
            check(config, plan)
        said = str(refused.value)
        assert said.startswith(f"metrics.path = '{plan.metrics_path}': DuckDB cannot read it (")
        assert "Restore the file from a copy, or move it away" in said


def test_a_damaged_block_the_runs_own_row_does_not_touch_is_refused_too(tmp_path):
    # Looking up the run's row reads few blocks: a file with other blocks damaged passed,
    # the run trained, and its landing (or every later query) failed on them.
    config = tiny_config(tmp_path, "run_name=r1")
    plan = plan_run(config)
    good = tmp_path / "good.duckdb"
    DuckDBSink(good).land(run_row("old"), steps("old", n=30_000), evals("old"))
    missed = 0
    for at in _blocks(good, 100):
        _damaged_copy(good, plan.metrics_path, at, b"\x5a" * 2000)
        try:  # does the block hold values? (free space and index blocks are not scanned)
            with duckdb.connect(plan.metrics_path, read_only=True) as con:
                for table in ("runs", "step_metrics", "eval_metrics"):
                    con.execute(f"SELECT bit_xor(hash(COLUMNS(*))) FROM {table}").fetchall()
            continue
        except duckdb.Error:
            pass
        try:
            DuckDBSink(plan.metrics_path).read_run("r1")
            missed += 1  # what the check read before: this damage passed
        except duckdb.Error:
            pass
        with pytest.raises(ConfigError, match=r"DuckDB cannot read it \(Corrupt database file"):
            check_run_owner(config, plan)
    assert missed


def test_whatever_block_is_damaged_a_landing_that_would_fail_is_refused_first(tmp_path):
    # A damaged block of a primary key's index passed the read of every value (probe R):
    # the run trained, then its landing's upsert failed on it, "run it again".
    config = tiny_config(tmp_path, "run_name=r1")
    plan = plan_run(config)
    good = tmp_path / "good.duckdb"
    DuckDBSink(good).land(run_row("old"), steps("old", n=100_000), evals("old"))
    landing = tmp_path / "landing.duckdb"
    failed = 0
    for at in [*_blocks(good, 100), *_blocks(good, 1024)]:
        for copy in (plan.metrics_path, landing):
            _damaged_copy(good, copy, at, b"\xff" * 64)
        try:
            DuckDBSink(landing).land(run_row("r1"), steps("r1", n=12), evals("r1"))
            continue
        except duckdb.Error:
            failed += 1
        with pytest.raises(ConfigError, match=r"DuckDB cannot read it"):
            check_run_owner(config, plan)
    assert failed


def _blocks(path: Path, offset: int) -> list[int]:
    """The byte `offset` into each of the DuckDB file's 256 KiB blocks (after its headers)."""
    return [12288 + k * 262144 + offset for k in range((path.stat().st_size - 12288) // 262144 + 1)]


def _damaged_copy(good: Path, copy: str | Path, at: int, data: bytes) -> None:
    """`good` copied to `copy`, with `data` written over its bytes from `at`."""
    import shutil

    shutil.copy(good, copy)
    with open(copy, "r+b") as f:
        f.seek(at)
        f.write(data)


def test_a_metrics_file_another_process_holds_still_passes(tmp_path, caplog):
    from tests.test_landing_interrupted import held

    config = tiny_config(tmp_path, "run_name=r1")
    plan = plan_run(config)
    DuckDBSink(plan.metrics_path).ensure_tables()
    with held(plan.metrics_path, tmp_path / "release"), caplog.at_level("WARNING"):
        check_run_owner(config, plan)  # landing waits for the lock: no refusal
    # Not landing's message, which said "held open ... for over 0 s" here.
    (said,) = [r.getMessage() for r in caplog.records if "could not look up" in r.getMessage()]
    assert said.endswith("another process holds it open (landing waits for it, then says which)")
    # A sweep's check of its table too (probe V read "for over 0 s" there).
    from tasks.access import check_sweeps_table

    caplog.clear()
    with held(plan.metrics_path, tmp_path / "release2"), caplog.at_level("WARNING"):
        check_sweeps_table(config, plan)
    (said,) = [r.getMessage() for r in caplog.records if "sweeps table" in r.getMessage()]
    assert said == (
        "could not check the sweeps table: another process holds it open (landing waits "
        "for it, then says which)"
    )


def test_a_users_table_of_a_landing_tables_name_in_another_schema_passes(tmp_path):
    # notebook.sweeps was read as sweeps, which does not exist before a sweep lands: the
    # healthy file was refused as unreadable (probe R).
    config = tiny_config(tmp_path, "run_name=r1")
    plan = plan_run(config)
    DuckDBSink(plan.metrics_path).land(run_row(), steps(), evals())
    with duckdb.connect(plan.metrics_path) as con:
        con.execute("CREATE SCHEMA notebook")
        con.execute("CREATE TABLE notebook.sweeps (name VARCHAR, best DOUBLE)")
    check_run_owner(config, plan)
