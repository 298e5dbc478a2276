"""What a chip-hour of a run's slice costs: the shipped price table, overrides, and the
one price a run is charged at.

The table (`tasks/tpu_prices.yaml`, dated and cited inside) gives USD per chip-hour per TPU
family and region, on-demand and spot. A config may replace it (`cost.price_table`) or set
one flat price (`cost.usd_per_chip_hour`). The price follows `slice.capacity`: spot pays
the spot price; on-demand and reserved pay on-demand (a reservation's committed rate is per
contract and not public: set `cost.usd_per_chip_hour` to use it). A local slice may be
priced at another capacity than its `slice.capacity` with `cost.capacity`.

Local slices are priced only as the TPU type the user says they stand for
(`cost.priced_as` in `cost.region`); otherwise, and wherever the table has no figure, the
run is reported as not priced (None), never at a made-up price.

A rerun may change the slice (and the cost section), so each attempt records its price
and its slice when it asks for one (`attempt_pricing`, on `provision_requested`): the
ledger bills every attempt at its own record (`recorded_price`), and an attempt recorded
before that (no record) at the run's current config.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
from dataclasses import asdict, dataclass, replace
from datetime import date
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from workloads.config import PipelineConfig, tpu_topology
from workloads.config_file import ConfigError
from workloads.config_infra import MAX_USD_PER_CHIP_HOUR

SHIPPED_TABLE = "tpu_prices.yaml"

Family = Literal["v4", "v5p", "v5litepod", "v6e"]
Region = Annotated[str, StringConstraints(pattern=r"^[a-z]+-[a-z]+[0-9]+$")]


class PriceTableError(ConfigError):
    """A price table that cannot be read or has a bad figure; names the file and field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class RegionPrice(_Strict):
    """USD per chip-hour in one region; a missing figure means 'not known', not zero."""

    on_demand: float | None = Field(None, gt=0, le=MAX_USD_PER_CHIP_HOUR)
    spot: float | None = Field(None, gt=0, le=MAX_USD_PER_CHIP_HOUR)


class PriceTable(_Strict):
    """A dated, cited table of TPU prices per chip-hour."""

    source: str = Field(min_length=1, description="Where the figures come from (a URL).")
    read_on: date = Field(description="The day the figures were read from the source.")
    currency: Literal["USD"] = "USD"
    families: dict[Family, dict[Region, RegionPrice]]


@dataclass(frozen=True)
class Price:
    """The price a run's chip-hours are charged at, and where it comes from.

    `usd_per_chip_hour` is None when the run is not priced; `source` then says why.
    """

    chips: int
    capacity: str
    accelerator: str | None  # the TPU type priced, e.g. v5litepod-8
    region: str | None
    usd_per_chip_hour: float | None
    source: str
    as_of: str | None = None  # ISO date the figure was read

    def describe(self) -> str:
        """`$1.2000/chip-hour (source, read 2026-11-22)`, or why the run is not priced."""
        if self.usd_per_chip_hour is None:
            return self.source
        read = f", read {self.as_of}" if self.as_of else ""
        return f"${self.usd_per_chip_hour:.4f}/chip-hour ({self.source}{read})"


def load_price_table(path: str | os.PathLike | None = None) -> PriceTable:
    """The price table in `path` (YAML or JSON), or the one shipped with tpupipe.

    Raises:
        PriceTableError: the file cannot be read or parsed, or a field is invalid; the
            message names the file and each bad field.
    """
    if path is None:
        return _shipped_table()
    return _parse(_read(os.fspath(path)), os.fspath(path))


@functools.cache
def _shipped_table() -> PriceTable:
    # importlib.resources finds the file inside an installed wheel as well as a checkout.
    text = importlib.resources.files("tasks").joinpath(SHIPPED_TABLE).read_text()
    return _parse(text, f"tasks/{SHIPPED_TABLE}")


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise PriceTableError(
            f"cost.price_table = {path!r}: cannot read it: {exc.strerror}"
        ) from None


def _parse(text: str, name: str) -> PriceTable:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PriceTableError(f"{name}: not valid YAML or JSON: {exc}") from None
    try:
        return PriceTable.model_validate(data)
    except ValidationError as exc:
        problems = [
            f"{name}: {'.'.join(str(p) for p in e['loc']) or '(top level)'}: {e['msg']}"
            for e in exc.errors()
        ]
        raise PriceTableError("\n".join(problems)) from None


def slice_price(config: PipelineConfig) -> Price:
    """What is priced, before any table is read: chips, capacity, TPU type and region;
    `usd_per_chip_hour` None ("not priced" until `price_for` finds a figure)."""
    sl, cost = config.slice, config.cost
    accelerator = sl.accelerator_type if sl.provider == "gcp" else cost.priced_as
    region = _region(sl.zone) if sl.provider == "gcp" else cost.region
    # One JAX device per chip: a local run's devices stand for chips, as sweeps count them.
    chips = tpu_topology(accelerator)[0] if accelerator else sl.devices
    return Price(chips, cost.capacity or sl.capacity, accelerator, region, None, "not priced")


