"""A run stopped by a signal during or after its landing, and an interrupted rerun of a
finished run: the `runs` row says failed as the exit does, and keeps the results landed
before (eval rows, eval loss, step rows).

Ctrl-C (KeyboardInterrupt) stands for SIGTERM here: in-process, Prefect's SIGTERM
handler would re-send the signal to the test process once the flow has crashed.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.metrics import DuckDBSink
from tests.helpers import tiny_config

pytestmark = pytest.mark.integration

NAME = "landed"
CTRL_C = "KeyboardInterrupt: the orchestrator received SIGINT (Ctrl-C)"  # runs.error of a Ctrl-C


@pytest.fixture(scope="module")
def finished(tmp_path_factory, prefect_harness) -> Path:
    """The storage root of a finished tiny run: its reruns only verify, evaluate, land."""
    from flows.pipeline import tpu_training_pipeline

    root = tmp_path_factory.mktemp("store")
    assert tpu_training_pipeline(config=tiny_config(root, f"run_name={NAME}")).eval_loss
    return root


def rerun(root: Path, metrics: Path):
    """Run the finished run again, landing into `metrics` (not a training field)."""
    from flows.pipeline import tpu_training_pipeline

    config = tiny_config(root, f"run_name={NAME}", f"metrics.path={metrics}")
    return tpu_training_pipeline(config=config)


def landed(metrics: Path) -> tuple[tuple, int, list[tuple]]:
    """The run's (status, error, eval_loss, params_sha256), step row count, eval rows."""
    sink = DuckDBSink(metrics)
    (run,) = sink.query(
        "SELECT status, error, eval_loss, params_sha256 FROM runs WHERE run_id = ?", [NAME]
    )
    ((steps,),) = sink.query("SELECT count(*) FROM step_metrics WHERE run_id = ?", [NAME])
    evals = sink.query("SELECT step, loss FROM eval_metrics WHERE run_id = ?", [NAME])
    return run, steps, evals


@contextlib.contextmanager
def held(path: Path, release: Path) -> Iterator[None]:
    """Another process holds the DuckDB file at `path` open until `release` exists."""
    holder = textwrap.dedent(f"""
        import duckdb, os, time
        con = duckdb.connect({str(path)!r})
        print("locked", flush=True)
        deadline = time.monotonic() + 120
        while not os.path.exists({str(release)!r}) and time.monotonic() < deadline:
            time.sleep(0.01)
        con.close()
    """)
    with subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True) as p:
        assert p.stdout.readline().strip() == "locked"
        try:
            yield
        finally:
            release.touch()


def interrupted(*args, **kwargs):
    raise KeyboardInterrupt


def stop_while_sharding(config, monkeypatch) -> None:
    """Run `config`'s pipeline, stopped by Ctrl-C as its shard stage starts."""
    from flows import pipeline

    with monkeypatch.context() as patch:
        patch.setattr(pipeline, "shard_dataset", interrupted)
        with pytest.raises(KeyboardInterrupt):
            pipeline.tpu_training_pipeline(config=config)


def test_a_signal_while_landing_waits_for_the_file_still_lands_the_failed_row(
    finished, tmp_path, monkeypatch
):
    # SIGTERM while land-metrics waited for a file another process held: no row landed
    # at all, though the file was free a second later (land-metrics was outside the
    # flow's try, so no failed row was attempted).
    import infra.metrics.duckdb_sink as duckdb_sink

    metrics, release = tmp_path / "m.duckdb", tmp_path / "release"
    signalled = []

    def sleep(seconds):  # the landing's wait for the lock: signalled in its first pause
        if not signalled:
            signalled.append(seconds)
            release.touch()  # the holder lets go once the landing was interrupted
            raise KeyboardInterrupt
        time.sleep(seconds)

    waiting = types.SimpleNamespace(monotonic=time.monotonic, sleep=sleep)
    monkeypatch.setattr(duckdb_sink, "time", waiting)
    with held(metrics, release), pytest.raises(KeyboardInterrupt):
        rerun(finished, metrics)
    assert signalled
    (status, error, eval_loss, _), steps, evals = landed(metrics)
    assert status == "failed" and error == CTRL_C
    assert eval_loss is not None and len(evals) == 1 and steps > 0  # this run evaluated


