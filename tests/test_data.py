"""Sharding a corpus into ArrayRecord files: layout, determinism, caching, atomicity, errors."""

from __future__ import annotations

import json
import os
import platform
import random
import re
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import read_sequences
from workloads import data, packing, shard_stats
from workloads.config import EOD_TOKEN, DatasetConfig
from workloads.data import DatasetError
from workloads.shard_pool import worker_pool


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


def cfg_for(corpus: Path | str, **kw) -> DatasetConfig:
    return DatasetConfig(sources=[str(corpus)], **{"seq_len": 16, "num_shards": 2, **kw})


def read_records(dataset_dir: str, manifest: dict, split: str) -> np.ndarray:
    """A split's records as token ids: the stored EOD (`record.eod`) read as `eod_token`."""
    record = manifest["record"]
    shards = manifest["splits"][split]["shards"]
    raw = np.concatenate(
        [read_sequences(os.path.join(dataset_dir, shard["name"]), manifest) for shard in shards]
    )
    ids = raw.astype(np.int64)
    ids[raw == record.get("eod", manifest["tokenizer"]["eod_token"])] = manifest["tokenizer"][
        "eod_token"
    ]
    return ids


def files_of(directory: str) -> dict[str, bytes]:
    """Every visible file's bytes (the `.lock` file is not part of a dataset)."""
    return {p.name: p.read_bytes() for p in Path(directory).iterdir() if not p.name.startswith(".")}


def test_resolve_sources_orders_by_entry_then_key_and_dedups(tmp_path):
    corpus = make_corpus(tmp_path)
    files = data.resolve_sources([str(corpus / "sub"), str(corpus), str(corpus / "**/*.txt")])
    # The sub-directory entry comes first, keyed relative to itself; the files it named
    # are not repeated for the later entries.
    assert [f.key for f in files] == [
        "doc1.txt",
        "doc3.txt",
        "doc5.txt",
        "doc0.txt",
        "doc2.txt",
        "doc4.txt",
    ]
    first = corpus / "doc0.txt"
    assert data.SourceFile(str(first), "doc0.txt", 700, first.stat().st_mtime_ns) in files
    (only,) = data.resolve_sources([str(corpus / "sub" / "doc1.txt")])
    assert only.key == "doc1.txt" and only.uri == str(corpus / "sub" / "doc1.txt")
    globbed = data.resolve_sources([str(corpus / "s*" / "*.txt")])
    assert [f.key for f in globbed] == ["sub/doc1.txt", "sub/doc3.txt", "sub/doc5.txt"]


def test_a_file_behind_a_symlink_is_read_once_from_a_file_uri_as_from_a_path(tmp_path):
    from infra.storage import source_storage

    corpus = tmp_path / "c"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text")
    (corpus / "link.txt").symlink_to(corpus / "a.txt")
    uri = f"file://{corpus}"
    for entry, store in ((str(corpus), None), (uri, source_storage([uri]))):
        assert [f.key for f in data.resolve_sources([entry], store)] == ["a.txt"], entry


