"""What a sweep's tasks hand each other: its plan, each trial's outcome and result, and
the errors that stop it."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel

from infra.metrics import RunRow, build_sink
from tasks.plan import metrics_path
from tasks.sweep_space import Trial
from workloads.config import PipelineConfig

TrialStatus = Literal["completed", "failed", "cancelled", "crashed"]


class SweepError(RuntimeError):
    """The sweep cannot run as configured (no chip limit, a trial larger than it)."""


class SweepPlan(BaseModel):
    """A sweep resolved before any trial runs: its name, trials and where they run."""

    sweep_id: str
    flow_run_id: str | None = None
    trials: list[Trial]
    via: Literal["subflow", "deployment"]
    trial_deployment: str
    chip_limit: str
    chips: int  # what the limit holds
    objective: str
    max_parallel: int
    base: PipelineConfig
    held_warning: str | None = None  # chips of the limit held when it was planned


class TrialOutcome(BaseModel):
    """How a trial's run ended, as its launcher saw it."""

    status: TrialStatus
    flow_run_id: str | None = None
    error: str | None = None
    run: RunRow | None = None


NOT_STARTED = TrialOutcome(
    status="cancelled", error="not started: the sweep was stopped (Ctrl-C, SIGTERM or a cancel)"
)


class TrialResult(TrialOutcome):
    """A trial's outcome with its identity and when it held its chips."""

    index: int
    run_id: str
    params: dict[str, Any]
    chips: int
    started_at: datetime  # chips acquired
    finished_at: datetime  # run over, chips about to be released
    waited_s: float  # time spent waiting for chips


class SweepInterrupted(Exception):
    """The sweep was stopped (`cause`: Ctrl-C, SIGTERM) once its trials under way had
    ended; `results` holds every trial's, those never started as cancelled."""

    def __init__(self, results: list[TrialResult], cause: BaseException):
        super().__init__(f"sweep interrupted: {type(cause).__name__}")
        self.results = results
        self.cause = cause


Launcher = Callable[[Trial, SweepPlan], TrialOutcome]


def read_run(base: PipelineConfig, run_id: str, wait_s: float | None = None) -> RunRow | None:
    """The trial's `runs` row from the sweep's metrics sink (`wait_s`: see `build_sink`)."""
    sink = build_sink(base.metrics.sink, metrics_path(base), base.metrics, wait_s)
    return sink.read_run(run_id)


def crashed(exc: Exception) -> TrialOutcome:
    """The outcome of a trial whose launch raised (an API error, a launcher bug)."""
    return TrialOutcome(status="crashed", error=f"{type(exc).__name__}: {exc}")


def status_of(state_type: str) -> TrialStatus:
    """A trial's status from its flow run's final state type (`COMPLETED`, ...)."""
    return {
        "COMPLETED": "completed",
        "CANCELLED": "cancelled",
        "CANCELLING": "cancelled",
        "CRASHED": "crashed",
    }.get(state_type, "failed")


def outcome_from_state(state: Any) -> TrialOutcome:
    """The outcome of an in-process trial from its subflow's final state."""
    status = status_of(state.type.value)
    run = state.result(raise_on_failure=False) if status == "completed" else None
    return TrialOutcome(
        status=status,
        flow_run_id=str(state.state_details.flow_run_id),
        error=None if status == "completed" else state.message,
        run=run if isinstance(run, RunRow) else None,
    )
