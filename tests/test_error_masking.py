"""A failure while cleaning up never replaces what stopped the run: a slice delete that
fails after a preempted attempt, a failed run's row that cannot be landed."""

from __future__ import annotations

import pytest

from tests.helpers import processes_mentioning, tiny_config

pytestmark = pytest.mark.integration


def test_a_failed_delete_after_a_preemption_does_not_replace_it(
    tmp_path, prefect_harness, monkeypatch
):
    """The attempt's `finally` deleted its slice and let the delete's error propagate: a
    preempted attempt then failed the run as a SliceError, and Prefect's retry (on
    preemptions only) never saw the preemption."""
    from flows.pipeline import tpu_training_pipeline
    from infra.slices import LocalSliceProvider, SliceError
    from tasks.watch import WorkloadFailed, WorkloadPreempted

    real_delete = LocalSliceProvider.delete
    refused = []

    def refuse_once_while_running(self, name, grace_s=5.0, where=None):
        if not refused and self.status(name).state.value == "READY":
            refused.append(name)
            raise SliceError(f"slice {name}: delete refused (injected)")
        return real_delete(self, name, grace_s, where=where)

    monkeypatch.setattr(LocalSliceProvider, "delete", refuse_once_while_running)
    config = tiny_config(
        tmp_path,
        "run_name=refused-delete",
        "slice.heartbeat_timeout_s=0.5",  # the workload is still compiling: taken for lost
        "resilience.heartbeat_confirm_s=0",
        "resilience.max_preemptions=0",
    )
    # Silent before its first heartbeat (never started) or after it (preempted).
    with pytest.raises((WorkloadPreempted, WorkloadFailed), match="no heartbeat"):
        tpu_training_pipeline(config=config)
    assert refused == ["tpupipe-refused-delete"]
    # The flow's teardown task deleted it on its second try: nothing is left running.
    assert list((tmp_path / "slices").glob("*.json")) == []
    run_dir = tmp_path / "runs" / "refused-delete"
    assert processes_mentioning(str(run_dir / "config.json")) == []


def test_a_row_that_cannot_be_landed_does_not_replace_the_runs_error(prefect_harness, monkeypatch):
    """Landing a failed run's row raised its own error in place of the run's."""
    from prefect import flow

    import tasks.landing as landing

    def broken_sink(*args, **kwargs):
        raise OSError("metrics.duckdb: database is locked")

    monkeypatch.setattr(landing, "land_metrics", broken_sink)

    @flow
    def fails():
        try:
            raise RuntimeError("workload exited 1: loss is not finite")
        except BaseException as exc:
            landing.land_failure(None, None, None, None, None, exc)
            raise

    with pytest.raises(RuntimeError, match="loss is not finite") as err:
        fails()
    assert "runs row was not landed: OSError" in " ".join(err.value.__notes__)


def test_a_failed_runs_row_waits_for_its_sink_by_how_the_run_ended(monkeypatch):
    """With BigQuery unreachable, a SIGTERMed run's row retried each call for 300 s before
    the run exited, and a run whose landing had just failed after 300 s retried 300 s more."""
    import tasks.landing as landing

    waits = []
    monkeypatch.setattr(landing, "land_metrics", lambda *a, wait_s: waits.append(wait_s))
    monkeypatch.setattr(landing, "describe_error", str)
    evaluated = object()  # an EvalResult: the landing was the step that failed
    landing.land_failure(None, None, None, None, None, RuntimeError("workload exited 1"))
    landing.land_failure(None, None, None, None, evaluated, RuntimeError("503 from BigQuery"))
    landing.land_failure(None, None, None, None, evaluated, KeyboardInterrupt())
    assert waits == [None, landing.AFTER_FAILED_LANDING_WAIT_S, landing.INTERRUPTED_WAIT_S]
    # A metrics file another process holds: its landing waited 30 s for it already, and a
    # row would wait for the same holder again (probe V: 60 s in all).
    from infra.metrics.duckdb_sink import MetricsLocked

    held = MetricsLocked("metrics database m.duckdb is held open by process 1 for over 30 s")
    landing.land_failure(None, None, None, None, evaluated, held)
    assert len(waits) == 3 and "run again once the file is closed" in held.__notes__[0]


def test_a_run_stopped_by_sigterm_says_a_cancel_may_have_sent_it():
    # Prefect's worker cancels a flow run (the UI's Cancel) with SIGTERM: the row said only
    # "received SIGTERM", which a user who pressed Cancel could not place.
    import signal

    from prefect.exceptions import TerminationSignal

    from tasks.landing import describe_error

    assert describe_error(TerminationSignal(signal.SIGTERM)) == (
        "TerminationSignal: the orchestrator received SIGTERM (a stop, or a cancel from the "
        "Prefect UI or API)"
    )
    assert describe_error(TerminationSignal(signal.SIGINT)) == (
        "TerminationSignal: the orchestrator received SIGINT"
    )