def test_missing_unreadable_and_empty_sources_are_named(tmp_path):
    corpus = make_corpus(tmp_path)
    with pytest.raises(DatasetError, match=re.escape("'" + str(tmp_path / "nope/x.txt") + "'")):
        data.resolve_sources([str(corpus), str(tmp_path / "nope/x.txt")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=r"source '.*empty' matches no file"):
        data.resolve_sources([str(tmp_path / "empty")])
    (tmp_path / "dangling.txt").symlink_to(tmp_path / "gone.txt")
    with pytest.raises(DatasetError, match=r"dangling\.txt is not readable"):
        data.resolve_sources([str(tmp_path / "dangling.txt")])
    with pytest.raises(DatasetError, match=r"gs://bucket/c4.*needs a storage backend"):
        data.resolve_sources(["gs://bucket/c4"])


def test_a_glob_ending_in_a_slash_matches_directories_only(tmp_path):
    corpus = make_corpus(tmp_path)
    (corpus / "README").write_text("not corpus")
    # As in the shell: `*/` names the directories (whose files are taken), not the files.
    for entry in (f"{corpus}/*/", f"{corpus}/s*/"):
        keys = [f.key for f in data.resolve_sources([entry])]
        assert keys == ["sub/doc1.txt", "sub/doc3.txt", "sub/doc5.txt"], entry
    for entry in (f"{corpus}/*.txt/", f"{corpus}/s*/doc1.txt/"):
        with pytest.raises(DatasetError, match=r"\.txt/' matches no file"):
            data.resolve_sources([entry])


def test_a_blank_source_entry_is_refused_not_read_as_the_current_directory(tmp_path, monkeypatch):
    make_corpus(tmp_path)
    monkeypatch.chdir(tmp_path / "corpus")  # what an empty entry would have sharded
    for entry in ("", "  "):
        with pytest.raises(DatasetError, match=f"dataset source {entry!r} is empty"):
            data.resolve_sources([entry])
        with pytest.raises(ValueError, match=f"source 2 is {entry!r}, which names nothing"):
            DatasetConfig(sources=["stdlib", entry])


def test_a_file_that_vanishes_or_changes_after_listing_is_named(tmp_path, monkeypatch):
    corpus = make_corpus(tmp_path)
    real_resolve = data.resolve_sources

    def resolve_then(edit):
        def resolve(*args, **kw):
            files = real_resolve(*args, **kw)
            edit()
            return files

        return resolve

    monkeypatch.setattr(
        data, "resolve_sources", resolve_then(lambda: (corpus / "doc0.txt").write_text("edit"))
    )
    with pytest.raises(DatasetError, match=r"doc0\.txt changed since it was listed"):
        data.shard_dataset(cfg_for(corpus), tmp_path / "out")
    monkeypatch.setattr(data, "resolve_sources", resolve_then((corpus / "doc2.txt").unlink))
    with pytest.raises(DatasetError, match=r"cannot read dataset source .*doc2\.txt"):
        data.shard_dataset(cfg_for(corpus), tmp_path / "out")


def test_pack_records_stride_and_tail():
    records = packing.pack_records(np.arange(11, dtype="<u2"), 3)
    assert records.tolist() == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    assert packing.pack_records(np.arange(3, dtype="<u2"), 3).shape == (0, 4)


def expected_streams(files: list[data.SourceFile], cfg: DatasetConfig) -> dict[str, list[int]]:
    """Each split's token stream rebuilt from the files: bytes then EOD, split by key hash."""
    streams: dict[str, list[int]] = {"train": [], "eval": []}
    for f in files:
        split = "eval" if packing.in_eval(f.key, cfg.eval_fraction) else "train"
        streams[split] += [*Path(f.uri).read_bytes(), EOD_TOKEN]
    return streams


def test_shards_hold_each_splits_stream(tmp_path):
    cfg = cfg_for(make_corpus(tmp_path), eval_fraction=0.3)
    calls = []
    result = data.shard_dataset(cfg, tmp_path / "out", progress=lambda *a: calls.append(a))
    m = result.manifest
    assert not result.cached and m == data.load_manifest(result.dataset_dir)
    # Byte tokens take one byte each; EOD (256) is stored as 0xFF, never a byte of UTF-8.
    assert m["record"] == {
        "dtype": "uint8",
        "length": 17,
        "byte_order": "little",
        "eod": 255,
        "sequences": 64,
    }
    assert m["tokenizer"] == {"kind": "bytes", "vocab_size": 257, "eod_token": 256}
    assert sorted(files_of(result.dataset_dir)) == [
        "eval-00000-of-00001.arrayrecord",
        "manifest.json",
        "train-00000-of-00002.arrayrecord",
        "train-00001-of-00002.arrayrecord",
    ]
    streams = expected_streams(data.resolve_sources(cfg.sources), cfg)
    assert streams["train"] and streams["eval"]  # eval_fraction=0.3 of 6 keys holds some out
    for split, stream in streams.items():
        s = m["splits"][split]
        docs = stream.count(EOD_TOKEN)
        assert (s["tokens"], s["bytes"], s["documents"]) == (len(stream), len(stream) - docs, docs)
        assert s["records"] == (len(stream) - 1) // 16 == sum(x["records"] for x in s["shards"])
        assert s["packing"] == {
            "slots": s["records"] * 16,
            "real_tokens": s["records"] * 16,
            "efficiency": 1.0,
            "dropped_tokens": len(stream) - 1 - s["records"] * 16,
        }
        records = read_records(result.dataset_dir, m, split)
        # Overlapping windows: the first record whole, then each record's last 16 tokens.
        rebuilt = np.concatenate([records[0], records[1:, 1:].ravel()])
        assert rebuilt.tolist() == stream[: len(rebuilt)]
        assert len(stream) - len(rebuilt) < 16
    total_bytes = sum(f.size for f in data.resolve_sources(cfg.sources))
    assert calls[0] == ("tokenize", 0, total_bytes)
    assert ("tokenize", total_bytes, total_bytes) in calls
    total_records = m["splits"]["train"]["records"] + m["splits"]["eval"]["records"]
    assert calls[-1] == ("write", total_records, total_records)
    data.verify_shards(result.dataset_dir)


def test_runs_are_byte_identical_across_workers_and_places_and_rerun_is_cached(
    tmp_path, monkeypatch
):
    corpus = make_corpus(tmp_path)
    # In this process, shards are built a few records at a time (many block boundaries);
    # the second run's worker process uses the default blocks. Neither may change a byte.
    monkeypatch.setattr(packing, "RECORD_BLOCK_BYTES", 100)
    a = data.shard_dataset(cfg_for(corpus, workers=1), tmp_path / "a", unit_bytes=1000)
    b = data.shard_dataset(cfg_for(corpus, workers=2), tmp_path / "b", unit_bytes=1500)
    assert os.path.basename(a.dataset_dir) == os.path.basename(b.dataset_dir)
    assert files_of(a.dataset_dir) == files_of(b.dataset_dir)

    # The same corpus elsewhere: another fingerprint (paths and mtimes differ), same shards,
    # because the split hashes keys relative to the source root.
    moved = shutil.copytree(corpus, tmp_path / "elsewhere" / "corpus")
    c = data.shard_dataset(cfg_for(moved), tmp_path / "c")
    assert os.path.basename(c.dataset_dir) != os.path.basename(a.dataset_dir)
    assert c.manifest["splits"] == a.manifest["splits"]

    before = {p: os.stat(p).st_mtime_ns for p in Path(a.dataset_dir).iterdir()}
    again = data.shard_dataset(
        cfg_for(corpus), tmp_path / "a", progress=lambda *_: pytest.fail("work was done")
    )
    assert again.cached and again.manifest == a.manifest and again.dataset_dir == a.dataset_dir
    assert before == {p: os.stat(p).st_mtime_ns for p in Path(a.dataset_dir).iterdir()}


def test_fingerprint_covers_sources_and_byte_changing_options_only(tmp_path):
    corpus = make_corpus(tmp_path)
    files = data.resolve_sources([str(corpus)])

    def fp(cfg: DatasetConfig) -> str:
        return data.dataset_fingerprint(files, cfg, data.load_tokenizer(None))

    base = fp(cfg_for(corpus))
    for changed in (
        dict(seq_len=32),
        dict(eval_fraction=0.3),
        dict(num_shards=3),
        dict(max_bytes=1000),
        dict(errors="replace"),
        dict(text_unit="line"),
        dict(format="jsonl"),
    ):
        assert fp(cfg_for(corpus, **changed)) != base, changed
    # Neither the worker count nor a field the format ignores changes the bytes.
    assert fp(cfg_for(corpus, workers=7)) == base
    assert fp(cfg_for(corpus, text_field="body")) == base
    jsonl = cfg_for(corpus, format="jsonl")
    assert fp(jsonl.model_copy(update={"text_field": "body"})) != fp(jsonl)
    (corpus / "doc0.txt").write_text("edited")
    edited = data.resolve_sources([str(corpus)])
    assert data.dataset_fingerprint(edited, cfg_for(corpus), data.load_tokenizer(None)) != base


def test_interrupted_run_leaves_no_manifest_and_the_next_run_completes(tmp_path, monkeypatch):
    cfg = cfg_for(make_corpus(tmp_path))

    def killed(*_):
        raise KeyboardInterrupt("killed before the manifest")

    monkeypatch.setattr(data, "write_manifest", killed)
    with pytest.raises(KeyboardInterrupt):
        data.shard_dataset(cfg, tmp_path / "out")
    (dataset_dir,) = (tmp_path / "out").iterdir()
    assert not (dataset_dir / "manifest.json").exists()
    assert any(p.name.startswith("train-") for p in dataset_dir.iterdir())
    with pytest.raises(
        DatasetError, match=re.escape(f"incomplete dataset: no manifest.json in {dataset_dir}")
    ):
        data.load_manifest(dataset_dir)
    # A directory that is gone is not called incomplete (evaluation alone, probe Y).
    with pytest.raises(DatasetError, match=r"^no dataset at .*/gone: the directory is gone$"):
        data.load_manifest(tmp_path / "gone")
    (dataset_dir / ".tmp-train-00000-of-00002.arrayrecord").write_bytes(b"half a shard")
    monkeypatch.undo()
    result = data.shard_dataset(cfg, tmp_path / "out")
    assert not result.cached and result.dataset_dir == str(dataset_dir)
    hidden = sorted(p.name for p in dataset_dir.iterdir() if p.name.startswith("."))
    assert hidden == [".lock", shard_stats.SHARD_STATS]  # no leftover, no .work
    clean = data.shard_dataset(cfg, tmp_path / "clean")
    assert files_of(result.dataset_dir) == files_of(clean.dataset_dir)


def test_corrupt_manifest_or_shard_is_detected_and_rebuilt(tmp_path):
    cfg = cfg_for(make_corpus(tmp_path))
    result = data.shard_dataset(cfg, tmp_path / "out")
    good = files_of(result.dataset_dir)
    shard = Path(result.dataset_dir, "train-00001-of-00002.arrayrecord")
    shard.write_bytes(shard.read_bytes()[:-1] + b"x")
    with pytest.raises(DatasetError, match="train-00001-of-00002"):
        data.verify_shards(result.dataset_dir)
    shard.write_bytes(shard.read_bytes()[:100])  # truncated: the cache check sees the size
    assert not data.shard_dataset(cfg, tmp_path / "out").cached
    assert files_of(result.dataset_dir) == good
    Path(result.dataset_dir, "manifest.json").write_text("{not json")
    with pytest.raises(
        DatasetError, match=re.escape(f"malformed manifest.json in {result.dataset_dir}")
    ):
        data.load_manifest(result.dataset_dir)
    assert not data.shard_dataset(cfg, tmp_path / "out").cached
    assert files_of(result.dataset_dir) == good


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda m: m["splits"]["train"]["shards"][0].update(records=3), id="count"),
        pytest.param(lambda m: m.update(seq_len=8) or m["record"].update(length=9), id="seq_len"),
    ],
)
def test_a_manifest_edited_by_hand_is_not_read_and_a_cache_hit_builds_it_again(
    tmp_path, caplog, edit
):
    """An edited manifest still parsed and its shards still matched their sha256: a run
    trained on 8-token slices of 16-token sequences and landed `completed`, or failed on
    its slice at the record its edited count overran."""
    cfg = cfg_for(make_corpus(tmp_path))
    result = data.shard_dataset(cfg, tmp_path / "out")
    good = files_of(result.dataset_dir)
    path = Path(result.dataset_dir, "manifest.json")
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match=rf"{path} was changed after it was written"):
        data.load_manifest(result.dataset_dir)

    with caplog.at_level("WARNING", logger="workloads.data"):
        assert not data.shard_dataset(cfg, tmp_path / "out").cached
    assert caplog.text.count("changed after it was written") == 1  # said once
    assert files_of(result.dataset_dir) == good
    assert data.shard_dataset(cfg, tmp_path / "out").cached


