"""Metrics sinks: where a run's rows land. `build_sink` picks the backend by name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from infra.metrics.duckdb_sink import DuckDBSink, MetricsLocked
from infra.metrics.rows import (
    EvalMetricRow,
    LandResult,
    RunRow,
    StepMetricRow,
    SweepRow,
    table_schema,
)

__all__ = [
    "DuckDBSink",
    "EvalMetricRow",
    "LandResult",
    "MetricsLocked",
    "MetricsSink",
    "RunRow",
    "StepMetricRow",
    "SweepRow",
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
        self,
        run: RunRow,
        steps: Sequence[StepMetricRow],
        evals: Sequence[EvalMetricRow],
        fresh: bool = False,
    ) -> LandResult:
        """Land the run's rows atomically and idempotently: a completed run's replace its
        stored rows; a failed run's are added or updated and keep the stored rows and
        results they have no value for; a `fresh` one's replace them all (the landing rule
        in `infra.metrics.landing_rule`)."""
        ...

    def land_sweep(self, rows: Sequence[SweepRow]) -> int:
        """Replace one sweep's `sweeps` rows with these, atomically and idempotently."""
        ...

    def ensure_sweep_table(self) -> None:
        """Create the `sweeps` table, or check it as `land_sweep` would (`SchemaError`)."""
        ...

    def read_run(self, run_id: str) -> RunRow | None:
        """The run's `runs` row, or None if it has not landed."""
        ...


def build_sink(
    kind: str, path: str, config: Any = None, wait_s: float | None = None
) -> MetricsSink:
    """The metrics sink of `kind`.

    Args:
        kind: "duckdb" or "bigquery".
        path: for "duckdb", the database file.
        config: the `MetricsConfig` (required for "bigquery": project, dataset, location,
            credentials_block).
        wait_s: how long the sink may wait for its backend: for "duckdb", while another
            process holds the file; for "bigquery", retrying each call (its `patience_s`).
            None: the sink's default.

    Returns:
        A new sink; for "bigquery" with its own client, built here once.

    Raises:
        ValueError: if `kind` is not a known backend, or "bigquery" comes without a config.
    """
    if kind == "duckdb":
        return DuckDBSink(path) if wait_s is None else DuckDBSink(path, wait_s)
    if kind == "bigquery":
        if config is None:
            raise ValueError("the bigquery sink needs the metrics config")
        # Imported here: local runs need no Google client.
        from infra.gcp.clients import bigquery_client
        from infra.metrics.bigquery_sink import BigQuerySink

        client = bigquery_client(config.project, config.location, config.credentials_block)
        return BigQuerySink(
            client, config.dataset, config.project, config.location, patience_s=wait_s
        )
    raise ValueError(f"unknown metrics sink kind {kind!r}; known: 'duckdb', 'bigquery'")
