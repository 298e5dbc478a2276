"""Validate the config and shard the dataset: everything that happens before a slice exists."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from tasks.plan import RunPlan, check_resumable, plan_run, write_workload_config
from workloads import data
from workloads.config import PipelineConfig


@task(name="validate-config", cache_policy=NONE)
def validate_config(config: PipelineConfig, flow_run_id: str | None = None) -> RunPlan:
    """Checks that cost nothing: field and cross-field rules (already enforced when the
    config was built), that every source resolves, and that a rerun trains the same thing.

    Raises:
        ConfigError / DatasetError: naming the field or source at fault.
    """
    # Re-validating catches a config mutated after construction (e.g. by a caller).
    config = PipelineConfig.model_validate(config.model_dump())
    plan = plan_run(config, flow_run_id)
    files = data.resolve_sources(config.dataset.sources)
    check_resumable(config, plan)
    get_run_logger().info(
        "run %s: %d source files, run directory %s", plan.run_id, len(files), plan.run_dir
    )
    return plan


@task(name="shard-dataset", cache_policy=NONE)
def shard_dataset(config: PipelineConfig, plan: RunPlan) -> str:
    """Shard the corpus to ArrayRecord (a no-op when the fingerprint's manifest exists)
    and write the run's config.json pointing at it; returns the config path."""
    result = data.shard_dataset(config.dataset, plan.datasets_root)
    splits = result.manifest["splits"]
    get_run_logger().info(
        "dataset %s (%s): %d train / %d eval sequences",
        result.dataset_dir,
        "cached" if result.cached else "written",
        splits["train"]["records"],
        splits["eval"]["records"],
    )
    return write_workload_config(config, plan, result.dataset_dir)
