"""Training attempts: provision a slice running the workload, watch it, always delete it.

Retries are Prefect's: `train_attempt` is retried only on `WorkloadPreempted` (budget
`resilience.max_preemptions`), `provision_slice` only on `ProvisioningError` (budget
`resilience.max_failures`, exponential backoff with jitter). An attempt whose workload
never started on its READY slice is retried within both budgets: it failed to come up, as a
create can. Every other error fails the run at once. Each attempt holds a lease on the run
directory and records its events.

Attempts are numbered from the run's ledger, not by Prefect's retry count: a rerun of the
run name (after a failure, after a success, a sweep run again) appends to the same
`events.jsonl`, and its attempts must not reuse the numbers of the earlier invocations.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from prefect import Task, get_run_logger, runtime, task
from prefect.cache_policies import NONE
from prefect.tasks import exponential_backoff

from infra.slices import ProvisioningError, SliceSpec, build_provider
from tasks.attempts import ended_by, next_attempt, stalled_in_a_row
from tasks.goodput import read_events
from tasks.own_slice import clear_slice_name, delete_own_slice
from tasks.plan import RunPlan, run_events, slice_labels, slice_log_path
from tasks.pricing import attempt_pricing
from tasks.progress import TrainingProgress, progress_key
from tasks.watch import (
    TrainOutcome,
    WatchSettings,
    WatchStopped,
    WorkloadFailed,
    WorkloadNeverStarted,
    WorkloadPreempted,
    watch_slice,
)
from workloads import checkpoint
from workloads.config import PipelineConfig
from workloads.events import EVENTS, EventLog, grant_lease, new_lease
from workloads.rundir import RunDir

log = logging.getLogger(__name__)


def _provider(config: PipelineConfig, plan: RunPlan):
    return build_provider(config.slice.provider, plan.slices_root, config.slice)


def _recalling_provider(config: PipelineConfig, plan: RunPlan):
    """The provider, also looking for the run's slice where earlier attempts recorded
    creating it (`placement` on their `provision_requested`): a rerun with another
    `slice.zone` deleted nothing in the old zone, and a node left by a killed orchestrator
    stayed READY, and billed, until its ttl."""
    provider = _provider(config, plan)
    earlier = [
        e["placement"]
        for e in read_events(f"{plan.run_dir}/{EVENTS}")
        if e["event"] == "provision_requested" and isinstance(e.get("placement"), dict)
    ]
    if earlier and (unreachable := provider.recall(plan.slice_name, earlier)):
        get_run_logger().warning(
            "earlier attempts of run %s created slice %s in %s, which this run's settings "
            "cannot reach: delete it there if it still exists",
            plan.run_name,
            plan.slice_name,
            ", ".join(unreachable),
        )
    return provider


def workload_command(config_path: str) -> list[str]:
    """The argv that runs the workload: the same module on every kind of slice."""
    return [sys.executable, "-m", "workloads.train", "--config", config_path]


def budget_spent(retries: int) -> bool:
    """Whether the running task's try is its last: its error ends the run, so the message
    says which budget ran out instead of only what happened this time."""
    return runtime.task_run.run_count > retries


def never_started(plan: RunPlan) -> int:
    """Attempts of this invocation (flow run) whose workload never started."""
    return sum(
        1
        for e in read_events(f"{plan.run_dir}/{EVENTS}")
        if e.get("never_started") and e.get("invocation") == plan.flow_run_id
    )


def _retry_on(*kinds: type[BaseException]):
    def condition(task: Task, task_run, state) -> bool:
        return isinstance(state.result(raise_on_failure=False), kinds)

    return condition


@task(name="provision-slice", cache_policy=NONE)
def provision_slice(
    config: PipelineConfig, plan: RunPlan, config_path: str, attempt: int, lease: str
) -> str:
    """Create the slice for this attempt with the workload as its job; returns its name."""
    provider = _recalling_provider(config, plan)
    events = run_events(plan, attempt)
    # A slice of this name left by a crashed orchestrator would block the create (or, in
    # a zone this attempt does not use, be billed until its ttl): deleted, and its bill
    # recorded for the attempt that left it. One a run under another storage root holds
    # is not ours to delete: SliceNameTaken.
    clear_slice_name(provider, plan, attempt)
    spec = SliceSpec(
        name=plan.slice_name,
        labels=slice_labels(plan, attempt=attempt, ttl_s=config.slice.max_lifetime_s),
        devices=config.slice.devices,
        hosts=config.slice.hosts,
        command=workload_command(config_path),
        env={"TPUPIPE_ATTEMPT": str(attempt), "TPUPIPE_LEASE": lease},
        log_path=slice_log_path(config, plan),
        run_dir=plan.run_dir,
        chaos=config.slice.chaos.model_dump() if config.slice.provider == "local" else None,
    )
    # The attempt's price and slice: a rerun on another slice must not re-price it.
    events.emit("provision_requested", placement=provider.placement(), **attempt_pricing(config))
    try:
        status = provider.create(spec)
    except ProvisioningError as exc:
        events.emit("provision_failed", reason=str(exc))
        get_run_logger().warning("attempt %d: %s", attempt, exc)
        if budget_spent(config.resilience.max_failures):
            raise ProvisioningError(
                f"{exc} (resilience.max_failures = {config.resilience.max_failures} retries "
                "of a failed create, all used)"
            ) from exc
        raise
    events.emit("provision_ready")
    get_run_logger().info("attempt %d: slice %s is %s", attempt, status.name, status.state.value)
    return status.name


@task(name="train-attempt", cache_policy=NONE)
def train_attempt(config: PipelineConfig, plan: RunPlan, config_path: str) -> TrainOutcome:
    """One attempt: provision, watch to the end, and delete the slice whatever happened."""
    # Not `runtime.task_run.run_count`: it starts again at 1 in every flow run. One past the
    # ledger's highest number is unique across invocations, and every event of the attempt
    # carries it: the orchestrator's, and the workload's through TPUPIPE_ATTEMPT.
    attempt = next_attempt(read_events(f"{plan.run_dir}/{EVENTS}"))
    logger = get_run_logger()
    events = run_events(plan, attempt)
    lease = new_lease()
    grant_lease(plan.run_dir, attempt, lease)  # any older attempt must stop writing now
    res = config.resilience
    provision = provision_slice.with_options(
        retries=res.max_failures,
        retry_delay_seconds=exponential_backoff(backoff_factor=res.backoff_s),
        retry_jitter_factor=res.backoff_jitter,
        retry_condition_fn=_retry_on(ProvisioningError),
    )
    provider = _provider(config, plan)
    resumes_from = _newest_step(plan)
    deleted = False
    progress = TrainingProgress(config.train.steps, progress_key(plan.run_id))
    try:
        name = provision(config, plan, config_path, attempt, lease)
        settings = WatchSettings(
            config.slice.poll_interval_s,
            config.slice.heartbeat_timeout_s,
            res.heartbeat_confirm_s,
        )
        outcome = watch_slice(
            provider,
            name,
            RunDir(plan.run_dir),
            settings,
            logger.info,
            progress.update,
            attempt=attempt,
            log_path=slice_log_path(config, plan),
        )
        events.emit("attempt_ended", outcome="completed")
        progress.end("finished", outcome.final_step)
        logger.info("training finished at step %s in %.1fs", outcome.final_step, outcome.seconds)
        return outcome
    except WorkloadNeverStarted as exc:
        # Not a preemption: the slice was fine, its start-up was not. Retried like a failed
        # create, on that smaller budget: re-creating it 21 times on the preemption budget
        # billed 21 slices for 10.5 minutes each, for a wheel the workers could not fetch.
        reason = f"{exc}: its start-up failed or hangs; see {plan.run_dir}/logs/"
        events.emit("attempt_ended", outcome="failed", reason=reason, never_started=True)
        logger.warning("attempt %d: %s", attempt, reason)
        tries = never_started(plan)
        if tries > res.max_failures or budget_spent(res.max_preemptions):
            raise WorkloadFailed(
                f"{reason} ({tries} attempt(s) of this run never started; retried within "
                f"resilience.max_failures = {res.max_failures} and "
                f"resilience.max_preemptions = {res.max_preemptions})"
            ) from exc
        raise
    except WorkloadPreempted as exc:
        # The slice goes first: its delete is a notice (SIGTERM) to a workload that was
        # only late (a paused VM, a stuck write), and one that saves then has progressed.
        # Judged before it, such an attempt was called stalled beside its own new step.
        # The attempt still ended now: its deletion is teardown, not lost time.
        ended, stalled = events.clock(), {}
        deleted = True  # here, not again in `finally`: the flow's teardown tries again
        try:
            _delete_after(provider, plan, events, logger)
            stalled = _stalled(exc, plan, attempt, resumes_from)
        finally:
            # Even when a signal stops the delete (minutes on Cloud TPU): without it, the
            # ledger called the attempt running, then abandoned, and its deletion lost time.
            events.emit("attempt_ended", at=ended, outcome="preempted", reason=str(exc), **stalled)
            progress.end("preempted")
        logger.warning("attempt %d preempted: %s", attempt, exc)
        ledger = read_events(f"{plan.run_dir}/{EVENTS}") if stalled else []
        if (in_a_row := stalled_in_a_row(ledger, plan.flow_run_id)) >= res.max_stalled_attempts:
            # Each retry re-provisions a slice (21 of them with the default budget) for a
            # workload killed at the same step each time: out of memory on its host, say.
            base = stalled["stalled_at"]
            past = (
                f"past the one each resumed from (step {base}, the last)"
                if base
                else "(the run has none yet)"
            )
            raise WorkloadFailed(
                f"{exc}; {in_a_row} attempt(s) in a row were lost without a preemption "
                f"notice before committing a checkpoint {past} "
                f"(resilience.max_stalled_attempts = {res.max_stalled_attempts}): a workload "
                "that dies at the same place each time is more likely out of memory or stuck "
                f"than preempted; see {plan.run_dir}/logs/"
            ) from exc
        if budget_spent(res.max_preemptions):
            newest = _newest_step(plan)  # None: its checkpoints could not be listed
            resume = "from its newest checkpoint"
            if newest is not None:
                resume = (
                    f"{resume} (step {newest})"
                    if newest
                    else "from step 0: it has no checkpoint yet"
                )
            raise WorkloadPreempted(
                f"{exc}; resilience.max_preemptions = {res.max_preemptions} preemption(s) "
                f"tolerated, all used: run it again to resume {resume}"
            ) from exc
        raise
    except BaseException as exc:
        outcome, reason = ended_by(exc, stopped=isinstance(exc, WatchStopped))  # a sweep's
        events.emit("attempt_ended", outcome=outcome, reason=reason)
        progress.end(outcome)
        raise
    finally:
        if not deleted:
            _delete_after(provider, plan, events, logger)


def _newest_step(plan: RunPlan) -> int | None:
    """The run's newest committed checkpoint step (0: none), or None if it cannot be read."""
    try:
        return checkpoint.latest_step(plan.run_dir) or 0
    except Exception as exc:  # progress unknown: no attempt is called stalled for it
        log.warning("could not list the checkpoints of %s: %s", plan.run_dir, exc)
        return None


