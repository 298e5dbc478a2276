"""The two kinds of work a sharding run spreads over its processes (`workloads.shard_pool`).

1. `tokenize_unit`: read a run of consecutive source files, split their documents between
   train and eval, tokenize them and append each split's ids to a spill file in the work
   directory. Its small JSON summary is written last, so a unit with a summary is finished
   and a killed run's later attempt reuses it instead of reading the files again.
2. `write_shard`: cut a contiguous block of sequences out of a split's token stream (the
   concatenation of the units' spill files) and write it as one ArrayRecord shard under a
   temporary name, renamed once complete and hashed. Shards are fsynced together just
   before the manifest (`workloads.manifest.write_manifest`), the commit point: syncing
   each as it is written made parallel writers wait on each other's journal commits.

Sequences are windows of `seq_len + 1` ids at stride `seq_len` (consecutive ones share one
id), so each id after the first is a target exactly once. Documents are packed back to back,
each ending in EOD; the reader derives segment ids and positions from the EOD ids, so
attention never crosses a document boundary and no slot is padding. An ArrayRecord record
holds `record_sequences` consecutive sequences; the manifest counts sequences.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

from workloads.documents import ReadOptions, document_place, iter_documents
from workloads.manifest import SPLITS, TMP_PREFIX, file_sha256, start_writeback
from workloads.sources import (
    DatasetError,
    DatasetWriteError,
    SourceFile,
    SourceStore,
    check_unchanged,
    open_source,
)
from workloads.tokens import EncodeError, TokenizerSpec, encode

WORK_VERSION = 1  # bump when a unit's spill files change meaning, so stale ones are redone
CHUNK_BYTES = 32 << 10  # the most a record (one ArrayRecord chunk) holds; `record_sequences`
ENCODE_BATCH_BYTES = 4 << 20  # documents tokenized together: bounds a worker's memory
# Ids built into records at once while writing a shard: a block's arrays stay in cache and
# malloc reuses them, where 8 MiB blocks were mapped afresh each time (~7,000 page faults
# per 16 MB shard). Also what bounds a writer's memory.
RECORD_BLOCK_BYTES = 1 << 20


@dataclass(frozen=True)
class UnitJob:
    """Consecutive source files tokenized by one worker into `work_dir/unit-NNNNN.*`."""

    index: int
    files: tuple[SourceFile, ...]
    read: ReadOptions
    eval_fraction: float
    tokenizer: TokenizerSpec
    work_dir: str
    store: SourceStore | None = None

    def path(self, suffix: str) -> Path:
        """The unit's file with this suffix: `train`, `eval` (token ids) or `json`."""
        return Path(self.work_dir) / f"unit-{self.index:05d}.{suffix}"

    def identity(self) -> list:
        """What a reusable summary must match: the work format and the unit's files."""
        return [WORK_VERSION, [[f.uri, f.size, f.version] for f in self.files]]


def in_eval(key: str, eval_fraction: float) -> bool:
    """Whether the document named `key` is held out: a hash of its name, not its position,
    so adding a document never moves another across the split."""
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction


def finished_unit(job: UnitJob) -> dict | None:
    """The summary of a unit a previous attempt finished, or None if it must be (re)done."""
    try:
        meta = json.loads(job.path("json").read_text())
        if meta["identity"] != job.identity():
            return None
        itemsize = np.dtype(job.tokenizer.dtype).itemsize
        for split in SPLITS:
            if job.path(split).stat().st_size != meta[split]["tokens"] * itemsize:
                return None
        return meta
    except (OSError, ValueError, KeyError, TypeError):
        return None


