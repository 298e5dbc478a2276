"""The sweep's tasks: plan it, admit each trial under the chip limit and run it, land it.

Admission is Prefect's global concurrency limit counted in chips: a trial holds its
slice's chip count from before its run starts until after it ends (with `max_parallel`, a
lane holds them from one trial to the next), so the trials of every sweep sharing the limit
never hold more chips than it has. The sweep never cancels a
trial because another failed: each trial's outcome is recorded, whatever it is.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import wait
from contextlib import ExitStack
from datetime import UTC, datetime
from typing import Any, Literal

from prefect import get_run_logger, task
from prefect.cache_policies import NONE
from prefect.client.orchestration import get_client
from prefect.concurrency.sync import concurrency
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from pydantic import BaseModel

from infra.metrics import RunRow, build_sink
from tasks.plan import check_resumable, metrics_path, plan_run
from tasks.sweep_space import SweepConfig, Trial, build_trials
from tasks.watch import STOPPING
from workloads.config import PipelineConfig
from workloads.config_file import ConfigError

TrialStatus = Literal["completed", "failed", "cancelled", "crashed"]
# How often run_deployment asks the API whether a trial's run has finished.
DEPLOYMENT_POLL_S = 2.0


class SweepError(RuntimeError):
    """The sweep cannot run as configured (no chip limit, a trial larger than it)."""


class SweepInterrupted(Exception):
    """The sweep was stopped (`cause`: Ctrl-C, SIGTERM) once its trials under way had
    ended; `results` holds every trial's, those never started as cancelled."""

    def __init__(self, results: list[TrialResult], cause: BaseException):
        super().__init__(f"sweep interrupted: {type(cause).__name__}")
        self.results = results
        self.cause = cause


class SweepPlan(BaseModel):
    """A sweep resolved before any trial runs: its name, trials and where they run."""

    sweep_id: str
    flow_run_id: str | None = None
    trials: list[Trial]
    via: Literal["subflow", "deployment"]
    trial_deployment: str
    chip_limit: str
    chips: int  # what the limit holds
    objective: str
    max_parallel: int
    base: PipelineConfig


class TrialOutcome(BaseModel):
    """How a trial's run ended, as its launcher saw it."""

    status: TrialStatus
    flow_run_id: str | None = None
    error: str | None = None
    run: RunRow | None = None


class TrialResult(TrialOutcome):
    """A trial's outcome with its identity and when it held its chips."""

    index: int
    run_id: str
    params: dict[str, Any]
    chips: int
    started_at: datetime  # chips acquired
    finished_at: datetime  # run over, chips about to be released
    waited_s: float  # time spent waiting for chips


def new_sweep_name(now: datetime | None = None, token: str | None = None) -> str:
    """A fresh, sortable sweep name: `sweep-20261122-061530-a1b2`."""
    now = now or datetime.now(UTC)
    return f"sweep-{now:%Y%m%d-%H%M%S}-{token or secrets.token_hex(2)}"


def ensure_chip_limit(
    name: str,
    quota: int | None,
    needed: int,
    client: Any,
    warn: Callable[[str], None] | None = None,
) -> int:
    """Make sure the global concurrency limit `name` exists and can admit a trial.

    Args:
        name: the limit's name.
        quota: set the limit to this many chips (created if missing); None: use the
            existing limit unchanged.
        needed: chips of the largest trial.
        client: a synchronous Prefect client.
        warn: told when some of the limit's chips are held already.

    Returns:
        The chips the limit holds.

    Raises:
        SweepError: the limit is missing with no quota given, or smaller than a trial (it
            would wait forever).
    """
    if quota is not None:
        client.upsert_global_concurrency_limit_by_name(name, quota)
    try:
        limit = client.read_global_concurrency_limit_by_name(name)
    except ObjectNotFound:
        raise SweepError(
            f"no global concurrency limit {name!r}: create it with `prefect gcl create "
            f"{name} --limit <chips>`, or give the sweep a chip_quota"
        ) from None
    if not limit.active:
        raise SweepError(f"global concurrency limit {name!r} is inactive: it would admit all")
    if needed > limit.limit:
        raise SweepError(
            f"a trial needs {needed} chips but the limit {name!r} holds {limit.limit}: it "
            "would wait forever"
        )
    held = getattr(limit, "active_slots", 0)
    if held and warn is not None:
        # Prefect's temporary local API keeps slot leases in its own memory: a sweep killed
        # there with SIGKILL leaves its chips held for good, and every later trial waits.
        warn(
            f"{held} of the {limit.limit} chips of limit {name!r} are held now: by sweeps "
            "running, or left by one killed outright; if none runs, free them with "
            f"`prefect gcl update {name} --active-slots 0`"
        )
    return limit.limit


