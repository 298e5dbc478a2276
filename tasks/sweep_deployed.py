"""Trials run as runs of a deployment (`trials_via: deployment`): on whichever workers
serve its pool, linked to the sweep as subflows, and cancelled with the sweep."""

from __future__ import annotations

from typing import Any

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterIdempotencyKey,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelling

from tasks.sweep_models import SweepError, SweepPlan, TrialOutcome, read_run, status_of
from tasks.sweep_space import Trial

# How often run_deployment asks the API whether a trial's run has finished.
DEPLOYMENT_POLL_S = 2.0
# A trial's run in one of these states still runs, or will: a cancelled sweep cancels it.
UNDER_WAY = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.PAUSED]


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


def trial_run_key(plan: SweepPlan, index: int) -> str:
    """The idempotency key of trial `index`'s run: a retried trial task finds the run it
    created instead of starting another; a sweep run again (another flow run) starts new
    runs, which resume the trials."""
    return f"{plan.flow_run_id or plan.sweep_id}-{index}"


def launch_deployment(trial: Trial, plan: SweepPlan) -> TrialOutcome:
    """Run the trial as a run of `plan.trial_deployment`, on whichever worker serves its
    pool, linked to the sweep as a subflow; its `runs` row is read from the metrics sink."""
    flow_run = run_deployment(
        plan.trial_deployment,
        parameters={"config": trial.config.model_dump(mode="json")},
        flow_run_name=trial.run_name,
        idempotency_key=trial_run_key(plan, trial.index),
        poll_interval=DEPLOYMENT_POLL_S,
        tags=["sweep", plan.sweep_id],
    )
    state = flow_run.state
    status = status_of(state.type.value if state else "CRASHED")
    if status != "completed":
        error = state.message if state else "no state"
        return TrialOutcome(status=status, flow_run_id=str(flow_run.id), error=error)
    run = read_run(plan.base, trial.run_name)
    # A worker with another metrics sink than the sweep's would leave nothing to rank by.
    error = None if run else f"completed, but run {trial.run_name} is not in the metrics sink"
    return TrialOutcome(status=status, flow_run_id=str(flow_run.id), error=error, run=run)


def cancel_trial_runs(plan: SweepPlan, reason: str) -> list[str]:
    """Cancel the runs of this sweep's trials still under way, as the UI's Cancel button
    does: their workers stop them, and each pipeline's cancellation hook deletes its
    slice. Returns the names of the runs cancelled.

    A deployed trial runs in another process, often on another machine: stopping the
    sweep used to leave it training, its slice billed, until its last step.
    """
    keys = [trial_run_key(plan, t.index) for t in plan.trials]
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                idempotency_key=FlowRunFilterIdempotencyKey(any_=keys),
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=UNDER_WAY)),
            )
        )
        for run in runs:
            client.set_flow_run_state(run.id, Cancelling(message=reason), force=True)
    return [run.name for run in runs]
