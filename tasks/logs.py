"""The project's own module loggers in the flow run's logs.

`infra`, `tasks` and `workloads` log through standard `logging` where no Prefect run
logger is at hand: the GCP provider's create retries per zone, the API retries of
`infra.gcp.retries`, the flow hooks' teardown, a quarantined checkpoint. Prefect sends
only its own loggers to its API, so those lines reached the console and never the Prefect
UI, where a run started from the UI or a schedule is watched. `PREFECT_LOGGING_EXTRA_LOGGERS`
would do it, but only if set before Prefect is imported, in every process that runs a flow.

This module does not import Prefect: `flows` routes the logs when it is imported, and
`tpupipe shard`, `validate` and `report` import it without ever running a flow. Importing
Prefect there cost about a second before anything started (1.1-1.4 s measured here).
"""

from __future__ import annotations

import logging
import sys

MODULE_LOGGERS = ("infra", "tasks", "workloads")

# Failures whose message is all a user needs: a refused config or input, a run another
# orchestrator runs, and the watch's verdicts on a workload (a spent preemption budget, a
# workload that failed, a stop: the message names the budget, the error and the logs, and the
# traceback would show only the watch's own code). Prefect's task and flow engines logged
# each with its traceback, twice (about 80 lines, on the console and in the UI) above the
# CLI's one-line error. Matched by name: this module imports none of them (see the module
# docstring).
REFUSALS = (
    "workloads.config_file.ConfigError",
    "workloads.sources.DatasetError",
    "tasks.run_lock.RunInUse",
    "tasks.run_owner.RunOwnerConflict",
    "tasks.own_slice.SliceNameTaken",
    "tasks.watch.WorkloadPreempted",
    "tasks.watch.WorkloadFailed",
    "tasks.watch.WatchStopped",  # a sweep's trial, stopped with its sweep
    # A metrics file another process holds: its message names the holder and what to do.
    "infra.metrics.duckdb_sink.MetricsLocked",
    # A deployment's run given a config that does not validate (the UI's Run form): the
    # flow engine refuses its parameters before the flow starts, naming each field.
    "prefect.exceptions.ParameterTypeError",
)
RUN_LOGGERS = ("prefect.task_runs", "prefect.flow_runs")


class RunLogHandler(logging.Handler):
    """Prefect's API log handler, for records logged inside a flow or task run only.

    Outside one (`tpupipe shard`, `tpupipe report`, a test calling a provider) the
    record reaches the console through the root logger's handlers, or, where it has none
    (no Prefect imported: `tpupipe shard`, `report`), as Python prints a record no handler
    takes (`logging.lastResort`): this handler counts as one, so Python would not, and
    those commands' warnings (a shard missing and rebuilt, a dataset repaired in GCS, an
    eval.json left out) were lost. Prefect's own handler would warn that it has no flow
    run to send the record to. No run can exist in a process that has not imported
    Prefect, so Prefect is only looked up once it is there.
    """

    def __init__(self, level: int = logging.NOTSET):
        super().__init__(level)
        self._api = None  # Prefect's APILogHandler, made at the first record in a run

    def emit(self, record: logging.LogRecord) -> None:
        """Send `record` to the API when it belongs to a flow or task run; outside one, to
        stderr if no other handler takes it."""
        context = sys.modules.get("prefect.context")
        in_run = context is not None and (
            context.FlowRunContext.get() is not None or context.TaskRunContext.get()
        )
        if not (in_run or getattr(record, "flow_run_id", None)):
            _last_resort(record)
            return
        if _prefect_routes(record.name):
            return
        if self._api is None:
            from prefect.logging.handlers import APILogHandler

            self._api = APILogHandler(self.level)
            self._api.setFormatter(self.formatter)
        self._api.emit(record)

    def flush(self) -> None:
        """Flush Prefect's handler, if a record was sent through it."""
        if self._api is not None:
            self._api.flush()


def _last_resort(record: logging.LogRecord) -> None:
    """Print `record` as Python does one that no handler takes: when no handler but this
    module's stands between its logger and the root (inclusive)."""
    logger: logging.Logger | None = logging.getLogger(record.name)
    while logger is not None:
        if any(not isinstance(h, RunLogHandler) for h in logger.handlers):
            return
        logger = logger.parent if logger.propagate else None
    resort = logging.lastResort
    if resort is not None and record.levelno >= resort.level:
        resort.handle(record)


class _RefusalsWithoutTraceback(logging.Filter):
    """Drops the traceback of a record whose exception is one of `REFUSALS` (or a
    subclass); its message stays, followed by the exception's when it does not name it
    (the flow engine's "Engine execution exited with unexpected exception" said no more)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if isinstance(record.exc_info, tuple) else None
        if exc is not None and any(
            f"{cls.__module__}.{cls.__qualname__}" in REFUSALS for cls in type(exc).__mro__
        ):
            message = record.getMessage()
            if type(exc).__name__ not in message:
                record.msg, record.args = f"{message}: {type(exc).__name__}: {exc}", ()
            record.exc_info, record.exc_text = None, None
        return True


def log_refusals_without_traceback() -> None:
    """Log the failures of `REFUSALS` in flow and task runs as one line (idempotent)."""
    for name in RUN_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _RefusalsWithoutTraceback) for f in logger.filters):
            logger.addFilter(_RefusalsWithoutTraceback())


def _prefect_routes(name: str) -> bool:
    """Whether Prefect's own API handler sends the records of logger `name` already:
    `PREFECT_LOGGING_EXTRA_LOGGERS` adds it to the loggers it names when Prefect is
    imported, which may be after `show_module_logs_in_runs`. Then no line is sent twice."""
    from prefect.logging.handlers import APILogHandler

    logger: logging.Logger | None = logging.getLogger(name)
    while logger is not None:
        if any(isinstance(h, APILogHandler) for h in logger.handlers):
            return True
        logger = logger.parent if logger.propagate else None
    return False


def show_module_logs_in_runs(level: int = logging.INFO) -> None:
    """Send the project's module loggers, from `level` up, to the run they are logged in.

    Idempotent; a record Prefect's own handler sends (loggers named in
    `PREFECT_LOGGING_EXTRA_LOGGERS`) is left to it, so no line is sent twice.
    """
    for name in MODULE_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(h, RunLogHandler) for h in logger.handlers):
            logger.addHandler(RunLogHandler())
        if logger.level == logging.NOTSET:
            logger.setLevel(level)
