"""The grain input pipeline over the ArrayRecord shards written by `workloads.data`.

Training reads an endless, per-epoch reshuffled stream, of which each process takes every
`shard_count`-th record; its iterator state is a small JSON dict saved with each checkpoint,
so a resumed run sees exactly the batches an uninterrupted one would. Evaluation reads the
eval split in order, padding the last batch instead of dropping real records.
"""

from __future__ import annotations

import json
import logging
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grain
import numpy as np

from workloads.dataset_cache import local_dataset
from workloads.manifest import load_manifest, records_identity
from workloads.shard_source import record_stacker, split_source


class _ChunkAdviceFilter(logging.Filter):
    """Drop grain's log line asking for `group_size:1` files: datasets of formats 3-5 hold
    several records per chunk on purpose, which measured 4x faster to read."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Grain requires group size 1" not in record.getMessage()


logging.getLogger("absl").addFilter(_ChunkAdviceFilter())


@dataclass(frozen=True)
class DatasetInfo:
    """What the model and the metrics need to know about a sharded dataset."""

    vocab_size: int
    eod_token: int
    seq_len: int
    bytes_per_token: float  # eval split: UTF-8 bytes of its text / its tokens (EOD included)
    train_records: int
    eval_records: int
    tokenizer: dict  # the manifest's entry: kind, vocab_size, eod_token (and path, sha256)


def dataset_info(dataset_dir: str | os.PathLike) -> DatasetInfo:
    """Summarise a dataset from its manifest.

    Raises:
        DatasetError: The manifest is missing or malformed.
    """
    m = load_manifest(local_dataset(dataset_dir))
    ev = m["splits"]["eval"]
    return DatasetInfo(
        vocab_size=m["tokenizer"]["vocab_size"],
        eod_token=m["tokenizer"]["eod_token"],
        seq_len=m["seq_len"],
        bytes_per_token=ev["bytes"] / ev["tokens"],
        train_records=m["splits"]["train"]["records"],
        eval_records=ev["records"],
        tokenizer=m["tokenizer"],
    )


def decode_records(
    raw: np.ndarray, eod_token: int, real_rows: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """Model inputs for a batch of packed records.

    Args:
        raw: Token ids, shape (batch, seq_len + 1).
        eod_token: The end-of-document id; the token after it starts a new segment.
        real_rows: Optional bool (batch,) mask; False rows are padding and get weight 0.

    Returns:
        int32 `inputs`, `targets`, `segment_ids` (1-based per record, the EOD belonging to
        the document it ends), `positions` (0-based within a segment) and float32 `weights`,
        each of shape (batch, seq_len).
    """
    tokens = np.asarray(raw).astype(np.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    batch, length = inputs.shape
    # A segment starts at position 0 and right after each EOD input.
    starts = np.zeros((batch, length), dtype=bool)
    starts[:, 0] = True
    starts[:, 1:] = inputs[:, :-1] == eod_token
    segment_ids = np.cumsum(starts, axis=1, dtype=np.int32)
    index = np.broadcast_to(np.arange(length, dtype=np.int32), (batch, length))
    segment_start = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    weights = np.ones((batch, length), dtype=np.float32)
    if real_rows is not None:
        weights *= np.asarray(real_rows, dtype=np.float32)[:, None]
    return {
        "inputs": np.ascontiguousarray(inputs),
        "targets": np.ascontiguousarray(targets),
        "segment_ids": segment_ids,
        "positions": (index - segment_start).astype(np.int32),
        "weights": weights,
    }


# What each train_iterator's position means: its global batch size, its seed and the
# identity of the records it reads (`records_identity`) (weakly held).
# States carry them beside grain's own keys, which grain's set_state must not see.
_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LAYOUT_KEYS = ("global_batch", "seed", "records")


def train_iterator(
    dataset_dir: str | os.PathLike,
    batch_size: int,
    seed: int,
    shard_index: int = 0,
    shard_count: int = 1,
    read_threads: int = 0,
) -> grain.DatasetIterator:
    """Endless iterator of this process's training batches.

    The global record stream (shuffled afresh each epoch from `seed`) is dealt round-robin
    over processes: process `shard_index` gets stream positions `i % shard_count ==
    shard_index`. Every process's n-th batch therefore comes from the same window of the
    global stream, and restoring a state resumes the same window even on another
    process count, as long as the global batch size is unchanged.

    Args:
        dataset_dir: A dataset directory written by `workloads.data.shard_dataset`.
        batch_size: Records per batch for this process.
        seed: Shuffle seed.
        shard_index: This process's index.
        shard_count: Number of processes reading the stream.
        read_threads: grain read threads; 0 reads in the calling thread (best on 2 cores).

    Returns:
        A grain iterator of `decode_records` dicts; see `iterator_state_to_json`.
    """
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index={shard_index} is not in [0, shard_count={shard_count})")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1")
    source, manifest = split_source(dataset_dir, "train")
    eod = manifest["tokenizer"]["eod_token"]
    ds = grain.MapDataset.source(source).seed(seed).shuffle().repeat()
    ds = ds[shard_index::shard_count]
    ds = ds.batch(batch_size, drop_remainder=True, batch_fn=record_stacker(manifest))
    ds = ds.map(lambda raw: decode_records(raw, eod))
    options = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=2 * read_threads)
    it = iter(ds.to_iter_dataset(options))
    _LAYOUTS[it] = {
        "global_batch": batch_size * shard_count,
        "seed": seed,
        "records": records_identity(manifest),
    }
    return it


def iterator_state_to_json(it: grain.DatasetIterator) -> dict:
    """The iterator's position as a JSON-ready dict (for orbax `JsonSave`): grain's state
    (a count of batches) with the global batch size and seed that give the count meaning.

    Raises:
        TypeError: grain returned a state JSON cannot represent.
    """
    # The round trip turns numpy scalars into ints and proves the state survives a save.
    state = json.loads(json.dumps(it.get_state(), default=_jsonable))
    return {**state, **_LAYOUTS.get(it, {})}


def restore_iterator_state(it: grain.DatasetIterator, state: dict) -> None:
    """Move a fresh iterator to a position saved by `iterator_state_to_json`.

    Raises:
        ValueError: `iterator_state_problem` names a problem.
    """
    if (problem := iterator_state_problem(it, state)) is not None:
        raise ValueError(f"iterator state {problem}")
    try:
        it.set_state({k: v for k, v in state.items() if k not in _LAYOUT_KEYS})
    except KeyError as exc:  # grain's own message is the bare key
        raise ValueError(f"iterator state with keys {sorted(state)} lacks {exc}") from None


def iterator_state_problem(it: grain.DatasetIterator, state: dict) -> str | None:
    """Why `state` cannot resume `it`, or None: it was saved with another global batch
    size or seed, where the same count of batches is another place in another stream, or
    over a dataset of other records (`records`: a checkpoint of a run over other data,
    copied into this run, resumed silently; a state saved before these were recorded is
    taken as it is), or it is not such a state at all (grain's own message was the bare
    missing key)."""
    return layout_problem(_LAYOUTS.get(it, {}), state)


def saved_layout(dataset_dir: str | os.PathLike, global_batch: int, seed: int) -> dict:
    """The layout (`_LAYOUT_KEYS`) a train iterator of this run records in its states:
    what a saved state is checked against without building the iterator (the
    orchestrator's verification of the final checkpoint)."""
    records = records_identity(load_manifest(local_dataset(dataset_dir)))
    return {"global_batch": global_batch, "seed": seed, "records": records}


def layout_problem(layout: dict, state: dict) -> str | None:
    """Why `state` cannot resume an iterator of `layout` (see `iterator_state_problem`)."""
    for key, value in layout.items():
        if key == "records" and key in state and state[key] != value:
            return (
                f"was saved over a dataset of other records (records={state[key]}; this run's "
                f"dataset is records={value}): it was trained on other data"
            )
        if key in state and state[key] != value:
            return (
                f"saved with {key}={state[key]} cannot resume an iterator with "
                f"{key}={value}: the batches it counts are not this iterator's"
            )
    if "next_index" not in state:
        keys = sorted(state)
        return f"with keys {keys} lacks 'next_index': not a state iterator_state_to_json saved"
    return None


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"iterator state holds {type(value).__name__}, which is not JSON")