def _stalled(
    exc: WorkloadPreempted, plan: RunPlan, attempt: int, newest_before: int | None
) -> dict:
    """`{"stalled": True, "stalled_at": step}` for an attempt lost without a notice
    (`exc.announced`) that committed no checkpoint past the one it resumed from (`step`),
    else {}: its `attempt_ended` fields.

    The step it resumed from is its `first_step` event's: the newest step before the
    attempt may have been quarantined as it started, and a new save of that step number
    was then progress, called a stall. An attempt lost before its first step saved nothing.
    """
    if exc.announced or newest_before is None:
        return {}
    now = _newest_step(plan)
    started = [
        e["resumed_from"]
        for e in read_events(f"{plan.run_dir}/{EVENTS}")
        if e["event"] == "first_step" and e.get("attempt") == attempt and "resumed_from" in e
    ]
    base = started[-1] if started else newest_before
    return {"stalled": True, "stalled_at": base} if now is not None and now <= base else {}


def _delete_after(provider, plan: RunPlan, events: EventLog, logger) -> None:
    """Delete the attempt's slice; a failed delete is logged, never raised.

    Raised from this `finally`, it would replace the attempt's own outcome: a preemption
    would fail the run instead of being retried, a finished training would fail. Nothing
    is lost by going on: the next attempt's `provision_slice` deletes a slice of this
    name before creating one, and the flow's `teardown_slice` deletes it again, failing
    the run loudly if it still cannot.
    """
    try:
        deleted = delete_own_slice(provider, plan, logger, running=events.attempt)
    except Exception as exc:  # see the docstring
        logger.warning(
            "could not delete slice %s after the attempt (tried again): %s", plan.slice_name, exc
        )
        return
    if deleted:
        events.emit("deleted")


