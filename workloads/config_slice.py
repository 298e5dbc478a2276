"""Config of where the workload runs: a local process group or a Cloud TPU slice, and the
names (TPU types, zones, regions) and durations the TPU API and the reaper accept.

Part of `PipelineConfig` (workloads/config.py), re-exported by workloads/config_infra.py.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

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
_ACCELERATOR = re.compile(r"^(v4|v5p|v5litepod|v6e)-([0-9]+)$")
_ZONE = re.compile(r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")
# A region name, e.g. us-central1 (a zone adds a letter: us-central1-a).
REGION = re.compile(r"^[a-z]+-[a-z]+[0-9]+$")

# Bounds of the slice's durations. A spot request's `valid_until` is a protobuf Duration:
# 1e12 s failed to serialise at provisioning and values under 1 s were sent as "0s"; a
# week is far inside what it holds and longer than any plan to wait for spot capacity.
QUEUE_TIMEOUT_RANGE_S = (1.0, 7 * 86400.0)
# The reaper (every 10 minutes as deployed) deletes any slice past its `ttl` label, live
# run or not: a shorter lifetime is no bound on a stray slice, only on a live one.
MIN_LIFETIME_S = 600.0
MAX_LIFETIME_S = 366 * 86400.0


def _zone(value: str) -> str:
    # A field validator (not the model's), so an error names the field and its own line,
    # e.g. `slice.fallback_zones.1`, not the `slice:` line.
    if not _ZONE.fullmatch(value):
        hint = (
            f" (a region? add the zone's letter, e.g. {value}-a)" if REGION.fullmatch(value) else ""
        )
        raise ValueError(f"{value!r} is not a zone name like us-west4-a{hint}")
    return value


# A Compute Engine zone name, e.g. us-west4-a.
Zone = Annotated[str, AfterValidator(_zone)]


def tpu_topology(accelerator_type: str) -> tuple[int, int]:
    """(devices, hosts) of a TPU accelerator type such as `v5litepod-8` or `v4-32`.

    Raises:
        ValueError: for an unknown family or a size that family does not come in.
    """
    match = _ACCELERATOR.fullmatch(accelerator_type)
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
    # None (empty in the UI's form): filled in (`filled_in`); never None once validated.
    devices: Int | None = Field(
        None,
        ge=1,
        le=256,
        description="Devices in the slice (empty: taken from accelerator_type on gcp, 8 on local).",
    )
    hosts: Int | None = Field(
        None,
        ge=1,
        le=64,
        description="Hosts (one JAX process each) the devices are spread over (empty: taken "
        "from accelerator_type on gcp, 1 on local).",
    )
    poll_interval_s: Float = Field(
        1.0,
        gt=0,
        le=300,
        description="Seconds between slice state checks (at most 300: a slice whose workload "
        "has finished is billed until the next check sees it and deletes it).",
    )
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
    zone: Zone | None = Field(None, description="gcp: zone to create the TPU in, e.g. us-west4-a.")
    fallback_zones: list[Zone] = Field(
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
        3600.0,
        ge=QUEUE_TIMEOUT_RANGE_S[0],
        le=QUEUE_TIMEOUT_RANGE_S[1],
        description="gcp: a spot request still waiting this long is cancelled (1 s to 7 days).",
    )
    provision_timeout_s: Float = Field(
        1800.0, gt=0, description="gcp: longest wait for the slice to become READY."
    )
    provision_attempts: Int = Field(
        3, ge=1, le=20, description="gcp: create attempts per zone on quota/capacity errors."
    )
    max_lifetime_s: Float = Field(
        86400.0,
        ge=MIN_LIFETIME_S,
        # A year: its ttl label (a deadline in epoch seconds) must stay a label's 63
        # characters; 1e300 passed validation and failed at the slice's create.
        le=MAX_LIFETIME_S,
        description="The `ttl` label of each attempt's slice: the reaper deletes a slice past "
        "it, even one still training. At least 600 s, and more than the slice's wait for "
        "capacity and start-up (gcp: queue_timeout_s for spot + provision_timeout_s; "
        "+ heartbeat_timeout_s).",
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

    FILLED_IN = ("devices", "hosts")

    @classmethod
    def filled_in(cls, data: dict) -> dict[str, Any]:
        """On gcp, the devices and hosts the TPU type fixes; otherwise (or for a type
        `_gcp_fields` refuses) one host of 8 devices."""
        if data.get("provider") == "gcp":
            try:
                devices, hosts = tpu_topology(str(data.get("accelerator_type") or ""))
                return {"devices": devices, "hosts": hosts}
            except ValueError:
                pass  # reported with the field's context by _gcp_fields
        return {"devices": 8, "hosts": 1}

    @model_validator(mode="after")
    def _lifetime_covers_start_up(self) -> SliceConfig:
        # The ttl counts from the create request: a slice must be able to get capacity,
        # become READY and start its workload before the reaper may take it.
        parts = ["slice.heartbeat_timeout_s"]
        if self.provider == "gcp":
            parts[:0] = ["slice.provision_timeout_s"]
            if self.capacity == "spot":
                parts[:0] = ["slice.queue_timeout_s"]
        needed = sum(getattr(self, p.removeprefix("slice.")) for p in parts)
        if self.max_lifetime_s <= needed:
            raise ValueError(
                f"slice.max_lifetime_s = {self.max_lifetime_s:g} must be above "
                f"{' + '.join(parts)} = {needed:g}: the reaper would delete the slice of a "
                "live run before it could train"
            )
        return self

    @model_validator(mode="after")
    def _gcp_fields(self) -> SliceConfig:
        if self.provider != "gcp":
            return self
        required = ("zone", "accelerator_type", "runtime_version", "wheel")
        missing = [f for f in required if not getattr(self, f)]
        if missing:
            raise ValueError(f"slice.provider = 'gcp' needs slice.{', slice.'.join(missing)}")
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
        # Here, not at the top: config_infra imports this module.
        from workloads.config_infra import gs_place_problem

        if (problem := gs_place_problem(self.wheel)) is not None:
            raise ValueError(f"slice.wheel {self.wheel!r}: {problem}")
        if problems := [p for r in self.tpu_packages if (p := _requirement_problem(r))]:
            raise ValueError("; ".join(problems))
        return self


def _requirement_problem(requirement: str) -> str | None:
    """What pip would refuse in one of `slice.tpu_packages`, or None. Such a typo failed
    only on the TPU VM, in its start-up script, once the slice was billed (probe Z)."""
    from packaging.requirements import InvalidRequirement, Requirement

    if requirement.rstrip().endswith("\\") or "\n" in requirement or "\r" in requirement:
        # Entries are lines of one requirements file: this one would run into the next.
        return f"slice.tpu_packages entry {requirement!r} is not one line of its own"
    try:
        Requirement(requirement)
    except InvalidRequirement as exc:
        first = str(exc).splitlines()[0]
        return (
            f"slice.tpu_packages entry {requirement!r} is not a pip requirement: {first} "
            "(a wheel or repository by URL is written 'name @ url'; pip options are not "
            "taken)"
        )
    return None
