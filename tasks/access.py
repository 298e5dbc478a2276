"""The cloud backends a run will use, checked before anything is provisioned.

A backend that cannot work failed the run only when it was first used: a storage block
after sharding (a bare CredentialsError), a BigQuery block or a dataset in another
location at landing, after the TPU hours were spent. Each check here builds the client the
run will build, with no API call, except for the BigQuery sink, whose dataset and tables
are made ready (`ensure_tables`): the run already calls the storage API before
provisioning (gs:// sources, the run directory), and a dataset's location, whether the
credentials may create it, and whether an existing table can take the rows can be known
no other way. A dataset they could not create, or a table whose column changed type, was
found only when landing, after the run had trained. Every refusal names the fields to fix.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from tasks.plan import is_gcs
from tasks.remote import storage_client
from workloads.config_file import ConfigError

if TYPE_CHECKING:
    from tasks.plan import RunPlan
    from workloads.config import PipelineConfig

log = logging.getLogger(__name__)


def check_backend_access(config: PipelineConfig, plan: RunPlan) -> None:
    """The slice provider, the gs:// storage root and the BigQuery sink can be reached
    with the credentials and projects the config names (see the checks below).

    Raises:
        ConfigError: naming the section's project / credentials_block, or metrics.location.
    """
    check_slice_access(config, plan)
    check_storage_access(config)
    check_source_access(config)
    check_metrics_access(config, plan)


def check_slice_access(config: PipelineConfig, plan: RunPlan) -> None:
    """A gcp slice's credentials and project resolve, with no API call: on a machine with
    neither, a run sharded and uploaded its dataset, then failed at its first attempt with
    an error that named no field.

    Raises:
        ConfigError: naming slice.project / slice.credentials_block and the fix.
    """
    if config.slice.provider != "gcp":
        return
    from infra.gcp.clients import CredentialsError
    from infra.slices import build_provider

    try:
        build_provider("gcp", plan.slices_root, config.slice)  # kept: the run reuses it
    except CredentialsError as exc:
        raise ConfigError(
            f"slice.provider 'gcp' with slice.project={config.slice.project!r} and "
            f"slice.credentials_block={config.slice.credentials_block!r}: {exc}"
        ) from None


def check_storage_access(config: PipelineConfig) -> None:
    """A gs:// storage root's credentials resolve (no API call): the dataset is uploaded
    with them once it is sharded.

    Raises:
        ConfigError: naming storage.project / storage.credentials_block and the fix.
    """
    if is_gcs(config.storage.root):
        storage_client(config)


def check_source_access(config: PipelineConfig) -> None:
    """Credentials for `gs://` dataset sources resolve (no API call). Sources are read
    with Application Default Credentials, as orbax and epath read `gs://` paths; without
    them, listing the sources failed with a bare CredentialsError (exit 1).

    Raises:
        ConfigError: naming dataset.sources and the fix.
    """
    remote = [s for s in config.dataset.sources if s.startswith("gs://")]
    if remote:
        check_adc(f"dataset.sources {remote[0]!r}")


def check_adc(what: str) -> None:
    """Application Default Credentials resolve (no API call): `what`, a `gs://` place read
    through epath, gcsfs or tensorstore, is read with them.

    Raises:
        ConfigError: "`what` is read with Application Default Credentials: <why not>".
    """
    from infra.gcp.clients import CredentialsError
    from infra.gcp.clients import storage_client as gcs_client

    try:
        gcs_client()
    except (CredentialsError, OSError) as exc:  # OSError: no project could be determined
        raise ConfigError(f"{what} is read with Application Default Credentials: {exc}") from None


# How long the check before a run retries each BigQuery call: an unreachable BigQuery
# failed the run's start after 300 s (a call's full deadline, `RETRY`).
PRESTART_WAIT_S = 60.0


def check_metrics_access(config: PipelineConfig, plan: RunPlan) -> None:
    """The BigQuery sink's credentials resolve, and its dataset and tables are ready: the
    dataset in metrics.location (created there if missing), each table created or migrated
    to its row model (`BigQuerySink.ensure_tables`, which landing repeats).

    Raises:
        ConfigError: naming metrics.project / metrics.credentials_block, metrics.location
            and the dataset's own location, metrics.dataset when it may not be read or
            created, or the table whose column changed type.
        google.api_core.exceptions.GoogleAPICallError / RetryError: BigQuery could not be
            reached within `PRESTART_WAIT_S` a call; the message names the call.
    """
    metrics = config.metrics
    if metrics.sink != "bigquery":
        return
    from google.api_core import exceptions as gexc

    from infra.gcp.clients import CredentialsError
    from infra.metrics import build_sink
    from infra.metrics.bigquery_sink import LocationError, SchemaError

    try:
        sink = build_sink("bigquery", plan.metrics_path, metrics, PRESTART_WAIT_S)
    except (CredentialsError, OSError) as exc:  # OSError: no project could be determined
        raise ConfigError(
            f"metrics.sink 'bigquery' with metrics.project={metrics.project!r} and "
            f"metrics.credentials_block={metrics.credentials_block!r}: {exc}"
        ) from None
    try:
        sink.ensure_tables()
    except LocationError as exc:
        raise ConfigError(f"metrics.location = {metrics.location!r}: {exc}") from None
    except SchemaError as exc:
        raise ConfigError(f"metrics.dataset = {metrics.dataset!r}: {exc}") from None
    except gexc.Forbidden as exc:  # landing would fail the same way, after the training
        raise ConfigError(
            f"metrics.dataset = {metrics.dataset!r}: these credentials may not use "
            f"{sink.dataset} ({exc.message}); grant roles/bigquery.dataEditor on it, and "
            "bigquery.datasets.create on the project while it does not exist (or create it)"
        ) from None


def check_sweeps_table(config: PipelineConfig, plan: RunPlan) -> None:
    """The `sweeps` table can take a sweep's rows: created, or migrated and checked as
    its landing would (`ensure_sweep_table`), before any trial trains. A table made or
    changed by hand that would refuse them (a NOT NULL `error`, an INT64 `eval_loss`)
    failed the sweep's landing, after every trial had trained.

    Best effort, as `tasks.run_owner.check_run_owner`: a DuckDB file not made yet (the
    first landing makes it) or held by another process, or a BigQuery error other than
    the table's, passes, and landing reports its own errors.

    Raises:
        ConfigError: naming metrics.path or metrics.dataset and what is wrong.
    """
    from infra.metrics import build_sink

    metrics = config.metrics
    if metrics.sink == "duckdb":
        from infra.metrics.duckdb_tables import SchemaError

        if not os.path.exists(plan.metrics_path):
            return
        refusals: tuple[type[Exception], ...] = (SchemaError,)
        where, wait = f"metrics.path = {plan.metrics_path!r}", 0.0
    else:
        from infra.metrics.bigquery_sink import LocationError, SchemaError

        refusals = (SchemaError, LocationError)
        where, wait = f"metrics.dataset = {metrics.dataset!r}", PRESTART_WAIT_S
    problem = None
    try:
        build_sink(metrics.sink, plan.metrics_path, metrics, wait).ensure_sweep_table()
    except refusals as exc:
        problem = f"{where}: {exc}"
    except Exception as exc:  # the check is advisory (see above)
        from infra.metrics.duckdb_file import unusable_database
        from tasks.run_owner import damaged_database, unread

        if metrics.sink == "duckdb" and unusable_database(exc):
            problem = damaged_database(plan.metrics_path, exc)
        else:
            log.warning("could not check the sweeps table: %s", unread(exc))
    if problem is not None:
        # Raised outside the handler, so the sink's error is not its context: that error's
        # frames hold the DuckDB connection, and the flow run's failed state keeps it.
        raise ConfigError(problem)
