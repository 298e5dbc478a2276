"""Cloud TPU slices through `google-cloud-tpu` (tpu_v2): the production SliceProvider.

Designed from what goes wrong with hand-rolled TPU scripts:

- Leaked requests: a spot request is a queued resource with a `valid_until` bound, so the
  API drops it even if the orchestrator dies; `delete` and the reaper cancel it earlier.
- Preempted nodes left behind block the next create of the same name: `create` deletes
  a PREEMPTED/TERMINATED node of that name first, in its zone only (a live node of the
  name in another zone, another run's, refuses the create instead).
- Duplicates: the node id is the slice name, so the API itself refuses a second node; a
  create that is retried after a lost response finds its own node (by its launch label)
  and adopts it instead of failing or creating another.
- Quota and capacity errors (RESOURCE_EXHAUSTED) are retried with exponential backoff,
  then the next fallback zone is tried; permission errors fail at once and say which API
  and role are missing.

The workload's exit code does not exist in the TPU API (a node stays READY after its
program ends), so each worker's launcher leaves an exit record in GCS beside the slice log,
and `status` reports TERMINATED with that code once every worker has one.

This file is the protocol across zones. Its base `TpuZones` (gcp_zone.py; its lookups and
deletes in gcp_lookup.py) makes the calls into one zone; gcp_api.py holds the retry
policies and errors, gcp_node.py the Node.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

from google.api_core import exceptions as gexc
from google.api_core import retry as gretry
from google.cloud import tpu_v2

from infra.slices.base import (
    LabelTest,
    PartialListError,
    SliceError,
    SliceSpec,
    SliceState,
    SliceStatus,
    validate_labels,
    validate_name,
)
from infra.slices.gcp_api import (
    CREATE_AGAIN,
    CapacityError,
    TpuPermissionError,
    exit_status,
    permission_error,
)
from infra.slices.gcp_node import (
    TpuSettings,
    build_node,
    protocol_state,
    request_labels,
    request_state,
)
from infra.slices.gcp_zone import LAUNCH_LABEL, TpuZones

__all__ = ["CapacityError", "GcpSliceProvider", "TpuPermissionError"]

log = logging.getLogger(__name__)


class GcpSliceProvider(TpuZones):
    """SliceProvider on Cloud TPU VMs; one TpuClient and one storage Client, passed in."""

    def __init__(
        self,
        tpu: tpu_v2.TpuClient,
        storage: Any,
        settings: TpuSettings,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Use these clients (built once by the caller) and settings.

        Args:
            tpu: the TPU API client.
            storage: a `google.cloud.storage.Client`, to read the workers' exit records.
            settings: project, zones, accelerator, capacity and timeouts.
            clock, sleep: injectable for tests.
        """
        super().__init__(tpu, settings, clock, sleep)
        self.storage = storage

    # -- the SliceProvider protocol ----------------------------------------------------

    def create(self, spec: SliceSpec) -> SliceStatus:
        """Create the slice and wait until it is READY (its workers then start the workload).

        Raises:
            SliceError: a live slice of that name exists in any zone (an ended one is
                deleted first, in its zone only), or the spec cannot run on TPU.
            TpuPermissionError: the caller may not create TPUs (names the role to grant).
            CapacityError: quota or capacity ran out in every zone after the retries.
            ProvisioningError: the slice failed or timed out while being created.
        """
        with self._denied("create"):
            return self._create(spec)

    def _create(self, spec: SliceSpec) -> SliceStatus:
        self._clear_for_create(spec.name)
        launch_id = secrets.token_hex(4)
        labels = validate_labels(
            {
                **spec.labels,
                "ttl": str(int(self._clock() + self.settings.max_lifetime_s)),
                LAUNCH_LABEL: launch_id,
            }
        )
        node = build_node(spec, self.settings, labels, launch_id)
        last: Exception | None = None
        for zone in self.settings.zones:
            delays = gretry.exponential_sleep_generator(self.settings.backoff_s, 600.0, 2.0)
            for attempt in range(1, self.settings.provision_attempts + 1):
                try:
                    return self._create_in(zone, spec.name, node, launch_id)
                except CREATE_AGAIN as e:  # quota, capacity, or a transient failure
                    last = e
                    log.warning(
                        "slice %s in %s: create failed (attempt %d/%d): %s",
                        spec.name,
                        zone,
                        attempt,
                        self.settings.provision_attempts,
                        e,
                    )
                except gexc.Forbidden:
                    raise  # `_denied` names the API and the role to grant
                except gexc.GoogleAPICallError as e:
                    # Permanent (INVALID_ARGUMENT, FAILED_PRECONDITION, NOT_FOUND, …): no
                    # other attempt or zone would fare better. The API's own message names
                    # neither the slice nor the zone when it comes from the operation.
                    left = self._delete_after_failed_create(zone, spec.name)
                    raise SliceError(
                        f"slice {spec.name!r} ({self.settings.accelerator_type}, "
                        f"{self.settings.runtime_version}) in {zone}: the TPU API refused to "
                        f"create it: {e}{left}"
                    ) from e
                if attempt < self.settings.provision_attempts:
                    self._sleep(next(delays))
            # Nothing of ours may linger in a zone we give up on (a waiting spot request).
            self._delete_in(zone, spec.name)
        raise CapacityError(
            f"slice {spec.name!r} ({self.settings.accelerator_type}, {self.settings.capacity}): "
            f"no quota or capacity (or the create kept failing) in "
            f"{', '.join(self.settings.zones)} after {self.settings.provision_attempts} "
            f"attempts each; last error: {last}"
        )

    def status(self, name: str) -> SliceStatus:
        """The slice's state; TERMINATED with the workload's exit code once it has exited."""
        with self._denied("read"):
            return self._status(validate_name(name))

    def _status(self, name: str) -> SliceStatus:
        found = self._find_node(name)
        if found is None:
            waiting = self._find_queued(name)
            if waiting is not None:
                state = request_state(waiting[1])
                if state is not SliceState.NOT_FOUND:
                    return SliceStatus(name, state, None, request_labels(waiting[1]))
            return SliceStatus(name, SliceState.NOT_FOUND)
        _, node = found
        state, labels = SliceState(protocol_state(node.state)), dict(node.labels)
        if state is SliceState.READY:
            ended = exit_status(self.storage, node)
            if ended is not None:
                code, failure, host = ended
                return SliceStatus(name, SliceState.TERMINATED, code, labels, failure, host)
        return SliceStatus(name, state, None, labels)

    def delete(self, name: str, grace_s: float = 5.0, *, where: LabelTest | None = None) -> bool:
        """Cancel any queued request and delete the node, in every zone; NotFound is done.

        Args:
            name: the slice.
            grace_s: unused: deleting a TPU VM shuts its workers down, which sends the
                workload the same SIGTERM a preemption does.
            where: delete only the zones' copies whose labels pass this test, each read
                in its zone just before its delete (None: every copy). Runs of one name
                under two storage roots can hold the node id in two zones at once.

        Returns:
            True if something was deleted or cancelled, False if nothing (that `where`
            accepts) existed.

        Raises:
            SliceError: the API refused the delete in some zone (after its retries); every
                other zone was still cleared, so a zone in trouble cannot shield the slice
                that a fallback zone holds.
        """
        del grace_s
        validate_name(name)
        deleted, failed, denied = False, [], None
        with self._denied("delete"):
            for zone in list(self._zones_for(name)):
                try:
                    deleted = self._delete_in(zone, name, where) or deleted
                except gexc.Forbidden as e:  # raised once every other zone was cleared
                    denied = denied or gexc.Forbidden(f"in {zone}: {e.message}")
                except (gexc.GoogleAPICallError, gexc.RetryError) as e:
                    failed.append(f"{zone}: {e}")
            if denied is not None:
                raise denied  # `_denied` names the API and the role to grant
        if failed:
            raise SliceError(f"slice {name!r} could not be deleted in {'; '.join(failed)}")
        if not deleted and name in self._unanswered:
            return self._delete_late_create(name, where)
        return deleted

    def _delete_late_create(self, name: str, where: LabelTest | None) -> bool:
        """Watch for the slice of a create request interrupted before its answer, which
        the API may carry out after this process's delete found nothing (a SIGTERM or
        Ctrl-C in the middle of the request): delete it if it appears within
        `late_create_s`. Otherwise it would live until a reaper run past its ttl."""
        self._unanswered.discard(name)
        deadline = self._clock() + self.settings.late_create_s
        log.info("slice %s: its create was interrupted; watching for it to appear", name)
        while self._clock() < deadline:
            self._sleep(self.settings.poll_s)
            with self._denied("read"):
                if where is None:
                    landed = self._find_node(name) or self._find_queued(name)
                else:  # another run's copy of the name, in another zone, is not it
                    landed = any(where(c.labels) for c in self._copies(name))
            if landed:
                return self.delete(name, where=where)
        return False

    def copies(self, name: str) -> list[SliceStatus]:
        """Slice `name` in each zone holding it (its node, or its spot request while that
        waits), in the order zones are searched; exit records are not read."""
        with self._denied("read"):
            return self._copies(validate_name(name))

    def _copies(self, name: str) -> list[SliceStatus]:
        found = (self._copy_in(zone, name) for zone in list(self._zones_for(name)))
        return [status for status in found if status is not None]

    def placement(self) -> dict[str, Any]:
        """The project and the zones a create may use, in order."""
        return {"project": self.settings.project, "zones": list(self.settings.zones)}

    def recall(self, name: str, placements: list[dict[str, Any]]) -> list[str]:
        """Find and delete slice `name` in the zones of `placements` too (those of this
        project): a rerun with another `slice.zone` left the node an earlier attempt had
        created READY, and billed, until its ttl. Returns `project/zone` of the others."""
        zones, elsewhere = [], []
        for placement in placements:
            for zone in placement.get("zones") or ():
                if placement.get("project") == self.settings.project:
                    zones.append(zone)
                else:
                    elsewhere.append(f"{placement.get('project')}/{zone}")
        self._recalled[name] = tuple(dict.fromkeys(zones))
        return list(dict.fromkeys(elsewhere))

    def list(self, labels: dict[str, str] | None = None) -> list[SliceStatus]:
        """Slices (nodes, and spot requests still waiting) carrying every given label: one
        status per zone holding a name, so the reaper and the flow's hooks judge each copy
        (runs of one name under two storage roots can hold it in two zones)."""
        wanted = (labels or {}).items()
        found: list[SliceStatus] = []
        errors: list[tuple[str, Exception]] = []
        for zone in self.settings.zones:
            # Each zone on its own: one that refuses the list must not hide the slices of
            # the others from the reaper and the flow's hooks, which delete what they see.
            try:
                with self._denied("list"):
                    found.extend(self._list_in(zone))
            except (SliceError, gexc.GoogleAPICallError, gexc.RetryError) as e:
                errors.append((zone, e))
        # By name; a name's copies in the order of the zones.
        listed = [s for s in sorted(found, key=lambda s: s.name) if wanted <= s.labels.items()]
        if len(errors) == len(self.settings.zones):
            raise errors[0][1]  # nothing answered: the first zone's error says why
        if errors:
            failed = "; ".join(f"{zone}: {e}" for zone, e in errors)
            raise PartialListError(f"could not list slices in {failed}", listed)
        return listed

    # -- plumbing ----------------------------------------------------------------------

    @contextlib.contextmanager
    def _denied(self, what: str) -> Iterator[None]:
        """Turn a 403 into an error that names the API and the role to grant; no retry."""
        try:
            yield
        except gexc.Forbidden as e:  # PermissionDenied, or the API not enabled
            raise permission_error(what, self.settings, e) from None