def test_a_manifest_without_its_digest_is_checked_against_its_shards(tmp_path, caplog):
    """With `manifest_sha256` deleted (or a manifest from before it), a count edited by
    one sequence passed every check, and a run trained over other data and completed."""
    from workloads import input

    cfg = cfg_for(make_corpus(tmp_path))
    result = data.shard_dataset(cfg, tmp_path / "out")
    good = files_of(result.dataset_dir)
    path = Path(result.dataset_dir, "manifest.json")
    unsealed = {k: v for k, v in json.loads(path.read_text()).items() if k != "manifest_sha256"}
    path.write_text(json.dumps(unsealed))  # as an older version wrote it: still a cache hit
    assert data.shard_dataset(cfg, tmp_path / "out").cached
    unsealed["splits"]["train"]["shards"][0]["records"] -= 1
    unsealed["splits"]["train"]["records"] -= 1
    path.write_text(json.dumps(unsealed))
    shard = Path(result.dataset_dir, unsealed["splits"]["train"]["shards"][0]["name"])
    with pytest.raises(DatasetError, match=rf"{shard}'s last record holds \d+ bytes, not the"):
        input.train_iterator(result.dataset_dir, 4, 0)

    with caplog.at_level("WARNING", logger="workloads.data"):
        assert not data.shard_dataset(cfg, tmp_path / "out").cached
    assert caplog.text.count(f"{shard}'s last record holds") == 1
    assert files_of(result.dataset_dir) == good