def test_a_signal_after_the_completed_row_landed_leaves_it_failed(finished, tmp_path, monkeypatch):
    # SIGTERM during publish-summary: exit 143 and a crashed flow run, the row completed.
    import flows.pipeline as pipeline

    monkeypatch.setattr(pipeline, "publish_summary", interrupted)
    with pytest.raises(KeyboardInterrupt):
        rerun(finished, tmp_path / "m.duckdb")
    (status, error, eval_loss, _), _, evals = landed(tmp_path / "m.duckdb")
    assert status == "failed" and error == CTRL_C
    assert eval_loss is not None and len(evals) == 1


def test_an_interrupted_rerun_of_a_finished_run_keeps_its_evaluation(
    finished, tmp_path, monkeypatch
):
    # The failed row landed through the completed run's DELETE + INSERT: the rerun,
    # stopped while it evaluated again, wiped the run's eval rows and eval loss.
    import flows.pipeline as pipeline

    metrics = tmp_path / "m.duckdb"
    rerun(finished, metrics)
    (_, _, eval_loss, sha), steps, evals = landed(metrics)
    monkeypatch.setattr(pipeline, "evaluate_checkpoint", interrupted)
    for _ in range(2):  # landing the failure again duplicates nothing
        with pytest.raises(KeyboardInterrupt):
            rerun(finished, metrics)
        assert landed(metrics) == (("failed", CTRL_C, eval_loss, sha), steps, evals)
    assert len(evals) == 1
    monkeypatch.undo()
    assert rerun(finished, metrics).status == "completed"  # and a rerun completes it again
    assert landed(metrics) == (("completed", None, eval_loss, sha), steps, evals)


def test_an_interrupted_rerun_with_other_eval_settings_keeps_the_config_of_its_evaluation(
    finished, tmp_path, monkeypatch
):
    # The failed row took the rerun's config (eval.max_batches 2) beside the eval loss of
    # the earlier evaluation, made with eval.max_batches 4.
    import flows.pipeline as pipeline
    from flows.pipeline import tpu_training_pipeline

    metrics = tmp_path / "m.duckdb"
    rerun(finished, metrics)
    (_, _, eval_loss, _), _, evals = landed(metrics)
    sink = DuckDBSink(metrics)

    def eval_settings() -> dict:
        ((config_json,),) = sink.query("SELECT config_json FROM runs WHERE run_id = ?", [NAME])
        return json.loads(config_json)["eval"]

    assert eval_settings()["max_batches"] == 4
    other = tiny_config(
        finished, f"run_name={NAME}", f"metrics.path={metrics}", "eval.max_batches=2"
    )
    with monkeypatch.context() as patched:
        patched.setattr(pipeline, "evaluate_checkpoint", interrupted)
        with pytest.raises(KeyboardInterrupt):
            tpu_training_pipeline(config=other)
    assert landed(metrics)[0][:3] == ("failed", CTRL_C, eval_loss)
    assert eval_settings()["max_batches"] == 4  # the settings of the loss it holds
    run = tpu_training_pipeline(config=other)  # evaluated with them: they are the row's
    assert run.status == "completed" and run.eval_loss != eval_loss
    assert eval_settings()["max_batches"] == 2 and len(evals) == 1


