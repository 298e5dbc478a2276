"""How the workload's processes join the slice's other hosts, and hear a preemption notice
(SIGTERM) together. Used by `workloads.train`, which re-exports both."""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from typing import Any

import jax
from jax.experimental import multihost_utils

from workloads.events import EventLog
from workloads.rundir import RunDir


class PreemptionNotice:
    """Set by SIGTERM; the loop saves at the next step boundary and exits.

    Alone, a process decides by itself. With several hosts every host must save the same
    step (a checkpoint save is collective), so once `jax.distributed` has started, JAX's
    preemption service owns SIGTERM (it replaces our handler) and agrees with the other
    hosts on the step to stop at: one past the furthest step any host has reported once
    the notice has reached them all. That takes the service about a second (with tiny
    steps of 0.15 s on 2 local hosts, a notice at step N stopped them at N+4 to N+8),
    spent from the preemption's grace period; the step it stops at is saved, so no step
    is lost.
    """

    def __init__(self) -> None:
        self.received = False
        self.across_hosts = False

    def install(self) -> None:
        """Route SIGTERM to this flag instead of killing the process mid-step."""
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = True

    def stop_at(self, taken: int) -> bool:
        """True once this attempt has taken `taken` steps and must now save and exit.

        Called after every step, with the count of this attempt's steps rather than the
        global step: the service stops one past the last count it was told, which is 0
        (so: after the first step) for a notice that lands during start-up.
        """
        if self.across_hosts:
            return multihost_utils.reached_preemption_sync_point(taken)
        return self.received


def init_distributed(env: Mapping[str, str] = os.environ) -> bool:
    """Join the slice's other hosts, if there are any; True if `jax.distributed` started.

    The local provider passes the coordinator explicitly (CPU collectives over gloo); on a
    Cloud TPU slice `TPUPIPE_DISTRIBUTED=auto` lets JAX discover its peers itself.
    """
    processes = int(env.get("TPUPIPE_NUM_PROCESSES", "1"))
    if processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=env["TPUPIPE_COORDINATOR_ADDRESS"],
            num_processes=processes,
            process_id=int(env["TPUPIPE_PROCESS_ID"]),
        )
        return True
    if env.get("TPUPIPE_DISTRIBUTED") == "auto":
        jax.distributed.initialize()
        return True
    return False


def host_index(across_hosts: bool, env: Mapping[str, str] = os.environ) -> int:
    """This process's host in the slice: JAX's once `jax.distributed` started, else the
    local provider's `TPUPIPE_PROCESS_ID` (a host whose start-up failed is still not host
    0), else 0."""
    return jax.process_index() if across_hosts else int(env.get("TPUPIPE_PROCESS_ID", "0"))


def record_failure(run_dir: str, error: str, host: int) -> None:
    """Record why training stopped on `host`: host 0, which writes every report, in the
    heartbeat (phase "failed") and a `failed` event; another host only in its own
    `status-host<i>.json`, which the orchestrator quotes if the attempt failed.

    Why not every host in the heartbeat: when a host is killed (a preemption), the
    survivors' collectives fail, and a survivor's "failed" heartbeat and event said a lost
    host was a failed workload; the orchestrator reads the hosts' exit codes, the kill
    first, and calls that a preemption.

    Raises:
        LeaseLost: a newer attempt owns the run directory (nothing was written).
    """
    events = EventLog.from_env(run_dir)
    events.check_lease()
    if host == 0:
        RunDir(run_dir).write_status("failed", error=error, attempt=events.attempt)
        events.emit("failed", error=error)
    else:
        RunDir(run_dir).write_host_failure(host, error, attempt=events.attempt)
