"""Credentials and the one client per Google API, built once and handed to the backends.

Credentials come from Application Default Credentials, or from a named prefect-gcp
`GcpCredentials` block when the config names one. They are never logged, never returned
in a parameter or an artifact, and never written to the run directory.

Emulators: each client honours its API's emulator variable, and then uses anonymous
credentials instead of asking ADC (which has nothing to give on a machine with no
account). `STORAGE_EMULATOR_HOST` and `BIGQUERY_EMULATOR_HOST` are the Google client
libraries' own variables; the TPU API has no emulator, so `TPU_EMULATOR_HOST` (same
convention) points the TPU client at the fake API the tests run.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials, Credentials

if TYPE_CHECKING:
    from google.cloud import bigquery, storage, tpu_v2

CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"
TPU_EMULATOR_HOST = "TPU_EMULATOR_HOST"
STORAGE_EMULATOR_HOST = "STORAGE_EMULATOR_HOST"
BIGQUERY_EMULATOR_HOST = "BIGQUERY_EMULATOR_HOST"


class CredentialsError(RuntimeError):
    """No usable Google credentials, or the named block cannot be loaded."""


def load_credentials(block_name: str | None = None) -> tuple[Credentials, str | None]:
    """Credentials and their default project, from a GcpCredentials block or from ADC.

    Args:
        block_name: name of a prefect-gcp `GcpCredentials` block; None for ADC.

    Returns:
        (credentials, project id or None).

    Raises:
        CredentialsError: the block cannot be loaded (prefect-gcp missing, no such block)
            or ADC finds nothing; the message says how to fix it, never what a key holds.
    """
    if block_name:
        try:
            from prefect_gcp import GcpCredentials  # optional: only when a block is named
        except ImportError as e:
            raise CredentialsError(
                f"credentials block {block_name!r} is set but prefect-gcp is not installed "
                "(`pip install prefect-gcp`), or leave credentials_block empty to use "
                "Application Default Credentials"
            ) from e
        try:
            block = GcpCredentials.load(block_name)
        except ValueError as e:
            raise CredentialsError(f"no GcpCredentials block named {block_name!r}") from e
        return block.get_credentials_from_service_account(), block.project
    import google.auth
    from google.auth.exceptions import DefaultCredentialsError

    try:
        credentials, project = google.auth.default(scopes=[CLOUD_PLATFORM_SCOPE])
    except DefaultCredentialsError as e:
        # ADC reads this file first and only: when it is missing or malformed, "run gcloud
        # auth" would send the user the wrong way. google-auth's reason says which it is.
        named = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
        if named:
            reason = "; ".join(str(a) for a in e.args)  # the file's problem, and its cause
            raise CredentialsError(
                f"GOOGLE_APPLICATION_CREDENTIALS={named} gives no credentials ({reason}): fix the "
                "file, unset the variable to use the other ADC sources, or set credentials_block"
            ) from e
        raise CredentialsError(
            "no Application Default Credentials: run `gcloud auth application-default "
            "login`, attach a service account, or set credentials_block"
        ) from e
    return credentials, project


def _emulated(variable: str, block_name: str | None) -> tuple[Credentials, None] | None:
    # An emulator wants no credentials; a named block still wins, so a misconfigured
    # environment cannot silently swap real credentials for anonymous ones.
    if os.environ.get(variable) and not block_name:
        return AnonymousCredentials(), None
    return None


def _endpoint(host: str) -> str:
    return host if host.startswith(("http://", "https://")) else f"http://{host}"


def tpu_client(block_name: str | None = None) -> tpu_v2.TpuClient:
    """The TPU API client (REST transport), against `TPU_EMULATOR_HOST` when it is set."""
    from google.cloud import tpu_v2

    host = os.environ.get(TPU_EMULATOR_HOST)
    credentials, _ = _emulated(TPU_EMULATOR_HOST, block_name) or load_credentials(block_name)
    options = ClientOptions(api_endpoint=_endpoint(host)) if host else None
    return tpu_v2.TpuClient(transport="rest", credentials=credentials, client_options=options)


def default_project(explicit: str | None, block_name: str | None = None) -> str:
    """`explicit` if given, else the credentials' project.

    Raises:
        CredentialsError: neither says which project to use.
    """
    if explicit:
        return explicit
    _, project = load_credentials(block_name)
    if not project:
        raise CredentialsError(
            "no project: set slice.project / storage.project / metrics.project, or "
            "`gcloud config set project`"
        )
    return project


def storage_client(project: str | None = None, block_name: str | None = None) -> storage.Client:
    """The Cloud Storage client; on `STORAGE_EMULATOR_HOST` it talks to the emulator."""
    from google.cloud import storage

    emulated = _emulated(STORAGE_EMULATOR_HOST, block_name)
    if emulated:
        return storage.Client(project=project or "emulator", credentials=emulated[0])
    credentials, adc_project = load_credentials(block_name)
    return storage.Client(project=project or adc_project, credentials=credentials)


def bigquery_client(
    project: str | None = None, location: str | None = None, block_name: str | None = None
) -> bigquery.Client:
    """The BigQuery client; on `BIGQUERY_EMULATOR_HOST` it talks to the emulator."""
    from google.cloud import bigquery

    kwargs: dict[str, Any] = {"location": location}
    host = os.environ.get(BIGQUERY_EMULATOR_HOST)
    emulated = _emulated(BIGQUERY_EMULATOR_HOST, block_name)
    if emulated:
        kwargs["client_options"] = ClientOptions(api_endpoint=_endpoint(host))
        return bigquery.Client(project=project or "emulator", credentials=emulated[0], **kwargs)
    credentials, adc_project = load_credentials(block_name)
    return bigquery.Client(project=project or adc_project, credentials=credentials, **kwargs)
