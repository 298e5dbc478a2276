"""The flows: the training pipeline, sweeps and the orphan reaper."""

from typing import Any

from pydantic import BaseModel, Field

from tasks.logs import log_refusals_without_traceback, show_module_logs_in_runs
from workloads.config_types import form_values

# Whichever way a flow's process starts (CLI, worker, `prefect deploy`), it imports this
# package first: the project's module logs then reach the Prefect UI too, and a refused
# config or input is logged without a traceback.
show_module_logs_in_runs()
log_refusals_without_traceback()


def form_parameter(default: BaseModel) -> Any:
    """A flow parameter's default, `default`, shown in the Prefect UI's run form with each
    field its section fills in by itself empty (`workloads.config_types.form_values`): the
    form sends what it shows, and a shown value overrode what the user picked to fill it
    (the run of `model.size: small` trained the tiny model's dimensions)."""
    return Field(default=default, json_schema_extra={"default": form_values(default)})
