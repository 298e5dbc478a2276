"""The pipeline's configuration: plain data, validated before anything costs money.

`PipelineConfig` is both the flow's parameter (the Prefect UI renders its form from the
field descriptions) and, wrapped in `WorkloadConfig`, the file the workload reads on the
slice. Cross-field checks live here so that a config that cannot train is rejected in the
validate stage, before a slice is provisioned.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Byte-level tokens 0..255 plus one end-of-document token.
BYTE_VOCAB_SIZE = 257
EOD_TOKEN = 256
# The model's embedding table is padded to a multiple of this, so it shards evenly.
VOCAB_PAD_MULTIPLE = 128

_RUN_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


class _Strict(BaseModel):
    # Unknown keys are errors: a typo in a YAML file must not be silently ignored.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DatasetConfig(_Strict):
    """Where the corpus comes from and how it is cut into training sequences."""

    sources: list[str] = Field(
        default_factory=lambda: ["stdlib"],
        description="Files, directories or globs of text; 'stdlib' means the Python "
        "standard library's own .py sources (no download needed).",
        min_length=1,
    )
    seq_len: int = Field(128, ge=8, le=32768, description="Tokens per training sequence.")
    eval_fraction: float = Field(
        0.02, gt=0.0, lt=0.5, description="Fraction of documents held out for evaluation."
    )
    num_shards: int = Field(4, ge=1, le=4096, description="ArrayRecord shards for the train split.")
    max_bytes: int | None = Field(
        None, ge=1, description="Stop reading sources after this many bytes (None: read all)."
    )


class ModelConfig(_Strict):
    """Decoder-only transformer sizes."""

    d_model: int = Field(128, ge=8, description="Width of the residual stream.")
    n_layers: int = Field(2, ge=1, description="Transformer blocks.")
    n_heads: int = Field(4, ge=1, description="Attention heads (d_model must divide by it).")
    d_ff: int = Field(512, ge=8, description="Hidden width of the MLP.")
    max_seq_len: int = Field(1024, ge=8, description="Longest sequence the model accepts.")
    dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16", description="Compute dtype of activations and matmuls."
    )
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Dtype of the master parameters and optimizer state."
    )


class TrainConfig(_Strict):
    """Optimisation and checkpointing."""

    steps: int = Field(100, ge=1, description="Optimizer steps in the whole run.")
    batch_size: int = Field(32, ge=1, description="Global batch size in sequences.")
    learning_rate: float = Field(3e-3, gt=0, description="Peak AdamW learning rate.")
    warmup_steps: int = Field(10, ge=0, description="Linear warmup steps before cosine decay.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW decoupled weight decay.")
    checkpoint_every: int = Field(50, ge=1, description="Save a checkpoint every K steps.")
    keep_checkpoints: int = Field(3, ge=1, description="How many recent checkpoints to keep.")
    log_every: int = Field(10, ge=1, description="Write step metrics every N steps.")


class EvalConfig(_Strict):
    """Evaluation of the verified checkpoint on the held-out shards."""

    batch_size: int = Field(16, ge=1, description="Sequences per evaluation batch.")
    max_batches: int = Field(20, ge=1, description="Evaluate at most this many batches.")


class MeshConfig(_Strict):
    """Device mesh axes; their product must equal the slice's device count."""

    data: int = Field(8, ge=1, description="Data-parallel axis (replicated parameters).")
    fsdp: int = Field(1, ge=1, description="Fully-sharded data-parallel axis.")
    tensor: int = Field(1, ge=1, description="Tensor-parallel axis (heads, MLP, vocab).")


class SliceConfig(_Strict):
    """Where the workload runs."""

    provider: Literal["local"] = Field(
        "local", description="'local': the workload as processes over virtual CPU devices."
    )
    devices: int = Field(8, ge=1, le=256, description="Devices in the slice.")
    hosts: int = Field(
        1, ge=1, le=64, description="Hosts (one JAX process each) the devices are spread over."
    )
    poll_interval_s: float = Field(1.0, gt=0, description="Seconds between slice state checks.")
    heartbeat_timeout_s: float = Field(
        600.0, gt=0, description="A running workload silent this long is treated as failed."
    )


