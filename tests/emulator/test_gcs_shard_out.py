"""`tpupipe shard --out gs://bucket/prefix` on the GCS emulator: the dataset is sharded in
the local cache, as a run does, and published to the bucket, manifest last."""

from __future__ import annotations

import json

import pytest

from flows.cli import main as cli_main
from workloads import data

pytestmark = pytest.mark.emulator


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a stray relative "gs:" directory would land here
    monkeypatch.setenv("TPUPIPE_DATASET_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "corpus"
    source.mkdir()
    for i in range(3):
        (source / f"{i}.txt").write_text(f"document {i} " * 400)
    return source


def shard(corpus, out: str) -> list[str]:
    return ["shard", "--source", str(corpus), "--out", out, "--num-shards", "1", "--seq-len", "32"]


def test_a_gs_out_publishes_the_dataset_to_the_bucket(corpus, gcs_client, bucket, capsys):
    # It wrote a local directory literally named "gs:" and exited 0, the bucket untouched.
    out = f"gs://{bucket}/datasets"
    assert cli_main(shard(corpus, out)) == 0
    printed = capsys.readouterr().out.strip()
    assert printed.startswith(f"{out}/")
    local = corpus.parent / "cache" / printed.rsplit("/", 1)[1]
    names = sorted(b.name for b in gcs_client.list_blobs(bucket, prefix="datasets/"))
    prefix = f"datasets/{local.name}/"
    visible = (p.name for p in local.iterdir() if p.is_file() and not p.name.startswith("."))
    assert names == sorted(prefix + name for name in visible)
    manifest = gcs_client.bucket(bucket).blob(prefix + data.MANIFEST).download_as_bytes()
    assert json.loads(manifest) == data.load_manifest(local)
    assert not (corpus.parent / "gs:").exists()
    # Run again: found, nothing sharded or uploaded anew.
    assert cli_main(shard(corpus, out)) == 0
    again = capsys.readouterr()
    assert again.out.strip() == printed and "found (cached)" in again.err


def test_a_gs_out_without_its_bucket_fails_before_sharding(corpus, gcs_emulator, capsys):
    assert cli_main(shard(corpus, "gs://no-such-bucket-here/datasets")) == 1
    err = capsys.readouterr().err
    assert "bucket gs://no-such-bucket-here does not exist" in err and "Traceback" not in err
    assert not (corpus.parent / "cache").exists()


def test_an_out_of_another_scheme_is_an_invalid_option(corpus, capsys):
    assert cli_main(shard(corpus, "s3://bucket/datasets")) == 2
    assert "--out 's3://bucket/datasets': s3:// is not supported; give a local directory or " in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("out", "says"),
    [
        ("gs:/bucket/datasets", "not a gs://bucket/prefix URI"),
        ("gs://", "names no bucket"),
        ("gs:///datasets", "names no bucket"),
        ("gs://Bad_Bucket!/x", "'Bad_Bucket!' is not a bucket name"),
        ("gs://bucket//x", "an empty, '.' or '..' part"),
        ("gs://bucket/a/../x", "an empty, '.' or '..' part"),
    ],
)
def test_a_malformed_gs_out_is_an_invalid_option(corpus, capsys, out, says):
    # Tracebacks (exit 1), objects named "/x" or "a/../x", or, for "gs:/", the local
    # directory ./gs:/bucket/datasets and exit 0.
    code = cli_main(shard(corpus, out))
    err = capsys.readouterr().err
    assert code == 2 and says in err and "Traceback" not in err, err
    assert not (corpus.parent / "gs:").exists() and not (corpus.parent / "cache").exists()


def test_only_the_datasets_own_files_are_published(corpus, gcs_client, bucket, capsys):
    # The local lock and sharding statistics beside the shards were uploaded with them.
    assert cli_main(shard(corpus, f"gs://{bucket}/ds")) == 0
    published = capsys.readouterr().out.strip().removeprefix(f"gs://{bucket}/")
    manifest = data.load_manifest(corpus.parent / "cache" / published.rsplit("/", 1)[1])
    shards = [s["name"] for split in ("train", "eval") for s in manifest["splits"][split]["shards"]]
    names = sorted(b.name.removeprefix(f"{published}/") for b in gcs_client.list_blobs(bucket))
    assert names == sorted([*shards, data.MANIFEST])
