"""The flows: the training pipeline, sweeps and the orphan reaper."""

from tasks.logs import log_refusals_without_traceback, show_module_logs_in_runs

# Whichever way a flow's process starts (CLI, worker, `prefect deploy`), it imports this
# package first: the project's module logs then reach the Prefect UI too, and a refused
# config or input is logged without a traceback.
show_module_logs_in_runs()
log_refusals_without_traceback()
