"""The Prefect flow itself on the GCP backends: the GCP slice provider against the fake TPU
API (whose "VM" runs the real launcher and workload here), the whole run directory and the
dataset in the GCS emulator, the metrics in the BigQuery emulator."""

from __future__ import annotations

import os

import pytest

from infra.gcp.clients import bigquery_client
from infra.metrics.bigquery_sink import BigQuerySink
from tasks.goodput import read_events
from tests.emulator.test_gcp_run import ZONE, FakeVms
from tests.helpers import tiny_config

pytestmark = [pytest.mark.emulator, pytest.mark.slow]


@pytest.fixture
def vms(fake_tpu, tmp_path):
    fake, host = fake_tpu
    machines = FakeVms(host, tmp_path / "vm-logs")
    fake.on_ready, fake.on_gone = machines.ready, machines.gone
    os.environ["TPU_EMULATOR_HOST"] = host
    yield fake, machines
    del os.environ["TPU_EMULATOR_HOST"]
    machines.stop_all()


def test_the_pipeline_flow_runs_on_the_gcp_backends(
    vms, gcs_client, bucket, bq_emulator, tmp_path, monkeypatch, prefect_harness
):
    from flows.pipeline import tpu_training_pipeline

    fake, _ = vms
    monkeypatch.setenv("TPUPIPE_DATASET_CACHE", str(tmp_path / "dataset-cache"))
    wheel = "wheels/tpupipe-0.1.0-py3-none-any.whl"  # checked before provisioning; the
    gcs_client.bucket(bucket).blob(wheel).upload_from_string(b"a wheel")  # fake VMs skip it
    config = tiny_config(
        tmp_path,
        f"storage.root=gs://{bucket}/flow",
        "slice.provider=gcp",
        "slice.project=test-project",
        f"slice.zone={ZONE}",
        "slice.accelerator_type=v5litepod-8",
        "slice.runtime_version=v2-alpha-tpuv5-lite",
        f"slice.wheel=gs://{bucket}/{wheel}",
        "slice.poll_interval_s=0.2",
        "metrics.sink=bigquery",
        "metrics.project=test-project",
        "metrics.dataset=flow",
    )
    run = tpu_training_pipeline(config=config)

    assert run.status == "completed" and run.final_step == config.train.steps
    assert run.run_dir.startswith(f"gs://{bucket}/flow/runs/")
    # The dataset was published to GCS, manifest last, and the workload read it from there.
    names = {b.name for b in gcs_client.list_blobs(bucket, prefix="flow/datasets/")}
    assert any(n.endswith("/manifest.json") for n in names)
    assert any(n.endswith(".arrayrecord") for n in names)
    # The run's lock object (one orchestrator per gs:// run across machines) was released.
    assert list(gcs_client.list_blobs(bucket, prefix="flow/locks/")) == []
    # The slice is gone and the node was created exactly once.
    assert fake.nodes == {} and sum(fake.creates.values()) == 1
    # Where it was asked for, for a rerun with other zones to find (test_tpu_reap).
    requested = [
        e for e in read_events(f"{run.run_dir}/events.jsonl") if e["event"] == "provision_requested"
    ]
    assert [e["placement"] for e in requested] == [{"project": "test-project", "zones": [ZONE]}]
    sink = BigQuerySink(bigquery_client("test-project"), "flow")
    ((steps, evals),) = sink.query(
        "SELECT (SELECT COUNT(DISTINCT step) FROM `flow.step_metrics` WHERE run_id = @run_id),"
        " (SELECT COUNT(*) FROM `flow.eval_metrics` WHERE run_id = @run_id)",
        run.run_id,
    )
    assert steps >= config.train.steps // config.train.log_every and evals == 1
