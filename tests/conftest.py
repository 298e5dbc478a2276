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


@pytest.fixture(scope="session", autouse=True)
def shared_compile_cache(tmp_path_factory):
    """One JAX compilation cache for every local run of the session, whatever its storage
    root (TPUPIPE_COMPILE_CACHE, inherited by the orchestrators and workers tests start):
    a cold tiny workload spends 10 of its 15 s compiling. A test of the cache itself
    unsets it (`monkeypatch.delenv`), and gets its root's own `compile_cache/`."""
    from tasks.plan import COMPILE_CACHE_ENV

    before = os.environ.get(COMPILE_CACHE_ENV)
    # Under pytest-xdist every worker has a base directory of its own in one shared parent:
    # the workers share one cache (JAX writes its entries under a file lock).
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    (shared / "compile_cache").mkdir(exist_ok=True)
    os.environ[COMPILE_CACHE_ENV] = str(shared / "compile_cache")
    yield
    if before is None:
        os.environ.pop(COMPILE_CACHE_ENV, None)
    else:
        os.environ[COMPILE_CACHE_ENV] = before
