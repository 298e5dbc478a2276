"""Config of the model and how it is laid out: its sizes, its padded vocabulary, and the
device mesh it is sharded over.

Part of `PipelineConfig` (workloads/config.py, which re-exports it); split out to keep each
file readable.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, model_validator

from workloads.config_types import Int
from workloads.config_types import StrictModel as _Strict

# The model's embedding table is padded to a multiple of this, so it shards evenly.
VOCAB_PAD_MULTIPLE = 128

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
        "d_ff where those are empty; any of them given overrides it. None: tiny's dimensions "
        "fill the empty ones.",
    )
    # None (empty in the UI's form): filled in from `size` (`filled_in`); never None once
    # validated.
    d_model: Int | None = Field(None, ge=8, description="Width of the residual stream.")
    n_layers: Int | None = Field(None, ge=1, description="Transformer blocks.")
    n_heads: Int | None = Field(
        None, ge=1, description="Attention heads (d_model must divide by it)."
    )
    d_ff: Int | None = Field(None, ge=8, description="Hidden width of the MLP.")
    max_seq_len: Int = Field(
        1024, ge=8, lt=2**31, description="Longest sequence the model accepts (int32 positions)."
    )
    dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16", description="Compute dtype of activations and matmuls."
    )
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Dtype of the master parameters and optimizer state."
    )

    FILLED_IN = ("d_model", "n_layers", "n_heads", "d_ff")

    @classmethod
    def filled_in(cls, data: dict) -> dict[str, Any]:
        """The named size's dimensions; tiny's without a size (or with one the `size`
        field refuses)."""
        size = data.get("size")
        # isinstance first: `size: [a]` is unhashable here; the Literal field reports it.
        named = isinstance(size, str) and size in MODEL_SIZES
        return dict(MODEL_SIZES[size if named else "tiny"])


def padded_vocab_size(vocab_size: int) -> int:
    """The embedding table's row count: vocab rounded up so it shards on any mesh axis."""
    return int(math.ceil(vocab_size / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE)


def layer_matmul_params(cfg: ModelConfig) -> int:
    """Parameters of one block's projections in workloads/model.py: QKV (d_model x
    3*d_model), attention output (d_model x d_model), MLP up and down (d_model x d_ff each).
    The FLOP count (`workloads.perf`) and the memory check (`workloads.config_memory`)
    both start from it."""
    return 4 * cfg.d_model * cfg.d_model + 2 * cfg.d_model * cfg.d_ff


def param_count(cfg: ModelConfig, vocab_size: int) -> int:
    """Scalar parameters of `workloads.model.Transformer` (what `count_params` finds on the
    built model), from the config alone: the tied embedding of the padded vocabulary, every
    block's projections and two norm scales, and the final norm's scale."""
    embedding = padded_vocab_size(vocab_size) * cfg.d_model
    norms = (2 * cfg.n_layers + 1) * cfg.d_model
    return embedding + cfg.n_layers * layer_matmul_params(cfg) + norms


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
