"""Mesh, sharded train state and the pure, jitted train step.

`train_step(state, batch) -> (state, metrics)` has no I/O and no logging; the state is
donated so its buffers are reused in place. Non-finite values are checked by the caller,
outside jit, before anything is checkpointed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from workloads.config import MESH_AXES, MeshConfig, ModelConfig, TrainConfig
from workloads.model import BATCH_AXES, Transformer, token_losses

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "weights")


def make_mesh(mesh_cfg: MeshConfig, devices: list | None = None) -> jax.sharding.Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: every device of every process)."""
    shape = (mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor)
    devices = devices if devices is not None else jax.devices()
    if int(np.prod(shape)) != len(devices):
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, shape, strict=True))} needs {int(np.prod(shape))} "
            f"devices, found {len(devices)}"
        )
    return jax.make_mesh(
        shape,
        MESH_AXES,
        axis_types=(jax.sharding.AxisType.Auto,) * 3,
        devices=devices,
    )


class LRSchedule(NamedTuple):
    """Linear warmup to `peak`, then cosine decay to `end` over `decay` steps: arguments of
    the train step, not constants in it.

    Why: as constants (optax's schedules close over them), every run with another
    learning rate, warmup or length compiled its own step, which a persistent cache
    cannot share: each trial of a learning-rate sweep compiled the step again (minutes
    for a large model on TPU; 3-5 s of a tiny attempt's start here).
    """

    peak: float
    warmup: float
    decay: float  # steps from the warmup's end to the decay's
    end: float


def lr_hyper(cfg: TrainConfig) -> LRSchedule:
    """The run's schedule: warmup over `warmup_steps`, then decay to a tenth of the peak
    at `steps` (floats: the step is compiled for their type, never for their values)."""
    decay_steps = max(cfg.steps, cfg.warmup_steps + 1)
    return LRSchedule(
        peak=float(cfg.learning_rate),
        warmup=float(cfg.warmup_steps),
        decay=float(decay_steps - cfg.warmup_steps),
        end=float(cfg.learning_rate * 0.1),
    )


def lr_at(count: Any, lr: LRSchedule) -> jax.Array:
    """The learning rate after `count` updates (optax's `warmup_cosine_decay_schedule`,
    written over traced values)."""
    count = jnp.asarray(count, jnp.float32)
    warm = lr.peak * count / jnp.maximum(lr.warmup, 1.0)
    done = jnp.minimum(count - lr.warmup, lr.decay) / lr.decay
    cosine = lr.end + (lr.peak - lr.end) * 0.5 * (1 + jnp.cos(jnp.pi * done))
    return jnp.where(count < lr.warmup, warm, cosine)


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """The run's learning rate by update count, as the train step computes it."""
    lr = lr_hyper(cfg)
    return lambda count: lr_at(count, lr)


def scale_by_scheduled_lr() -> optax.GradientTransformationExtraArgs:
    """Scale updates by minus the learning rate of the `lr` argument (an `LRSchedule`) at
    the update count. Its state is optax's `scale_by_schedule`'s, so checkpoints keep
    the layout they had when the schedule was a constant."""

    def init(params: Any) -> optax.ScaleByScheduleState:
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None, *, lr: LRSchedule, **extra):
        del params, extra
        step_size = -lr_at(state.count, lr)
        updates = jax.tree.map(lambda g: step_size.astype(g.dtype) * g, updates)
        return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformationExtraArgs(init, update)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW after global-norm clipping (to `grad_clip_norm`, if set), its learning rate
    an argument of each update (`lr=lr_hyper(cfg)`); weight decay on matrices only, so
    the norms' scale vectors are not decayed. (The embedding's padding rows are: they get
    no gradient, so decay only shrinks them, and they are never looked up or predicted.)"""

    def decay_mask(params: Any) -> Any:
        # Weight decay on matrices only: decaying norm scales pulls them towards zero.
        return jax.tree.map(lambda p: p.ndim >= 2, params)

    # Without clipping, identity() keeps the optimizer state's structure (both states are
    # empty), so checkpoints have one layout whatever the setting.
    clip = (
        optax.identity()
        if cfg.grad_clip_norm is None
        else optax.clip_by_global_norm(cfg.grad_clip_norm)
    )
    # optax.adamw's own chain, with the learning rate scaled by an argument.
    adamw = optax.chain(
        optax.scale_by_adam(b1=0.9, b2=0.95),
        optax.add_decayed_weights(cfg.weight_decay, decay_mask),
        scale_by_scheduled_lr(),
    )
    return optax.chain(clip, adamw)


@dataclass
class TrainState:
    """The split model and optimizer: a static graph and the arrays the step updates."""

    graphdef: Any
    arrays: dict  # {"model": nnx.State, "opt": nnx.State}


def create_train_state(
    model_cfg: ModelConfig, train_cfg: TrainConfig, vocab_size: int, seed: int, mesh
) -> TrainState:
    """Initialise parameters and optimizer state directly on their shards."""
    with jax.set_mesh(mesh):
        model = Transformer(model_cfg, vocab_size, rngs=nnx.Rngs(params=seed))
        opt = nnx.Optimizer(model, make_optimizer(train_cfg), wrt=nnx.Param)
    model_def, model_state = nnx.split(model)
    opt_def, opt_state = nnx.split(opt)
    return TrainState(
        graphdef=(model_def, opt_def), arrays={"model": model_state, "opt": opt_state}
    )


def batch_sharding(mesh) -> NamedSharding:
    """Batches are split over data×fsdp along their leading axis."""
    return NamedSharding(mesh, P(BATCH_AXES, None))


def place_batch(local_batch: dict[str, np.ndarray], mesh) -> dict[str, jax.Array]:
    """Assemble this process's rows into global arrays laid out for the mesh."""
    sharding = batch_sharding(mesh)
    return {
        key: jax.make_array_from_process_local_data(sharding, local_batch[key])
        for key in BATCH_KEYS
    }


def make_train_step(graphdef: Any, mesh, lr: LRSchedule) -> Callable:
    """The jitted step: forward, backward, clip, AdamW update at the schedule `lr`. State
    is donated."""

    def loss_fn(model: Transformer, batch: dict) -> tuple[jax.Array, jax.Array]:
        nll, weights = token_losses(model, batch)
        tokens = weights.sum()
        return (nll * weights).sum() / jnp.maximum(tokens, 1.0), tokens

    def step(arrays: dict, batch: dict, lr: LRSchedule) -> tuple[dict, dict]:
        model = nnx.merge(graphdef[0], arrays["model"])
        opt = nnx.merge(graphdef[1], arrays["opt"])
        (loss, tokens), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        opt.update(model, grads, lr=lr)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "tokens": tokens}
        return {"model": nnx.state(model), "opt": nnx.state(opt)}, metrics

    jitted: dict[str, Callable] = {}

    def run(arrays: dict, batch: dict) -> tuple[dict, dict]:
        if not jitted:
            # The state leaves in the shardings it came in. Left to XLA, step 1's output
            # layouts differed from the initial state's, and step 2 compiled the step
            # again (6.5 s of the tiny model's 7, minutes on a real model), counted in
            # the step time, tokens/s and MFU of the first logged steps.
            shardings = jax.tree.map(lambda x: x.sharding, arrays)
            jitted["step"] = jax.jit(step, donate_argnums=(0,), out_shardings=(shardings, None))
        with jax.set_mesh(mesh):
            return jitted["step"](arrays, batch, lr)

    return run
