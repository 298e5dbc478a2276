"""Checkpoints: a round trip, and verification that refuses what a run must not trust."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import cut_checkpoint_data
from workloads import checkpoint, ckpt_integrity
from workloads.config import MeshConfig, ModelConfig, TrainConfig
from workloads.step_metrics import NonFiniteError
from workloads.trainer import (
    BATCH_KEYS,
    create_train_state,
    lr_hyper,
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
    # One batch a step: the data iterator's count is the step (state_problem checks it).
    checkpoint.save(mngr, step, arrays, {"next_index": step}, config_hash)
    mngr.wait_until_finished()
    mngr.close()


def test_round_trip_restores_arrays_on_their_shardings(tmp_path, state):
    save(tmp_path, 3, state.arrays)
    fresh = create_train_state(MODEL, TRAIN, 257, seed=1, mesh=make_mesh(MeshConfig(data=8)))
    mngr = checkpoint.make_manager(str(tmp_path))
    arrays, data_iter, meta = checkpoint.restore(mngr, 3, fresh.arrays)
    mngr.close()
    assert data_iter == {"next_index": 3} and meta["step"] == 3 and meta["config_hash"] == "h1"
    # The checksums saved from the (2, 2, 2) mesh hold for the arrays read onto (8, 1, 1).
    assert checkpoint.state_problem(checkpoint._pure(arrays), meta, "h1") is None
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


def test_verify_checks_the_data_iterator_against_the_run(tmp_path, state):
    from workloads.input import layout_problem

    layout = {"global_batch": 8, "seed": 0, "records": "ours"}
    mngr = checkpoint.make_manager(str(tmp_path))
    checkpoint.save(mngr, 10, state.arrays, {"next_index": 10, **layout}, "h1")
    mngr.wait_until_finished()
    mngr.close()
    ours = partial(layout_problem, layout)
    assert checkpoint.verify_checkpoint(str(tmp_path), 10, "h1", ours).step == 10
    seen = []
    theirs = partial(layout_problem, {**layout, "records": "theirs"})
    with pytest.raises(checkpoint.CheckpointError, match=r"records=ours; this run's .*=theirs"):
        checkpoint.verify_checkpoint(str(tmp_path), 10, "h1", theirs, lambda *a: seen.append(a))
    assert seen and seen[0][0] == 10 and "other data" in seen[0][1]
    assert checkpoint.latest_step(str(tmp_path)) is None  # quarantined


def test_a_non_finite_state_is_never_saved(tmp_path, state):
    kernel = state.arrays["model"]["blocks"][0]["up"]["kernel"]
    kernel[...] = kernel[...].at[0, 0].set(jnp.inf)
    expected = r"step 4: after the update, array model/blocks/0/up/kernel has NaN or Inf"
    with pytest.raises(NonFiniteError, match=expected):
        save(tmp_path, 4, state.arrays)
    assert checkpoint.latest_step(str(tmp_path)) is None
    assert not list((tmp_path / "checkpoints").glob("4*"))


def test_saves_reuse_the_check_compiled_after_the_first_step(tmp_path, state):
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    step = make_train_step(state.graphdef, mesh, lr_hyper(TRAIN))
    batch = {key: np.ones((8, 64), np.int32) for key in BATCH_KEYS}
    arrays, _ = step(state.arrays, place_batch(batch, mesh))
    ckpt_integrity._scan_each.clear_cache()  # earlier tests may have compiled it
    checkpoint.prepare_saves(arrays)
    compiled = ckpt_integrity._scan_each._cache_size()
    save(tmp_path, 1, arrays)
    arrays, _ = step(arrays, place_batch(batch, mesh))
    save(tmp_path, 2, arrays)
    assert compiled == 1
    assert ckpt_integrity._scan_each._cache_size() == compiled


@pytest.fixture()
def bad_saves_allowed(monkeypatch):
    """Write a non-finite checkpoint, as a bug or bit rot might: what reads it must cope."""
    monkeypatch.setattr(checkpoint, "_refuse_non_finite", lambda step, state: None)


def test_verify_refuses_non_finite_parameters(tmp_path, state, bad_saves_allowed):
    kernel = state.arrays["model"]["blocks"][0]["up"]["kernel"]
    kernel[...] = kernel[...].at[0, 0].set(jnp.nan)
    save(tmp_path, 10, state.arrays)
    with pytest.raises(checkpoint.CheckpointError, match=r"up/kernel has NaN or Inf.*quarantine"):
        checkpoint.verify_checkpoint(str(tmp_path), 10, "h1")


def test_an_uncommitted_step_is_never_the_latest(tmp_path, state):
    save(tmp_path, 5, state.arrays)
    (tmp_path / "checkpoints" / "9.orbax-checkpoint-tmp-123").mkdir()
    assert checkpoint.latest_step(str(tmp_path)) == 5


def _restore_newest(run_dir, arrays, config_hash="h1", data_problem=None):
    mngr = checkpoint.make_manager(str(run_dir))
    try:
        return checkpoint.restore_newest_valid(
            mngr, str(run_dir), arrays, config_hash, data_problem
        )
    finally:
        mngr.close()


def test_a_truncated_newest_checkpoint_is_quarantined_and_the_previous_one_used(tmp_path, state):
    save(tmp_path, 5, state.arrays)
    save(tmp_path, 10, state.arrays)
    cut_checkpoint_data(tmp_path / "checkpoints" / "10" / "state")

    step, arrays, data_state = _restore_newest(tmp_path, state.arrays)
    assert step == 5 and data_state == {"next_index": 5}
    for a, b in zip(jax.tree.leaves(state.arrays), jax.tree.leaves(arrays), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["5"]
    (moved,) = (tmp_path / "quarantine").iterdir()
    assert moved.name.startswith("10-")
    reason = (moved / "QUARANTINED.txt").read_text()
    assert "does not restore" in reason
    # Which array and where: orbax's own error named only the slices it read (probe Y).
    assert re.search(r'Error reading "[^"]+" .*checkpoints/10/state/', reason), reason
    # A second attempt resumes from the same place: no crash loop on the bad step.
    assert _restore_newest(tmp_path, state.arrays)[0] == 5


def _checkpoints_on_another_filesystem(monkeypatch, run_dir):
    """os.rename fails with EXDEV between `checkpoints/` and the rest of the run directory,
    as with `checkpoints/` a symlink to another mount (mounting needs root in a test)."""
    real_rename, mount = os.rename, str(run_dir / "checkpoints") + os.sep

    def rename(src, dst, *args, **kwargs):
        if str(src).startswith(mount) != str(dst).startswith(mount):
            raise OSError(errno.EXDEV, "Invalid cross-device link", str(src), None, str(dst))
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)


def test_a_bad_checkpoint_on_another_filesystem_is_quarantined(tmp_path, state, monkeypatch):
    # Every rerun failed with `OSError: [Errno 18] Invalid cross-device link` on the step.
    save(tmp_path, 5, state.arrays)
    save(tmp_path, 10, state.arrays)
    files = sorted(
        str(p.relative_to(tmp_path / "checkpoints" / "10"))
        for p in (tmp_path / "checkpoints" / "10").rglob("*")
    )
    cut_checkpoint_data(tmp_path / "checkpoints" / "10" / "state")
    _checkpoints_on_another_filesystem(monkeypatch, tmp_path)

    assert _restore_newest(tmp_path, state.arrays)[0] == 5
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["5"]
    (moved,) = (tmp_path / "quarantine").iterdir()
    assert moved.name.startswith("10-")
    assert "does not restore" in (moved / "QUARANTINED.txt").read_text()
    copied = sorted(str(p.relative_to(moved)) for p in moved.rglob("*"))
    assert copied == sorted([*files, "QUARANTINED.txt"])  # moved whole, nothing lost


def test_a_cross_filesystem_quarantine_cut_short_leaves_no_half_checkpoint(
    tmp_path, state, monkeypatch
):
    save(tmp_path, 5, state.arrays)
    save(tmp_path, 10, state.arrays)
    cut_checkpoint_data(tmp_path / "checkpoints" / "10" / "state")
    _checkpoints_on_another_filesystem(monkeypatch, tmp_path)
    real_copyfile, copied = shutil.copyfile, []

    def copyfile_then_die(src, dst, **kwargs):  # the orchestrator killed mid-copy
        if copied:
            raise KeyboardInterrupt
        copied.append(src)
        return real_copyfile(src, dst, **kwargs)

    monkeypatch.setattr(shutil, "copyfile", copyfile_then_die)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.quarantine(str(tmp_path), 10, "bad")
    # The half copy is hidden, never a quarantined step; the step is still whole.
    assert not [p for p in (tmp_path / "quarantine").iterdir() if not p.name.startswith(".")]
    assert checkpoint.latest_step(str(tmp_path)) == 10

    monkeypatch.setattr(shutil, "copyfile", real_copyfile)
    assert _restore_newest(tmp_path, state.arrays)[0] == 5  # the next run moves it
    assert [p.name[:3] for p in (tmp_path / "quarantine").iterdir()] == ["10-"]


def test_a_step_moved_out_of_checkpoints_but_not_yet_deleted_is_no_step(tmp_path, state):
    save(tmp_path, 5, state.arrays)
    save(tmp_path, 10, state.arrays)
    source = tmp_path / "checkpoints" / "10"
    source.rename(source.with_name(".10.quarantined-10-123"))  # a deletion cut short
    assert checkpoint.latest_step(str(tmp_path)) == 5
    assert checkpoint.committed_steps(str(tmp_path)) == [5]


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


@pytest.fixture()
def wide():
    """A state whose MLP kernel's chunks (64 x 256 floats) are stored as raw bytes in the
    data files: the tiny model's 1 KiB chunks are inlined in compressed OCDBT nodes."""
    model = ModelConfig(d_model=128, n_layers=1, n_heads=2, d_ff=512, max_seq_len=64)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    return create_train_state(model, TRAIN, 257, seed=0, mesh=mesh)


