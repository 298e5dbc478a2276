"""The GCP slice provider through the real `TpuClient` (REST) against the fake TPU API."""

from __future__ import annotations

import json
import threading
import time

import pytest
from google.api_core import retry as gretry

from infra.slices import gcp, gcp_zone
from infra.slices.base import ProvisioningError, SliceSpec, SliceState
from infra.slices.gcp import CapacityError, GcpSliceProvider, TpuPermissionError
from infra.slices.gcp_node import STARTUP_SCRIPT, TpuSettings

pytestmark = pytest.mark.emulator

PROJECT = "test-project"
CONFIG_URI = "gs://bucket/root/runs/r1/config.json"
LABELS = {"managed-by": "tpupipe", "run-id": "r1", "flow-run-id": "f1", "attempt": "1"}


class FakeClock:
    """Time that moves only when the provider sleeps: timeouts without waiting."""

    def __init__(self) -> None:
        self.now, self.sleeps = 1_000_000.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        time.sleep(0.001)


def make_provider(host, storage=None, clock=None, **overrides) -> GcpSliceProvider:
    from infra.gcp.clients import tpu_client

    settings = TpuSettings(
        project=PROJECT,
        zones=overrides.pop("zones", ("us-west4-a",)),
        accelerator_type="v5litepod-8",
        runtime_version="v2-alpha-tpuv5-lite",
        wheel="gs://bucket/wheels/tpupipe-0.1.0-py3-none-any.whl",
        tpu_packages=("jax[tpu]==0.10.2",),
        poll_s=0.01,
        backoff_s=7.0,
        **overrides,
    )
    clock = clock or FakeClock()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPU_EMULATOR_HOST", host)
        client = tpu_client()
    return GcpSliceProvider(client, storage, settings, clock=clock, sleep=clock.sleep)


def spec(name: str = "tpupipe-r1", labels: dict | None = None, hosts: int = 1) -> SliceSpec:
    return SliceSpec(
        name=name,
        labels=labels or LABELS,
        devices=8,
        hosts=hosts,
        command=["/usr/bin/python3", "-m", "workloads.train", "--config", CONFIG_URI],
        env={"EXTRA": "1"},
        log_path="gs://bucket/root/runs/r1/logs/tpupipe-r1.log",
    )


def test_create_waits_for_ready_and_builds_the_node(fake_tpu):
    fake, host = fake_tpu
    fake.creating_polls = 3
    provider = make_provider(host)

    status = provider.create(spec())

    assert status.state is SliceState.READY
    node = fake.nodes[("us-west4-a", "tpupipe-r1")]
    assert node["acceleratorType"] == "v5litepod-8"
    assert node["runtimeVersion"] == "v2-alpha-tpuv5-lite"
    assert node["networkConfig"].get("enableExternalIps", False) is False
    labels = node["labels"]
    assert {k: labels[k] for k in LABELS} == LABELS
    assert int(labels["ttl"]) == 1_000_000 + 86400 and labels["launch"]
    md = node["metadata"]
    # The script is constant; user values travel as data in their own metadata keys.
    assert md["startup-script"] == STARTUP_SCRIPT and CONFIG_URI not in STARTUP_SCRIPT
    assert json.loads(md["tpupipe-argv"]) == ["-m", "workloads.train", "--config", CONFIG_URI]
    assert json.loads(md["tpupipe-env"]) == {"EXTRA": "1"}
    assert md["tpupipe-exit-uri"].startswith("gs://bucket/root/runs/r1/logs/tpupipe-r1-")
    assert provider.status("tpupipe-r1").state is SliceState.READY


def test_multi_host_slice_lets_jax_find_its_peers(fake_tpu):
    fake, host = fake_tpu
    make_provider(host).create(spec(hosts=4))
    env = json.loads(fake.nodes[("us-west4-a", "tpupipe-r1")]["metadata"]["tpupipe-env"])
    assert env["TPUPIPE_DISTRIBUTED"] == "auto"


def test_preempted_node_is_deleted_before_the_next_create(fake_tpu):
    fake, host = fake_tpu
    provider = make_provider(host)
    provider.create(spec())
    fake.preempt("us-west4-a", "tpupipe-r1")
    assert provider.status("tpupipe-r1").state is SliceState.PREEMPTED

    provider.create(spec())

    calls = [c for c in fake.calls if c[1].endswith(("/nodes", "/nodes/tpupipe-r1"))]
    delete_at = calls.index(
        ("DELETE", f"/v2/projects/{PROJECT}/locations/us-west4-a/nodes/tpupipe-r1")
    )
    second_create = [i for i, c in enumerate(calls) if c[0] == "POST"][1]
    assert delete_at < second_create
    assert fake.creates["tpupipe-r1"] == 2 and len(fake.nodes) == 1
    assert provider.status("tpupipe-r1").state is SliceState.READY


def test_a_live_slice_is_never_created_twice(fake_tpu):
    fake, host = fake_tpu
    provider = make_provider(host)
    provider.create(spec())
    with pytest.raises(gcp.SliceError, match="already exists"):
        provider.create(spec())
    assert fake.creates["tpupipe-r1"] == 1


