"""Credentials for the Google clients (infra/gcp/clients.py) when ADC cannot give any: the
error says why, naming the file GOOGLE_APPLICATION_CREDENTIALS points at."""

from __future__ import annotations

import pytest

from infra.gcp import clients


@pytest.fixture
def no_gcloud(tmp_path, monkeypatch):
    """No emulator, no gcloud configuration, no metadata server to fall back on."""
    for name in (clients.TPU_EMULATOR_HOST, clients.STORAGE_EMULATOR_HOST):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")  # nothing listens: refused
    monkeypatch.setenv("GCE_METADATA_IP", "127.0.0.1:9")
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    return tmp_path


def test_no_adc_at_all_says_how_to_get_some(no_gcloud):
    with pytest.raises(clients.CredentialsError, match="gcloud auth application-default login"):
        clients.storage_client()


@pytest.mark.parametrize("content", [None, '{"type": "service_account"}'], ids=["gone", "bad"])
def test_a_bad_google_application_credentials_file_is_named(no_gcloud, monkeypatch, content):
    key = no_gcloud / "key.json"
    if content is not None:
        key.write_text(content)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))

    with pytest.raises(clients.CredentialsError) as err:
        clients.tpu_client()
    assert str(key) in str(err.value) and "GOOGLE_APPLICATION_CREDENTIALS" in str(err.value)


def test_a_gcp_run_without_credentials_is_refused_before_anything_runs(no_gcloud):
    # It sharded and uploaded its dataset first, then failed its first attempt with an
    # error naming no field (exit 1, not the invalid-config exit 2).
    from tasks.plan import plan_run
    from tasks.prepare import check_slice_access
    from tests.helpers import GCP_OVERRIDES, tiny_config
    from workloads.config_file import ConfigError

    config = tiny_config(no_gcloud, *GCP_OVERRIDES)
    with pytest.raises(ConfigError, match=r"slice.project=None.*gcloud auth application-default"):
        check_slice_access(config, plan_run(config))


def test_gs_sources_without_credentials_are_refused_naming_the_field(no_gcloud):
    # Listing the sources failed with a bare CredentialsError: exit 1, no field named.
    from tasks.access import check_backend_access
    from tasks.plan import plan_run
    from tests.helpers import tiny_config
    from workloads.config_file import ConfigError

    config = tiny_config(no_gcloud, "dataset.sources=[gs://corpus-bucket/text/]")
    with pytest.raises(
        ConfigError,
        match=r"dataset.sources 'gs://corpus-bucket/text/' is read with Application Default "
        r"Credentials: .*gcloud auth application-default login",
    ):
        check_backend_access(config, plan_run(config))


def test_tpupipe_shard_of_gs_sources_without_credentials_says_so_in_one_line(no_gcloud, capsys):
    from flows.cli import main

    out = str(no_gcloud / "ds")
    assert main(["shard", "--source", "gs://corpus-bucket/text/", "--out", out]) == 1
    err = capsys.readouterr().err
    assert "sharding failed: cannot read gs:// sources: " in err
    assert "gcloud auth application-default login" in err and "Traceback" not in err
    assert "credentials_block" not in err  # a config field, no option of this command
    # The same for a gs:// --out, before any source is read.
    local = no_gcloud / "corpus.txt"
    local.write_text("text\n")
    assert main(["shard", "--source", str(local), "--out", "gs://corpus-bucket/ds"]) == 1
    err = capsys.readouterr().err
    assert "sharding failed: no Application Default Credentials" in err
    assert "credentials_block" not in err and "Traceback" not in err