def test_a_stopped_run_waits_for_a_held_metrics_file_only_briefly(finished, tmp_path, monkeypatch):
    # A stopped run's row waited the sink's 30 s for a held file: `docker stop` sends
    # SIGKILL after 10 s, before the crash hooks and the API server's stop had run.
    import flows.pipeline as pipeline
    from tasks.landing import INTERRUPTED_WAIT_S

    stopped_at = []

    def stopped(*args, **kwargs):
        stopped_at.append(time.monotonic())
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "evaluate_checkpoint", stopped)
    metrics = tmp_path / "m.duckdb"
    with held(metrics, tmp_path / "release"), pytest.raises(KeyboardInterrupt) as err:
        rerun(finished, metrics)
    assert time.monotonic() - stopped_at[0] < INTERRUPTED_WAIT_S + 10
    assert "runs row was not landed" in " ".join(err.value.__notes__)


def test_a_rerun_over_a_metrics_file_cut_short_keeps_the_landed_step_rows(
    finished, tmp_path, caplog
):
    # The completed landing made the stored rows exactly the file's: with metrics.jsonl
    # cut to its first 5 rows, 7 landed step rows were deleted and train_loss_last became
    # step 5's loss beside final_step 12.
    from tasks.plan import plan_run

    metrics = tmp_path / "m.duckdb"
    rerun(finished, metrics)
    sink = DuckDBSink(metrics)
    step_rows = "SELECT step, loss FROM step_metrics WHERE run_id = ? ORDER BY step"
    summary = "SELECT final_step, train_loss_first, train_loss_last FROM runs WHERE run_id = ?"
    steps, (losses,) = sink.query(step_rows, [NAME]), sink.query(summary, [NAME])
    assert [s for s, _ in steps] == list(range(1, 13)) and losses[0] == 12
    path = Path(plan_run(tiny_config(finished, f"run_name={NAME}")).run_dir) / "metrics.jsonl"
    whole = path.read_bytes()
    try:
        path.write_bytes(b"".join(whole.splitlines(keepends=True)[:5]))
        run = rerun(finished, metrics)  # the row the CLI prints and the summary shows
        assert (run.status, run.final_step, run.train_loss_first, run.train_loss_last) == (
            "completed",
            *losses,
        )
        assert sink.query(step_rows, [NAME]) == steps
        assert sink.query(summary, [NAME]) == [losses]
        assert "metrics.jsonl has no row for step 6-12 of 1-12" in caplog.text
    finally:
        path.write_bytes(whole)


def test_a_rerun_over_an_emptied_events_file_keeps_the_goodput_and_cost(finished, tmp_path, caplog):
    # The ledger read from an emptied events.jsonl counted no attempt: the completed
    # landing set attempts 0, goodput NULL, wall_s 0 and chip_hours 0 over the real ones.
    from tasks.landing_rows import LEDGER_COLUMNS, ledger_fields, run_ledger
    from tasks.plan import plan_run

    config = tiny_config(finished, f"run_name={NAME}")
    assert set(ledger_fields(run_ledger(config, plan_run(config).run_dir))) == set(LEDGER_COLUMNS)
    metrics = tmp_path / "m.duckdb"
    rerun(finished, metrics)
    sink = DuckDBSink(metrics)
    columns = ", ".join(LEDGER_COLUMNS)
    before = sink.query(f"SELECT {columns} FROM runs WHERE run_id = ?", [NAME])
    assert before[0][LEDGER_COLUMNS.index("tokens_trained")] > 0
    path = Path(plan_run(config).run_dir) / "events.jsonl"
    whole = path.read_bytes()
    try:
        path.write_bytes(b"")
        assert rerun(finished, metrics).status == "completed"
        assert sink.query(f"SELECT {columns} FROM runs WHERE run_id = ?", [NAME]) == before
        # Nothing landed before (a fresh metrics file): unknown, not a measured 0 (a run of
        # 200 steps on 8 chips landed goodput 0.0, 0 chip-hours and 0 tokens).
        fresh = rerun(finished, tmp_path / "fresh.duckdb")
        assert fresh.status == "completed" and fresh.final_step == 12
        assert all(getattr(fresh, column) is None for column in LEDGER_COLUMNS)
        assert "(cut short or damaged)" in caplog.text
        # Trained by a workload started by hand: its events say so, the file is whole.
        caplog.clear()
        hand = [
            {"time": 1.0, "event": "first_step", "attempt": None, "source": "workload", "step": 1},
            {"time": 2.0, "event": "finished", "attempt": None, "source": "workload", "step": 12},
        ]
        path.write_text("".join(json.dumps(e) + "\n" for e in hand))
        assert rerun(finished, metrics).status == "completed"
        assert "trained by a workload started by hand" in caplog.text
        assert "cut short or damaged" not in caplog.text
    finally:
        path.write_bytes(whole)


