"""Watching a training attempt, and the typed outcomes the retry policy acts on.

- `WorkloadPreempted`: the slice was PREEMPTED/TERMINATED/lost, the workload exited with
  its "preempted" code after a SIGTERM, or the heartbeat stayed silent past the timeout
  and a second look confirmed it. Retried: re-provision and resume.
- `WorkloadNeverStarted`, a kind of `WorkloadPreempted`: the slice stayed READY but this
  attempt's workload never wrote a heartbeat. Its start-up failed or hangs (a wheel it
  cannot download, workers with no route to storage, a host that never joined): a new
  slice rarely fares better, so these are retried on the smaller `max_failures` budget.
- `ProvisioningError` (from infra): no capacity or quota. Retried with backoff.
- `WorkloadFailed`: any other exit. A bug: never retried.

A status read that fails is logged and read again on the next poll: one flaky API answer
never starts a recovery by itself. A `SliceError` from the read is the provider saying it
is permanent (no permission, say): it ends the watch, and the attempt fails.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

from etils import epath

from infra.slices import SliceError, SliceState
from infra.slices.procs import host_log_path
from tasks.slice_log import log_error
from workloads.events import SUPERSEDED_EXIT
from workloads.rundir import RunDir
from workloads.train import PREEMPTED_EXIT


class WorkloadFailed(RuntimeError):
    """The workload exited with an error: a bug or bad state, not worth a retry."""


class WorkloadPreempted(RuntimeError):
    """The attempt was lost to the platform; the run resumes in a new attempt.

    Attributes:
        announced: the platform said so (the slice PREEMPTED or gone), or the workload
            saved at a notice and exited; False for a workload killed without notice or
            gone silent, which may as well be out of memory or stuck (see
            `resilience.max_stalled_attempts`).
    """

    def __init__(self, message: str, announced: bool = False) -> None:
        super().__init__(message)
        self.announced = announced


class WorkloadNeverStarted(WorkloadPreempted):
    """The slice is READY, but its workload never wrote a heartbeat in this attempt."""


class WatchStopped(RuntimeError):
    """The run was told to stop (`STOPPING`): while watching its slice, the attempt fails,
    never retried, and its slice is deleted as after any failure; while verifying or
    evaluating, the run fails."""


# Set by a sweep being stopped (Ctrl-C, SIGTERM: see `tasks.sweep.run_trials`). Its trials
# watch their slices in its task threads, where no signal arrives; Prefect copies the
# context into those threads, so this reaches every watch of that sweep and no other.
STOPPING: ContextVar[threading.Event | None] = ContextVar("tpupipe_stopping", default=None)


def stop_requested() -> bool:
    """Whether this run's sweep is being stopped (`STOPPING`)."""
    stopping = STOPPING.get()
    return stopping is not None and stopping.is_set()


def stop_if_requested(when: str) -> None:
    """Raise `WatchStopped` ("stopped `when`: ...") if this run's sweep is being stopped:
    the run's stages after training check it too, or a stopped sweep waited minutes for
    its trials' evaluations."""
    if stop_requested():
        raise WatchStopped(f"stopped {when}: the sweep was interrupted")


@dataclass(frozen=True)
class TrainOutcome:
    """How a training attempt ended."""

    slice_name: str
    exit_code: int
    final_step: int | None
    seconds: float


@dataclass(frozen=True)
class WatchSettings:
    """How often to look, and how long silence may last before a second look."""

    poll_s: float
    heartbeat_timeout_s: float
    confirm_s: float


