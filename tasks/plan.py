"""Where a run lives and what it is called, decided once, before anything costs money."""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import secrets
import time
from datetime import UTC, datetime

from etils import epath
from pydantic import BaseModel, Field

from infra.slices import registry_dir
from workloads.config import PipelineConfig, WorkloadConfig
from workloads.config_file import ConfigError
from workloads.events import EventLog
from workloads.rundir import CONFIG, write_json_atomic

MANAGED_BY = "tpupipe"
# A directory on this machine holding the compilation cache of every run whose workload
# runs here (local slices), whatever its storage root: see `compile_cache_dir`.
COMPILE_CACHE_ENV = "TPUPIPE_COMPILE_CACHE"
# The label naming, by a hash, the storage root a slice's run writes to (see `slice_labels`).
ROOT_LABEL = "run-root"


class RunPlan(BaseModel):
    """The resolved identity and paths of one run."""

    run_id: str = Field(description="Identity of the run; equals its run_name.")
    run_name: str
    storage_root: str
    run_dir: str
    datasets_root: str
    compile_cache_dir: str
    slices_root: str
    metrics_path: str
    config_hash: str
    slice_name: str
    flow_run_id: str | None = None
    # A rerun whose sources changed only their versions (`tasks.rerun.check_resumable`): the
    # dataset it trained on, whose shards the one sharded now must equal before it resumes.
    same_records_as: str | None = None


def run_events(plan: RunPlan, attempt: int | None) -> EventLog:
    """The orchestrator's log of one attempt of `plan`'s run (None: of no attempt, which
    the ledger counts no time for), stamped with its flow run (the invocation)."""
    return EventLog(plan.run_dir, attempt, source="orchestrator", invocation=plan.flow_run_id)


def new_run_name(now: datetime | None = None, token: str | None = None) -> str:
    """A fresh, sortable run name: `run-20261122-061530-a1b2`."""
    now = now or datetime.now(UTC)
    return f"run-{now:%Y%m%d-%H%M%S}-{token or secrets.token_hex(2)}"


def slice_name(run_name: str) -> str:
    """The slice name of a run: `tpupipe-<run_name>`, or, when that passes the 63 characters
    a GCP resource name may have, its first 54 characters and a hash of the whole run name.

    Cutting the name alone gave run names alike in their first 55 characters one slice
    name (a sweep's trials t100..t109 under a long sweep name), and every attempt deletes
    a slice of its name before creating one: one run deleted another's live slice.
    """
    name = f"{MANAGED_BY}-{run_name}"
    if len(name) <= 63:
        return name
    digest = hashlib.sha256(run_name.encode()).hexdigest()[:8]
    return f"{name[:54].rstrip('-')}-{digest}"


def is_gcs(path: str) -> bool:
    """True for a `gs://` URI."""
    return path.startswith("gs://")


def _local_root(config: PipelineConfig) -> str:
    # What must stay on this machine (the local slice registry, a DuckDB file) lives under
    # the storage root when it is a directory, and under ./.tpupipe when it is in GCS.
    root = config.storage.root
    return os.path.abspath(".tpupipe" if is_gcs(root) else root)


def metrics_path(config: PipelineConfig) -> str:
    """Where metrics land: the DuckDB file (absolute), or `bigquery:project.dataset`."""
    if config.metrics.sink == "bigquery":
        return f"bigquery:{config.metrics.project or '(default project)'}.{config.metrics.dataset}"
    default = os.path.join(_local_root(config), "metrics.duckdb")
    return os.path.abspath(config.metrics.path or default)


def compile_cache_dir(config: PipelineConfig, default: str) -> str:
    """The JAX compilation cache of a run: `default` (its storage root's `compile_cache/`),
    or, for a run on local slices, the directory TPUPIPE_COMPILE_CACHE names (checked with
    the run's other local places, `tasks.prepare.check_local_paths`, not here: a reaper
    building a plan to delete slices has no use for it).

    Why: a cold start compiles every program again (10 s of a 15 s attempt of the tiny
    config here), and roots are many where runs are short: one per CI job or test, one
    per experiment. Programs are keyed by their HLO, devices and JAX version, so any run
    may share them. A Cloud TPU slice's workers cannot read this machine's directory, so
    a gcp run keeps its root's.
    """
    shared = shared_compile_cache(config)
    return default if shared is None else os.path.abspath(shared)


def shared_compile_cache(config: PipelineConfig) -> str | None:
    """TPUPIPE_COMPILE_CACHE as set, when it applies to `config` (a run on local slices)."""
    shared = os.environ.get(COMPILE_CACHE_ENV)
    return shared if shared and config.slice.provider == "local" else None


