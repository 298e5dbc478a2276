"""What a Cloud TPU slice is made of: its settings, the Node the API creates, and the
start-up script every worker runs.

The start-up script is constant text. User values (config path, wheel, environment)
travel as instance metadata and are read back by the script and by `infra.gcp.launcher`
as data, so nothing the user wrote is ever parsed by a shell.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field
from typing import Any

from google.cloud import tpu_v2

from infra.slices.base import SliceError, SliceSpec, SliceState

# Metadata keys the start-up script and the launcher read.
MD_WHEEL = "tpupipe-wheel"
MD_TPU_PACKAGES = "tpupipe-tpu-packages"
MD_ARGV = "tpupipe-argv"
MD_ENV = "tpupipe-env"
MD_EXIT_URI = "tpupipe-exit-uri"
MD_HOSTS = "tpupipe-hosts"

# Runs as root at every boot of every worker. `md` reads one metadata attribute; values are
# only ever expanded inside double quotes. If anything fails before the launcher takes over
# (download, pip), the ERR trap still leaves an exit record, so the orchestrator learns of
# it at once instead of after the heartbeat timeout.
STARTUP_SCRIPT = r"""#!/bin/bash
# tpupipe worker start-up. Constant text: every value comes from instance metadata.
set -euo pipefail
md() {
  curl -sSf -H 'Metadata-Flavor: Google' \
    "http://metadata.google.internal/computeMetadata/v1/instance/attributes/$1"
}
work=/var/lib/tpupipe
worker="$(md agent-worker-number || echo 0)"
exit_uri="$(md tpupipe-exit-uri)"
report_failure() {
  printf '{"worker": %d, "exit_code": 127, "stage": "startup"}' "$worker" |
    gcloud storage cp - "$exit_uri/worker-$worker.json" || true
}
trap report_failure ERR
mkdir -p "$work/wheel"
rm -f "$work"/wheel/*.whl
gcloud storage cp "$(md tpupipe-wheel)" "$work/wheel/"
md tpupipe-tpu-packages > "$work/tpu-requirements.txt"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet "$work"/wheel/*.whl -r "$work/tpu-requirements.txt"
trap - ERR
exec "$work/venv/bin/python" -m infra.gcp.launcher >>"$work/launcher.log" 2>&1
"""

# Node states, in the Protocol's vocabulary. Everything transient counts as CREATING.
_DONE_STATES = {
    tpu_v2.Node.State.PREEMPTED: "PREEMPTED",
    tpu_v2.Node.State.TERMINATED: "TERMINATED",
    tpu_v2.Node.State.STOPPED: "TERMINATED",
    tpu_v2.Node.State.STOPPING: "TERMINATED",
    tpu_v2.Node.State.HIDDEN: "TERMINATED",
    tpu_v2.Node.State.DELETING: "NOT_FOUND",
}


def protocol_state(state: tpu_v2.Node.State) -> str:
    """The SliceState name of a TPU node state (READY, CREATING, PREEMPTED, …)."""
    if state == tpu_v2.Node.State.READY:
        return "READY"
    return _DONE_STATES.get(state, "CREATING")


_QR = tpu_v2.QueuedResourceState.State
# A spot request whose TPUs were taken back (by the service: a spot reclaim) or are being:
# its node is gone or going, and the slice must be re-created, as after a preemption.
QR_RECLAIMED = (_QR.SUSPENDING, _QR.SUSPENDED)


def request_state(qr: tpu_v2.QueuedResource) -> SliceState:
    """What a spot request without its node means for the slice: CREATING while it waits,
    PREEMPTED once the service took its TPUs back (SUSPENDING, SUSPENDED: the watch then
    re-creates the slice at once, not after the heartbeat timeout), NOT_FOUND once it
    failed or is being deleted."""
    state = qr.state.state
    if state in QR_RECLAIMED:
        return SliceState.PREEMPTED
    return SliceState.NOT_FOUND if state in (_QR.FAILED, _QR.DELETING) else SliceState.CREATING


def request_labels(qr: tpu_v2.QueuedResource) -> dict[str, str]:
    """The labels of the node a spot request makes (the slice's labels)."""
    return dict(qr.tpu.node_spec[0].node.labels) if qr.tpu.node_spec else {}


@dataclass(frozen=True, kw_only=True)
class TpuSettings:
    """Everything the GCP provider needs to know beyond a SliceSpec.

    Attributes:
        project: project the TPUs live in.
        zones: zones to try, in order (the configured zone first, then the fallbacks).
        accelerator_type: e.g. "v5litepod-8".
        runtime_version: TPU VM image, e.g. "v2-alpha-tpuv5-lite".
        capacity: "on-demand", "spot" (through a queued resource) or "reserved".
        wheel: gs:// URI of the project's wheel installed on every worker.
        tpu_packages: extra pip requirements for the workers (libtpu).
        service_account: e-mail of the workers' service account; None for the default.
        network, subnetwork: VPC placement; None for the defaults.
        external_ip: give workers external IPs.
        queue_timeout_s: a spot request still waiting this long is cancelled.
        provision_timeout_s: longest wait for READY after the create is accepted.
        provision_attempts: create attempts per zone on quota/capacity errors.
        max_lifetime_s: lifetime written as the `ttl` label (epoch seconds).
        poll_s: seconds between polls of operations, nodes and queued resources.
        late_create_s: how long a delete watches for the slice of a create request that
            was interrupted before its answer (a signal), which the API may still carry out.
        backoff_s: first wait after a quota/capacity error; doubles up to 10 minutes.
    """

    project: str
    zones: tuple[str, ...]
    accelerator_type: str
    runtime_version: str
    capacity: str = "on-demand"
    wheel: str
    tpu_packages: tuple[str, ...] = ()
    service_account: str | None = None
    network: str | None = None
    subnetwork: str | None = None
    external_ip: bool = False
    queue_timeout_s: float = 3600.0
    provision_timeout_s: float = 1800.0
    provision_attempts: int = 3
    max_lifetime_s: float = 86400.0
    poll_s: float = 5.0
    late_create_s: float = 30.0
    backoff_s: float = 30.0
    extra_env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: Any, project: str, **overrides: Any) -> TpuSettings:
        """Settings from a `SliceConfig` (any object with its attributes)."""
        values = dict(
            project=project,
            zones=(cfg.zone, *cfg.fallback_zones),
            accelerator_type=cfg.accelerator_type,
            runtime_version=cfg.runtime_version,
            capacity=cfg.capacity,
            wheel=cfg.wheel,
            tpu_packages=tuple(cfg.tpu_packages),
            service_account=cfg.service_account,
            network=cfg.network,
            subnetwork=cfg.subnetwork,
            external_ip=cfg.external_ip,
            queue_timeout_s=cfg.queue_timeout_s,
            provision_timeout_s=cfg.provision_timeout_s,
            provision_attempts=cfg.provision_attempts,
            max_lifetime_s=cfg.max_lifetime_s,
        )
        values.update(overrides)
        return cls(**values)


def workload_argv(spec: SliceSpec) -> list[str]:
    """The workload's arguments after the interpreter, checked to read a gs:// config.

    The orchestrator's `sys.executable` means nothing on a TPU VM: the launcher runs these
    arguments with the workers' own interpreter.

    Raises:
        SliceError: the command is not `<python> -m <module> … --config gs://…`.
    """
    args = spec.command[1:]
    if args[:1] != ["-m"] or "--config" not in args:
        raise SliceError(f"slice {spec.name!r}: expected `<python> -m <module> --config …`")
    config = args[args.index("--config") + 1] if args.index("--config") + 1 < len(args) else ""
    if not config.startswith("gs://"):
        raise SliceError(
            f"slice {spec.name!r}: TPU workers cannot read {config!r}; the run directory must "
            "be in GCS (storage.root = gs://bucket/prefix)"
        )
    return args


def exit_uri(spec: SliceSpec, launch_id: str) -> str:
    """Where this incarnation's workers leave their exit records and logs (beside the log)."""
    if not spec.log_path.startswith("gs://"):
        raise SliceError(f"slice {spec.name!r}: log_path {spec.log_path!r} must be gs://")
    return posixpath.join(posixpath.dirname(spec.log_path), f"{spec.name}-{launch_id}")


def build_node(
    spec: SliceSpec, settings: TpuSettings, labels: dict[str, str], launch_id: str
) -> tpu_v2.Node:
    """The Node to create for `spec`: type, image, capacity, network, labels, metadata."""
    env = {**settings.extra_env, **spec.env}
    if spec.hosts > 1:
        env.setdefault("TPUPIPE_DISTRIBUTED", "auto")  # JAX finds its peers on Cloud TPU
    metadata = {
        "startup-script": STARTUP_SCRIPT,
        MD_WHEEL: settings.wheel,
        MD_TPU_PACKAGES: "\n".join(settings.tpu_packages) + "\n",
        MD_ARGV: json.dumps(workload_argv(spec)),
        MD_ENV: json.dumps(env, sort_keys=True),
        MD_EXIT_URI: exit_uri(spec, launch_id),
        MD_HOSTS: str(spec.hosts),
    }
    node = tpu_v2.Node(
        accelerator_type=settings.accelerator_type,
        runtime_version=settings.runtime_version,
        labels=labels,
        metadata=metadata,
        network_config=tpu_v2.NetworkConfig(
            network=settings.network or "",
            subnetwork=settings.subnetwork or "",
            enable_external_ips=settings.external_ip,
        ),
        description=f"tpupipe slice {spec.name}",
    )
    if settings.service_account:
        node.service_account = tpu_v2.ServiceAccount(
            email=settings.service_account,
            scope=["https://www.googleapis.com/auth/cloud-platform"],
        )
    if settings.capacity == "reserved":
        node.scheduling_config = tpu_v2.SchedulingConfig(reserved=True)
    # Spot is not set here: it is a property of the queued resource that carries this node
    # (`QueuedResource.spot`), as `gcloud … queued-resources create --spot` does.
    return node
