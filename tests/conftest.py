"""Shared fixtures. Eight virtual CPU devices must be configured before jax is imported."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from pathlib import Path

# Prefect's first import configures logging with dictConfig, which closes every handler
# already installed. absl's (installed when grain is imported) closes its stream unless it
# is the current sys.stderr: under pytest, the capture stream of the test that imported
# grain, so a later test importing Prefect crashed pytest ("lost sys.stderr"). Imported
# first, Prefect configures logging before any other handler exists.
import prefect.main  # noqa: F401
import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def prefect_harness():
    """One temporary Prefect API for the whole session (starting one costs ~20 s)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