def test_a_create_whose_answer_was_lost_adopts_its_node(fake_tpu, monkeypatch):
    fake, host = fake_tpu
    monkeypatch.setattr(
        gcp_zone,
        "CREATE_RETRY",
        gretry.Retry(predicate=gcp_zone.CREATE_RETRY._predicate, initial=0.01),
    )
    fake.create_errors["us-west4-a"] = [("lost",)]
    provider = make_provider(host)

    assert provider.create(spec()).state is SliceState.READY
    # The retried POST met its own node (409) and adopted it: one node, not two.
    posts = [c for c in fake.calls if c[0] == "POST"]
    assert len(posts) == 2 and fake.creates["tpupipe-r1"] == 1 and len(fake.nodes) == 1


def test_quota_and_capacity_errors_back_off_then_fall_back_to_the_next_zone(fake_tpu):
    fake, host = fake_tpu
    fake.create_errors["us-west4-a"] = [
        (429, "Quota 'TPUV5S_LITEPOD' exceeded"),
        ("op", 8, "no capacity"),
    ]
    clock = FakeClock()
    provider = make_provider(
        host, clock=clock, zones=("us-west4-a", "us-east5-b"), provision_attempts=2
    )

    status = provider.create(spec())

    assert status.state is SliceState.READY
    assert ("us-east5-b", "tpupipe-r1") in fake.nodes and len(fake.nodes) == 1
    # One backoff between the two attempts in the first zone (jittered, at most 2x). Told
    # from the polls (0.01 s) by being another value: as "over 0.01 s", a jittered backoff
    # drawn from [0, 7) below it (1 time in 700) failed the test.
    backoffs = [s for s in clock.sleeps if s != 0.01]
    assert len(backoffs) == 1 and 0 <= backoffs[0] <= 14.0
    assert provider.status("tpupipe-r1").state is SliceState.READY


def test_no_capacity_anywhere_is_a_capacity_error_and_leaves_nothing(fake_tpu):
    fake, host = fake_tpu
    for zone in ("us-west4-a", "us-east5-b"):
        fake.create_errors[zone] = [("op", 8, "no capacity")] * 2
    provider = make_provider(host, zones=("us-west4-a", "us-east5-b"), provision_attempts=2)

    with pytest.raises(CapacityError, match="us-west4-a, us-east5-b"):
        provider.create(spec())
    assert fake.nodes == {} and fake.queued == {}


def test_permission_denied_fails_at_once_naming_api_and_role(fake_tpu):
    fake, host = fake_tpu
    fake.deny = True
    provider = make_provider(host, service_account="tpu-vm@test-project.iam.gserviceaccount.com")

    with pytest.raises(TpuPermissionError) as err:
        provider.create(spec())
    message = str(err.value)
    assert "tpu.googleapis.com" in message and "roles/tpu.admin" in message
    assert "roles/iam.serviceAccountUser" in message
    assert len(fake.calls) == 1  # the first refusal ends it: nothing retried


def test_spot_goes_through_a_queued_resource_with_a_valid_until_bound(fake_tpu):
    fake, host = fake_tpu
    provider = make_provider(host, capacity="spot", queue_timeout_s=900)

    assert provider.create(spec()).state is SliceState.READY

    qr = fake.queued[("us-west4-a", "tpupipe-r1")]
    assert "spot" in qr and qr["queueingPolicy"]["validUntilDuration"] == "900s"
    assert provider.delete("tpupipe-r1") is True
    assert fake.queued == {} and fake.nodes == {}


def test_a_spot_request_still_waiting_at_its_timeout_is_cancelled(fake_tpu):
    fake, host = fake_tpu
    fake.spot_waits = True
    provider = make_provider(host, capacity="spot", queue_timeout_s=0.05, provision_attempts=1)

    with pytest.raises(CapacityError):
        provider.create(spec())

    qr_path = f"/v2/projects/{PROJECT}/locations/us-west4-a/queuedResources/tpupipe-r1"
    assert ("DELETE", qr_path) in fake.calls
    assert fake.queued == {} and fake.nodes == {}


def test_teardown_cancels_a_waiting_request_that_list_shows(fake_tpu):
    fake, host = fake_tpu
    fake.spot_waits = True
    provider = make_provider(host, capacity="spot", queue_timeout_s=1e9)
    outcome: list[BaseException] = []

    def create() -> None:
        try:
            provider.create(spec())
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=create)
    thread.start()
    deadline = time.monotonic() + 10
    while ("us-west4-a", "tpupipe-r1") not in fake.queued and time.monotonic() < deadline:
        time.sleep(0.01)

    listed = provider.list({"run-id": "r1"})
    assert [(s.name, s.state) for s in listed] == [("tpupipe-r1", SliceState.CREATING)]
    assert provider.status("tpupipe-r1").state is SliceState.CREATING
    assert provider.delete("tpupipe-r1") is True
    thread.join(10)

    assert fake.queued == {} and fake.nodes == {}
    assert outcome and isinstance(outcome[0], ProvisioningError)


