"""The slice interface: what every provider (local process group, GCP TPU) speaks.

The vocabulary is the TPU API's on purpose, so flows and the reaper handle a local slice
and a TPU slice with the same code. Names and labels are validated here with GCP's rules,
so a config that works locally does not fail later when it reaches a real TPU.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

# GCP resource names are lowercase letters, digits and dashes, at most 63 characters.
# RFC 1035, as GCP names a TPU node or queued resource: a leading digit or a trailing dash
# passed a looser check here and failed in the API, after sharding and upload.
_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
# GCP label keys start with a letter; keys and values are lowercase, digits, '_' and '-'.
_LABEL_KEY_RE = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
_LABEL_VALUE_RE = re.compile(r"^[a-z0-9_-]{0,63}$")

# Which copies of a slice name a delete may take, judged on each copy's labels: slices of
# one name can exist in several places at once (two runs' nodes in two zones).
LabelTest = Callable[[Mapping[str, str]], bool]


class SliceError(RuntimeError):
    """A slice operation failed (duplicate name, unsupported shape, process that won't die)."""


class PartialListError(SliceError):
    """Some zones (or regions) could not be listed; `found` holds the slices of the others,
    so a caller tearing slices down can still delete those before raising."""

    def __init__(self, message: str, found: list[SliceStatus]) -> None:
        super().__init__(message)
        self.found = found


class ProvisioningError(SliceError):
    """The slice could not be created (no capacity, quota, bad accelerator, spawn failure)."""


class SliceState(StrEnum):
    """Lifecycle state of a slice, in TPU vocabulary.

    For the local provider: READY while the workload's process group runs, TERMINATED once
    it exited, NOT_FOUND when the slice is unknown or was deleted.
    """

    CREATING = "CREATING"
    READY = "READY"
    PREEMPTED = "PREEMPTED"
    TERMINATED = "TERMINATED"
    NOT_FOUND = "NOT_FOUND"


def validate_name(name: str) -> str:
    """Check a slice name against GCP's rules.

    Args:
        name: the slice name.

    Returns:
        The name unchanged.

    Raises:
        ValueError: if it is not 1-63 characters of `[a-z0-9-]`, starting with a letter and
            not ending in a dash. The local provider also relies on this to keep names
            from escaping its registry directory.
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"slice name {name!r} must be 1-63 characters of [a-z0-9-], starting with a "
            "letter and not ending in a dash"
        )
    return name


def validate_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """Check labels against GCP's label rules and return a plain-dict copy.

    Args:
        labels: label keys to values.

    Returns:
        A new dict with the same pairs.

    Raises:
        ValueError: on a key or value that GCP would reject.
    """
    out: dict[str, str] = {}
    for key, value in labels.items():
        if not isinstance(key, str) or not _LABEL_KEY_RE.fullmatch(key):
            raise ValueError(f"label key {key!r} must match {_LABEL_KEY_RE.pattern}")
        if not isinstance(value, str) or not _LABEL_VALUE_RE.fullmatch(value):
            raise ValueError(f"label {key}={value!r}: value must match {_LABEL_VALUE_RE.pattern}")
        out[key] = value
    return out


@dataclass(frozen=True, kw_only=True)
class SliceSpec:
    """What to create: a named slice of `devices` devices on `hosts` hosts running `command`.

    Keyword-only, so call sites stay readable and field order can never be confused.

    Attributes:
        name: slice name, `[a-z0-9-]`, at most 63 characters.
        labels: labels (GCP rules); the teardown hooks and the reaper select on them.
        devices: accelerator devices in the slice (virtual CPU devices locally).
        hosts: number of hosts, one workload process per host.
        command: the workload's argv; never a shell string, so nothing is re-parsed.
        env: extra environment for the workload on top of the provider's own.
        log_path: file receiving the workload's stdout and stderr.
        run_dir: the run directory the workload reports to (the local provider's chaos
            option watches it); None when unknown.
        chaos: failures the local provider injects (see workloads' ChaosConfig fields);
            other providers refuse a spec that asks for chaos.
    """

    name: str
    labels: dict[str, str] = field(default_factory=dict)
    devices: int
    hosts: int = 1
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    log_path: str
    run_dir: str | None = None
    chaos: dict | None = None

    def __post_init__(self) -> None:
        validate_name(self.name)
        # Copies, so a caller mutating its dict later cannot change a "frozen" spec.
        object.__setattr__(self, "labels", validate_labels(self.labels))
        object.__setattr__(self, "env", {str(k): str(v) for k, v in self.env.items()})
        if isinstance(self.command, str) or not self.command:
            raise ValueError("command must be a non-empty argv list, not a shell string")
        object.__setattr__(self, "command", [str(arg) for arg in self.command])
        if self.devices < 1 or self.hosts < 1:
            raise ValueError(f"devices ({self.devices}) and hosts ({self.hosts}) must be >= 1")
        if not self.log_path:
            raise ValueError("log_path is required")


@dataclass(frozen=True)
class SliceStatus:
    """A provider's view of one slice.

    Attributes:
        name: slice name.
        state: lifecycle state.
        exit_code: the workload's exit code when known (negative: killed by that signal);
            None while running or when the provider cannot know it.
        labels: the slice's labels.
        failure: why the workload failed, when the provider knows more than its exit code
            (a worker that failed in its start-up script, before the workload ran).
        host: of a slice of several hosts, the one whose exit `exit_code` is, when the
            provider knows it (the others' exits may only be what its exit did to them).
    """

    name: str
    state: SliceState
    exit_code: int | None = None
    labels: dict[str, str] = field(default_factory=dict)
    failure: str | None = None
    host: int | None = None


@runtime_checkable
class SliceProvider(Protocol):
    """Creates, inspects, deletes and lists slices. Every backend implements this."""

    def create(self, spec: SliceSpec) -> SliceStatus:
        """Create the slice and start `spec.command` on it; raise ProvisioningError/SliceError."""
        ...

    def status(self, name: str) -> SliceStatus:
        """Current state of slice `name`; NOT_FOUND (never an exception) if there is none.

        A transient failure may raise anything; a SliceError means reading again cannot
        help (no permission, say), and the watcher gives up on the slice.
        """
        ...

    def delete(self, name: str, grace_s: float = 5.0, *, where: LabelTest | None = None) -> bool:
        """Delete the slice, idempotently: True if something was deleted, False if not found.

        With `where`, only the copies of the name whose labels it accepts are deleted (a
        provider with several places, such as zones, judges each place's copy on its own);
        None deletes every copy.
        """
        ...

    def copies(self, name: str) -> list[SliceStatus]:
        """Every copy of slice `name` that exists, one per place holding it (a zone), with
        its state and labels; the exit code may be left unread (None)."""
        ...

    def list(self, labels: dict[str, str] | None = None) -> list[SliceStatus]:
        """Slices whose labels include every given pair (all slices when labels is None),
        one status per copy: a name held in two places (zones) is listed twice.

        Raises:
            PartialListError: some zones could not be listed; it holds the others' slices.
        """
        ...

    def placement(self) -> dict[str, Any]:
        """Where this provider creates slices (JSON-able; {} if it has one place only),
        recorded with each attempt's provision request, for `recall`."""
        ...

    def recall(self, name: str, placements: list[dict[str, Any]]) -> list[str]:
        """Also look for slice `name` where earlier attempts recorded creating it
        (`placement`s of other settings: a rerun with another zone), when finding and
        deleting it. Returns the places this provider cannot reach (another project)."""
        ...
