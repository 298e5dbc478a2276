"""The DuckDB metrics sink: schemas from the row models, idempotent and atomic landing."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta

import pydantic
import pytest

from infra.metrics import (
    DuckDBSink,
    EvalMetricRow,
    LandResult,
    MetricsLocked,
    MetricsSink,
    RunRow,
    StepMetricRow,
    SweepRow,
    build_sink,
    table_schema,
)
from tests.helpers import REPO

T0 = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)


def run_row(run_id: str = "run-1", **kw) -> RunRow:
    fields = dict(
        run_id=run_id,
        run_name="tiny",
        status="completed",
        config_hash="c0ffee",
        config_json="{}",
        dataset_fingerprint="fp",
        started_at=T0,
        run_dir=f"/runs/{run_id}",
    )
    return RunRow(**{**fields, **kw})


def steps(run_id: str = "run-1", n: int = 5, offset: float = 0.0) -> list[StepMetricRow]:
    return [
        StepMetricRow(run_id=run_id, step=i, loss=10.0 - i + offset, recorded_at=T0)
        for i in range(n)
    ]


def evals(run_id: str = "run-1") -> list[EvalMetricRow]:
    return [EvalMetricRow(run_id=run_id, step=4, loss=2.5, tokens=128, recorded_at=T0)]


@pytest.fixture
def sink(tmp_path) -> DuckDBSink:
    s = DuckDBSink(tmp_path / "nested" / "metrics.duckdb")
    s.ensure_tables()
    return s


def counts(sink: DuckDBSink) -> tuple[int, int, int]:
    return tuple(
        sink.query(f"SELECT count(*) FROM {t}")[0][0]
        for t in ("runs", "step_metrics", "eval_metrics")
    )


def test_schema_is_derived_from_the_models(sink):
    assert [tuple(c) for c in table_schema(EvalMetricRow)] == [
        ("run_id", "VARCHAR", False),
        ("step", "BIGINT", False),
        ("split", "VARCHAR", False),
        ("loss", "DOUBLE", True),
        ("bits_per_byte", "DOUBLE", True),
        ("tokens", "BIGINT", False),
        ("nonfinite", "BOOLEAN", False),
        ("recorded_at", "TIMESTAMPTZ", False),
    ]
    names = {"TIMESTAMPTZ": "TIMESTAMP WITH TIME ZONE"}
    for model in (RunRow, StepMetricRow, EvalMetricRow):
        described = sink.query(f"DESCRIBE {model.table}")
        expected = [(c.name, names.get(c.type, c.type), c.nullable) for c in table_schema(model)]
        assert [(r[0], r[1], r[2] == "YES") for r in described] == expected
        (pk,) = sink.query(
            "SELECT constraint_column_names FROM duckdb_constraints() "
            "WHERE table_name = ? AND constraint_type = 'PRIMARY KEY'",
            [model.table],
        )
        assert tuple(pk[0]) == model.primary_key


def test_landing_twice_leaves_one_copy(sink):
    assert sink.land(run_row(), steps(), evals()) == LandResult(runs=1, steps=5, evals=1)
    sink.land(run_row("run-2"), steps("run-2", 3), [])
    assert sink.land(run_row(), steps(), evals()) == LandResult(runs=1, steps=5, evals=1)
    assert counts(sink) == (2, 8, 1)
    # A re-landing is the new truth: changed values replace, missing rows go.
    sink.land(run_row(final_step=2), steps(n=3, offset=0.5), [])
    assert sink.query("SELECT final_step FROM runs WHERE run_id = 'run-1'") == [(2,)]
    assert sink.query(
        "SELECT step, loss FROM step_metrics WHERE run_id = 'run-1' ORDER BY step"
    ) == [(0, 10.5), (1, 9.5), (2, 8.5)]
    assert counts(sink) == (2, 6, 0)


def test_duplicate_steps_last_one_wins(sink):
    rerun = StepMetricRow(run_id="run-1", step=2, loss=42.0, recorded_at=T0 + timedelta(hours=1))
    result = sink.land(run_row(), [*steps(), rerun], [*evals(), *evals()])
    assert result == LandResult(runs=1, steps=5, evals=1)
    assert sink.query("SELECT loss, recorded_at FROM step_metrics WHERE step = 2") == [
        (42.0, T0 + timedelta(hours=1))
    ]


def test_nonfinite_values_become_null_with_flag(sink):
    bad = StepMetricRow(run_id="run-1", step=7, loss=float("nan"), grad_norm="inf", recorded_at=T0)
    assert (bad.loss, bad.grad_norm, bad.nonfinite) == (None, None, True)
    ev = EvalMetricRow(run_id="run-1", step=7, loss=float("-inf"), tokens=1, recorded_at=T0)
    run = run_row(eval_loss=float("nan"), train_loss_last=1.5)
    sink.land(run, [*steps(), bad], [ev])
    assert sink.query("SELECT loss, grad_norm, nonfinite FROM step_metrics WHERE step = 7") == [
        (None, None, True)
    ]
    assert sink.query("SELECT count(*) FROM step_metrics WHERE nonfinite") == [(1,)]
    assert sink.query("SELECT loss, nonfinite FROM eval_metrics") == [(None, True)]
    assert sink.query("SELECT eval_loss, train_loss_last FROM runs") == [(None, 1.5)]
    with pytest.raises(pydantic.ValidationError):
        # Naive times are ambiguous; rows carry UTC instants only.
        StepMetricRow(run_id="r", step=0, recorded_at=datetime(2025, 1, 1))


def test_failure_mid_landing_keeps_previous_rows(sink, monkeypatch):
    sink.land(run_row(), steps(), evals())
    before = sink.query("SELECT * FROM step_metrics ORDER BY step")
    real_upsert = DuckDBSink._upsert

    def failing_upsert(con, model, rows):
        if model is StepMetricRow:  # the runs row and the steps past 1 replaced by now
            raise RuntimeError("disk full")
        real_upsert(con, model, rows)

    monkeypatch.setattr(DuckDBSink, "_upsert", staticmethod(failing_upsert))
    with pytest.raises(RuntimeError, match="disk full"):
        sink.land(run_row(final_step=1), steps(n=2, offset=1.0), [])
    assert sink.query("SELECT * FROM step_metrics ORDER BY step") == before
    assert sink.query("SELECT final_step FROM runs") == [(None,)]
    assert counts(sink) == (1, 5, 1)


def test_a_failed_landing_keeps_the_rows_and_results_landed_before(sink):
    # An interrupted rerun of a finished run landed its failed row through the same
    # DELETE + INSERT as a completed one: the run's eval rows went, and its eval loss.
    sink.land(run_row(eval_loss=2.5, params_sha256="abc", final_step=4), steps(), evals())
    sink.land(run_row("run-2"), steps("run-2", 3), evals("run-2"))
    failed = run_row(status="failed", error="TerminationSignal: SIGTERM", final_step=4)
    for _ in range(2):  # idempotent: no row twice
        assert sink.land(failed, steps(n=3, offset=0.5), []) == LandResult(1, 3, 0)
        assert counts(sink) == (2, 8, 2)
    row = sink.read_run("run-1")
    assert (row.status, row.error) == ("failed", "TerminationSignal: SIGTERM")
    assert (row.eval_loss, row.params_sha256, row.final_step) == (2.5, "abc", 4)
    # Rows it has are updated, rows it lacks are kept.
    assert sink.query(
        "SELECT step, loss FROM step_metrics WHERE run_id = 'run-1' ORDER BY step"
    ) == [
        (0, 10.5),
        (1, 9.5),
        (2, 8.5),
        (3, 7.0),
        (4, 6.0),
    ]
    assert sink.query("SELECT step, loss FROM eval_metrics WHERE run_id = 'run-1'") == [(4, 2.5)]
    # A value it has replaces the stored one; the next completed landing is exact again.
    sink.land(run_row(status="failed", error="e", eval_loss=2.0), [], [])
    assert sink.read_run("run-1").eval_loss == 2.0
    sink.land(run_row(final_step=1), steps(n=2), [])
    assert counts(sink) == (2, 5, 1)
    assert sink.read_run("run-1").eval_loss is None


def run_steps(run_id: str = "run-1", first: int = 1, last: int = 12, offset: float = 0.0):
    return [
        StepMetricRow(run_id=run_id, step=i, loss=100.0 / i + offset, recorded_at=T0)
        for i in range(first, last + 1)
    ]


def test_a_completed_landing_keeps_stored_steps_it_lacks_up_to_its_final_step(sink):
    # A rerun of a finished run over a metrics.jsonl cut short landed it as exactly its
    # rows: the steps the file had lost were deleted, and train_loss_last became the loss
    # of the last row left beside final_step 12.
    done = run_row(final_step=12, train_loss_first=100.0, train_loss_last=100.0 / 12)
    sink.land(done, run_steps(), evals())
    sink.land(run_row("run-2", final_step=3), run_steps("run-2", last=3), [])
    cut = done.model_copy(update={"train_loss_first": 99.0, "train_loss_last": None})
    assert sink.land(cut, run_steps(last=5, offset=1.0), evals()) == LandResult(1, 5, 1)
    got = sink.query("SELECT step, loss FROM step_metrics WHERE run_id = 'run-1' ORDER BY step")
    assert got == [(s, 100.0 / s + (1.0 if s <= 5 else 0.0)) for s in range(1, 13)]
    row = sink.read_run("run-1")
    assert (row.train_loss_first, row.train_loss_last) == (99.0, 100.0 / 12)
    # A file missing its start keeps the stored first loss; an eval it lacks still goes.
    sink.land(done.model_copy(update={"train_loss_first": None}), run_steps(first=7), [])
    assert sink.read_run("run-1").train_loss_first == 99.0
    assert counts(sink) == (2, 15, 0)
    # Stored steps past the final step go, with no step rows given too; other runs stay.
    sink.land(run_row(final_step=8), run_steps(last=4), [])
    got = sink.query("SELECT step FROM step_metrics WHERE run_id = 'run-1' ORDER BY step")
    assert [s for (s,) in got] == list(range(1, 9))
    sink.land(run_row(final_step=2), [], [])
    assert counts(sink) == (2, 5, 0)
    # A failed landing still deletes nothing.
    sink.land(run_row(status="failed", error="e", final_step=1), [], [])
    assert counts(sink) == (2, 5, 0)


COST_COLUMNS = ("goodput", "chip_hours", "cost_usd", "tokens_trained", "cost_per_million_tokens")


def test_a_runs_started_at_stays_its_first_start_over_later_landings(sink):
    # Every invocation of a run name lands its row again: started_at moved to the latest
    # one's start (a rerun that only evaluated again), while wall_s covers every attempt.
    sink.land(run_row(started_at=T0), steps(), evals())
    later = T0 + timedelta(hours=3)
    sink.land(run_row(started_at=later), steps(), evals())  # completed again
    sink.land(run_row(started_at=later, status="failed", error="SIGTERM"), [], [])
    assert sink.read_run("run-1").started_at == T0
    earlier = T0 - timedelta(hours=1)  # a row landed late by an earlier invocation
    sink.land(run_row(started_at=earlier), steps(), evals())
    assert sink.read_run("run-1").started_at == earlier


def test_a_fresh_landing_replaces_every_row_an_earlier_run_of_the_name_left(sink):
    # The run directory was deleted and the name run again (`tasks.run_owner.earlier_life`):
    # the rows are the new run's alone, its later start included, even when it failed.
    sink.land(run_row(eval_loss=2.5, params_sha256="abc", final_step=12), run_steps(), evals())
    sink.land(run_row("run-2", final_step=3), run_steps("run-2", last=3), [])
    later = T0 + timedelta(days=2)
    new = run_row(started_at=later, status="failed", error="SIGTERM", final_step=3)
    assert sink.land(new, run_steps(last=3, offset=1.0), [], fresh=True) == LandResult(1, 3, 0)
    row = sink.read_run("run-1")
    assert (row.started_at, row.status, row.final_step) == (later, "failed", 3)
    assert (row.eval_loss, row.params_sha256) == (None, None)
    assert counts(sink) == (2, 6, 0)
    # Landed again as usual, it keeps its own start.
    sink.land(run_row(started_at=later + timedelta(hours=1), final_step=3), run_steps(last=3), [])
    assert sink.read_run("run-1").started_at == later


def test_an_older_sweeps_table_gains_the_cost_columns(tmp_path):
    sink = DuckDBSink(tmp_path / "m.duckdb")
    # The sweeps table as the first sweep landings created it, before the cost ledger.
    old = [c for c in table_schema(SweepRow) if c.name not in COST_COLUMNS]
    cols = ", ".join(f"{c.name} {c.type}{'' if c.nullable else ' NOT NULL'}" for c in old)
    sink.query(f"CREATE TABLE sweeps ({cols}, PRIMARY KEY (sweep_id, trial))")
    trial = SweepRow(
        sweep_id="sw",
        trial=0,
        run_id="sw-t00",
        status="completed",
        params_json="{}",
        chips=8,
        objective="eval_loss",
        chip_hours=0.5,
        cost_usd=0.6,
        tokens_trained=30_720,
        started_at=T0,
    )
    assert sink.land_sweep([trial]) == 1
    assert sink.query("SELECT chip_hours, cost_usd, tokens_trained, goodput FROM sweeps") == [
        (0.5, 0.6, 30_720, None)
    ]
    # The runs table's new ledger columns land and read back too.
    sink.land(run_row(chip_hours=0.25, cost_usd=0.3, price_source="x", tokens_trained=7), [], [])
    assert sink.read_run("run-1").cost_usd == 0.3


def test_rows_of_another_run_are_refused(sink):
    with pytest.raises(ValueError, match="run-2"):
        sink.land(run_row(), steps("run-2"), [])
    assert counts(sink) == (0, 0, 0)


def test_build_sink_and_waiting_for_another_process(tmp_path):
    path = tmp_path / "m.duckdb"
    sink = build_sink("duckdb", str(path))
    assert isinstance(sink, MetricsSink)
    with pytest.raises(ValueError, match="bigquery"):
        build_sink("bigquery", str(path))
    holder = textwrap.dedent(f"""
        import duckdb, time
        con = duckdb.connect({str(path)!r})
        print("locked", flush=True)
        time.sleep(0.5)
        con.close()
    """)
    with subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True) as p:
        assert p.stdout.readline().strip() == "locked"
        sink.land(run_row(), steps(), [])  # waits for the other process's lock to go
    assert p.returncode == 0
    assert counts(sink) == (1, 5, 0)


def test_a_file_held_open_past_the_timeout_names_the_process_and_what_to_do(tmp_path):
    path = tmp_path / "m.duckdb"
    DuckDBSink(path).ensure_tables()
    holder = textwrap.dedent(f"""
        import duckdb, sys
        con = duckdb.connect({str(path)!r}, read_only=True)  # a notebook looking at it
        print("open", flush=True)
        sys.stdin.readline()
    """)
    with subprocess.Popen(
        [sys.executable, "-c", holder], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as p:
        assert p.stdout.readline().strip() == "open"
        with pytest.raises(MetricsLocked) as err:
            DuckDBSink(path, lock_timeout_s=0.3).land(run_row(), steps(), [])
        p.stdin.write("\n")
        p.stdin.flush()
    msg = str(err.value)
    assert str(path) in msg and f"process {p.pid} (" in msg
    assert "run the same command again" in msg
    assert counts(DuckDBSink(path)) == (0, 0, 0)


def test_threads_landing_into_one_new_file_take_turns(tmp_path):
    # Sweep trials run as threads of one process and land into one file; their table
    # DDL used to meet in DuckDB as a "write-write conflict" and fail a trial's landing.
    from concurrent.futures import ThreadPoolExecutor

    for attempt in range(3):
        sink = DuckDBSink(tmp_path / f"m{attempt}.duckdb")  # a new file: every thread's DDL
        names = [f"t{i}" for i in range(6)]
        with ThreadPoolExecutor(len(names)) as pool:
            list(pool.map(lambda n, s=sink: s.land(run_row(n), steps(n), evals(n)), names))
        assert counts(sink) == (6, 30, 6)


@pytest.mark.parametrize("room", [0, 4096], ids=["nothing-written", "first-header-only"])
def test_a_create_that_runs_out_of_disk_leaves_nothing_a_later_run_would_trust(tmp_path, room):
    """DuckDB's own create, on a full disk, left a 0-byte or 4 KB file at the path; once
    space was freed every later landing failed on it ("exists, but it is not a valid
    DuckDB database file!"), after each run had trained. A file size limit makes the
    writes fail (EFBIG) where a full disk would (ENOSPC), without a mount."""
    path = tmp_path / "m.duckdb"
    full_disk = textwrap.dedent(f"""
        import resource, signal, sys
        from infra.metrics import DuckDBSink
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, ({room}, resource.RLIM_INFINITY))
        try:
            DuckDBSink({str(path)!r}).ensure_tables()
        except Exception as e:
            print(type(e).__name__, e)
            sys.exit(3)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", full_disk], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 3 and "File too large" in done.stdout, done.stdout + done.stderr
    assert os.listdir(tmp_path) == []  # no stub, no temporary file
    sink = DuckDBSink(path)  # space freed: the next run lands
    assert sink.land(run_row(), steps(), evals()) == LandResult(runs=1, steps=5, evals=1)
    assert counts(sink) == (1, 5, 1)


