"""Cross-field checks of a `PipelineConfig`: a config whose fields are each fine but that
cannot train together is rejected before anything is provisioned.

Every problem is one sentence naming its fields as dotted paths (`train.batch_size = 30`),
so `workloads.config_file` can point each at a file line or a `--set`. A problem never
contains "; ": the model validator joins several problems with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workloads.config import PipelineConfig

# Which mesh axes each model dimension is split over, as declared by the partitioning in
# workloads/model.py: the embedding and every kernel split d_model over `fsdp`; only the
# MLP kernels' d_ff side is split, over `tensor` (up: (fsdp, tensor), down: (tensor, fsdp)).
# Attention's `tensor` side is 3*d_model or d_model, whole heads, covered by the
# n_heads % mesh.tensor check. A dimension not split over an axis needs no divisibility.
SHARDED_DIMS: dict[str, tuple[str, ...]] = {"d_model": ("fsdp",), "d_ff": ("tensor",)}


def cross_field_problems(cfg: PipelineConfig) -> list[str]:
    """Every inconsistency between fields, each message naming the fields involved.

    Args:
        cfg: a config whose fields are each valid, with its mesh's -1 axis resolved.

    Returns:
        One message per problem; empty if the config can train.
    """
    return [*_mesh_problems(cfg), *_model_problems(cfg), *_run_problems(cfg)]


def _mesh_problems(cfg: PipelineConfig) -> list[str]:
    mesh, t, hosts = cfg.mesh, cfg.train, cfg.slice.hosts
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
    if cfg.slice.devices % hosts:
        problems.append(
            f"slice.devices = {cfg.slice.devices} is not divisible by slice.hosts = {hosts}"
        )
    elif dp % hosts:
        problems.append(
            f"mesh.data*mesh.fsdp = {dp} is not divisible by slice.hosts = {hosts}: each host "
            "feeds its own rows of the batch"
        )
    return problems


def _model_problems(cfg: PipelineConfig) -> list[str]:
    m, mesh = cfg.model, cfg.mesh
    problems: list[str] = []
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
    for name, axes in SHARDED_DIMS.items():
        value = getattr(m, name)
        for axis in axes:
            size = getattr(mesh, axis)
            if value % size:
                problems.append(f"model.{name} = {value} is not divisible by mesh.{axis} = {size}")
    if cfg.dataset.seq_len > m.max_seq_len:
        problems.append(
            f"dataset.seq_len = {cfg.dataset.seq_len} exceeds model.max_seq_len = {m.max_seq_len}"
        )
    return problems


def _run_problems(cfg: PipelineConfig) -> list[str]:
    t = cfg.train
    problems: list[str] = []
    # Also for steps == 1: the schedule has no step left to decay over after the warmup.
    if t.warmup_steps >= t.steps:
        problems.append(
            f"train.warmup_steps = {t.warmup_steps} must be below train.steps = {t.steps}"
        )
    if cfg.slice.provider == "gcp":
        for name, actual in (("priced_as", "accelerator_type"), ("capacity", "capacity")):
            if getattr(cfg.cost, name):
                problems.append(
                    f"cost.{name} = {getattr(cfg.cost, name)!r} is for local slices (a gcp "
                    f"slice is priced at slice.{actual} = {getattr(cfg.slice, actual)!r})"
                )
    return problems
