"""Processes of a local slice: host groups, liveness from /proc, signals and environment.

Process liveness is read from /proc where it exists: a killed process whose parent does
not reap it stays a zombie, `os.killpg(pgid, 0)` still succeeds on it, and a delete that
waited for that would hang. Containers whose PID 1 never reaps orphans make this common.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.slices.allocator import allocator_env
from infra.slices.base import ProvisioningError, SliceError, SliceSpec
from infra.slices.gate import Gate

_POLL_S = 0.02
_DEVICE_FLAG = "--xla_force_host_platform_device_count"

# Exit codes after which the other hosts are still finishing (a clean exit or a
# preemption save): the slice only ends once every host has exited.
_PREEMPTED = 75  # workloads.train.PREEMPTED_EXIT (infra does not import the workload)
_ORDERLY_EXITS = (0, _PREEMPTED)


def _cause_rank(code: int) -> int:
    """Which of several failed hosts' exit codes says why the slice ended: a kill from
    outside (SIGKILL, SIGTERM) first, then another signal (a crash, an abort), then a
    plain non-zero exit."""
    if code in (-signal.SIGKILL, -signal.SIGTERM):
        return 0
    return 1 if code < 0 else 2


class HostGroup:
    """The processes of a slice's hosts, seen as one Popen-like job led by host 0."""

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        self.procs = procs
        self.pid = procs[0].pid

    @property
    def returncode(self) -> int | None:
        codes = [p.returncode for p in self.procs]
        # A host that crashed leaves the others blocked in collectives: report it at once.
        failed = [c for c in codes if c is not None and c not in _ORDERLY_EXITS]
        if failed:
            # A host killed from outside (a lost host) is the cause when others failed with
            # it (their collectives broke, JAX aborted them): reported first, it is retried
            # as a preemption, where the others' codes would fail the run as a workload bug.
            # So is a host that stopped for a preemption notice the others never shared (a
            # SIGTERM to one host before the hosts connected: host 0 then timed out in its
            # first collective, exit 1, and the run failed with no retry).
            if _PREEMPTED in codes and min(map(_cause_rank, failed)) > 0:
                return _PREEMPTED
            return min(failed, key=_cause_rank)
        if any(c is None for c in codes):
            return None
        return next((c for c in codes if c != 0), 0)

    def cause_host(self) -> int | None:
        """Of several hosts, the first whose exit code is the group's (`returncode`), once
        it is one of a failure; None for one host, while running, or after a clean exit."""
        code = self.returncode
        if len(self.procs) < 2 or code in (None, 0):
            return None
        return next((i for i, p in enumerate(self.procs) if p.returncode == code), None)

    def poll(self) -> int | None:
        for p in self.procs:
            p.poll()
        return self.returncode

    def wait(self) -> int | None:
        for p in self.procs:
            p.wait()
        return self.returncode


@dataclass
class Owned:
    proc: HostGroup
    record: dict[str, Any]


def proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/{pid}/stat from field 3 (state) on; None if absent or unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses; it ends at the last ')'.
    return raw.rpartition(")")[2].split()


def start_ticks(pid: int) -> str | None:
    """Boot-relative start time of `pid`, which tells a process from a later one reusing its id."""
    fields = proc_stat(pid)
    return fields[19] if fields and len(fields) > 19 else None


def live_members(pgid: int) -> list[int] | None:
    """Pids of the non-zombie processes in process group `pgid`.

    Args:
        pgid: process group id.

    Returns:
        The pids (empty when the group is gone or only zombies remain), or None when /proc
        is not available and the caller must fall back to `os.killpg(pgid, 0)`.
    """
    if not os.path.isdir("/proc/self"):
        return None
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = proc_stat(int(entry))
            if fields and len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in "ZX":
                members.append(int(entry))
    return members


def group_alive(pgid: int) -> bool:
    members = live_members(pgid)
    if members is not None:
        return bool(members)
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or another user's reused id
        return False
    return True


@functools.cache  # read once: asked on every status read, and fixed for the process
def process_space() -> str:
    """This machine's boot and this process's PID namespace, '<boot id>/<pid ns>': where a
    record's pids name the processes they named when it was written ('' parts unknown)."""
    boot = ns = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    with contextlib.suppress(OSError):
        ns = os.readlink("/proc/self/ns/pid")
    return f"{boot}/{ns}"


def seen_from_elsewhere(record: dict[str, Any]) -> str | None:
    """None if the record's pids can be read from here; "boot" if the machine has booted
    since it was written (none of its processes runs), "namespace" if it was written in
    another PID namespace (a container, another host sharing the root): its pids name
    other processes here, or none. Read from such a namespace, a live slice looked gone
    and the reaper dropped its record, signalling whatever held its pgid here (probe Q)."""
    theirs, ours = record.get("space"), process_space()
    if not theirs or theirs == ours:
        return None
    return "boot" if theirs.split("/")[0] != ours.split("/")[0] else "namespace"