def test_a_run_of_the_same_name_landed_meanwhile_from_another_root_is_not_replaced(
    finished, tmp_path, monkeypatch
):
    # Two runs of one name in two storage roots at once, one metrics file: both passed the
    # owner check at their start, and the second to land replaced the first's rows (a
    # SIGTERMed one mixed them: its status and steps beside the other's eval loss).
    from flows.pipeline import tpu_training_pipeline
    from tasks import prepare
    from tasks.run_owner import RunOwnerConflict

    metrics = tmp_path / "m.duckdb"
    rerun(finished, metrics)  # the other root's run lands first
    sink = DuckDBSink(metrics)
    row = "SELECT run_dir, status, final_step, eval_loss FROM runs WHERE run_id = ?"
    before, steps = sink.query(row, [NAME]), sink.query(STEP_COUNT, [NAME])
    monkeypatch.setattr(prepare, "check_run_owner", lambda *a, **k: None)  # it started earlier
    other = tiny_config(tmp_path / "b", f"run_name={NAME}", f"metrics.path={metrics}")
    with pytest.raises(RunOwnerConflict, match="not landed: run_name = 'landed': a run of"):
        tpu_training_pipeline(config=other)
    assert sink.query(row, [NAME]) == before and sink.query(STEP_COUNT, [NAME]) == steps
    assert (tmp_path / "b" / "runs" / NAME / "eval.json").exists()  # its results are kept


STEP_COUNT = "SELECT count(*) FROM step_metrics WHERE run_id = ?"


def test_a_moved_storage_root_resumes_its_runs_and_a_copy_beside_it_is_refused(
    finished, tmp_path, caplog
):
    # Moving a root took the run's landed row's directory away: every run of the moved
    # root was refused as "a run of this name from another run directory", naming the
    # gone one, and the advice (another run_name) threw away its checkpoints.
    import shutil

    from tasks.plan import plan_run
    from tasks.run_owner import check_run_owner
    from workloads.config_file import ConfigError

    metrics = tmp_path / "m.duckdb"
    shutil.copytree(finished, tmp_path / "a")
    rerun(tmp_path / "a", metrics)  # only evaluates: its invocation is recorded at landing
    (tmp_path / "a").rename(tmp_path / "b")
    caplog.clear()
    assert rerun(tmp_path / "b", metrics).eval_loss
    assert caplog.text.count("holds that run's attempts (its storage root was moved)") == 1
    sink = DuckDBSink(metrics)
    row = "SELECT run_dir, status FROM runs WHERE run_id = ?"
    assert sink.query(row, [NAME]) == [(str(tmp_path / "b" / "runs" / NAME), "completed")]

    shutil.copytree(tmp_path / "b", tmp_path / "c")  # b still there: one name, two runs
    copy = tiny_config(tmp_path / "c", f"run_name={NAME}", f"metrics.path={metrics}")
    with pytest.raises(ConfigError, match=r"runs/landed, is a copy of .*/b/runs/landed"):
        check_run_owner(copy, plan_run(copy))
    # Landing in its own copy of the metrics file (inside its root: the default), the
    # copy replaces none of the original's rows.
    own = tiny_config(tmp_path / "c", f"run_name={NAME}")
    assert plan_run(own).metrics_path.startswith(str(tmp_path / "c"))
    check_run_owner(own, plan_run(own))
    other = tiny_config(tmp_path / "d", f"run_name={NAME}", f"metrics.path={metrics}")
    with pytest.raises(ConfigError, match="a run of this name from another run directory"):
        check_run_owner(other, plan_run(other))  # no history of it: another run


