"""The flows: the training pipeline, sweeps and the orphan reaper."""

from tasks.logs import show_module_logs_in_runs

# Whichever way a flow's process starts (CLI, worker, `prefect deploy`), it imports this
# package first: the project's module logs then reach the Prefect UI too.
show_module_logs_in_runs()
