"""The grain reader: decoding, batching, per-process sharding, exact resume, eval padding."""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import read_sequences
from workloads import data, input
from workloads.config import EOD_TOKEN, DatasetConfig
from workloads.data import DatasetError
from workloads.shard_source import SequenceSource

SEQ = 16


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("input")
    corpus = root / "corpus"
    corpus.mkdir()
    for i, size in enumerate((700, 450, 900, 300, 650, 520, 610)):
        rng = random.Random(i)
        (corpus / f"doc{i}.txt").write_text(
            "".join(rng.choice("abcdefgh ij\n") for _ in range(size))
        )
    # Two train shards of 86 sequences and an eval shard of 85: records of 64 and a rest.
    cfg = DatasetConfig(sources=[str(corpus)], seq_len=SEQ, num_shards=2, eval_fraction=0.2)
    return data.shard_dataset(cfg, root / "out").dataset_dir


def all_records(dataset_dir: str, split: str) -> np.ndarray:
    """A split's records as the model's ids: bytes, with the stored 0xFF read as EOD."""
    manifest = data.load_manifest(dataset_dir)
    assert manifest["record"]["dtype"] == "uint8" and manifest["record"]["eod"] == 0xFF
    shards = manifest["splits"][split]["shards"]
    raw = np.concatenate(
        [read_sequences(os.path.join(dataset_dir, shard["name"]), manifest) for shard in shards]
    )
    return np.where(raw == 0xFF, EOD_TOKEN, raw.astype(np.int32))


def test_decode_records_segments_and_positions():
    e = EOD_TOKEN
    raw = np.array([[5, 6, e, 7, e, e, 8, 9], [1, 2, 3, 4, 5, 6, 7, e]], dtype=np.uint16)
    out = input.decode_records(raw, e)
    assert out["inputs"].tolist() == [[5, 6, e, 7, e, e, 8], [1, 2, 3, 4, 5, 6, 7]]
    assert out["targets"].tolist() == [[6, e, 7, e, e, 8, 9], [2, 3, 4, 5, 6, 7, e]]
    # The EOD ends its document's segment; the token after it opens the next one.
    assert out["segment_ids"].tolist() == [[1, 1, 1, 2, 2, 3, 4], [1] * 7]
    assert out["positions"].tolist() == [[0, 1, 2, 0, 1, 0, 0], list(range(7))]
    assert out["weights"].tolist() == [[1.0] * 7] * 2
    for key in ("inputs", "targets", "segment_ids", "positions"):
        assert out[key].dtype == np.int32 and out[key].shape == (2, 7)
    assert out["weights"].dtype == np.float32
    padded = input.decode_records(raw, e, real_rows=np.array([True, False]))
    assert padded["weights"].tolist() == [[1.0] * 7, [0.0] * 7]


def test_dataset_info(dataset_dir):
    info = input.dataset_info(dataset_dir)
    ev = data.load_manifest(dataset_dir)["splits"]["eval"]
    assert (info.vocab_size, info.eod_token, info.seq_len) == (257, EOD_TOKEN, SEQ)
    assert info.bytes_per_token == ev["bytes"] / ev["tokens"] < 1.0
    assert info.train_records == len(all_records(dataset_dir, "train"))
    assert info.eval_records == len(all_records(dataset_dir, "eval"))


def test_train_batches_shapes_and_content(dataset_dir):
    it = input.train_iterator(dataset_dir, batch_size=4, seed=0)
    batch = next(it)
    assert set(batch) == {"inputs", "targets", "segment_ids", "positions", "weights"}
    for key, value in batch.items():
        assert value.shape == (4, SEQ)
        assert value.dtype == (np.float32 if key == "weights" else np.int32)
    records = {tuple(r) for r in all_records(dataset_dir, "train")}
    for inp, tgt in zip(batch["inputs"], batch["targets"], strict=True):
        assert (*inp, tgt[-1]) in records


def first_epoch(dataset_dir: str, seed: int, index: int, count: int, n: int) -> list[tuple]:
    it = input.train_iterator(dataset_dir, 1, seed, shard_index=index, shard_count=count)
    rows = []
    for _ in range(n):
        b = next(it)
        rows.append((*b["inputs"][0], b["targets"][0, -1]))
    return rows