def _patterned(arrays) -> bytes:
    """Give the first MLP kernel distinct values; returns its first 16 bytes as stored."""
    kernel = arrays["model"]["blocks"][0]["up"]["kernel"]
    kernel[...] = jnp.arange(kernel[...].size, dtype=jnp.float32).reshape(kernel[...].shape)
    kernel[...] = kernel[...] * 1e-3 + 0.5
    return np.asarray(kernel[...])[0, :4].astype("<f4").tobytes()


def flip_low_bit(state_dir, needle: bytes) -> None:
    """Flip the lowest mantissa bit of the first value stored as `needle`'s first 4 bytes,
    as bit rot would: the files still parse and the value stays finite."""
    for path in state_dir.glob("ocdbt.process_*/d/*"):
        data = bytearray(path.read_bytes())
        at = data.find(needle)
        if at >= 0:
            data[at] ^= 1
            path.write_bytes(bytes(data))
            return
    raise AssertionError(f"the array's bytes are not in {state_dir}")


def test_a_checkpoint_whose_bytes_changed_after_the_save_is_never_resumed(tmp_path, wide):
    save(tmp_path, 5, wide.arrays)
    needle = _patterned(wide.arrays)
    save(tmp_path, 10, wide.arrays)
    flip_low_bit(tmp_path / "checkpoints" / "10" / "state", needle)

    step, _, data_state = _restore_newest(tmp_path, wide.arrays)
    assert step == 5 and data_state == {"next_index": 5}
    (moved,) = (tmp_path / "quarantine").iterdir()
    reason = (moved / "QUARANTINED.txt").read_text()
    assert "array model/blocks/0/up/kernel does not match the checksum saved with it" in reason


