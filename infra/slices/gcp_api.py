"""Plumbing of the Cloud TPU provider (infra/slices/gcp.py): retry policies, errors, the
queued-resource request, long-running operations and the workers' exit records in GCS.

Kept apart so the provider's file reads as the slice life cycle it implements.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import requests
from google.api_core import exceptions as gexc
from google.api_core import retry as gretry
from google.api_core.future.polling import POLLING_PREDICATE
from google.auth import exceptions as auth_exceptions
from google.cloud import tpu_v2
from google.protobuf import duration_pb2

from infra.gcp.retries import logged_retry
from infra.slices.base import ProvisioningError, SliceError
from infra.slices.gcp_node import MD_EXIT_URI, MD_HOSTS, MD_WHEEL, TpuSettings

# A call that never got an answer: the connection was reset or dropped mid-answer, or the
# token refresh could not reach its server. Not API errors, so no status code names them
# (google-api-core's `if_transient_error` lists the same ones).
_UNANSWERED = (
    requests.exceptions.ConnectionError,
    requests.exceptions.ChunkedEncodingError,
    auth_exceptions.TransportError,
)
# Transient failures of a single call; retried by google-api-core with backoff. 429 (rate
# limit) is transient for reads and deletes; for creates it means quota, handled apart.
TRANSIENT = logged_retry(
    "TPU API call failed",
    gretry.if_exception_type(
        gexc.ServiceUnavailable,
        gexc.InternalServerError,
        gexc.BadGateway,
        gexc.GatewayTimeout,
        gexc.TooManyRequests,
        *_UNANSWERED,
    ),
)
# A create is keyed by its node id, so retrying it cannot duplicate anything (a create that
# did arrive answers 409 and is adopted); 429 is not in this list because it means quota,
# which the provisioning loop backs off from.
CREATE_RETRY = logged_retry(
    "TPU create call failed",
    gretry.if_exception_type(gexc.ServiceUnavailable, gexc.InternalServerError, *_UNANSWERED),
)


# Why a create may fail and still be worth another attempt after a backoff (then another
# zone): RESOURCE_EXHAUSTED (quota, capacity, a failed spot request), and a create
# operation that ended INTERNAL or UNAVAILABLE, or CREATE_RETRY running out on an API that
# stayed unavailable. These are transient by gRPC's definition; failing the whole run on
# them (as a raw traceback, never retried) would throw away a run for a hiccup.
CREATE_AGAIN = (
    gexc.TooManyRequests,
    gexc.InternalServerError,
    gexc.ServiceUnavailable,
    gexc.RetryError,
)


class TpuPermissionError(SliceError):
    """The TPU API refused a call for lack of permission: not worth retrying."""


class CapacityError(ProvisioningError):
    """No zone had quota or capacity for the slice within the attempts allowed."""


def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` with the TRANSIENT retry unless the caller gave one."""
    kwargs.setdefault("retry", TRANSIENT)
    return fn(*args, **kwargs)


def wait_op(op: Any, poll_s: float, timeout_s: float) -> Any:
    """A long-running operation's result, polled every `poll_s` (backing off to 30 s);
    its error is raised as an API error. Each poll is retried on TRANSIENT errors: the
    operations client's own default retries a 503 only, not a 429, a 500 or a reset."""
    polling = gretry.Retry(
        predicate=POLLING_PREDICATE,
        initial=poll_s,
        maximum=max(poll_s, 30.0),
        multiplier=1.5,
        timeout=timeout_s,
    )
    try:
        return op.result(polling=polling, retry=TRANSIENT)
    except TimeoutError:
        # api-core's own: a bare TimeoutError that escaped every caller's handling of API
        # errors, so a delete that never finished named no slice and a create's skipped the
        # zone loop. As an API error, each caller names the slice and zone.
        name = getattr(getattr(op, "operation", None), "name", "") or "an operation"
        raise gexc.DeadlineExceeded(
            f"{name} not done after {timeout_s:g}s (slice.provision_timeout_s)"
        ) from None