def plan_run(config: PipelineConfig, flow_run_id: str | None = None) -> RunPlan:
    """Resolve names and paths; the run id is the run name, so a rerun resumes it.

    Raises:
        ConfigError: a Cloud TPU slice with a local storage root (its workers could not
            read it).
    """
    run_name = config.run_name or new_run_name()
    gcs = is_gcs(config.storage.root)
    if config.slice.provider == "gcp" and not gcs:
        raise ConfigError(
            f"slice.provider = 'gcp' needs storage.root in GCS (gs://bucket/prefix), not "
            f"{config.storage.root!r}: the TPU workers read and write the run directory"
        )
    root = config.storage.root.rstrip("/") if gcs else os.path.abspath(config.storage.root)
    join = posixpath.join if gcs else os.path.join
    run_dir = join(root, "runs", run_name)
    return RunPlan(
        run_id=run_name,
        run_name=run_name,
        storage_root=root,
        run_dir=run_dir,
        datasets_root=join(root, "datasets"),
        compile_cache_dir=compile_cache_dir(config, join(root, "compile_cache")),
        slices_root=_local_root(config),
        metrics_path=metrics_path(config),
        config_hash=config.config_hash(),
        slice_name=slice_name(run_name),
        flow_run_id=flow_run_id,
    )


def write_workload_config(config: PipelineConfig, plan: RunPlan, dataset_dir: str) -> str:
    """Write the run's resolved config.json, which the workload reads; returns its path.

    Training fields never change under a run (`tasks.rerun.check_resumable` guarantees
    it); where and how it runs (mesh, slice, eval, log and checkpoint cadence) may differ
    between attempts, so the file is rewritten.
    """
    path = epath.Path(plan.run_dir) / CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    wcfg = WorkloadConfig(
        pipeline=config.model_copy(update={"run_name": plan.run_name}),
        run_id=plan.run_id,
        run_dir=plan.run_dir,
        dataset_dir=dataset_dir,
        compile_cache_dir=plan.compile_cache_dir,
        config_hash=plan.config_hash,
    )
    write_json_atomic(path, json.loads(wcfg.model_dump_json()))
    return os.fspath(path)


def slice_log_path(config: PipelineConfig, plan: RunPlan) -> str:
    """Where the slice's workload logs (host 0's; host i's beside it): the run directory's
    `logs/`, or for a local slice of a `gs://` root, this machine's
    `<slices_root>/logs/<run_name>/`. Its processes write a local file: the run
    directory's URI made one under the working directory, named `gs:/<bucket>/...`."""
    if config.slice.provider == "local" and is_gcs(plan.run_dir):
        return os.path.join(plan.slices_root, "logs", plan.run_name, f"{plan.slice_name}.log")
    return f"{plan.run_dir}/logs/{plan.slice_name}.log"


def owned_places(plan: RunPlan) -> dict[str, str]:
    """What the pipeline writes for its runs, each with the setting that places it, as
    `workloads.listing.resolve_sources` leaves it out of a dataset's sources: directories
    (ending in "/") and the DuckDB metrics file with the files DuckDB makes beside it.

    Why: with the storage root inside a source directory or prefix (`storage.root:
    gs://bucket/tpupipe`, `sources: [gs://bucket/]`), a run sharded its own lock object
    into its dataset, and every rerun was refused, its compile cache and checkpoints now
    "added" sources. Only what a run writes: a user's own `notes.txt` beside the metrics
    file, or a `logs/` under a local root (a run's logs are in its run directory), is corpus.
    """
    gcs = is_gcs(plan.storage_root)
    join = posixpath.join if gcs else os.path.join
    # compile_cache/ also where TPUPIPE_COMPILE_CACHE moves this run's: another's is there.
    names = ["runs", "datasets", "locks", "compile_cache"]
    owned = {join(plan.storage_root, name, ""): "storage.root" for name in names}
    if not gcs:  # a gs:// root's local registry is in ./.tpupipe, which walks skip (hidden)
        owned[os.path.join(registry_dir(plan.slices_root), "")] = "storage.root"
    owned.setdefault(join(plan.compile_cache_dir, ""), COMPILE_CACHE_ENV)
    if not plan.metrics_path.startswith("bigquery:"):
        default = plan.metrics_path == os.path.join(plan.slices_root, "metrics.duckdb")
        setting = "storage.root" if default else "metrics.path"
        for beside in ("", ".wal"):
            owned[plan.metrics_path + beside] = setting
        owned[plan.metrics_path + ".tmp/"] = setting  # DuckDB's spill directory
    return owned


def root_tag(plan: RunPlan) -> str:
    """A label value standing for the run's storage root (a hash: a label holds 63
    lowercase characters at most, which a `gs://` URI need not fit)."""
    return hashlib.sha256(plan.storage_root.encode()).hexdigest()[:16]


def slice_labels(
    plan: RunPlan, attempt: int | None = None, ttl_s: float | None = None, now: float | None = None
) -> dict[str, str]:
    """Labels every slice of this run carries, so hooks and reapers can find it.

    `ttl` is the epoch second after which the reaper deletes the slice whatever else it
    knows: the backstop when an orchestrator died and its flow run's state is stale.
    `run-root` tells the slices of one run name under two storage roots apart: they share
    the slice name (two buckets' `nightly` in one project's zone), and neither run may
    delete the other's slice (`tasks.own_slice`).
    """
    labels = {"managed-by": MANAGED_BY, "run-id": plan.run_id, ROOT_LABEL: root_tag(plan)}
    if ttl_s is not None:
        labels["ttl"] = str(int((now if now is not None else time.time()) + ttl_s))
    if plan.flow_run_id:
        labels["flow-run-id"] = plan.flow_run_id
    if attempt:
        labels["attempt"] = str(attempt)
    return labels
