"""A gs:// dataset that is damaged or incomplete in GCS, as a worker copying it meets it:
never trusted, refused naming the gs:// object at fault, and no temporary copy left."""

from __future__ import annotations

import json
import os

import pytest
from etils import epath

from infra.gcp import gcs
from tests.helpers import tiny_config
from workloads import data
from workloads.dataset_cache import local_dataset
from workloads.sources import DatasetError

pytestmark = pytest.mark.emulator


@pytest.fixture
def published(tmp_path, gcs_client, bucket) -> tuple[str, dict, bytes]:
    """(gs:// dataset URI, its manifest, the first train shard's bytes)."""
    config = tiny_config(tmp_path, "dataset.max_bytes=60000")
    local = data.shard_dataset(config.dataset, str(tmp_path / "datasets")).dataset_dir
    uri = f"gs://{bucket}/root/datasets/{epath.Path(local).name}"
    gcs.upload_tree(gcs_client, local, uri, last=[data.MANIFEST])
    manifest = data.load_manifest(local)
    first = manifest["splits"]["train"]["shards"][0]["name"]
    return uri, manifest, (epath.Path(local) / first).read_bytes()


def _blob(gcs_client, uri: str):
    bucket, name = gcs.split_uri(uri)
    return gcs_client.bucket(bucket).blob(name)


def test_a_shard_whose_bytes_differ_in_gcs_is_refused_naming_it(tmp_path, gcs_client, published):
    uri, manifest, good = published
    shard = f"{uri}/{manifest['splits']['train']['shards'][0]['name']}"
    _blob(gcs_client, shard).upload_from_string(b"not the shard the manifest describes")
    cache = tmp_path / "cache"

    with pytest.raises(DatasetError, match="sha256") as err:
        local_dataset(uri + "/", str(cache))  # a trailing slash names the same dataset
    assert shard in str(err.value)
    assert os.listdir(cache) == []  # nothing half-copied stays behind, or is trusted later

    _blob(gcs_client, shard).upload_from_string(good)  # repaired: the copy now succeeds
    copy = local_dataset(uri, str(cache))
    data.verify_shards(copy)
    assert json.loads((epath.Path(copy) / data.MANIFEST).read_text()) == manifest


@pytest.mark.parametrize("missing", ["shard", "manifest"])
def test_an_incomplete_dataset_in_gcs_is_refused_naming_what_is_missing(
    tmp_path, gcs_client, published, missing
):
    uri, manifest, _ = published
    eval_shard = manifest["splits"]["eval"]["shards"][0]["name"]
    name = eval_shard if missing == "shard" else data.MANIFEST
    _blob(gcs_client, f"{uri}/{name}").delete()
    cache = tmp_path / "cache"

    with pytest.raises(DatasetError) as err:
        local_dataset(uri, str(cache))
    assert f"{uri}/{name}" in str(err.value)
    assert not cache.exists() or os.listdir(cache) == []


def test_an_upload_interrupted_midway_is_never_read_and_a_rerun_completes_it(
    tmp_path, gcs_client, bucket
):
    from google.cloud.storage import Blob

    config = tiny_config(tmp_path, "dataset.max_bytes=60000")
    local = data.shard_dataset(config.dataset, str(tmp_path / "datasets")).dataset_dir
    uri = f"gs://{bucket}/root/datasets/{epath.Path(local).name}"
    real_upload, uploaded = Blob.upload_from_filename, []

    def dying_upload(self, filename, *args, **kwargs):
        if len(uploaded) == 2:
            raise ConnectionError("the orchestrator died mid-upload")
        uploaded.append(self.name)
        return real_upload(self, filename, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Blob, "upload_from_filename", dying_upload)
        with pytest.raises(ConnectionError):
            gcs.upload_tree(gcs_client, local, uri, last=[data.MANIFEST])
    assert not gcs.exists(gcs_client, f"{uri}/{data.MANIFEST}")  # shards, but no manifest
    with pytest.raises(DatasetError, match=r"has no .*manifest\.json"):
        local_dataset(uri, str(tmp_path / "cache"))

    gcs.upload_tree(gcs_client, local, uri, last=[data.MANIFEST])  # the publish, run again
    data.verify_shards(local_dataset(uri, str(tmp_path / "cache")))
