"""The local slice: the real workload as its own process group over virtual CPU devices.

Each slice is recorded in `{registry_dir}/{name}.json` so other processes (the flow's
hooks, the reaper, a CLI) can see and delete it; the provider instance that created a
slice also keeps its `Popen`, which is the only way to learn the exit code.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import subprocess
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from infra.slices.base import (
    LabelTest,
    SliceError,
    SliceSpec,
    SliceState,
    SliceStatus,
    validate_name,
)
from infra.slices.chaos import ChaosMonkey
from infra.slices.gate import Gate
from infra.slices.held_signals import signals_held
from infra.slices.procs import (
    HostGroup,
    Owned,
    group_alive,
    is_our_group,
    kill_started,
    live_members,
    process_space,
    seen_from_elsewhere,
    signal_group,
    start_hosts,
    start_ticks,
    wait_gone,
)

# After SIGKILL the kernel needs moments, not seconds; longer means a stuck (D-state) process.
_KILL_WAIT_S = 10.0

log = logging.getLogger(__name__)


class LocalSliceProvider:
    """SliceProvider running each slice's command as a process group on this machine."""

    def __init__(self, registry_dir: str | os.PathLike[str]) -> None:
        """Use (and create) `registry_dir` as the registry of slices, one JSON file each."""
        self.registry_dir = Path(registry_dir)
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        self._owned: dict[str, Owned] = {}
        self._lock = threading.Lock()

    def create(self, spec: SliceSpec) -> SliceStatus:
        """Start `spec.command` as a new process group; READY once it is running.

        Raises:
            SliceError: devices do not split over the hosts, a live slice of that name
                exists, or the command cannot be started for good (no such program, an
                unwritable log).
            ProvisioningError: the command could not be started for want of processes or
                memory (EAGAIN, ENOMEM, EMFILE, ENFILE): worth retrying.
        """
        if spec.devices % spec.hosts:
            raise SliceError(
                f"slice {spec.name!r}: devices={spec.devices} cannot be split evenly over "
                f"hosts={spec.hosts}"
            )
        with self._registry_lock():
            old, old_proc = self._lookup(spec.name)
            if old is not None:
                if self._state(old, old_proc)[0] is SliceState.READY:
                    raise SliceError(
                        f"slice {spec.name!r} already exists and is running (pgid "
                        f"{old['pgid']}); delete it first"
                    )
                # Its leader exited, but children may linger in the group: finish them off.
                self._kill_group(spec.name, old, old_proc, grace_s=0.0)
            log_path = Path(spec.log_path)
            log_path.parent.mkdir(parents=True, exist_ok=True)
            monkey = None
            if spec.chaos:
                run_key = spec.labels.get("run-id", spec.name)
                monkey = ChaosMonkey(self.registry_dir, run_key, spec.chaos)
                monkey.before_create(spec.name)
            started: list[subprocess.Popen] = []
            # An unrecorded process is one nobody could find to delete: never leave one.
            # From the first fork to the record, the stop signals wait (see held_signals:
            # a pid can be lost between bytecodes), and any other error kills and reaps
            # every process started so far before it goes on.
            gate = Gate()  # the hosts run the command only once recorded
            with signals_held():
                try:
                    proc = start_hosts(spec, started, gate)
                    record = self._record(spec, proc, log_path)
                    self._write_record(record)
                    gate.open()
                except BaseException:
                    gate.close()
                    kill_started(started)
                    raise
                with self._lock:
                    self._owned[spec.name] = Owned(proc, record)
            if monkey is not None:
                monkey.attach(proc.pid, spec.run_dir)
        return SliceStatus(spec.name, SliceState.READY, None, dict(spec.labels))

    @staticmethod
    def _record(spec: SliceSpec, proc: HostGroup, log_path: Path) -> dict[str, Any]:
        """The registry record of slice `spec` whose hosts `proc` just started."""
        return {
            "name": spec.name,
            "pid": proc.pid,
            "pids": [p.pid for p in proc.procs],
            "pgid": proc.pid,  # host 0 leads the group: pgid == its pid
            "start_ticks": start_ticks(proc.pid),
            "labels": spec.labels,
            "devices": spec.devices,
            "hosts": spec.hosts,
            "command": spec.command,
            "created_at": datetime.now(UTC).isoformat(),
            # The reaper deletes a slice whose creating process is gone (a SIGKILLed
            # orchestrator) when no flow run state says otherwise.
            "owner_pid": os.getpid(),
            "owner_start_ticks": start_ticks(os.getpid()),
            "space": process_space(),  # where these pids mean these processes
            "log_path": str(log_path),
        }

    def status(self, name: str) -> SliceStatus:
        """READY while the group runs, TERMINATED after (exit code if we own it), else NOT_FOUND."""
        record, proc = self._lookup(validate_name(name))
        if record is None:
            return SliceStatus(name, SliceState.NOT_FOUND)
        state, code = self._state(record, proc)
        host = proc.cause_host() if proc is not None else None
        return SliceStatus(name, state, code, dict(record["labels"]), host=host)

    def delete(self, name: str, grace_s: float = 5.0, *, where: LabelTest | None = None) -> bool:
        """SIGTERM the group, SIGKILL it after `grace_s`, then drop the record.

        Args:
            name: the slice.
            grace_s: how long the workload may take to exit after SIGTERM.
            where: delete the slice only if its labels pass this test (None: whatever
                its labels).

        Returns:
            True if a slice was deleted, False if there was none or `where` refused it
            (never raises for that).

        Raises:
            SliceError: processes of the group survived SIGKILL (the record is kept, so a
                later delete or the reaper tries again).
        """
        record, proc = self._lookup(validate_name(name))
        if record is None or (where is not None and not where(dict(record["labels"]))):
            return False
        self._kill_group(name, record, proc, grace_s)
        with self._registry_lock():
            current = self._read_record(name)
            # Only our incarnation's record: someone may have re-created the name meanwhile.
            if current is not None and current.get("pid") == record["pid"]:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self._path(name))
        with self._lock:
            owned = self._owned.get(name)
            if owned is not None and owned.proc.pid == record["pid"]:
                del self._owned[name]
        return True

    def copies(self, name: str) -> list[SliceStatus]:
        """The slice's status in a list, or [] if there is none: one registry, one copy."""
        status = self.status(name)
        return [] if status.state is SliceState.NOT_FOUND else [status]

    def owner_gone(self, name: str) -> bool:
        """True if the process that created slice `name` no longer runs (it was killed
        without tearing down); False while it runs or when the slice is unknown."""
        record = self._read_record(validate_name(name))
        if record is None or "owner_pid" not in record:
            return False
        if (elsewhere := seen_from_elsewhere(record)) is not None:
            return elsewhere == "boot"  # another namespace's owner cannot be seen from here
        ticks = start_ticks(record["owner_pid"])
        return ticks is None or ticks != record.get("owner_start_ticks")

    def list(self, labels: dict[str, str] | None = None) -> list[SliceStatus]:
        """Statuses of the registered slices whose labels include every pair of `labels`."""
        with self._lock:
            names = set(self._owned)
        names.update(p.stem for p in self.registry_dir.glob("*.json"))
        out = []
        for name in sorted(names):
            try:
                status = self.status(name)
            except ValueError:  # a stray file whose name is not a slice name
                continue
            except OSError as exc:  # another user's record, mode 600 in a shared root
                # Skipped, not raised: one unreadable record had stopped the reaper and
                # every run's teardown hook from judging any other slice.
                log.warning("slice record %s cannot be read, skipped: %s", self._path(name), exc)
                continue
            wanted = (labels or {}).items()
            if status.state is not SliceState.NOT_FOUND and wanted <= status.labels.items():
                out.append(status)
        return out

    def placement(self) -> dict[str, Any]:
        """{}: one registry, the only place this provider's slices are."""
        return {}

    def recall(self, name: str, placements: list[dict[str, Any]]) -> list[str]:
        """Nothing to recall: every slice of this storage root is in its one registry."""
        return []

    # -- internals --------------------------------------------------------------------

    def _path(self, name: str) -> Path:
        return self.registry_dir / f"{name}.json"

    @contextlib.contextmanager
    def _registry_lock(self) -> Iterator[None]:
        # flock, not a threading lock: creators in other processes must serialise too.
        with open(self.registry_dir / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _read_record(self, name: str) -> dict[str, Any] | None:
        try:
            return json.loads(self._path(name).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def _write_record(self, record: dict[str, Any]) -> None:
        # Write-then-rename: a reader sees the old record or the new one, never half of one.
        tmp = self.registry_dir / f".{record['name']}.{uuid.uuid4().hex}.tmp"
        tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
        os.replace(tmp, self._path(record["name"]))

    def _lookup(self, name: str) -> tuple[dict[str, Any] | None, HostGroup | None]:
        """The slice's record and, if this instance started that incarnation, its Popen."""
        record = self._read_record(name)
        with self._lock:
            owned = self._owned.get(name)
            if owned is None:
                return record, None
            if record is not None and record.get("pid") != owned.proc.pid:
                owned.proc.poll()  # an older incarnation of ours: reap it and forget it
                if owned.proc.returncode is not None:
                    del self._owned[name]
                return record, None
            if record is None:
                if owned.proc.poll() is not None:
                    del self._owned[name]  # deleted elsewhere (or by hand) and exited
                    return None, None
                # Still running without a record: stay visible so teardown can kill it.
                return owned.record, owned.proc
            return record, owned.proc

    @staticmethod
    def _kill_group(
        name: str, record: dict[str, Any], proc: HostGroup | None, grace_s: float
    ) -> None:
        pgid = record["pgid"]
        if (elsewhere := seen_from_elsewhere(record)) == "boot":
            return  # the machine booted since: nothing of the group runs
        if elsewhere == "namespace":
            raise SliceError(
                f"slice {name!r} was created in another PID namespace (a container, or "
                "another host sharing this storage root): its processes cannot be seen or "
                "signalled from here; delete it from where it was created"
            )
        if not is_our_group(record):
            return  # the pid now belongs to someone else: our group ended long ago
        signal_group(pgid, signal.SIGTERM)
        # The workload may trap SIGTERM to save a checkpoint, or ignore it: SIGKILL follows.
        if not wait_gone(pgid, proc, grace_s):
            signal_group(pgid, signal.SIGKILL)
            if not wait_gone(pgid, proc, _KILL_WAIT_S):
                raise SliceError(
                    f"slice {name!r}: processes {live_members(pgid)} of group {pgid} "
                    f"survived SIGKILL for {_KILL_WAIT_S}s"
                )
        if proc is not None:
            proc.wait()  # the leader is our child: reap it so no zombie of ours remains

    @staticmethod
    def _state(record: dict[str, Any], proc: HostGroup | None) -> tuple[SliceState, int | None]:
        if proc is not None:
            code = proc.poll()
            return (SliceState.READY, None) if code is None else (SliceState.TERMINATED, code)
        if (elsewhere := seen_from_elsewhere(record)) is not None:
            # Another namespace's slice cannot be seen: taken as running, never as over.
            state = SliceState.READY if elsewhere == "namespace" else SliceState.TERMINATED
            return state, None
        alive = is_our_group(record) and group_alive(record["pgid"])
        return (SliceState.READY, None) if alive else (SliceState.TERMINATED, None)