class StorageConfig(_Strict):
    """Where datasets, run directories and checkpoints live."""

    root: str = Field(".tpupipe", description="Storage root: a local directory.")


class MetricsConfig(_Strict):
    """Where metrics land."""

    sink: Literal["duckdb"] = Field("duckdb", description="'duckdb': a DuckDB file.")
    path: str | None = Field(
        None, description="DuckDB file (default: metrics.duckdb under the storage root)."
    )


class PipelineConfig(_Strict):
    """Everything one training run needs, validated before anything is provisioned."""

    run_name: str | None = Field(
        None,
        description="Name of the run; running again with the same name resumes it from its "
        "checkpoints. Lowercase letters, digits and dashes. Empty: a new name is generated.",
    )
    seed: int = Field(0, description="Seed for parameter init and data shuffling.")
    dataset: DatasetConfig = Field(default_factory=DatasetConfig, description="Input corpus.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Model sizes.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training loop.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation.")
    mesh: MeshConfig = Field(default_factory=MeshConfig, description="Device mesh.")
    slice: SliceConfig = Field(default_factory=SliceConfig, description="Compute slice.")
    storage: StorageConfig = Field(default_factory=StorageConfig, description="Storage.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Metrics sink.")

    @field_validator("run_name")
    @classmethod
    def _run_name_shape(cls, value: str | None) -> str | None:
        if value is not None and not _RUN_NAME.match(value):
            raise ValueError(
                f"run_name {value!r} must be 1-63 lowercase letters, digits or dashes, "
                "starting with a letter or digit"
            )
        return value

    @model_validator(mode="after")
    def _cross_field_checks(self) -> PipelineConfig:
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


def cross_field_problems(cfg: PipelineConfig) -> list[str]:
    """Every inconsistency between fields, each message naming the fields involved."""
    m, mesh, t = cfg.model, cfg.mesh, cfg.train
    problems: list[str] = []
    mesh_size = mesh.data * mesh.fsdp * mesh.tensor
    if mesh_size != cfg.slice.devices:
        problems.append(
            f"mesh.data*mesh.fsdp*mesh.tensor = {mesh.data}*{mesh.fsdp}*{mesh.tensor} = "
            f"{mesh_size} does not equal slice.devices = {cfg.slice.devices}"
        )
    dp = mesh.data * mesh.fsdp
    if t.batch_size % dp:
        problems.append(
            f"train.batch_size = {t.batch_size} is not divisible by the data-parallel size "
            f"mesh.data*mesh.fsdp = {dp}"
        )
    if m.d_model % m.n_heads:
        problems.append(
            f"model.d_model = {m.d_model} is not divisible by model.n_heads = {m.n_heads}"
        )
    elif (m.d_model // m.n_heads) % 2:
        problems.append(
            f"model.d_model/model.n_heads = {m.d_model // m.n_heads} must be even (rotary)"
        )
    if m.n_heads % mesh.tensor:
        problems.append(
            f"model.n_heads = {m.n_heads} is not divisible by mesh.tensor = {mesh.tensor}"
        )
    for name in ("d_model", "d_ff"):
        value = getattr(m, name)
        for axis in ("fsdp", "tensor"):
            size = getattr(mesh, axis)
            if name == "d_model" and axis == "tensor":
                continue  # d_model is never split over the tensor axis
            if value % size:
                problems.append(
                    f"model.{name} = {value} is not divisible by mesh.{axis} = {size}"
                )
    if cfg.dataset.seq_len > m.max_seq_len:
        problems.append(
            f"dataset.seq_len = {cfg.dataset.seq_len} exceeds model.max_seq_len = {m.max_seq_len}"
        )
    if t.warmup_steps >= t.steps and t.steps > 1:
        problems.append(
            f"train.warmup_steps = {t.warmup_steps} must be below train.steps = {t.steps}"
        )
    return problems


def training_hash(cfg: PipelineConfig) -> str:
    """sha256 over the fields that change the bytes of the trained parameters."""
    payload = cfg.model_dump(include={"seed", "dataset", "model", "train"}, mode="json")
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