def tokenize_unit(job: UnitJob) -> dict:
    """Tokenize one unit's files into its spill files; returns the unit's summary.

    The summary holds, per split, `tokens`, `documents`, `bytes` (UTF-8 text) and the last
    document's `last_tokens` and `last_bytes`, so the run can move one document between
    splits without reading it again.

    Raises:
        DatasetError: from reading or decoding a source, naming the place.
    """
    fields = ("tokens", "documents", "bytes", "last_tokens", "last_bytes")
    stats = {s: dict.fromkeys(fields, 0) for s in SPLITS}
    pending: dict[str, list[bytes]] = {s: [] for s in SPLITS}
    # (file, document number) of each pending document: only read to name a document the
    # tokenizer fails on, whose line `document_place` then finds by reading the file again.
    origin: dict[str, list[tuple[SourceFile, int]]] = {s: [] for s in SPLITS}
    pending_bytes = dict.fromkeys(SPLITS, 0)
    spills = {s: job.path(f"{s}.tmp") for s in SPLITS}
    outs = {}
    for s, path in spills.items():
        with write_errors(path):
            outs[s] = open(path, "wb")  # noqa: SIM115

    def flush(split: str) -> None:
        try:
            ids, last = encode(job.tokenizer, pending[split])
        except EncodeError as exc:
            src, n = origin[split][exc.index]
            place = document_place(src, n, job.read, job.store)
            raise DatasetError(f"{place}: {exc}") from None
        with write_errors(spills[split]):
            outs[split].write(memoryview(ids).cast("B"))  # the array's bytes, not a copy
        st = stats[split]
        st["tokens"] += len(ids)
        st["last_tokens"], st["last_bytes"] = last, len(pending[split][-1])
        pending[split], origin[split], pending_bytes[split] = [], [], 0

    prefetch(job.files)
    try:
        for src in job.files:
            whole = job.read.whole_files(src.uri)
            with open_source(src, job.store) as fh:
                try:
                    for n, doc in enumerate(iter_documents(fh, src, job.read)):
                        # A multi-document file's documents are split one by one, so even
                        # a single large JSONL file yields both splits.
                        key = src.key if whole else f"{src.key}#{n}"
                        split = "eval" if in_eval(key, job.eval_fraction) else "train"
                        pending[split].append(doc)
                        origin[split].append((src, n))
                        pending_bytes[split] += len(doc)
                        stats[split]["documents"] += 1
                        stats[split]["bytes"] += len(doc)
                        if pending_bytes[split] >= ENCODE_BATCH_BYTES:
                            flush(split)
                except DatasetError:
                    # A line cut off by a writer still appending is not bad input: say so.
                    check_unchanged(fh, src)
                    raise
                check_unchanged(fh, src)
        for split in SPLITS:
            if pending[split]:
                flush(split)
    finally:
        for split, fh in outs.items():
            with write_errors(spills[split]):
                fh.close()  # flushes the buffer's last bytes: a full disk says so here
    for split in SPLITS:  # a crash between renames leaves no summary, so nothing is trusted
        with write_errors(job.path(split)):
            os.replace(spills[split], job.path(split))
    meta = {"identity": job.identity(), **stats}
    tmp = job.path("json.tmp")
    with write_errors(tmp):
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, job.path("json"))
    return meta


