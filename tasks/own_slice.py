"""Which copies of a run's slice name are the run's own, and deleting only those.

Runs of one run name under two storage roots (two buckets' `nightly`) share the slice
name, and with fallback zones each can hold it in another zone at once. The `run-root`
label tells them apart: a run deletes only its own copies, and refuses to create its
slice while another root's copy holds the name anywhere.
"""

from __future__ import annotations

import logging

from infra.slices.base import LabelTest
from tasks.plan import ROOT_LABEL, RunPlan, root_tag

log = logging.getLogger(__name__)


class SliceNameTaken(RuntimeError):
    """The run's slice name is held by a slice of a run of the same name under another
    storage root (same project, in one of the zones this run looks in, another bucket):
    neither run may delete the other's."""


def own_copy(plan: RunPlan) -> LabelTest:
    """The test of a copy of the run's slice name being this run's: its `run-root` label
    is this storage root's, or it has none (labelled before the label existed)."""
    ours = root_tag(plan)
    return lambda labels: labels.get(ROOT_LABEL) in (None, ours)


def foreign_slice(provider, plan: RunPlan) -> str | None:
    """What holds the run's slice name, when a run under another storage root does in any
    place (zone); None when every copy is this run's or there is none. A copy labelled
    before the `run-root` label existed is taken as this run's, as it was before; so are
    copies that cannot be read, as the delete that follows goes on as it did before (it
    still deletes only the copies it reads as this run's)."""
    try:
        copies = provider.copies(plan.slice_name)
    except Exception as exc:  # see the docstring
        log.warning("slice %s: could not read its labels: %s", plan.slice_name, exc)
        return None
    ours = own_copy(plan)
    theirs = next((c for c in copies if not ours(c.labels)), None)
    if theirs is None:
        return None
    return (
        f"slice {plan.slice_name!r} ({theirs.state.value}) belongs to a run of the same name "
        f"under another storage root (its label {ROOT_LABEL}={theirs.labels[ROOT_LABEL]}; "
        f"this run's root {plan.storage_root} is {ROOT_LABEL}={root_tag(plan)})"
    )


def delete_own_slice(provider, plan: RunPlan, logger) -> bool | None:
    """Delete the run's copies of its slice name, in every zone: True if something was
    deleted, False if nothing was there. A copy a run under another storage root holds
    is logged and left standing; None when it was and nothing of this run's was deleted.

    Args:
        provider: the run's slice provider.
        plan: the run.
        logger: receives the warning naming the copy left standing.
    """
    other = foreign_slice(provider, plan)
    if other is not None:
        logger.warning("%s: left standing", other)
    # Only this run's copies, wherever they are: another root's copy of the name stays.
    deleted = provider.delete(plan.slice_name, where=own_copy(plan))
    return deleted if other is None else (deleted or None)