def ensure_trial_deployment(name: str, client: Any) -> None:
    """The deployment trials run as must exist, or every trial would take its chips and
    crash in `run_deployment`.

    Raises:
        SweepError: naming the deployment and how to create it.
    """
    try:
        client.read_deployment_by_name(name)
    except ObjectNotFound:
        raise SweepError(
            f"no deployment {name!r} for the trials (trial_deployment): deploy it with "
            "`prefect deploy --all`, or give trials_via 'subflow'"
        ) from None


@task(name="plan-sweep", cache_policy=NONE)
def plan_sweep(config: SweepConfig, flow_run_id: str | None, deployed: bool) -> SweepPlan:
    """Name the sweep, validate every trial's config and check the chip limit: all of
    it before any trial runs."""
    sweep_id = config.sweep_name or new_sweep_name()
    trials = build_trials(config, sweep_id)
    check_trials_resumable(trials)
    via = config.trials_via
    if via == "auto":
        via = "deployment" if deployed else "subflow"
    with get_client(sync_client=True) as client:
        if via == "deployment":
            ensure_trial_deployment(config.trial_deployment, client)
        needed = max(t.chips for t in trials)
        warn = get_run_logger().warning
        chips = ensure_chip_limit(config.chip_limit, config.chip_quota, needed, client, warn)
    plan = SweepPlan(
        sweep_id=sweep_id,
        flow_run_id=flow_run_id,
        trials=trials,
        via=via,
        trial_deployment=config.trial_deployment,
        chip_limit=config.chip_limit,
        chips=chips,
        objective=config.objective,
        max_parallel=config.max_parallel or len(trials),
        base=config.base,
    )
    get_run_logger().info(
        "sweep %s: %d trials as %ss, at most %d at once, limit %r of %d chips",
        sweep_id,
        len(trials),
        via,
        plan.max_parallel,
        plan.chip_limit,
        chips,
    )
    return plan


def check_trials_resumable(trials: list[Trial]) -> None:
    """A sweep run again resumes its trials, so each must train what its run trained.

    Checked for all trials before any runs: a space changed since the first sweep of this
    name otherwise let every trial take its chips and fail its own validation, and the
    sweep then replaced the finished sweep's `sweeps` rows with failed ones.

    Raises:
        ConfigError: naming each trial, its overrides and the fields that changed.
    """
    problems = []
    for trial in trials:
        try:
            check_resumable(trial.config, plan_run(trial.config))
        except ConfigError as exc:
            params = ", ".join(f"{k}={v!r}" for k, v in trial.params.items())
            problems.append(f"trial {trial.index} ({params}): {exc}")
    if problems:
        raise ConfigError("\n".join(problems))


Launcher = Callable[[Trial, SweepPlan], TrialOutcome]


class TrialQueue:
    """The trials no lane has taken yet, in order (lanes are threads of one process), and
    whether the sweep still starts trials (`close`)."""

    def __init__(self, trials: Iterable[Trial]):
        self._trials = deque(trials)
        self._lock = threading.Lock()
        self.closed = False

    def take(self) -> Trial | None:
        """The next trial, or None when every one is taken or the queue is closed."""
        with self._lock:
            return self._trials.popleft() if self._trials and not self.closed else None

    def close(self) -> None:
        """Start no more trials: the sweep is stopping."""
        with self._lock:
            self.closed = True


@task(name="run-trial", cache_policy=NONE, task_run_name="trial-{trial.index}")
def run_trial(trial: Trial, plan: SweepPlan, launch: Launcher, queue: TrialQueue) -> TrialResult:
    """Wait for the trial's chips, run it with `launch` unless `queue` was closed
    meanwhile, and record how it ended.

    Never raises for the trial's own failure: the sweep goes on and ranks what finished.
    """
    asked = time.time()
    try:
        # strict: a limit deleted since planning must stop the trial, not run it unlimited.
        with concurrency(plan.chip_limit, occupy=trial.chips, strict=True):
            return _admitted(trial, plan, launch, asked, queue)
    except Exception as exc:  # no admission (limit gone, API unreachable): never ran
        return _never_ran(trial, _crashed(exc), asked)


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
                try:
                    chips.enter_context(
                        concurrency(plan.chip_limit, occupy=trial.chips, strict=True)
                    )
                except Exception as exc:  # no admission (limit gone, API unreachable)
                    results.append(_never_ran(trial, _crashed(exc), asked))
                    continue
                held = trial.chips
            results.append(_admitted(trial, plan, launch, asked, queue))
    return results


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
    try:
        outcome = launch(trial, plan)
    except Exception as exc:  # a launcher bug or an API error: this trial only
        outcome = _crashed(exc)
    return _result(trial, outcome, started, datetime.now(UTC), asked)


