"""Config of where a run executes and stores things: slice, storage, metrics sink, and how
its slice time is priced.

Part of `PipelineConfig` (workloads/config.py); split out to keep each file readable.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from workloads.config_resilience import ChaosConfig
from workloads.config_types import Float, Int, ProjectId
from workloads.config_types import StrictModel as _Strict

# TPU generations: (devices JAX sees per chip-count unit, chips per host on multi-host
# slices, largest single-host slice in chips). The number after the dash in an accelerator
# type counts TensorCores on v4/v5p (two per chip, one JAX device per chip) and chips on
# v5e/v6e.
_TPU_FAMILIES: dict[str, tuple[int, int, int]] = {
    "v4": (2, 4, 4),
    "v5p": (2, 4, 4),
    "v5litepod": (1, 4, 8),
    "v6e": (1, 4, 8),
}
_ACCELERATOR = re.compile(r"^(v4|v5p|v5litepod|v6e)-(\d+)$")
_ZONE = re.compile(r"^[a-z]+-[a-z]+\d+-[a-z]$")
_REGION = re.compile(r"^[a-z]+-[a-z]+\d+$")


def tpu_topology(accelerator_type: str) -> tuple[int, int]:
    """(devices, hosts) of a TPU accelerator type such as `v5litepod-8` or `v4-32`.

    Raises:
        ValueError: for an unknown family or a size that family does not come in.
    """
    match = _ACCELERATOR.match(accelerator_type)
    if not match:
        families = ", ".join(f"{f}-N" for f in _TPU_FAMILIES)
        raise ValueError(f"slice.accelerator_type {accelerator_type!r} is not one of {families}")
    per_chip, chips_per_host, single_host = _TPU_FAMILIES[match[1]]
    size = int(match[2])
    chips = size // per_chip
    single_host_sizes = (4,) if per_chip == 2 else (1, 4, 8)  # chips
    if size % per_chip or not (
        chips in single_host_sizes or (chips > single_host and chips % chips_per_host == 0)
    ):
        raise ValueError(f"slice.accelerator_type {accelerator_type!r}: no such slice size")
    return chips, 1 if chips <= single_host else chips // chips_per_host


class SliceConfig(_Strict):
    """Where the workload runs: local processes, or a Cloud TPU slice."""

    provider: Literal["local", "gcp"] = Field(
        "local",
        description="'local': the workload as processes over virtual CPU devices; 'gcp': a "
        "Cloud TPU VM slice (needs a gs:// storage.root).",
    )
    devices: Int = Field(
        8, ge=1, le=256, description="Devices in the slice (gcp: taken from accelerator_type)."
    )
    hosts: Int = Field(
        1,
        ge=1,
        le=64,
        description="Hosts (one JAX process each) the devices are spread over (gcp: taken "
        "from accelerator_type).",
    )
    poll_interval_s: Float = Field(1.0, gt=0, description="Seconds between slice state checks.")
    heartbeat_timeout_s: Float = Field(
        600.0,
        gt=0,
        description="A running workload silent this long is treated as lost (the slice is "
        "deleted and the attempt retried as a preemption). Keep it above the workload's "
        "start-up and longest compile: it beats only before and after them.",
    )
    project: ProjectId = Field(
        None, description="gcp: project of the TPU (None: the credentials' project)."
    )
    zone: str | None = Field(None, description="gcp: zone to create the TPU in, e.g. us-west4-a.")
    fallback_zones: list[str] = Field(
        default_factory=list,
        description="gcp: zones tried in order when `zone` has no capacity or quota left.",
    )
    accelerator_type: str | None = Field(
        None, description="gcp: TPU type, e.g. v5litepod-8, v4-32, v6e-16."
    )
    runtime_version: str | None = Field(
        None, description="gcp: TPU VM software version, e.g. v2-alpha-tpuv5-lite."
    )
    capacity: Literal["on-demand", "spot", "reserved"] = Field(
        "on-demand",
        description="gcp: 'spot' queues a request (queued resource) that expires after "
        "queue_timeout_s; 'reserved' uses the project's reservation. The cost ledger prices "
        "gcp slices by it ('reserved' at the on-demand price unless cost.usd_per_chip_hour).",
    )
    queue_timeout_s: Float = Field(
        3600.0, gt=0, description="gcp: a spot request still waiting this long is cancelled."
    )
    provision_timeout_s: Float = Field(
        1800.0, gt=0, description="gcp: longest wait for the slice to become READY."
    )
    provision_attempts: Int = Field(
        3, ge=1, le=20, description="gcp: create attempts per zone on quota/capacity errors."
    )
    max_lifetime_s: Float = Field(
        86400.0, gt=0, description="gcp: the `ttl` label; the reaper deletes a slice past it."
    )
    service_account: str | None = Field(
        None, description="gcp: service account e-mail of the TPU VMs (None: the default)."
    )
    network: str | None = Field(None, description="gcp: VPC network (None: 'default').")
    subnetwork: str | None = Field(None, description="gcp: subnetwork (None: the network's).")
    external_ip: bool = Field(
        False,
        description="gcp: give workers external IPs (off: the subnet needs Private Google "
        "Access to reach GCS and PyPI mirrors).",
    )
    wheel: str | None = Field(
        None,
        description="gcp: gs:// URI of this project's wheel, installed on every worker at "
        "boot together with tpu_packages.",
    )
    tpu_packages: list[str] = Field(
        default_factory=lambda: ["jax[tpu]==0.10.2"],
        description="gcp: extra pip requirements for the TPU VM (libtpu via jax[tpu]).",
    )
    credentials_block: str | None = Field(
        None,
        description="gcp: name of a prefect-gcp GcpCredentials block (None: Application "
        "Default Credentials). Never put keys in a config.",
    )
    chaos: ChaosConfig = Field(
        default_factory=ChaosConfig, description="local: injected preemptions and failures."
    )

    @model_validator(mode="before")
    @classmethod
    def _topology_from_accelerator(cls, data: Any) -> Any:
        # A TPU type fixes devices and hosts: fill them in unless the user wrote them.
        if isinstance(data, dict) and data.get("provider") == "gcp":
            try:
                devices, hosts = tpu_topology(str(data.get("accelerator_type") or ""))
            except ValueError:
                return data  # reported with the field's context by _gcp_fields
            return {"devices": devices, "hosts": hosts, **data}
        return data

    @model_validator(mode="after")
    def _gcp_fields(self) -> SliceConfig:
        if self.provider != "gcp":
            return self
        required = ("zone", "accelerator_type", "runtime_version", "wheel")
        missing = [f for f in required if not getattr(self, f)]
        if missing:
            raise ValueError(f"slice.provider = 'gcp' needs slice.{', slice.'.join(missing)}")
        for zone in [self.zone, *self.fallback_zones]:
            if not _ZONE.match(zone):
                raise ValueError(f"slice zone {zone!r} is not a zone name like us-west4-a")
        devices, hosts = tpu_topology(self.accelerator_type)
        if (self.devices, self.hosts) != (devices, hosts):
            raise ValueError(
                f"slice.accelerator_type {self.accelerator_type} has {devices} devices on "
                f"{hosts} hosts, but slice.devices = {self.devices}, slice.hosts = {self.hosts}"
            )
        if not (self.wheel.startswith("gs://") and self.wheel.endswith(".whl")):
            raise ValueError(f"slice.wheel {self.wheel!r} must be a gs://…/*.whl URI")
        if not self.wheel[5:].split("/", 1)[0]:
            raise ValueError(f"slice.wheel {self.wheel!r} names no bucket (gs://bucket/….whl)")
        return self


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

    @field_validator("root")
    @classmethod
    def _a_place_runs_can_live(cls, value: str) -> str:
        # Anything but gs:// is a local path, so these became odd local directories:
        # `s3://b/x` was ./s3:/b/x, `~/x` was ./~/x (nothing expands ~) and an empty root
        # was the working directory, where a run then wrote its checkpoints silently.
        if not value.strip():
            raise ValueError("storage.root is empty: give a directory or gs://bucket/prefix")
        if value.startswith("gs://") and not value[5:].split("/", 1)[0]:
            raise ValueError(f"storage.root {value!r} names no bucket")
        scheme = value.split("://", 1)[0] if "://" in value else None
        if scheme is not None and scheme != "gs":
            raise ValueError(
                f"storage.root {value!r}: {scheme}:// is not supported; give a local "
                "directory or gs://bucket/prefix"
            )
        if value.startswith("~"):
            raise ValueError(
                f"storage.root {value!r} starts with ~, which is not expanded here: give "
                "the directory's absolute path (or one relative to the working directory)"
            )
        return value


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
    location: str = Field("US", description="bigquery: location of the dataset.")
    credentials_block: str | None = Field(
        None,
        description="bigquery: name of a prefect-gcp GcpCredentials block (None: Application "
        "Default Credentials).",
    )


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
        if value is not None and not _REGION.match(value):
            raise ValueError(f"cost.region {value!r} is not a region name like us-central1")
        return value

    @model_validator(mode="after")
    def _region_with_type(self) -> CostConfig:
        if self.priced_as and not self.region:
            raise ValueError(
                f"cost.priced_as = {self.priced_as!r} needs cost.region (prices differ by "
                "region), e.g. us-central1"
            )
        return self