def test_verify_refuses_a_final_checkpoint_whose_bytes_changed(tmp_path, wide):
    needle = _patterned(wide.arrays)
    save(tmp_path, 10, wide.arrays)
    flip_low_bit(tmp_path / "checkpoints" / "10" / "state", needle)
    with pytest.raises(checkpoint.CheckpointError, match=r"up/kernel does not match the checksum"):
        checkpoint.verify_checkpoint(str(tmp_path), 10, "h1")


def test_bytes_overwritten_after_the_save_read_as_damage_not_as_nan(tmp_path, wide):
    # Random bytes in a data file decode to NaN here and there: the reason said "has NaN
    # or Inf values", as for a diverged state, where the files had changed after the save.
    needle = _patterned(wide.arrays)
    save(tmp_path, 10, wide.arrays)
    for path in (tmp_path / "checkpoints" / "10" / "state").glob("ocdbt.process_*/d/*"):
        data = path.read_bytes()
        if (at := data.find(needle)) >= 0:
            path.write_bytes(data[:at] + b"\xff" * 16 + data[at + 16 :])  # four NaNs
    with pytest.raises(checkpoint.CheckpointError) as raised:
        checkpoint.verify_checkpoint(str(tmp_path), 10, "h1")
    assert "up/kernel does not match the checksum saved with it" in str(raised.value)
    assert "NaN" not in str(raised.value)


