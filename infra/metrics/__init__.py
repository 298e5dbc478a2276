"""Metrics sinks: where a run's rows land. `build_sink` picks the backend by name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from infra.metrics.duckdb_sink import DuckDBSink
from infra.metrics.rows import (
    EvalMetricRow,
    LandResult,
    RunRow,
    StepMetricRow,
    table_schema,
)

__all__ = [
    "DuckDBSink",
    "EvalMetricRow",
    "LandResult",
    "MetricsSink",
    "RunRow",
    "StepMetricRow",
    "build_sink",
    "table_schema",
]


@runtime_checkable
class MetricsSink(Protocol):
    """Stores runs and their metrics; landing a run twice leaves one copy of each row."""

    def ensure_tables(self) -> None:
        """Create the `runs`, `step_metrics` and `eval_metrics` tables if missing."""
        ...

    def land(
        self, run: RunRow, steps: Sequence[StepMetricRow], evals: Sequence[EvalMetricRow]
    ) -> LandResult:
        """Replace the run's rows with these, atomically and idempotently."""
        ...


def build_sink(kind: str, path: str) -> MetricsSink:
    """The metrics sink of `kind` at `path`.

    Args:
        kind: backend name; only "duckdb" exists so far.
        path: for "duckdb", the database file.

    Returns:
        A new sink (sinks hold no state between calls, so nothing is cached).

    Raises:
        ValueError: if `kind` is not a known backend.
    """
    if kind == "duckdb":
        return DuckDBSink(path)
    raise ValueError(f"unknown metrics sink kind {kind!r}; known: 'duckdb'")
