"""Which copies of a run's slice name are the run's own, and deleting only those.

Runs of one run name under two storage roots (two buckets' `nightly`) share the slice
name, and with fallback zones each can hold it in another zone at once. The `run-root`
label tells them apart: a run deletes only its own copies, and refuses to create its
slice while another root's copy holds the name anywhere.

A copy of the run's own that an earlier attempt left standing (its orchestrator was
killed, or its delete failed) was billed by Google until it is deleted here, so its
deletion is recorded for that attempt (`leftover_deleted`, see `tasks.ledger`).
"""

from __future__ import annotations

import logging
import os
import time

from etils import epath

from infra.slices.base import LabelTest, SliceState, SliceStatus
from tasks.attempts import LEFTOVER_DELETED
from tasks.goodput import MAX_ATTEMPT
from tasks.plan import ROOT_LABEL, RunPlan, is_gcs, plan_run, root_tag, run_events
from workloads.config import PipelineConfig, valid_run_name
from workloads.events import EVENTS
from workloads.rundir import RunDir

log = logging.getLogger(__name__)


class SliceNameTaken(RuntimeError):
    """The run's slice name is held by a slice of a run of the same name under another
    storage root (same project, in one of the zones this run looks in, another bucket):
    neither run may delete the other's."""


# Seconds a heartbeat may be late beyond two of its intervals (a write, a clock apart).
BEAT_SLACK_S = 5.0


def own_copy(plan: RunPlan) -> LabelTest:
    """The test of a copy of the run's slice name being this run's: its `run-root` label
    is this storage root's, or it has none (labelled before the label existed); any copy,
    where the provider's registry lives in the storage root itself (a local directory
    root's `slices/`): none but this root's runs write there, and a copy labelled with
    another root's tag came along when the root was moved. It was refused as another
    root's ("wait for it to end, or choose another run_name"), so a moved root's run whose
    orchestrator had been killed could never resume, and left its slice standing."""
    if not is_gcs(plan.storage_root) and os.path.abspath(plan.slices_root) == os.path.abspath(
        plan.storage_root
    ):
        return lambda labels: True
    ours = root_tag(plan)
    return lambda labels: labels.get(ROOT_LABEL) in (None, ours)


def _copies(provider, plan: RunPlan) -> list[SliceStatus]:
    """Every copy of the run's slice name; none when they cannot be read: the delete that
    follows then goes on as it did before the labels were read (it still deletes only the
    copies it reads as this run's)."""
    try:
        return provider.copies(plan.slice_name)
    except Exception as exc:  # see the docstring
        log.warning("slice %s: could not read its labels: %s", plan.slice_name, exc)
        return []


def _foreign(copies: list[SliceStatus], plan: RunPlan) -> str | None:
    """What holds the run's slice name among `copies`, when a run under another storage
    root does in any place (zone); None when every copy is this run's or there is none. A
    copy labelled before the `run-root` label existed is taken as this run's, as it was
    before."""
    ours = own_copy(plan)
    theirs = next((c for c in copies if not ours(c.labels)), None)
    if theirs is None:
        return None
    return (
        f"slice {plan.slice_name!r} ({theirs.state.value}) belongs to a run of the same name "
        f"under another storage root (its label {ROOT_LABEL}={theirs.labels[ROOT_LABEL]}; "
        f"this run's root {plan.storage_root} is {ROOT_LABEL}={root_tag(plan)})"
    )


def delete_own_slice(provider, plan: RunPlan, logger, running: int | None = None) -> bool | None:
    """Delete the run's copies of its slice name, in every zone: True if something was
    deleted, False if nothing was there. A copy a run under another storage root holds
    is logged and left standing; None when it was and nothing of this run's was deleted.
    A copy an attempt other than `running` made is recorded as that attempt's leftover.

    Args:
        provider: the run's slice provider.
        plan: the run.
        logger: receives the warning naming the copy left standing.
        running: the attempt deleting its own slice; None after the attempts (the flow's
            teardown), when every copy is a leftover.
    """
    copies = _copies(provider, plan)
    other = _foreign(copies, plan)
    if other is not None:
        logger.warning("%s: left standing", other)
    deleted = _delete_recording(provider, plan, copies, running)
    return deleted if other is None else (deleted or None)


def clear_slice_name(provider, plan: RunPlan, attempt: int) -> None:
    """Before attempt `attempt` creates the run's slice: delete the run's copies of the
    name (a killed orchestrator's would block the create, or, in a zone this attempt does
    not use, be billed until its ttl), recording each earlier attempt's as its leftover.

    Raises:
        SliceNameTaken: a run under another storage root holds the name: not ours to
            delete, and the create would fail on it.
    """
    copies = _copies(provider, plan)
    if (other := _foreign(copies, plan)) is not None:
        raise SliceNameTaken(f"{other}: wait for it to end, or choose another run_name")
    _delete_recording(provider, plan, copies, attempt)


