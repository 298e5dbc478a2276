"""An orchestrator that deletes a slice an earlier attempt left records it for that attempt.

A `tpupipe run` SIGKILLed while its slice is READY leaves the node running (and billed);
the rerun deletes it before it creates its own, or in its teardown when training had
finished. That deletion was written nowhere, so the ledger billed the abandoned attempt
only to its last event. Now `leftover_deleted` names the attempt from the slice's
`attempt` label, and the ledger bills the attempt to it.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from infra.slices import SliceSpec, SliceState, build_provider
from tasks import teardown, training
from tasks.goodput import compute_goodput, read_events
from tasks.ledger import compute_ledger
from tasks.plan import plan_run, run_events, slice_labels
from tasks.pricing import price_for
from tests.helpers import tiny_config
from workloads.events import EventLog

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


@pytest.fixture
def run(tmp_path, monkeypatch):
    """A run `left` whose attempt 1 (flow run flow-a) recorded its request and READY slice
    60 s ago and whose orchestrator was then killed: the slice still stands. Yields the
    config, the rerun's plan (flow run flow-b) and the local provider."""
    monkeypatch.setattr(training, "get_run_logger", lambda: logging.getLogger("test"))
    monkeypatch.setattr(training, "workload_command", lambda config_path: SLEEP)
    config = tiny_config(tmp_path, "run_name=left")
    killed = plan_run(config, "flow-a")
    Path(killed.run_dir).mkdir(parents=True)
    clock = iter([time.time() - 60, time.time() - 58]).__next__
    events = EventLog(killed.run_dir, 1, source="orchestrator", invocation="flow-a", clock=clock)
    events.emit("provision_requested")
    events.emit("provision_ready")
    provider = build_provider("local", killed.slices_root, config.slice)
    provider.create(spec(killed, slice_labels(killed, attempt=1), tmp_path))
    yield config, plan_run(config, "flow-b"), provider
    provider.delete(killed.slice_name, grace_s=0)


def spec(plan, labels: dict[str, str], tmp_path: Path) -> SliceSpec:
    return SliceSpec(
        name=plan.slice_name,
        labels=labels,
        devices=1,
        command=SLEEP,
        log_path=str(tmp_path / "slice.log"),
    )


def leftovers(plan) -> list[dict]:
    return [e for e in read_events(f"{plan.run_dir}/events.jsonl") if "leftover" in e["event"]]


def test_the_rerun_s_attempt_records_deleting_the_killed_attempt_s_slice(run, caplog):
    config, plan, provider = run
    training.provision_slice.fn(config, plan, "config.json", 2, "lease")
    assert f"deleted slice {plan.slice_name}, left READY by attempt 1 of run left" in caplog.text

    events = read_events(f"{plan.run_dir}/events.jsonl")
    (left,) = leftovers(plan)
    assert left["event"] == "leftover_deleted"
    assert (left["attempt"], left["source"], left["invocation"]) == (1, "orchestrator", "flow-b")
    assert (left["name"], left["state"]) == (plan.slice_name, "READY")
    # Written before the rerun's first request: it stays with attempt 1's invocation.
    kinds = [(e["attempt"], e["event"]) for e in events]
    assert kinds.index((1, "leftover_deleted")) < kinds.index((2, "provision_requested"))
    # The new slice stands, labelled with the rerun's attempt.
    (copy,) = provider.copies(plan.slice_name)
    assert copy.state is SliceState.READY and copy.labels["attempt"] == "2"

    # Attempt 1 is billed from its request to the deletion, not to its READY event (58 s
    # before); the time between the invocations stays out of the wall time.
    ledger = compute_ledger(events, price_for(config), tokens_per_step=1)
    first = ledger.attempts[0]
    assert (first.billed_from, first.billed_to) == (events[0]["time"], left["time"])
    assert first.billed_s >= 60
    assert compute_goodput(events) == compute_goodput([e for e in events if e is not left])


def test_the_deletion_records_the_killed_attempt_s_last_heartbeat(run):
    # The ledger's evidence of how long the orphan trained on (`trained_after`): its
    # metrics rows come every train.log_every steps only.
    from workloads.rundir import RunDir

    config, plan, _provider = run
    RunDir(plan.run_dir).write_status("training", attempt=1, step=42, beat_s=10.0)
    beat = RunDir(plan.run_dir).read_status()
    before = time.time()
    training.provision_slice.fn(config, plan, "config.json", 2, "lease")
    (left,) = leftovers(plan)
    assert (left["beat_time"], left["beat_step"]) == (beat["time"], 42)
    # Beating within two of its intervals when the delete began: it trained until then.
    assert before <= left["trained_until"] <= left["time"]


