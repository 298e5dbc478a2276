"""One orchestrator per run: a second `tpupipe run` of a run name that is being run stops
before it provisions anything.

Without it, two orchestrators of one run name shared the slice name: the second deleted the
first one's live slice while creating its own, the first then watched the second's workload
as its own, and both wrote the same attempt numbers into the run's ledger and landed its
`runs` row. The lock is an flock on a file, so the kernel releases it when its holder dies,
however it dies: a killed orchestrator never blocks the rerun that resumes its run. For a
local storage root the file is under it; for a `gs://` one, under this user's cache
(`~/.cache/tpupipe/locks`, or `$XDG_CACHE_HOME`), whatever directory the orchestrator
starts in: under `./.tpupipe`, two orchestrators of one run started from two directories
were not kept apart, and the second took the first's run over (its workload stopped on the
lost lease, and the first failed). It guards the orchestrators of one machine;
orchestrators of one `gs://` run on two machines are not kept apart.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import pwd
import socket
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tasks.plan import RunPlan
from workloads.config import PipelineConfig
from workloads.config_file import ConfigError
from workloads.rundir import RunDir

log = logging.getLogger(__name__)


class RunInUse(RuntimeError):
    """Another live orchestrator is running this run."""


def lock_path(plan: RunPlan) -> Path:
    """The lock file of the run `plan` names."""
    return locks_dir(plan) / f"{plan.run_name}.lock"


def locks_dir(plan: RunPlan) -> Path:
    """Where the locks of `plan`'s runs are (see the module docstring). One directory for
    every `gs://` root: a run name is its slice's name too (`tpupipe-<run_name>`), which
    one project's zone holds once, whichever bucket the run writes to."""
    if "://" not in plan.storage_root:
        return Path(plan.slices_root) / "locks"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "tpupipe" / "locks"


@contextmanager
def run_held(plan: RunPlan, config: PipelineConfig) -> Iterator[None]:
    """Hold the run's lock while the body runs; the lock records who holds it.

    Raises:
        RunInUse: naming the holder (pid, host, flow run, since when), at once: a run can
            take hours, so waiting for it would only hide the mistake; or the workload
            started by hand whose heartbeat is live (`RunDir.live_workload`).
        infra.gcp.gcs_lease.LeaseError: a `gs://` run's lock object could not be written.
    """
    with _held(plan, config, f"{plan.run_name}.lock", f"run {plan.run_name!r}", "run_name"):
        # A workload started by hand holds neither this lock nor a lease the attempts would
        # take from it: it went on writing the run directory beside the run's attempts.
        live = live_workload(plan, config)
        if live is not None and live.get("attempt") is None:
            raise RunInUse(
                f"run {plan.run_name!r} is being trained by a workload started by hand in "
                f"{plan.run_dir} ({RunDir.describe_beat(live)}); stop it, or wait for it to end"
            )
        yield


def live_workload(plan: RunPlan, config: PipelineConfig) -> dict | None:
    """The heartbeat of a workload training the run now (`RunDir.live_workload`), or None.
    Local run directories only, as the lock: a gs:// one is its slice's hosts' to read."""
    if "://" in plan.run_dir:
        return None
    return RunDir(plan.run_dir).live_workload(config.slice.heartbeat_timeout_s)


def training_now(plan: RunPlan, config: PipelineConfig) -> str | None:
    """What `tpupipe validate` notes of a run that is training now, or None."""
    if (live := live_workload(plan, config)) is None:
        return None
    then = "stops before provisioning"  # `run_held`
    if (attempt := live.get("attempt")) is not None:  # its lease, unless its orchestrator runs
        then += f" while its orchestrator runs, and otherwise takes over from attempt {attempt}"
    return (
        f"run {plan.run_name!r} is training now ({RunDir.describe_beat(live)}): "
        f"`tpupipe run` of it now {then}"
    )


@contextmanager
def sweep_held(plan: RunPlan, sweep_id: str, config: PipelineConfig) -> Iterator[None]:
    """Hold sweep `sweep_id`'s lock, next to the run locks of `plan` (one of its trials,
    whose config is `config`).

    Two sweeps of one name at once each found the other's trial held (`RunInUse`),
    recorded it failed, and the last to land replaced the `sweeps` rows: a trial that
    completed was listed failed, without its chip-hours, and the two sweeps named two
    different best trials.

    Raises:
        RunInUse: naming the sweep and its holder.
    """
    with _held(plan, config, f"sweep-{sweep_id}.lock", f"sweep {sweep_id!r}", "sweep_name"):
        yield


