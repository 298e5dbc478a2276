"""Verify the final checkpoint and evaluate it, on the orchestrator's own CPU."""

from __future__ import annotations

from functools import partial

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from tasks.plan import RunPlan, run_events
from tasks.watch import WatchStopped, stop_if_requested, stop_requested
from workloads import checkpoint, config_file, evaluate, input
from workloads.config import PipelineConfig, WorkloadConfig
from workloads.config_file import ConfigError
from workloads.rundir import CONFIG
from workloads.sources import DatasetError


def load_workload_config(plan: RunPlan) -> WorkloadConfig:
    """The resolved config the workload trained with.

    Raises:
        ConfigError: naming the file if it does not read as a workload config.
    """
    return config_file.load_workload_config(f"{plan.run_dir}/{CONFIG}")


@task(name="verify-checkpoint", cache_policy=NONE)
def verify_checkpoint(config: PipelineConfig, plan: RunPlan) -> checkpoint.VerifiedCheckpoint:
    """The newest checkpoint must be the final step, from this config, and all finite.

    Raises:
        WatchStopped: the run's sweep is being stopped.
    """
    stop_if_requested("before checkpoint verification")
    verified = _verify_final(config, plan)
    get_run_logger().info(
        "checkpoint step %d verified: %d arrays finite, params sha256 %s",
        verified.step,
        verified.num_arrays,
        verified.params_sha256[:16],
    )
    return verified


@task(name="find-finished-training", cache_policy=NONE)
def finished_training(
    config: PipelineConfig, plan: RunPlan
) -> checkpoint.VerifiedCheckpoint | None:
    """The final checkpoint, verified, if an earlier invocation of this run finished
    training it: then the run provisions nothing (it used to create a slice only for the
    workload to find the run finished, and a TPU slice costs minutes of chips to create).

    None when training is not finished. A final checkpoint that fails verification is
    quarantined and None returned: training resumes from the checkpoint before it.
    """
    final = config.train.steps
    steps = checkpoint.committed_steps(plan.run_dir)
    if final not in steps:
        return None
    logger = get_run_logger()
    for step in [s for s in steps if s > final]:
        # No attempt of this run saves past its last step (train.steps is a training
        # field): a step there was copied in. It made a finished run provision a slice,
        # for its workload only to quarantine it.
        reason = f"step {step} is past train.steps ({final}): no attempt of this run saved it"
        checkpoint.quarantine(plan.run_dir, step, reason)
        run_events(plan, None).emit("quarantined", step=step, reason=reason)
        logger.warning("checkpoint step %d moved to quarantine: %s", step, reason)
    try:
        verified = _verify_final(config, plan)
    except checkpoint.CheckpointError as exc:
        logger.warning("training will resume: %s", exc)
        return None
    logger.info("training finished at step %d already: no slice is provisioned", verified.step)
    return verified


def _verify_final(config: PipelineConfig, plan: RunPlan) -> checkpoint.VerifiedCheckpoint:
    """`checkpoint.verify_checkpoint` of the final step, its data-iterator state included
    (a final checkpoint of a run over other data, copied in, was evaluated and landed), a
    step it quarantines recorded in `events.jsonl` as the workload records its own."""
    data_problem = None
    try:
        dataset_dir = load_workload_config(plan).dataset_dir
        layout = input.saved_layout(dataset_dir, config.train.batch_size, config.seed)
        data_problem = partial(input.layout_problem, layout)
    except (ConfigError, DatasetError) as exc:  # evaluation, next, fails naming it
        get_run_logger().warning("the final checkpoint's data iterator is not checked: %s", exc)

    def recorded(step: int, reason: str) -> None:
        # No attempt's: the ledger counts no time for it, as for a workload run by hand.
        run_events(plan, None).emit("quarantined", step=step, reason=reason)

    return checkpoint.verify_checkpoint(
        plan.run_dir, config.train.steps, plan.config_hash, data_problem, recorded
    )


class EvaluationError(RuntimeError):
    """The eval split could not be read after training (deleted, damaged meanwhile): no
    input to change before a rerun, as a DatasetError before provisioning would be."""


@task(name="evaluate", cache_policy=NONE)
def evaluate_checkpoint(plan: RunPlan, step: int) -> evaluate.EvalResult:
    """Loss and bits-per-byte of the verified step on the eval split; writes eval.json.

    Raises:
        EvaluationError: the dataset, accepted before training, cannot be read now.
        WatchStopped: the run's sweep is being stopped (also between eval batches).
    """
    stop_if_requested("before evaluation")
    try:
        result = evaluate.evaluate(load_workload_config(plan), step, stop=stop_requested)
    except DatasetError as exc:
        raise EvaluationError(f"cannot evaluate step {step}: {exc}") from exc
    except evaluate.EvaluationStopped as exc:
        raise WatchStopped(f"{exc} of step {step}: the sweep was interrupted") from None
    evaluate.write_result(plan.run_dir, result)
    get_run_logger().info(
        "eval at step %d: loss %.4f, %.4f bits/byte over %d tokens",
        result.step,
        result.loss,
        result.bits_per_byte,
        result.tokens,
    )
    return result