def test_a_fresh_heartbeat_of_a_workload_that_exited_says_when_it_was_written_only(run, tmp_path):
    # Orchestrator and workload both killed, the rerun a few seconds later: the slice was
    # TERMINATED, yet its beat, still fresh, had it training until the deletion (38 s
    # lost where 0.1 s were, goodput 0.08 for 0.37: probe R, session 39).
    from workloads.rundir import RunDir

    config, plan, provider = run
    provider.delete(plan.slice_name, grace_s=0)
    exited = spec(plan, slice_labels(plan_run(config, "flow-a"), attempt=1), tmp_path)
    provider.create(dataclasses.replace(exited, command=[sys.executable, "-c", "pass"]))
    deadline = time.monotonic() + 30
    while provider.status(plan.slice_name).state is not SliceState.TERMINATED:
        assert time.monotonic() < deadline, "the workload did not exit"
        time.sleep(0.05)
    RunDir(plan.run_dir).write_status("training", attempt=1, step=42, beat_s=10.0)
    training.provision_slice.fn(config, plan, "config.json", 2, "lease")
    (left,) = leftovers(plan)
    assert left["state"] == "TERMINATED"
    assert left["beat_step"] == 42 and "trained_until" not in left


def test_a_stale_or_finished_heartbeat_says_when_it_was_written_only(run):
    from workloads.rundir import RunDir

    config, plan, _provider = run
    rundir = RunDir(plan.run_dir)
    rundir._clock = lambda: time.time() - 60  # 60 s old: no longer beating every 10 s
    rundir.write_status("training", attempt=1, step=42, beat_s=10.0)
    training.provision_slice.fn(config, plan, "config.json", 2, "lease")
    (left,) = leftovers(plan)
    assert left["beat_step"] == 42 and "trained_until" not in left


def test_a_heartbeat_of_another_attempt_is_not_recorded(run):
    from workloads.rundir import RunDir

    config, plan, _provider = run
    RunDir(plan.run_dir).write_status("training", attempt=7, step=42)
    training.provision_slice.fn(config, plan, "config.json", 2, "lease")
    (left,) = leftovers(plan)
    assert "beat_time" not in left and "beat_step" not in left


def test_the_teardown_records_a_leftover_of_any_attempt(run):
    config, plan, _provider = run
    assert training.teardown_slice.fn(config, plan) is True
    (left,) = leftovers(plan)
    assert (left["attempt"], left["invocation"]) == (1, "flow-b")


def test_an_attempt_deleting_its_own_slice_records_no_leftover(run, tmp_path):
    _config, plan, provider = run
    provider.delete(plan.slice_name, grace_s=0)
    provider.create(spec(plan, slice_labels(plan, attempt=2), tmp_path))
    events = run_events(plan, 2)
    training._delete_after(provider, plan, events, logging.getLogger("test"))
    assert leftovers(plan) == []
    assert read_events(f"{plan.run_dir}/events.jsonl")[-1]["event"] == "deleted"


def test_a_slice_without_an_attempt_label_is_deleted_and_billed_to_nobody(run, tmp_path):
    # Made by an older version (or by hand): no attempt to bill it to.
    config, plan, provider = run
    provider.delete(plan.slice_name, grace_s=0)
    provider.create(spec(plan, {"run-id": plan.run_id}, tmp_path))
    assert training.teardown_slice.fn(config, plan) is True
    assert provider.copies(plan.slice_name) == []
    assert leftovers(plan) == []


def test_the_reaper_records_deleting_a_killed_run_s_slice_and_bills_it(run):
    # The run's orchestrator was SIGKILLed and no rerun came: the reaper deleted its slice,
    # which the ledger billed only to the attempt's last event, short of the node's time.
    config, plan, provider = run
    reaped = teardown.reap(
        provider,
        lambda flow_run_id: "CRASHED",
        on_deleted=lambda status: teardown.record_teardown_delete(config, status, "reaper"),
    )
    assert reaped == [(plan.slice_name, "its flow run is CRASHED")]
    (left,) = leftovers(plan)
    assert (left["attempt"], left["invocation"], left["state"]) == (1, "reaper", "READY")
    events = read_events(f"{plan.run_dir}/events.jsonl")
    first = compute_ledger(events, price_for(config), tokens_per_step=1).attempts[0]
    assert (first.billed_from, first.billed_to) == (events[0]["time"], left["time"])


