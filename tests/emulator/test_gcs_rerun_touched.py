"""A rerun under a gs:// storage root after its sources' versions changed (an object
uploaded again with the same bytes: a new generation), on the GCS emulator.

Under a gs:// root the run records the dataset it trained on as the published one
(`gs://.../datasets/<fingerprint>`). Its manifest was read as a local path, so every such
rerun was refused, saying that directory "holds no readable manifest.json (deleted with the
dataset cache?)", though it was there: a run could never be resumed or evaluated again once
any source was uploaded again or touched, and a removed object was not named.
"""

from __future__ import annotations

import json
import logging
import posixpath
import shutil
from pathlib import Path

import pytest

from infra.gcp import gcs
from tasks.plan import plan_run
from tests.helpers import tiny_config
from workloads.config_file import ConfigError

pytestmark = [pytest.mark.emulator, pytest.mark.integration]


def test_a_gs_rooted_run_goes_on_after_its_objects_are_uploaded_again(
    gcs_client, bucket, tmp_path, monkeypatch, prefect_harness
):
    from flows.pipeline import tpu_training_pipeline
    from infra.metrics import DuckDBSink

    monkeypatch.setenv("TPUPIPE_DATASET_CACHE", str(tmp_path / "dataset-cache"))
    monkeypatch.chdir(tmp_path)  # a gs:// root keeps its local slices and metrics in ./.tpupipe
    texts = {f"corpus/{i}.txt": f"document {i} " * 60 for i in range(6)}
    for name, text in texts.items():
        gcs_client.bucket(bucket).blob(name).upload_from_string(text)
    config = tiny_config(
        tmp_path,
        "run_name=regen",
        f"storage.root=gs://{bucket}/root",
        f"dataset.sources=[gs://{bucket}/corpus/]",
        "dataset.eval_fraction=0.3",
    )
    run_config = f"{plan_run(config).run_dir}/config.json"

    def trained_on() -> str:
        blob = run_config.removeprefix(f"gs://{bucket}/")
        return json.loads(gcs_client.bucket(bucket).blob(blob).download_as_text())["dataset_dir"]

    assert tpu_training_pipeline(config=config).status == "completed"
    first = trained_on()
    assert first.startswith(f"gs://{bucket}/root/datasets/")
    for name, text in texts.items():  # the same bytes again: every object a new generation
        gcs_client.bucket(bucket).blob(name).upload_from_string(text)
    assert tpu_training_pipeline(config=config).status == "completed"  # evaluated again
    assert trained_on() == first

    gcs_client.bucket(bucket).blob("corpus/4.txt").delete()
    with pytest.raises(ConfigError, match=rf"removed: gs://{bucket}/corpus/4\.txt"):
        tpu_training_pipeline(config=config)
    # The dataset it trained on gone from the bucket: that is what to restore.
    gcs_client.bucket(bucket).blob("corpus/4.txt").upload_from_string(texts["corpus/4.txt"])
    trained = first.removeprefix(f"gs://{bucket}/")
    gcs_client.bucket(bucket).blob(f"{trained}/manifest.json").delete()
    gone = r"no readable manifest\.json \(deleted from the bucket\?\).*Restore that dataset"
    with pytest.raises(ConfigError, match=gone):
        tpu_training_pipeline(config=config)
    row = DuckDBSink(tmp_path / ".tpupipe" / "metrics.duckdb").read_run("regen")
    assert (row.status, row.error) == ("completed", None)


def test_the_trained_dataset_is_checked_and_repaired_from_shards_built_under_a_new_name(
    gcs_client, bucket, tmp_path, caplog
):
    from tasks.remote import publish_dataset
    from tests.emulator.test_gcp_preflight import overwrite_in_place, published_tiny, repaired
    from workloads import data
    from workloads.data import DatasetError

    datasets = f"gs://{bucket}/root/datasets"
    config, local, remote = published_tiny(gcs_client, bucket, tmp_path, "cache")
    trained = posixpath.basename(remote)
    # The rerun's own build: the same shards under the fingerprint the sources give now.
    rebuilt = str(tmp_path / "cache" / "0123456789abcdef")
    shutil.copytree(local, rebuilt)
    name = data.load_manifest(local)["splits"]["train"]["shards"][0]["name"]
    blob = overwrite_in_place(gcs_client, bucket, local, name)

    with caplog.at_level(logging.WARNING, logger="tasks.remote"):
        assert publish_dataset(rebuilt, datasets, config, name=trained) == remote
    assert blob.download_as_bytes() == (Path(rebuilt) / name).read_bytes()
    assert repaired(caplog, name, "damaged: other bytes")
    assert not gcs.exists(gcs_client, f"{datasets}/0123456789abcdef/manifest.json")

    # Its manifest gone: never published anew from another build's manifest.
    gcs_client.bucket(bucket).blob(f"root/datasets/{trained}/manifest.json").delete()
    with pytest.raises(DatasetError, match=rf"{remote}, which the run trained on, has no"):
        publish_dataset(rebuilt, datasets, config, name=trained)
    assert not gcs.exists(gcs_client, f"{remote}/manifest.json")


def test_a_gs_root_under_the_prefix_its_sources_list_is_no_source(
    gcs_client, bucket, tmp_path, monkeypatch, prefect_harness
):
    # probe S: `storage.root: gs://b/tp` with `sources: [gs://b/]` sharded the run's own lock
    # object into its dataset, and every rerun was refused: its compile cache, run files
    # and lock were "added" sources (tests/test_root_in_corpus.py: the same, locally).
    from flows.pipeline import tpu_training_pipeline
    from workloads.manifest import load_manifest

    monkeypatch.setenv("TPUPIPE_DATASET_CACHE", str(tmp_path / "dataset-cache"))
    monkeypatch.chdir(tmp_path)
    for i in range(6):
        gcs_client.bucket(bucket).blob(f"corpus/{i}.txt").upload_from_string(f"doc {i} " * 90)
    config = tiny_config(
        tmp_path,
        "run_name=nested",
        f"storage.root=gs://{bucket}/tp",
        f"dataset.sources=[gs://{bucket}/]",
        "dataset.eval_fraction=0.3",
    )
    assert tpu_training_pipeline(config=config).status == "completed"
    blob = f"{plan_run(config).run_dir}/config.json".removeprefix(f"gs://{bucket}/")
    dataset = json.loads(gcs_client.bucket(bucket).blob(blob).download_as_text())["dataset_dir"]
    manifest = load_manifest(dataset)
    assert sorted(s["key"] for s in manifest["sources"]) == [f"corpus/{i}.txt" for i in range(6)]
    assert tpu_training_pipeline(config=config).status == "completed"  # resumed, not refused
