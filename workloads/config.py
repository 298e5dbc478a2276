"""The pipeline's configuration: plain data, validated before anything costs money.

`PipelineConfig` is both the flow's parameter (the Prefect UI renders its form from the
field descriptions) and, wrapped in `WorkloadConfig`, the file the workload reads on the
slice. Its validator runs the cross-field checks (workloads/config_checks.py), so that a
config that cannot train is rejected in the validate stage, before a slice is provisioned.

Its sections live beside it and are re-exported here, the config's one home: the dataset
(workloads/config_dataset.py), the model and mesh (workloads/config_model.py), the training
loop and evaluation (workloads/config_train.py), the slice, storage, metrics and cost
(workloads/config_infra.py) and the retry budgets (workloads/config_resilience.py).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator

from workloads.config_checks import cross_field_problems
from workloads.config_dataset import DatasetConfig
from workloads.config_infra import (  # noqa: F401  (re-exported: the config's one home)
    CostConfig,
    MetricsConfig,
    SliceConfig,
    StorageConfig,
    tpu_topology,
)
from workloads.config_model import (  # noqa: F401  (re-exported: the config's one home)
    MESH_AXES,
    MODEL_SIZES,
    VOCAB_PAD_MULTIPLE,
    MeshConfig,
    ModelConfig,
    layer_matmul_params,
    padded_vocab_size,
    param_count,
    resolve_mesh,
)
from workloads.config_resilience import ResilienceConfig
from workloads.config_train import (  # noqa: F401  (re-exported: the config's one home)
    FLOAT32_MAX,
    EvalConfig,
    TrainConfig,
)
from workloads.config_types import Int
from workloads.config_types import StrictModel as _Strict
from workloads.vocab import BYTE_VOCAB_SIZE, EOD_TOKEN  # noqa: F401 - re-exported

# It ends in a letter or digit too: the run's TPU node id is `tpupipe-<run_name>`, and node
# ids follow RFC 1035 (`[a-z]([-a-z0-9]*[a-z0-9])?`), so `abc-` failed at the TPU API after
# the dataset was sharded and uploaded. A trailing dash is mostly an unset variable anyway.
_RUN_NAME = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")


def valid_run_name(value: str) -> bool:
    """Whether `value` may name a run (`PipelineConfig.run_name`)."""
    return bool(_RUN_NAME.fullmatch(value))


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
        if value is not None and not valid_run_name(value):
            raise ValueError(
                f"run_name {value!r} must be 1-63 lowercase letters, digits or dashes, "
                "starting and ending with a letter or digit (it names the TPU node "
                "tpupipe-<run_name>, which cannot end in a dash)"
            )
        return value

    # The mesh axis given as -1, before it was resolved: a sweep varying slice.devices
    # resolves it again per trial (`tasks.sweep_trials.build_trials`).
    _mesh_fill: str | None = PrivateAttr(None)

    def without_fill_ins(self) -> dict[str, Any]:
        """The config less what fills in again by itself (JSON values): every field that
        holds what its section fills in from its other fields, or its default where the
        section fills in nothing; the mesh axis given as -1 as -1. What a sweep's trial
        starts from, its overrides set on it.

        Why: validated, `model.size: tiny` has filled in tiny's dimensions, and a trial of
        `model.size: small` built on that dump kept them: every trial of a size sweep
        trained the tiny model. So did a TPU type's devices (a sweep over
        `slice.accelerator_type` was refused) and the stdlib corpus's `errors: replace` (a
        trial over the user's own corpus decoded it leniently). Left out, they fill in again
        from the trial's own values. By value, not by what a file gave: a base changed in
        Python (`base.train.grad_clip_norm = 0.5`) or a deployment's full JSON parameter
        keeps every value it set.
        """
        data = _without_fill_ins(self, self.model_dump(mode="json"))
        if self._mesh_fill is not None:
            data["mesh"][self._mesh_fill] = -1
        return data

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


def _without_fill_ins(model: BaseModel, dumped: dict) -> dict:
    """`dumped` (model's JSON dump) less the fields that fill in again by themselves (see
    `PipelineConfig.without_fill_ins`), every section kept (as {} when nothing of it is left),
    so a dotted override finds it."""
    filled = model.filled_in(dumped) if isinstance(model, _Strict) else {}
    out = {}
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            out[name] = _without_fill_ins(value, dumped[name])
        elif name in filled:
            if filled[name] != dumped[name]:
                out[name] = dumped[name]  # given otherwise: it stays
        elif field.is_required() or value != field.get_default(call_default_factory=True):
            out[name] = dumped[name]
    return out


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