def test_a_file_another_process_creates_meanwhile_is_kept_with_its_rows(tmp_path, monkeypatch):
    """The create links its complete file into place: when another process created the
    file (and landed a run) between this one's check and its link, that file stays; a
    rename would have replaced it, and its rows with it."""
    path = tmp_path / "m.duckdb"
    link = os.link

    def other_process_first(src, dst):
        monkeypatch.setattr(os, "link", link)  # the other one's own create links as usual
        DuckDBSink(tmp_path / "other.duckdb").land(run_row("other"), steps("other"), [])
        os.rename(tmp_path / "other.duckdb", dst)
        link(src, dst)

    monkeypatch.setattr(os, "link", other_process_first)
    sink = DuckDBSink(path)
    sink.land(run_row(), steps(), [])
    assert sink.query("SELECT run_id FROM runs ORDER BY run_id") == [("other",), ("run-1",)]
    assert os.listdir(tmp_path) == ["m.duckdb"]


def test_a_create_killed_mid_way_leaves_files_the_next_create_removes(tmp_path):
    """A SIGKILL during a create leaves its `.creating` file (and WAL); the next create
    removes those of dead processes and leaves a live process's create alone."""
    dead = _finished_pid()
    abandoned = [
        tmp_path / f"m.duckdb.{dead}-0a1b2c3d.creating",
        tmp_path / f"m.duckdb.{dead}-0a1b2c3d.creating.wal",
    ]
    live = tmp_path / f"m.duckdb.{os.getppid()}-99999999.creating"
    for f in (*abandoned, live):
        f.write_bytes(b"half a database")
    DuckDBSink(tmp_path / "m.duckdb").land(run_row(), steps(), [])
    assert sorted(os.listdir(tmp_path)) == ["m.duckdb", live.name]


def _finished_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_filesystem_without_hard_links_still_gets_its_file(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise PermissionError(errno.EPERM, "Operation not permitted")  # what vfat says

    monkeypatch.setattr(os, "link", no_links)
    sink = DuckDBSink(tmp_path / "m.duckdb")
    sink.land(run_row(), steps(), [])
    assert counts(sink) == (1, 5, 0)
    assert os.listdir(tmp_path) == ["m.duckdb"]
