"""Typed rows of the metrics tables, one pydantic model per table.

The models are the single source of the schemas: `table_schema` derives the columns, and
each model names its table, primary key and partition column, so the DuckDB sink today
and a BigQuery sink later create the same tables from the same code.

NaN/Inf policy: a non-finite float metric is stored as NULL, never as NaN, and the row's
`nonfinite` flag says that this happened (a diverged step stays visible as a fact rather
than a poisoned average). RunRow has no flag: its summary fields simply become NULL.

How a landing treats the rows already stored (a completed run's, a failed run's):
`infra.metrics.landing_rule`.
"""

from __future__ import annotations

import math
import numbers
import types
import typing
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, ClassVar, NamedTuple

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator

DUCKDB_TYPES: dict[type, str] = {
    str: "VARCHAR",
    bool: "BOOLEAN",
    int: "BIGINT",
    float: "DOUBLE",
    datetime: "TIMESTAMPTZ",
}


def is_nonfinite(value: Any) -> bool:
    """True for NaN and ±Inf, as numbers (numpy scalars included) or as strings like "nan"."""
    if isinstance(value, bool):
        return False
    if isinstance(value, numbers.Real):
        return not math.isfinite(float(value))
    if isinstance(value, str):
        try:
            return not math.isfinite(float(value))
        except ValueError:
            return False  # not a number at all: pydantic's own validation reports it
    return False


