"""Config that only a Cloud TPU run would trip over is refused at validation, naming the field
and its line: a run name no TPU node id can carry, durations the TPU API or the reaper
cannot honour, zones, a BigQuery location that is no location, and credentials blocks of
the storage and metrics backends (found by an acceptance probe: each of these passed
validate and failed only after sharding and uploading, or after training)."""

from __future__ import annotations

import re

import pytest

from infra.gcp import clients
from tasks.plan import plan_run, slice_name
from tests.helpers import GCP_OVERRIDES, tiny_config
from workloads.config_file import ConfigError, load_config

# RFC 1035, which TPU node ids follow.
_NODE_ID = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


@pytest.mark.parametrize("name", ["abc-", "x" * 54 + "-", "a--"])
def test_a_run_name_ending_in_a_dash_is_refused_naming_it(tmp_path, name):
    # tpupipe-abc- is no TPU node id: the run sharded and uploaded, then the API refused it.
    with pytest.raises(ConfigError) as err:
        tiny_config(tmp_path, f"run_name={name}")
    assert "run_name" in str(err.value) and repr(name) in str(err.value)


@pytest.mark.parametrize(
    "name", ["a", "0", "tiny", "run-20261122-061530-a1b2", "a--b", "x" * 55, "x" * 63, "9" * 63]
)
def test_every_valid_run_name_gives_a_valid_tpu_node_id(tmp_path, name):
    assert tiny_config(tmp_path, f"run_name={name}").run_name == name
    assert _NODE_ID.match(slice_name(name)), slice_name(name)


def test_trials_of_a_sweep_named_with_a_trailing_dash_get_valid_node_ids():
    from tasks.sweep_space import SweepConfig

    for sweep in ("lr-", "s" * 50 + "-"):
        config = SweepConfig(sweep_name=sweep)
        for i in (0, 99, 100):
            trial = f"{config.sweep_name}-t{i:02d}"
            assert _NODE_ID.match(slice_name(trial)), slice_name(trial)


@pytest.mark.parametrize("value", ["1e12", "0.5", "0", "700000"])
def test_a_queue_timeout_the_tpu_api_cannot_take_is_refused(tmp_path, value):
    # 1e12 s failed provisioning with "Duration is not valid"; 0.5 s became "0s".
    with pytest.raises(ConfigError, match=r"slice.queue_timeout_s"):
        tiny_config(tmp_path, f"slice.queue_timeout_s={value}")


@pytest.mark.parametrize("value", ["0.1", "599"])
def test_a_lifetime_shorter_than_the_reapers_round_is_refused(tmp_path, value):
    # The reaper deleted the slice of a live run once its ttl label passed.
    with pytest.raises(ConfigError, match=r"slice.max_lifetime_s"):
        tiny_config(tmp_path, f"slice.max_lifetime_s={value}")


def test_a_lifetime_shorter_than_provisioning_and_start_up_is_refused(tmp_path):
    with pytest.raises(ConfigError) as err:
        tiny_config(
            tmp_path,
            *GCP_OVERRIDES,
            "slice.capacity=spot",
            "slice.max_lifetime_s=3600",  # < queue 3600 + provision 1800 + heartbeat 600
        )
    message = str(err.value)
    assert "slice.max_lifetime_s = 3600" in message and "slice.queue_timeout_s" in message


def test_the_shipped_spot_config_keeps_its_bounds():
    config = load_config("configs/v5e-8-spot.yaml")
    assert config.slice.max_lifetime_s == 43200 and config.slice.queue_timeout_s == 3600


def test_a_bad_zone_names_its_field_and_its_own_line(tmp_path):
    path = tmp_path / "gcp.yaml"
    path.write_text(
        "run_name: z\n"
        "mesh: {data: -1, fsdp: 1, tensor: 1}\n"
        "storage: {root: gs://bkt/root}\n"
        "slice:\n"
        "  provider: gcp\n"
        "  zone: us-west4-a\n"
        "  fallback_zones:\n"
        "    - us-east5-b\n"
        "    - europe-west4\n"
        "  accelerator_type: v5litepod-8\n"
        "  runtime_version: v2-alpha-tpuv5-lite\n"
        "  wheel: gs://bkt/tpupipe-0-py3-none-any.whl\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}:9: slice.fallback_zones.1: 'europe-west4' ")

    with pytest.raises(ConfigError) as err:
        load_config(path, ["slice.zone=us-west4"])
    assert str(err.value).startswith("--set: slice.zone: 'us-west4' ")


@pytest.mark.parametrize("location", ["mars", "us-west4-a", "", "US-CENTRAL1"])
def test_a_bigquery_location_that_is_no_location_is_refused(tmp_path, location):
    with pytest.raises(ConfigError, match=r"metrics.location"):
        tiny_config(tmp_path, "metrics.sink=bigquery", f"metrics.location={location}")


@pytest.mark.parametrize("location", ["US", "EU", "us", "us-central1", "europe-west4"])
def test_bigquery_locations_are_accepted(tmp_path, location):
    config = tiny_config(tmp_path, "metrics.sink=bigquery", f"metrics.location={location}")
    assert config.metrics.location == location


@pytest.fixture
def no_emulators(tmp_path, monkeypatch):
    """No emulator, no gcloud configuration, no metadata server: no credentials at all."""
    for name in (
        clients.TPU_EMULATOR_HOST,
        clients.STORAGE_EMULATOR_HOST,
        clients.BIGQUERY_EMULATOR_HOST,
        "GOOGLE_APPLICATION_CREDENTIALS",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")  # nothing listens: refused
    monkeypatch.setenv("GCE_METADATA_IP", "127.0.0.1:9")


@pytest.mark.parametrize("section", ["storage", "metrics"])
def test_a_credentials_block_that_cannot_load_is_refused_naming_its_field(
    tmp_path, no_emulators, section
):
    # It failed after training (metrics) or after sharding (storage) with a bare
    # CredentialsError; prefect-gcp is not installed here, so the block cannot load.
    from tasks.access import check_backend_access

    root = "gs://bkt/root" if section == "storage" else str(tmp_path)
    config = tiny_config(
        tmp_path,
        f"storage.root={root}",
        "metrics.sink=bigquery",
        f"{section}.credentials_block=nope",
    )
    with pytest.raises(ConfigError) as err:
        check_backend_access(config, plan_run(config))
    assert f"{section}.credentials_block='nope'" in str(err.value)
    assert "prefect-gcp" in str(err.value)


def test_validate_config_checks_the_backends_before_anything_runs(tmp_path, no_emulators):
    from tasks.prepare import validate_config

    config = tiny_config(tmp_path, "metrics.sink=bigquery", "metrics.credentials_block=nope")
    with pytest.raises(ConfigError, match=r"metrics.credentials_block='nope'"):
        validate_config.fn(config)
