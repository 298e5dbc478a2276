"""Slices: where a workload runs. `build_provider` picks the backend by name.

Providers are cached per (kind, root) because the local provider's table of `Popen`
objects is the only place exit codes live: every caller in this process (train task,
flow hooks, CLI) must share one instance to see them.
"""

from __future__ import annotations

import os
import threading

from infra.slices.base import (
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


def build_provider(kind: str, root: str) -> SliceProvider:
    """The slice provider of `kind` rooted at `root`, one shared instance per pair.

    Args:
        kind: backend name; only "local" exists so far.
        root: the pipeline root; the local provider keeps its registry in `{root}/slices`.

    Returns:
        The provider, the same object for every call with the same kind and root.

    Raises:
        ValueError: if `kind` is not a known backend.
    """
    if kind != "local":
        raise ValueError(f"unknown slice provider kind {kind!r}; known: 'local'")
    # Normalised, so "./x" and "/abs/x" share one instance (and one Popen table).
    key = (kind, os.path.abspath(os.fspath(root)))
    with _PROVIDERS_LOCK:
        provider = _PROVIDERS.get(key)
        if provider is None:
            provider = LocalSliceProvider(os.path.join(key[1], "slices"))
            _PROVIDERS[key] = provider
        return provider
