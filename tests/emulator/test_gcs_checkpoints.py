"""Checkpoints in gs:// changed by another process, and quarantined there.

The orchestrator lists a run's checkpoints before its workload (another process, often on
another machine) writes and deletes steps, then lists them again to verify the final one.
"""

from __future__ import annotations

import pytest

from workloads import checkpoint
from workloads.config import MeshConfig, ModelConfig, TrainConfig
from workloads.trainer import create_train_state, make_mesh

pytestmark = pytest.mark.emulator


def save_step(run_dir: str, step: int) -> None:
    model = ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=64)
    train = TrainConfig(steps=step, batch_size=8, warmup_steps=1)
    state = create_train_state(model, train, 257, seed=0, mesh=make_mesh(MeshConfig(data=8)))
    mngr = checkpoint.make_manager(run_dir)
    checkpoint.save(mngr, step, state.arrays, {"next_index": step}, "h1")
    mngr.wait_until_finished()
    mngr.close()


def copy_prefix(client, bucket: str, src: str, dst: str, delete: bool = False) -> None:
    """What another process writing (or moving) a step looks like to this one."""
    b = client.bucket(bucket)
    for blob in list(client.list_blobs(bucket, prefix=src)):
        b.copy_blob(blob, b, dst + blob.name.removeprefix(src))
        if delete:
            blob.delete()


def test_steps_another_process_writes_and_deletes_are_seen(gcs_client, bucket):
    # gcsfs cached the listing of checkpoints/ for the life of the process: a rerun that
    # looked for a finished run before training, then verified after it, saw only the steps
    # of before ("no committed checkpoint"), and failed a run whose training had finished.
    run_dir = f"gs://{bucket}/root/runs/other"
    save_step(run_dir, 4)
    assert checkpoint.latest_step(run_dir) == 4

    # Step 8 written elsewhere and moved in, step 4 deleted: what the workload does to the
    # listing. (A copy of step 4 named 8 is refused now: it holds step 4.)
    save_step(f"gs://{bucket}/root/runs/scratch", 8)
    prefix = "root/runs/other/checkpoints/"
    copy_prefix(gcs_client, bucket, "root/runs/scratch/checkpoints/8/", prefix + "8/")
    for blob in list(gcs_client.list_blobs(bucket, prefix=prefix + "4/")):
        blob.delete()

    assert checkpoint.latest_step(run_dir) == 8
    assert checkpoint.committed_steps(run_dir) == [8]
    assert checkpoint.verify_checkpoint(run_dir, 8, "h1").step == 8


def test_a_checkpoint_failing_verification_on_gs_is_quarantined(gcs_client, bucket):
    # There are no folders in GCS: the move to quarantine/ failed ("folder ... does not
    # exist"), the step stayed where it was, and every rerun failed on it again.
    run_dir = f"gs://{bucket}/root/runs/bad"
    save_step(run_dir, 4)
    prefix = "root/runs/bad/checkpoints/4/"
    # Every array data file cut short, as a crashed upload leaves them. (Only the largest
    # is not enough: an OCDBT data file may end in bytes no longer referenced.)
    blobs = [b for b in gcs_client.list_blobs(bucket, prefix=prefix + "state/ocdbt.process_")]
    data = [b for b in blobs if "/d/" in b.name]
    assert data
    for blob in data:
        blob.upload_from_string(b"\0" * 100)

    with pytest.raises(checkpoint.CheckpointError, match=r"(?s)does not restore.*moved to"):
        checkpoint.verify_checkpoint(run_dir, 4, "h1")

    assert not list(gcs_client.list_blobs(bucket, prefix=prefix))
    assert checkpoint.latest_step(run_dir) is None
    moved = {b.name for b in gcs_client.list_blobs(bucket, prefix="root/runs/bad/quarantine/")}
    (folder,) = {name.split("/")[4] for name in moved}
    assert folder.startswith("4-")
    names = {name.split("/", 5)[5] for name in moved}
    assert "QUARANTINED.txt" in names and "commit_success.txt" in names
    assert {b.name.removeprefix(prefix) for b in data} <= names
    reason = gcs_client.bucket(bucket).blob(f"root/runs/bad/quarantine/{folder}/QUARANTINED.txt")
    assert "does not restore" in reason.download_as_text()