def test_processes_share_an_epoch_disjointly(dataset_dir):
    records = sorted(tuple(r) for r in all_records(dataset_dir, "train"))
    n = len(records)
    one = first_epoch(dataset_dir, 7, 0, 1, n)
    assert sorted(one) == records and one != records  # a permutation, shuffled
    p0 = first_epoch(dataset_dir, 7, 0, 2, (n + 1) // 2)
    p1 = first_epoch(dataset_dir, 7, 1, 2, n // 2)
    assert sorted(p0 + p1) == records
    # Dealt round-robin from the same global order as the single-process stream.
    assert p0 == one[0::2] and p1 == one[1::2]
    assert first_epoch(dataset_dir, 8, 0, 1, n) != one


@pytest.mark.parametrize(("index", "count"), [(0, 1), (1, 2)])
def test_iterator_state_resumes_exactly(dataset_dir, index, count):
    n_train = input.dataset_info(dataset_dir).train_records
    k = n_train // 3 + 1  # past the first epoch for the sharded reader

    def fresh():
        return input.train_iterator(dataset_dir, 3, seed=1, shard_index=index, shard_count=count)

    uninterrupted = fresh()
    for _ in range(k):
        next(uninterrupted)
    saved = json.loads(json.dumps(input.iterator_state_to_json(uninterrupted)))
    expected = [next(uninterrupted) for _ in range(2)]
    resumed = fresh()
    input.restore_iterator_state(resumed, saved)
    for want in expected:
        got = next(resumed)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


def test_eval_batches_pad_the_last_batch(dataset_dir):
    records = all_records(dataset_dir, "eval")
    n = len(records)
    size = next(s for s in (4, 3, 5, 7) if n % s)  # one that leaves a partial batch
    batches = list(input.eval_batches(dataset_dir, size, max_batches=1000))
    assert len(batches) == -(-n // size)
    assert all(b["inputs"].shape == (size, SEQ) for b in batches)
    inputs = np.concatenate([b["inputs"] for b in batches])
    weights = np.concatenate([b["weights"] for b in batches])
    np.testing.assert_array_equal(inputs[:n], records[:, :-1])  # in order, nothing dropped
    assert (weights[:n] == 1).all() and (weights[n:] == 0).all()
    assert (inputs[n:] == EOD_TOKEN).all()
    assert len(list(input.eval_batches(dataset_dir, size, max_batches=2))) == min(2, len(batches))
    again = list(input.eval_batches(dataset_dir, size, max_batches=1000))
    np.testing.assert_array_equal(np.concatenate([b["inputs"] for b in again]), inputs)
    # A batch size past the split's size is one batch of the split, not of padding (10**12
    # rows allocated 7.28 TiB, after the whole training run).
    (whole,) = input.eval_batches(dataset_dir, 10**12, max_batches=1000)
    np.testing.assert_array_equal(whole["inputs"], records[:, :-1])
    assert (whole["weights"] == 1).all()


def test_incomplete_dataset_is_refused(tmp_path, dataset_dir):
    with pytest.raises(DatasetError, match="incomplete dataset"):
        input.train_iterator(tmp_path, 2, 0)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "manifest.json").write_text(Path(dataset_dir, "manifest.json").read_text())
    with pytest.raises(DatasetError, match="train-00000-of-00002"):
        input.train_iterator(broken, 2, 0)
    with pytest.raises(ValueError, match="shard_index"):
        input.train_iterator(dataset_dir, 2, 0, shard_index=2, shard_count=2)


def _copy(dataset_dir: str, to: Path) -> Path:
    import shutil

    return Path(shutil.copytree(dataset_dir, to))


def test_a_damaged_or_foreign_shard_is_refused_naming_it(dataset_dir, tmp_path):
    """A shard ArrayRecord cannot read gave a bare RuntimeError ('' or a Riegeli offset);
    a shard of the same name and size from another build (ArrayRecord pads files to
    64 KiB) passed every check and made batches of fewer rows than asked for."""
    last = data.load_manifest(dataset_dir)["splits"]["train"]["shards"][-1]["name"]
    truncated = _copy(dataset_dir, tmp_path / "truncated")
    (truncated / last).write_bytes((truncated / last).read_bytes()[:65536])
    with pytest.raises(DatasetError, match=f"dataset shard .*{last} is corrupt or truncated"):
        input.train_iterator(truncated, 4, 0)

    # Another build's shard: as many records, the last holding one sequence fewer.
    from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

    from workloads.packing import writer_options

    reader = ArrayRecordReader(str(Path(dataset_dir, last)))
    records = reader.read_all()
    reader.close()
    other = tmp_path / "other.arrayrecord"
    writer = ArrayRecordWriter(str(other), writer_options())
    for record in [*records[:-1], records[-1][: -(SEQ + 1)]]:
        writer.write(record)
    writer.close()
    foreign = _copy(dataset_dir, tmp_path / "foreign")
    (foreign / last).write_bytes(other.read_bytes())
    assert data.shards_present(foreign, data.load_manifest(foreign))  # the cheap check passes
    it = input.train_iterator(foreign, 8, 0)
    with pytest.raises(
        DatasetError,
        match=f"dataset shard .*{last}: its record .* the shard and its manifest disagree",
    ):
        for _ in range(100):  # two epochs: every sequence is read
            assert next(it)["inputs"].shape == (8, SEQ)


@pytest.mark.parametrize("sequences", [None, 1], ids=["several-a-record", "one-a-record"])
def test_a_shard_with_another_record_count_is_refused_naming_it(dataset_dir, tmp_path, sequences):
    """The error named no shard ("the shards hold 87 records, their manifest counts 126"),
    and where a record holds one sequence the miscount went unchecked."""
    from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

    from workloads.packing import writer_options

    edited = _copy(dataset_dir, tmp_path / "edited")
    manifest = json.loads((edited / "manifest.json").read_text())
    if sequences == 1:  # an older layout: one sequence per ArrayRecord record
        manifest["record"]["sequences"] = 1
        del manifest["manifest_sha256"]  # as an older version wrote it
        for split in ("train", "eval"):
            for entry in manifest["splits"][split]["shards"]:
                path = str(edited / entry["name"])
                reader = ArrayRecordReader(path)
                entry["records"] = reader.num_records()
                reader.close()
        (edited / "manifest.json").write_text(json.dumps(manifest))
    first = manifest["splits"]["train"]["shards"][0]["name"]
    reader = ArrayRecordReader(str(edited / first))
    records = reader.read_all()
    reader.close()
    writer = ArrayRecordWriter(str(edited / first), writer_options())
    for record in records[:-1]:
        writer.write(record)
    writer.close()

    want = f"{edited / first} holds {len(records) - 1} records, its manifest counts {len(records)}"
    with pytest.raises(DatasetError, match=re.escape(want)):
        input.train_iterator(edited, 4, 0)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m["splits"]["eval"].update(shards=[]), "the eval split lists no shard"),
        (lambda m: m["splits"]["train"]["shards"][0].update(records="64"), "records '64'"),
        (lambda m: m["splits"]["train"]["shards"][0].update(records=-1), "records -1"),
        (lambda m: m["record"].update(length=SEQ + 2), f"record length {SEQ + 2} is not seq_len"),
    ],
    ids=["no-eval-shard", "records-a-string", "records-negative", "record-length"],
)
def test_a_manifest_that_cannot_describe_its_shards_is_refused_naming_it(
    dataset_dir, tmp_path, edit, message
):
    edited = _copy(dataset_dir, tmp_path / "edited")
    manifest = json.loads((edited / "manifest.json").read_text())
    edit(manifest)
    (edited / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match=f"malformed manifest.json in {edited}: .*{message}"):
        input.train_iterator(edited, 4, 0)