def test_delete_is_idempotent_and_list_filters_by_label(fake_tpu):
    _fake, host = fake_tpu
    provider = make_provider(host)
    provider.create(spec("tpupipe-a", {**LABELS, "run-id": "a"}))
    provider.create(spec("tpupipe-b", {**LABELS, "run-id": "b"}))

    assert [s.name for s in provider.list({"run-id": "a"})] == ["tpupipe-a"]
    assert len(provider.list({"managed-by": "tpupipe"})) == 2
    assert provider.delete("tpupipe-a") is True
    assert provider.delete("tpupipe-a") is False
    assert provider.status("tpupipe-a").state is SliceState.NOT_FOUND
    assert [s.name for s in provider.list()] == ["tpupipe-b"]


def test_exit_records_in_gcs_turn_a_ready_node_terminated(fake_tpu, gcs_client, bucket):
    fake, host = fake_tpu
    provider = make_provider(host, storage=gcs_client)
    s = spec(hosts=2)
    s = SliceSpec(**{**s.__dict__, "log_path": f"gs://{bucket}/runs/r1/logs/tpupipe-r1.log"})
    provider.create(s)
    exit_uri = fake.nodes[("us-west4-a", "tpupipe-r1")]["metadata"]["tpupipe-exit-uri"]
    prefix = exit_uri.removeprefix(f"gs://{bucket}/")

    def record(worker: int, code: int) -> None:
        blob = gcs_client.bucket(bucket).blob(f"{prefix}/worker-{worker}.json")
        blob.upload_from_string(json.dumps({"worker": worker, "exit_code": code}))

    record(0, 0)
    assert provider.status("tpupipe-r1").state is SliceState.READY  # worker 1 still runs
    record(1, 75)
    status = provider.status("tpupipe-r1")
    assert (status.state, status.exit_code, status.host) == (SliceState.TERMINATED, 75, 1)


def test_a_worker_failing_in_its_start_up_script_is_reported_as_such(
    fake_tpu, gcs_client, bucket, tmp_path
):
    # It read "exited with code 127: see the slice log", naming neither slice.wheel nor
    # the URI, though the script's record says it failed in start-up (no slice log exists).
    from tasks.watch import WatchSettings, WorkloadFailed, watch_slice
    from workloads.rundir import RunDir

    fake, host = fake_tpu
    provider = make_provider(host, storage=gcs_client)
    s = spec()
    s = SliceSpec(**{**s.__dict__, "log_path": f"gs://{bucket}/runs/r1/logs/tpupipe-r1.log"})
    provider.create(s)
    exit_uri = fake.nodes[("us-west4-a", "tpupipe-r1")]["metadata"]["tpupipe-exit-uri"]
    record = {"worker": 0, "exit_code": 127, "stage": "startup"}  # STARTUP_SCRIPT's ERR trap
    blob = gcs_client.bucket(bucket).blob(
        f"{exit_uri.removeprefix(f'gs://{bucket}/')}/worker-0.json"
    )
    blob.upload_from_string(json.dumps(record))

    with pytest.raises(WorkloadFailed) as err:
        watch_slice(
            provider, "tpupipe-r1", RunDir(str(tmp_path)), WatchSettings(0.01, 60, 0), print
        )
    message = str(err.value)
    assert "code 127" in message and "failed during start-up" in message
    assert (
        "slice.wheel" in message and "gs://bucket/wheels/tpupipe-0.1.0-py3-none-any.whl" in message
    )


@pytest.mark.parametrize("name", ["tpupipe-r1-", "1-tpupipe", "-tpupipe", "tpupipe_r1", "a" * 64])
def test_a_slice_name_the_api_would_refuse_is_refused_before_any_call(fake_tpu, name):
    fake, host = fake_tpu
    with pytest.raises(ValueError, match="must be 1-63 characters"):
        make_provider(host).create(spec(name=name))
    assert fake.calls == []


def test_the_longest_names_a_config_allows_give_slices_the_api_accepts(fake_tpu, tmp_path):
    # The fake answers INVALID_ARGUMENT to ids and labels the real API refuses (shown by
    # the direct call below), so this is what a run with such names would meet there.
    from tasks.plan import plan_run, slice_labels
    from tests.helpers import tiny_config

    fake, host = fake_tpu
    provider = make_provider(host, capacity="spot")
    names = ["a" * 63, "9" + "a" * 62, f"{'s' * 51}-t100", "r"]
    for name in names:
        plan = plan_run(tiny_config(tmp_path, f"run_name={name}")).model_copy(
            update={"flow_run_id": "0b9e5f4c-7a43-4cf1-9b4d-1f0c8a1e2d3f"}
        )
        labels = slice_labels(plan, attempt=12, ttl_s=86400)
        made = SliceSpec(**{**spec().__dict__, "name": plan.slice_name, "labels": labels})
        assert provider.create(made).state is SliceState.READY, name
    assert len(fake.nodes) == len(names)
    bad = fake.handle("POST", "/v2/projects/p/locations/z/nodes?nodeId=r1-", {"labels": {}})
    assert bad[0] == 400 and bad[1]["error"]["status"] == "INVALID_ARGUMENT"