def watch_slice(
    provider,
    name: str,
    run_dir: RunDir,
    settings: WatchSettings,
    log: Callable[[str], None],
    on_heartbeat: Callable[[dict], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    attempt: int | None = None,
    log_path: str | None = None,
    wall: Callable[[], float] = time.time,
) -> TrainOutcome:
    """Wait until the workload on slice `name` exits.

    `attempt` tells this attempt's heartbeats from an earlier one's left in the run
    directory; without it (or from a workload that does not write it), a heartbeat
    written after the watch started is this attempt's. `log_path` is the slice's log
    (`tasks.plan.slice_log_path`; default the run directory's `logs/<name>.log`), whose
    last line a failure without an error of its own quotes.

    Silence is timed on `clock`, this process's own (monotonic) clock, from the moment a
    heartbeat last changed, not from the time written in it: a wall clock stepped by an
    hour (a VM resumed, NTP correcting a bad boot clock) made a healthy workload look an
    hour silent, and its slice was deleted. `wall` dates the watch's start for heartbeats
    that carry no attempt.

    Raises:
        WorkloadNeverStarted: the slice stayed READY and its workload never beat.
        WorkloadPreempted: the attempt was lost (see the module docstring).
        WorkloadFailed: the workload exited with an error.
        WatchStopped: `STOPPING` was set.
    """
    started, since = clock(), wall()
    last_step, suspect_since, failing_since, heard = None, None, None, False
    seen, seen_at = None, started  # this attempt's newest heartbeat, and when it was read
    our_step = None  # this attempt's newest step: its last heartbeat may have none
    quarantined: set[int] = set()  # steps whose quarantine was logged
    told_start = False  # whether the step this attempt trains from was logged
    while True:
        # The heartbeat's step: the workload may have gone on since, and it saves the step
        # it is at when its slice is deleted (the landed row's final step): "after step
        # 60" was read as where it stopped, beside a checkpoint of step 75.
        stop_if_requested(
            "before its first step"
            if last_step is None
            else f"while training, at step {last_step} or past it"
        )
        try:
            status = provider.status(name)
            failing_since = None
        except SliceError:
            # Typed by the provider as permanent (a permission, a refused read of the exit
            # records): reading again cannot help, and this loop would never reach the
            # heartbeat check below, so it would watch forever, slice and all.
            raise
        except Exception as exc:  # maybe transient: look again, but not forever
            if failing_since is None:
                failing_since = clock()
            failing = clock() - failing_since
            if failing > settings.heartbeat_timeout_s:
                # An untyped error that lasts (a raw 400, a bug in a provider) would
                # otherwise be read again for good, the slice running all the while.
                raise SliceError(
                    f"reading slice {name} kept failing for {failing:.0f}s (longer than "
                    f"slice.heartbeat_timeout_s = {settings.heartbeat_timeout_s:.0f}): "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            log(f"reading slice {name} failed ({type(exc).__name__}: {exc}); retrying")
            sleep(settings.poll_s)
            continue
        heartbeat = run_dir.read_status() or {}
        ours = _ours(heartbeat, attempt, since)
        heard = heard or ours
        if ours and heartbeat != seen:
            seen, seen_at = heartbeat, clock()
        if ours:
            _log_quarantined(heartbeat, quarantined, log)
            if not told_start:
                told_start = _log_start(heartbeat, log)
        # This attempt's step only: a rerun logged the crashed attempt's last heartbeat
        # ("step 75 loss 2.76 (training)") before its own workload restored step 50.
        step = heartbeat.get("step") if ours else None
        if step is not None:
            our_step = step
        if step != last_step and step is not None:
            loss = heartbeat.get("loss")  # none yet while restoring or compiling
            said = f" loss {loss}" if loss is not None else ""
            log(f"step {step}{said} ({heartbeat.get('phase')})")
            last_step = step
            if on_heartbeat is not None:
                on_heartbeat(heartbeat)
        if status.state in (SliceState.PREEMPTED, SliceState.NOT_FOUND):
            raise WorkloadPreempted(
                f"slice {name} is {status.state.value} at step {our_step}", announced=True
            )
        if status.state == SliceState.TERMINATED:
            break
        silent = clock() - seen_at
        if silent <= settings.heartbeat_timeout_s:
            suspect_since = None
        elif suspect_since is None:
            suspect_since = clock()  # first look: maybe a slow status write; look again
        elif clock() - suspect_since >= settings.confirm_s:
            if not heard and status.state == SliceState.READY:
                raise WorkloadNeverStarted(
                    f"the workload on slice {name} never started: no heartbeat in "
                    f"{silent:.0f}s (slice.heartbeat_timeout_s = "
                    f"{settings.heartbeat_timeout_s:g}) while the slice was READY"
                )
            raise WorkloadPreempted(
                f"no heartbeat from slice {name} for {silent:.0f}s (slice.heartbeat_timeout_s "
                f"= {settings.heartbeat_timeout_s:g}, confirmed after "
                f"{settings.confirm_s:g}s); last phase {heartbeat.get('phase')!r}"
            )
        sleep(settings.poll_s)
    final = run_dir.read_status() or {}
    if not _ours(final, attempt, since):
        # An older attempt's heartbeat, its error included: this attempt's workload died
        # before it wrote one (a full disk), and that error was reported as this one's.
        final = {}
    if final.get("step") is None and our_step is not None:
        # A "failed" heartbeat says no step (written outside the loop), nor does one of
        # another tool: the message of a kill then said "at step None".
        final = {**final, "step": our_step}
    if on_heartbeat is not None and final:
        # How it ended ("finished" repeats the last step, "failed" says none): passed on
        # only when the step moved, the UI's bar stayed at "(training)" for good.
        on_heartbeat(final)
    if status.failure:  # the workload never ran: a heartbeat's error is an older attempt's
        final = {**final, "error": status.failure}
    elif status.exit_code not in (0, PREEMPTED_EXIT, SUPERSEDED_EXIT, None):
        error = _with_host_errors(final.get("error"), run_dir, attempt, since)
        if status.host and status.host not in _host_records(run_dir, attempt, since):
            # Another host's exit ended the slice without its own record (a signal), and
            # host 0's error (a collective's "Connection reset by peer") or log line is what
            # that did to it: that host's log says more (the workload's faulthandler).
            own = _last_log_line(run_dir, name, log_path, status.host)
            error = "; ".join(filter(None, [own, error and f"host 0 then: {error}"]))
        final = {**final, "error": error or _last_log_line(run_dir, name, log_path)}
    return _ended(name, status.exit_code, final, clock() - started, status.host)


def _log_quarantined(heartbeat: dict, seen: set[int], log: Callable[[str], None]) -> None:
    """Log, once each, the checkpoints the workload quarantined while resuming."""
    for entry in heartbeat.get("quarantined") or []:
        step = entry.get("step") if isinstance(entry, dict) else None
        if isinstance(step, int) and step not in seen:
            seen.add(step)
            log(f"checkpoint step {step} was quarantined, not resumed from: {entry.get('reason')}")


def _log_start(heartbeat: dict, log: Callable[[str], None]) -> bool:
    """Log the step the attempt trains from once its heartbeat says (True then): a resume,
    or a run that had checkpoints starting over because none of them restored. The console
    showed only "step 50 loss None (compiling)" after a quarantine, and nothing at all
    when every checkpoint was quarantined and the run trained again from step 0."""
    start = heartbeat.get("resumed_from")
    if not isinstance(start, int):
        return False
    bad = sorted(
        {e.get("step") for e in heartbeat.get("quarantined") or [] if isinstance(e, dict)} - {None},
        reverse=True,
    )
    steps = f"step{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))}"
    if start:
        log(
            f"resuming from the checkpoint of step {start}"
            + (f" (newer: {steps}, quarantined)" if bad else "")
        )
    elif bad:
        log(f"training from step 0: none of the run's checkpoints restored ({steps}, quarantined)")
    return True


def _last_log_line(
    run_dir: RunDir, name: str, log_path: str | None = None, host: int = 0
) -> str | None:
    """The error the slice's log of `host` ends with (host 0's, by default in the run
    directory): that of a workload that could not write its heartbeat (a full disk), or
    that a signal killed. None when there is no such log (gcp slices log elsewhere)."""
    root = getattr(run_dir, "path", None)  # a stand-in without a directory has no log
    if log_path is None and root is None:
        return None
    path = log_path or str(epath.Path(root) / "logs" / f"{name}.log")
    if host:
        if "://" in path:  # a gcp worker's log is on its VM
            return None
        path = str(host_log_path(path, host))
    return log_error(epath.Path(path))


def _with_host_errors(
    error: str | None, run_dir: RunDir, attempt: int | None, started: float
) -> str | None:
    """`error` (host 0's, or its log's last line) with this attempt's errors of the other
    hosts (`RunDir.host_failures`) that differ from it: only host 0 writes the heartbeat,
    and a host that failed alone (its input, its disk) says why in its own record."""
    records = _host_records(run_dir, attempt, started)
    others = [
        f"host {host}: {record.get('error')}"
        for host, record in records.items()
        if record.get("error") not in (None, error)
    ]
    return "; ".join(([error] if error else []) + others) or None


def _host_records(run_dir: RunDir, attempt: int | None, started: float) -> dict[int, dict]:
    """This attempt's failure records of hosts other than 0 (`RunDir.host_failures`)."""
    try:
        records = run_dir.host_failures()
    except OSError:
        return {}
    return {host: r for host, r in records.items() if _ours(r, attempt, started)}


def _ours(heartbeat: dict, attempt: int | None, started: float) -> bool:
    """Whether `heartbeat` was written by this attempt's workload."""
    if attempt is not None and "attempt" in heartbeat:
        return heartbeat["attempt"] == attempt
    return heartbeat.get("time", float("-inf")) >= started


def _ended(
    name: str, code: int | None, final: dict, seconds: float, host: int | None = None
) -> TrainOutcome:
    if code == 0:
        return TrainOutcome(name, 0, final.get("step"), seconds)
    if code == PREEMPTED_EXIT:
        step = final.get("step")
        if final.get("saved") is False:  # the notice came in start-up: nothing new to save
            newest = f"its newest checkpoint is step {step}" if step else "no checkpoint yet"
            did = f"stopped at the notice before its first step ({newest})"
        else:
            did = f"saved step {step}"
        raise WorkloadPreempted(f"workload on {name} {did} and exited", announced=True)
    if code == SUPERSEDED_EXIT:
        raise WorkloadFailed(
            f"workload on slice {name} stopped without writing: a newer attempt took the run "
            "directory's lease, so another orchestrator is running this run (from another "
            "machine?); this one stops and leaves the run to it"
        )
    on = "" if host is None else f", host {host}"
    if code is None or code in (-signal.SIGKILL, -signal.SIGTERM):
        # Killed from outside, or the exit code is unknown: the platform took the slice. A
        # SIGTERM is its notice, even one that came before the workload could save.
        how = f"signal {-code}{on}" if code else "no exit code"
        step = final.get("step")
        at = "before its first step" if step is None else f"at step {step}"
        raise WorkloadPreempted(
            f"workload on {name} was killed ({how}) {at}", announced=code == -signal.SIGTERM
        )
    who = "" if host is None else f": host {host}"
    raise WorkloadFailed(
        f"workload on slice {name}{who} {_exit_words(code)}: "
        f"{final.get('error') or 'see the slice log'}"
    )


def _exit_words(code: int) -> str:
    """'exited with code 1', or for a process a signal ended 'was killed by SIGSEGV
    (signal 11)' (it read "exited with code -11")."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f"was killed by signal {-code}"
    return f"was killed by {name} (signal {-code})"