def test_a_dataset_stored_as_uint16_by_an_older_version_reads_the_same(dataset_dir, tmp_path):
    """Format 4 stored byte ids as uint16 with EOD 256; a run that trained on such a
    dataset, resumed after an upgrade, must see the same batches and iterator positions."""
    from tests.helpers import as_format_4

    old = as_format_4(dataset_dir, tmp_path / "v4")
    assert input.dataset_info(old) == input.dataset_info(dataset_dir)
    new_it = input.train_iterator(dataset_dir, 3, seed=5)
    old_it = input.train_iterator(old, 3, seed=5)
    for _ in range(4):
        want, got = next(new_it), next(old_it)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
    saved = input.iterator_state_to_json(old_it)
    input.restore_iterator_state(new_it, saved)  # the state carries over between the two
    np.testing.assert_array_equal(next(new_it)["inputs"], next(old_it)["inputs"])
    batches = zip(
        input.eval_batches(dataset_dir, 4, max_batches=100),
        input.eval_batches(old, 4, max_batches=100),
        strict=True,
    )
    for want, got in batches:
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
    assert any((b["inputs"] == EOD_TOKEN).any() for b in input.eval_batches(old, 4, 100))


def test_a_state_saved_over_other_records_does_not_resume(dataset_dir, tmp_path):
    """A checkpoint of a run over other data, copied into a run, resumed silently: its
    config hash was this run's, and nothing else was compared."""
    import shutil

    it = input.train_iterator(dataset_dir, 4, seed=1)
    next(it)
    saved = input.iterator_state_to_json(it)
    # Other text at the same paths: same config, another dataset.
    corpus = tmp_path / "corpus"
    shutil.copytree(Path(dataset_dir).parents[1] / "corpus", corpus)
    (corpus / "doc0.txt").write_text("other text " * 80)
    cfg = DatasetConfig(sources=[str(corpus)], seq_len=SEQ, num_shards=2, eval_fraction=0.2)
    other = input.train_iterator(data.shard_dataset(cfg, tmp_path / "out").dataset_dir, 4, 1)
    with pytest.raises(ValueError, match=r"saved over a dataset of other records .*other data"):
        input.restore_iterator_state(other, saved)
    # The same records stored elsewhere (a copied dataset, a newer storage format) resume.
    copy = shutil.copytree(dataset_dir, tmp_path / "copy")
    same = input.train_iterator(copy, 4, seed=1)
    input.restore_iterator_state(same, saved)
    np.testing.assert_array_equal(next(same)["inputs"], next(it)["inputs"])


