"""Orbax checkpoints of a run: model, optimizer and data-iterator state, saved together.

A checkpoint step holds three items: `state` (the model and optimizer arrays as a pure
dict), `data_iter` (the grain iterator's state, so a resumed run sees the batches an
uninterrupted run would) and `meta` (step and config hash). Orbax writes each step under a
temporary name and commits it atomically; `latest_step` only reports committed steps, and
`verify_checkpoint` re-checks a step before the pipeline trusts it.

This module saves steps and verifies the final one, and stays the entry point: it
re-exports the rest, which lives beside it. The manager over a run's checkpoint directory
is in workloads/ckpt_manager.py, restoring and resuming in workloads/ckpt_restore.py,
quarantine in workloads/ckpt_quarantine.py, and the arrays' finite check and checksums in
workloads/ckpt_integrity.py.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np
import orbax.checkpoint as ocp

from workloads import ckpt_integrity as integrity
from workloads.ckpt_manager import checkpoint_dir, make_manager
from workloads.ckpt_quarantine import (  # noqa: F401  (re-exported: the checkpoints' one home)
    COMMIT_MARKER,
    QUARANTINED,
    quarantine,
)
from workloads.ckpt_restore import (  # noqa: F401  (re-exported: the checkpoints' one home)
    REASON_BYTES,
    CheckpointUnreadable,
    restore,
    restore_error,
    restore_newest_valid,
    restore_on_host,
    says_nothing_of_the_checkpoint,
    state_problem,
    unreadable,
)
from workloads.ckpt_restore import pure_dicts as _pure  # the name save and tests use
from workloads.step_metrics import NON_FINITE_HINT, NonFiniteError


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, non-finite or from another config."""


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
            f"({NON_FINITE_HINT})"
        )


@dataclass(frozen=True)
class VerifiedCheckpoint:
    """What verification found: the step, the config it came from and a parameter checksum."""

    step: int
    config_hash: str
    params_sha256: str
    num_params: int
    num_arrays: int


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
    run_dir: str,
    expected_step: int | None,
    config_hash: str,
    data_problem: Callable[[dict], str | None] | None = None,
    on_quarantine: Callable[[int, str], None] | None = None,
) -> VerifiedCheckpoint:
    """Restore the newest checkpoint and check its step, its config and that it is finite,
    and with `data_problem` (`input.layout_problem` over this run's `input.saved_layout`),
    that its data-iterator state is at its step over this run's records: a final
    checkpoint of a run over other data, copied in, was evaluated and landed `completed`.
    A step that fails is quarantined, then `on_quarantine(step, reason)` is called.

    Raises:
        CheckpointError: naming the run directory and what is wrong; the checkpoint is
            quarantined.
        CheckpointUnreadable: it could not be read for a reason that is no damage to it
            (no permission, no memory, storage unavailable); it is left in place.
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
        state, meta, data_state = restore_on_host(run_dir, step, with_data=True)
        if data_problem is not None and data_state is None:
            data_state = {}  # no data iterator state: `data_problem` names what it lacks
        problem = state_problem(state, meta, config_hash, step, data_state, data_problem)
    except Exception as exc:
        if says_nothing_of_the_checkpoint(exc):
            raise unreadable(str(where / str(step)), exc) from exc
        problem = restore_error(exc)
    if problem is not None:
        moved = quarantine(run_dir, step, problem)
        if on_quarantine is not None:
            on_quarantine(step, problem)
        raise CheckpointError(f"checkpoint {where / str(step)}: {problem} (moved to {moved})")
    sha, count = params_sha256(state["model"])
    return VerifiedCheckpoint(
        step, meta["config_hash"], sha, count, len(jax.tree_util.tree_leaves(state))
    )


def restore_params(run_dir: str, step: int, config_hash: str) -> dict:
    """Checkpoint `step`'s model parameters on one host device, checked as far as they
    go: the step's config, the step recorded inside, finite values and the parameters'
    saved checksums. The optimizer state is not read: evaluating needs none of it, and
    AdamW's is twice the parameters' bytes. Nothing is quarantined (only the pipeline's
    `verify_checkpoint` moves a step aside).

    Raises:
        CheckpointError: naming the step's directory and what is wrong with it.
        CheckpointUnreadable: it could not be read for a reason that is no damage to it.
    """
    where = checkpoint_dir(run_dir) / str(step)
    try:
        state, meta = restore_on_host(run_dir, step, only="model")
        if (saved := meta.get("checksums")) is not None:
            meta = {**meta, "checksums": {p: c for p, c in saved.items() if p.startswith("model/")}}
        problem = state_problem(state, meta, config_hash, step)
    except Exception as exc:
        if says_nothing_of_the_checkpoint(exc):
            raise unreadable(str(where), exc) from exc
        problem = restore_error(exc)
    if problem is not None:
        raise CheckpointError(f"checkpoint {where}: {problem}")
    return state["model"]
