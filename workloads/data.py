"""Turn a text corpus into fixed-length, byte-tokenised ArrayRecord shards.

Runs in the orchestrator. The output directory is named by a fingerprint of everything that
changes its bytes (the files' paths, sizes and mtimes, and the dataset options), so a rerun
with the same corpus finds the finished dataset and does no work. `manifest.json` is written
last and atomically: a directory without one is an interrupted run, never a dataset.

Layout of `{out_root}/{fingerprint}/`: `train-0000i-of-0000N.arrayrecord` (contiguous blocks of
records), `eval-00000-of-00001.arrayrecord` and `manifest.json`. Each record is `seq_len + 1`
little-endian uint16 token ids, consecutive records overlapping by one token so that every
token of a split's stream is a target exactly once.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

from workloads.config import BYTE_VOCAB_SIZE, EOD_TOKEN, DatasetConfig

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER = "bytes"
RECORD_DTYPE = np.dtype("<u2")  # vocab <= 65536; explicit byte order so shards are portable
WRITER_OPTIONS = "uncompressed,group_size:1"  # one record per chunk: cheap random access
TMP_PREFIX = ".tmp-"


class DatasetError(ValueError):
    """A source is missing or unreadable, or the corpus cannot fill the requested shards."""


@dataclass(frozen=True)
class SourceFile:
    """One input document, identified by what the fingerprint covers."""

    path: str
    size: int
    mtime_ns: int


@dataclass
class ShardResult:
    """Where the dataset is, its manifest, and whether it already existed."""

    dataset_dir: str
    manifest: dict
    cached: bool


def resolve_sources(sources: list[str]) -> list[SourceFile]:
    """Expand source entries into the sorted, de-duplicated list of files they name.

    Args:
        sources: Files, directories (all regular files below, recursively), globs
            (`**` allowed) or `"stdlib"` (every `*.py` of this Python's standard library,
            without `site-packages`).

    Returns:
        The files sorted by absolute path.

    Raises:
        DatasetError: A source matches no file, a file cannot be read, or nothing is left.
    """
    found: dict[str, SourceFile] = {}
    for source in sources:
        paths = _expand(source)
        if not paths:
            raise DatasetError(f"dataset source {source!r} matches no file")
        for path in paths:
            if not os.access(path, os.R_OK):
                raise DatasetError(f"dataset source {source!r}: file {path} is not readable")
            st = os.stat(path)
            found[path] = SourceFile(path, st.st_size, st.st_mtime_ns)
    if not found:
        raise DatasetError(f"dataset sources {sources!r} contain no files")
    return [found[p] for p in sorted(found)]


def _expand(source: str) -> list[str]:
    if source == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        return [p for p in _walk(root, skip_dirs={"site-packages"}) if p.endswith(".py")]
    if os.path.isdir(source):
        return _walk(source)
    if os.path.isfile(source):
        return [os.path.abspath(source)]
    paths: list[str] = []
    for match in sorted(glob.glob(source, recursive=True)):
        if os.path.isdir(match):
            paths.extend(_walk(match))
        elif os.path.isfile(match):  # sockets, fifos and dangling links are not documents
            paths.append(os.path.abspath(match))
    return paths


def _walk(root: str, skip_dirs: frozenset[str] | set[str] = frozenset()) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs)
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            if os.path.isfile(path):
                out.append(os.path.abspath(path))
    return out


def dataset_fingerprint(files: list[SourceFile], cfg: DatasetConfig) -> str:
    """First 16 hex digits of a sha256 over everything that changes the shards' bytes.

    Args:
        files: The resolved sources (identity = path, size and mtime, not content, so a
            cache hit costs one `stat` per file).
        cfg: Dataset options; `sources` itself is covered by the resolved files.

    Returns:
        The fingerprint, also the dataset's directory name.
    """
    payload = {
        "format_version": FORMAT_VERSION,
        "tokenizer": [TOKENIZER, BYTE_VOCAB_SIZE, EOD_TOKEN],
        "options": [cfg.seq_len, cfg.eval_fraction, cfg.num_shards, cfg.max_bytes],
        "files": [[f.path, f.size, f.mtime_ns] for f in files],
    }
    blob = json.dumps(payload, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _select(files: list[SourceFile], max_bytes: int | None) -> list[SourceFile]:
    """Whole documents in path order until the byte total reaches max_bytes (at least one)."""
    if max_bytes is None:
        return list(files)
    chosen, total = [], 0
    for f in files:
        if chosen and total >= max_bytes:
            break
        chosen.append(f)
        total += f.size
    return chosen


def _in_eval(path: str, eval_fraction: float) -> bool:
    # Hash of the path, not of the position: adding a file does not reshuffle the others.
    return int(hashlib.sha256(os.fsencode(path)).hexdigest()[:8], 16) / 2**32 < eval_fraction


def split_documents(
    files: list[SourceFile], cfg: DatasetConfig
) -> tuple[list[SourceFile], list[SourceFile]]:
    """Deterministic (train, eval) split by document, both non-empty.

    A document goes to eval when a hash of its path falls below `eval_fraction`; if that
    leaves a split empty, the last document of the other split moves over.

    Args:
        files: The documents, in path order.
        cfg: Supplies `eval_fraction` (and `sources`, for the error message).

    Returns:
        (train, eval) documents, each in path order.

    Raises:
        DatasetError: Fewer than two documents, so one split would be empty.
    """
    train = [f for f in files if not _in_eval(f.path, cfg.eval_fraction)]
    evals = [f for f in files if _in_eval(f.path, cfg.eval_fraction)]
    if len(files) < 2:
        raise DatasetError(
            f"dataset sources {cfg.sources!r} give {len(files)} document(s); with "
            f"eval_fraction={cfg.eval_fraction} train and eval each need at least one"
        )
    if not evals:
        evals.append(train.pop())
    elif not train:
        train.append(evals.pop())
    return train, evals


def _token_stream(files: list[SourceFile]) -> np.ndarray:
    """Each document's bytes followed by EOD, concatenated, as uint16 token ids."""
    blobs = []
    for f in files:
        try:
            with open(f.path, "rb") as fh:
                blob = fh.read()
        except OSError as exc:
            raise DatasetError(f"cannot read dataset file {f.path}: {exc}") from exc
        if len(blob) != f.size:
            # The fingerprint promised this size; shards of other bytes would lie about it.
            raise DatasetError(f"dataset file {f.path} changed while sharding; run again")
        blobs.append(blob)
    lengths = np.fromiter((len(b) for b in blobs), dtype=np.int64, count=len(blobs))
    stream = np.empty(int(lengths.sum()) + len(blobs), dtype=RECORD_DTYPE)
    eod_at = np.cumsum(lengths + 1) - 1
    is_byte = np.ones(len(stream), dtype=bool)
    is_byte[eod_at] = False
    stream[is_byte] = np.frombuffer(b"".join(blobs), dtype=np.uint8)
    stream[eod_at] = EOD_TOKEN
    return stream