def test_checksums_see_any_changed_word_and_old_steps_without_them_verify(tmp_path, state):
    x = jnp.arange(1000, dtype=jnp.float32)
    ((_, _, base),) = ckpt_integrity.scan({"x": x})
    for i in (0, 1, 500, 999):  # one word changed, anywhere, by one bit
        ((_, _, changed),) = ckpt_integrity.scan({"x": x.at[i].set(x[i] + 1e-4)})
        assert changed != base
    swapped = x.at[0].set(x[1]).at[1].set(x[0])  # same words, other places
    assert ckpt_integrity.scan({"x": swapped})[0][2] != base
    for dtype in (jnp.bfloat16, jnp.int8, jnp.bool_):  # narrow items are widened
        assert ckpt_integrity.scan({"x": jnp.ones(8, dtype)})[0][1] is True
    # A step saved before checksums existed: meta without them.
    save(tmp_path, 10, state.arrays)
    meta_file = tmp_path / "checkpoints" / "10" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({k: v for k, v in meta.items() if k != "checksums"}))
    assert checkpoint.verify_checkpoint(str(tmp_path), 10, "h1").step == 10


def _quarantined(run_dir) -> str:
    (moved,) = (run_dir / "quarantine").iterdir()
    return (moved / "QUARANTINED.txt").read_text()


def test_a_checkpoint_under_another_steps_name_is_quarantined(tmp_path, state):
    # A step directory renamed or copied under a higher number was resumed from: steps in
    # between were skipped silently, and the run ended with other parameters.
    save(tmp_path, 5, state.arrays)
    save(tmp_path, 10, state.arrays)
    (tmp_path / "checkpoints" / "10").rename(tmp_path / "checkpoints" / "12")
    step, _, _ = _restore_newest(tmp_path, state.arrays)
    assert step == 5
    assert "holds step 10, not the step 12 its directory is named for" in _quarantined(tmp_path)


@pytest.mark.parametrize(
    ("saved", "problem", "reason"),
    [
        # One bit of "16" made "14": the resumed run read other batches, no error.
        ({"next_index": 8}, None, "its data iterator state is at batch 8, not at step 10's"),
        # Damage only the iterator can tell (a batch size or seed the training hash rules
        # out): the run failed on every rerun, the checkpoint left in place.
        ({"next_index": 10, "global_batch": 14}, "has global_batch=14", "has global_batch=14"),
    ],
)
def test_a_checkpoint_whose_data_state_cannot_resume_is_quarantined(
    tmp_path, state, saved, problem, reason
):
    save(tmp_path, 5, state.arrays)
    mngr = checkpoint.make_manager(str(tmp_path))
    checkpoint.save(mngr, 10, state.arrays, saved, "h1")
    mngr.wait_until_finished()
    mngr.close()

    def data_problem(data_state):
        return problem if "global_batch" in data_state else None

    step, _, data_state = _restore_newest(tmp_path, state.arrays, data_problem=data_problem)
    assert (step, data_state) == (5, {"next_index": 5})
    assert reason in _quarantined(tmp_path)


NOT_DAMAGE = [
    PermissionError(errno.EACCES, "Permission denied", "checkpoints/10/state/manifest.ocdbt"),
    MemoryError(),
    ValueError('UNAVAILABLE: Error reading "state/d/1a2b": HTTP 503 after 32 attempts'),
    RuntimeError("restore failed in a thread"),  # wraps its cause, as orbax does
]
NOT_DAMAGE[3].__cause__ = ValueError("PERMISSION_DENIED: caller lacks storage.objects.get")


@pytest.mark.parametrize("error", NOT_DAMAGE, ids=lambda e: type(e).__name__)
def test_a_read_that_fails_for_no_fault_of_the_checkpoint_leaves_it_in_place(
    tmp_path, state, monkeypatch, error
):
    # No permission, no memory, storage unavailable: quarantining the newest checkpoint
    # for that threw away its steps (and on the orchestrator, cost a slice to train them).
    save(tmp_path, 5, state.arrays)
    save(tmp_path, 10, state.arrays)

    def fails(*args, **kwargs):
        raise error

    monkeypatch.setattr("workloads.ckpt_restore.restore", fails)
    with pytest.raises(checkpoint.CheckpointUnreadable, match="step 10 could not be read"):
        _restore_newest(tmp_path, state.arrays)
    monkeypatch.setattr(checkpoint, "restore_on_host", fails)
    with pytest.raises(checkpoint.CheckpointUnreadable, match="left in place") as raised:
        checkpoint.verify_checkpoint(str(tmp_path), 10, "h1")
    assert not isinstance(raised.value, checkpoint.CheckpointError)  # a rerun must not retrain
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["10", "5"]
    assert not (tmp_path / "quarantine").exists()


