"""The GCP slice provider under API faults the happy-path tests never script: transient
errors on any call, create operations that fail, permanent errors on a create."""

from __future__ import annotations

import signal
import threading

import pytest
from google.api_core import exceptions as gexc

from infra.slices.base import ProvisioningError, SliceError, SliceState
from infra.slices.gcp import TpuPermissionError
from tests.emulator.test_tpu_provider import LABELS, PROJECT, FakeClock, make_provider, spec
from tests.fake_tpu import RESET

pytestmark = pytest.mark.emulator

ZONES = ("us-west4-a", "us-east5-b")
NODE = f"/v2/projects/{PROJECT}/locations/us-west4-a/nodes/tpupipe-r1"


def test_transient_errors_on_every_kind_of_call_are_retried(fake_tpu):
    fake, host = fake_tpu
    provider = make_provider(host)
    fake.faults = [("GET", NODE, 503), ("GET", "/operations/op-1", 503), ("GET", NODE, 429)]
    assert provider.create(spec()).state is SliceState.READY
    fake.faults = [("GET", NODE, 500)]
    assert provider.status("tpupipe-r1").state is SliceState.READY
    fake.faults = [("DELETE", NODE, 503), ("GET", "/operations/op-2", 503)]
    assert provider.delete("tpupipe-r1") is True
    assert fake.nodes == {} and fake.faults == []


@pytest.mark.parametrize("code", [13, 14], ids=["INTERNAL", "UNAVAILABLE"])
def test_a_create_operation_that_failed_transiently_is_tried_again(fake_tpu, code):
    fake, host = fake_tpu
    fake.create_errors["us-west4-a"] = [("op", code, "An internal error has occurred")]
    clock = FakeClock()
    provider = make_provider(host, clock=clock, zones=ZONES, provision_attempts=2)

    assert provider.create(spec()).state is SliceState.READY
    assert ("us-west4-a", "tpupipe-r1") in fake.nodes and len(fake.nodes) == 1
    assert len([s for s in clock.sleeps if s != 0.01]) == 1  # one backoff (not a 0.01 s poll)


def test_a_create_that_keeps_failing_transiently_is_a_provisioning_error(fake_tpu):
    fake, host = fake_tpu
    for zone in ZONES:
        fake.create_errors[zone] = [("op", 13, "An internal error has occurred")] * 2
    provider = make_provider(host, zones=ZONES, provision_attempts=2)

    # ProvisioningError: the provision task's retry budget (with its backoff) applies.
    with pytest.raises(ProvisioningError, match="internal error"):
        provider.create(spec())
    assert fake.nodes == {} and fake.queued == {}


@pytest.mark.parametrize(
    "error",
    [(400, "Invalid accelerator type"), ("op", 3, "Invalid accelerator type")],
    ids=["call", "operation"],
)
def test_a_refused_create_names_slice_and_zone_and_is_not_retried(fake_tpu, error):
    fake, host = fake_tpu
    fake.create_errors["us-west4-a"] = [error]
    provider = make_provider(host, zones=ZONES)

    with pytest.raises(SliceError) as err:
        provider.create(spec())
    assert not isinstance(err.value, ProvisioningError)  # a config error: never retried
    message = str(err.value)
    assert "'tpupipe-r1'" in message and "us-west4-a" in message
    assert "v5litepod-8" in message and "Invalid accelerator type" in message
    assert [c for c in fake.calls if c[0] == "POST"] == [("POST", NODE.rsplit("/", 1)[0])]
    assert fake.nodes == {}


def test_a_connection_reset_is_retried_like_any_transient_error(fake_tpu):
    fake, host = fake_tpu
    provider = make_provider(host)
    fake.faults = [("GET", NODE, RESET)]
    assert provider.create(spec()).state is SliceState.READY
    fake.faults = [("GET", NODE, RESET)]
    assert provider.status("tpupipe-r1").state is SliceState.READY
    fake.faults = [("DELETE", NODE, RESET)]
    assert provider.delete("tpupipe-r1") is True
    assert fake.nodes == {} and fake.faults == []


