"""Slices: where a workload runs. `build_provider` picks the backend by name.

Providers are cached per (kind, root) because the local provider's table of `Popen`
objects is the only place exit codes live: every caller in this process (train task,
flow hooks, CLI) must share one instance to see them.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from infra.slices.base import (
    PartialListError,
    ProvisioningError,
    SliceError,
    SliceProvider,
    SliceSpec,
    SliceState,
    SliceStatus,
)
from infra.slices.local import LocalSliceProvider

__all__ = [
    "LocalSliceProvider",
    "PartialListError",
    "ProvisioningError",
    "SliceError",
    "SliceProvider",
    "SliceSpec",
    "SliceState",
    "SliceStatus",
    "build_provider",
]

_PROVIDERS: dict[tuple[str, str], SliceProvider] = {}
_PROVIDERS_LOCK = threading.Lock()


def build_provider(kind: str, root: str, config: Any = None) -> SliceProvider:
    """The slice provider of `kind` rooted at `root`, one shared instance per pair.

    Args:
        kind: "local" or "gcp".
        root: the pipeline root; the local provider keeps its registry in `{root}/slices`.
        config: the `SliceConfig` (required for "gcp": project, zones, accelerator…).

    Returns:
        The provider, the same object for every call with the same kind, root and (for
        "gcp") config, so its clients are built once.

    Raises:
        ValueError: if `kind` is not a known backend, or "gcp" comes without a config.
    """
    if kind == "gcp":
        if config is None:
            raise ValueError("the gcp slice provider needs the slice config")
        key = (kind, f"{root}|{config.model_dump_json()}")
        with _PROVIDERS_LOCK:
            if key not in _PROVIDERS:
                _PROVIDERS[key] = _gcp_provider(config)
            return _PROVIDERS[key]
    if kind != "local":
        raise ValueError(f"unknown slice provider kind {kind!r}; known: 'local', 'gcp'")
    # Normalised, so "./x" and "/abs/x" share one instance (and one Popen table).
    key = (kind, os.path.abspath(os.fspath(root)))
    with _PROVIDERS_LOCK:
        provider = _PROVIDERS.get(key)
        if provider is None:
            provider = LocalSliceProvider(registry_dir(key[1]))
            _PROVIDERS[key] = provider
        return provider


def registry_dir(root: str | os.PathLike) -> str:
    """The directory of the local slices' records under local root `root`."""
    return os.path.join(os.path.abspath(os.fspath(root)), "slices")


def _gcp_provider(config: Any) -> SliceProvider:
    # Imported here: the Google clients cost a second to import and local runs need none.
    from infra.gcp.clients import default_project, storage_client, tpu_client
    from infra.slices.gcp import GcpSliceProvider
    from infra.slices.gcp_node import TpuSettings

    block = config.credentials_block
    project = default_project(config.project, block)
    settings = TpuSettings.from_config(config, project, poll_s=min(5.0, config.poll_interval_s))
    return GcpSliceProvider(tpu_client(block), storage_client(project, block), settings)
