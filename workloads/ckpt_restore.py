"""Reading checkpoint steps back: onto the training mesh, to resume from the newest step
that restores and can be trusted (quarantining each newer one that cannot, with the hosts
agreeing on it), or onto one host CPU device, to verify or evaluate a step whatever mesh
wrote it (re-exported by workloads/checkpoint.py).
"""

from __future__ import annotations

import errno
import logging
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from workloads import ckpt_integrity as integrity
from workloads.ckpt_manager import item_handlers, make_manager
from workloads.ckpt_quarantine import quarantine
from workloads.closed_loop_noise import drop_failed_read_leftovers

# The logger these lines had before the split, so their records are unchanged.
log = logging.getLogger("workloads.checkpoint")

REASON_BYTES = 1024  # of a restore problem, as hosts tell each other (see `_agreed_problem`)
UNREADABLE = "[unreadable] "  # marks a problem that is no damage, as hosts tell each other


def restore(mngr: ocp.CheckpointManager, step: int, arrays: dict) -> tuple[dict, dict, dict]:
    """Restore `step` onto the shardings of `arrays`; returns (arrays, data_iter, meta).

    Each host reads its own shards and nothing more: no collective, no barrier, unlike
    `CheckpointManager.restore`, whose closing barrier a host that failed to read never
    reaches (see `restore_newest_valid`).
    """
    from flax import nnx

    target = pure_dicts(arrays)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    handler = ocp.CompositeCheckpointHandler(**item_handlers())
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


def state_problem(
    state: Any,
    meta: dict,
    config_hash: str,
    step: int | None = None,
    data_state: dict | None = None,
    data_problem: Callable[[dict], str | None] | None = None,
) -> str | None:
    """Why a restored checkpoint must not be trusted, or None. `state`: the restored pure
    dict; `step`: the step its directory is named for; `data_problem`: why the saved data
    iterator state cannot resume this run's iterator (`input.iterator_state_problem`).

    Checked: the config; the step recorded inside against the directory's, and the data
    iterator's batch count against both (one batch a step: a directory renamed or copied
    under another number skipped steps silently, and a state edited to another count
    resumed another place in the stream, as neither has a checksum); NaN/Inf; arrays that
    differ from their saved checksums.
    """
    if meta.get("config_hash") != config_hash:
        return f"written by config {meta.get('config_hash')}, this run's config is {config_hash}"
    if step is not None and meta.get("step", step) != step:
        return f"holds step {meta.get('step')}, not the step {step} its directory is named for"
    if data_state is not None and step is not None:
        batches = data_state.get("next_index", step)
        if batches != step:
            return f"its data iterator state is at batch {batches}, not at step {step}'s"
        if data_problem is not None and (problem := data_problem(data_state)) is not None:
            return f"its data iterator state {problem}"
    return integrity.integrity_problem(state, meta.get("checksums"))


class CheckpointUnreadable(RuntimeError):
    """A checkpoint could not be read for a reason that says nothing about the checkpoint
    (no permission, no memory, storage unavailable): it is left in place, never
    quarantined, and the read fails. A later run, once that is fixed, resumes from it."""


# Status codes (absl's, as tensorstore's errors begin) of a read that failed for want of
# access, memory or a storage service, not because of the bytes read.
_NOT_DAMAGE_CODES = re.compile(
    r"\b(PERMISSION_DENIED|UNAUTHENTICATED|UNAVAILABLE|DEADLINE_EXCEEDED|RESOURCE_EXHAUSTED):"
)
_NOT_DAMAGE_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.ENOMEM})


def says_nothing_of_the_checkpoint(exc: BaseException) -> bool:
    """Whether a failed read is the reader's or the storage's trouble, not damage: an
    error a checkpoint's bytes cannot cause (quarantining a good checkpoint for it cost
    the steps since the one before, and on the orchestrator, a slice to train them)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:  # orbax wraps errors of its threads
        seen.add(id(exc))
        if isinstance(exc, MemoryError | PermissionError):
            return True
        if isinstance(exc, OSError) and exc.errno in _NOT_DAMAGE_ERRNOS:
            return True
        if _NOT_DAMAGE_CODES.search(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def unreadable(where: str, exc: BaseException) -> CheckpointUnreadable:
    """The error for a checkpoint left in place: `where` and why it could not be read."""
    reason = restore_error(exc).removeprefix("does not restore: ")
    return CheckpointUnreadable(
        f"checkpoint {where} could not be read, for a reason that is not damage to it; it "
        f"was left in place, and a run once that is fixed resumes from it: {reason}"
    )


def restore_error(exc: BaseException) -> str:
    """'does not restore: <error>', without the store's whole spec that tensorstore's
    errors append (60 lines of JSON for one array, in a message a person reads), and with
    the error it was raised from: orbax's "Encountered error while reading array index:
    (slice(0, 384, 1), ...)" named no array and no file; its cause names both."""
    said = f"{type(exc).__name__}: {_short(exc)}"
    cause = exc.__cause__
    if cause is not None and _short(cause) not in said:
        said += f" (from {type(cause).__name__}: {_short(cause)})"
    return f"does not restore: {said}"


def _short(exc: BaseException) -> str:
    text = str(exc).split("See full TensorStore details", 1)[0].strip()
    return text[:500] + " ..." if len(text) > 500 else text


