"""The sweep flow: trials of the training pipeline as parallel subflows, admitted by a
Prefect global concurrency limit counted in TPU chips.

Run locally, each trial is the pipeline flow called in this process (a subflow). Deployed,
each trial is a run of the `train` deployment (`run_deployment`, still linked as a
subflow), so the trials land on whatever workers serve that deployment's pool.

From a Python script, run it with `run_sweep`, not by calling the flow: a SIGTERM to a
script that calls `sweep(...)` leaves Prefect's temporary API server running for good, and
a SIGHUP kills it before its trials are stopped.
"""

from __future__ import annotations

from functools import partial

from prefect import flow, runtime
from prefect.task_runners import ThreadPoolTaskRunner

from flows import form_parameter
from flows.local_run import orchestrate_here
from flows.pipeline import tpu_training_pipeline
from tasks.landing import INTERRUPTED_WAIT_S
from tasks.sweep import plan_sweep, run_trials, sweep_lock
from tasks.sweep_deployed import launch_deployment
from tasks.sweep_models import SweepInterrupted, SweepPlan, TrialOutcome, outcome_from_state
from tasks.sweep_results import (
    SweepSummary,
    attach_landed_runs,
    land_early,
    land_sweep,
    publish_leaderboard,
    summarize,
)
from tasks.sweep_space import SweepConfig, Trial

# Trials in flight at once (waiting for chips or watching their run); `max_parallel`
# usually keeps it lower, and further trials wait in the runner's queue.
TRIAL_THREADS = 32

# The default sweep, as the UI's run form shows it (`flows.form_parameter`).
DEFAULT_SWEEP = form_parameter(SweepConfig())


def launch(trial: Trial, plan: SweepPlan) -> TrialOutcome:
    """Run one trial where the plan says and report how it ended (never raises for a
    failed run: `return_state` hands back its state instead)."""
    if plan.via == "deployment":
        return launch_deployment(trial, plan)
    pipeline = tpu_training_pipeline.with_options(flow_run_name=trial.run_name)
    return outcome_from_state(pipeline(config=trial.config, return_state=True))


@flow(
    name="tpu-sweep",
    log_prints=True,
    task_runner=ThreadPoolTaskRunner(max_workers=TRIAL_THREADS),
)
def sweep(config: SweepConfig = DEFAULT_SWEEP) -> SweepSummary:
    """Plan the trials, run them under the chip limit, publish the leaderboard and land
    the `sweeps` rows; fails only if no trial completed."""
    plan = plan_sweep(
        config, str(runtime.flow_run.id or "") or None, deployed=bool(runtime.deployment.id)
    )
    with sweep_lock(plan):  # RunInUse if this sweep name is running: nothing started
        try:
            results, interrupted = run_trials(plan, launch, partial(land_early, plan)), None
        except SweepInterrupted as exc:  # Ctrl-C, SIGTERM: record what ran, then stop
            results, interrupted = exc.results, exc.cause
        # A stopped sweep waits for its metrics sink only briefly, as a stopped run does.
        wait = None if interrupted is None else INTERRUPTED_WAIT_S
        results = attach_landed_runs(plan, results, wait)
        publish_leaderboard(plan, results)
        land_sweep(plan, results, wait)
    if interrupted is not None:
        raise interrupted
    return summarize(plan, results)


def run_sweep(config: SweepConfig) -> SweepSummary:
    """Run the sweep from this process as `tpupipe run` runs a pipeline: SIGTERM and SIGHUP
    stop it as Ctrl-C does (its trials stopped, its rows landed, then exit 143 or 129),
    and with no `PREFECT_API_URL` set, the temporary API server it starts goes with it.

    Args:
        config: the sweep: base config, search space and admission.

    Returns:
        The sweep's summary, as the flow returns it.
    """
    with orchestrate_here():
        return sweep(config=config)
