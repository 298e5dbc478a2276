"""The project's own module loggers in the flow run's logs.

`infra`, `tasks` and `workloads` log through standard `logging` where no Prefect run
logger is at hand: the GCP provider's create retries per zone, the API retries of
`infra.gcp.retries`, the flow hooks' teardown, a quarantined checkpoint. Prefect sends
only its own loggers to its API, so those lines reached the console and never the Prefect
UI, where a run started from the UI or a schedule is watched. `PREFECT_LOGGING_EXTRA_LOGGERS`
would do it, but only if set before Prefect is imported, in every process that runs a flow.
"""

from __future__ import annotations

import logging

from prefect.context import FlowRunContext, TaskRunContext
from prefect.logging.handlers import APILogHandler

MODULE_LOGGERS = ("infra", "tasks", "workloads")


class RunLogHandler(APILogHandler):
    """Prefect's API log handler, for records logged inside a flow or task run only.

    Outside one (`tpupipe shard`, `tpupipe report`, a test calling a provider) the
    record still reaches the console through the root logger; Prefect's own handler would
    also warn there that it has no flow run to send it to.
    """

    def emit(self, record: logging.LogRecord) -> None:
        """Send `record` to the API when it belongs to a flow or task run."""
        in_run = FlowRunContext.get() is not None or TaskRunContext.get() is not None
        if in_run or getattr(record, "flow_run_id", None):
            super().emit(record)


def show_module_logs_in_runs(level: int = logging.INFO) -> None:
    """Send the project's module loggers, from `level` up, to the run they are logged in.

    Idempotent, and a logger that already has an API handler (set up through
    `PREFECT_LOGGING_EXTRA_LOGGERS`) is left as it is, so no line is sent twice.
    """
    for name in MODULE_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(h, APILogHandler) for h in logger.handlers):
            logger.addHandler(RunLogHandler())
        if logger.level == logging.NOTSET:
            logger.setLevel(level)