def _never_ran(trial: Trial, outcome: TrialOutcome, asked: float) -> TrialResult:
    now = datetime.now(UTC)
    return _result(trial, outcome, now, now, asked)


NOT_STARTED = TrialOutcome(
    status="cancelled", error="not started: the sweep was interrupted (Ctrl-C or SIGTERM)"
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


def run_trials(plan: SweepPlan, launch: Launcher) -> list[TrialResult]:
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
            Before, the threads went on starting and running every trial, and the sweep
            ended minutes later with nothing recorded. A second signal stops the wait.
    """
    queue, stopping = TrialQueue(plan.trials), threading.Event()
    token = STOPPING.set(stopping)  # submitted tasks run in copies of this context
    try:
        if plan.max_parallel >= len(plan.trials):
            futures = [run_trial.submit(trial, plan, launch, queue) for trial in plan.trials]
        else:
            futures = [run_lane.submit(n, queue, plan, launch) for n in range(plan.max_parallel)]
        try:
            results = _gather(futures)
        except BaseException as exc:
            queue.close()
            stopping.set()
            get_run_logger().warning(
                "sweep interrupted: no trial starts now; waiting for those under way%s "
                "(signal again to stop waiting)",
                " (deployed: they run to their end)" if plan.via == "deployment" else "",
            )
            results = _gather(futures)
            ran, now = {r.index for r in results}, time.time()
            results += [_never_ran(t, NOT_STARTED, now) for t in plan.trials if t.index not in ran]
            raise SweepInterrupted(sorted(results, key=lambda r: r.index), exc) from exc
    finally:
        STOPPING.reset(token)
    return sorted(results, key=lambda r: r.index)


def _gather(futures: list) -> list[TrialResult]:
    """Every future's results (a trial's `TrialResult`, or a lane's list of them).

    Waits a second at a time: a signal delivered to another thread of the process does
    not wake a wait, and Python runs its handler only once this thread runs again.
    """
    while wait([f.wrapped_future for f in futures], timeout=1.0).not_done:
        pass
    results = []
    for future in futures:
        value = future.result()
        results.extend(value if isinstance(value, list) else [value])
    return results


def launch_deployment(trial: Trial, plan: SweepPlan) -> TrialOutcome:
    """Run the trial as a run of `plan.trial_deployment`, on whichever worker serves its
    pool, linked to the sweep as a subflow; its `runs` row is read from the metrics sink."""
    flow_run = run_deployment(
        plan.trial_deployment,
        parameters={"config": trial.config.model_dump(mode="json")},
        flow_run_name=trial.run_name,
        # A retried trial task finds the run it created instead of starting another; a
        # sweep run again (another flow run) starts new runs, which resume the trials.
        idempotency_key=f"{plan.flow_run_id or plan.sweep_id}-{trial.index}",
        poll_interval=DEPLOYMENT_POLL_S,
        tags=["sweep", plan.sweep_id],
    )
    state = flow_run.state
    status = _status(state.type.value if state else "CRASHED")
    if status != "completed":
        error = state.message if state else "no state"
        return TrialOutcome(status=status, flow_run_id=str(flow_run.id), error=error)
    run = read_run(plan.base, trial.run_name)
    # A worker with another metrics sink than the sweep's would leave nothing to rank by.
    error = None if run else f"completed, but run {trial.run_name} is not in the metrics sink"
    return TrialOutcome(status=status, flow_run_id=str(flow_run.id), error=error, run=run)


def outcome_from_state(state: Any) -> TrialOutcome:
    """The outcome of an in-process trial from its subflow's final state."""
    status = _status(state.type.value)
    run = state.result(raise_on_failure=False) if status == "completed" else None
    return TrialOutcome(
        status=status,
        flow_run_id=str(state.state_details.flow_run_id),
        error=None if status == "completed" else state.message,
        run=run if isinstance(run, RunRow) else None,
    )


def read_run(base: PipelineConfig, run_id: str) -> RunRow | None:
    """The trial's `runs` row from the sweep's metrics sink."""
    return build_sink(base.metrics.sink, metrics_path(base), base.metrics).read_run(run_id)


def _crashed(exc: Exception) -> TrialOutcome:
    return TrialOutcome(status="crashed", error=f"{type(exc).__name__}: {exc}")


def _status(state_type: str) -> TrialStatus:
    return {
        "COMPLETED": "completed",
        "CANCELLED": "cancelled",
        "CANCELLING": "cancelled",
        "CRASHED": "crashed",
    }.get(state_type, "failed")


def completed(results: Iterable[TrialResult]) -> list[TrialResult]:
    """The trials whose run completed."""
    return [r for r in results if r.status == "completed"]
