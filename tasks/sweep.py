"""The sweep's tasks: admit each trial under the chip limit and run it.

Admission is Prefect's global concurrency limit counted in chips: a trial holds its
slice's chip count from before its run starts until after it ends (with `max_parallel`, a
lane holds them from one trial to the next), so the trials of every sweep sharing the limit
never hold more chips than it has. The sweep never cancels a
trial because another failed: each trial's outcome is recorded, whatever it is. A sweep
stopped (Ctrl-C, SIGTERM, cancelled from the UI) starts no more trials and stops those
under way.

Planning the sweep (its name, every trial checked, the chip limit) is in
`tasks.sweep_plan`, landing it in `tasks.sweep_results`; the planning names are
re-exported here, where the flow and the tests import them from.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import wait
from contextlib import ExitStack
from datetime import UTC, datetime

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from tasks.sweep_chips import hold_chips
from tasks.sweep_deployed import cancel_trial_runs, ensure_trial_deployment
from tasks.sweep_models import (
    NOT_STARTED,
    Launcher,
    SweepError,
    SweepInterrupted,
    SweepPlan,
    TrialOutcome,
    TrialResult,
    crashed,
)
from tasks.sweep_plan import check_trials, ensure_chip_limit, new_sweep_name, plan_sweep, sweep_lock
from tasks.sweep_space import Trial
from tasks.watch import STOPPING

__all__ = [
    "SweepError",
    "SweepInterrupted",
    "SweepPlan",
    "TrialOutcome",
    "TrialResult",
    "check_trials",
    "ensure_chip_limit",
    "ensure_trial_deployment",
    "new_sweep_name",
    "plan_sweep",
    "sweep_lock",
]


class TrialQueue:
    """The trials no lane has taken yet, in order (lanes are threads of one process), and
    whether the sweep still starts trials (`close`)."""

    def __init__(self, trials: Iterable[Trial]):
        self._trials = deque(trials)
        self._lock = threading.Lock()
        self.closed = False
        self.running: set[int] = set()  # trials launched and not yet ended
        self.ended: dict[int, TrialResult] = {}

    def take(self) -> Trial | None:
        """The next trial, or None when every one is taken or the queue is closed."""
        with self._lock:
            return self._trials.popleft() if self._trials and not self.closed else None

    def close(self) -> None:
        """Start no more trials: the sweep is stopping."""
        with self._lock:
            self.closed = True

    def launched(self, trial: Trial) -> None:
        """`trial` is under way."""
        with self._lock:
            self.running.add(trial.index)

    def record(self, result: TrialResult) -> TrialResult:
        """A launched trial has ended with `result` (returned)."""
        with self._lock:
            self.ended[result.index] = result
        return result

    def so_far(self, trials: Iterable[Trial]) -> list[TrialResult]:
        """Every trial's result as known now: those under way as stopping, with no end
        recorded yet (what the sweep lands at once when it is interrupted)."""
        now = time.time()
        with self._lock:
            ended, running = dict(self.ended), set(self.running)
        return [
            ended.get(t.index)
            or _never_ran(t, STOPPING_NOW if t.index in running else NOT_STARTED, now)
            for t in trials
        ]


@task(name="run-trial", cache_policy=NONE, task_run_name="trial-{trial.index}")
def run_trial(trial: Trial, plan: SweepPlan, launch: Launcher, queue: TrialQueue) -> TrialResult:
    """Wait for the trial's chips, run it with `launch` unless `queue` was closed
    meanwhile, and record how it ended.

    Never raises for the trial's own failure: the sweep goes on and ranks what finished.
    """
    asked = time.time()
    with ExitStack() as chips:
        refused = _admit(chips, trial, plan, queue, asked)
        return refused or _admitted(trial, plan, launch, asked, queue)


@task(name="run-lane", cache_policy=NONE, task_run_name="lane-{lane}")
def run_lane(lane: int, queue: TrialQueue, plan: SweepPlan, launch: Launcher) -> list[TrialResult]:
    """Run trials from `queue` one after another until none is left, holding their chips
    from one trial to the next (acquired again only for a trial that needs another count).

    Never raises for a trial's own failure, nor for one that could not be admitted.
    """
    results = []
    with ExitStack() as chips:
        held = 0
        while (trial := queue.take()) is not None:
            asked = time.time()
            if trial.chips != held:
                held = 0
                _release(chips, lane)
                if refused := _admit(chips, trial, plan, queue, asked):
                    results.append(refused)
                    continue
                held = trial.chips
            results.append(_admitted(trial, plan, launch, asked, queue))
    return results


def _admit(
    chips: ExitStack, trial: Trial, plan: SweepPlan, queue: TrialQueue, asked: float
) -> TrialResult | None:
    """Hold the trial's chips on `chips`; None once held, else the trial's result as one
    that never ran: the sweep stopped while it waited, or no admission at all."""
    try:
        if hold_chips(chips, plan.chip_limit, trial.chips, lambda: queue.closed):
            return None
        return _never_ran(trial, NOT_STARTED, asked)
    except Exception as exc:  # no admission (limit deleted since planning, API unreachable)
        return _never_ran(trial, crashed(exc), asked)


def _release(chips: ExitStack, lane: int) -> None:
    try:
        chips.close()
    except Exception as exc:  # the lease lapses on its own; the other trials still run
        get_run_logger().warning("lane %d could not release its chips: %s", lane, exc)


def _admitted(
    trial: Trial, plan: SweepPlan, launch: Launcher, asked: float, queue: TrialQueue
) -> TrialResult:
    """Run a trial whose chips are held and record how it ended (never raises for it),
    unless the sweep stopped while it waited for them."""
    if queue.closed:
        return _never_ran(trial, NOT_STARTED, asked)
    started = datetime.now(UTC)
    queue.launched(trial)
    try:
        outcome = launch(trial, plan)
    except Exception as exc:  # a launcher bug or an API error: this trial only
        outcome = crashed(exc)
    return queue.record(_result(trial, outcome, started, datetime.now(UTC), asked))


def _never_ran(trial: Trial, outcome: TrialOutcome, asked: float) -> TrialResult:
    now = datetime.now(UTC)
    return _result(trial, outcome, now, now, asked)


STOPPING_NOW = TrialOutcome(
    status="cancelled", error="stopping: the sweep was interrupted while it ran"
)


def _result(
    trial: Trial, outcome: TrialOutcome, started: datetime, finished: datetime, asked: float
) -> TrialResult:
    get_run_logger().info(
        "trial %d (%s): %s", trial.index, trial.run_name, outcome.error or outcome.status
    )
    return TrialResult(
        **outcome.model_dump(),
        index=trial.index,
        run_id=trial.run_name,
        params=trial.params,
        chips=trial.chips,
        started_at=started,
        finished_at=finished,
        waited_s=started.timestamp() - asked,
    )


def run_trials(
    plan: SweepPlan,
    launch: Launcher,
    on_interrupt: Callable[[list[TrialResult]], None] | None = None,
) -> list[TrialResult]:
    """Run the trials, at most `plan.max_parallel` at once; results in trial order.

    With fewer than one per trial, `max_parallel` lanes (`run_lane`) each run trials one
    after another and keep their chips from one to the next, so admission costs one
    acquisition per lane, not one per trial: on a Prefect API backed by SQLite, each
    acquisition made while trials ran took 1-2.3 s, during which the freed chips sat idle
    (6 trials of 100 tiny steps, 2 at a time: 1.1-2.3 s before trials 2-5). With one per
    trial (no `max_parallel`), every trial is submitted at once and the chip limit alone
    admits them, across every sweep that shares it.

    Raises:
        SweepInterrupted: on Ctrl-C or SIGTERM (raised in this thread), once no trial is
            left under way: none starts after it, and the trials running stop watching
            their slices (`tasks.watch.STOPPING`), so their pipelines delete them and fail.
            Deployed trials' runs are cancelled (`cancel_trial_runs`). Before, the threads
            went on starting and running every trial, and the sweep ended minutes later
            with nothing recorded. A second signal stops the wait: the trials under way
            are then recorded as stopping (as `on_interrupt` is given them).

    `on_interrupt` is given every trial's result as known at the interruption, before the
    wait: a worker cancelling a deployed sweep kills it 30 s after its SIGTERM, which
    trials slow to stop outlasted, so the sweep was killed with nothing recorded.
    """
    queue, stopping = TrialQueue(plan.trials), threading.Event()
    token = STOPPING.set(stopping)  # submitted tasks run in copies of this context
    futures: list = []  # filled as they are submitted: a signal may come in between
    try:
        try:
            if plan.max_parallel >= len(plan.trials):
                for trial in plan.trials:
                    futures.append(run_trial.submit(trial, plan, launch, queue))
            else:
                for n in range(plan.max_parallel):
                    futures.append(run_lane.submit(n, queue, plan, launch))
            results = _gather(futures)
        except BaseException as exc:
            raise _stopped(plan, queue, stopping, futures, exc, on_interrupt) from exc
    finally:
        STOPPING.reset(token)
    return sorted(results, key=lambda r: r.index)


def _stopped(
    plan: SweepPlan,
    queue: TrialQueue,
    stopping: threading.Event,
    futures: list,
    cause: BaseException,
    on_interrupt: Callable[[list[TrialResult]], None] | None,
) -> SweepInterrupted:
    """Stop the sweep interrupted by `cause`: start no more trials, stop those under way
    and wait for them (`run_trials`), and say how each trial ended.

    A signal that came while the trials were still being submitted stops those already
    submitted too: it left the sweep function before, and the flow's task runner waited
    for them at its exit, so a trial admitted meanwhile trained to its end and the sweep
    crashed with no `sweeps` rows.
    """
    queue.close()
    stopping.set()
    log = get_run_logger()
    log.warning(
        "sweep interrupted: no trial starts now; waiting for those under way to stop "
        "(signal again to stop waiting)"
    )
    if on_interrupt is not None:
        on_interrupt(queue.so_far(plan.trials))
    try:
        results = _gather(futures, _canceller(plan, cause))
    except BaseException:  # a second signal: stop waiting, land what is known now
        log.warning(
            "sweep interrupted again: not waiting for the trials under way (their rows say "
            "stopping); they still delete their slices before this ends"
        )
        return SweepInterrupted(queue.so_far(plan.trials), cause)
    ran, now = {r.index for r in results}, time.time()
    results += [_never_ran(t, NOT_STARTED, now) for t in plan.trials if t.index not in ran]
    return SweepInterrupted(sorted(results, key=lambda r: r.index), cause)


def _gather(futures: list, tick: Callable[[], None] | None = None) -> list[TrialResult]:
    """Every future's results (a trial's `TrialResult`, or a lane's list of them); `tick`
    is called about once a second while they run.

    Waits a second at a time: a signal delivered to another thread of the process does
    not wake a wait, and Python runs its handler only once this thread runs again.
    """
    while True:
        if tick is not None:
            tick()
        if not wait([f.wrapped_future for f in futures], timeout=1.0).not_done:
            break
    results = []
    for future in futures:
        value = future.result()
        results.extend(value if isinstance(value, list) else [value])
    return results


def _canceller(plan: SweepPlan, cause: BaseException) -> Callable[[], None] | None:
    """For deployed trials, what cancels their runs while the interrupted sweep waits for
    them: again each second, since a trial that took its chips just before the signal may
    create its run a moment after."""
    if plan.via != "deployment":
        return None  # in-process trials stop at their next poll (STOPPING)
    reason = f"the sweep {plan.sweep_id} was stopped ({type(cause).__name__})"
    log = get_run_logger()

    def tick() -> None:
        try:
            if names := cancel_trial_runs(plan, reason):
                log.warning("cancelled the runs of trials %s", ", ".join(names))
        except Exception as exc:  # the API unreachable: keep waiting, try again
            log.warning("could not cancel the trials' runs: %s", exc)

    return tick


def completed(results: Iterable[TrialResult]) -> list[TrialResult]:
    """The trials whose run completed."""
    return [r for r in results if r.status == "completed"]
