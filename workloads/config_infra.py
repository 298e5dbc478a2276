"""Config of where a run stores things: storage, metrics sink, and how its slice time is
priced. The slice itself is workloads/config_slice.py (re-exported here).

Part of `PipelineConfig` (workloads/config.py); split out to keep each file readable.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from workloads.config_slice import REGION, SliceConfig, tpu_topology
from workloads.config_types import Float, ProjectId
from workloads.config_types import StrictModel as _Strict

__all__ = ["CostConfig", "MetricsConfig", "SliceConfig", "StorageConfig", "tpu_topology"]

# BigQuery's multi-regions; every other BigQuery location is a region name.
_BQ_MULTI_REGIONS = ("US", "EU")


class StorageConfig(_Strict):
    """Where datasets, run directories and checkpoints live."""

    root: str = Field(
        ".tpupipe", description="Storage root: a local directory or gs://bucket/prefix."
    )
    project: ProjectId = Field(
        None, description="gs://: project billed for requests (None: the credentials')."
    )
    credentials_block: str | None = Field(
        None,
        description="gs://: name of a prefect-gcp GcpCredentials block (None: Application "
        "Default Credentials).",
    )
    compile_cache_gb: Float | None = Field(
        20.0,
        gt=0,
        description="Most the JAX compilation cache of a local storage root (its "
        "compile_cache/, shared by every run there) may hold, in GB: past it the least "
        "recently used programs are deleted. None: no limit. The bound is the directory's: "
        "every run writing to it (TPUPIPE_COMPILE_CACHE: every local run) evicts down to its "
        "own, so the smallest governs. A gs:// root's cache is bounded by a bucket lifecycle "
        "rule instead (docs/gcp.md).",
    )

    @field_validator("root")
    @classmethod
    def _a_place_runs_can_live(cls, value: str) -> str:
        if (problem := place_problem(value, "storage.root")) is not None:
            raise ValueError(problem)
        return value


def place_problem(value: str, name: str, local_only: bool = False) -> str | None:
    """What is wrong with `value`, given as `name`, as a place for runs or datasets (a local
    directory or gs://bucket/prefix; with `local_only`, a local directory), or None.

    Anything but gs:// is a local path, so these became odd local directories: `s3://b/x`
    was ./s3:/b/x, `~/x` was ./~/x (nothing expands ~) and an empty value was the working
    directory, where a run then wrote its checkpoints (and `tpupipe shard --out "$UNSET"`
    its dataset) silently. Where only a local directory will do (TPUPIPE_COMPILE_CACHE), a
    `gs://` value became the local directory ./gs:/bucket/prefix the same way.
    """
    wanted = "a directory" if local_only else "a directory or gs://bucket/prefix"
    if not value.strip():
        return f"{name} is empty: give {wanted}"
    if value != value.strip():
        # ' /data' was the directory './ /data' under the working directory, silently.
        return f"{name} {value!r} begins or ends with whitespace: give {wanted} without it"
    if local_only and "://" in value:
        return f"{name} {value!r} is not a directory on this machine: give {wanted}"
    if value.startswith("gs://") and not value[5:].split("/", 1)[0]:
        return f"{name} {value!r} names no bucket"
    if (problem := gs_place_problem(value)) is not None:
        return f"{name} {value!r}: {problem}"
    scheme = value.split("://", 1)[0] if "://" in value else None
    if scheme is not None and scheme != "gs":
        return (
            f"{name} {value!r}: {scheme}:// is not supported; give a local directory or "
            "gs://bucket/prefix"
        )
    if value.startswith("~"):
        return (
            f"{name} {value!r} starts with ~, which is not expanded here: give the "
            "directory's absolute path (or one relative to the working directory)"
        )
    return unexpanded(value, name)


_VARIABLE = re.compile(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?")


def unexpanded(value: str, name: str) -> str | None:
    """'{name} ... holds $HOME ...' if `value` holds an environment variable, else None:
    nothing expands one here, so `$HOME/x` was the local directory ./$HOME/x."""
    if (found := _VARIABLE.search(value)) is None:
        return None
    return (
        f"{name} {value!r} holds {found.group()}, an environment variable, which is not "
        "expanded here: give the path itself"
    )


# Cloud Storage's bucket names: lowercase letters, digits, "-", "_" and ".", 3-222 long.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")


def gs_place_problem(value: str) -> str | None:
    """What is wrong with `value` as a `gs://bucket/prefix` place, or None (also for a
    local path). Each became something else: `gs:/b/x` (one slash) the local directory
    ./gs:/b/x, a bucket name Cloud Storage refuses a traceback, and `gs://b//x` or
    `gs://b/a/../x` objects literally named so."""
    if value.lower().startswith("gs:") and not value.startswith("gs://"):
        return "not a gs://bucket/prefix URI (as written, a local directory named 'gs:')"
    if not value.startswith("gs://"):
        return None
    bucket, _, prefix = value[5:].partition("/")
    if not bucket:
        return "it names no bucket (gs://bucket/prefix)"
    if not _BUCKET.fullmatch(bucket):
        return (
            f"{bucket!r} is not a bucket name (3-222 lowercase letters, digits, '-', '_' or "
            "'.', starting and ending with a letter or digit)"
        )
    parts = prefix.rstrip("/").split("/") if prefix.rstrip("/") else []
    if any(part in ("", ".", "..") for part in parts):
        return "its path has an empty, '.' or '..' part, which Cloud Storage keeps as a name"
    return None


class MetricsConfig(_Strict):
    """Where metrics land."""

    sink: Literal["duckdb", "bigquery"] = Field(
        "duckdb", description="'duckdb': a DuckDB file; 'bigquery': a BigQuery dataset."
    )
    path: str | None = Field(
        None, description="DuckDB file (default: metrics.duckdb under the storage root)."
    )
    project: ProjectId = Field(
        None, description="bigquery: project of the dataset (None: the credentials')."
    )
    dataset: str = Field(
        "tpupipe", pattern=r"^[A-Za-z0-9_]{1,1024}$", description="bigquery: dataset name."
    )
    location: str = Field(
        "US",
        description="bigquery: location of the dataset: a multi-region (US, EU) or a region "
        "such as us-central1 (not a zone). Checked against an existing dataset before a "
        "slice is provisioned.",
    )
    credentials_block: str | None = Field(
        None,
        description="bigquery: name of a prefect-gcp GcpCredentials block (None: Application "
        "Default Credentials).",
    )

    @field_validator("path")
    @classmethod
    def _a_local_file(cls, value: str | None) -> str | None:
        # Each was taken as a local path: `gs://b/m.duckdb` landed in ./gs:/b/m.duckdb,
        # `~/m.duckdb` in ./~/m.duckdb, and '' (an unset variable) in the default file.
        if value is None:
            return None
        if not value.strip():
            raise ValueError(
                "metrics.path is empty: give a DuckDB file's path, or leave it out for "
                "metrics.duckdb under the storage root"
            )
        if value != value.strip():  # ' /m.duckdb' landed in ./ /m.duckdb (probe P)
            raise ValueError(
                f"metrics.path {value!r} begins or ends with whitespace: give the file's path "
                "without it"
            )
        if "://" in value or value.lower().startswith("gs:"):
            raise ValueError(
                f"metrics.path {value!r} is not a file on this machine: DuckDB metrics are a "
                "local file (for a cloud sink, set metrics.sink: bigquery)"
            )
        if value.startswith("~"):
            raise ValueError(
                f"metrics.path {value!r} starts with ~, which is not expanded here: give the "
                "file's absolute path (or one relative to the working directory)"
            )
        if (problem := unexpanded(value, "metrics.path")) is not None:
            raise ValueError(problem)
        return value

    @field_validator("location")
    @classmethod
    def _location_shape(cls, value: str) -> str:
        # `mars` or a zone passed validation and failed only at landing, after training.
        if value.upper() not in _BQ_MULTI_REGIONS and not REGION.fullmatch(value):
            raise ValueError(
                f"metrics.location {value!r} is not a BigQuery location: US, EU or a "
                "region such as us-central1 (not a zone)"
            )
        return value


# No accelerator is billed a million dollars a chip-hour: past that a figure is a typo, and
# the run's cost of a long run could pass what a float holds (landing failed on an inf).
MAX_USD_PER_CHIP_HOUR = 1e6


class CostConfig(_Strict):
    """How the cost ledger prices the run's chip-hours (it never changes what runs)."""

    price_table: str | None = Field(
        None,
        description="A YAML/JSON price table (USD per chip-hour per TPU family and region, "
        "the shape of tasks/tpu_prices.yaml) replacing the one shipped with tpupipe.",
    )
    usd_per_chip_hour: Float | None = Field(
        None,
        gt=0,
        le=MAX_USD_PER_CHIP_HOUR,
        description="One price per chip-hour for this run (e.g. a committed-use rate); "
        "overrides the price table.",
    )
    priced_as: str | None = Field(
        None,
        description="local: the TPU type this local run stands for, e.g. v5litepod-8; its "
        "chips are priced at cost.region's price. Unset: a local run is not priced.",
    )
    region: str | None = Field(
        None,
        description="local: the region whose price cost.priced_as takes, e.g. us-central1 "
        "(gcp slices are priced in slice.zone's region).",
    )
    capacity: Literal["on-demand", "spot", "reserved"] | None = Field(
        None,
        description="local: the capacity cost.priced_as is priced at (None: "
        "slice.capacity); gcp slices are priced at slice.capacity.",
    )

    @field_validator("priced_as")
    @classmethod
    def _known_tpu(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                tpu_topology(value)
            except ValueError as exc:
                msg = str(exc).replace("slice.accelerator_type", "cost.priced_as")
                raise ValueError(msg) from None
        return value

    @field_validator("region")
    @classmethod
    def _region_shape(cls, value: str | None) -> str | None:
        if value is not None and not REGION.fullmatch(value):
            raise ValueError(f"cost.region {value!r} is not a region name like us-central1")
        return value

    @model_validator(mode="after")
    def _region_with_type(self) -> CostConfig:
        if self.priced_as and not self.region:
            raise ValueError(
                f"cost.priced_as = {self.priced_as!r} needs cost.region (prices differ by "
                "region), e.g. us-central1"
            )
        # Both only say how cost.priced_as is priced: without it they were ignored.
        for name in ("region", "capacity"):
            if getattr(self, name) is not None and not self.priced_as:
                raise ValueError(
                    f"cost.{name} = {getattr(self, name)!r} applies only with cost.priced_as "
                    "(the TPU type a local run stands for); a gcp slice is priced at "
                    "slice.zone's region and slice.capacity"
                )
        return self