def price_for(config: PipelineConfig, table: PriceTable | None = None) -> Price:
    """The price of one chip-hour of `config`'s slice.

    Args:
        config: the run's config (slice, cost).
        table: the price table (default: `cost.price_table`, else the shipped one).

    Returns:
        The price with its provenance; `usd_per_chip_hour` None when not priced.

    Raises:
        PriceTableError: `cost.price_table` is unreadable or invalid.
    """
    cost = config.cost
    base = slice_price(config)
    if table is None:
        table = load_price_table(cost.price_table)
    if cost.usd_per_chip_hour is not None:
        return _with(base, cost.usd_per_chip_hour, "cost.usd_per_chip_hour (config)")
    if base.accelerator is None:
        return _with(
            base,
            None,
            "not priced: a local slice (set cost.priced_as and cost.region, or "
            "cost.usd_per_chip_hour)",
        )
    family = base.accelerator.rsplit("-", 1)[0]
    kind = "spot" if base.capacity == "spot" else "on_demand"
    figure = table.families.get(family, {}).get(base.region or "")
    usd = getattr(figure, kind) if figure else None
    label = cost.price_table or f"tasks/{SHIPPED_TABLE}"
    if usd is None:
        reason = f"not priced: no {kind} price for {family} in {base.region} in {label}"
        return _with(base, None, reason)
    note = " (reserved: priced on-demand)" if base.capacity == "reserved" else ""
    where = f"{label} ({table.source}): {family} {base.region} {kind}{note}"
    return _with(base, usd, where, table.read_on.isoformat())


def _with(base: Price, usd: float | None, source: str, as_of: str | None = None) -> Price:
    return replace(base, usd_per_chip_hour=usd, source=source, as_of=as_of)


def _region(zone: str | None) -> str | None:
    """`us-central1-a` -> `us-central1`."""
    return zone.rsplit("-", 1)[0] if zone else None


# The slice fields a price depends on, recorded per attempt so that it can be re-priced.
PRICED_SLICE_FIELDS = ("provider", "devices", "accelerator_type", "zone", "capacity")


def price_or_unpriced(config: PipelineConfig) -> Price:
    """`price_for(config)`, or its slice unpriced, saying why, when the price table cannot
    be read (the validate stage checked it; one broken since must not lose a record)."""
    try:
        return price_for(config)
    except PriceTableError as exc:
        return replace(slice_price(config), source=f"not priced: {exc}")


def attempt_pricing(config: PipelineConfig) -> dict[str, Any]:
    """What an attempt records when it asks for its slice: the price it runs at (`price`)
    and the slice fields that price came from (`slice`, to re-price it with another cost
    section). Event fields, JSON-ready."""
    sl = config.slice
    return {
        "price": asdict(price_or_unpriced(config)),
        "slice": {name: getattr(sl, name) for name in PRICED_SLICE_FIELDS},
    }


# A recorded chip count past this is no record: no slice has 2**31 chips, and one of 2**63
# overflowed the sinks' INT64 column; with the price bounded too, no cost is inf.
MAX_RECORDED_CHIPS = 2**31 - 1


class _PriceRecord(BaseModel):
    """A `Price` as an event records it. Strict: a value of another type is no record."""

    model_config = ConfigDict(strict=True, extra="ignore")  # a newer version's fields too
    chips: int = Field(ge=1, le=MAX_RECORDED_CHIPS)
    capacity: str
    accelerator: str | None
    region: str | None
    usd_per_chip_hour: float | None = Field(ge=0, le=MAX_USD_PER_CHIP_HOUR, allow_inf_nan=False)
    source: str
    as_of: str | None = None


class _SliceRecord(BaseModel):
    """The slice fields an attempt recorded with its price (`PRICED_SLICE_FIELDS`)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    provider: str | None = None
    devices: int | None = Field(None, ge=1, le=MAX_RECORDED_CHIPS)
    accelerator_type: str | None = None
    zone: str | None = None
    capacity: str | None = None


def readable_pricing(event: dict[str, Any]) -> bool:
    """Whether an event's `price` and `slice` records, if any, are as `attempt_pricing`
    writes them. A damaged one (null, a string, a field of another type: a hand edit)
    failed the run's landing and `tpupipe report` with a TypeError naming no file; the
    ledger drops it, and prices the attempt as one that recorded none. So does a figure
    no run records (more than `MAX_RECORDED_CHIPS` chips, a price past
    `MAX_USD_PER_CHIP_HOUR`), whose cost failed the landing too."""
    try:
        if "price" in event:
            _PriceRecord.model_validate(event["price"])
        if "slice" in event:
            _SliceRecord.model_validate(event["slice"])
    except ValidationError:
        return False
    return True


def recorded_price(event: dict[str, Any]) -> Price:
    """The price an attempt recorded (an event carrying `attempt_pricing`'s fields, which
    `readable_pricing` accepts)."""
    return Price(**_PriceRecord.model_validate(event["price"]).model_dump())


def reprice(config: PipelineConfig, event: dict[str, Any]) -> Price:
    """The price of the attempt that recorded `event` under `config`'s cost section: its
    own slice (chips, TPU type, zone, capacity), `config`'s prices.

    Raises:
        PriceTableError: `cost.price_table` is unreadable or invalid.
    """
    ran_on = config.slice.model_copy(update=event.get("slice", {}))
    return price_for(config.model_copy(update={"slice": ran_on}))
