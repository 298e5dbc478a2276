"""One slice name in two zones at once, on the GCP provider against the fake TPU API.

Runs of one run name under two storage roots share the node id `tpupipe-<run>`, told
apart by the `run-root` label; with fallback zones each can hold it in another zone. The
reaper, the flow's crash hook and a run's own deletes must each take only the copy they
decided on: listing kept one copy per name, and a delete took the name in every zone.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from infra.slices.base import SliceError
from tasks import teardown, training
from tasks.own_slice import SliceNameTaken
from tasks.plan import root_tag
from tasks.teardown import reap
from tests.emulator.test_tpu_provider import LABELS, make_provider, spec

pytestmark = pytest.mark.emulator

NOW = 1_000_000.0  # the fake clock of make_provider: no ttl has passed
ZONES = ("us-west4-a", "us-east5-b")
NAME = "tpupipe-exp"
DEAD = {**LABELS, "run-id": "exp", "run-root": "aaaaaaaaaaaaaaaa", "flow-run-id": "f-dead"}
LIVE = {**LABELS, "run-id": "exp", "run-root": "bbbbbbbbbbbbbbbb", "flow-run-id": "f-live"}


def _create_in(host, zone: str, labels: dict, **settings) -> None:
    make_provider(host, zones=(zone,), **settings).create(spec(NAME, labels))


def _left(fake) -> dict[str, str]:
    """The flow run of each zone's node of the name."""
    return {zone: node["labels"]["flow-run-id"] for (zone, _), node in fake.nodes.items()}


@pytest.mark.parametrize("capacity", ["on-demand", "spot"])
@pytest.mark.parametrize("dead_zone", ZONES, ids=["orphan-listed-first", "orphan-listed-last"])
def test_the_reaper_takes_the_orphan_not_the_live_slice_of_its_name_elsewhere(
    fake_tpu, dead_zone, capacity
):
    fake, host = fake_tpu
    live_zone = next(zone for zone in ZONES if zone != dead_zone)
    _create_in(host, dead_zone, DEAD, capacity=capacity)
    _create_in(host, live_zone, LIVE, capacity=capacity)
    provider = make_provider(host, zones=ZONES, capacity=capacity)
    assert [s.labels["flow-run-id"] for s in provider.list({"run-id": "exp"})] == [
        "f-dead" if zone == dead_zone else "f-live" for zone in ZONES
    ]  # each copy, in the order of the zones

    states = {"f-dead": "CRASHED", "f-live": "RUNNING"}
    assert reap(provider, states.get, now=NOW) == [(NAME, "its flow run is CRASHED")]
    assert _left(fake) == {live_zone: "f-live"}
    if capacity == "spot":  # the orphan's request went with its node; the other stays
        assert [zone for zone, _ in fake.queued] == [live_zone]


@pytest.mark.parametrize("dead_zone", ZONES)
def test_the_crash_hook_deletes_only_its_flow_runs_copy_of_a_name(fake_tpu, monkeypatch, dead_zone):
    fake, host = fake_tpu
    live_zone = next(zone for zone in ZONES if zone != dead_zone)
    _create_in(host, dead_zone, DEAD)
    _create_in(host, live_zone, LIVE)
    provider = make_provider(host, zones=ZONES)
    monkeypatch.setattr(teardown, "provider_for", lambda config: provider)
    flow_run = SimpleNamespace(id="f-dead", parameters={})

    teardown.delete_flow_run_slices(None, flow_run, SimpleNamespace(type="CRASHED"))
    assert _left(fake) == {live_zone: "f-live"}


def test_a_run_whose_name_another_root_holds_in_a_fallback_zone_creates_and_deletes_nothing_of_it(
    fake_tpu, tmp_path, monkeypatch
):
    """Its killed orchestrator left its node in the first zone; a run of the same name
    under another bucket trains in the fallback zone. The pre-create check read only the
    first zone (this run's), and the delete after it took the other run's node too."""
    fake, host = fake_tpu
    plan = SimpleNamespace(
        run_dir=str(tmp_path),
        run_name="exp",
        slice_name=NAME,
        storage_root="gs://bucket-a/root",
        flow_run_id=None,
    )
    mine = {**DEAD, "run-root": root_tag(plan), "flow-run-id": "f-old"}
    _create_in(host, ZONES[0], mine)
    _create_in(host, ZONES[1], LIVE)
    created = sum(fake.creates.values())
    provider = make_provider(host, zones=ZONES)
    monkeypatch.setattr(training, "_provider", lambda config, plan: provider)

    with pytest.raises(SliceNameTaken, match=f"run-root={LIVE['run-root']}"):
        training.provision_slice.fn(None, plan, "config.json", 2, "lease")
    assert sum(fake.creates.values()) == created
    assert _left(fake) == {ZONES[0]: "f-old", ZONES[1]: "f-live"}

    # Its teardown takes its own node and leaves the other root's standing.
    assert training.delete_own_slice(provider, plan, logging.getLogger("test")) is True
    assert _left(fake) == {ZONES[1]: "f-live"}


def test_a_create_refuses_a_live_copy_in_another_zone_and_keeps_it(fake_tpu):
    """A dead node of the name in the first zone was deleted in every zone, taking a live
    node of the same name in another zone with it."""
    fake, host = fake_tpu
    _create_in(host, ZONES[0], DEAD)
    fake.preempt(ZONES[0], NAME)
    _create_in(host, ZONES[1], LIVE)
    provider = make_provider(host, zones=ZONES)

    with pytest.raises(SliceError, match=f"already exists in {ZONES[1]}"):
        provider.create(spec(NAME, DEAD))
    assert _left(fake) == {ZONES[0]: "f-dead", ZONES[1]: "f-live"}
    assert [s.labels["flow-run-id"] for s in provider.copies(NAME)] == ["f-dead", "f-live"]


@pytest.mark.parametrize("capacity", ["on-demand", "spot"])
def test_a_slices_status_reads_its_own_copy_not_another_roots_elsewhere(fake_tpu, capacity):
    # Our spot capacity taken back (node gone, request SUSPENDED), or our node gone: the
    # status read the other root's READY node of the name in the other zone, so the
    # watch missed the reclaim and judged our attempt by the other run's workload.
    fake, host = fake_tpu
    ours = make_provider(host, zones=ZONES, capacity=capacity)
    ours.create(spec(NAME, DEAD))  # in the first zone
    _create_in(host, ZONES[1], LIVE, capacity=capacity)
    assert ours.status(NAME).labels["flow-run-id"] == "f-dead"
    if capacity == "spot":
        fake.reclaim(ZONES[0], NAME)
        assert ours.status(NAME).state.value == "PREEMPTED"
    else:
        del fake.nodes[(ZONES[0], NAME)]
        assert ours.status(NAME).state.value == "NOT_FOUND"
    assert _left(fake) == {ZONES[1]: "f-live"}
