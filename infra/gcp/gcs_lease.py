"""A lock held in Cloud Storage by renewing it: one orchestrator per `gs://` run across
machines.

A file lock guards the orchestrators of one machine only. Two machines running one
`gs://` run (a Prefect worker on each, a scheduled run and a manual one from the UI) share
its slice name, and every attempt deletes a slice of its name before creating one: the
second machine deleted the first one's live slice.

The lock is an object created only if absent (`ifGenerationMatch=0`), so exactly one
creator wins. Its holder rewrites it every `renew_every_s` seconds, each time only if it is
still the generation it wrote, so a lock taken over is never written back. A holder that
dies stops renewing: once the object is older than `ttl_s` (by Cloud Storage's own `updated`
time) it is stale, and the next taker replaces it, again only if it is the generation it
judged stale. A holder on this very machine whose process is gone is stale at once, so the
rerun of a killed orchestrator does not wait `ttl_s`. "This very machine" is this boot of
this kernel in this process namespace (`this_machine`), not the hostname: containers
given one `--hostname`, and VMs cloned from one image, share theirs, and a live holder on
another such machine was taken over at once (its pid is no process here).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from google.api_core import exceptions as gexc

from infra.gcp.gcs import split_uri
from infra.slices.procs import start_ticks

log = logging.getLogger(__name__)

TTL_S = 120.0  # a lock not renewed for this long is stale: its holder died or is cut off
RENEW_EVERY_S = 20.0  # six renewals per TTL: a few failed ones do not lose the lock


class LeaseHeld(RuntimeError):
    """Another live holder has the lock; `holder` is what it recorded, `age_s` how long
    since it last renewed it."""

    def __init__(self, uri: str, holder: dict, age_s: float, ttl_s: float):
        self.uri, self.holder, self.age_s, self.ttl_s = uri, holder, age_s, ttl_s
        super().__init__(f"{uri} is held by {describe(holder)} (renewed {age_s:.0f} s ago)")


class LeaseError(OSError):
    """The lock object could not be read or written (names it and why)."""


def describe(holder: dict) -> str:
    """`pid P on H since S, flow run F` from a holder record, or what is known of it."""
    if not isinstance(holder, dict) or "pid" not in holder or "host" not in holder:
        return "an unknown holder"
    text = f"pid {holder['pid']} on {holder['host']} since {holder.get('since', '?')}"
    return f"{text}, flow run {holder['flow_run_id']}" if holder.get("flow_run_id") else text


class GcsLease:
    """The lock object `uri`, held between `acquire` and `release` by a renewing thread.

    Args:
        client: A `google.cloud.storage.Client`.
        uri: `gs://bucket/path` of the lock object.
        owner: What the object records of its holder (`pid`, `host`, `since`, ...).
        ttl_s, renew_every_s: staleness and renewal periods (see the module docstring).
        clock: wall clock compared with the object's `updated` time (injectable).
    """

    def __init__(
        self,
        client: Any,
        uri: str,
        owner: dict,
        ttl_s: float = TTL_S,
        renew_every_s: float = RENEW_EVERY_S,
        clock: Callable[[], float] = time.time,
    ):
        # The token tells our own write from another holder's when a retried request was
        # answered 412 although its first try had succeeded.
        self.owner = {**self.record(owner), "token": secrets.token_hex(8)}
        self._body = json.dumps(self.owner)  # what every write of ours puts in the object
        self.uri, self.ttl_s, self.renew_every_s = uri, ttl_s, renew_every_s
        self._clock = clock
        bucket, name = split_uri(uri)
        self._bucket = client.bucket(bucket)
        self._name = name
        self.generation: int | None = None
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def record(owner: dict) -> dict:
        """What the lock object records of holder `owner`: for one on this host (by name)
        with a pid, also its machine (`this_machine`) and its process's start, which tell
        it gone at once."""
        if not isinstance(owner.get("pid"), int) or owner.get("host") != socket.gethostname():
            return dict(owner)
        return {**owner, "machine": this_machine(), "started": start_ticks(owner["pid"])}

    def acquire(self) -> None:
        """Create the lock, or replace a stale one; then renew it in the background.

        Raises:
            LeaseHeld: a live holder has it.
            LeaseError: Cloud Storage refused or failed a request (after its retries).
        """
        for _ in range(5):  # each turn loses only to another taker's write: never for long
            try:
                self.generation = self._write(0)
                break
            except gexc.PreconditionFailed:
                current = self._call("read", lambda: self._bucket.get_blob(self._name))
                if current is None:
                    continue  # released between our create and our read
                holder = _holder(current)
                if holder.get("token") == self.owner["token"]:
                    self.generation = current.generation  # our create, answered twice
                    break
                age = self._clock() - current.updated.timestamp()
                if age <= self.ttl_s and not _gone_from_this_host(holder):
                    raise LeaseHeld(self.uri, holder, age, self.ttl_s) from None
                try:
                    self.generation = self._write(current.generation)
                except gexc.PreconditionFailed:
                    continue  # another taker was first: look again
                log.warning(
                    "took over the lock %s from %s, %s",
                    self.uri,
                    describe(holder),
                    "whose process is gone" if age <= self.ttl_s else f"stale for {age:.0f} s",
                )
                break
        else:
            raise LeaseError(f"{self.uri}: the lock changed hands on every attempt to take it")
        self._thread = threading.Thread(target=self._renew_loop, name="gcs-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop renewing and delete the lock if it is still ours (never raises: a lock left
        behind is stale after `ttl_s`, and at once for a rerun on this host)."""
        self._stop.set()
        if self._thread is not None:
            # A renewal stuck in Cloud Storage's retries must not hold up the run's end; one
            # that lands after the delete below finds the lock gone and writes nothing.
            self._thread.join(timeout=10)
        if self.generation is None or self.lost:
            return
        try:
            current = self._bucket.get_blob(self._name)
            if current is not None and current.generation == self.generation:
                current.delete(if_generation_match=self.generation)
        except (gexc.GoogleAPIError, OSError) as exc:
            log.warning("could not delete the lock %s: %s", self.uri, exc)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.renew_every_s):
            try:
                self.generation = self._write(self.generation)
            except gexc.PreconditionFailed:
                if self._stop.is_set():
                    return  # released meanwhile: the lock is gone, not taken
                holder, generation = self._peek()
                if holder.get("token") == self.owner["token"]:
                    self.generation = generation  # our renewal, answered twice
                    continue
                self.lost = True
                log.error(
                    "lost the lock %s to %s: this orchestrator was cut off from Cloud Storage "
                    "for over %.0f s; the run's lease stops this attempt's workload",
                    self.uri,
                    describe(holder),
                    self.ttl_s,
                )
                return
            except (LeaseError, gexc.GoogleAPIError, OSError) as exc:  # tried again next turn
                log.warning("could not renew the lock %s: %s", self.uri, exc)

    def _write(self, if_generation_match: int) -> int:
        blob = self._bucket.blob(self._name)
        self._call(
            "write",
            lambda: blob.upload_from_string(
                self._body, content_type="application/json", if_generation_match=if_generation_match
            ),
        )
        return blob.generation

    def _peek(self) -> tuple[dict, int | None]:
        try:
            current = self._bucket.get_blob(self._name)
        except (gexc.GoogleAPIError, OSError):
            return {}, None
        return (_holder(current), current.generation) if current is not None else ({}, None)

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except gexc.PreconditionFailed:
            raise
        except (gexc.GoogleAPIError, OSError) as exc:
            raise LeaseError(f"could not {what} the lock {self.uri}: {exc}") from exc


def _holder(blob: Any) -> dict:
    try:
        holder = json.loads(blob.download_as_bytes())
    except (gexc.GoogleAPIError, OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def this_machine() -> str | None:
    """This boot of this kernel (its random boot id) and this process namespace: where a
    pid names one process. None where /proc does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    return f"{boot}/{namespace}"


def _gone_from_this_host(holder: dict) -> bool:
    """The holder ran on this machine (`this_machine`) and its process no longer exists
    (or its pid is another process's now). A record without a machine (an older version's)
    is never judged so: it is stale only after the TTL."""
    pid, mine = holder.get("pid"), this_machine()
    if mine is None or holder.get("machine") != mine or not isinstance(pid, int):
        return False
    if not 0 < pid < 2**22:  # no pid (Linux's pid_max): not a record a holder wrote
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, another user's
    started = holder.get("started")
    return started is not None and start_ticks(pid) != started