def train_with_retries(config: PipelineConfig) -> Task:
    """`train_attempt`, retried on preemptions only, up to the config's budget."""
    return train_attempt.with_options(
        retries=config.resilience.max_preemptions,
        retry_delay_seconds=0,
        retry_condition_fn=_retry_on(WorkloadPreempted),
    )


@task(name="teardown-slice", cache_policy=NONE)
def teardown_slice(config: PipelineConfig, plan: RunPlan) -> bool:
    """Delete the run's slice; idempotent, so it is safe whatever happened before."""
    logger = get_run_logger()
    deleted = delete_own_slice(_recalling_provider(config, plan), plan, logger)
    if deleted is not None:
        logger.info("slice %s %s", plan.slice_name, "deleted" if deleted else "was already gone")
    return bool(deleted)


@contextmanager
def slice_torn_down(config: PipelineConfig, plan: RunPlan) -> Iterator[None]:
    """Delete the run's slice once the block ends, however it ends.

    A teardown failing after the block raised is logged by its task and never replaces
    the block's error (Ctrl-C, SIGTERM, a failed attempt): the run would exit 1 instead of
    143, its row name the SliceError and its crash hook not run. That hook and the reaper
    try the slice again.
    """
    try:
        yield
    except BaseException:
        with suppress(Exception):
            teardown_slice(config, plan)
        raise
    teardown_slice(config, plan)
