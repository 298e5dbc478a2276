"""The run directory in `gs://` on the GCS emulator: datasets, run files, an orbax
checkpoint and the compilation cache, written and read back through gs:// paths, and
checked object by object with the real `google.cloud.storage` client."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from etils import epath
from google.cloud.storage import Blob

from infra.gcp import gcs
from tasks.plan import plan_run, write_workload_config
from tests.helpers import tiny_config
from workloads import checkpoint, data
from workloads.config import MeshConfig, ModelConfig, TrainConfig
from workloads.rundir import RunDir
from workloads.trainer import create_train_state, make_mesh

pytestmark = pytest.mark.emulator


def objects(client, bucket: str, prefix: str) -> dict[str, bytes]:
    return {
        b.name.removeprefix(prefix): b.download_as_bytes()
        for b in client.list_blobs(bucket, prefix=prefix)
    }


def test_run_files_round_trip_through_gs(gcs_client, bucket):
    run = RunDir(f"gs://{bucket}/root/runs/r1")
    run.write_status("training", step=3, loss=2.5)
    run.append_metrics([{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.8}])
    run.append_metrics([{"step": 3, "loss": 2.5}])

    assert run.read_status()["step"] == 3
    assert [m["step"] for m in run.read_metrics()] == [1, 2, 3]
    stored = objects(gcs_client, bucket, "root/runs/r1/")
    assert set(stored) == {"status.json", "metrics.jsonl"}
    assert json.loads(stored["status.json"])["phase"] == "training"
    assert stored["metrics.jsonl"].decode().count("\n") == 3


def test_plan_and_config_json_live_in_gs(tmp_path, gcs_client, bucket):
    config = tiny_config(tmp_path, f"storage.root=gs://{bucket}/root/")
    plan = plan_run(config)
    assert plan.run_dir == f"gs://{bucket}/root/runs/tiny"
    assert plan.datasets_root == f"gs://{bucket}/root/datasets"
    assert not plan.slices_root.startswith("gs://") and plan.metrics_path.endswith(".duckdb")

    path = write_workload_config(config, plan, f"{plan.datasets_root}/fp")
    assert path == f"gs://{bucket}/root/runs/tiny/config.json"
    stored = json.loads(objects(gcs_client, bucket, "root/runs/tiny/")["config.json"])
    assert stored["run_dir"] == plan.run_dir and stored["config_hash"] == plan.config_hash


def test_a_dataset_is_published_manifest_last_and_reads_back(tmp_path, gcs_client, bucket):
    config = tiny_config(tmp_path, "dataset.max_bytes=60000")
    local = data.shard_dataset(config.dataset, str(tmp_path / "datasets")).dataset_dir
    uri = f"gs://{bucket}/root/datasets/{epath.Path(local).name}"
    uploads = []
    real_upload = Blob.upload_from_filename

    def recording_upload(self, filename, *args, **kwargs):
        uploads.append(self.name)
        return real_upload(self, filename, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Blob, "upload_from_filename", recording_upload)
        count = gcs.upload_tree(gcs_client, local, uri, last=[data.MANIFEST])

    assert uploads[-1].endswith("/manifest.json") and count == len(uploads)
    # Listed and read through gs:// paths, as the workload would.
    names = sorted(p.name for p in epath.Path(uri).iterdir())
    assert "manifest.json" in names and any(n.endswith(".arrayrecord") for n in names)
    manifest = json.loads((epath.Path(uri) / data.MANIFEST).read_text())
    assert manifest == data.load_manifest(local)
    # A copy brought back verifies against the manifest's checksums.
    back = tmp_path / "back"
    assert gcs.download_tree(gcs_client, uri, back) == count
    data.verify_shards(back)
    assert gcs.exists(gcs_client, f"{uri}/manifest.json")


def test_an_orbax_checkpoint_saves_to_and_verifies_from_gs(gcs_client, bucket):
    model = ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=64)
    state = create_train_state(
        model,
        TrainConfig(steps=4, batch_size=8, warmup_steps=1),
        257,
        seed=0,
        mesh=make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)),
    )
    run_dir = f"gs://{bucket}/root/runs/ckpt"
    mngr = checkpoint.make_manager(run_dir)
    checkpoint.save(mngr, 4, state.arrays, {"next_index": 4}, "h1")
    mngr.wait_until_finished()
    mngr.close()

    # On GCS only commit_success.txt marks a step as complete (there is no rename).
    stored = objects(gcs_client, bucket, "root/runs/ckpt/checkpoints/")
    assert "4/commit_success.txt" in stored
    verified = checkpoint.verify_checkpoint(run_dir, 4, "h1")
    assert verified.step == 4 and verified.num_params > 0

    fresh = create_train_state(
        model,
        TrainConfig(steps=4, batch_size=8, warmup_steps=1),
        257,
        seed=1,
        mesh=make_mesh(MeshConfig(data=8)),
    )
    mngr = checkpoint.make_manager(run_dir)
    arrays, data_iter, meta = checkpoint.restore(mngr, 4, fresh.arrays)
    mngr.close()
    assert data_iter == {"next_index": 4} and meta["config_hash"] == "h1"
    for a, b in zip(jax.tree.leaves(state.arrays), jax.tree.leaves(arrays), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_compilation_cache_fills_in_gs(gcs_client, bucket):
    from workloads.train import configure_compile_cache

    cache = f"gs://{bucket}/root/compile_cache"
    before = jax.config.jax_compilation_cache_dir
    try:
        configure_compile_cache(cache)
        jax.jit(lambda x: x * 3 + 1)(np.arange(7.0)).block_until_ready()
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
    assert list(gcs_client.list_blobs(bucket, prefix="root/compile_cache/"))
