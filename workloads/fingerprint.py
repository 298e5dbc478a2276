"""The dataset fingerprint: which sources, tokenizer and options a dataset's bytes depend on.

`dataset_fingerprint` names a dataset's directory (`workloads.data`): a run that finds it
complete does no work. `byte_options` are the options recorded with it, in the manifest
too; `same_records` says whether a dataset an older version built under another
fingerprint holds the same records (a run over it resumes over the new one).
"""

from __future__ import annotations

import hashlib
import json
import os

from workloads.config import DatasetConfig
from workloads.documents import file_format
from workloads.manifest import FORMAT_VERSION, SAME_RECORDS_SINCE, load_manifest, records_fields
from workloads.sources import DatasetError, SourceFile
from workloads.tokens import TokenizerSpec, load_tokenizer


def byte_options(cfg: DatasetConfig, files: list[SourceFile]) -> dict:
    """The options that change the shards' bytes (what the fingerprint and manifest record).

    Options that have no effect on the formats `files` are read in are left out, so
    changing them does not miss the cache. Format "auto" is recorded as the one format its
    files resolve to when they agree (the same bytes as that format given outright), else
    as "auto".
    """
    keys = {"errors", "seq_len", "eval_fraction", "num_shards", "max_bytes"}
    out = cfg.model_dump(mode="json", include=keys | {"tokenizer"})
    used = {file_format(f.uri, cfg.format) for f in files} or {cfg.format}
    out["format"] = next(iter(used)) if len(used) == 1 else cfg.format
    if used & {"text", "auto"}:
        out["text_unit"] = cfg.text_unit
    if used - {"text"}:
        out["text_field"] = cfg.text_field
    return out


def dataset_fingerprint(
    files: list[SourceFile], cfg: DatasetConfig, tokenizer: TokenizerSpec
) -> str:
    """First 16 hex digits of a sha256 over everything that changes the shards' bytes.

    Args:
        files: The source files read (identity = URI, key, size and version, not content,
            so a cache hit costs one `stat` or listing per file).
        cfg: Dataset options; `sources` itself is covered by `files`, `tokenizer` by the
            tokenizer's content rather than its path.
        tokenizer: The loaded tokenizer.

    Returns:
        The fingerprint, also the dataset's directory name.
    """
    options = {k: v for k, v in byte_options(cfg, files).items() if k != "tokenizer"}
    payload = {
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer.fingerprint_entry(),
        "options": options,
        "files": [[f.uri, f.key, f.size, f.version] for f in files],
    }
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def same_records(
    dataset_dir: str | os.PathLike, cfg: DatasetConfig, files: list[SourceFile]
) -> bool:
    """Whether the dataset in `dataset_dir` (local or gs://) holds the records that `cfg`
    over `files` gives now, though its fingerprint differs: it was built from the same
    sources, tokenizer and options by an older version whose records hold the same ids in
    the same order (format `SAME_RECORDS_SINCE` or later; only their storage changed). A
    run that trained on it resumes exactly over the new dataset: its data-iterator state
    indexes the same records. False when the manifest cannot be read.
    """
    stored = _stored_fields(dataset_dir)
    if stored is None or stored[0] < SAME_RECORDS_SINCE:
        return False
    return stored[1] == _fields_now(cfg, files)


def times_only(dataset_dir: str | os.PathLike, cfg: DatasetConfig, files: list[SourceFile]) -> bool:
    """Whether the dataset in `dataset_dir` (local or gs://), built in this format, differs
    from what `cfg` over `files` gives now only by its sources' versions (modification times, GCS
    generations): the same files by name and size, the same tokenizer and options. A
    `touch`, a copy or a checkout that keeps every byte, or one that edits a file but not
    its size: only the new dataset's shards tell which (`same_shards`). Local files are
    compared by real path: the same directory named through a symlink is the same files
    (the fingerprint covers the paths as given, and such a rerun was refused, each file
    "added" and "removed"). False when the manifest cannot be read.
    """
    stored = _stored_fields(dataset_dir)
    if stored is None or stored[0] != FORMAT_VERSION:
        return False  # another format's shards differ whatever the sources hold

    def unversioned(fields: dict) -> dict:
        sources = [[_real(uri), *rest] for uri, *rest in fields["sources"]]
        return {**fields, "sources": [source[:3] for source in sources]}

    return unversioned(stored[1]) == unversioned(_fields_now(cfg, files))


def _real(uri: object) -> object:
    return os.path.realpath(uri) if isinstance(uri, str) and "://" not in uri else uri


def _stored_fields(dataset_dir: str | os.PathLike) -> tuple[int, dict] | None:
    """The format version and `records_fields` of the dataset's manifest, or None when it
    cannot be read."""
    try:
        m = load_manifest(dataset_dir)
        return m["format_version"], records_fields(m)
    except (DatasetError, OSError, KeyError, TypeError, AttributeError):
        return None


def _fields_now(cfg: DatasetConfig, files: list[SourceFile]) -> dict:
    """`records_fields` of the dataset `cfg` over `files` would give now."""
    options = {k: v for k, v in byte_options(cfg, files).items() if k != "tokenizer"}
    return {
        "sources": [[f.uri, f.key, f.size, f.version] for f in files],
        "tokenizer": load_tokenizer(cfg.tokenizer).fingerprint_entry(),
        "options": options,
    }


def same_shards(before: dict, after: dict) -> bool:
    """Whether two datasets' manifests list the same shards: names, record counts, sizes
    and sha256, split by split. Then they hold the same records, whatever their sources'
    versions say."""

    def shards(manifest: dict) -> list:
        return [
            [(s.get("name"), s.get("records"), s.get("bytes"), s.get("sha256")) for s in split]
            for split in (manifest["splits"][name]["shards"] for name in ("train", "eval"))
        ]

    try:
        return shards(before) == shards(after)
    except (KeyError, TypeError, AttributeError):
        return False
