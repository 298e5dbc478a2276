"""Config of the input corpus: where it comes from, how it is read and cut into sequences.

Part of `PipelineConfig` (workloads/config.py, which re-exports it); split out to keep each
file readable.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from workloads.config_types import Float, Int
from workloads.config_types import StrictModel as _Strict

# URI schemes a dataset source may have (infra/storage.py reads them).
_SOURCE_SCHEMES = ("gs", "file")


class DatasetConfig(_Strict):
    """Where the corpus comes from, how it is read and how it is cut into training sequences.

    Every field except `workers` changes the shards' bytes, so it is part of the dataset
    fingerprint (see `workloads.data`).
    """

    sources: list[str] = Field(
        default_factory=lambda: ["stdlib"],
        description="Files, directories, globs or gs:// prefixes; 'stdlib' means the Python "
        "standard library's own .py sources (no download needed).",
        min_length=1,
    )
    format: Literal["auto", "text", "jsonl", "parquet"] = Field(
        "auto",
        description="How source files hold documents: 'text' (see text_unit), 'jsonl' (one "
        "JSON object per line, text in text_field), 'parquet' (text in column text_field), "
        "or 'auto': each file by its name (.jsonl, .ndjson, also compressed: jsonl; "
        ".parquet, .pq: parquet; any other: text). Text and JSONL files may be gzip, zstd, "
        "bzip2 or xz compressed (detected from the content).",
    )
    text_unit: Literal["file", "line"] = Field(
        "file",
        description="For text files: each file is one document ('file'), or each "
        "non-blank line is one ('line').",
    )
    text_field: str = Field(
        "text",
        min_length=1,
        description="The JSON field (jsonl) or column (parquet) holding each document's text; "
        "a dotted name such as meta.text reaches into nested objects or struct columns.",
    )
    tokenizer: str | None = Field(
        None,
        description="Path to a Hugging Face tokenizers JSON file (tokenizer.json), read from "
        "disk, never downloaded; null: byte-level tokens.",
    )
    errors: Literal["strict", "replace"] | None = Field(
        None,
        description="Invalid UTF-8 in a source: 'strict' fails naming the file and byte "
        "offset; 'replace' substitutes U+FFFD. Empty: 'replace' with sources [stdlib] alone "
        "(4 of the standard library's test files are deliberately not UTF-8), else 'strict'.",
    )
    seq_len: Int = Field(128, ge=8, le=32768, description="Tokens per training sequence.")
    eval_fraction: Float = Field(
        0.02, gt=0.0, lt=0.5, description="Fraction of documents held out for evaluation."
    )
    num_shards: Int = Field(4, ge=1, le=4096, description="ArrayRecord shards for the train split.")
    max_bytes: Int | None = Field(
        None,
        ge=1,
        description="Use whole source files, in order, until their sizes reach this many "
        "bytes (None: all files).",
    )
    # The worker count never changes the shards' bytes, so it is no training field either
    # (`config._NOT_TRAINING`: a rerun with more workers resumes the same run). It is in the
    # config's dump: left out (`exclude=True`), a sweep whose base set it failed with a
    # KeyError, and a deployment's trials, sent their config as JSON, lost it.
    workers: Int = Field(
        0,
        ge=0,
        le=256,
        description=(
            "Processes that shard, the calling one included (N starts N - 1 more); 0: one "
            "per CPU, or the calling process alone for under 32 MiB of sources. Does not "
            "change the bytes."
        ),
    )

    FILLED_IN = ("errors",)

    @classmethod
    def filled_in(cls, data: dict) -> dict[str, Any]:
        """`errors: replace` for the stdlib corpus alone, `strict` for any other.

        The default corpus must train as it is: the nightly deployment and a UI run with
        no dataset given use it, and strict decoding refused its 4 non-UTF-8 test files.
        A user's own corpus keeps strict decoding unless asked, and so does an explicit
        `errors: strict`.
        """
        stdlib = data.get("sources", ["stdlib"]) == ["stdlib"]
        return {"errors": "replace" if stdlib else "strict"}

    @field_validator("sources")
    @classmethod
    def _sources_name_something(cls, value: list[str]) -> list[str]:
        # An empty entry (an unset variable: --source "$CORPUS") is not "no path": globbing
        # reads it as the current directory, which would then be sharded.
        for n, entry in enumerate(value, start=1):
            if not entry.strip():
                raise ValueError(
                    f"source {n} is {entry!r}, which names nothing; give a file, directory, "
                    "glob, gs:// prefix or 'stdlib'"
                )
            # Checked here, not only when the sources are listed: `tpupipe validate` does
            # not list remote sources, so it called a source the run then refused valid.
            scheme = entry.split("://", 1)[0] if "://" in entry else None
            if scheme is not None and scheme not in _SOURCE_SCHEMES:
                raise ValueError(
                    f"source {n} {entry!r}: {scheme}:// is not supported; give a local path, "
                    "file:// or gs://bucket/prefix"
                )
            if scheme == "gs" and not entry[5:].split("/", 1)[0]:
                raise ValueError(f"source {n} {entry!r} names no bucket (gs://bucket/prefix)")
        return value

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_is_a_file(cls, value: str | None) -> str | None:
        if value is not None and ("://" in value or not value.strip()):
            raise ValueError(
                f"tokenizer {value!r} must be the local path of a tokenizer.json file "
                "(tokenizers are never downloaded)"
            )
        return value

    @model_validator(mode="after")
    def _text_unit_needs_text(self) -> DatasetConfig:
        if self.text_unit == "line" and self.format not in ("text", "auto"):
            raise ValueError(
                f"dataset.text_unit = 'line' applies to dataset.format = 'text', "
                f"not {self.format!r}"
            )
        return self