def restore_newest_valid(
    mngr: ocp.CheckpointManager,
    run_dir: str,
    arrays: dict,
    config_hash: str,
    data_problem: Callable[[dict], str | None] | None = None,
    on_quarantine: Callable[[int, str], None] | None = None,
) -> tuple[int, dict, dict | None]:
    """Resume point: the newest checkpoint that restores, is finite, is this config's and
    whose data iterator state resumes this run's iterator (`state_problem`).

    Each newer checkpoint that fails is quarantined first, and `on_quarantine(step,
    reason)` called on every host. Returns (step, arrays, data iterator state);
    (0, arrays, None) when nothing valid exists, with `arrays` untouched.

    With several hosts, each reads its own shards, so a damaged file may fail one host's
    read only. The hosts then agree on the outcome before anything collective runs: after
    orbax's restore, a host whose read failed skipped the barrier that closes it while the
    others waited there, the hosts' collectives no longer matched, and the attempt stalled
    until the orchestrator's heartbeat timeout.
    """
    drop_failed_read_leftovers()  # a damaged step's failed reads: its warning says enough
    for step in sorted(mngr.all_steps(), reverse=True):
        try:
            restored, data_state, meta = restore(mngr, step, arrays)
            problem = None
        except Exception as exc:  # a truncated or missing file surfaces as any error
            problem = restore_error(exc)
            if says_nothing_of_the_checkpoint(exc):
                problem = UNREADABLE + str(unreadable(f"step {step}", exc))
            log.warning("checkpoint step %d %s", step, problem)
        problem = _agreed_problem(problem)
        if problem is not None and problem.startswith(UNREADABLE):  # every host stops alike
            raise CheckpointUnreadable(problem.removeprefix(UNREADABLE))
        if problem is None:  # every host holds its shards: collective checks are safe
            problem = state_problem(
                pure_dicts(restored), meta, config_hash, step, data_state, data_problem
            )
        if problem is None:
            return step, restored, data_state
        if jax.process_index() == 0:
            quarantine(run_dir, step, problem)
        multihost_utils.sync_global_devices(f"quarantine-{step}")
        if on_quarantine is not None:
            on_quarantine(step, problem)
        mngr.reload()
    return 0, arrays, None


def _agreed_problem(problem: str | None) -> str | None:
    """This host's restore problem or, if only other hosts' restores failed, theirs; but
    the first `UNREADABLE` one if any host's is, so that every host stops alike (one host
    quarantining the step and going on while another stopped left the first waiting).

    Every host calls it once per step tried, whatever happened on it: the hosts exchange
    their problems (the first `REASON_BYTES` of each) in one collective.
    """
    if jax.process_count() == 1:
        return problem
    mine = (problem or "").encode()[:REASON_BYTES].ljust(REASON_BYTES, b"\0")
    every = multihost_utils.process_allgather(np.frombuffer(mine, np.uint8))
    reasons = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in every]
    failed = [(host, reason) for host, reason in enumerate(reasons) if reason]
    if stop := next((r for _, r in failed if r.startswith(UNREADABLE)), None):
        return stop
    if problem is None and failed:
        host, reason = failed[0]
        problem = reason.replace("does not restore:", f"does not restore on host {host}:", 1)
    return problem


def _restore_args(abstract: Any, partial: bool = False) -> ocp.args.PyTreeRestore:
    """Restore onto the shapes, dtypes and shardings of an abstract tree (with `partial`,
    a part of the saved tree: the rest is never read)."""
    return ocp.args.PyTreeRestore(
        item=abstract,
        restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
        partial_restore=partial,
    )


def pure_dicts(arrays: dict) -> dict:
    """Each state of `arrays` as the pure dict of its arrays (what orbax saves)."""
    from flax import nnx

    return {key: nnx.to_pure_dict(state) for key, state in arrays.items()}


def restore_on_host(
    run_dir: str, step: int, with_data: bool = False, only: str | None = None
) -> tuple[dict, dict] | tuple[dict, dict, dict | None]:
    """Restore a step's `state` onto one host CPU device (any mesh wrote it) and its meta;
    with `with_data`, its data-iterator state too (None if the step has none); with
    `only`, that item of the state alone (`"model"`: AdamW's moments, twice the
    parameters' bytes, are never read)."""
    drop_failed_read_leftovers()  # a damaged step's failed reads: the raised error says why
    mngr = make_manager(run_dir, read_only=True)
    try:
        metadata = mngr.item_metadata(step)["state"]
        if metadata is None:  # orbax's reading of a tree metadata file it could not read
            path = epath.Path(mngr.directory) / str(step) / "state" / "_METADATA"
            path.read_bytes()  # its own error: missing (damage), or no permission (none)
            raise ValueError(f"{path} is not orbax tree metadata")
        if only is not None:
            metadata = {only: metadata[only]}
        # One host device holds everything: valid whatever topology wrote the checkpoint.
        host = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
        abstract = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=host),
            metadata,
            is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"),
        )
        items = {"state": _restore_args(abstract, only is not None), "meta": ocp.args.JsonRestore()}
        has_data = (epath.Path(mngr.directory) / str(step) / "data_iter").exists()
        if with_data and has_data:
            items["data_iter"] = ocp.args.JsonRestore()
        out = mngr.restore(step, args=ocp.args.Composite(**items))
        if with_data:
            return out["state"], out["meta"], out.get("data_iter")
        return out["state"], out["meta"]
    finally:
        mngr.close()
