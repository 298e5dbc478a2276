"""Verify the final checkpoint and evaluate it, on the orchestrator's own CPU."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from tasks.plan import RunPlan
from workloads import checkpoint, evaluate
from workloads.config import PipelineConfig, WorkloadConfig
from workloads.rundir import CONFIG


def load_workload_config(plan: RunPlan) -> WorkloadConfig:
    """The resolved config the workload trained with."""
    from etils import epath

    return WorkloadConfig.model_validate_json((epath.Path(plan.run_dir) / CONFIG).read_text())


@task(name="verify-checkpoint", cache_policy=NONE)
def verify_checkpoint(config: PipelineConfig, plan: RunPlan) -> checkpoint.VerifiedCheckpoint:
    """The newest checkpoint must be the final step, from this config, and all finite."""
    verified = checkpoint.verify_checkpoint(plan.run_dir, config.train.steps, plan.config_hash)
    get_run_logger().info(
        "checkpoint step %d verified: %d arrays finite, params sha256 %s",
        verified.step,
        verified.num_arrays,
        verified.params_sha256[:16],
    )
    return verified


@task(name="evaluate", cache_policy=NONE)
def evaluate_checkpoint(plan: RunPlan, step: int) -> evaluate.EvalResult:
    """Loss and bits-per-byte of the verified step on the eval split; writes eval.json."""
    result = evaluate.evaluate(load_workload_config(plan), step)
    evaluate.write_result(plan.run_dir, result)
    get_run_logger().info(
        "eval at step %d: loss %.4f, %.4f bits/byte over %d tokens",
        result.step,
        result.loss,
        result.bits_per_byte,
        result.tokens,
    )
    return result