def test_the_crash_hook_records_deleting_its_flow_run_s_slice(run):
    config, plan, provider = run
    flow_run = SimpleNamespace(id="flow-a", parameters={"config": config.model_dump()})
    teardown.delete_flow_run_slices(None, flow_run, SimpleNamespace(type="CRASHED"))
    assert provider.copies(plan.slice_name) == []
    (left,) = leftovers(plan)
    assert (left["attempt"], left["invocation"]) == (1, "flow-a")


def test_the_reaper_records_nothing_for_a_run_under_another_root(run, tmp_path):
    # Its labels hash another storage root: the run directory is not the one found here,
    # whatever its name; the slice is deleted all the same.
    _config, plan, provider = run
    other = tiny_config(tmp_path / "elsewhere", "run_name=left")
    Path(plan_run(other).run_dir).mkdir(parents=True)
    Path(plan_run(other).run_dir, "events.jsonl").write_text("")
    deleted = []
    teardown.reap(
        provider,
        lambda flow_run_id: "FAILED",
        on_deleted=lambda s: deleted.append(teardown.record_teardown_delete(other, s, "r")),
    )
    assert deleted == [False] and provider.copies(plan.slice_name) == []
    assert leftovers(plan) == [] and leftovers(plan_run(other)) == []


def test_the_reaper_makes_no_run_directory_for_a_slice_whose_run_is_gone(run):
    config, plan, provider = run
    shutil.rmtree(plan.run_dir)
    recorded = []
    teardown.reap(
        provider,
        lambda flow_run_id: "COMPLETED",
        on_deleted=lambda s: recorded.append(teardown.record_teardown_delete(config, s, "r")),
    )
    assert recorded == [False] and not Path(plan.run_dir).exists()


@pytest.mark.integration
def test_a_rerun_of_a_finished_run_bills_the_slice_its_first_invocation_left(
    tmp_path, prefect_harness, monkeypatch
):
    # The first invocation trains to the end but cannot delete its slice (its attempt's
    # delete and the flow's teardown both refused, as an orchestrator killed after its
    # attempt ended would leave it); the rerun finds training finished and deletes it.
    import flows.pipeline as pipeline
    from infra.metrics import DuckDBSink
    from infra.slices import LocalSliceProvider, SliceError

    real_delete = LocalSliceProvider.delete

    def refuse(self, name, grace_s=5.0, where=None):
        if not self.copies(name):  # the delete before the create finds nothing
            return real_delete(self, name, grace_s, where=where)
        raise SliceError(f"slice {name!r} could not be deleted: 503")

    config = tiny_config(tmp_path, "run_name=finished")
    monkeypatch.setattr(LocalSliceProvider, "delete", refuse)
    with pytest.raises(SliceError):
        pipeline.tpu_training_pipeline(config=config)
    monkeypatch.setattr(LocalSliceProvider, "delete", real_delete)
    plan = plan_run(config)
    before = read_events(f"{plan.run_dir}/events.jsonl")
    assert [e["event"] for e in before if e["event"] in ("attempt_ended", "deleted")] == [
        "attempt_ended"
    ]

    run = pipeline.tpu_training_pipeline(config=config)

    (left,) = leftovers(plan)
    assert (left["attempt"], left["invocation"]) == (1, run.flow_run_id)
    events = read_events(f"{plan.run_dir}/events.jsonl")
    requested = next(e["time"] for e in events if e["event"] == "provision_requested")
    chips = price_for(config).chips
    assert run.chip_hours == pytest.approx(chips * (left["time"] - requested) / 3600)
    # The rerun's goodput and wall time are the first invocation's: nothing was timed.
    assert run.wall_s == pytest.approx(compute_goodput(before).wall_s)
    assert run.goodput == pytest.approx(compute_goodput(before).goodput)
    sink = DuckDBSink(str(tmp_path / "metrics.duckdb"))
    ((hours,),) = sink.query("SELECT chip_hours FROM runs WHERE run_id = 'finished'")
    assert hours == pytest.approx(run.chip_hours)