def pack_records(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Cut a token stream into overlapping training records.

    Args:
        stream: 1-D token ids.
        seq_len: Tokens per training sequence.

    Returns:
        Shape (count, seq_len + 1): windows at stride seq_len, so each token after the first
        is a target exactly once; the incomplete tail window is dropped.
    """
    count = max(0, (len(stream) - 1) // seq_len)
    if count == 0:
        return np.empty((0, seq_len + 1), dtype=stream.dtype)
    windows = np.lib.stride_tricks.sliding_window_view(stream, seq_len + 1)
    return np.ascontiguousarray(windows[::seq_len][:count])


def _write_shard(directory: Path, name: str, records: np.ndarray) -> dict:
    tmp = directory / f"{TMP_PREFIX}{name}"
    writer = ArrayRecordWriter(str(tmp), WRITER_OPTIONS)
    try:
        for row in records:  # the writer takes one bytes object per record
            writer.write(row.tobytes())
    finally:
        writer.close()
    digest = _file_sha256(tmp, sync=True)
    os.replace(tmp, directory / name)
    return {"name": name, "records": len(records), "sha256": digest}


def _file_sha256(path: Path, sync: bool = False) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
        if sync:  # the rename must not be durable before the bytes it names
            os.fsync(fh.fileno())
    return digest.hexdigest()


def _write_manifest(directory: Path, manifest: dict) -> None:
    tmp = directory / f"{TMP_PREFIX}{MANIFEST}"
    with open(tmp, "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, directory / MANIFEST)


def load_manifest(dataset_dir: str | os.PathLike) -> dict:
    """Read and sanity-check a dataset's manifest.

    Raises:
        DatasetError: naming the directory, if the manifest is missing or malformed.
    """
    path = Path(dataset_dir) / MANIFEST
    if not path.is_file():
        raise DatasetError(f"incomplete dataset: no {MANIFEST} in {dataset_dir}")
    try:
        manifest = json.loads(path.read_text())
        if manifest["format_version"] != FORMAT_VERSION:
            raise ValueError(f"format_version {manifest['format_version']} != {FORMAT_VERSION}")
        for split in ("train", "eval"):
            for shard in manifest["splits"][split]["shards"]:
                _ = shard["name"], shard["records"], shard["sha256"]
        _ = manifest["seq_len"], manifest["tokenizer"]["eod_token"]
    except (ValueError, KeyError, TypeError) as exc:
        raise DatasetError(f"malformed {MANIFEST} in {dataset_dir}: {exc!r}") from exc
    return manifest


def verify_shards(dataset_dir: str | os.PathLike) -> None:
    """Check every shard's sha256 against the manifest.

    Raises:
        DatasetError: naming the first shard that is missing or differs.
    """
    manifest = load_manifest(dataset_dir)
    for split in ("train", "eval"):
        for shard in manifest["splits"][split]["shards"]:
            path = Path(dataset_dir) / shard["name"]
            try:
                digest = _file_sha256(path)
            except OSError as exc:
                raise DatasetError(f"dataset shard {path} is unreadable: {exc}") from exc
            if digest != shard["sha256"]:
                raise DatasetError(f"dataset shard {path} does not match its manifest sha256")


def shard_dataset(
    cfg: DatasetConfig,
    out_root: str | os.PathLike,
    progress: Callable[[int, int], None] | None = None,
) -> ShardResult:
    """Build (or find) the sharded dataset for `cfg` under `out_root/<fingerprint>/`.

    Args:
        cfg: Sources and packing options.
        out_root: Directory that holds one sub-directory per dataset fingerprint.
        progress: Called as `progress(records_written, records_total)` after each shard.

    Returns:
        The dataset directory, its manifest and whether it was already complete.

    Raises:
        DatasetError: Bad sources, or too little text for the requested shards.
    """
    files = resolve_sources(cfg.sources)
    fingerprint = dataset_fingerprint(files, cfg)
    directory = Path(out_root) / fingerprint
    if (directory / MANIFEST).is_file():
        try:
            return ShardResult(str(directory), load_manifest(directory), cached=True)
        except DatasetError:
            pass  # a corrupt manifest is rebuilt like a missing one
    directory.mkdir(parents=True, exist_ok=True)
    for leftover in directory.glob(f"{TMP_PREFIX}*"):  # from a run killed mid-write
        leftover.unlink()

    train_docs, eval_docs = split_documents(_select(files, cfg.max_bytes), cfg)
    plan = {"train": (train_docs, cfg.num_shards), "eval": (eval_docs, 1)}
    packed, streams = {}, {}
    for split, (docs, shards) in plan.items():
        streams[split] = _token_stream(docs)
        packed[split] = pack_records(streams[split], cfg.seq_len)
        if len(packed[split]) < shards:
            raise DatasetError(
                f"the {split} split has {len(packed[split])} record(s) of seq_len="
                f"{cfg.seq_len}, fewer than its {shards} shard(s) (num_shards="
                f"{cfg.num_shards}); add text, lower seq_len or lower num_shards"
            )

    total = sum(len(r) for r in packed.values())
    done = 0
    splits = {}
    for split, (docs, shards) in plan.items():
        records = packed[split]
        bounds = [len(records) * i // shards for i in range(shards + 1)]
        entries = []
        for i in range(shards):
            name = f"{split}-{i:05d}-of-{shards:05d}.arrayrecord"
            entries.append(_write_shard(directory, name, records[bounds[i] : bounds[i + 1]]))
            done += entries[-1]["records"]
            if progress is not None:
                progress(done, total)
        splits[split] = {
            "shards": entries,
            "records": len(records),
            "tokens": len(streams[split]),
            "bytes": len(streams[split]) - len(docs),
            "documents": len(docs),
        }
    manifest = {
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "tokenizer": {"kind": TOKENIZER, "vocab_size": BYTE_VOCAB_SIZE, "eod_token": EOD_TOKEN},
        "record": {"dtype": "uint16", "length": cfg.seq_len + 1},
        "seq_len": cfg.seq_len,
        "splits": splits,
        "sources": [{"path": f.path, "size": f.size, "mtime_ns": f.mtime_ns} for f in files],
        "options": cfg.model_dump(mode="json"),
    }
    _write_manifest(directory, manifest)
    return ShardResult(str(directory), manifest, cached=False)
