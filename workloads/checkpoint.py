"""Orbax checkpoints of a run: model, optimizer and data-iterator state, saved together.

A checkpoint step holds three items: `state` (the model and optimizer arrays as a pure
dict), `data_iter` (the grain iterator's state, so a resumed run sees the batches an
uninterrupted run would) and `meta` (step and config hash). Orbax writes each step under a
temporary name and commits it atomically; `latest_step` only reports committed steps, and
`verify_checkpoint` re-checks a step before the pipeline trusts it.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from workloads import ckpt_integrity as integrity
from workloads.ckpt_manager import OldestFirstManager, TrainingManager
from workloads.step_metrics import NonFiniteError

log = logging.getLogger(__name__)


REASON_BYTES = 1024  # of a restore problem, as hosts tell each other (see `_agreed_problem`)
QUARANTINED = "QUARANTINED.txt"  # the reason, in a quarantined step's folder
COMMIT_MARKER = "commit_success.txt"  # what marks a step committed on GCS (orbax)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, non-finite or from another config."""


def checkpoint_dir(run_dir: str) -> epath.Path:
    """Where a run's checkpoints live."""
    return epath.Path(run_dir) / "checkpoints"


def make_manager(
    run_dir: str, keep: int = 3, async_save: bool = True, read_only: bool = False
) -> ocp.CheckpointManager:
    """A CheckpointManager over the run's checkpoint directory, keeping `keep` steps.

    Saving cadence is decided by the training loop (every K steps, the final step and on a
    preemption notice), so the manager saves whenever asked. On local storage with
    `keep >= 2` the oldest step goes just before a save (`OldestFirstManager`); on gs://,
    where no local memory is written, and with `keep == 1`, orbax deletes it after the
    new one commits.
    """
    oldest_first = keep >= 2 and not read_only and "://" not in str(run_dir)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if oldest_first else keep,
        enable_async_checkpointing=async_save,
        # Orbax's own read_only mode logs warnings on every open; not creating and not
        # cleaning is all a reader needs.
        cleanup_tmp_directories=not read_only,
        create=not read_only,
    )
    handlers = _handlers()
    if oldest_first:
        return OldestFirstManager(
            checkpoint_dir(run_dir), keep, options=options, item_handlers=handlers
        )
    return TrainingManager(checkpoint_dir(run_dir), options=options, item_handlers=handlers)


def _handlers() -> dict:
    """The handlers of a step's three items."""
    return {
        # Float parameters barely compress (zstd gained ~3% here) while compressing costs
        # the CPU time an async save should leave to training: store them raw.
        "state": ocp.PyTreeCheckpointHandler(use_compression=False),
        "data_iter": ocp.JsonCheckpointHandler(),
        "meta": ocp.JsonCheckpointHandler(),
    }


def save(
    mngr: ocp.CheckpointManager, step: int, arrays: dict, data_iter: dict, config_hash: str
) -> None:
    """Start saving `step` (asynchronously); the caller waits before exiting.

    The step's `meta` holds each array's checksum (`workloads.ckpt_integrity`), computed
    in the same pass as the finite check, so a restore can tell altered files.

    Raises:
        NonFiniteError: the state holds NaN/Inf (an update can overflow even when the loss
            and gradients it came from were finite); nothing is written.
    """
    pure = _pure(arrays)
    scanned = integrity.scan(pure)
    _refuse_non_finite(step, scanned)
    meta = {"step": step, "config_hash": config_hash, "checksums": integrity.checksums(scanned)}
    args = ocp.args.Composite(
        state=ocp.args.PyTreeSave(pure),
        data_iter=ocp.args.JsonSave(data_iter),
        meta=ocp.args.JsonSave(meta),
    )
    mngr.save(step, args=args, force=True)


def prepare_saves(arrays: dict) -> None:
    """Compile the finite check and checksums every save runs, for the layouts of `arrays`.

    Call it with the first train step's output (jit may lay out replicated arrays
    differently from the initial state, and the check compiles per layout). Otherwise
    the first save pays the compile (0.1-0.3 s here) in the middle of training, where it
    competes with the train step for the host's cores.
    """
    integrity.scan(_pure(arrays))


def _refuse_non_finite(step: int, scanned: list) -> None:
    problem = integrity.first_non_finite(scanned)
    if problem:
        raise NonFiniteError(
            f"step {step}: after the update, {problem}; stopping without saving this state "
            "(lower train.learning_rate)"
        )