def test_a_deleted_shard_is_named_as_the_dataset_is_built_again(tmp_path, caplog):
    cfg = cfg_for(make_corpus(tmp_path))
    result = data.shard_dataset(cfg, tmp_path / "out")
    shard = Path(result.dataset_dir, "eval-00000-of-00001.arrayrecord")
    shard.unlink()
    with caplog.at_level("WARNING", logger="workloads.data"):
        assert not data.shard_dataset(cfg, tmp_path / "out").cached
    assert caplog.text.count(f"dataset shard {shard} is missing") == 1
    assert shard.is_file()


def test_a_shard_replaced_by_another_builds_is_caught_by_the_cache_check_and_rebuilt(
    tmp_path, caplog
):
    """A same-named shard of another build passed the cache check (ArrayRecord pads files
    to 64 KiB, so the sizes match) and, holding as many records, was trained on silently."""
    cfg = cfg_for(make_corpus(tmp_path / "a"))
    result = data.shard_dataset(cfg, tmp_path / "out")
    good = files_of(result.dataset_dir)
    corpus_b = make_corpus(tmp_path / "b")
    (corpus_b / "doc0.txt").write_text((corpus_b / "doc0.txt").read_text()[::-1])
    other = data.shard_dataset(cfg_for(corpus_b), tmp_path / "out")
    name = "train-00000-of-00002.arrayrecord"
    shard, foreign = Path(result.dataset_dir, name), Path(other.dataset_dir, name).read_bytes()
    assert foreign != good[name] and len(foreign) == len(good[name])
    # Copied over it as `cp -p` would: same size, and the mtime kept.
    mtime = os.stat(shard).st_mtime_ns
    shard.write_bytes(foreign)
    os.utime(shard, ns=(mtime, mtime))

    with caplog.at_level("WARNING", logger="workloads.data"):
        assert not data.shard_dataset(cfg, tmp_path / "out").cached
    assert caplog.text.count(f"{shard} no longer matches its manifest's sha256") == 1
    assert files_of(result.dataset_dir) == good
    assert data.shard_dataset(cfg, tmp_path / "out").cached


