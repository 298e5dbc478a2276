"""A training run on the GCP backends, end to end without a cloud: the GCP provider creates
a slice on the fake TPU API, whose "VM" runs the real launcher and the real workload on this
machine; the run directory and the orbax checkpoints are in the GCS emulator, the metrics
land in the BigQuery emulator. The slice is preempted mid-run, re-created and resumes.

The steps are driven one by one here, to script a preemption between them; the flow
itself on these backends is tests/emulator/test_gcp_flow.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime

import pytest

from infra.metrics.bigquery_sink import BigQuerySink
from infra.slices.base import SliceSpec, SliceState
from infra.slices.gcp import GcpSliceProvider
from infra.slices.gcp_node import TpuSettings
from tasks.landing import build_rows
from tasks.plan import plan_run, slice_labels, write_workload_config
from tasks.training import workload_command
from tasks.watch import WatchSettings, WorkloadPreempted, watch_slice
from tests.emulator.conftest import REPO
from tests.helpers import tiny_config
from workloads import checkpoint, data
from workloads.rundir import RunDir

pytestmark = [pytest.mark.emulator, pytest.mark.slow]
ZONE = "us-west4-a"


class FakeVms:
    """Starts the launcher as each READY node's worker 0; a preemption SIGTERMs it."""

    def __init__(self, metadata_host: str, log_dir) -> None:
        self.metadata_host, self.log_dir = metadata_host, log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.env: dict[str, str] = {}  # the VMs' own environment, e.g. their dataset cache

    def ready(self, zone: str, node_id: str, node: dict) -> None:
        env = {
            **os.environ,
            "GCE_METADATA_HOST": f"{self.metadata_host}/vm/{zone}/{node_id}/0",
            "TPUPIPE_LOG_DIR": str(self.log_dir),
            "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
            "JAX_PLATFORMS": "cpu",
            **self.env,
        }
        self.procs[node_id] = subprocess.Popen(
            [sys.executable, "-m", "infra.gcp.launcher"],
            cwd=REPO,
            env=env,
            start_new_session=True,
        )

    def gone(self, zone: str, node_id: str, node: dict) -> None:
        proc = self.procs.get(node_id)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # what a preempted or deleted VM's agent does

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def vms(fake_tpu, tmp_path):
    fake, host = fake_tpu
    machines = FakeVms(host, tmp_path / "vm-logs")
    fake.on_ready, fake.on_gone = machines.ready, machines.gone
    yield fake, host, machines
    machines.stop_all()


def test_a_preempted_tpu_run_resumes_and_lands_once(vms, gcs_client, bucket, bq_emulator, tmp_path):
    from infra.gcp.clients import bigquery_client, tpu_client

    fake, host, machines = vms
    config = tiny_config(
        tmp_path,
        f"storage.root=gs://{bucket}/root",
        "slice.provider=gcp",
        f"slice.zone={ZONE}",
        "slice.accelerator_type=v5litepod-8",
        "slice.runtime_version=v2-alpha-tpuv5-lite",
        f"slice.wheel=gs://{bucket}/wheels/tpupipe-0.1.0-py3-none-any.whl",
        "train.steps=120",
        "train.checkpoint_every=40",
        "train.log_every=10",
    )
    plan = plan_run(config, flow_run_id="flow-1")
    dataset = data.shard_dataset(config.dataset, str(tmp_path / "datasets")).dataset_dir
    config_path = write_workload_config(config, plan, dataset)
    assert config_path.startswith("gs://")

    os.environ["TPU_EMULATOR_HOST"] = host
    try:
        tpu = tpu_client()
    finally:
        del os.environ["TPU_EMULATOR_HOST"]
    settings = TpuSettings.from_config(config.slice, "test-project", poll_s=0.05)
    provider = GcpSliceProvider(tpu, gcs_client, settings)
    spec = SliceSpec(
        name=plan.slice_name,
        labels=slice_labels(plan, attempt=1),
        devices=8,
        command=workload_command(config_path),
        log_path=f"{plan.run_dir}/logs/{plan.slice_name}.log",
    )
    run_dir = RunDir(plan.run_dir)

    # Attempt 1: preempted once it has trained a little.
    assert provider.create(spec).state is SliceState.READY
    deadline = time.monotonic() + 240
    while ((run_dir.read_status() or {}).get("step") or 0) < 20:
        assert time.monotonic() < deadline, run_dir.read_status()
        time.sleep(0.5)
    fake.preempt(ZONE, plan.slice_name)
    with pytest.raises(WorkloadPreempted):
        watch_slice(provider, plan.slice_name, run_dir, WatchSettings(0.2, 300, 0), print)
    machines.procs[plan.slice_name].wait(120)  # it saved and left its exit record

    # Attempt 2: the preempted node is deleted, a new one resumes from the GCS checkpoint.
    assert provider.create(spec).state is SliceState.READY
    outcome = watch_slice(provider, plan.slice_name, run_dir, WatchSettings(0.2, 300, 0), print)
    assert outcome.exit_code == 0 and outcome.final_step == 120
    assert fake.creates[plan.slice_name] == 2 and len(fake.nodes) == 1
    assert provider.status(plan.slice_name).state is SliceState.TERMINATED

    # Each incarnation left its exit record and log beside the slice log: 75 = saved after
    # the preemption notice, then 0.
    records, logs = {}, 0
    for blob in gcs_client.list_blobs(bucket, prefix="root/runs/tiny/logs/"):
        if blob.name.endswith("/worker-0.json"):
            records[blob.time_created] = json.loads(blob.download_as_bytes())["exit_code"]
        logs += blob.name.endswith("/worker-0.log")
    assert [code for _, code in sorted(records.items())] == [75, 0] and logs == 2
    # The second attempt resumed from the step the first one saved on its way out.
    metrics = run_dir.read_metrics()
    resumed = [m["resumed_from"] for m in metrics if "resumed_from" in m]
    assert resumed[0] == 0 and resumed[1] >= 20

    verified = checkpoint.verify_checkpoint(plan.run_dir, 120, plan.config_hash)
    assert max(m["step"] for m in metrics) == 120

    assert provider.delete(plan.slice_name) is True
    assert fake.nodes == {} and provider.list({"run-id": plan.run_id}) == []

    sink = BigQuerySink(bigquery_client("test-project"), "e2e")
    rows = build_rows(config, plan, datetime.now(UTC), verified, None)
    sink.land(*rows)
    sink.land(*rows)
    ((n, top),) = sink.query(
        f"SELECT COUNT(*), MAX(step) FROM `{sink.dataset}.step_metrics` WHERE run_id = @run_id",
        plan.run_id,
    )
    assert top == 120 and n == len({m["step"] for m in run_dir.read_metrics()})