@contextmanager
def _held_in_bucket(
    plan: RunPlan, config: PipelineConfig, name: str, what: str, field: str, owner: dict
) -> Iterator[None]:
    """For a `gs://` storage root, also hold the lock object `<root>/locks/<name>`."""
    if not plan.storage_root.startswith("gs://"):
        yield
        return
    from infra.gcp.gcs_lease import GcsLease, LeaseHeld, describe
    from tasks.remote import storage_client

    lease = GcsLease(storage_client(config), f"{plan.storage_root}/locks/{name}", owner)
    try:
        lease.acquire()
    except LeaseHeld as held:
        raise RunInUse(
            f"{what} is being run by another orchestrator ({describe(held.holder)}; its lock "
            f"{held.uri} was renewed {held.age_s:.0f} s ago and is stale after "
            f"{held.ttl_s:.0f} s); wait for it to end, or choose another {field}"
        ) from None
    try:
        yield
    finally:
        lease.release()


@contextmanager
def _held(
    plan: RunPlan, config: PipelineConfig, name: str, what: str, field: str
) -> Iterator[None]:
    """This machine's lock file `name` (an flock), then for a `gs://` root the bucket's."""
    path = locks_dir(plan) / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # 0o666 less the umask, as any file: with 0o644 only its creator could open it
        # again, and a teammate's rerun of a run in a group-shared root failed for good.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        raise ConfigError(lock_problem(path, exc, field)) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunInUse(
                f"{what} is being run by another orchestrator ({_describe(path)}); wait for "
                f"it to end, or choose another {field}"
            ) from None
        owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "flow_run_id": plan.flow_run_id,
            "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        try:  # who holds it, for the message above: no reason to stop the run on a full disk
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(owner).encode(), 0)
        except OSError as exc:
            log.warning("could not record this orchestrator in %s: %s", path, exc)
        with _held_in_bucket(plan, config, name, what, field, owner):
            yield
    finally:
        os.close(fd)  # releases the flock


def lock_problem(path: Path, exc: OSError, field: str) -> str:
    """Why lock file `path` cannot be opened (`exc`), naming its owner and mode if it exists."""
    return f"cannot open the lock file {path}{owner_and_mode(path)}: {remedy(exc, field, path)}"


def owner_and_mode(path: str | os.PathLike) -> str:
    """ " (owner alice, mode -rw-r--r--)" for an existing `path`, else ""."""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = f"uid {st.st_uid}"
    return f" (owner {owner}, mode {stat.filemode(st.st_mode)})"


def remedy(exc: OSError, field: str, path: str | os.PathLike | None = None) -> str:
    """`exc`'s reason, then what to do about a teammate's file this user cannot write
    (`path`, when given, is that file: its mode may allow writing, and then the mode is
    not what stops it)."""
    reason = exc.strerror or str(exc)
    if exc.errno not in (errno.EACCES, errno.EPERM):
        return f"{reason}; remove or repair it, or choose another {field}"
    if path is not None and (beyond := beyond_mode(path)):
        return f"{reason}{beyond}; lift that, or choose another {field}"
    return (
        f"{reason}; have its owner make it writable for you (a group sharing a storage root "
        f"needs umask 002, or chmod -R g+w), or choose another {field}"
    )


def beyond_mode(path: str | os.PathLike) -> str:
    """Why a file or directory whose mode lets this user write is still not writable, as
    "; ...", else "": root was told "not writable (owner root, mode drwxr-xr-x)" of an
    immutable directory, a mode that says the opposite, and to have the owner of an
    immutable file make it writable with umask 002."""
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return "; its file system is mounted read-only"
        st = os.stat(path)
    except OSError:
        return ""
    if os.geteuid() != 0 and not (st.st_uid == os.geteuid() and st.st_mode & stat.S_IWUSR):
        return ""  # the mode says it, as shown
    return (
        "; its mode allows writing: an immutable attribute (see lsattr) or a security "
        "policy stops it"
    )


def _describe(path: Path) -> str:
    try:
        owner = json.loads(path.read_text())
        where = f"pid {owner['pid']} on {owner['host']} since {owner['since']}"
        return f"{where}, flow run {owner['flow_run_id']}" if owner.get("flow_run_id") else where
    except (OSError, ValueError, KeyError, TypeError):
        return f"lock {path}"  # the holder is between taking the lock and writing to it