def is_our_group(record: dict[str, Any]) -> bool:
    """False if the leader's pid now belongs to a different process (so our group ended).

    POSIX never reuses a pid while a process group of that id has members, so when no
    process holds the leader's pid, any members left are still ours.
    """
    recorded, current = record.get("start_ticks"), start_ticks(record["pgid"])
    return recorded is None or current is None or recorded == current


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Send `sig` to process group `pgid`, gone or not.

    Raises:
        PermissionError: the group is another user's (a teammate's slice in a shared
            storage root), naming that user: the bare "Operation not permitted" left the
            reaper's and a rerun's user guessing why the slice would not go.
    """
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    except PermissionError as exc:
        try:
            owner = pwd.getpwuid(os.stat(f"/proc/{pgid}").st_uid).pw_name
        except (OSError, KeyError):
            owner = "another user"
        raise PermissionError(
            exc.errno,
            f"cannot signal process group {pgid}, {owner}'s: only {owner} or root can stop "
            "that slice",
        ) from None


def wait_gone(pgid: int, proc: HostGroup | None, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None:
            proc.poll()  # reap our child, or it lingers as a zombie of this process
        if not group_alive(pgid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def host_log_path(log_path: str, host: int) -> Path:
    """Host 0 logs to `log_path`; host i to `<stem>-host<i><suffix>` beside it."""
    path = Path(log_path)
    return path if host == 0 else path.with_name(f"{path.stem}-host{host}{path.suffix}")


def workload_env(spec: SliceSpec, host: int = 0, coordinator: str | None = None) -> dict[str, str]:
    """The environment of the workload process for `host` of the slice.

    Args:
        spec: the slice spec; its env overrides this process's environment.
        host: host index: one process per host, each with devices/hosts virtual devices.
        coordinator: `host:port` of the JAX coordinator (host 0) when hosts > 1.

    Returns:
        os.environ + spec.env, with the virtual device count merged into XLA_FLAGS (any
        earlier device-count flag replaced, other flags kept), JAX_PLATFORMS=cpu, the
        allocator of `infra.slices.allocator` (TCMalloc when installed), and for
        several hosts TPUPIPE_COORDINATOR_ADDRESS, TPUPIPE_NUM_PROCESSES and
        TPUPIPE_PROCESS_ID, which the workload passes to `jax.distributed.initialize`.
    """
    env = allocator_env({**os.environ, **spec.env})
    if spec.hosts > 1:
        env["TPUPIPE_COORDINATOR_ADDRESS"] = coordinator or f"127.0.0.1:{free_port()}"
        env["TPUPIPE_NUM_PROCESSES"] = str(spec.hosts)
        env["TPUPIPE_PROCESS_ID"] = str(host)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_FLAG)]
    flags.append(f"{_DEVICE_FLAG}={spec.devices // spec.hosts}")
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    return env


# The line each host's log gets before its workload starts: a re-provisioned attempt
# appends to the log of the one before, and what the log says of a failure must be this
# attempt's (`tasks.slice_log`).
LOG_START = "--- tpupipe: workload started on slice"

# Why a host could not be started that may pass by the next try.
_TRANSIENT_START_ERRORS = frozenset({errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE})


def start_hosts(spec: SliceSpec, started: list[subprocess.Popen], gate: Gate) -> HostGroup:
    """One process per host, all in one new process group so a delete kills them all,
    each waiting behind `gate` until the caller has recorded them (`infra.slices.gate`).

    Each process is appended to `started` as soon as it runs, for the caller to kill
    if the slice cannot be recorded.
    """
    coordinator = f"127.0.0.1:{free_port()}" if spec.hosts > 1 else None
    try:
        _runnable(spec.command[0], workload_env(spec, 0, None).get("PATH"))
        for host in range(spec.hosts):
            command, stdin = gate.gated(spec.command)
            try:
                _start_host(spec, host, command, stdin, started, coordinator)
            finally:
                os.close(stdin)  # the host holds its own copy
    except OSError as e:
        # Out of processes or memory may pass: retried like a create without capacity.
        # A missing program or an unwritable log stays so: retrying it only made the
        # run wait out resilience.max_failures backoffs before failing the same way.
        kind = ProvisioningError if e.errno in _TRANSIENT_START_ERRORS else SliceError
        raise kind(f"slice {spec.name!r}: cannot start {spec.command[0]!r}: {e}") from e
    return HostGroup(list(started))


def _runnable(program: str, path: str | None) -> None:
    """Raise the OSError exec would for `program`, as Popen raised it before the gate: the
    gate's shell finds a missing program only once let through (exit 127), and a run
    should fail at once on it, not be retried. (A script whose interpreter is missing is
    still found out only then.)"""
    if shutil.which(program, path=path) is not None:
        return
    code = errno.EACCES if os.sep in program and os.path.exists(program) else errno.ENOENT
    raise OSError(code, os.strerror(code), program)


def _start_host(
    spec: SliceSpec,
    host: int,
    command: list[str],
    stdin: int,
    started: list[subprocess.Popen],
    coordinator: str | None,
) -> None:
    # Append: a re-provisioned attempt keeps the log of the one before it.
    with open(host_log_path(spec.log_path, host), "ab") as log:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        # After a newline: the last attempt's log may end mid-line (killed).
        log.write(f"\n{LOG_START} {spec.name}, host {host}, {stamp} ---\n".encode())
        log.flush()  # before the workload's own writes to the same file
        started.append(
            subprocess.Popen(
                command,
                # Host 0 leads a new process group and the others join it (a group in
                # another session could not be joined).
                process_group=started[0].pid if started else 0,
                stdin=stdin,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=workload_env(spec, host, coordinator),
            )
        )


def kill_started(procs: list[subprocess.Popen]) -> None:
    """SIGKILL the hosts of a slice that could not be recorded, and reap them."""
    if procs:
        signal_group(procs[0].pid, signal.SIGKILL)  # with anything they started
    for p in procs:
        p.kill()  # each by pid too: a host not yet in the group, or a group never made
        p.wait()