def test_a_cache_hit_hashes_only_shards_whose_file_changed(tmp_path, monkeypatch):
    cfg = cfg_for(make_corpus(tmp_path))
    result = data.shard_dataset(cfg, tmp_path / "out")
    hashed = []
    real = shard_stats.file_sha256
    monkeypatch.setattr(shard_stats, "file_sha256", lambda p: hashed.append(p) or real(p))
    assert data.shard_dataset(cfg, tmp_path / "out").cached and hashed == []
    shard = Path(result.dataset_dir, "eval-00000-of-00001.arrayrecord")
    shard.chmod(0o644)  # a new ctime, the same bytes: hashed once, then trusted again
    assert data.shard_dataset(cfg, tmp_path / "out").cached and hashed == [shard]
    assert data.shard_dataset(cfg, tmp_path / "out").cached and hashed == [shard]
    # A dataset built before the signatures were recorded: each shard hashed once, then watched.
    Path(result.dataset_dir, shard_stats.SHARD_STATS).unlink()
    hashed.clear()
    assert data.shard_dataset(cfg, tmp_path / "out").cached and len(hashed) == 3
    assert Path(result.dataset_dir, shard_stats.SHARD_STATS).is_file()
    assert data.shard_dataset(cfg, tmp_path / "out").cached and len(hashed) == 3