@contextmanager
def write_errors(path: Path, what: str = "the tokenize spill file") -> Iterator[None]:
    """Raise an error writing a sharding output file as a DatasetError naming the file.

    A full disk (ENOSPC) gave a raw traceback: an OSError naming no path for a spill
    file, the ArrayRecord writer's RuntimeError for a shard. `tpupipe shard` prints a
    DatasetError as one line, and the run removes the dataset directory it could not
    finish (freeing the disk it filled).
    """
    try:
        yield
    except (OSError, RuntimeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise DatasetWriteError(f"cannot write {what} {path}: {reason}") from None


def prefetch(files: tuple[SourceFile, ...]) -> None:
    """Ask the kernel to start reading a unit's local files now, all at once: a cold
    corpus of many small files is then read with many requests in flight instead of one
    file after another (cold stdlib corpus, 2 workers: 0.57-0.62 s -> 0.41-0.50 s). A
    hint only: errors are left to the real read."""
    for src in files:
        if src.remote:
            continue
        try:
            fd = os.open(src.uri, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


@dataclass(frozen=True)
class ShardJob:
    """Records `[first, first + count)` of a split's stream, written as shard `name`.

    `parts` lists the stream's pieces in order as (spill file, first token, token count).
    """

    directory: str
    name: str
    parts: tuple[tuple[str, int, int], ...]
    dtype: str
    seq_len: int
    first: int
    count: int


def read_stream(
    parts: tuple[tuple[str, int, int], ...], dtype: np.dtype, start: int, stop: int
) -> np.ndarray:
    """Tokens `[start, stop)` of the stream made of `parts`."""
    out, base = [], 0
    for path, offset, length in parts:
        lo, hi = max(start, base), min(stop, base + length)
        if lo < hi:
            at = (offset + lo - base) * dtype.itemsize
            out.append(np.fromfile(path, dtype=dtype, count=hi - lo, offset=at))
        base += length
    # One piece (the usual case: a unit's spill holds a whole block) is used as read:
    # concatenating it alone would copy it.
    tokens = out[0] if len(out) == 1 else np.concatenate(out) if out else np.empty(0, dtype)
    if len(tokens) != stop - start:
        raise ValueError(f"token stream holds {base} ids, asked for [{start}, {stop})")
    return tokens


def pack_records(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """Cut a token stream into records of `seq_len + 1` ids at stride `seq_len`.

    Args:
        tokens: 1-D ids.
        seq_len: Tokens per training sequence.

    Returns:
        Shape (count, seq_len + 1); the incomplete tail is dropped.
    """
    count = max(0, (len(tokens) - 1) // seq_len)
    records = np.empty((count, seq_len + 1), dtype=tokens.dtype)
    # Two contiguous copies: much faster than materialising a strided window view.
    records[:, :seq_len] = tokens[: count * seq_len].reshape(count, seq_len)
    records[:, seq_len] = tokens[seq_len : count * seq_len + 1 : seq_len]
    return records


def record_sequences(seq_len: int, dtype: str) -> int:
    """Training sequences (`seq_len + 1` ids of `dtype`) stored together in one ArrayRecord
    record: as many as fit in `CHUNK_BYTES`, at most 64. A pure function of the sequence
    size, so the bytes stay deterministic; readers take it from the manifest
    (`record.sequences`).

    The writer costs about 0.3 us per record whatever its size: writing the stdlib
    corpus's 31.5 MB as one record per 129-byte sequence took 0.13 s, as records of 64
    sequences 0.056 s (the writer alone, same bytes, best of 5 each).
    """
    sequence_bytes = (seq_len + 1) * np.dtype(dtype).itemsize
    return max(1, min(64, CHUNK_BYTES // sequence_bytes))


def writer_options() -> str:
    """ArrayRecord options: uncompressed (tokens barely compress, and decoding would cost
    the loader), one record per chunk (what grain's docs ask for).

    A record holds `record_sequences` sequences, so a chunk is about `CHUNK_BYTES`:
    reading a chunk for one sequence costs little, and chunks of single 258-byte
    sequences had made grain's random reads 4x slower (245 vs 1,040 batches/s for the
    demo config), each costing a header, an index entry and a seek.
    """
    return "uncompressed,group_size:1"


def write_shard(job: ShardJob) -> dict:
    """Write one shard atomically; returns its manifest entry (name, records, bytes, sha256).

    `records` counts sequences; the shard's ArrayRecord records hold
    `record_sequences` of them each, its last one the rest.
    """
    final = Path(job.directory) / job.name
    tmp = final.with_name(f"{TMP_PREFIX}{job.name}")
    with write_errors(tmp, "the shard"):
        _write_records(job, tmp)
        start_writeback(tmp)
        digest = file_sha256(tmp)
        size = tmp.stat().st_size
        os.replace(tmp, final)
    return {"name": job.name, "records": job.count, "bytes": size, "sha256": digest}


def _write_records(job: ShardJob, tmp: Path) -> None:
    dtype = np.dtype(job.dtype).newbyteorder("<")
    per = record_sequences(job.seq_len, job.dtype)
    writer = ArrayRecordWriter(str(tmp), writer_options())
    try:
        # A whole number of records per block: records never straddle two blocks.
        block = max(1, RECORD_BLOCK_BYTES // (per * job.seq_len * dtype.itemsize)) * per
        for first in range(job.first, job.first + job.count, block):
            n = min(block, job.first + job.count - first)
            start = first * job.seq_len
            tokens = read_stream(job.parts, dtype, start, start + n * job.seq_len + 1)
            packed = pack_records(tokens, job.seq_len)
            # The writer takes one bytes object per record, each copied out of the block
            # once (the block's bytes sliced was two copies: 14% more time per shard),
            # handed over by `map` (18% less than a Python loop calling it).
            records = [packed[i : i + per].tobytes() for i in range(0, len(packed), per)]
            deque(map(writer.write, records), 0)
    finally:
        writer.close()
