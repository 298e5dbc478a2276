"""What a gcp run checks in GCS before it provisions a slice: the storage root's bucket,
the wheel the workers install, the `gs://` sources, and that a dataset already published
there is whole (repaired from the orchestrator's copy when it is not).

`tpupipe run` is driven as a user runs it; the fake TPU API's create count says whether
anything was provisioned."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest
from etils import epath

from infra.gcp import gcs
from tests.emulator.test_gcp_run import ZONE, FakeVms
from tests.helpers import REPO
from workloads import data

pytestmark = [pytest.mark.emulator, pytest.mark.slow]
WHEEL = "wheels/tpupipe-0.1.0-py3-none-any.whl"


@pytest.fixture
def vms(fake_tpu, tmp_path, monkeypatch):
    fake, host = fake_tpu
    machines = FakeVms(host, tmp_path / "vm-logs")
    fake.on_ready, fake.on_gone = machines.ready, machines.gone
    monkeypatch.setenv("TPU_EMULATOR_HOST", host)
    monkeypatch.setenv("TPUPIPE_DATASET_CACHE", str(tmp_path / "orchestrator-cache"))
    monkeypatch.chdir(tmp_path)  # the run's local lock and DuckDB file go here
    yield fake, machines
    machines.stop_all()


def gcp_args(bucket: str, *overrides: str) -> list[str]:
    """`tpupipe run` of configs/tiny.yaml on the gcp backends, storage in `bucket`."""
    settings = [
        f"storage.root=gs://{bucket}/root",
        "slice.provider=gcp",
        "slice.project=test-project",
        f"slice.zone={ZONE}",
        "slice.accelerator_type=v5litepod-8",
        "slice.runtime_version=v2-alpha-tpuv5-lite",
        f"slice.wheel=gs://{bucket}/{WHEEL}",
        "slice.poll_interval_s=0.2",
        "slice.heartbeat_timeout_s=20",
        "resilience.max_preemptions=0",
        "resilience.heartbeat_confirm_s=0",
        *overrides,
    ]
    args = ["run", "--config", str(REPO / "configs" / "tiny.yaml")]
    for setting in settings:
        args += ["--set", setting]
    return args


def put_wheel(gcs_client, bucket: str) -> None:
    gcs_client.bucket(bucket).blob(WHEEL).upload_from_string(b"a wheel")


def published_tiny(gcs_client, bucket: str, tmp_path, cache: str, *overrides: str):
    """configs/tiny.yaml's dataset sharded into `tmp_path/cache` and published in `bucket`
    as an earlier run left it; returns (config, local dataset dir, remote dataset dir)."""
    from tasks.corpus import shard_corpus
    from tests.helpers import tiny_config

    config = tiny_config(tmp_path, *overrides)
    local = shard_corpus(config.dataset, str(tmp_path / cache)).dataset_dir
    remote = f"gs://{bucket}/root/datasets/{epath.Path(local).name}"
    gcs.upload_tree(gcs_client, local, remote, last=[data.MANIFEST])
    return config, local, remote


def overwrite_in_place(gcs_client, bucket: str, local: str, name: str):
    """Replace the published shard `name` with other bytes of its size (every bit flipped,
    as a bad copy or a stray writer could leave it); returns its blob."""
    blob = gcs_client.bucket(bucket).blob(f"root/datasets/{epath.Path(local).name}/{name}")
    blob.upload_from_string(bytes(b ^ 0xFF for b in (epath.Path(local) / name).read_bytes()))
    return blob


def repaired(caplog, name: str, why: str) -> bool:
    return any(
        "repaired" in r.getMessage() and f"{name} ({why}" in r.getMessage() for r in caplog.records
    )


def test_a_published_dataset_missing_a_shard_is_repaired_before_provisioning(
    vms, gcs_client, bucket, tmp_path, prefect_harness, caplog
):
    from flows.cli import main
    from tasks.corpus import shard_corpus
    from tests.helpers import tiny_config

    fake, machines = vms
    put_wheel(gcs_client, bucket)
    # Published by an earlier run, then a shard went missing from the bucket.
    config = tiny_config(tmp_path)
    local = shard_corpus(config.dataset, str(tmp_path / "orchestrator-cache")).dataset_dir
    remote = f"gs://{bucket}/root/datasets/{epath.Path(local).name}"
    gcs.upload_tree(gcs_client, local, remote, last=[data.MANIFEST])
    lost = data.load_manifest(local)["splits"]["train"]["shards"][1]["name"]
    gcs_client.bucket(bucket).blob(f"root/datasets/{epath.Path(local).name}/{lost}").delete()
    machines.env = {"TPUPIPE_DATASET_CACHE": str(tmp_path / "worker-cache")}  # a fresh VM

    assert main(gcp_args(bucket)) == 0
    assert sum(fake.creates.values()) == 1
    assert gcs.exists(gcs_client, f"{remote}/{lost}")
    assert any(lost in r.getMessage() and "repaired" in r.getMessage() for r in caplog.records)


def test_a_published_shard_of_another_size_is_uploaded_again(gcs_client, bucket, tmp_path):
    from tasks.corpus import shard_corpus
    from tasks.remote import publish_dataset
    from tests.helpers import tiny_config

    config = tiny_config(tmp_path, f"storage.root=gs://{bucket}/root")
    local = shard_corpus(config.dataset, str(tmp_path / "cache")).dataset_dir
    remote = f"gs://{bucket}/root/datasets/{epath.Path(local).name}"
    gcs.upload_tree(gcs_client, local, remote, last=[data.MANIFEST])
    cut = data.load_manifest(local)["splits"]["train"]["shards"][0]["name"]
    blob = gcs_client.bucket(bucket).blob(f"root/datasets/{epath.Path(local).name}/{cut}")
    blob.upload_from_string(b"half a shard")

    assert publish_dataset(local, f"gs://{bucket}/root/datasets", config) == remote
    assert blob.download_as_bytes() == (epath.Path(local) / cut).read_bytes()


def test_a_published_shard_with_other_bytes_of_its_size_is_repaired_before_provisioning(
    vms, gcs_client, bucket, tmp_path, prefect_harness, caplog
):
    from flows.cli import main

    fake, machines = vms
    put_wheel(gcs_client, bucket)
    _, local, _ = published_tiny(gcs_client, bucket, tmp_path, "orchestrator-cache")
    name = data.load_manifest(local)["splits"]["train"]["shards"][0]["name"]
    blob = overwrite_in_place(gcs_client, bucket, local, name)
    machines.env = {"TPUPIPE_DATASET_CACHE": str(tmp_path / "worker-cache")}  # a fresh VM

    # Without the check the VM's workload fails on the shard's sha256, on every rerun.
    assert main(gcp_args(bucket)) == 0
    assert sum(fake.creates.values()) == 1
    assert blob.download_as_bytes() == (epath.Path(local) / name).read_bytes()
    assert repaired(caplog, name, "damaged: other bytes")


def test_a_second_check_reads_no_local_shard_again(gcs_client, bucket, tmp_path, monkeypatch):
    from tasks.remote import CRC_CACHE, publish_dataset

    datasets = f"gs://{bucket}/root/datasets"
    config, local, remote = published_tiny(
        gcs_client, bucket, tmp_path, "cache", f"storage.root=gs://{bucket}/root"
    )
    shards = [
        s["name"]
        for split in ("train", "eval")
        for s in data.load_manifest(local)["splits"][split]["shards"]
    ]
    reads = []
    real = gcs.file_crc32c
    monkeypatch.setattr(gcs, "file_crc32c", lambda path, *a: reads.append(path) or real(path, *a))

    assert publish_dataset(local, datasets, config) == remote
    assert sorted(epath.Path(p).name for p in reads) == sorted(shards)
    assert (epath.Path(local) / CRC_CACHE).is_file()
    # The next check compares with the cached checksums, so it still finds other bytes.
    reads.clear()
    blob = overwrite_in_place(gcs_client, bucket, local, shards[-1])
    assert publish_dataset(local, datasets, config) == remote
    assert reads == []
    assert blob.download_as_bytes() == (epath.Path(local) / shards[-1]).read_bytes()
    # A cache that does not parse is read as none.
    (epath.Path(local) / CRC_CACHE).write_text('{"torn')
    assert publish_dataset(local, datasets, config) == remote
    assert len(reads) == len(shards)


def test_a_damaged_shard_whose_local_copy_is_another_file_is_left_to_the_size_check(
    gcs_client, bucket, tmp_path, caplog
):
    from tasks.remote import publish_dataset
    from workloads.manifest import sealed

    config, local, remote = published_tiny(
        gcs_client, bucket, tmp_path, "cache", f"storage.root=gs://{bucket}/root"
    )
    manifest = data.load_manifest(local)
    same, other = (s["name"] for s in manifest["splits"]["train"]["shards"][:2])
    # The local manifest vouches for other bytes of `other` (another build of that shard):
    # its local file must not replace the remote one, whatever is there.
    manifest["splits"]["train"]["shards"][1]["sha256"] = hashlib.sha256(b"another").hexdigest()
    # Sealed as a build writes it: an edited manifest is not read at all.
    (epath.Path(local) / data.MANIFEST).write_text(json.dumps(sealed(manifest)))
    fixable = overwrite_in_place(gcs_client, bucket, local, same)
    left = overwrite_in_place(gcs_client, bucket, local, other)
    damaged = left.download_as_bytes()

    with caplog.at_level(logging.WARNING, logger="tasks.remote"):
        assert publish_dataset(local, f"gs://{bucket}/root/datasets", config) == remote
    assert fixable.download_as_bytes() == (epath.Path(local) / same).read_bytes()
    assert repaired(caplog, same, "damaged: other bytes")
    assert left.download_as_bytes() == damaged
    assert not any(other in r.getMessage() for r in caplog.records)


def test_a_published_dataset_missing_a_shard_with_no_local_copy_is_refused(
    gcs_client, bucket, tmp_path
):
    from tasks.corpus import shard_corpus
    from tasks.remote import publish_dataset
    from tests.helpers import tiny_config
    from workloads.data import DatasetError

    put_wheel(gcs_client, bucket)
    config = tiny_config(tmp_path, f"storage.root=gs://{bucket}/root")
    local = shard_corpus(config.dataset, str(tmp_path / "cache")).dataset_dir
    remote = f"gs://{bucket}/root/datasets/{epath.Path(local).name}"
    gcs.upload_tree(gcs_client, local, remote, last=[data.MANIFEST])
    lost = data.load_manifest(local)["splits"]["eval"]["shards"][0]["name"]
    gcs_client.bucket(bucket).blob(f"root/datasets/{epath.Path(local).name}/{lost}").delete()
    (epath.Path(local) / lost).unlink()  # the orchestrator's copy lacks it as well

    with pytest.raises(DatasetError) as err:
        publish_dataset(local, f"gs://{bucket}/root/datasets", config)
    assert remote in str(err.value) and lost in str(err.value)


def test_a_wheel_that_is_not_in_gcs_is_refused_before_provisioning(
    vms, gcs_client, bucket, prefect_harness, capsys
):
    from flows.cli import main

    fake, _ = vms
    nope = f"gs://{bucket}/wheels/nope-0.1-py3-none-any.whl"
    assert main(gcp_args(bucket, f"slice.wheel={nope}")) == 2
    err = capsys.readouterr().err
    assert "slice.wheel" in err and nope in err
    assert sum(fake.creates.values()) == 0


def test_a_storage_root_in_a_missing_bucket_is_refused_before_sharding(
    vms, gcs_client, bucket, tmp_path, prefect_harness, capsys
):
    from flows.cli import main

    fake, _ = vms
    put_wheel(gcs_client, bucket)
    args = gcp_args(bucket, "storage.root=gs://nonexistent-bucket-xyz/x")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "storage.root = 'gs://nonexistent-bucket-xyz/x': bucket nonexistent-bucket-xyz" in err
    assert sum(fake.creates.values()) == 0
    assert not (tmp_path / "orchestrator-cache").exists()  # nothing was sharded for it


def test_a_source_in_a_missing_bucket_is_refused_naming_it(
    vms, gcs_client, bucket, prefect_harness, capsys
):
    from flows.cli import main

    fake, _ = vms
    put_wheel(gcs_client, bucket)
    source = "gs://nonexistent-source-xyz/corpus/"
    assert main(gcp_args(bucket, f"dataset.sources=[{source}]")) == 2
    err = capsys.readouterr().err
    assert f"dataset source {source!r}: bucket nonexistent-source-xyz does not exist" in err
    assert sum(fake.creates.values()) == 0


def test_the_final_checkpoints_data_check_reads_a_gs_dataset(
    gcs_client, bucket, tmp_path, monkeypatch
):
    # It read the manifest as a local path: on every gs:// root the check was skipped,
    # with a false warning, and a final checkpoint of other records landed completed.
    from workloads import input
    from workloads.manifest import records_identity

    monkeypatch.setenv("TPUPIPE_DATASET_CACHE", str(tmp_path / "worker-cache"))
    config, local, remote = published_tiny(gcs_client, bucket, tmp_path, "cache")
    layout = input.saved_layout(remote, config.train.batch_size, config.seed)
    assert layout["records"] == records_identity(data.load_manifest(local))
    state = {"next_index": 12, **layout}
    assert input.layout_problem(layout, state) is None
    other = {**state, "records": "0123456789abcdef"}
    assert "saved over a dataset of other records" in input.layout_problem(layout, other)