def _delete_recording(
    provider, plan: RunPlan, copies: list[SliceStatus], running: int | None
) -> bool:
    # The labels are read before the delete: after it, nothing says whose copy it was.
    ours = own_copy(plan)
    left = {
        number: copy.state.value
        for copy in copies
        if ours(copy.labels) and (number := _attempt_of(copy.labels)) not in (None, running)
    }
    # Only this run's copies, wherever they are: another root's copy of the name stays.
    deleting = time.time()
    deleted = provider.delete(plan.slice_name, where=ours)
    if deleted:
        for number, state in sorted(left.items()):
            # A killed orchestrator's slice, billed until now: said, not only recorded.
            log.warning(
                "deleted slice %s, left %s by attempt %d of run %s (billed to that attempt)",
                plan.slice_name,
                state,
                number,
                plan.run_name,
            )
            _record_leftover(plan, number, state, deleting)
    return deleted


def record_teardown_delete(
    config: PipelineConfig, status: SliceStatus, invocation: str | None
) -> bool:
    """Record, in its run's ledger, that the reaper or a flow hook (`tasks.teardown`)
    deleted `status`, a copy of some run's slice, as its attempt's leftover, billed until
    now. True if recorded.

    The labels name the run and the attempt, and a hash of the run's storage root, not the
    root: only a run under `config`'s storage root (the reaper's or the flow run's) is
    found, by its run directory's ledger. Nothing is recorded for a copy of another root,
    one without an `attempt` label, or one whose run directory holds no ledger: the ledger
    then bills that attempt to its end, as before. A failure to record is logged, never
    raised: the slice is gone either way.
    """
    labels = status.labels
    run_id, attempt = labels.get("run-id", ""), _attempt_of(labels)
    if attempt is None or not valid_run_name(run_id):
        return False
    try:
        plan = plan_run(config.model_copy(update={"run_name": run_id}), invocation)
        # The name follows from the run id: a copy whose labels do not fit it is no run's.
        if plan.slice_name != status.name or labels.get(ROOT_LABEL) != root_tag(plan):
            return False
        if not (epath.Path(plan.run_dir) / EVENTS).exists():
            return False  # the run directory is gone, or lives on another machine
    except Exception as exc:  # a storage root that cannot be read: see the docstring
        log.warning("deleted slice %s, but could not find its run's ledger: %s", status.name, exc)
        return False
    return _record_leftover(plan, attempt, status.state.value)


def _attempt_of(labels) -> int | None:
    """The attempt that made a copy, from its `attempt` label; None without one (a slice
    of an older version, or made by hand): its deletion is billed to nobody."""
    value = labels.get("attempt", "")
    return int(value) if value.isdecimal() and 0 < int(value) < MAX_ATTEMPT else None


def _last_beat(plan: RunPlan, attempt: int, deleting: float, state: str) -> dict:
    """The last heartbeat the deleted copy's workload wrote, if it is that attempt's: its
    time and step (`beat_time`, `beat_step`), the ledger's evidence of how long a workload
    whose orchestrator was killed trained on (`tasks.attempts.trained_after`; its metrics
    rows come only every `train.log_every` steps). A beat of its training phase no older
    than two of its intervals when the delete began (`deleting`), on a copy still READY
    (`state`), says it trained until then (`trained_until`), as the watch would have
    judged it alive. A copy whose workload had exited (TERMINATED) trained only until its
    last beat: counted until the delete, an orchestrator and workload both killed, then
    rerun, showed 38 s lost where 0.1 s were (probe R). None found: {}."""
    try:
        beat = RunDir(plan.run_dir).read_status() or {}
    except Exception:  # only a note for the ledger: the deletion is recorded without it
        return {}
    when, step, every = beat.get("time"), beat.get("step"), beat.get("beat_s")
    if beat.get("attempt") != attempt or not isinstance(when, int | float):
        return {}
    found = {"beat_time": when, "beat_step": step if isinstance(step, int) else None}
    alive = isinstance(every, int | float) and deleting - when <= 2 * every + BEAT_SLACK_S
    if beat.get("phase") == "training" and alive and state == SliceState.READY.value:
        found["trained_until"] = deleting
    return found


def _record_leftover(
    plan: RunPlan, attempt: int, state: str, deleting: float | None = None
) -> bool:
    """Append `leftover_deleted` for `attempt`, stamped with this invocation; True if
    written. A failed write is logged, not raised: the slice is gone either way, and
    failing the attempt (or the teardown) over the ledger's note would cost more than the
    note is worth."""
    try:
        beat = _last_beat(plan, attempt, time.time() if deleting is None else deleting, state)
        run_events(plan, attempt).emit(LEFTOVER_DELETED, name=plan.slice_name, state=state, **beat)
        return True
    except Exception as exc:  # see the docstring
        log.warning(
            "deleted slice %s left by attempt %d, but could not record it in %s: %s",
            plan.slice_name,
            attempt,
            plan.run_dir,
            exc,
        )
        return False
