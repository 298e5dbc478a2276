"""Validate the config and shard the dataset: everything that happens before a slice exists."""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from typing import Any
from uuid import UUID

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NONE

from infra.storage import source_storage
from tasks.access import check_backend_access, check_slice_access
from tasks.corpus import shard_corpus
from tasks.local_places import check_local_paths
from tasks.plan import RunPlan, owned_places, plan_run, write_workload_config
from tasks.pricing import price_for
from tasks.remote import check_gcs_places, publish_dataset
from tasks.rerun import check_resumable, same_records_result
from tasks.run_owner import check_run_owner
from workloads import data
from workloads.config import PipelineConfig
from workloads.config_file import ConfigError
from workloads.config_memory import eval_memory_problem, host_memory_bytes, memory_problems
from workloads.data import DatasetError
from workloads.dataset_cache import cache_root
from workloads.sources import DatasetWriteError
from workloads.splits import lopsided_split

__all__ = [
    "ArtifactProgress",
    "DatasetError",
    "DatasetWriteError",
    "check_backend_access",
    "check_inputs",
    "check_local_paths",
    "check_memory",
    "check_same_records",
    "check_slice_access",
    "shard_corpus",
    "shard_dataset",
    "validate_config",
]

# Share of the progress bar each sharding stage fills (writing shards is the slower part).
STAGE_SPAN = {"tokenize": (0.0, 40.0), "write": (40.0, 100.0)}


class ArtifactProgress:
    """A `progress(stage, done, total)` callback that moves a Prefect progress artifact.

    Updates are API calls, so they are sent only when the bar moves by `min_step` percent
    (and always at 100).
    """

    def __init__(
        self,
        description: str,
        create: Callable[..., UUID] = create_progress_artifact,
        update: Callable[..., Any] = update_progress_artifact,
        min_step: float = 2.0,
    ):
        self._update, self._min_step = update, min_step
        self._artifact = create(progress=0.0, description=description)
        self.percent = 0.0

    def __call__(self, stage: str, done: int, total: int) -> None:
        lo, hi = STAGE_SPAN[stage]
        percent = lo + (hi - lo) * (done / total if total else 1.0)
        if percent - self.percent >= self._min_step or (percent >= 100.0 > self.percent):
            self._update(self._artifact, progress=percent)
            self.percent = percent

    def finish(self) -> None:
        """Fill the bar (a cache hit reports no stages)."""
        if self.percent < 100.0:
            self._update(self._artifact, progress=100.0)
            self.percent = 100.0


def shard_root(plan: RunPlan) -> str:
    """The local directory the run's dataset is sharded under: its datasets root, or the
    local cache when that root is in GCS (ArrayRecord writes local files, published after).
    `check_inputs` fingerprints the dataset with the same root, so the two agree."""
    return cache_root() if "://" in plan.datasets_root else plan.datasets_root


def check_inputs(
    config: PipelineConfig, plan: RunPlan, remote: bool = True, listed: dict | None = None
) -> tuple[RunPlan, int]:
    """What the config points at, checked before anything is spent: every source resolves,
    the tokenizer file loads, and a rerun of an existing run trains the same thing on the
    same dataset.

    Args:
        config: The validated config.
        plan: Its run plan (`tasks.plan.plan_run`).
        remote: False skips what needs cloud access (`gs://` sources, a `gs://` run
            directory): `tpupipe validate` checks what this machine can see.
        listed: Where a caller checking many configs (a sweep's trials) keeps the sources
            already listed, by dataset options and root: trials of one corpus list it once.

    Returns:
        The plan to run with (see `check_resumable`) and the number of source files found.

    Raises:
        ConfigError / DatasetError: naming the field, file or source at fault.
    """
    check_local_paths(config, plan)
    listed = {} if listed is None else listed
    key = (config.dataset.model_dump_json(), shard_root(plan), remote)
    if key not in listed:
        listed[key] = _resolve(config.dataset, shard_root(plan), remote, owned_places(plan))
    files, fingerprint = listed[key]
    if remote or "://" not in plan.run_dir:
        plan = check_resumable(config, plan, fingerprint, files)
    return plan, len(files)


def _resolve(dataset, out_root: str, remote: bool, owned: dict) -> tuple[list, str | None]:
    """The source files `check_inputs` sees, and the dataset's fingerprint when every
    source was listed (else None)."""
    # file:// is this machine's: checked without cloud access too (validate called a
    # missing one valid, "checked when the run starts": probe Z).
    sources = [s for s in dataset.sources if remote or not s.startswith("gs://")]
    store = source_storage(sources)
    if sources == dataset.sources:  # all of them: the dataset this run would train on
        _, files, fingerprint = data.resolve_dataset(dataset, out_root, store, owned)
        return files, fingerprint
    files = data.resolve_sources(sources, store, out_root, owned) if sources else []
    data.load_tokenizer(dataset.tokenizer)  # a missing tokenizer file fails here, for free
    return files, None