def restore(mngr: ocp.CheckpointManager, step: int, arrays: dict) -> tuple[dict, dict, dict]:
    """Restore `step` onto the shardings of `arrays`; returns (arrays, data_iter, meta).

    Each host reads its own shards and nothing more: no collective, no barrier, unlike
    `CheckpointManager.restore`, whose closing barrier a host that failed to read never
    reaches (see `restore_newest_valid`).
    """
    from flax import nnx

    target = _pure(arrays)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    handler = ocp.CompositeCheckpointHandler(**_handlers())
    try:
        out = handler.restore(
            epath.Path(mngr.directory) / str(step),
            args=ocp.args.Composite(
                state=_restore_args(abstract),
                data_iter=ocp.args.JsonRestore(),
                meta=ocp.args.JsonRestore(),
            ),
        )
    finally:
        handler.close()
    restored = {}
    for key, state in arrays.items():
        copy = jax.tree.map(lambda x: x, state)  # never mutate the caller's state
        nnx.replace_by_pure_dict(copy, out["state"][key])
        restored[key] = copy
    return restored, out["data_iter"], out["meta"]


def state_problem(state: Any, meta: dict, config_hash: str) -> str | None:
    """Why a restored checkpoint must not be trusted (wrong config, NaN/Inf, arrays that
    differ from their saved checksums), or None. `state`: the restored pure dict."""
    if meta.get("config_hash") != config_hash:
        return f"written by config {meta.get('config_hash')}, this run's config is {config_hash}"
    return integrity.integrity_problem(state, meta.get("checksums"))


def quarantine(run_dir: str, step: int, reason: str) -> epath.Path:
    """Move a checkpoint a run must not trust to `quarantine/<step>-<time>/`, with the
    reason in `QUARANTINED.txt` there.

    Never deletes: a person may want to look at what went wrong.
    """
    source = checkpoint_dir(run_dir) / str(step)
    target = epath.Path(run_dir) / "quarantine" / f"{step}-{int(time.time())}"
    if "://" not in str(run_dir):
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(source, target)  # atomic
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            _move_across_filesystems(source, target, reason)
        else:
            (target / QUARANTINED).write_text(reason + "\n")
    else:
        # GCS has no folders: a folder exists once an object is in it (moving a step to a
        # quarantine/ that did not exist failed, and every rerun failed on the same step),
        # and a rename is a copy and a delete per object anyway. The commit marker moves
        # first, so a move cut short leaves a step orbax no longer counts as committed.
        (target / QUARANTINED).write_text(reason + "\n")
        for child in sorted(source.iterdir(), key=lambda p: p.name != COMMIT_MARKER):
            child.rename(target / child.name)
    log.warning("checkpoint step %d quarantined to %s: %s", step, target, reason)
    return target


def _move_across_filesystems(source: epath.Path, target: epath.Path, reason: str) -> None:
    """Move a step's folder to `target` on another filesystem (`checkpoints/` a symlink to
    another mount made every rename fail with EXDEV, so the bad step was never moved and
    every rerun failed on it), so that no moment shows half a checkpoint as a whole one.

    The copy, with its reason, is made under a hidden name beside `target` and renamed to
    it once whole: a copy cut short is never a quarantined step, and the step stays whole
    in `checkpoints/`, quarantined again by the next run. Only then is the step renamed
    out of `checkpoints/` (on its own filesystem: atomic) to a hidden name orbax counts
    as no step, and deleted there: a deletion cut short leaves that folder, never a step.
    """
    for stale in target.parent.glob(f".{source.name}-*.partial"):  # copies cut short
        shutil.rmtree(stale, ignore_errors=True)
    partial = target.with_name(f".{target.name}.partial")
    shutil.copytree(source, partial, symlinks=True)
    (partial / QUARANTINED).write_text(reason + "\n")
    os.rename(partial, target)
    moved_out = source.with_name(f".{source.name}.quarantined-{target.name}")
    os.rename(source, moved_out)
    try:
        shutil.rmtree(moved_out)
    except OSError as exc:  # the step is out of checkpoints/ and copied: nothing is at risk
        log.warning("could not delete %s, a copy of %s: %s", moved_out, target, exc)


def restore_error(exc: BaseException) -> str:
    """'does not restore: <error>', without the store's whole spec that tensorstore's
    errors append (60 lines of JSON for one array, in a message a person reads)."""
    text = str(exc).split("See full TensorStore details", 1)[0].strip()
    if len(text) > 500:
        text = text[:500] + " ..."
    return f"does not restore: {type(exc).__name__}: {text}"


def restore_newest_valid(
    mngr: ocp.CheckpointManager, run_dir: str, arrays: dict, config_hash: str
) -> tuple[int, dict, dict | None]:
    """Resume point: the newest checkpoint that restores, is finite and is this config's.

    Each newer checkpoint that fails is quarantined first. Returns (step, arrays, data
    iterator state); (0, arrays, None) when nothing valid exists, with `arrays` untouched.

    With several hosts, each reads its own shards, so a damaged file may fail one host's
    read only. The hosts then agree on the outcome before anything collective runs: after
    orbax's restore, a host whose read failed skipped the barrier that closes it while the
    others waited there, the hosts' collectives no longer matched, and the attempt stalled
    until the orchestrator's heartbeat timeout.
    """
    for step in sorted(mngr.all_steps(), reverse=True):
        try:
            restored, data_state, meta = restore(mngr, step, arrays)
            problem = None
        except Exception as exc:  # a truncated or missing file surfaces as any error
            problem = restore_error(exc)
            log.warning("checkpoint step %d %s", step, problem)
        problem = _agreed_problem(problem)
        if problem is None:  # every host holds its shards: collective checks are safe
            problem = state_problem(_pure(restored), meta, config_hash)
        if problem is None:
            return step, restored, data_state
        if jax.process_index() == 0:
            quarantine(run_dir, step, problem)
        multihost_utils.sync_global_devices(f"quarantine-{step}")
        mngr.reload()
    return 0, arrays, None