def test_a_shard_damaged_while_its_stats_record_was_missing_is_rebuilt_not_blessed(tmp_path):
    """A dataset copied without its dot-files (`cp dir/*`) lost its record: recording the
    shards' signatures as they were blessed a damaged one, and the slice failed on it."""
    cfg = cfg_for(make_corpus(tmp_path))
    result = data.shard_dataset(cfg, tmp_path / "out")
    good = files_of(result.dataset_dir)
    shard = Path(result.dataset_dir, "train-00000-of-00002.arrayrecord")
    mtime = os.stat(shard).st_mtime_ns
    damaged = bytearray(shard.read_bytes())
    damaged[100] ^= 0xFF
    shard.write_bytes(bytes(damaged))
    os.utime(shard, ns=(mtime, mtime))
    Path(result.dataset_dir, shard_stats.SHARD_STATS).unlink()

    assert not data.shard_dataset(cfg, tmp_path / "out").cached
    assert files_of(result.dataset_dir) == good


def test_the_manifest_lists_a_source_per_line_and_reads_back_whatever_its_names(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    names = ["plain.txt", 'quote " and }, {.txt', "new\nline.txt", "ünï.txt"]
    for i, name in enumerate(names):
        (corpus / name).write_text(f"document {i} " * 200)
    result = data.shard_dataset(cfg_for(corpus, num_shards=1), tmp_path / "out")
    text = Path(result.dataset_dir, "manifest.json").read_text()
    assert data.load_manifest(result.dataset_dir) == result.manifest
    lines = text.splitlines()
    assert lines[0] == "{" and lines[-1] == "}"
    first = lines.index(' "sources": [')
    sources = lines[first + 1 : first + 1 + len(names)]
    assert sorted(json.loads(line.rstrip(","))["key"] for line in sources) == sorted(names)


def test_max_bytes_takes_whole_files(tmp_path):
    corpus = make_corpus(tmp_path, sizes=(400,) * 6)
    result = data.shard_dataset(cfg_for(corpus, max_bytes=900), tmp_path / "out")
    splits = result.manifest["splits"]
    # 400 + 400 < 900, so a third whole file is read, then the total has reached it.
    assert splits["train"]["documents"] + splits["eval"]["documents"] == 3
    assert splits["train"]["bytes"] + splits["eval"]["bytes"] == 1200
    assert len(result.manifest["sources"]) == 3


def test_an_empty_eval_split_takes_the_last_train_document(tmp_path):
    corpus = make_corpus(tmp_path)
    result = data.shard_dataset(cfg_for(corpus, eval_fraction=1e-9), tmp_path / "out")
    ev = result.manifest["splits"]["eval"]
    last = data.resolve_sources([str(corpus)])[-1]
    assert (ev["documents"], ev["bytes"], ev["tokens"]) == (1, last.size, last.size + 1)
    records = read_records(result.dataset_dir, result.manifest, "eval")
    assert bytes(records[0][:16].astype(np.uint8)) == Path(last.uri).read_bytes()[:16]


def test_too_few_sequences_names_the_numbers(tmp_path):
    cfg = cfg_for(make_corpus(tmp_path), num_shards=500)
    with pytest.raises(
        DatasetError, match=r"train split has \d+ sequence\(s\) of seq_len=16.*num_shards=500"
    ):
        data.shard_dataset(cfg, tmp_path / "out")


def test_single_document_cannot_split(tmp_path):
    (tmp_path / "one.txt").write_text("x" * 500)
    cfg = DatasetConfig(sources=[str(tmp_path / "one.txt")], seq_len=16, eval_fraction=0.1)
    with pytest.raises(DatasetError, match=r"one\.txt.*1 document\(s\)"):
        data.shard_dataset(cfg, tmp_path / "out")


def test_stdlib_source(tmp_path):
    files = data.resolve_sources(["stdlib"])
    assert len(files) > 500 and all(f.uri.endswith(".py") for f in files)
    assert not any("site-packages" in f.uri for f in files)
    assert files[0].key == "__future__.py"
    # Every .py file outside site-packages, hidden ones aside: skipping __pycache__ loses none.
    root = sysconfig.get_paths()["stdlib"]
    expected = set()
    for top, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != "site-packages" and not d.startswith(".")]
        rel = os.path.relpath(top, root)
        expected |= {
            os.path.normpath(os.path.join(rel, n)).replace(os.sep, "/")
            for n in names
            if n.endswith(".py") and not n.startswith(".") and os.path.isfile(os.path.join(top, n))
        }
    assert {f.key for f in files} == expected
    cfg = DatasetConfig(sources=["stdlib"], seq_len=128, num_shards=2, max_bytes=1_000_000)
    m = data.shard_dataset(cfg, tmp_path / "out").manifest
    total = m["splits"]["train"]["bytes"] + m["splits"]["eval"]["bytes"]
    assert 1_000_000 <= total < 1_000_000 + max(f.size for f in files)
    assert m["splits"]["eval"]["records"] >= 1 and m["splits"]["train"]["records"] > 1000