def spot_request(parent: str, name: str, node: tpu_v2.Node, timeout_s: float):
    """A queued resource asking for `node` as spot capacity, valid for `timeout_s`: the
    API drops it by itself after that, even if the orchestrator died meanwhile."""
    return tpu_v2.QueuedResource(
        tpu=tpu_v2.QueuedResource.Tpu(
            node_spec=[tpu_v2.QueuedResource.Tpu.NodeSpec(parent=parent, node_id=name, node=node)]
        ),
        spot=tpu_v2.QueuedResource.Spot(),
        queueing_policy=tpu_v2.QueuedResource.QueueingPolicy(
            valid_until_duration=duration_pb2.Duration(seconds=int(timeout_s))
        ),
    )


def exit_status(storage: Any, node: tpu_v2.Node) -> tuple[int, str | None, int | None] | None:
    """The workload's exit code once every worker left an exit record in GCS (or one
    failed), with what failed when a record says more than its code (`startup_failure`)
    and, of several workers, the one that failed; None while some are still running, or
    without a storage client."""
    uri = node.metadata.get(MD_EXIT_URI)
    if not uri or storage is None:
        return None
    bucket, _, prefix = uri.removeprefix("gs://").partition("/")
    records = {}
    try:
        for blob in call(storage.list_blobs, bucket, prefix=prefix.rstrip("/") + "/"):
            if blob.name.endswith(".json"):
                record = json.loads(blob.download_as_bytes(retry=TRANSIENT))
                records[int(record["worker"])] = record
    except gexc.Forbidden as e:
        # Not a Forbidden: the provider would take it for the TPU API's and name its role.
        raise SliceError(
            f"Cloud Storage refused to read the workers' exit records under {uri}: "
            f"{e.message}. Grant the orchestrator's identity roles/storage.objectViewer "
            f"on gs://{bucket}"
        ) from e
    except gexc.NotFound as e:  # the bucket: a record listed but gone is not an answer either
        raise SliceError(
            f"cannot read the workers' exit records under {uri}: {e.message} (was the bucket "
            f"gs://{bucket} deleted during the run?)"
        ) from e
    failed = [r for _, r in sorted(records.items()) if int(r["exit_code"]) != 0]
    hosts = int(node.metadata.get(MD_HOSTS, "1"))
    if failed:  # one dead worker stalls the rest in their collectives
        worker = int(failed[0]["worker"]) if hosts > 1 else None
        return int(failed[0]["exit_code"]), startup_failure(failed[0], node), worker
    return (0, None, None) if len(records) >= hosts else None


def startup_failure(record: dict, node: tpu_v2.Node) -> str | None:
    """What a worker whose start-up script failed (its record's stage "startup") was
    doing: the workload never ran, so no log of it exists to point at."""
    if record.get("stage") != "startup":
        return None
    return (
        f"worker {record.get('worker')} failed during start-up (downloading the wheel "
        f"{node.metadata.get(MD_WHEEL)} of slice.wheel, or installing it with "
        "slice.tpu_packages), before the workload started: see the worker's start-up "
        "script log (`journalctl -u google-startup-scripts` on the TPU VM)"
    )


def permission_error(what: str, settings: TpuSettings, exc: gexc.Forbidden) -> TpuPermissionError:
    """A 403 turned into an error that names the API and the role to grant."""
    sa = settings.service_account
    role = "roles/tpu.admin" + (
        f" and roles/iam.serviceAccountUser on {sa}" if sa and what == "create" else ""
    )
    return TpuPermissionError(
        f"the Cloud TPU API (tpu.googleapis.com) refused to {what} TPUs in project "
        f"{settings.project} ({', '.join(settings.zones)}): {exc.message}. "
        f"Enable the API and grant the orchestrator's identity {role} (docs/gcp.md)"
    )