def check_memory(config: PipelineConfig, host_bytes: int | None) -> None:
    """The model's training state fits the slice's devices (`workloads.config_memory`).

    Args:
        config: The validated config.
        host_bytes: The memory of the machine a local slice runs on; None skips the check
            of a local slice (a gcp slice is checked against its chips' HBM).

    Raises:
        ConfigError: naming the fields that drive the estimate, the estimate and the limit.
    """
    problems = memory_problems(config, host_bytes)
    if problems:
        raise ConfigError("\n".join(problems))


@task(name="validate-config", cache_policy=NONE)
def validate_config(config: PipelineConfig, flow_run_id: str | None = None) -> RunPlan:
    """Checks that cost nothing: field and cross-field rules (already enforced when the
    config was built), that every source resolves, that a rerun trains the same thing, that
    the run name has not landed from another run directory (`tasks.run_owner`), that
    the cloud backends' credentials resolve and an existing BigQuery dataset is in
    metrics.location (`tasks.access`), that the `gs://` storage root's bucket and a gcp
    slice's wheel exist (`tasks.remote`), that the price table (`cost.price_table`) reads,
    and that the model's training state fits the slice's devices (`check_memory`: this task
    runs where a local slice does).

    Raises:
        ConfigError / DatasetError: naming the field, file or source at fault.
    """
    # Re-validating catches a config mutated after construction (e.g. by a caller).
    config = PipelineConfig.model_validate(config.model_dump())
    check_memory(config, host_memory_bytes())
    plan = plan_run(config, flow_run_id)
    check_backend_access(config, plan)  # credentials resolve, before any call that needs them
    check_gcs_places(config)  # a missing bucket or wheel: before any source is read
    plan, files = check_inputs(config, plan)
    check_run_owner(config, plan)  # another run's landed rows under this name
    price = price_for(config)
    logger = get_run_logger()
    logger.info("run %s: %d source files, run directory %s", plan.run_id, files, plan.run_dir)
    logger.info("cost: %d chips, %s", price.chips, price.describe())
    return plan


@task(name="check-same-records", cache_policy=NONE)
def check_same_records(config: PipelineConfig, plan: RunPlan) -> None:
    """For a rerun whose sources changed only their versions (`plan.same_records_as`):
    shard them now and refuse the rerun unless the shards are the ones it trained on
    (`tasks.rerun.same_records_result`). A refusal of the inputs, like the validate
    stage's: the flow calls this before anything is provisioned or landed (a same-size
    edit landed a completed run's row as failed). The shard stage then finds the dataset
    built.

    Raises:
        ConfigError: naming the files, when the shards differ.
    """
    if plan.same_records_as is None:
        return
    progress = ArtifactProgress(f"Sharding the sources of run {plan.run_id} to compare them")
    result = shard_corpus(config.dataset, shard_root(plan), progress, owned=owned_places(plan))
    progress.finish()
    same_records_result(plan, result)


# No Prefect cache policy: the dataset's manifest is the cache. It is checked where the
# data lives, so it is right for the CLI, for another orchestrator process or machine, after
# the Prefect database is reset, and when someone deleted the shards (a Prefect cache would
# return a path to nothing). The fingerprint that names the directory is what a cache key
# would hash anyway, and a hit costs one stat per source file.
@task(name="shard-dataset", cache_policy=NONE)
def shard_dataset(config: PipelineConfig, plan: RunPlan) -> str:
    """Shard the corpus to ArrayRecord (a no-op when the fingerprint's manifest exists)
    and write the run's config.json pointing at it; returns the config path.

    A Prefect progress artifact follows the sharding."""
    progress = ArtifactProgress(f"Sharding the dataset for run {plan.run_id}")
    remote = "://" in plan.datasets_root
    built = shard_corpus(config.dataset, shard_root(plan), progress, owned=owned_places(plan))
    progress.finish()
    # A rerun over sources touched since goes on over the dataset it trained on, if the
    # one just sharded holds its records.
    result = same_records_result(plan, built, say=False)  # said by `check_same_records`
    if remote:  # under that dataset's name: the shards built here are its shards
        name = posixpath.basename(result.dataset_dir.rstrip("/"))
        dataset_dir = publish_dataset(built.dataset_dir, plan.datasets_root, config, name=name)
        result = data.ShardResult(dataset_dir, result.manifest, result.cached)
    splits = result.manifest["splits"]
    vocab = result.manifest["tokenizer"]["vocab_size"]
    # Known once the split is: a batch larger than memory failed only after training.
    problem = eval_memory_problem(config, splits["eval"]["records"], vocab, host_memory_bytes())
    if problem:
        raise ConfigError(problem)
    get_run_logger().info(
        "dataset %s (%s): %d train / %d eval sequences",
        result.dataset_dir,
        "cached" if result.cached else "written",
        splits["train"]["records"],
        splits["eval"]["records"],
    )
    if lopsided := lopsided_split(result.manifest, config.dataset.eval_fraction):
        get_run_logger().warning("dataset %s: %s", result.dataset_dir, lopsided)
    return write_workload_config(config, plan, result.dataset_dir)
