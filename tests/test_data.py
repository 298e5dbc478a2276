"""Sharding a corpus into ArrayRecord files: determinism, caching, atomicity and errors."""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordReader

from workloads import data
from workloads.config import EOD_TOKEN, DatasetConfig
from workloads.data import DatasetError


def make_corpus(root: Path, sizes: tuple[int, ...] = (700, 450, 900, 300, 650, 520)) -> Path:
    """A directory of small text files with distinct (so distinguishable) contents."""
    corpus = root / "corpus"
    (corpus / "sub").mkdir(parents=True)
    for i, size in enumerate(sizes):
        rng = random.Random(i)
        text = "".join(rng.choice("abcdefgh ijklmnop\n") for _ in range(size))
        where = corpus / "sub" if i % 2 else corpus
        (where / f"doc{i}.txt").write_text(text)
    return corpus


def cfg_for(corpus: Path, **kw) -> DatasetConfig:
    return DatasetConfig(sources=[str(corpus)], **{"seq_len": 16, "num_shards": 2, **kw})


def read_records(dataset_dir: str, names: list[str]) -> np.ndarray:
    rows = []
    for name in names:
        reader = ArrayRecordReader(os.path.join(dataset_dir, name))
        rows += [np.frombuffer(r, dtype="<u2") for r in reader.read_all()]
        reader.close()
    return np.stack(rows)


def shard_names(manifest: dict, split: str) -> list[str]:
    return [s["name"] for s in manifest["splits"][split]["shards"]]


def test_resolve_sources_expands_sorts_and_dedups(tmp_path):
    corpus = make_corpus(tmp_path)
    files = data.resolve_sources([str(corpus / "sub"), str(corpus), str(corpus / "**/*.txt")])
    paths = [f.path for f in files]
    assert paths == sorted(paths) and len(paths) == len(set(paths)) == 6
    first = corpus / "doc0.txt"
    assert data.SourceFile(str(first), 700, first.stat().st_mtime_ns) in files
    assert [f.path for f in data.resolve_sources([str(first)])] == [str(first)]


def test_missing_source_is_named(tmp_path):
    with pytest.raises(DatasetError, match=re.escape("nope/missing.txt")):
        data.resolve_sources([str(make_corpus(tmp_path)), str(tmp_path / "nope/missing.txt")])


def test_empty_directory_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="empty"):
        data.resolve_sources([str(tmp_path / "empty")])


def test_pack_records_stride_and_tail():
    records = data.pack_records(np.arange(11, dtype="<u2"), 3)
    assert records.tolist() == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    assert data.pack_records(np.arange(3, dtype="<u2"), 3).shape == (0, 4)


def test_shards_hold_each_splits_stream(tmp_path):
    corpus = make_corpus(tmp_path)
    cfg = cfg_for(corpus)
    calls = []
    result = data.shard_dataset(cfg, tmp_path / "out", progress=lambda d, t: calls.append((d, t)))
    m = result.manifest
    assert not result.cached and m == data.load_manifest(result.dataset_dir)
    assert m["record"] == {"dtype": "uint16", "length": 17}
    assert m["tokenizer"] == {"kind": "bytes", "vocab_size": 257, "eod_token": 256}
    assert sorted(os.listdir(result.dataset_dir)) == [
        "eval-00000-of-00001.arrayrecord",
        "manifest.json",
        "train-00000-of-00002.arrayrecord",
        "train-00001-of-00002.arrayrecord",
    ]
    files = data.resolve_sources(cfg.sources)
    train_docs, eval_docs = data.split_documents(files, cfg)
    assert train_docs and eval_docs
    for split, docs in (("train", train_docs), ("eval", eval_docs)):
        stream = []
        for f in docs:
            stream += [*Path(f.path).read_bytes(), EOD_TOKEN]
        s = m["splits"][split]
        assert s["tokens"] == len(stream) and s["bytes"] == len(stream) - len(docs)
        assert s["documents"] == len(docs)
        assert s["records"] == (len(stream) - 1) // 16 == sum(x["records"] for x in s["shards"])
        records = read_records(result.dataset_dir, shard_names(m, split))
        assert records.shape == (s["records"], 17)
        # Overlapping windows: the first record whole, then each record's last 16 tokens.
        rebuilt = np.concatenate([records[0], records[1:, 1:].ravel()])
        assert rebuilt.tolist() == stream[: len(rebuilt)]
        assert len(stream) - len(rebuilt) < 16
    assert calls[-1] == (m["splits"]["train"]["records"] + m["splits"]["eval"]["records"],) * 2
    data.verify_shards(result.dataset_dir)


def test_two_runs_are_byte_identical_and_rerun_is_cached(tmp_path):
    cfg = cfg_for(make_corpus(tmp_path))
    a = data.shard_dataset(cfg, tmp_path / "a")
    b = data.shard_dataset(cfg, tmp_path / "b")
    assert os.path.basename(a.dataset_dir) == os.path.basename(b.dataset_dir)
    for name in os.listdir(a.dataset_dir):
        assert Path(a.dataset_dir, name).read_bytes() == Path(b.dataset_dir, name).read_bytes()
    mtimes = {
        n: os.stat(os.path.join(a.dataset_dir, n)).st_mtime_ns for n in os.listdir(a.dataset_dir)
    }
    again = data.shard_dataset(cfg, tmp_path / "a", progress=lambda *_: pytest.fail("work done"))
    assert again.cached and again.manifest == a.manifest and again.dataset_dir == a.dataset_dir
    assert mtimes == {
        n: os.stat(os.path.join(a.dataset_dir, n)).st_mtime_ns for n in os.listdir(a.dataset_dir)
    }


