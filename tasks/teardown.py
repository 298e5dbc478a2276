"""The second and third layers of teardown: flow hooks and the orphan reaper.

The flow's `on_cancellation` and `on_crashed` hooks delete every slice labelled with the
flow run's id. They cannot run if the orchestrator is SIGKILLed, so the reaper looks at
every slice labelled as this project's and deletes those whose owner is gone: its flow
run is in a terminal state, its `ttl` label has passed, or (local slices) the process that
created it no longer exists.

A slice name can exist in several zones at once (runs of one run name under two storage
roots), and `list` shows each copy: every decision deletes only the copy it was made on.

Both record a deletion in the run's `events.jsonl` as its attempt's leftover, as a run's
own deletes of a leftover do (`leftover_deleted`, `tasks.own_slice`), so the ledger bills
the node until it was deleted. A slice's labels carry its run id and a hash of its
storage root, not the root: the hooks find the run directory under the flow run's storage
root, the reaper under its `config`'s. A slice of a run under another root (a reaper
deployed with another config) is deleted all the same, and its attempt billed to its end
(`tasks.ledger`), short of the node's time after it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from infra.slices import PartialListError, build_provider
from tasks.own_slice import record_teardown_delete
from tasks.plan import MANAGED_BY, plan_run
from workloads.config import PipelineConfig

log = logging.getLogger(__name__)

TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "CRASHED"})


def _config_of(parameters: dict[str, Any]) -> PipelineConfig:
    raw = parameters.get("config")
    if isinstance(raw, PipelineConfig):
        return raw
    return PipelineConfig.model_validate(raw or {})


def provider_for(config: PipelineConfig):
    """The slice provider a run with `config` used."""
    return build_provider(config.slice.provider, plan_run(config).slices_root, config.slice)


class TeardownError(RuntimeError):
    """Some slices could not be deleted (the others were): each is named with its error.

    Attributes:
        failed: (slice name, error) of each slice left standing.
        reaped: (slice name, reason) of each slice deleted before and after them.
    """

    def __init__(
        self, failed: list[tuple[str, Exception]], reaped: list[tuple[str, str]] = ()
    ) -> None:
        names = "; ".join(f"{name}: {type(e).__name__}: {e}" for name, e in failed)
        super().__init__(f"{len(failed)} slice(s) could not be deleted ({names})")
        self.failed, self.reaped = failed, list(reaped)


def delete_flow_run_slices(flow, flow_run, state) -> None:
    """Flow hook: delete every slice labelled with this flow run's id (idempotent).

    Raises:
        TeardownError: some could not be deleted; every other one was.
    """
    config = _config_of(flow_run.parameters)
    provider = provider_for(config)
    run_id = str(flow_run.id)
    listed, failed = listed_slices(provider, {"flow-run-id": run_id})
    for status in listed:
        try:
            # Only this flow run's copy: another run's slice of the same name (a run name
            # under another storage root) can stand in another zone.
            where = same_labels(status.labels)
            deleted = provider.delete(status.name, where=where)
        except Exception as e:  # the next slice must still go: the error is raised below
            failed.append((status.name, e))
            continue
        log.warning("flow run %s is %s: deleted slice %s", flow_run.id, state.type, status.name)
        if deleted:
            record_teardown_delete(config, status, run_id)
    if failed:
        raise TeardownError(failed)


def same_labels(labels: dict[str, str]) -> Callable[[Mapping[str, str]], bool]:
    """The test of a copy being the listed one: the same labels (each create's own `ttl`,
    and on gcp its `launch`, tell two copies of one name apart)."""
    wanted = dict(labels)
    return lambda found: dict(found) == wanted


def listed_slices(provider, labels: dict[str, str]) -> tuple[list, list[tuple[str, Exception]]]:
    """The slices carrying `labels` that could be listed, and ("listing", error) if some
    zones could not be: the ones that could are still torn down, the error raised after."""
    try:
        return provider.list(labels), []
    except PartialListError as e:
        return e.found, [("listing", e)]


def orphan_reason(
    labels: dict[str, str], flow_run_state: str | None, now: float, owner_gone: bool | None
) -> str | None:
    """Why a managed slice should be reaped, or None to leave it alone.

    Args:
        labels: the slice's labels.
        flow_run_state: state type of the owning flow run ("RUNNING", "COMPLETED", …), or
            None if it has no owner label or the API does not know the run.
        now: epoch seconds.
        owner_gone: whether the creating process is gone; None if the provider cannot say.
    """
    ttl = labels.get("ttl")
    until = _epoch(ttl) if ttl else None
    if until is not None and until < now:
        return f"ttl {ttl} has passed"
    if flow_run_state in TERMINAL:
        return f"its flow run is {flow_run_state}"
    if owner_gone:
        return "the process that created it is gone"
    # A flow run this API does not know is not a finished one: it may live in another
    # Prefect API (a `tpupipe run` from a laptop or CI has its own temporary one). Reaping
    # those killed every such run's live slice; the ttl is their bound.
    return None


def _epoch(ttl: str) -> float | None:
    """A `ttl` label's epoch seconds; None for one that is no number (hand-set: "soon"),
    which failed the reaper on that slice before its flow run's state was looked at, so a
    FAILED run's slice labelled so was never reaped)."""
    try:
        value = float(ttl)
    except ValueError:
        log.warning("ttl label %r is not epoch seconds: ignored", ttl)
        return None
    return value if math.isfinite(value) else None


def reap(
    provider,
    flow_run_state: Callable[[str], str | None],
    now: float | None = None,
    on_reaped: Callable[[str, str], None] | None = None,
    on_deleted: Callable[[Any], object] | None = None,
) -> list[tuple[str, str]]:
    """Delete every orphaned slice of this project; returns (name, reason) pairs.

    A slice that cannot be looked at or deleted does not stop the others from being
    reaped: one slice the API refuses to delete would otherwise shield every slice listed
    after it, run after run of the reaper.

    Args:
        on_reaped: called with (name, reason) as each slice is deleted.
        on_deleted: called with the `SliceStatus` (labels) of each copy this call deleted
            (not one already gone), to record it in its run's ledger.

    Raises:
        TeardownError: some orphans could not be deleted; its `reaped` lists the others.
    """
    now = time.time() if now is None else now
    owner_gone = getattr(provider, "owner_gone", None)
    reaped = []
    listed, failed = listed_slices(provider, {"managed-by": MANAGED_BY})
    for status in listed:
        run_id = status.labels.get("flow-run-id")
        try:
            state = flow_run_state(run_id) if run_id else None
            reason = orphan_reason(
                status.labels, state, now, owner_gone(status.name) if owner_gone else None
            )
            # Only the copy judged: the name can stand in another zone too, another run's
            # slice (a run name under another storage root) whose owner lives.
            deleted = bool(reason) and provider.delete(
                status.name, where=same_labels(status.labels)
            )
            if deleted and on_deleted:
                on_deleted(status)
        except Exception as e:
            failed.append((status.name, e))
            continue
        if not reason:  # said, so a reaper run that deletes nothing shows what it saw
            log.info(
                "kept slice %s: not an orphan (flow run %s: %s; its ttl not past)",
                status.name,
                run_id or "unnamed",
                state or "state unknown",
            )
        else:
            reaped.append((status.name, reason))
            if on_reaped:
                on_reaped(status.name, reason)
    if failed:
        raise TeardownError(failed, reaped)
    return reaped
