"""Turn a corpus into fixed-length, tokenized ArrayRecord shards: the dataset entry point.

Runs in the orchestrator (the pipeline's shard task, or `tpupipe shard`). The output
directory `{out_root}/{fingerprint}/` is named by a hash of everything that changes its
bytes: each source file's URI, key, size and mtime (or GCS generation), the tokenizer file's
content and every byte-changing option. A run that finds that directory's manifest does no
work; that check is the cache (the shard task has no Prefect cache policy: see
`tasks/prepare.py`).

A run has three phases, each safe to kill:
    1. Tokenize: source files are grouped into units of consecutive files; this process
       and its workers (`workloads.shard_pool`) tokenize units into spill files under
       `.work/` (see `workloads.packing`). A later run reuses every unit a killed one
       finished.
    2. Write: they write `train-0000i-of-0000N.arrayrecord` (contiguous blocks of the
       train stream) and `eval-00000-of-00001.arrayrecord` under temporary names, each
       renamed once complete and hashed.
    3. Every shard is fsynced, then `manifest.json` is written last and atomically; then
       `.work/` is removed.
Output bytes depend on neither the worker count nor the unit size. A lock file (`.lock`)
serialises concurrent runs on the same directory; a run that fails on bad input removes the
directory (see `workloads.outdir`), one that is killed leaves it for the next to resume.
Sources are never read from inside `out_root` nor from a dataset directory, so a datasets
directory may sit in a source directory; `out_root` itself may not be a source directory.

Split: a document goes to eval when a hash of its key (its path relative to its source
root, plus `#n` for the n-th document of a JSONL, Parquet or line-per-document file) falls
below `eval_fraction`; if a split ends up empty, the last document of the other moves over.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from workloads.config import DatasetConfig
from workloads.documents import ReadOptions, lone_cr_hint
from workloads.fingerprint import byte_options, dataset_fingerprint, same_records
from workloads.listing import resolve_sources
from workloads.manifest import (
    DIGEST,
    FORMAT_VERSION,
    MANIFEST,
    SPLITS,
    TMP_PREFIX,
    load_manifest,
    missing_shards,
    shards_present,
    verify_shards,
    write_manifest,
)
from workloads.outdir import WORK_DIR, claimed, interrupted_builds
from workloads.packing import (
    UnitJob,
    finished_unit,
    record_sequences,
    tokenize_unit,
    write_errors,
    write_shard,
)
from workloads.shard_pool import worker_pool
from workloads.shard_source import counts_problem
from workloads.shard_stats import changed_shards, record_shard_stats
from workloads.sources import DatasetError, SourceFile, SourceStore, select_by_size
from workloads.splits import plan_splits, plan_units, split_entries
from workloads.tokens import TokenizerSpec, load_tokenizer

__all__ = [
    "MANIFEST",
    "DatasetError",
    "Progress",
    "ShardResult",
    "SourceFile",
    "dataset_fingerprint",
    "load_manifest",
    "load_tokenizer",
    "resolve_dataset",
    "resolve_sources",
    "same_records",
    "shard_dataset",
    "shards_present",
    "verify_shards",
]

log = logging.getLogger(__name__)
Progress = Callable[[str, int, int], None]  # (stage "tokenize" | "write", done, total)
# With workers=0 (auto), a smaller corpus is sharded in this process alone. In a fresh
# process the first worker is up only after 0.1-0.3 s (a forkserver starts and imports
# numpy first), and this process works meanwhile, so a second core pays from about here
# (fresh process, site-packages .py files, 2 cores, 1 vs 2 processes: 0.29-0.31 vs
# 0.35-0.39 s at 8 MB, 0.50 vs 0.45-0.54 s at 24 MB, 0.63-0.71 vs 0.59-0.60 s at 48 MB;
# before this process worked alongside its workers, 0.95 vs 0.97 s at 48 MB).
AUTO_PARALLEL_BYTES = 32 << 20


@dataclass
class ShardResult:
    """Where the dataset is, its manifest, and whether it already existed."""

    dataset_dir: str
    manifest: dict
    cached: bool


def shard_dataset(
    cfg: DatasetConfig,
    out_root: str | os.PathLike,
    progress: Progress | None = None,
    store: SourceStore | None = None,
    unit_bytes: int | None = None,
    owned: Mapping[str, str] | None = None,
) -> ShardResult:
    """Build (or find) the sharded dataset for `cfg` under `out_root/<fingerprint>/`.

    Args:
        cfg: Sources, format, tokenizer and packing options; `cfg.workers` processes,
            this one included (0: one per CPU, or this one alone for a corpus under
            `AUTO_PARALLEL_BYTES`). With more than one, a script calling this needs the
            `if __name__ == "__main__":` guard: workers start from a forkserver, which
            imports the main module.
        out_root: Local directory holding one sub-directory per dataset fingerprint.
        progress: Called as `progress(stage, done, total)`: stage "tokenize" counts source
            bytes, "write" counts records.
        store: Lists and opens `gs://` (any `scheme://`) sources.
        unit_bytes: Source bytes per unit of work (default: about 1/32 of the corpus,
            clamped to 1-256 MiB). Never changes the output bytes.
        owned: What walks of the sources leave out (`listing.resolve_sources`).

    Returns:
        The dataset directory, its manifest and whether it was already complete.

    Raises:
        DatasetError: Bad sources or input, naming the place; too little text for the
            requested shards; or an `out_root` that is not a writable directory.
    """
    tokenizer, files, fingerprint = resolve_dataset(cfg, out_root, store, owned)
    directory = Path(out_root) / fingerprint
    if (cached := _complete(directory, say=False)) is not None:
        return cached
    with claimed(directory):
        if (cached := _complete(directory)) is not None:  # another run finished meanwhile
            return cached
        for leftover in directory.glob(f"{TMP_PREFIX}*"):  # from a run killed mid-write
            leftover.unlink()
        work = directory / WORK_DIR
        work.mkdir(exist_ok=True)
        units = plan_units(files, cfg, tokenizer, str(work), store, unit_bytes)
        workers = min(_workers(cfg, files), max(len(units), cfg.num_shards + 1))
        with worker_pool(workers) as run:
            metas = _tokenize(units, run, progress)
            try:
                splits = plan_splits(units, metas, cfg, tokenizer, str(directory))
            except DatasetError as exc:  # too little text: a file of CR-ended lines may be why
                hint = lone_cr_hint(files, ReadOptions.of(cfg), store)
                raise DatasetError(f"{exc}{hint}") from None
            _write(splits, run, progress)
        manifest = _manifest(fingerprint, cfg, tokenizer, files, splits)
        with write_errors(directory / MANIFEST, "the manifest"):  # a full disk, say
            manifest = write_manifest(directory, manifest)  # sealed with its digest
        record_shard_stats(directory, manifest)
        shutil.rmtree(work, ignore_errors=True)
    if left := interrupted_builds(Path(out_root), directory):
        log.warning(
            "%d interrupted build(s) beside this dataset keep %.1f MB of finished work (%s): "
            "a run of their sources and options resumes them; if those changed, delete them",
            len(left),
            sum(left.values()) / 1e6,
            ", ".join(map(str, sorted(left))),
        )
    return ShardResult(str(directory), manifest, cached=False)


def resolve_dataset(
    cfg: DatasetConfig,
    out_root: str | os.PathLike,
    store: SourceStore | None = None,
    owned: Mapping[str, str] | None = None,
) -> tuple[TokenizerSpec, list[SourceFile], str]:
    """What `shard_dataset(cfg, out_root, store=store, owned=owned)` would shard now,
    without reading a source: the tokenizer, the source files and the dataset's fingerprint.

    Raises:
        DatasetError: from listing the sources or loading the tokenizer.
    """
    tokenizer = load_tokenizer(cfg.tokenizer)
    files = resolve_sources(cfg.sources, store, exclude=out_root, owned=owned)
    files = select_by_size(files, cfg.max_bytes)
    return tokenizer, files, dataset_fingerprint(files, cfg, tokenizer)


def _workers(cfg: DatasetConfig, files: list[SourceFile]) -> int:
    if cfg.workers:
        return cfg.workers
    if sum(f.size for f in files) < AUTO_PARALLEL_BYTES:
        return 1
    return os.cpu_count() or 1


def _complete(directory: Path, say: bool = True) -> ShardResult | None:
    """The dataset already complete in `directory`, or None if it must be (re)built; with
    `say`, a warning says why a dataset whose manifest exists is built again.

    Raises:
        DatasetError: the directory or its manifest cannot be read (say, another user's
            run made it with mode 700): this run can neither trust nor rebuild it.
    """
    try:
        if not (directory / MANIFEST).is_file():
            return None
        manifest = load_manifest(directory)
    except DatasetError as exc:  # a corrupt or edited manifest is rebuilt like a missing one
        if say:
            log.warning("%s; building %s again", exc, directory)
        return None
    except OSError as exc:  # is_file() answers False only for a missing path
        reason = exc.strerror or exc
        raise DatasetError(f"cannot read the dataset directory {directory}: {reason}") from None
    if missing := missing_shards(directory, manifest):  # deleted or truncated
        if say:
            log.warning(
                "dataset shard %s is missing or not the size its manifest records; building "
                "%s again",
                ", ".join(missing),
                directory,
            )
        return None
    if DIGEST not in manifest and (problem := counts_problem(directory, manifest)):
        if say:  # no digest to show an edit: the counts checked against the shards
            log.warning("%s; building %s again", problem, directory)
        return None
    changed = changed_shards(directory, manifest)
    if changed:  # replaced since the build (another build's shard): built again
        if say:
            log.warning(
                "dataset shard %s no longer matches its manifest's sha256; building %s again",
                ", ".join(changed),
                directory,
            )
        return None
    shutil.rmtree(directory / WORK_DIR, ignore_errors=True)  # killed after the manifest
    return ShardResult(str(directory), manifest, cached=True)


def _tokenize(units: list[UnitJob], run: Callable, progress: Progress | None) -> list[dict]:
    metas: list[dict | None] = [finished_unit(u) for u in units]
    total = sum(f.size for u in units for f in u.files)
    done = sum(f.size for u, m in zip(units, metas, strict=True) if m for f in u.files)
    if progress:
        progress("tokenize", done, total)
    todo = [u for u, m in zip(units, metas, strict=True) if m is None]
    for unit, meta in zip(todo, run(tokenize_unit, todo), strict=True):
        metas[unit.index] = meta
        done += sum(f.size for f in unit.files)
        if progress:
            progress("tokenize", done, total)
    return metas


def _write(splits: dict, run: Callable, progress: Progress | None) -> None:
    jobs = [job for split in SPLITS for job in splits[split]["jobs"]]
    total, done = sum(j.count for j in jobs), 0
    if progress:
        progress("write", 0, total)
    entries = {}
    for job, entry in zip(jobs, run(write_shard, jobs), strict=True):
        entries[job.name] = entry
        done += job.count
        if progress:
            progress("write", done, total)
    for split in SPLITS:
        splits[split]["shards"] = [entries[j.name] for j in splits[split]["jobs"]]


def _manifest(
    fingerprint: str,
    cfg: DatasetConfig,
    tokenizer: TokenizerSpec,
    files: list[SourceFile],
    splits: dict,
) -> dict:
    """The dataset's manifest, before `write_manifest` seals it with its digest."""
    return {
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "tokenizer": tokenizer.manifest_entry(),
        "record": {
            "dtype": tokenizer.dtype,
            "length": cfg.seq_len + 1,
            "byte_order": "little",
            "eod": tokenizer.stored_eod,
            "sequences": record_sequences(cfg.seq_len, tokenizer.dtype),
        },
        "seq_len": cfg.seq_len,
        "splits": split_entries(splits, cfg.seq_len),
        "sources": [
            {"uri": f.uri, "key": f.key, "size": f.size, "version": f.version} for f in files
        ],
        "options": byte_options(cfg, files),
    }