def test_a_read_that_fails_on_the_checkpoint_s_bytes_still_quarantines_it(
    tmp_path, state, monkeypatch
):
    save(tmp_path, 10, state.arrays)

    def fails(*args, **kwargs):
        raise ValueError("DATA_LOSS: Error reading manifest: checksum mismatch")

    monkeypatch.setattr(checkpoint, "restore_on_host", fails)
    with pytest.raises(checkpoint.CheckpointError, match="DATA_LOSS"):
        checkpoint.verify_checkpoint(str(tmp_path), 10, "h1")
    (moved,) = (tmp_path / "quarantine").iterdir()
    assert moved.name.startswith("10-")


def test_hosts_agree_to_stop_when_any_host_could_not_read_for_no_fault_of_the_checkpoint(
    monkeypatch,
):
    # Host 0 found damage and would quarantine the step and go on to the next, while host 1,
    # refused its read (no permission, storage unavailable), stopped: host 0 then waited.
    from workloads import ckpt_restore

    def hosts_say(*others):
        def allgather(mine):
            rows = [
                mine,
                *(np.frombuffer(o.encode().ljust(len(mine), b"\0"), np.uint8) for o in others),
            ]
            return np.stack(rows)

        monkeypatch.setattr(ckpt_restore.jax, "process_count", lambda: 1 + len(others))
        monkeypatch.setattr(ckpt_restore.multihost_utils, "process_allgather", allgather)

    refused = ckpt_restore.UNREADABLE + "checkpoint step 10 could not be read: PermissionError"
    hosts_say(refused)
    assert ckpt_restore._agreed_problem("does not restore: ValueError: cut") == refused
    assert ckpt_restore._agreed_problem(None) == refused
    hosts_say("does not restore: ValueError: cut")
    assert ckpt_restore._agreed_problem(None) == "does not restore on host 1: ValueError: cut"
    hosts_say("")
    assert ckpt_restore._agreed_problem(None) is None


def test_restore_params_reads_the_checked_parameters_alone_and_moves_nothing(tmp_path, state):
    save(tmp_path, 10, state.arrays)
    params = checkpoint.restore_params(str(tmp_path), 10, "h1")
    sha, count = checkpoint.params_sha256(params)
    verified = checkpoint.verify_checkpoint(str(tmp_path), 10, "h1")
    assert (sha, count) == (verified.params_sha256, verified.num_params)
    # Another config's step is refused by name, and left where it is (only the pipeline's
    # verification quarantines).
    with pytest.raises(checkpoint.CheckpointError, match=r"checkpoints/10: written by config h1"):
        checkpoint.restore_params(str(tmp_path), 10, "h2")
    assert checkpoint.committed_steps(str(tmp_path)) == [10]
    assert not (tmp_path / "quarantine").exists()


def test_a_step_without_its_state_metadata_is_refused_by_name(tmp_path, state):
    save(tmp_path, 10, state.arrays)
    (tmp_path / "checkpoints" / "10" / "state" / "_METADATA").unlink()
    # Orbax reads a missing tree metadata file as none; the error names the file.
    named = r"checkpoints/10: does not restore: FileNotFoundError: .*state/_METADATA"
    with pytest.raises(checkpoint.CheckpointError, match=named):
        checkpoint.restore_params(str(tmp_path), 10, "h1")
    assert checkpoint.committed_steps(str(tmp_path)) == [10]
    # The pipeline's verification moves the damaged step aside, saying why.
    with pytest.raises(checkpoint.CheckpointError, match=named):
        checkpoint.verify_checkpoint(str(tmp_path), 10, "h1")
    assert checkpoint.committed_steps(str(tmp_path)) == []
    (moved,) = (tmp_path / "quarantine").iterdir()
    assert "state/_METADATA" in (moved / "QUARANTINED.txt").read_text()
