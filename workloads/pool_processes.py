"""How a sharding pool's processes start and end (`workloads.shard_pool`): what the
forkserver preloads, the signals multiprocessing's helper processes are shielded from, and
the workers' initializer, which ends a worker with the process that started its pool.
"""

from __future__ import annotations

import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import select
import signal
import sys
import threading
import time

# What every worker imports to run a job, and what a caller's main module most often
# imports at its top (the `tpupipe` script: flows.cli, whose cost is workloads.config).
PRELOAD = ("workloads.data", "workloads.shard_pool")


def forkserver_preload(main: object | None = None) -> list[str]:
    """The modules the forkserver imports once, so that the workers forked from it start
    with them: `PRELOAD`, and the module the caller runs as `python -m NAME`.

    Why the main module: multiprocessing runs it again in every worker before its first
    job (workers could unpickle functions defined there), so every module it imports at
    its top is imported again per worker, per pool. Prefect deployments run flows as
    `python -m prefect.engine`: its import took 0.84 s here, and no sharding worker ever
    got a job in a run shorter than that (a probe of 200 jobs of 2.5 ms: none before,
    half of them now, the first after 17-20 ms). Imported once in the forkserver, the
    workers' run of it finds its imports done. A script's path cannot be preloaded
    (Python 3.11's forkserver is never handed it, though `"__main__"` asks for it), hence
    `PRELOAD` for the `tpupipe` script's imports (flows.cli: 0.16 s, 0.02 s after it).

    Args:
        main: The `__main__` module (default: this process's).
    """
    main = sys.modules.get("__main__") if main is None else main
    name = getattr(getattr(main, "__spec__", None), "name", None)
    # Workers skip a package's `__main__` (`python -m pkg`), as multiprocessing does.
    if name and name != "__main__" and not name.endswith(".__main__"):
        return [*PRELOAD, name]
    return list(PRELOAD)


# What a terminal (Ctrl-C, its closing), systemd or `timeout` send the whole process group.
SHIELDED = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})


def start_helpers() -> None:
    """Start multiprocessing's helper processes, the forkserver and the resource tracker
    (which unlinks the pool's named semaphores if this process dies), with `SHIELDED`
    signals blocked, so that they keep them blocked for life.

    A signal to the group is this process's to handle: it stops the pool and exits
    (`flows.local_run`), and the helpers exit once it has (their pipes close). Left to the
    signal, the tracker (which ignores SIGINT and SIGTERM only) died of SIGHUP, and the
    exit's clean-up relaunched it: "resource_tracker: process died unexpectedly ... Some
    resources might leak" and a `KeyError: '/mp-...'` traceback per semaphore. The
    forkserver died of SIGHUP and SIGTERM (and of Ctrl-C while importing its preload):
    a worker it was starting failed with an `EOFError` traceback. Started already (an
    earlier pool in this process), they are left as they are.
    """
    # One at a time: the tracker's start unblocks SIGINT and SIGTERM again after its spawn,
    # and the forkserver's start begins with the tracker's (then running: a no-op).
    for start in (
        multiprocessing.resource_tracker.ensure_running,
        multiprocessing.forkserver.ensure_running,
    ):
        before = signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED)
        try:
            start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)  # one sent meanwhile lands now


def init_worker(parent: int) -> None:
    """Sharding workers' initializer: leave Ctrl-C to the process that started the pool
    (pid `parent`), exit with it, and keep freed memory for reuse (`keep_freed_memory`).

    Ctrl-C reaches the whole process group, and the run stops by killing its workers: a
    worker left to it printed a KeyboardInterrupt traceback when it was waiting for a job.
    SIGTERM and SIGHUP, blocked by the forkserver the worker is forked from, end it again
    as they end any process.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SHIELDED)
    exit_with(parent)
    keep_freed_memory()


def exit_with(parent: int) -> None:
    """End this process as soon as process `parent` is gone.

    Workers are children of the forkserver, not of the run, so nothing else stops them
    when the run is killed (SIGKILL, the OOM killer, or SIGTERM's default action): they
    went on tokenizing for minutes, holding the caller's stdout open, and renamed shards
    under the next run of the same dataset. A pidfd wakes a watcher thread the moment the
    parent exits; where there is none (not Linux), the thread polls once a second.
    """
    try:
        fd = os.pidfd_open(parent)
    except ProcessLookupError:
        os._exit(1)  # already gone
    except (AttributeError, OSError):
        fd = None

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])
        else:
            while pid_alive(parent):
                time.sleep(1.0)
        os._exit(1)  # no clean-up: the unfinished work is the next run's to redo

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (someone else's too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def keep_freed_memory() -> None:
    """Have glibc's malloc keep freed memory for reuse.

    Each encode batch's arrays (several MB) are otherwise handed back to the kernel when
    freed and faulted in afresh by the next batch: sharding the 31 MB stdlib corpus took
    34,000 page faults to tokenize and 18,000 to write (5,000 and 7,000 with this), and
    the system time they cost exceeded the tokenizing's own. Workers live for one
    sharding run, so holding on to their peak memory costs nothing after. A no-op where
    the C library has no `mallopt` (macOS, musl).
    """
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the process runs on
    except (OSError, AttributeError, TypeError):
        return
    mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: large arrays from the heap, not fresh mmaps
    mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: do not shrink the heap between batches
