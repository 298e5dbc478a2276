"""An interrupted rerun of a finished run: its failed `runs` row keeps the results an
earlier invocation landed (eval rows, eval loss, step rows).

Ctrl-C (KeyboardInterrupt) stands for SIGTERM here: in-process, Prefect's SIGTERM
handler would re-send the signal to the test process once the flow has crashed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.metrics import DuckDBSink
from tests.helpers import tiny_config

pytestmark = pytest.mark.integration

NAME = "landed"


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


def interrupted(*args, **kwargs):
    raise KeyboardInterrupt


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
        assert landed(metrics) == (("failed", "KeyboardInterrupt", eval_loss, sha), steps, evals)
    assert len(evals) == 1
    monkeypatch.undo()
    assert rerun(finished, metrics).status == "completed"  # and a rerun completes it again
    assert landed(metrics) == (("completed", None, eval_loss, sha), steps, evals)
