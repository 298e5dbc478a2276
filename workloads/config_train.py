"""Config of the training loop and of evaluation: optimisation, checkpointing cadence and
how much of the held-out split is evaluated.

Part of `PipelineConfig` (workloads/config.py, which re-exports it); split out to keep each
file readable.
"""

from __future__ import annotations

from pydantic import Field, ValidationInfo, field_validator

from workloads.config_types import Float, Int
from workloads.config_types import StrictModel as _Strict

# optax counts steps in int32 (and stops counting at its maximum): the learning rate
# schedule of a longer run would stop where that count does.
MAX_STEPS = 2**31 - 1
# Hyperparameters become float32 on the device: a larger value would be inf there.
FLOAT32_MAX = 3.4028234663852886e38
# The smallest normal float32: below it a value is subnormal, which XLA flushes to zero on
# CPU and TPU. A positive learning rate or clip norm that small is 0 on the device, and the
# run trained on, landing "completed" with parameters no step had moved.
FLOAT32_TINY = 1.1754943508222875e-38


class TrainConfig(_Strict):
    """Optimisation and checkpointing."""

    steps: Int = Field(100, ge=1, le=MAX_STEPS, description="Optimizer steps in the whole run.")
    batch_size: Int = Field(32, ge=1, description="Global batch size in sequences.")
    learning_rate: Float = Field(3e-3, gt=0, description="Peak AdamW learning rate.")
    warmup_steps: Int = Field(
        10, ge=0, le=MAX_STEPS, description="Linear warmup steps before cosine decay."
    )
    weight_decay: Float = Field(0.1, ge=0, description="AdamW decoupled weight decay.")
    grad_clip_norm: Float | None = Field(
        1.0,
        gt=0,
        description=(
            "Scale the gradients down to this global L2 norm when it is larger, before the "
            "AdamW update; null: no clipping. Step metrics log the norm before clipping."
        ),
    )
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

    @field_validator("learning_rate", "weight_decay", "grad_clip_norm")
    @classmethod
    def _fits_float32(cls, value: float | None) -> float | None:
        if value is not None and value >= FLOAT32_MAX:
            raise ValueError(f"{value:g} is inf in float32: use a value below 3.4e38")
        if value is not None and 0 < value < FLOAT32_TINY:
            raise ValueError(f"{value:g} is 0 in float32: use 1.2e-38 or more")
        return value


class EvalConfig(_Strict):
    """Evaluation of the verified checkpoint on the held-out shards."""

    batch_size: Int = Field(16, ge=1, description="Sequences per evaluation batch.")
    max_batches: Int = Field(20, ge=1, description="Evaluate at most this many batches.")