def test_a_state_resumes_only_the_same_global_batch_and_seed(dataset_dir):
    it = input.train_iterator(dataset_dir, 4, seed=1)
    for _ in range(3):
        next(it)
    saved = json.loads(json.dumps(input.iterator_state_to_json(it)))
    assert saved["global_batch"] == 4 and saved["seed"] == 1
    # Three batches of 4 are not three batches of 8, nor a place in another shuffle.
    for batch, seed, key in ((8, 1, "global_batch=4"), (4, 2, "seed=1")):
        other = input.train_iterator(dataset_dir, batch, seed=seed)
        with pytest.raises(ValueError, match=f"saved with {key} cannot resume"):
            input.restore_iterator_state(other, saved)
    # Two processes of 2 read the same global batches of 4: their halves of the next one.
    want = next(it)["inputs"]
    halves = []
    for index in (0, 1):
        part = input.train_iterator(dataset_dir, 2, seed=1, shard_index=index, shard_count=2)
        input.restore_iterator_state(part, saved)
        halves.append(next(part)["inputs"])
    np.testing.assert_array_equal(np.stack(halves, axis=1).reshape(want.shape), want)
    # A state saved before the batch size and seed were recorded is taken as it is.
    old = input.train_iterator(dataset_dir, 4, seed=1)
    input.restore_iterator_state(old, {"next_index": saved["next_index"]})
    np.testing.assert_array_equal(next(old)["inputs"], want)
    # Not a saved state at all (grain said only "KeyError: 'next_index'").
    with pytest.raises(ValueError, match="iterator state with keys \\[\\] lacks 'next_index'"):
        input.restore_iterator_state(input.train_iterator(dataset_dir, 4, seed=1), {})


def test_sequences_are_found_across_records_and_shards_and_a_miscount_is_refused():
    # Shards of 130, 5 and 64 sequences, 64 a record: records of 64, 64, 2 | 5 | 64.
    counts, per, size = [130, 5, 64], 64, 3
    sequences = [bytes([i % 251, i // 251, 7]) for i in range(sum(counts))]
    records, at = [], 0
    for count in counts:
        shard = sequences[at : at + count]
        records += [b"".join(shard[i : i + per]) for i in range(0, count, per)]
        at += count

    class Records(list):
        def __getitems__(self, indices):
            return [self[i] for i in indices]

    source = SequenceSource(Records(records), counts, per, size)
    assert len(source) == 199
    assert [source[i] for i in range(len(source))] == sequences
    picks = [198, 0, 129, 130, 134, 135, 64, 63, 130]
    assert source.__getitems__(picks) == [sequences[i] for i in picks]
    with pytest.raises(IndexError):
        source[199]
    with pytest.raises(DatasetError, match="the shards hold 4 records, their manifest counts 5"):
        SequenceSource(Records(records[:4]), counts, per, size)


def test_shards_hold_several_sequences_a_record(dataset_dir):
    manifest = data.load_manifest(dataset_dir)
    assert manifest["record"]["sequences"] == 64  # 17-byte sequences: 64 fit in 32 KiB
    from array_record.python.array_record_module import ArrayRecordReader

    shards = manifest["splits"]["train"]["shards"] + manifest["splits"]["eval"]["shards"]
    assert all(shard["records"] % 64 and shard["records"] > 64 for shard in shards)
    for shard in shards:
        reader = ArrayRecordReader(os.path.join(dataset_dir, shard["name"]))
        assert reader.num_records() == -(-shard["records"] // 64)
        reader.close()