class TableRow(BaseModel):
    """Base of the row models: validation policy plus the table's name, key and partition."""

    # allow_inf_nan=False is the backstop: a non-finite float that escaped the validators
    # below fails validation instead of reaching a table.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    table: ClassVar[str]
    primary_key: ClassVar[tuple[str, ...]]
    partition_field: ClassVar[str]  # the day-partition column in BigQuery
    cluster_fields: ClassVar[tuple[str, ...]] = ("run_id",)  # BigQuery clustering
    metric_fields: ClassVar[tuple[str, ...]] = ()
    # Columns a failed run's landing never sets to NULL (infra/metrics/landing_rule.py).
    result_fields: ClassVar[tuple[str, ...]] = ()
    # Columns read from the run directory that a completed run's landing without them (a
    # damaged metrics.jsonl) does not set to NULL either (infra/metrics/landing_rule.py).
    local_fields: ClassVar[tuple[str, ...]] = ()
    # Columns a landing never moves later than the stored value (see RunRow).
    earliest_fields: ClassVar[tuple[str, ...]] = ()

    @field_validator("*", mode="before")
    @classmethod
    def _nonfinite_to_none(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name in cls.metric_fields and is_nonfinite(value):
            return None
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _utc(cls, value: Any) -> Any:
        if isinstance(value, datetime):
            # A naive time is ambiguous; guessing its zone would shift rows silently.
            if value.tzinfo is None or value.utcoffset() is None:
                raise ValueError("datetime must be timezone-aware")
            return value.astimezone(UTC)
        return value


class _FlaggedRow(TableRow):
    """A row with a `nonfinite: bool` field (declared by each subclass, so that it comes
    after the metrics in column order), set when a metric was NaN/Inf and stored as NULL."""

    @model_validator(mode="before")
    @classmethod
    def _flag_nonfinite(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(is_nonfinite(data.get(f)) for f in cls.metric_fields):
            data = {**data, "nonfinite": True}
        return data


class RunRow(TableRow):
    """One row per run: identity, config, outcome and summary numbers."""

    table: ClassVar[str] = "runs"
    primary_key: ClassVar[tuple[str, ...]] = ("run_id",)
    partition_field: ClassVar[str] = "started_at"
    metric_fields: ClassVar[tuple[str, ...]] = (
        "train_loss_first",
        "train_loss_last",
        "eval_loss",
        "eval_bits_per_byte",
    )
    # A run's results: a failed landing without them (an interrupted rerun, stopped before
    # it evaluated again) keeps those an earlier invocation landed. A run name always
    # trains the same steps with the same config, so they stay the run's.
    result_fields: ClassVar[tuple[str, ...]] = (
        "final_step",
        "train_loss_first",
        "train_loss_last",
        "eval_loss",
        "eval_bits_per_byte",
        "params_sha256",
        "num_params",
    )
    # The losses of the first and final steps' rows in metrics.jsonl.
    local_fields: ClassVar[tuple[str, ...]] = ("train_loss_first", "train_loss_last")
    # When the run first started: each invocation of a run name lands its row again, and
    # `started_at` moved to the latest one's start (a rerun that only evaluated again), while
    # `wall_s` covers every attempt; it is also BigQuery's partition column.
    earliest_fields: ClassVar[tuple[str, ...]] = ("started_at",)

    run_id: str
    run_name: str
    flow_run_id: str | None = None
    status: typing.Literal["completed", "failed"]
    error: str | None = None  # why a failed run failed; NULL when it completed
    config_hash: str
    config_json: str
    dataset_fingerprint: str
    started_at: datetime
    finished_at: datetime | None = None
    final_step: int | None = None
    train_loss_first: float | None = None
    train_loss_last: float | None = None
    eval_loss: float | None = None
    eval_bits_per_byte: float | None = None
    params_sha256: str | None = None
    num_params: int | None = None
    run_dir: str
    # The attempt ledger (events.jsonl): how the run survived, and what it cost in time.
    attempts: int | None = None
    preemptions: int | None = None
    goodput: float | None = None  # productive step time / wall time
    wall_s: float | None = None
    productive_s: float | None = None
    provisioning_s: float | None = None
    startup_s: float | None = None
    restore_s: float | None = None
    lost_s: float | None = None
    teardown_s: float | None = None
    idle_s: float | None = None
    # The cost ledger (tasks/ledger.py): chip-hours from slice create to delete, priced.
    chips: int | None = None
    chip_hours: float | None = None
    usd_per_chip_hour: float | None = None  # NULL: the run is not priced
    price_source: str | None = None  # where the price comes from, or why there is none
    price_as_of: str | None = None  # ISO day the price's figures were read
    cost_usd: float | None = None
    tokens_trained: int | None = None  # tokens of the optimizer steps that count
    cost_per_million_tokens: float | None = None  # cost_usd per 1M tokens_trained


class StepMetricRow(_FlaggedRow):
    """One training step of one run."""

    table: ClassVar[str] = "step_metrics"
    primary_key: ClassVar[tuple[str, ...]] = ("run_id", "step")
    partition_field: ClassVar[str] = "recorded_at"
    metric_fields: ClassVar[tuple[str, ...]] = (
        "loss",
        "learning_rate",
        "grad_norm",
        "step_time_s",
        "tokens_per_s",
    )

    run_id: str
    step: int
    loss: float | None = None
    learning_rate: float | None = None
    grad_norm: float | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    nonfinite: bool = False
    recorded_at: datetime


class EvalMetricRow(_FlaggedRow):
    """One evaluation of one run's checkpoint at `step` on `split`."""

    table: ClassVar[str] = "eval_metrics"
    primary_key: ClassVar[tuple[str, ...]] = ("run_id", "step", "split")
    partition_field: ClassVar[str] = "recorded_at"
    metric_fields: ClassVar[tuple[str, ...]] = ("loss", "bits_per_byte")

    run_id: str
    step: int
    split: str = "eval"
    loss: float | None = None
    bits_per_byte: float | None = None
    tokens: int
    nonfinite: bool = False
    recorded_at: datetime


class SweepRow(_FlaggedRow):
    """One trial of one sweep, linked to the run it trained (`runs.run_id`).

    Landed per sweep, not per run: a sweep's rows are replaced as a whole, so its ranks
    and its best trial always come from one landing.
    """

    table: ClassVar[str] = "sweeps"
    primary_key: ClassVar[tuple[str, ...]] = ("sweep_id", "trial")
    partition_field: ClassVar[str] = "started_at"
    cluster_fields: ClassVar[tuple[str, ...]] = ("sweep_id", "run_id")
    metric_fields: ClassVar[tuple[str, ...]] = (
        "objective_value",
        "eval_loss",
        "eval_bits_per_byte",
        "train_loss_last",
    )

    sweep_id: str
    trial: int
    run_id: str
    sweep_flow_run_id: str | None = None
    flow_run_id: str | None = None  # the trial's own flow run
    status: typing.Literal["completed", "failed", "cancelled", "crashed"]
    error: str | None = None
    params_json: str  # the trial's overrides of the base config, dotted keys
    chips: int
    objective: str
    objective_value: float | None = None
    rank: int | None = None  # 1 = best; NULL for a trial that did not complete
    is_best: bool = False
    eval_loss: float | None = None
    eval_bits_per_byte: float | None = None
    train_loss_last: float | None = None
    # The trial's cost ledger, from its `runs` row; a sweep's totals are their sums.
    goodput: float | None = None
    chip_hours: float | None = None
    cost_usd: float | None = None
    tokens_trained: int | None = None
    cost_per_million_tokens: float | None = None
    nonfinite: bool = False
    started_at: datetime
    finished_at: datetime | None = None


def one_sweep_id(rows: typing.Sequence[SweepRow]) -> str:
    """The sweep id all `rows` share: a sweep landing replaces one sweep's rows, never two.

    Raises:
        ValueError: no rows, or rows of several sweeps.
    """
    ids = {r.sweep_id for r in rows}
    if len(ids) != 1:
        raise ValueError(f"a sweep landing needs the rows of exactly one sweep, got {sorted(ids)}")
    return ids.pop()


# The tables landed per run. `sweeps` is landed per sweep (see SweepRow) and created by
# the first sweep landing, so a sink used only for runs holds only these three.
ROW_MODELS: tuple[type[TableRow], ...] = (RunRow, StepMetricRow, EvalMetricRow)


class Column(NamedTuple):
    """One column of a table: (name, DuckDB type, nullable)."""

    name: str
    type: str
    nullable: bool


def table_schema(model: type[BaseModel]) -> list[Column]:
    """The columns of `model`'s table, in field order, derived from its annotations.

    Args:
        model: a row model class.

    Returns:
        (name, type, nullable) per field: str→VARCHAR, int→BIGINT, float→DOUBLE,
        bool→BOOLEAN, datetime→TIMESTAMPTZ, Literal[...] of strings→VARCHAR; nullable
        when the annotation admits None.

    Raises:
        TypeError: on a field type with no column type.
    """
    columns = []
    for name, info in model.model_fields.items():
        args = typing.get_args(info.annotation)
        is_union = typing.get_origin(info.annotation) in (typing.Union, types.UnionType)
        base = [a for a in args if a is not type(None)] if is_union else [info.annotation]
        nullable = is_union and len(base) < len(args)
        if len(base) == 1 and typing.get_origin(base[0]) is typing.Literal:
            base = list({type(v) for v in typing.get_args(base[0])})
        if len(base) != 1 or base[0] not in DUCKDB_TYPES:
            raise TypeError(f"{model.__name__}.{name}: no column type for {info.annotation!r}")
        columns.append(Column(name, DUCKDB_TYPES[base[0]], nullable))
    return columns


@dataclass(frozen=True)
class LandResult:
    """Rows written by one landing (after de-duplication), per table."""

    runs: int
    steps: int
    evals: int
