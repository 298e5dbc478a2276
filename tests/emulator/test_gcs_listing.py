"""`gs://` dataset sources on the GCS emulator select the same files, with the same keys, as
the same tree on local disk: globs match part by part, and dataset directories are skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.storage import source_storage
from workloads.data import DatasetError, resolve_sources

pytestmark = pytest.mark.emulator

TREE = [
    "top.jsonl",
    "sub/a.jsonl",
    "sub/deeper/b.jsonl",
    "old/c.jsonl",
    "sub/.hidden.jsonl",
    ".git/config",
]
DEEP = ["old/c.jsonl", "sub/a.jsonl", "sub/deeper/b.jsonl"]

# pattern (relative to the tree) -> keys (relative to the pattern's static prefix)
GLOBS = {
    "*.jsonl": ["top.jsonl"],
    "**/*.jsonl": [*DEEP, "top.jsonl"],
    "*/*.jsonl": ["old/c.jsonl", "sub/a.jsonl"],
    "*/": DEEP,  # the directories: every visible file below them
    "*": [*DEEP, "top.jsonl"],
    "**": [*DEEP, "top.jsonl"],
    "sub/**/*.jsonl": ["a.jsonl", "deeper/b.jsonl"],
    "*/deeper/*": ["sub/deeper/b.jsonl"],
    "t?p.jsonl": ["top.jsonl"],
    "sub/?.jsonl": ["a.jsonl"],
    "[os]*/*.jsonl": ["old/c.jsonl", "sub/a.jsonl"],
    "[!s]*/*.jsonl": ["old/c.jsonl"],
    "sub/.*": [".hidden.jsonl"],  # a pattern that asks for a dot-name gets it
    "**/.hidden.jsonl": ["sub/.hidden.jsonl"],
    "": [*DEEP, "top.jsonl"],  # the prefix itself: a directory walk
}


def put_tree(tmp_path: Path, gcs_client, bucket: str, files: dict[str, bytes]) -> Path:
    """`files` under a local directory and under gs://bucket/t/."""
    local = tmp_path / "t"
    for rel, data in files.items():
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        (local / rel).write_bytes(data)
        gcs_client.bucket(bucket).blob(f"t/{rel}").upload_from_string(data)
    return local


def keys(entry: str, store=None) -> list[str]:
    return sorted(f.key for f in resolve_sources([entry], store))


def test_a_glob_selects_the_same_files_on_gcs_as_locally(tmp_path, gcs_client, bucket):
    local = put_tree(tmp_path, gcs_client, bucket, {rel: b'{"text": "x"}\n' for rel in TREE})
    uri = f"gs://{bucket}/t/"
    store = source_storage([uri])
    for pattern, want in GLOBS.items():
        assert keys(f"{local}/{pattern}") == want, f"local {pattern!r}"
        assert keys(uri + pattern, store) == want, f"gs:// {pattern!r}"


def test_a_gcs_prefix_skips_dataset_directories_as_a_local_walk_does(tmp_path, gcs_client, bucket):
    manifest = json.dumps({"format_version": 6, "fingerprint": "0123456789abcdef"}).encode()
    shard = b"\xff\xfe\x00binary"
    files = {
        "corpus.txt": b"hello corpus\n",
        "root/runs/r1/config.json": b"{}",
        # A published dataset, and a killed run's directory (`.lock` next to `.work/`).
        "root/datasets/0123456789abcdef/manifest.json": manifest,
        "root/datasets/0123456789abcdef/train-00000-of-00001.arrayrecord": shard,
        "root/datasets/0123456789abcdef/eval-00000-of-00001.arrayrecord": shard,
        "old/fedcba9876543210/.lock": b"",
        "old/fedcba9876543210/.work/part": shard,
        "old/fedcba9876543210/train-00000-of-00001.arrayrecord": shard,
        # A file merely called manifest.json, with no shards beside it, is corpus.
        "app/manifest.json": b'{"name": "app"}',
    }
    local = put_tree(tmp_path, gcs_client, bucket, files)
    below = ["app/manifest.json", "root/runs/r1/config.json"]
    uri = f"gs://{bucket}/t/"
    store = source_storage([uri])
    everything = ["app/manifest.json", "corpus.txt", "root/runs/r1/config.json"]
    for pattern, want in (("", everything), ("**", everything), ("*/", below)):
        assert keys(f"{local}/{pattern}") == want, f"local {pattern!r}"
        assert keys(uri + pattern, store) == want, f"gs:// {pattern!r}"
    # A glob into a dataset directory finds nothing there either.
    for pattern in ("root/datasets/*/*.arrayrecord", "*/*/*.arrayrecord"):
        for entry, store_ in ((f"{local}/{pattern}", None), (uri + pattern, store)):
            with pytest.raises(DatasetError, match="matches no file"):
                keys(entry, store_)
    # Named as the source itself, a dataset directory is refused as locally.
    for entry, store_ in (
        (f"{local}/root/datasets/0123456789abcdef", None),
        (f"{uri}root/datasets/0123456789abcdef/", store),
    ):
        with pytest.raises(DatasetError, match="is a tpupipe dataset directory"):
            keys(entry, store_)


def test_a_name_with_glob_characters_is_taken_literally_when_it_exists(
    tmp_path, gcs_client, bucket
):
    files = {"a[1].jsonl": b'{"text": "x"}\n', "b.jsonl": b"{}\n", "d[2]/c.jsonl": b"{}\n"}
    local = put_tree(tmp_path, gcs_client, bucket, files)
    roots = {
        "local": (f"{local}/", None),
        "file://": (f"file://{local}/", source_storage([f"file://{local}/"])),
        "gs://": (f"gs://{bucket}/t/", source_storage([f"gs://{bucket}/t/"])),
    }
    for where, (root, store) in roots.items():
        # The object of that name, not the pattern (which matches "a1.jsonl" only).
        assert keys(root + "a[1].jsonl", store) == ["a[1].jsonl"], where
        assert keys(root + "d[2]", store) == ["c.jsonl"], where  # a directory of that name
        assert keys(root + "[ab]*.jsonl", store) == ["a[1].jsonl", "b.jsonl"], where


def test_folder_placeholders_are_no_documents_whatever_the_entry_names(
    tmp_path, gcs_client, bucket
):
    # The Cloud Console's "Create folder" leaves a zero-byte object "t/" (and "t/sub/"):
    # named by the entry itself, it was read as one more, empty, document (key "").
    local = put_tree(tmp_path, gcs_client, bucket, {"a.txt": b"a\n", "sub/b.txt": b"b\n"})
    for name in ("t/", "t/sub/"):
        gcs_client.bucket(bucket).blob(name).upload_from_string(b"")
    uri = f"gs://{bucket}/t/"
    store = source_storage([uri])
    assert keys(uri, store) == keys(str(local)) == ["a.txt", "sub/b.txt"]
    assert keys(f"{uri}sub/", store) == ["b.txt"]
    # A "folder" holding nothing but its placeholder matches no file, as an empty one does.
    gcs_client.bucket(bucket).blob("empty/").upload_from_string(b"")
    with pytest.raises(DatasetError, match="matches no file"):
        keys(f"gs://{bucket}/empty/", store)
