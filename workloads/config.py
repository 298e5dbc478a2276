"""The pipeline's configuration: plain data, validated before anything costs money.

`PipelineConfig` is both the flow's parameter (the Prefect UI renders its form from the
field descriptions) and, wrapped in `WorkloadConfig`, the file the workload reads on the
slice. Its validator runs the cross-field checks (workloads/config_checks.py), so that a
config that cannot train is rejected in the validate stage, before a slice is provisioned.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from workloads.config_checks import cross_field_problems
from workloads.config_infra import (  # noqa: F401  (re-exported: the config's one home)
    CostConfig,
    MetricsConfig,
    SliceConfig,
    StorageConfig,
    tpu_topology,
)
from workloads.config_resilience import ResilienceConfig
from workloads.config_types import Float, Int
from workloads.config_types import StrictModel as _Strict
from workloads.vocab import BYTE_VOCAB_SIZE, EOD_TOKEN  # noqa: F401 - re-exported

# The model's embedding table is padded to a multiple of this, so it shards evenly.
VOCAB_PAD_MULTIPLE = 128

# It ends in a letter or digit too: the run's TPU node id is `tpupipe-<run_name>`, and node
# ids follow RFC 1035 (`[a-z]([-a-z0-9]*[a-z0-9])?`), so `abc-` failed at the TPU API after
# the dataset was sharded and uploaded. A trailing dash is mostly an unset variable anyway.
_RUN_NAME = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
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
    errors: Literal["strict", "replace"] = Field(
        "strict",
        description="Invalid UTF-8 in a source: 'strict' fails naming the file and byte "
        "offset; 'replace' substitutes U+FFFD. Unset with sources [stdlib] alone: "
        "'replace' (4 of the standard library's test files are deliberately not UTF-8).",
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
    # exclude=True: the worker count never changes the shards' bytes, so it must not change
    # the training hash either (a rerun with more workers resumes the same run).
    workers: Int = Field(
        0,
        ge=0,
        le=256,
        exclude=True,
        description=(
            "Processes that shard, the calling one included (N starts N - 1 more); 0: one "
            "per CPU, or the calling process alone for under 32 MiB of sources. Does not "
            "change the bytes."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _stdlib_reads_with_replace(cls, data: Any) -> Any:
        # The default corpus must train as it is: the nightly deployment and a UI run with
        # no dataset given use it, and strict decoding refused its 4 non-UTF-8 test files.
        # A user's own corpus keeps strict decoding unless asked, and so does an explicit
        # `errors: strict`.
        stdlib_alone = isinstance(data, dict) and data.get("sources", ["stdlib"]) == ["stdlib"]
        if stdlib_alone and "errors" not in data:
            return {**data, "errors": "replace"}
        return data

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


# Named model sizes; fields given explicitly next to `size` override the preset. `small`
# and `base` use 128-wide heads: a TPU's matrix units are 128 wide (so 64-wide heads
# leave half of each unit idle in attention), and on CPU the attention products ran at
# twice the speed with 4 heads of 128 as with 8 of 64.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"d_model": 128, "n_layers": 2, "n_heads": 4, "d_ff": 512},  # ~0.4M params
    "small": {"d_model": 512, "n_layers": 4, "n_heads": 4, "d_ff": 2048},  # ~13M
    "base": {"d_model": 768, "n_layers": 12, "n_heads": 6, "d_ff": 3072},  # ~85M
}


class ModelConfig(_Strict):
    """Decoder-only transformer sizes."""

    size: Literal["tiny", "small", "base"] | None = Field(
        None,
        description="Named size (tiny, small, base) filling d_model, n_layers, n_heads and "
        "d_ff; any of those given explicitly overrides it. None: free-form.",
    )
    d_model: Int = Field(128, ge=8, description="Width of the residual stream.")
    n_layers: Int = Field(2, ge=1, description="Transformer blocks.")
    n_heads: Int = Field(4, ge=1, description="Attention heads (d_model must divide by it).")
    d_ff: Int = Field(512, ge=8, description="Hidden width of the MLP.")
    max_seq_len: Int = Field(
        1024, ge=8, lt=2**31, description="Longest sequence the model accepts (int32 positions)."
    )
    dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16", description="Compute dtype of activations and matmuls."
    )
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Dtype of the master parameters and optimizer state."
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_size(cls, data: Any) -> Any:
        size = data.get("size") if isinstance(data, dict) else None
        # isinstance first: `size: [a]` is unhashable here; the Literal field reports it.
        if isinstance(size, str) and size in MODEL_SIZES:
            return {**MODEL_SIZES[size], **data}
        return data


# Hyperparameters become float32 on the device: a larger value would be inf there.
FLOAT32_MAX = 3.4028234663852886e38


class TrainConfig(_Strict):
    """Optimisation and checkpointing."""

    steps: Int = Field(100, ge=1, description="Optimizer steps in the whole run.")
    batch_size: Int = Field(32, ge=1, description="Global batch size in sequences.")
    learning_rate: Float = Field(3e-3, gt=0, description="Peak AdamW learning rate.")
    warmup_steps: Int = Field(10, ge=0, description="Linear warmup steps before cosine decay.")
    weight_decay: Float = Field(0.1, ge=0, description="AdamW decoupled weight decay.")
    checkpoint_every: Int = Field(50, ge=1, description="Save a checkpoint every K steps.")
    keep_checkpoints: Int = Field(
        3,
        ge=1,
        description=(
            "How many recent checkpoints to keep. On local storage the oldest goes just "
            "before a new one is written (its memory is reused), so keep - 1 complete ones "
            "remain meanwhile; with 1, or on gs://, it goes once the new one is committed."
        ),
    )
    log_every: Int = Field(10, ge=1, description="Write step metrics every N steps.")
    max_lost_steps: Int | None = Field(
        None,
        ge=1,
        description=(
            "The most steps a hard kill (SIGKILL, a host lost) may cost, enforced: once "
            "training would pass it while a save is still being written, the loop waits "
            "for that save to commit. Default: checkpoint_every (a save overlaps one step). "
            "Larger lets slow saves (large states, remote storage) overlap more steps."
        ),
    )

    @field_validator("max_lost_steps")
    @classmethod
    def _covers_the_interval(cls, value: int | None, info: ValidationInfo) -> int | None:
        every = info.data.get("checkpoint_every")
        if value is not None and every is not None and value < every:
            raise ValueError(
                f"{value} is below train.checkpoint_every ({every}): the steps between "
                "two saves are lost to a kill just before the second"
            )
        return value

    @property
    def lost_steps_bound(self) -> int:
        """The most steps a hard kill may cost (max_lost_steps, or checkpoint_every)."""
        return self.max_lost_steps or self.checkpoint_every

    @field_validator("learning_rate", "weight_decay")
    @classmethod
    def _fits_float32(cls, value: float) -> float:
        if value >= FLOAT32_MAX:
            raise ValueError(f"{value:g} is inf in float32: use a value below 3.4e38")
        return value


class EvalConfig(_Strict):
    """Evaluation of the verified checkpoint on the held-out shards."""

    batch_size: Int = Field(16, ge=1, description="Sequences per evaluation batch.")
    max_batches: Int = Field(20, ge=1, description="Evaluate at most this many batches.")


class MeshConfig(_Strict):
    """Device mesh axes; their product must equal the slice's device count.

    One axis may be -1, meaning "the devices the other axes leave".
    """

    data: Int = Field(8, ge=-1, description="Data-parallel axis (replicated parameters).")
    fsdp: Int = Field(1, ge=-1, description="Fully-sharded data-parallel axis.")
    tensor: Int = Field(1, ge=-1, description="Tensor-parallel axis (attention heads, MLP).")

    @model_validator(mode="after")
    def _no_zero(self) -> MeshConfig:
        for axis in MESH_AXES:
            if getattr(self, axis) == 0:
                raise ValueError(f"mesh.{axis} = 0: an axis is a positive size or -1")
        return self


MESH_AXES = ("data", "fsdp", "tensor")


def resolve_mesh(mesh: MeshConfig, devices: int) -> tuple[MeshConfig, list[str]]:
    """Replace a -1 axis by the devices the others leave; problems name the fields."""
    rest = [a for a in MESH_AXES if getattr(mesh, a) == -1]
    if not rest:
        return mesh, []
    if len(rest) > 1:
        names = ", ".join(f"mesh.{a}" for a in rest)
        return mesh, [f"only one mesh axis may be -1, got {names}"]
    known = math.prod(getattr(mesh, a) for a in MESH_AXES if a != rest[0])
    if devices % known:
        return mesh, [
            f"mesh.{rest[0]} = -1: slice.devices = {devices} is not divisible by the other "
            f"axes' product {known}"
        ]
    return mesh.model_copy(update={rest[0]: devices // known}), []


class PipelineConfig(_Strict):
    """Everything one training run needs, validated before anything is provisioned."""

    run_name: str | None = Field(
        None,
        description="Name of the run; running again with the same name resumes it from its "
        "checkpoints. Lowercase letters, digits and dashes, not ending in a dash. Empty: a new "
        "name is generated.",
    )
    seed: Int = Field(
        0, ge=0, le=2**32 - 1, description="Seed for parameter init and data shuffling (uint32)."
    )
    dataset: DatasetConfig = Field(default_factory=DatasetConfig, description="Input corpus.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Model sizes.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training loop.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation.")
    mesh: MeshConfig = Field(default_factory=MeshConfig, description="Device mesh.")
    slice: SliceConfig = Field(default_factory=SliceConfig, description="Compute slice.")
    storage: StorageConfig = Field(default_factory=StorageConfig, description="Storage.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Metrics sink.")
    resilience: ResilienceConfig = Field(
        default_factory=ResilienceConfig, description="Retry budgets for preemptions and failures."
    )
    cost: CostConfig = Field(
        default_factory=CostConfig, description="How the cost ledger prices the run's chip-hours."
    )

    @field_validator("run_name")
    @classmethod
    def _run_name_shape(cls, value: str | None) -> str | None:
        if value == "":
            return None  # as documented (and as the planner reads it): a new name is generated
        if value is not None and not _RUN_NAME.match(value):
            raise ValueError(
                f"run_name {value!r} must be 1-63 lowercase letters, digits or dashes, "
                "starting and ending with a letter or digit (it names the TPU node "
                "tpupipe-<run_name>, which cannot end in a dash)"
            )
        return value

    # The mesh axis given as -1, before it was resolved: a sweep varying slice.devices
    # resolves it again per trial (`tasks.sweep_space.build_trials`).
    _mesh_fill: str | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _cross_field_checks(self) -> PipelineConfig:
        mesh, problems = resolve_mesh(self.mesh, self.slice.devices)
        if problems:
            raise ValueError("; ".join(problems))
        if mesh is not self.mesh:
            self._mesh_fill = next(a for a in MESH_AXES if getattr(self.mesh, a) == -1)
            self.mesh = mesh
        problems = cross_field_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def config_hash(self) -> str:
        """Hash of every field that changes the training math (not names or places)."""
        return training_hash(self)


def padded_vocab_size(vocab_size: int) -> int:
    """The embedding table's row count: vocab rounded up so it shards on any mesh axis."""
    return int(math.ceil(vocab_size / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE)


# Fields under the training sections that leave the trained bytes alone: how often to log
# and checkpoint (an attempt after a preemption may change them), shard-writing workers
# (the same bytes for any count), and the size name (the dimensions it filled are hashed).
_NOT_TRAINING = {
    "dataset": {"workers"},
    "model": {"size"},
    "train": {"checkpoint_every", "keep_checkpoints", "log_every", "max_lost_steps"},
}


def training_fields(cfg: PipelineConfig) -> dict:
    """The config fields that change the bytes of the trained parameters, as JSON."""
    return cfg.model_dump(
        include={"seed", "dataset", "model", "train"}, exclude=_NOT_TRAINING, mode="json"
    )


def training_hash(cfg: PipelineConfig) -> str:
    """sha256 over the fields that change the bytes of the trained parameters."""
    payload = training_fields(cfg)
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


class WorkloadConfig(_Strict):
    """The resolved, immutable `config.json` a training attempt reads from its run directory."""

    pipeline: PipelineConfig
    run_id: str = Field(description="Identity of the run (its directory name).")
    run_dir: str = Field(description="The run directory: checkpoints, status, metrics.")
    dataset_dir: str = Field(description="The sharded dataset (holds manifest.json).")
    compile_cache_dir: str | None = Field(None, description="JAX persistent compilation cache.")
    config_hash: str = Field(description="training_hash(pipeline) when the run was created.")