def _agreed_problem(problem: str | None) -> str | None:
    """This host's restore problem or, if only other hosts' restores failed, theirs.

    Every host calls it once per step tried, whatever happened on it: the hosts exchange
    their problems (the first `REASON_BYTES` of each) in one collective.
    """
    if jax.process_count() == 1:
        return problem
    mine = (problem or "").encode()[:REASON_BYTES].ljust(REASON_BYTES, b"\0")
    every = multihost_utils.process_allgather(np.frombuffer(mine, np.uint8))
    reasons = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in every]
    failed = [(host, reason) for host, reason in enumerate(reasons) if reason]
    if problem is None and failed:
        host, reason = failed[0]
        problem = reason.replace("does not restore:", f"does not restore on host {host}:", 1)
    return problem


def _restore_args(abstract: Any) -> ocp.args.PyTreeRestore:
    """Restore onto the shapes, dtypes and shardings of an abstract tree."""
    return ocp.args.PyTreeRestore(
        item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)
    )


def _pure(arrays: dict) -> dict:
    from flax import nnx

    return {key: nnx.to_pure_dict(state) for key, state in arrays.items()}


@dataclass(frozen=True)
class VerifiedCheckpoint:
    """What verification found: the step, the config it came from and a parameter checksum."""

    step: int
    config_hash: str
    params_sha256: str
    num_params: int
    num_arrays: int


def restore_on_host(run_dir: str, step: int) -> tuple[dict, dict]:
    """Restore a step's `state` onto one host CPU device (any mesh wrote it) and its meta."""
    mngr = make_manager(run_dir, read_only=True)
    try:
        metadata = mngr.item_metadata(step)["state"]
        # One host device holds everything: valid whatever topology wrote the checkpoint.
        host = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
        abstract = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=host),
            metadata,
            is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"),
        )
        out = mngr.restore(
            step,
            args=ocp.args.Composite(state=_restore_args(abstract), meta=ocp.args.JsonRestore()),
        )
        return out["state"], out["meta"]
    finally:
        mngr.close()


def params_sha256(model_tree: dict) -> tuple[str, int]:
    """sha256 over every parameter's path, dtype, shape and bytes, in a fixed order."""
    digest = hashlib.sha256()
    count = 0
    flat = jax.tree_util.tree_flatten_with_path(model_tree)[0]
    for path, leaf in sorted(flat, key=lambda kv: jax.tree_util.keystr(kv[0])):
        arr = np.ascontiguousarray(np.asarray(leaf))
        digest.update(f"{jax.tree_util.keystr(path)}|{arr.dtype}|{arr.shape}|".encode())
        digest.update(arr.tobytes())
        count += arr.size
    return digest.hexdigest(), count


def committed_steps(run_dir: str) -> list[int]:
    """Every committed checkpoint step of a run, oldest first (none: an empty list)."""
    if not checkpoint_dir(run_dir).exists():
        return []
    mngr = make_manager(run_dir, read_only=True)
    try:
        return sorted(mngr.all_steps())
    finally:
        mngr.close()


def latest_step(run_dir: str) -> int | None:
    """The newest committed checkpoint step of a run, or None."""
    if not checkpoint_dir(run_dir).exists():
        return None
    mngr = make_manager(run_dir, read_only=True)
    try:
        return mngr.latest_step()
    finally:
        mngr.close()


def verify_checkpoint(
    run_dir: str, expected_step: int | None, config_hash: str
) -> VerifiedCheckpoint:
    """Restore the newest checkpoint and check its step, its config and that it is finite.

    Raises:
        CheckpointError: naming the run directory and what is wrong.
    """
    step = latest_step(run_dir)
    where = checkpoint_dir(run_dir)
    if step is None:
        raise CheckpointError(f"no committed checkpoint in {where}")
    if expected_step is not None and step != expected_step:
        raise CheckpointError(
            f"newest checkpoint in {where} is step {step}, expected the final step {expected_step}"
        )
    try:
        state, meta = restore_on_host(run_dir, step)
        problem = state_problem(state, meta, config_hash)
    except Exception as exc:
        problem = restore_error(exc)
    if problem is not None:
        moved = quarantine(run_dir, step, problem)
        raise CheckpointError(f"checkpoint {where / str(step)}: {problem} (moved to {moved})")
    sha, count = params_sha256(state["model"])
    return VerifiedCheckpoint(
        step, meta["config_hash"], sha, count, len(jax.tree_util.tree_leaves(state))
    )