def test_a_zone_that_refuses_the_delete_does_not_shield_the_slice_in_another(fake_tpu):
    fake, host = fake_tpu
    fake.create_errors["us-west4-a"] = [("op", 8, "no capacity")]
    make_provider(host, zones=ZONES, provision_attempts=1).create(spec())
    assert [zone for zone, _ in fake.nodes] == ["us-east5-b"]  # the fallback zone
    # Teardown runs in another process: a new provider, which tries the zones in order.
    qr = f"/v2/projects/{PROJECT}/locations/us-west4-a/queuedResources/tpupipe-r1"
    fake.faults = [("DELETE", qr, 400)]

    with pytest.raises(SliceError, match="us-west4-a") as err:
        make_provider(host, zones=ZONES).delete("tpupipe-r1")
    assert "'tpupipe-r1'" in str(err.value)
    assert fake.nodes == {}  # the node in the fallback zone was deleted all the same


def test_a_spot_request_the_operation_refuses_for_capacity_falls_back_to_the_next_zone(
    fake_tpu,
):
    fake, host = fake_tpu
    fake.create_errors["us-west4-a"] = [("op", 8, "no spot capacity")]
    provider = make_provider(host, zones=ZONES, provision_attempts=1, capacity="spot")

    assert provider.create(spec()).state is SliceState.READY
    assert list(fake.queued) == [("us-east5-b", "tpupipe-r1")]
    assert [zone for zone, _ in fake.nodes] == ["us-east5-b"]
    assert provider.delete("tpupipe-r1") is True
    assert fake.nodes == {} and fake.queued == {}


def test_a_refused_read_of_the_exit_records_names_cloud_storage_not_the_tpu_api(fake_tpu):
    class DeniedStorage:
        def list_blobs(self, bucket, prefix=None, retry=None):
            raise gexc.Forbidden("storage.objects.list denied on bucket 'bucket'")

    _fake, host = fake_tpu
    provider = make_provider(host, storage=DeniedStorage())
    provider.create(spec())

    with pytest.raises(SliceError) as err:
        provider.status("tpupipe-r1")
    message = str(err.value)
    assert "gs://bucket/root/runs/r1/logs/tpupipe-r1-" in message
    assert "storage.objects.list" in message and "roles/tpu.admin" not in message


def test_transient_errors_while_polling_an_operation_are_retried(fake_tpu):
    fake, host = fake_tpu
    provider = make_provider(host)
    fake.faults = [("GET", "/operations/op-1", RESET), ("GET", "/operations/op-1", 500)]
    assert provider.create(spec()).state is SliceState.READY
    fake.faults = [("GET", "/operations/op-2", 429), ("GET", "/operations/op-2", RESET)]
    assert provider.delete("tpupipe-r1") is True
    assert fake.nodes == {} and fake.faults == [] and fake.creates["tpupipe-r1"] == 1


def test_an_operation_that_never_finishes_is_an_error_naming_the_slice(fake_tpu):
    # A delete the API accepted but never finished raised a bare TimeoutError ("Operation
    # did not complete within the designated timeout"): the run's error and the teardown
    # task named no slice, and a create's escaped the zone loop the same way.
    fake, host = fake_tpu
    provider = make_provider(host, provision_timeout_s=0.5)
    provider.create(spec())
    fake.op_polls = 10**9  # from now on, no operation ever reports done

    with pytest.raises(SliceError, match=r"'tpupipe-r1'.*us-west4-a.*slice.provision_timeout_s"):
        provider.delete("tpupipe-r1")
    with pytest.raises(SliceError, match=r"'tpupipe-r2'.*slice.provision_timeout_s"):
        provider.create(spec("tpupipe-r2"))


def interrupt_when_a_create_arrives(fake) -> None:
    """Ctrl-C (SIGINT) in this thread once the fake holds a create request in flight."""
    main = threading.get_ident()

    def interrupt() -> None:
        if fake.create_arrived.wait(30):
            signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()


@pytest.mark.parametrize("capacity", ["on-demand", "spot"])
def test_a_create_interrupted_in_flight_is_deleted_when_it_lands_after_the_delete(
    fake_tpu, capacity
):
    # A signal while the create request is in flight: the run's teardown deletes at once,
    # finds nothing, and the API carries the request out a moment later. That slice would
    # have run, billed, until a reaper saw its ttl.
    fake, host = fake_tpu
    fake.hold_creates = threading.Event()
    provider = make_provider(host, capacity=capacity)
    interrupt_when_a_create_arrives(fake)
    with pytest.raises(KeyboardInterrupt):
        provider.create(spec())
    assert fake.nodes == {} and fake.queued == {}  # not carried out yet
    threading.Timer(0.3, fake.hold_creates.set).start()
    assert provider.delete("tpupipe-r1") is True
    assert fake.nodes == {} and fake.queued == {} and sum(fake.creates.values()) <= 1
    # Answered creates are not watched for: a delete of nothing returns at once.
    fake.hold_creates = None
    assert provider.delete("tpupipe-r1") is False


