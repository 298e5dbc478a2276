"""What a run writes in place beneath a storage root that others may have made: checked
before it starts (`check_writable`), for roots a group shares.

Files a run replaces (config.json, status.json, eval.json) need only their directory to be
writable. These it opens for writing instead, so a teammate's copy made with umask 022 or
027 stopped the run, most after its slice was provisioned: the run's and the slice
registry's lock files (a PermissionError traceback at provisioning, and for the reaper),
the DuckDB file and its write-ahead log (landing failed after the whole training run),
the ledger and metrics lines appended to (events.jsonl, metrics.jsonl, logs/), the
compilation cache's lock (JAX read and wrote no entry: every program compiled again,
said only in the slice's log), and every directory of the run: a teammate's checkpoint
step was deleted at the first save of a resumed run, which then failed, every attempt.
"""

from __future__ import annotations

import errno
import os

from infra.slices import registry_dir
from tasks.plan import COMPILE_CACHE_ENV, RunPlan, shared_compile_cache
from tasks.run_lock import lock_path, owner_and_mode, remedy
from workloads.config import PipelineConfig
from workloads.config_file import ConfigError

# The files of a run directory its processes append to; JAX's cache lock (`.lockfile`).
APPENDED = ("events.jsonl", "metrics.jsonl")
CACHE_LOCK = ".lockfile"


def check_writable(config: PipelineConfig, plan: RunPlan) -> None:
    """Refuse, naming it with its owner and mode, the first existing file a run would open
    for writing, or directory of its run directory, that this user cannot write. Nothing
    is opened (see below), so nothing changes, not even for a watcher of the files.

    Raises:
        ConfigError: naming the field, the path, its owner and mode, and what to do.
    """
    root = f"storage.root = {config.storage.root!r}"
    run = f"{root} and run_name = {plan.run_name!r}"
    files = [(run, str(lock_path(plan)), "run_name")]
    if config.slice.provider == "local":
        files.append((root, os.path.join(registry_dir(plan.slices_root), ".lock"), "storage.root"))
    if config.metrics.sink == "duckdb":
        field, value = metrics_field(config)
        named = f"{field} = {value!r}"
        files += [(named, plan.metrics_path, field), (named, f"{plan.metrics_path}.wal", field)]
    if "://" not in plan.compile_cache_dir:
        shared = shared_compile_cache(config)
        field = f"{COMPILE_CACHE_ENV} = {shared!r}" if shared else root
        cache_lock = os.path.join(plan.compile_cache_dir, CACHE_LOCK)
        files.append((field, cache_lock, COMPILE_CACHE_ENV if shared else "storage.root"))
    if "://" not in plan.run_dir:
        files += [(run, os.path.join(plan.run_dir, name), "run_name") for name in APPENDED]
        files += [(run, path, "run_name") for path in _run_logs(plan.run_dir)]
        files += [(run, path, "run_name") for path in _run_directories(plan.run_dir)]
    for field, path, other in files:
        # Asked (access(2): it answers for root too on a read-only mount or an immutable
        # file), never opened: closing a file drops every POSIX lock this process holds on
        # it, and a sweep's trial landing in the DuckDB file (a thread of this process)
        # then lost its lock to another process's writes; a FIFO opened for writing waits.
        if os.access(path, os.W_OK | (os.X_OK if os.path.isdir(path) else 0)):
            continue
        if not os.path.lexists(path):
            continue  # not there (yet, or any more: orbax renames and deletes steps)
        denied = PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        why = remedy(denied, other, path)
        raise ConfigError(f"{field}: {path} cannot be written{owner_and_mode(path)}: {why}")


def metrics_field(config: PipelineConfig) -> tuple[str, str]:
    """The field that places the DuckDB file, and its value: `metrics.path` if set, else
    `storage.root` (the file is `metrics.duckdb` beneath it)."""
    if config.metrics.path:
        return "metrics.path", config.metrics.path
    return "storage.root", config.storage.root


def _run_logs(run_dir: str) -> list[str]:
    logs = os.path.join(run_dir, "logs")
    try:
        return [e.path for e in os.scandir(logs) if e.is_file(follow_symlinks=False)]
    except OSError:
        return []


def _run_directories(run_dir: str) -> list[str]:
    """The run directory and every directory beneath it (checkpoints: a few hundred)."""
    if not os.path.isdir(run_dir):
        return []
    return [top for top, _, _ in os.walk(run_dir)]
