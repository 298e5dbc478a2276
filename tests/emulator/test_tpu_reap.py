"""Teardown layers 2 and 3 (flow hooks, the orphan reaper) on the GCP provider when the
TPU API refuses to delete one of the slices: the others are still deleted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tasks import teardown
from tasks.teardown import TeardownError, reap
from tests.emulator.test_tpu_provider import LABELS, PROJECT, make_provider, spec

pytestmark = pytest.mark.emulator

NOW = 1_000_000.0  # the fake clock of make_provider: no ttl has passed
NODES = f"/v2/projects/{PROJECT}/locations/us-west4-a/nodes"


def test_one_slice_that_cannot_be_deleted_does_not_shield_the_others(fake_tpu):
    fake, host = fake_tpu
    provider = make_provider(host)
    for name in ("tpupipe-a", "tpupipe-b", "tpupipe-c"):
        provider.create(spec(name, {**LABELS, "run-id": name}))
    fake.faults = [("DELETE", f"{NODES}/tpupipe-a", 400)]  # e.g. FAILED_PRECONDITION

    with pytest.raises(TeardownError) as err:
        reap(provider, lambda flow_run_id: "COMPLETED", now=NOW)

    # Every other orphan is gone; the error names the one left and why.
    assert sorted(zone_node[1] for zone_node in fake.nodes) == ["tpupipe-a"]
    assert "tpupipe-a" in str(err.value) and "400" in str(err.value)
    assert [name for name, _ in err.value.reaped] == ["tpupipe-b", "tpupipe-c"]
    assert reap(provider, lambda flow_run_id: "COMPLETED", now=NOW) == [
        ("tpupipe-a", "its flow run is COMPLETED")
    ]  # the next run of the reaper gets it
    assert fake.nodes == {}


def test_the_crash_hook_deletes_the_rest_of_its_flow_runs_slices(fake_tpu, monkeypatch):
    fake, host = fake_tpu
    provider = make_provider(host)
    for name in ("tpupipe-a", "tpupipe-b"):
        provider.create(spec(name, {**LABELS, "run-id": name}))
    fake.faults = [("DELETE", f"{NODES}/tpupipe-a", 400)]
    monkeypatch.setattr(teardown, "provider_for", lambda config: provider)
    flow_run = SimpleNamespace(id=LABELS["flow-run-id"], parameters={})

    with pytest.raises(TeardownError, match="tpupipe-a"):
        teardown.delete_flow_run_slices(None, flow_run, SimpleNamespace(type="CRASHED"))
    assert [node for _, node in fake.nodes] == ["tpupipe-a"]


def test_a_zone_that_refuses_the_list_does_not_hide_the_others(fake_tpu):
    """One zone refusing the list stopped it for all: the reaper (and the flow's hooks)
    saw no slice at all, so orphans in the zones that answered were never deleted."""
    fake, host = fake_tpu
    zones = ("us-west4-a", "us-central1-a")
    provider = make_provider(host, zones=zones)
    provider.create(spec("tpupipe-a", {**LABELS, "run-id": "a"}))
    refused = f"/v2/projects/{PROJECT}/locations/us-west4-a/queuedResources"
    other = make_provider(host, zones=zones[::-1])  # created in the zone that answers
    other.create(spec("tpupipe-b", {**LABELS, "run-id": "b"}))

    fake.faults = [("GET", refused, 403)]
    with pytest.raises(TeardownError) as err:
        reap(provider, lambda flow_run_id: "COMPLETED", now=NOW)
    assert [name for name, _ in err.value.reaped] == ["tpupipe-b"]
    assert "us-west4-a" in str(err.value) and "listing" in str(err.value)
    assert [node for _, node in fake.nodes] == ["tpupipe-a"]  # in the zone not listed
    assert reap(provider, lambda flow_run_id: "COMPLETED", now=NOW) == [
        ("tpupipe-a", "its flow run is COMPLETED")
    ]


def test_a_slice_whose_flow_run_this_api_does_not_know_is_left_to_its_ttl(fake_tpu, caplog):
    # A `tpupipe run` from a laptop or CI records its flow run in its own temporary API:
    # a deployed reaper found "its flow run does not exist" and deleted the live slice.
    fake, host = fake_tpu
    provider = make_provider(host)
    provider.create(spec("tpupipe-live", {**LABELS, "run-id": "live"}))

    with caplog.at_level("INFO", logger="tasks.teardown"):
        assert reap(provider, lambda flow_run_id: None, now=NOW) == []
    # A reaper run that deletes nothing says what it kept (it said nothing).
    assert "kept slice tpupipe-live: not an orphan (flow run f1: state unknown" in caplog.text
    assert [node for _, node in fake.nodes] == ["tpupipe-live"]
    ttl = provider.status("tpupipe-live").labels["ttl"]  # the provider's max lifetime
    assert reap(provider, lambda flow_run_id: None, now=float(ttl) + 1) == [
        ("tpupipe-live", f"ttl {ttl} has passed")
    ]


def test_a_rerun_in_another_zone_deletes_the_slice_an_earlier_attempt_left(
    fake_tpu, tmp_path, monkeypatch, prefect_harness
):
    """A rerun with another `slice.zone` after a killed orchestrator looked for the run's
    slice only in its own zones: the node the first attempt had created stayed READY, and
    billed, until its ttl (24 h by default)."""
    from prefect import flow

    from tasks import training
    from tasks.goodput import read_events
    from workloads.events import EventLog

    fake, host = fake_tpu
    make_provider(host, zones=("us-west4-a",)).create(spec("tpupipe-r1"))  # attempt 1's
    placement = {"project": PROJECT, "zones": ["us-west4-a"]}  # as its ledger records it
    EventLog(str(tmp_path), 1, source="orchestrator").emit(
        "provision_requested", placement=placement
    )
    rerun = make_provider(host, zones=("us-east5-b",))
    monkeypatch.setattr(training, "_provider", lambda config, plan: rerun)
    plan = SimpleNamespace(
        run_dir=str(tmp_path),
        run_name="r1",
        slice_name="tpupipe-r1",
        storage_root="gs://b/r",
        flow_run_id="f2",
    )

    @flow
    def teardown_of_the_rerun() -> bool:
        return training.teardown_slice(None, plan)

    assert teardown_of_the_rerun() is True
    assert fake.nodes == {}
    # Attempt 1's node is billed until the rerun deleted it (its `attempt` label).
    (left,) = [e for e in read_events(tmp_path / "events.jsonl") if e["attempt"] == 1][1:]
    assert (left["event"], left["invocation"], left["state"]) == ("leftover_deleted", "f2", "READY")
    # A zone of another project is named for the user (the warning), not looked in.
    other = [{"project": "other-project", "zones": ["us-west4-a"]}]
    assert rerun.recall("tpupipe-r1", other) == ["other-project/us-west4-a"]


@pytest.mark.parametrize("ttl", ["soon", "nan"])
def test_a_ttl_label_that_is_no_time_leaves_the_flow_run_to_decide(ttl, caplog):
    # float("soon") failed the reaper on that slice before its flow run was looked at, so
    # a FAILED run's slice labelled so was never reaped.
    labels = {**LABELS, "ttl": ttl}
    assert teardown.orphan_reason(labels, "FAILED", NOW, None) == "its flow run is FAILED"
    assert teardown.orphan_reason(labels, "RUNNING", NOW, None) is None
    assert f"ttl label {ttl!r} is not epoch seconds" in caplog.text or ttl == "nan"
    assert teardown.orphan_reason({**LABELS, "ttl": "5"}, "RUNNING", NOW, None) == (
        "ttl 5 has passed"
    )