def test_an_interrupted_create_that_never_lands_is_watched_for_late_create_s(fake_tpu):
    fake, host = fake_tpu
    fake.hold_creates = threading.Event()  # never set while the delete watches
    clock = FakeClock()
    provider = make_provider(host, clock=clock, late_create_s=2.0)
    interrupt_when_a_create_arrives(fake)
    with pytest.raises(KeyboardInterrupt):
        provider.create(spec())
    started = clock.now
    assert provider.delete("tpupipe-r1") is False
    assert 2.0 <= clock.now - started <= 2.1
    fake.hold_creates.set()


def test_a_zone_that_answers_403_to_the_delete_does_not_shield_the_slice_in_another(fake_tpu):
    fake, host = fake_tpu
    fake.create_errors["us-west4-a"] = [("op", 8, "no capacity")]
    make_provider(host, zones=ZONES, provision_attempts=1).create(spec())
    assert [zone for zone, _ in fake.nodes] == ["us-east5-b"]
    # The reaper, a new provider, tries the first zone first; it now refuses TPU calls.
    qr = f"/v2/projects/{PROJECT}/locations/us-west4-a/queuedResources/tpupipe-r1"
    fake.faults = [("DELETE", qr, 403)]

    with pytest.raises(
        TpuPermissionError, match=r"refused to delete TPUs .*: in us-west4-a: DELETE"
    ):
        make_provider(host, zones=ZONES).delete("tpupipe-r1")
    assert fake.nodes == {}  # the billed node in the fallback zone was deleted all the same


@pytest.mark.parametrize("state", ["SUSPENDED", "SUSPENDING"])
def test_a_reclaimed_spot_slice_reads_as_preempted_and_is_created_again(fake_tpu, state):
    fake, host = fake_tpu
    provider = make_provider(host, capacity="spot")
    provider.create(spec())
    fake.reclaim("us-west4-a", "tpupipe-r1", state)

    # Not CREATING: the watch re-creates a PREEMPTED slice at once, and waited out its
    # heartbeat timeout (900 s in configs/v5e-8-spot.yaml) for a CREATING one.
    assert provider.status("tpupipe-r1").state is SliceState.PREEMPTED
    listed = make_provider(host).list({"run-id": "r1"})
    assert [(s.name, s.state) for s in listed] == [("tpupipe-r1", SliceState.PREEMPTED)]
    assert provider.create(spec()).state is SliceState.READY


def test_a_spot_request_that_expired_unwatched_does_not_block_the_next_create(fake_tpu):
    fake, host = fake_tpu
    fake.spot_waits = True
    provider = make_provider(host, capacity="spot", queue_timeout_s=1e9)
    qr = fake.queued[("us-west4-a", "tpupipe-r1")] = {
        "name": f"projects/{PROJECT}/locations/us-west4-a/queuedResources/tpupipe-r1",
        "tpu": {"nodeSpec": [{"nodeId": "tpupipe-r1", "node": {"labels": LABELS}}]},
        "state": {"state": "FAILED", "failedData": {"error": {"code": 8, "message": "expired"}}},
    }
    assert qr and provider.status("tpupipe-r1").state is SliceState.NOT_FOUND

    fake.spot_waits = False  # capacity now: the new request is served
    assert provider.create(spec()).state is SliceState.READY  # was "already exists"


def test_a_deleted_exit_record_bucket_ends_the_watch_naming_it(fake_tpu):
    class NoBucket:
        def list_blobs(self, bucket, prefix=None, retry=None):
            raise gexc.NotFound("The specified bucket does not exist.")

    _fake, host = fake_tpu
    provider = make_provider(host, storage=NoBucket())
    provider.create(spec())

    with pytest.raises(SliceError, match="gs://bucket deleted during the run"):
        provider.status("tpupipe-r1")
