"""A decoder-only transformer in Flax NNX, annotated for a (data, fsdp, tensor) mesh.

Parameters carry their partitioning as metadata (`nnx.with_partitioning`), so building the
model under `jax.set_mesh(mesh)` places every array on its shards at creation: the full
unsharded model never exists on one device. Activations are constrained to split the batch
over `data`×`fsdp`. Compute runs in `ModelConfig.dtype` (bf16 by default) on float32 master
parameters; logits and the loss are float32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from workloads.config import ModelConfig, padded_vocab_size

BATCH_AXES = ("data", "fsdp")
_init = nnx.initializers.normal(stddev=0.02)


class Dense(nnx.Linear):
    """A bias-free projection applied to the tokens flattened into one matrix.

    `x @ kernel` over [batch, seq, d] makes the gradients contract two axes at once, which
    XLA:CPU lowers with full transposes of the activations: flattening to [batch*seq, d]
    keeps every product a plain matrix multiply (the step got ~30% faster on CPU), and
    costs nothing elsewhere since merging leading axes is a free reshape.
    """

    def __call__(self, x: jax.Array, scale: jax.Array | None = None) -> jax.Array:
        """`x @ kernel`, `x`'s features first multiplied by `scale` [din] when given (the
        learned scale of the `RMSNorm` before this projection)."""
        return scaled_matmul(x, self.kernel[...], scale, self.promote_dtype, self.dtype)


def scaled_matmul(
    x: jax.Array, matrix: jax.Array, scale: jax.Array | None, promote: Any, dtype: Any
) -> jax.Array:
    """`(x * scale) @ matrix` over `x`'s last axis, computed as `x @ (diag(scale) @ matrix)`
    on the tokens flattened into one matrix (see `Dense`), in `dtype` after `promote`
    (a Flax module's `promote_dtype`)."""
    if scale is not None:
        matrix = matrix * scale[:, None].astype(matrix.dtype)
    flat, matrix = promote((x.reshape(-1, x.shape[-1]), matrix), dtype=dtype)
    y = jnp.dot(flat, matrix)
    return y.reshape(*x.shape[:-1], y.shape[-1])


class RMSNorm(nnx.RMSNorm):
    """RMSNorm whose learned scale the next projection applies (`normalize` + `Dense`).

    `scaled_matmul(normalize(x), W, scale, ...)` is `rmsnorm(x) @ W`, with the scale multiplying
    the [d, out] kernel instead of the [tokens, d] activations. On XLA:CPU the activation-
    sized product was materialised as a broadcast in the backward pass of every norm; with
    the scale moved, the `small` step's kernels outside the matmuls take 234 instead of 283
    ms per step (f32 profile). The parameters are those of `nnx.RMSNorm` (checkpoints are
    unchanged) and its own `__call__` still gives the scaled result.
    """

    def normalize(self, x: jax.Array) -> jax.Array:
        """`x` divided by its root mean square over the features, computed in float32,
        returned in the compute dtype, not yet multiplied by `scale`."""
        xf = x.astype(jnp.float32)
        inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.epsilon)
        return (xf * inv).astype(self.dtype or x.dtype)


def _dense(din: int, dout: int, axes: tuple, cfg: ModelConfig, rngs: nnx.Rngs) -> Dense:
    return Dense(
        din,
        dout,
        use_bias=False,
        kernel_init=nnx.with_partitioning(_init, axes),
        dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.dtype(cfg.param_dtype),
        rngs=rngs,
    )


def _norm(dim: int, cfg: ModelConfig, rngs: nnx.Rngs) -> RMSNorm:
    return RMSNorm(
        dim,
        scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), (None,)),
        dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.dtype(cfg.param_dtype),
        rngs=rngs,
    )


Rope = tuple[jax.Array, jax.Array]  # sin and cos of the rotary angles, [b, s, 1, head_dim/2]


def rotary_angles(
    positions: jax.Array, head_dim: int, max_len: int, base: float = 10_000.0
) -> Rope:
    """Sin and cos of the rotary angles at `positions` [batch, seq] (each below `max_len`).

    They are looked up in a table of every position below `max_len`, built once per forward
    pass and shared by the layers. Computed from the positions where they are used instead,
    XLA:CPU fuses the sin and cos into each consumer and so evaluates them again per head,
    for queries and keys, in both passes: a third of the step's elementwise time for the
    `small` model. The values are the same either way (the same float32 products).

    A position is an offset inside its document, which starts inside the sequence, so the
    table stops at the sequence's length: sized by `max_len` alone, a model with a long
    `max_seq_len` trained on short sequences built a table of every position each step.
    """
    half = head_dim // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    rows = min(max_len, positions.shape[1])
    angles = jnp.arange(rows, dtype=jnp.float32)[:, None] * freqs  # [rows, half]
    return jnp.sin(angles)[positions][:, :, None, :], jnp.cos(angles)[positions][:, :, None, :]