def test_a_step_past_the_final_one_is_quarantined_without_provisioning(finished, tmp_path):
    # A step copied in past train.steps (another run's) made a finished run provision a
    # slice, only for its workload to quarantine that step.
    import shutil

    shutil.copytree(finished, tmp_path / "a")
    run_dir = tmp_path / "a" / "runs" / NAME
    final = tiny_config(tmp_path / "a").train.steps
    shutil.copytree(run_dir / "checkpoints" / str(final), run_dir / "checkpoints" / "1000")
    lines = (run_dir / "events.jsonl").read_text().splitlines()

    assert rerun(tmp_path / "a", tmp_path / "m.duckdb").final_step == final
    new = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    new = new[len(lines) :]
    assert [e["event"] for e in new] == ["quarantined", "landed"]
    assert new[0]["step"] == 1000 and f"past train.steps ({final})" in new[0]["reason"]
    kept = {p.name for p in (run_dir / "checkpoints").iterdir()}
    assert str(final) in kept and "1000" not in kept
    (moved,) = (run_dir / "quarantine").iterdir()
    assert moved.name.startswith("1000-")


def test_a_run_stopped_before_its_directory_existed_keeps_its_start_when_run_again(
    tmp_path, monkeypatch, prefect_harness
):
    # Stopped while sharding, its landing could not record itself in the run directory,
    # which did not exist yet ("could not record the landing in .../events.jsonl", a
    # warning on every such stop). Now it makes it: the next invocation is the same run
    # (its row keeps the first start), not a new run of the name over an old row.
    from flows.pipeline import tpu_training_pipeline
    from tasks.run_owner import recorded_invocations

    config = tiny_config(tmp_path, "run_name=early")
    metrics = tmp_path / "metrics.duckdb"
    run_dir = tmp_path / "runs" / "early"
    stop_while_sharding(config, monkeypatch)
    first = DuckDBSink(metrics).read_run("early")
    assert first.status == "failed" and first.flow_run_id in recorded_invocations(str(run_dir))
    assert tpu_training_pipeline(config=config).status == "completed"
    assert DuckDBSink(metrics).read_run("early").started_at == first.started_at


def test_a_new_run_in_a_deleted_directory_stopped_while_sharding_replaces_the_old_rows(
    tmp_path, monkeypatch, prefect_harness
):
    # `rm -rf runs/again`, then the name run again and stopped before its directory
    # existed: its failed landing kept the old run's start, steps and evaluation, under
    # the new run's config, and recorded itself there, so they were kept for good.
    import shutil

    from flows.pipeline import tpu_training_pipeline

    config = tiny_config(tmp_path, "run_name=again")
    sink = DuckDBSink(tmp_path / "metrics.duckdb")
    old = tpu_training_pipeline(config=config)
    shutil.rmtree(tmp_path / "runs" / "again")
    stop_while_sharding(config, monkeypatch)
    new = sink.read_run("again")
    assert new.started_at > old.started_at
    assert (new.status, new.final_step, new.eval_loss) == ("failed", None, None)
    assert sink.query("SELECT count(*) FROM step_metrics WHERE run_id = 'again'") == [(0,)]
    assert sink.query("SELECT count(*) FROM eval_metrics WHERE run_id = 'again'") == [(0,)]
    # Its next invocation is the same (new) run: its start stays.
    assert tpu_training_pipeline(config=config).status == "completed"
    assert sink.read_run("again").started_at == new.started_at
