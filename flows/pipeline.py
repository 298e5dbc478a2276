"""The training pipeline flow: it only wires the stages together and guarantees teardown."""

from __future__ import annotations

from datetime import UTC, datetime

from prefect import flow, runtime

from infra.metrics import RunRow
from tasks.checks import evaluate_checkpoint, verify_checkpoint
from tasks.landing import land_metrics, publish_summary
from tasks.prepare import shard_dataset, validate_config
from tasks.training import provision_slice, teardown_slice, train
from workloads.config import PipelineConfig


@flow(name="tpu-training-pipeline", log_prints=True)
def tpu_training_pipeline(config: PipelineConfig | None = None) -> RunRow:
    """Shard → provision → train → verify → evaluate → land, tearing the slice down
    whatever fails. A failed run still lands a `runs` row with its error."""
    config = config or PipelineConfig()
    started = datetime.now(UTC)
    plan = validate_config(config, str(runtime.flow_run.id or "") or None)
    verified = result = None
    try:
        config_path = shard_dataset(config, plan)
        try:
            provision_slice(config, plan, config_path)
            train(config, plan, plan.slice_name)
        finally:
            teardown_slice(config, plan)
        verified = verify_checkpoint(config, plan)
        result = evaluate_checkpoint(plan, verified.step)
    except Exception as exc:
        land_metrics(config, plan, started, verified, result, error=f"{type(exc).__name__}: {exc}")
        raise
    run = land_metrics(config, plan, started, verified, result)
    publish_summary(config, plan, run)
    return run
