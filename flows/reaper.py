"""`reap-orphans`: delete slices whose owner is gone (deployed every 10 minutes)."""

from __future__ import annotations

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NONE
from prefect.client.orchestration import get_client
from prefect.exceptions import ObjectNotFound
from prefect.runtime import flow_run

# A worker loads this file by its path (prefect.yaml's entrypoint), which imports
# no package; the flows package's set-up sends the project's module logs to the run and
# logs refusals in one line, as `tpupipe run` does.
import flows  # noqa: F401
from tasks.own_slice import record_teardown_delete
from tasks.teardown import provider_for, reap
from workloads.config import PipelineConfig


def _flow_run_state(flow_run_id: str) -> str | None:
    with get_client(sync_client=True) as client:
        try:
            run = client.read_flow_run(flow_run_id)
        except (ObjectNotFound, ValueError):
            return None
    return run.state.type.value if run.state else None


@task(name="reap-slices", cache_policy=NONE)
def reap_slices(config: PipelineConfig) -> list[tuple[str, str]]:
    """Delete this project's orphaned slices on the config's provider, recording each
    deletion in its run's ledger when the run is under the config's storage root."""
    logger = get_run_logger()
    invocation = flow_run.get_id()
    return reap(
        provider_for(config),
        _flow_run_state,
        on_reaped=lambda name, reason: logger.warning("reaped slice %s: %s", name, reason),
        on_deleted=lambda status: record_teardown_delete(config, status, invocation),
    )


@flow(name="reap-orphans")
def reap_orphans(config: PipelineConfig | None = None) -> list[tuple[str, str]]:
    """Reap on the provider and storage root of `config` (default: the local ones)."""
    return reap_slices(config or PipelineConfig())