def test_auto_workers_shard_small_corpora_in_this_process():
    def files(total: int) -> list[data.SourceFile]:
        return [data.SourceFile(f"/c/{i}", str(i), total // 4, 0) for i in range(4)]

    auto = DatasetConfig(sources=["x"], workers=0)
    # Below the threshold a worker pool's start costs more than a second core gives back.
    assert data._workers(auto, files(data.AUTO_PARALLEL_BYTES - 4)) == 1
    assert data._workers(auto, files(data.AUTO_PARALLEL_BYTES)) == (os.cpu_count() or 1)
    assert data._workers(DatasetConfig(sources=["x"], workers=3), files(100)) == 3


def faults_of_batches(job: tuple[int, int, str]) -> tuple[int, int]:
    """(pid, page faults) of `batches` rounds of allocating and freeing three 8 MB arrays
    (what an encode batch does), after one round to reach the process's peak. The calling
    process (`parent`) waits until a worker holds a job, however slowly it starts."""
    import resource
    import time

    batches, parent, marks = job
    if os.getpid() != parent:
        Path(marks, str(os.getpid())).touch()
    deadline = time.monotonic() + 30
    while os.getpid() == parent and not os.listdir(marks) and time.monotonic() < deadline:
        time.sleep(0.01)

    def batch() -> None:
        arrays = [np.ones(8 << 20, dtype=np.uint8) for _ in range(3)]
        del arrays

    batch()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(batches):
        batch()
    return os.getpid(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_sharding_workers_reuse_freed_memory_instead_of_faulting_it_in_again(tmp_path):
    # Each such round costs ~6,000 page faults in a process on glibc's defaults; a worker
    # reuses the memory. Over a corpus that was more system time than the tokenizing.
    # (This process, which works alongside its worker, keeps the caller's allocator.)
    with worker_pool(2) as run:
        results = list(run(faults_of_batches, [(5, os.getpid(), str(tmp_path))] * 3))
    in_worker = [faults for pid, faults in results if pid != os.getpid()]
    assert in_worker and all(faults < 500 for faults in in_worker)


@pytest.mark.parametrize("mean_length", [0, 3, 60, 511, 512, 5000])
def test_byte_encoding_is_each_documents_bytes_then_eod_whatever_their_length(mean_length):
    from workloads import tokens

    rng = random.Random(mean_length)
    chars = "ab \n\xe9\u20ac\U0001f600"  # UTF-8 sequences of 1, 2, 3 and 4 bytes
    docs = [
        "".join(rng.choice(chars) for _ in range(rng.randint(0, 2 * mean_length))).encode()
        for _ in range(40)
    ]
    # Stored as uint8, EOD as 0xFF: a byte no UTF-8 document holds, so it marks EOD alone.
    want = [t for doc in docs for t in (*doc, 0xFF)]
    ids, last = tokens.encode(tokens.BYTES, docs)
    assert ids.dtype == np.uint8 and ids.tolist() == want
    assert int((ids == 0xFF).sum()) == len(docs)
    assert last == len(docs[-1]) + 1