def test_manifest_is_written_last(tmp_path, monkeypatch):
    cfg = cfg_for(make_corpus(tmp_path))

    def killed(*_):
        raise KeyboardInterrupt("killed before the manifest")

    monkeypatch.setattr(data, "_write_manifest", killed)
    with pytest.raises(KeyboardInterrupt):
        data.shard_dataset(cfg, tmp_path / "out")
    (dataset_dir,) = (tmp_path / "out").iterdir()
    assert not (dataset_dir / "manifest.json").exists()
    assert any(p.name.startswith("train-") for p in dataset_dir.iterdir())
    with pytest.raises(
        DatasetError, match=re.escape(f"incomplete dataset: no manifest.json in {dataset_dir}")
    ):
        data.load_manifest(dataset_dir)
    (dataset_dir / ".tmp-train-00000-of-00002.arrayrecord").write_bytes(b"half a shard")
    monkeypatch.undo()
    result = data.shard_dataset(cfg, tmp_path / "out")
    assert not result.cached and result.dataset_dir == str(dataset_dir)
    assert not [p for p in dataset_dir.iterdir() if p.name.startswith(".tmp-")]
    data.verify_shards(dataset_dir)


def test_malformed_manifest_and_corrupt_shard(tmp_path):
    result = data.shard_dataset(cfg_for(make_corpus(tmp_path)), tmp_path / "out")
    shard = Path(result.dataset_dir, "train-00001-of-00002.arrayrecord")
    shard.write_bytes(shard.read_bytes()[:-1] + b"x")
    with pytest.raises(DatasetError, match="train-00001-of-00002"):
        data.verify_shards(result.dataset_dir)
    Path(result.dataset_dir, "manifest.json").write_text("{not json")
    with pytest.raises(
        DatasetError, match=re.escape(f"malformed manifest.json in {result.dataset_dir}")
    ):
        data.load_manifest(result.dataset_dir)


def test_fingerprint_follows_files_and_options(tmp_path):
    corpus = make_corpus(tmp_path)
    cfg = cfg_for(corpus)
    fp = data.dataset_fingerprint(data.resolve_sources(cfg.sources), cfg)
    assert fp == data.dataset_fingerprint(data.resolve_sources(cfg.sources), cfg)
    for changed in (
        cfg_for(corpus, seq_len=32),
        cfg_for(corpus, eval_fraction=0.3),
        cfg_for(corpus, num_shards=3),
        cfg_for(corpus, max_bytes=1000),
    ):
        assert data.dataset_fingerprint(data.resolve_sources(cfg.sources), changed) != fp
    (corpus / "doc0.txt").write_text("edited")
    assert data.dataset_fingerprint(data.resolve_sources(cfg.sources), cfg) != fp


def test_max_bytes_takes_whole_documents(tmp_path):
    corpus = make_corpus(tmp_path, sizes=(400,) * 6)
    result = data.shard_dataset(cfg_for(corpus, max_bytes=900), tmp_path / "out")
    splits = result.manifest["splits"]
    # 400 + 400 < 900, so a third whole document is read, then the total has reached it.
    assert splits["train"]["documents"] + splits["eval"]["documents"] == 3
    assert splits["train"]["bytes"] + splits["eval"]["bytes"] == 1200
    assert len(result.manifest["sources"]) == 6


def test_too_few_records_names_the_numbers(tmp_path):
    cfg = cfg_for(make_corpus(tmp_path), num_shards=500)
    with pytest.raises(
        DatasetError,
        match=r"train split has \d+ record\(s\) of seq_len=16.*"
        r"num_shards=500",
    ):
        data.shard_dataset(cfg, tmp_path / "out")


def test_single_document_cannot_split(tmp_path):
    (tmp_path / "one.txt").write_text("x" * 500)
    cfg = DatasetConfig(sources=[str(tmp_path / "one.txt")], seq_len=16, eval_fraction=0.1)
    with pytest.raises(DatasetError, match=r"one\.txt.*eval_fraction=0\.1"):
        data.shard_dataset(cfg, tmp_path / "out")


def test_stdlib_source(tmp_path):
    files = data.resolve_sources(["stdlib"])
    assert len(files) > 500 and all(f.path.endswith(".py") for f in files)
    assert not any("site-packages" in f.path for f in files)
    cfg = DatasetConfig(sources=["stdlib"], seq_len=128, num_shards=2, max_bytes=1_000_000)
    m = data.shard_dataset(cfg, tmp_path / "out").manifest
    total = m["splits"]["train"]["bytes"] + m["splits"]["eval"]["bytes"]
    assert 1_000_000 <= total < 1_000_000 + max(f.size for f in files)
    assert m["splits"]["eval"]["records"] >= 1 and m["splits"]["train"]["records"] > 1000
