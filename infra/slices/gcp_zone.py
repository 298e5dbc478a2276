"""The Cloud TPU provider's calls into one zone at a time (the base of `GcpSliceProvider`
in infra/slices/gcp.py): creating a slice in a zone, on demand or as a spot request (a
queued resource), and waiting until it is READY; finding, listing and deleting a slice by
name, each zone's copy on its own (runs of one name under two storage roots can hold the
same node id in two zones at once).

The provider on top implements the SliceProvider protocol across the configured zones:
the zone order and fallback, the backoff between attempts, and the errors a user reads.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from google.api_core import exceptions as gexc
from google.cloud import tpu_v2

from infra.slices.base import LabelTest, ProvisioningError, SliceError, SliceState, SliceStatus
from infra.slices.gcp_api import CREATE_RETRY, call, spot_request, wait_op
from infra.slices.gcp_node import (
    QR_RECLAIMED,
    TpuSettings,
    protocol_state,
    request_labels,
    request_state,
)

log = logging.getLogger(__name__)

LAUNCH_LABEL = "launch"
_QR = tpu_v2.QueuedResourceState.State


class TpuZones:
    """One TpuClient's slices by name in the zones of `settings`: create, find, delete."""

    def __init__(
        self,
        tpu: tpu_v2.TpuClient,
        settings: TpuSettings,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Use this client (built once by the caller) and settings; clock and sleep for tests."""
        self.tpu, self.settings = tpu, settings
        self._clock, self._sleep = clock, sleep
        self._zone_of: dict[str, str] = {}  # where we last saw each slice: try it first
        # Zones outside `settings.zones` where earlier attempts may have created a slice
        # (a rerun with another zone): looked in and cleared, never created in.
        self._recalled: dict[str, tuple[str, ...]] = {}
        self._unanswered: set[str] = set()  # creates interrupted before their answer
        # The zone and launch id of each slice this provider created: its status reads that
        # copy only (another storage root's run can hold the name in another zone).
        self._launched: dict[str, tuple[str, str]] = {}

    # -- creation ----------------------------------------------------------------------

    def _create_in(self, zone: str, name: str, node: tpu_v2.Node, launch_id: str) -> SliceStatus:
        parent = self._parent(zone)
        self._zone_of[name] = zone
        self._launched[name] = (zone, launch_id)
        try:
            if self.settings.capacity == "spot":
                self._queue(parent, name, node)
            else:
                op = self._send_create(
                    name,
                    lambda: self.tpu.create_node(
                        parent=parent, node_id=name, node=node, retry=CREATE_RETRY
                    ),
                )
                self._wait_op(op)
        except gexc.Conflict:
            # Our own earlier create whose response was lost, or somebody else's slice.
            if self._launch_of(zone, name) != launch_id:
                raise SliceError(f"slice {name!r} already exists in {zone}") from None
            if self.settings.capacity == "spot":
                self._queue(parent, name, node, adopt=True)
        return self._wait_ready(zone, name)

    def _launch_of(self, zone: str, name: str) -> str | None:
        node = self._get_node(zone, name)
        if node is not None:
            return node.labels.get(LAUNCH_LABEL)
        found = self._find_queued(name, zones=[zone])
        return found[1].tpu.node_spec[0].node.labels.get(LAUNCH_LABEL) if found else None

    def _queue(self, parent: str, name: str, node: tpu_v2.Node, adopt: bool = False) -> None:
        """Queue a spot request valid for queue_timeout_s and wait until it is ACTIVE.

        With `adopt`, the request already exists (ours) and is only waited for.
        """
        timeout = self.settings.queue_timeout_s
        request = spot_request(parent, name, node, timeout)
        zone = parent.rsplit("/", 1)[-1]
        if not adopt:
            op = self._send_create(
                name,
                lambda: self.tpu.create_queued_resource(
                    parent=parent,
                    queued_resource_id=name,
                    queued_resource=request,
                    retry=CREATE_RETRY,
                ),
            )
            self._wait_op(op)
        qr_name = f"{parent}/queuedResources/{name}"
        deadline = self._clock() + timeout
        while True:
            try:
                qr = self._call(self.tpu.get_queued_resource, name=qr_name)
            except gexc.NotFound:
                raise ProvisioningError(f"spot request {name} was cancelled") from None
            state = qr.state.state
            if state == _QR.ACTIVE:
                return
            if state in (_QR.FAILED, *QR_RECLAIMED):
                error = qr.state.failed_data.error
                self._delete_in(zone, name)
                # A failed spot request means no capacity: let the zone loop go on.
                raise gexc.ResourceExhausted(
                    f"queued resource {name} {state.name}: {error.message or 'no capacity'}"
                )
            if self._clock() >= deadline:
                self._delete_in(zone, name)  # cancel: never leave a request waiting
                raise gexc.ResourceExhausted(
                    f"spot request {name} still {state.name} after {timeout:.0f}s"
                )
            self._sleep(self.settings.poll_s)

    def _send_create(self, name: str, send: Callable[[], Any]) -> Any:
        """`send()`, a create request for slice `name`. Interrupted before an answer (by
        a signal's exception, not an API error), `name` stays marked for `delete`."""
        self._unanswered.add(name)
        try:
            result = send()
        except Exception:
            self._unanswered.discard(name)  # answered: what it left is found by name
            raise
        self._unanswered.discard(name)
        return result

    def _wait_ready(self, zone: str, name: str) -> SliceStatus:
        deadline = self._clock() + self.settings.provision_timeout_s
        while True:
            node = self._get_node(zone, name)
            state = "NOT_FOUND" if node is None else protocol_state(node.state)
            if state == "READY":
                return SliceStatus(name, SliceState.READY, None, dict(node.labels))
            if state != "CREATING":
                self._delete_in(zone, name)
                raise ProvisioningError(f"slice {name!r} became {state} while being created")
            if self._clock() >= deadline:
                self._delete_in(zone, name)
                raise ProvisioningError(
                    f"slice {name!r} not READY after {self.settings.provision_timeout_s:.0f}s "
                    "(slice.provision_timeout_s); deleted"
                )
            self._sleep(self.settings.poll_s)

    def _delete_after_failed_create(self, zone: str, name: str) -> str:
        """Delete what a failed create may have left; "" or what the user must delete."""
        try:
            self._delete_in(zone, name)
        except (gexc.GoogleAPICallError, gexc.RetryError) as e:
            return f"; deleting what it may have left failed too (delete slice {name} by hand): {e}"
        return ""

    def _wait_op(self, op: Any) -> Any:
        return wait_op(op, self.settings.poll_s, self.settings.provision_timeout_s)

    # -- lookups and deletes -----------------------------------------------------------

    def _zones_for(self, name: str) -> Iterator[str]:
        first = self._zone_of.get(name)
        if first:
            yield first
        yield from (z for z in self.settings.zones if z != first)
        yield from (
            z for z in self._recalled.get(name, ()) if z != first and z not in self.settings.zones
        )

    def _find_node(self, name: str) -> tuple[str, tpu_v2.Node] | None:
        if name in self._launched:  # ours: only the copy we created, never another's
            zone, launch = self._launched[name]
            node = self._get_node(zone, name)
            mine = node is not None and node.labels.get(LAUNCH_LABEL) == launch
            return (zone, node) if mine else None
        for zone in self._zones_for(name):
            node = self._get_node(zone, name)
            if node is not None:
                self._zone_of[name] = zone
                return zone, node
        return None

    def _find_queued(
        self, name: str, zones: list[str] | None = None
    ) -> tuple[str, tpu_v2.QueuedResource] | None:
        if name in self._launched and zones is None:  # ours: as in `_find_node`
            zone, launch = self._launched[name]
            found = self._find_queued(name, [zone])
            mine = found is not None and request_labels(found[1]).get(LAUNCH_LABEL) == launch
            return found if mine else None
        for zone in zones or self._zones_for(name):
            try:
                qr = self._call(
                    self.tpu.get_queued_resource,
                    name=f"{self._parent(zone)}/queuedResources/{name}",
                )
            except gexc.NotFound:
                continue
            return zone, qr
        return None

    def _get_node(self, zone: str, name: str) -> tpu_v2.Node | None:
        try:
            return self._call(self.tpu.get_node, name=f"{self._parent(zone)}/nodes/{name}")
        except gexc.NotFound:
            return None

    def _copy_in(self, zone: str, name: str) -> SliceStatus | None:
        """Slice `name`'s copy in `zone` as `list` shows it: its node, else its spot request
        while it waits (or was reclaimed); None if neither. No exit record is read."""
        node = self._get_node(zone, name)
        if node is not None:
            state = SliceState(protocol_state(node.state))
            return SliceStatus(name, state, None, dict(node.labels))
        found = self._find_queued(name, zones=[zone])
        if found is None or (state := request_state(found[1])) is SliceState.NOT_FOUND:
            return None
        return SliceStatus(name, state, None, request_labels(found[1]))

    def _list_in(self, zone: str) -> list[SliceStatus]:
        """Every slice in `zone`: one status per name, its node's, else its request's."""
        found: dict[str, SliceStatus] = {}
        # Requests too, whatever the configured capacity: a waiting spot request from an
        # earlier config still holds a place in the queue and must be found to be cancelled.
        for qr in self._call(self.tpu.list_queued_resources, parent=self._parent(zone)):
            spec = qr.tpu.node_spec[0] if qr.tpu.node_spec else None
            state = request_state(qr)
            if spec and state is not SliceState.NOT_FOUND and qr.state.state != _QR.ACTIVE:
                found[spec.node_id] = SliceStatus(spec.node_id, state, None, request_labels(qr))
        for node in self._call(self.tpu.list_nodes, parent=self._parent(zone)):
            name = node.name.rsplit("/", 1)[-1]
            state = SliceState(protocol_state(node.state))
            found[name] = SliceStatus(name, state, None, dict(node.labels))
        return list(found.values())

    def _clear_for_create(self, name: str) -> None:
        """Delete what of slice `name` would block its create, each in its own zone: a
        PREEMPTED or TERMINATED node, a spot request that FAILED (expired) or was reclaimed.

        Raises:
            SliceError: a copy of the name is live (a READY or CREATING node, a waiting
                request) in any zone, this slice's or another run's: deleting the name
                everywhere took another run's live node in another zone with the dead one.
        """
        ended = []
        for zone in list(self._zones_for(name)):
            node = self._get_node(zone, name)
            if node is not None:
                state = protocol_state(node.state)
                if state in ("READY", "CREATING"):
                    raise SliceError(
                        f"slice {name!r} already exists in {zone} ({state}); delete it first"
                    )
                ended.append((zone, f"{state} slice"))
            elif (queued := self._find_queued(name, zones=[zone])) is not None:
                state = queued[1].state.state
                if request_state(queued[1]) is SliceState.CREATING:
                    raise SliceError(
                        f"slice {name!r} already exists in {zone} (spot request "
                        f"{state.name}); delete it first"
                    )
                # An ended spot request holds no TPU but keeps its name taken: one that
                # expired or was reclaimed while no orchestrator watched would refuse
                # every re-create.
                if state in (_QR.FAILED, *QR_RECLAIMED):
                    ended.append((zone, f"{state.name} spot request"))
        for zone, what in ended:
            log.info("deleting %s %s in %s before re-creating it", what, name, zone)
            self._delete_in(zone, name)

    def _delete_in(self, zone: str, name: str, where: LabelTest | None = None) -> bool:
        """Cancel the queued request (force: with its node) and delete the node in `zone`;
        with `where`, each only if its labels, read just before, pass that test."""
        parent, deleted = self._parent(zone), False
        qr_name, node_name = f"{parent}/queuedResources/{name}", f"{parent}/nodes/{name}"
        take_request = take_node = True
        if where is not None:
            node = self._get_node(zone, name)
            queued = self._find_queued(name, zones=[zone])
            take_node = node is not None and where(dict(node.labels))
            # An ACTIVE request and the node it made are one slice: taken together.
            take_request = queued is not None and (
                where(request_labels(queued[1]))
                or (take_node and queued[1].state.state == _QR.ACTIVE)
            )
        for method, kwargs, take in (
            (
                self.tpu.delete_queued_resource,
                {"request": {"name": qr_name, "force": True}},
                take_request,
            ),
            (self.tpu.delete_node, {"name": node_name}, take_node),
        ):
            if not take:
                continue
            try:
                op = self._call(method, **kwargs)
            except gexc.NotFound:
                continue
            deleted = True
            # Wait, so a create of the same name right after cannot meet this one.
            with contextlib.suppress(gexc.NotFound):
                self._wait_op(op)
        return deleted

    # -- plumbing ----------------------------------------------------------------------

    def _parent(self, zone: str) -> str:
        return f"projects/{self.settings.project}/locations/{zone}"

    _call = staticmethod(call)
