"""The shards of one split as grain reads them: opened with each failure naming its shard,
random access to single sequences over records that hold several (`SequenceSource`), and
batches of them stacked as token ids (`record_stacker`). Used by `workloads.input`.
"""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from workloads.dataset_cache import local_dataset
from workloads.manifest import (
    DIGEST,
    SPLITS,
    load_manifest,
    record_dtype,
    sequences_per_record,
    shard_paths,
    stored_eod,
)
from workloads.sources import DatasetError


def split_source(dataset_dir: str | os.PathLike, split: str) -> tuple[Any, dict]:
    """One split's sequences as a grain source (`SequenceSource`, or the records themselves
    where a record holds one sequence), and the dataset's manifest.

    Raises:
        DatasetError: the manifest is malformed, or a shard is missing or unreadable.
    """
    dataset_dir = local_dataset(dataset_dir)  # a gs:// dataset is read from a local copy
    manifest = load_manifest(dataset_dir)
    paths = shard_paths(dataset_dir, manifest, split)
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        # The reader would otherwise fail later with a less helpful C++ error.
        raise DatasetError(f"dataset shard {missing[0]} listed in the manifest is missing")
    records = _open_shards(paths)
    if DIGEST not in manifest and (problem := counts_problem(dataset_dir, manifest)):
        raise DatasetError(
            f"dataset shards and their manifest disagree (an edited manifest, a shard from "
            f"another build): {problem}; shard the dataset again (delete its directory)"
        )
    per = sequences_per_record(manifest)
    counts = [shard["records"] for shard in manifest["splits"][split]["shards"]]
    expected = [-(-count // per) for count in counts]  # ArrayRecord records per shard
    if len(records) != sum(expected):
        raise _miscounted(paths, expected)
    if per == 1:
        return records, manifest
    size = manifest["record"]["length"] * record_dtype(manifest).itemsize
    return SequenceSource(records, counts, per, size, paths), manifest


def counts_problem(dataset_dir: str | os.PathLike, manifest: dict) -> str | None:
    """Where the shards do not hold exactly the sequences their manifest counts, naming
    the first such shard; None if they all do.

    A shard of `records` sequences, `per` to an ArrayRecord record, holds ceil(records /
    per) records, its last one the rest. The read-time checks only see a record too short:
    a manifest without a digest (`manifest.DIGEST`: written before it existed, or deleted)
    that counted a sequence fewer was trained on over other data. One read of each shard's
    last record, for such manifests only.
    """
    from array_record.python.array_record_module import ArrayRecordReader

    per = sequences_per_record(manifest)
    size = manifest["record"]["length"] * record_dtype(manifest).itemsize
    for split in SPLITS:
        shards = manifest["splits"][split]["shards"]
        for path, shard in zip(shard_paths(dataset_dir, manifest, split), shards, strict=True):
            want, reader = -(-shard["records"] // per), ArrayRecordReader(path)
            try:
                got = reader.num_records()
                last = len(reader.read([got - 1])[0]) if got else 0
            except RuntimeError as exc:
                return f"{path} cannot be read ({str(exc).strip()[:200]})"
            finally:
                reader.close()
            if got != want:
                return f"{path} holds {got} records, its manifest counts {want}"
            rest = shard["records"] - (got - 1) * per
            if got and last != rest * size:
                return (
                    f"{path}'s last record holds {last} bytes, not the {rest} sequence(s) of "
                    f"{size} bytes its manifest counts"
                )
    return None


def _open_shards(paths: list[str]) -> Any:
    """The shards as one grain source; a shard ArrayRecord cannot open (truncated, not an
    ArrayRecord file) is named, where its error was a bare RuntimeError ('' or a Riegeli
    byte offset) that left a user of 64 shards guessing which to replace."""
    # Imported here, not at the top: grain imports jax (0.6 s), and sharding, which
    # imports this module for `counts_problem`, needs neither, nor do the workers forked
    # from its forkserver, whose preload was that much slower to come up.
    import grain

    try:
        return grain.sources.ArrayRecordDataSource(paths)
    except RuntimeError as exc:
        for path in paths:  # only after a failure: which one
            try:
                grain.sources.ArrayRecordDataSource([path])
            except RuntimeError as bad:
                raise unreadable_shard(path, bad) from None
        raise DatasetError(f"the dataset shards {paths[0]}... cannot be opened: {exc}") from None


def _miscounted(paths: list[str], expected: list[int]) -> DatasetError:
    """The error for shards holding another number of records than their manifest says,
    naming each such shard (counted one by one only now, after the total disagreed)."""
    from array_record.python.array_record_module import ArrayRecordReader

    wrong = []
    for path, want in zip(paths, expected, strict=True):
        reader = ArrayRecordReader(path)
        try:
            if (got := reader.num_records()) != want:
                wrong.append(f"{path} holds {got} records, its manifest counts {want}")
        finally:
            reader.close()
    return DatasetError(
        f"dataset shards and their manifest disagree (a shard from another build, an edited "
        f"manifest): {'; '.join(wrong)}; shard the dataset again (delete its directory)"
    )


def unreadable_shard(path: str, exc: Exception) -> DatasetError:
    """The error for a shard whose bytes ArrayRecord refuses, naming it."""
    reason = str(exc).strip() or type(exc).__name__
    return DatasetError(
        f"dataset shard {path} is corrupt or truncated ({reason[:300]}); shard the dataset "
        "again (delete its directory) or restore the file"
    )


class SequenceSource:
    """Random access to single sequences, over shards whose ArrayRecord records hold `per`
    sequences each (a shard's last record the rest): what grain samples and batches.

    A record too short for a sequence the manifest counts (a shard from another build of
    the same name and size, an edited manifest) is refused naming its shard, as is a
    record ArrayRecord cannot read: sliced short, it had made batches with fewer rows.

    Args:
        records: The split's records, its shards in order.
        counts: Sequences in each shard (the manifest's `records`).
        per: Sequences per record (`record.sequences`).
        sequence_bytes: Bytes of one sequence.
        paths: The shards' paths, in the same order (named in errors).
    """

    def __init__(
        self,
        records: Any,
        counts: Sequence[int],
        per: int,
        sequence_bytes: int,
        paths: Sequence[str] = (),
    ):
        self._records, self._per, self._bytes = records, per, sequence_bytes
        self._paths = list(paths)
        # Python ints and `bisect`: numpy's per-item overhead cost the loader ~10%.
        self._first_sequence = list(itertools.accumulate(counts, initial=0))
        self._first_record = list(itertools.accumulate((-(-c // per) for c in counts), initial=0))
        if self._first_record[-1] != len(records):
            raise DatasetError(
                f"the shards hold {len(records)} records, their manifest counts "
                f"{self._first_record[-1]} ({self._first_sequence[-1]} sequences, {per} a record)"
            )

    def __len__(self) -> int:
        return self._first_sequence[-1]

    def _locate(self, index: int) -> tuple[int, int]:
        """(record, byte offset in it) of sequence `index`."""
        index = int(index)
        if not 0 <= index < self._first_sequence[-1]:
            raise IndexError(f"sequence {index} is not in [0, {len(self)})")
        shard = bisect.bisect_right(self._first_sequence, index) - 1
        within = index - self._first_sequence[shard]
        return self._first_record[shard] + within // self._per, (within % self._per) * self._bytes

    def __getitem__(self, index: int) -> bytes:
        record, at = self._locate(index)
        try:
            data = self._records[record]
        except RuntimeError as exc:
            raise unreadable_shard(self._shard_of(record)[0], exc) from None
        return self._sequence(data, record, at)

    def __getitems__(self, indices: Sequence[int]) -> list[bytes]:
        where = [self._locate(i) for i in indices]
        wanted = sorted({record for record, _ in where})
        try:
            got = self._records.__getitems__(wanted)
        except RuntimeError:
            return [self[i] for i in indices]  # one by one: the failing read names its shard
        read = dict(zip(wanted, got, strict=True))
        return [self._sequence(read[record], record, at) for record, at in where]

    def _sequence(self, data: bytes, record: int, at: int) -> bytes:
        sequence = data[at : at + self._bytes]
        if len(sequence) != self._bytes:
            path, within = self._shard_of(record)
            raise DatasetError(
                f"dataset shard {path}: its record {within} holds {len(data)} bytes, too few for "
                f"the sequences its manifest counts: the shard and its manifest disagree (a "
                "shard from another build, an edited manifest); shard the dataset again "
                "(delete its directory)"
            )
        return sequence

    def _shard_of(self, record: int) -> tuple[str, int]:
        """The shard holding `record` (its path, if known) and the record's index in it."""
        shard = bisect.bisect_right(self._first_record, record) - 1
        path = self._paths[shard] if shard < len(self._paths) else f"number {shard}"
        return path, record - self._first_record[shard]


def record_stacker(manifest: dict) -> Any:
    """`stack(records)`: a batch of records as token ids, shape (batch, record length); the
    stored EOD (0xFF in uint8 records) is given back as the tokenizer's EOD id."""
    dtype, record_len = record_dtype(manifest), manifest["record"]["length"]
    stored, eod = stored_eod(manifest), manifest["tokenizer"]["eod_token"]

    def stack(records: Sequence[bytes]) -> np.ndarray:
        # One frombuffer per batch rather than per record.
        joined = b"".join(records)
        if len(joined) != len(records) * record_len * dtype.itemsize:
            # A short record would otherwise make a batch of fewer rows, whole ones.
            raise DatasetError(
                f"a dataset record holds other than {record_len} {dtype.name} ids (the "
                "manifest's record.length): the shards and their manifest disagree"
            )
        raw = np.frombuffer(joined, dtype=dtype).reshape(-1, record_len)
        if stored == eod:
            return raw
        ids = raw.astype(np.uint16)
        ids[raw == stored] = eod
        return ids

    return stack
