"""Finding, listing and deleting a Cloud TPU slice by name, each zone's copy on its own
(the lookup half of `infra.slices.gcp_zone.TpuZones`): runs of one name under two storage
roots can hold the same node id in two zones at once, and a provider reads, as its slice,
only the copy it created.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from google.api_core import exceptions as gexc
from google.cloud import tpu_v2

from infra.slices.base import LabelTest, SliceError, SliceState, SliceStatus
from infra.slices.gcp_api import call, wait_op
from infra.slices.gcp_node import (
    QR_RECLAIMED,
    TpuSettings,
    protocol_state,
    request_labels,
    request_state,
)

log = logging.getLogger("infra.slices.gcp_zone")  # the logger these lines had before

LAUNCH_LABEL = "launch"
_QR = tpu_v2.QueuedResourceState.State


class TpuLookups:
    """The lookups and deletes of `TpuZones`, which sets the state they read: `tpu`,
    `settings`, `_zone_of`, `_launched` and `_recalled`."""

    tpu: tpu_v2.TpuClient
    settings: TpuSettings
    _zone_of: dict[str, str]
    _launched: dict[str, tuple[str, str]]
    _recalled: dict[str, tuple[str, ...]]

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

    def _parent(self, zone: str) -> str:
        return f"projects/{self.settings.project}/locations/{zone}"

    def _wait_op(self, op: Any) -> Any:
        return wait_op(op, self.settings.poll_s, self.settings.provision_timeout_s)

    _call = staticmethod(call)
