"""The source storage interface: the local backend, routing by scheme, sharding through it."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest

from infra.storage import GCSStorage, LocalStorage, ObjectInfo, source_storage
from tests.test_data import cfg_for, files_of, make_corpus
from workloads import data
from workloads.data import DatasetError


def test_local_storage_lists_with_sizes_and_generations(tmp_path):
    corpus = make_corpus(tmp_path)
    store = LocalStorage()
    listing = store.list(f"file://{corpus}")
    assert [o.uri for o in listing] == sorted(f"file://{p}" for p in corpus.rglob("*.txt"))
    doc0 = corpus / "doc0.txt"
    assert ObjectInfo(f"file://{doc0}", 700, doc0.stat().st_mtime_ns) in listing
    # A prefix that is not a directory matches by name, like an object-store prefix.
    assert [o.uri for o in store.list(f"file://{corpus}/sub/doc1")] == [
        f"file://{corpus}/sub/doc1.txt"
    ]
    assert store.list(f"file://{tmp_path}/nothing-here") == []


def test_local_storage_open_checks_the_generation(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("hello")
    store = LocalStorage()
    (info,) = store.list(f"file://{path}")
    with store.open(info.uri, info.generation) as fh:
        assert fh.read() == b"hello"
    os.utime(path, ns=(info.generation + 1, info.generation + 1))
    with pytest.raises(FileNotFoundError, match="no longer generation"):
        store.open(info.uri, info.generation)
    with pytest.raises(FileNotFoundError):
        store.open(f"file://{tmp_path}/missing.txt")


def test_scheme_routing_and_which_sources_need_a_store():
    assert source_storage(["corpus/", "stdlib", "data/*.txt"]) is None
    store = source_storage(["file:///data"])
    with pytest.raises(ValueError, match=r"no storage backend for s3:// \(known: file://\)"):
        store.list("s3://bucket/x")
    built = []
    gcs = source_storage(["gs://bucket/c4"], gcs_client=lambda: built.append(1) or FakeClient())
    assert built == [1] and isinstance(gcs.backends["gs"], GCSStorage)


class FakeClient:
    project = "proj"


def test_gcs_storage_does_not_pickle_its_client():
    # Worker processes get a copy that builds its own client on first use.
    copy = pickle.loads(pickle.dumps(GCSStorage(FakeClient())))
    assert copy._client is None and copy._project == "proj"


def test_sharding_file_uris_through_a_store_matches_local_paths(tmp_path):
    corpus = make_corpus(tmp_path)
    local = data.shard_dataset(cfg_for(corpus), tmp_path / "local")
    uri = f"file://{corpus}/"
    cfg = cfg_for(uri, workers=2)  # the store travels to worker processes by pickling
    with pytest.raises(DatasetError, match="needs a storage backend for file://"):
        data.shard_dataset(cfg, tmp_path / "remote")
    remote = data.shard_dataset(cfg, tmp_path / "remote", store=source_storage([uri]))
    assert remote.manifest["sources"][0]["uri"].startswith("file://")
    # Same keys (relative to the prefix), same documents: the same shards.
    assert {k: v for k, v in files_of(remote.dataset_dir).items() if k != "manifest.json"} == {
        k: v for k, v in files_of(local.dataset_dir).items() if k != "manifest.json"
    }
    with pytest.raises(DatasetError, match=r"source 'file://.*/nope/' matches no file"):
        data.resolve_sources([f"file://{tmp_path}/nope/"], source_storage([uri]))


def test_uri_sources_are_keyed_like_local_ones(tmp_path):
    corpus = make_corpus(tmp_path)
    store = source_storage(["file:///"])

    def keys(entry: str) -> list[str]:
        return [f.key for f in data.resolve_sources([entry], store)]

    local = keys(str(corpus))
    assert keys(f"file://{corpus}") == keys(f"file://{corpus}/") == local
    assert keys(f"file://{corpus}/sub/doc1.txt") == ["doc1.txt"]
    assert keys(f"file://{corpus}/s*/*.txt") == ["sub/doc1.txt", "sub/doc3.txt", "sub/doc5.txt"]
    # A prefix is a directory, not the start of a name: "corpus" does not take "corpus2/".
    shutil.copytree(corpus, tmp_path / "corpus2")
    assert keys(f"file://{corpus}") == local
