"""Checkpoints: a round trip, and verification that refuses what a run must not trust."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import cut_checkpoint_data
from workloads import checkpoint
from workloads.config import MeshConfig, ModelConfig, TrainConfig
from workloads.step_metrics import NonFiniteError
from workloads.trainer import (
    BATCH_KEYS,
    create_train_state,
    make_mesh,
    make_train_step,
    place_batch,
)

MODEL = ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=64)
TRAIN = TrainConfig(steps=10, batch_size=8, warmup_steps=1)


@pytest.fixture()
def state():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    return create_train_state(MODEL, TRAIN, 257, seed=0, mesh=mesh)


def save(run_dir, step, arrays, config_hash="h1"):
    mngr = checkpoint.make_manager(str(run_dir))
    checkpoint.save(mngr, step, arrays, {"next_index": step * 8}, config_hash)
    mngr.wait_until_finished()
    mngr.close()


def test_round_trip_restores_arrays_on_their_shardings(tmp_path, state):
    save(tmp_path, 3, state.arrays)
    fresh = create_train_state(MODEL, TRAIN, 257, seed=1, mesh=make_mesh(MeshConfig(data=8)))
    mngr = checkpoint.make_manager(str(tmp_path))
    arrays, data_iter, meta = checkpoint.restore(mngr, 3, fresh.arrays)
    mngr.close()
    assert data_iter == {"next_index": 24} and meta == {"step": 3, "config_hash": "h1"}
    for a, b in zip(jax.tree.leaves(state.arrays), jax.tree.leaves(arrays), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Restored onto the new mesh's layout, not the one it was saved from.
    leaf = jax.tree.leaves(arrays["model"])[0]
    assert leaf.sharding.mesh.shape["data"] == 8


def test_verify_accepts_the_final_step_and_checksums_parameters(tmp_path, state):
    save(tmp_path, 10, state.arrays)
    verified = checkpoint.verify_checkpoint(str(tmp_path), 10, "h1")
    assert verified.step == 10 and len(verified.params_sha256) == 64
    again = checkpoint.verify_checkpoint(str(tmp_path), 10, "h1")
    assert again.params_sha256 == verified.params_sha256
    assert verified.num_params == sum(x.size for x in jax.tree.leaves(state.arrays["model"]))


def test_verify_refuses_wrong_step_config_or_missing(tmp_path, state):
    with pytest.raises(checkpoint.CheckpointError, match="no committed checkpoint"):
        checkpoint.verify_checkpoint(str(tmp_path), 10, "h1")
    save(tmp_path, 5, state.arrays)
    with pytest.raises(checkpoint.CheckpointError, match="is step 5, expected the final step 10"):
        checkpoint.verify_checkpoint(str(tmp_path), 10, "h1")
    with pytest.raises(checkpoint.CheckpointError, match="written by config h1"):
        checkpoint.verify_checkpoint(str(tmp_path), 5, "other")


def test_a_non_finite_state_is_never_saved(tmp_path, state):
    kernel = state.arrays["model"]["blocks"][0]["up"]["kernel"]
    kernel[...] = kernel[...].at[0, 0].set(jnp.inf)
    with pytest.raises(NonFiniteError, match=r"step 4: after the update, array .*'up'.*Inf"):
        save(tmp_path, 4, state.arrays)
    assert checkpoint.latest_step(str(tmp_path)) is None
    assert not list((tmp_path / "checkpoints").glob("4*"))


def test_saves_reuse_the_check_compiled_after_the_first_step(tmp_path, state):
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    step = make_train_step(state.graphdef, mesh)
    batch = {key: np.ones((8, 64), np.int32) for key in BATCH_KEYS}
    arrays, _ = step(state.arrays, place_batch(batch, mesh))
    checkpoint._finite_each.clear_cache()  # earlier tests may have compiled it
    checkpoint.prepare_saves(arrays)
    compiled = checkpoint._finite_each._cache_size()
    save(tmp_path, 1, arrays)
    arrays, _ = step(arrays, place_batch(batch, mesh))
    save(tmp_path, 2, arrays)
    assert compiled == 1
    assert checkpoint._finite_each._cache_size() == compiled


@pytest.fixture()
def bad_saves_allowed(monkeypatch):
    """Write a non-finite checkpoint, as a bug or bit rot might: what reads it must cope."""
    monkeypatch.setattr(checkpoint, "_refuse_non_finite", lambda step, state: None)


def test_verify_refuses_non_finite_parameters(tmp_path, state, bad_saves_allowed):
    kernel = state.arrays["model"]["blocks"][0]["up"]["kernel"]
    kernel[...] = kernel[...].at[0, 0].set(jnp.nan)
    save(tmp_path, 10, state.arrays)
    with pytest.raises(checkpoint.CheckpointError, match=r"'up'.*NaN or Inf.*quarantine"):
        checkpoint.verify_checkpoint(str(tmp_path), 10, "h1")


def test_an_uncommitted_step_is_never_the_latest(tmp_path, state):
    save(tmp_path, 5, state.arrays)
    (tmp_path / "checkpoints" / "9.orbax-checkpoint-tmp-123").mkdir()
    assert checkpoint.latest_step(str(tmp_path)) == 5


def _restore_newest(run_dir, arrays, config_hash="h1"):
    mngr = checkpoint.make_manager(str(run_dir))
    try:
        return checkpoint.restore_newest_valid(mngr, str(run_dir), arrays, config_hash)
    finally:
        mngr.close()


def test_a_truncated_newest_checkpoint_is_quarantined_and_the_previous_one_used(tmp_path, state):
    save(tmp_path, 5, state.arrays)
    save(tmp_path, 10, state.arrays)
    cut_checkpoint_data(tmp_path / "checkpoints" / "10" / "state")

    step, arrays, data_state = _restore_newest(tmp_path, state.arrays)
    assert step == 5 and data_state == {"next_index": 40}
    for a, b in zip(jax.tree.leaves(state.arrays), jax.tree.leaves(arrays), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["5"]
    (moved,) = (tmp_path / "quarantine").iterdir()
    assert moved.name.startswith("10-")
    assert "does not restore" in (moved / "QUARANTINED.txt").read_text()
    # A second attempt resumes from the same place: no crash loop on the bad step.
    assert _restore_newest(tmp_path, state.arrays)[0] == 5


def test_non_finite_or_foreign_checkpoints_are_never_resumed(tmp_path, state, bad_saves_allowed):
    save(tmp_path, 5, state.arrays, config_hash="other-config")
    kernel = state.arrays["model"]["blocks"][0]["up"]["kernel"]
    original = kernel[...]
    kernel[...] = original.at[0, 0].set(jnp.nan)
    save(tmp_path, 10, state.arrays)
    kernel[...] = original

    step, arrays, data_state = _restore_newest(tmp_path, state.arrays)
    assert (step, data_state) == (0, None)
    assert arrays is state.arrays  # nothing valid: the fresh state, untouched
    reasons = sorted(
        (p / "QUARANTINED.txt").read_text() for p in (tmp_path / "quarantine").iterdir()
    )
    assert any("NaN or Inf" in r for r in reasons)
    assert any("written by config other-config" in r for r in reasons)


def _on_disk(run_dir) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def test_local_saves_delete_the_oldest_first_and_keep_the_newest(tmp_path, state):
    mngr = checkpoint.make_manager(str(tmp_path), keep=3)
    for step in (1, 2, 3):
        checkpoint.save(mngr, step, state.arrays, {"next_index": step}, "h1")
    mngr.wait_until_finished()
    checkpoint.save(mngr, 4, state.arrays, {"next_index": 4}, "h1")
    # Step 1 is gone before step 4 is written (its memory is what step 4 is written
    # into); the two newest complete ones remain meanwhile.
    assert 1 not in _on_disk(tmp_path) and {2, 3} <= set(_on_disk(tmp_path))
    mngr.wait_until_finished()
    assert _on_disk(tmp_path) == [2, 3, 4]
    mngr.close()
    resumed = checkpoint.make_manager(str(tmp_path), keep=3)  # a later attempt
    checkpoint.save(resumed, 5, state.arrays, {"next_index": 5}, "h1")
    resumed.wait_until_finished()
    resumed.close()
    assert _on_disk(tmp_path) == [3, 4, 5] and checkpoint.latest_step(str(tmp_path)) == 5


def test_keeping_one_checkpoint_never_leaves_none_during_a_save(tmp_path, state):
    mngr = checkpoint.make_manager(str(tmp_path), keep=1)
    checkpoint.save(mngr, 1, state.arrays, {"next_index": 1}, "h1")
    mngr.wait_until_finished()
    checkpoint.save(mngr, 2, state.arrays, {"next_index": 2}, "h1")
    assert 1 in _on_disk(tmp_path)  # deleted only once step 2 is committed
    mngr.wait_until_finished()
    mngr.close()
    assert _on_disk(tmp_path) == [2]