def eval_batches(
    dataset_dir: str | os.PathLike, batch_size: int, max_batches: int
) -> Iterator[dict[str, np.ndarray]]:
    """The eval split in order, in batches of constant shape.

    The last partial batch is filled with all-EOD rows of weight 0, so every real record is
    scored once and nothing else is. A split smaller than `batch_size` is one batch of its
    records: padding it to an `eval.batch_size` far above the split's size (a user's "all of
    it in one batch") built, and scored, mostly padding.

    Args:
        dataset_dir: A dataset directory written by `workloads.data.shard_dataset`.
        batch_size: Records per batch.
        max_batches: Stop after this many batches.

    Yields:
        `decode_records` dicts of shape (batch_size, seq_len).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1")
    source, manifest = split_source(dataset_dir, "eval")
    eod, length = manifest["tokenizer"]["eod_token"], manifest["record"]["length"]
    stack = record_stacker(manifest)
    total = len(source)
    batch_size = min(batch_size, max(total, 1))
    for b, start in enumerate(range(0, total, batch_size)):
        if b >= max_batches:
            return
        stop = min(start + batch_size, total)
        raw = stack(source.__getitems__(list(range(start, stop))))
        real = np.arange(batch_size) < stop - start
        if stop - start < batch_size:
            pad = np.full((batch_size - (stop - start), length), eod, dtype=raw.dtype)
            raw = np.concatenate([raw, pad])
        yield decode_records(raw, eod, real_rows=real)
