"""The Cloud TPU provider's calls into one zone at a time (the base of `GcpSliceProvider`
in infra/slices/gcp.py): creating a slice in a zone, on demand or as a spot request (a
queued resource), and waiting until it is READY; finding, listing and deleting a slice by
name, each zone's copy on its own, are in infra/slices/gcp_lookup.py.

The provider on top implements the SliceProvider protocol across the configured zones:
the zone order and fallback, the backoff between attempts, and the errors a user reads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from google.api_core import exceptions as gexc
from google.cloud import tpu_v2

from infra.slices.base import ProvisioningError, SliceError, SliceState, SliceStatus
from infra.slices.gcp_api import CREATE_RETRY, spot_request
from infra.slices.gcp_lookup import LAUNCH_LABEL, TpuLookups
from infra.slices.gcp_node import (
    QR_RECLAIMED,
    TpuSettings,
    protocol_state,
)

log = logging.getLogger(__name__)

_QR = tpu_v2.QueuedResourceState.State


class TpuZones(TpuLookups):
    """One TpuClient's slices by name in the zones of `settings`: create, find, delete
    (finding and deleting in `TpuLookups`)."""

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
