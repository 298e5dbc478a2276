"""Provision a slice running the workload, watch it to the end, and tear it down.

The orchestrator never talks to the workload directly: it reads the slice's state and
exit code from the provider and the heartbeat from the run directory.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from prefect import get_run_logger, runtime, task
from prefect.cache_policies import NONE

from infra.slices import SliceSpec, SliceState, build_provider
from tasks.plan import RunPlan, slice_labels
from workloads.config import PipelineConfig
from workloads.rundir import RunDir
from workloads.train import PREEMPTED_EXIT


class WorkloadFailed(RuntimeError):
    """The workload exited with an error: a bug or bad state, not worth a retry."""


class WorkloadPreempted(RuntimeError):
    """The slice was preempted or the workload exited after a preemption notice."""


@dataclass(frozen=True)
class TrainOutcome:
    """How a training attempt ended."""

    slice_name: str
    exit_code: int
    final_step: int | None
    seconds: float


def _provider(config: PipelineConfig, plan: RunPlan):
    return build_provider(config.slice.provider, plan.slices_root, config.slice)


def workload_command(config_path: str) -> list[str]:
    """The argv that runs the workload: the same module on every kind of slice."""
    return [sys.executable, "-m", "workloads.train", "--config", config_path]


@task(name="provision-slice", cache_policy=NONE)
def provision_slice(config: PipelineConfig, plan: RunPlan, config_path: str) -> str:
    """Create the slice for this run with the workload as its job; returns its name."""
    provider = _provider(config, plan)
    # A slice of this name left by a crashed orchestrator would block the create.
    provider.delete(plan.slice_name)
    spec = SliceSpec(
        name=plan.slice_name,
        labels=slice_labels(plan, attempt=runtime.task_run.run_count),
        devices=config.slice.devices,
        hosts=config.slice.hosts,
        command=workload_command(config_path),
        env={},
        log_path=f"{plan.run_dir}/logs/{plan.slice_name}.log",
    )
    status = provider.create(spec)
    get_run_logger().info("slice %s is %s", status.name, status.state.value)
    return status.name


def watch_slice(
    provider,
    name: str,
    run_dir: RunDir,
    poll_s: float,
    heartbeat_timeout_s: float,
    log: Callable[[str], None],
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> TrainOutcome:
    """Wait until the workload on slice `name` exits; raise on failure or preemption."""
    started = clock()
    last_step = None
    while True:
        status = provider.status(name)
        heartbeat = run_dir.read_status() or {}
        step = heartbeat.get("step")
        if step != last_step and step is not None:
            log(f"step {step} loss {heartbeat.get('loss')} ({heartbeat.get('phase')})")
            last_step = step
        if status.state in (SliceState.PREEMPTED, SliceState.NOT_FOUND):
            raise WorkloadPreempted(f"slice {name} is {status.state.value} at step {step}")
        if status.state == SliceState.TERMINATED:
            break
        beat = heartbeat.get("time", started)
        if clock() - max(beat, started) > heartbeat_timeout_s:
            raise WorkloadFailed(
                f"no heartbeat from slice {name} for {heartbeat_timeout_s:.0f}s "
                f"(slice.heartbeat_timeout_s); last phase {heartbeat.get('phase')!r}"
            )
        sleep(poll_s)
    code = status.exit_code
    final = run_dir.read_status() or {}
    if code == 0:
        return TrainOutcome(name, 0, final.get("step"), clock() - started)
    if code == PREEMPTED_EXIT:
        raise WorkloadPreempted(f"workload on {name} saved step {final.get('step')} and exited")
    raise WorkloadFailed(
        f"workload on slice {name} exited with code {code}: "
        f"{final.get('error') or 'see the slice log'}"
    )


@task(name="train", cache_policy=NONE)
def train(config: PipelineConfig, plan: RunPlan, slice_name: str) -> TrainOutcome:
    """Watch the training workload on the slice until it finishes."""
    logger = get_run_logger()
    outcome = watch_slice(
        _provider(config, plan),
        slice_name,
        RunDir(plan.run_dir),
        config.slice.poll_interval_s,
        config.slice.heartbeat_timeout_s,
        logger.info,
    )
    logger.info("training finished at step %s in %.1fs", outcome.final_step, outcome.seconds)
    return outcome


@task(name="teardown-slice", cache_policy=NONE)
def teardown_slice(config: PipelineConfig, plan: RunPlan) -> bool:
    """Delete the run's slice; idempotent, so it is safe whatever happened before."""
    deleted = _provider(config, plan).delete(plan.slice_name)
    get_run_logger().info(
        "slice %s %s", plan.slice_name, "deleted" if deleted else "was already gone"
    )
    return deleted