def rotary(x: jax.Array, rope: Rope) -> jax.Array:
    """Rotary position embedding of `x` [batch, seq, heads, head_dim], given the angles'
    sin and cos from `rotary_angles`."""
    sin, cos = rope
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def attention_mask(segment_ids: jax.Array) -> jax.Array:
    """Causal mask that never lets a token attend across a document boundary."""
    seq = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (causal[None] & same_doc)[:, None]  # [b, 1, q, k]


def attention_bias(segment_ids: jax.Array) -> jax.Array:
    """`attention_mask` as a float32 bias added to the scores: 0 where a token may attend,
    a large negative number elsewhere. Built once per forward pass and shared by the
    layers; an add is cheaper than a select in both passes. Every query sees at least
    itself, so no row of the softmax is all masked."""
    return jnp.where(attention_mask(segment_ids), 0.0, -1e30).astype(jnp.float32)


class Attention(nnx.Module):
    """Multi-head self-attention; heads are split over the `tensor` axis."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.qkv = _dense(cfg.d_model, 3 * cfg.d_model, ("fsdp", "tensor"), cfg, rngs)
        self.out = _dense(cfg.d_model, cfg.d_model, ("tensor", "fsdp"), cfg, rngs)

    def __call__(
        self, x: jax.Array, rope: Rope, bias: jax.Array, scale: jax.Array | None = None
    ) -> jax.Array:
        """Attention over `x` [batch, seq, d] (its features first multiplied by `scale`)."""
        b, s, _ = x.shape
        qkv = self.qkv(x, scale).reshape(b, s, 3, self.n_heads, self.head_dim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        q = rotary(q, rope) * jnp.asarray(self.head_dim**-0.5, q.dtype)
        k = rotary(k, rope)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        probs = jax.nn.softmax(scores + bias, axis=-1).astype(v.dtype)
        ctx = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, -1)
        return self.out(ctx)


class Block(nnx.Module):
    """Pre-norm transformer block: attention then a GELU MLP, each with a residual."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = _norm(cfg.d_model, cfg, rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = _norm(cfg.d_model, cfg, rngs)
        self.up = _dense(cfg.d_model, cfg.d_ff, ("fsdp", "tensor"), cfg, rngs)
        self.down = _dense(cfg.d_ff, cfg.d_model, ("tensor", "fsdp"), cfg, rngs)

    def __call__(self, x: jax.Array, rope: Rope, bias: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm.normalize(x), rope, bias, self.attn_norm.scale[...])
        hidden = self.up(self.mlp_norm.normalize(x), self.mlp_norm.scale[...])
        x = x + self.down(jax.nn.gelu(hidden))
        return jax.lax.with_sharding_constraint(x, P(BATCH_AXES, None, None))


class Transformer(nnx.Module):
    """Decoder-only language model with tied input and output embeddings."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, *, rngs: nnx.Rngs):
        self.vocab_size = vocab_size
        self.head_dim, self.max_seq_len = cfg.d_model // cfg.n_heads, cfg.max_seq_len
        self.embed = nnx.Embed(
            padded_vocab_size(vocab_size),
            cfg.d_model,
            embedding_init=nnx.with_partitioning(_init, (None, "fsdp")),
            dtype=jnp.dtype(cfg.dtype),
            param_dtype=jnp.dtype(cfg.param_dtype),
            rngs=rngs,
        )
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
        self.final_norm = _norm(cfg.d_model, cfg, rngs)

    def __call__(
        self, inputs: jax.Array, positions: jax.Array, segment_ids: jax.Array
    ) -> jax.Array:
        """Float32 logits [batch, seq, padded_vocab] for token ids `inputs` [batch, seq] at
        `positions` (each below `max_seq_len`) in documents `segment_ids`."""
        x = jax.lax.with_sharding_constraint(self.embed(inputs), P(BATCH_AXES, None, None))
        bias = attention_bias(segment_ids)
        rope = rotary_angles(positions, self.head_dim, self.max_seq_len)
        for block in self.blocks:
            x = block(x, rope, bias)
        logits = scaled_matmul(  # the tied output projection
            self.final_norm.normalize(x),
            self.embed.embedding[...].T,
            self.final_norm.scale[...],
            self.embed.promote_dtype,
            self.embed.dtype,
        ).astype(jnp.float32)
        # Padding rows of the embedding table are not tokens: give them no probability.
        real = jnp.arange(logits.shape[-1]) < self.vocab_size
        return jnp.where(real, logits, jnp.finfo(jnp.float32).min)


def token_losses(model: Transformer, batch: dict) -> tuple[jax.Array, jax.Array]:
    """Per-token negative log-likelihood (nats) and the weights that say which count."""
    logits = model(batch["inputs"], batch["positions"], batch["segment_ids"])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    return nll, batch["weights"].astype(jnp.float32)


def count_params(model: nnx.Module) -> int:
    """Number of scalar parameters in `model`."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
