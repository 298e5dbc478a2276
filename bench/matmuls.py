"""The model's own matrix multiplies timed alone: the ceiling of the model-FLOP/s figure.

    XLA_FLAGS=--xla_force_host_platform_device_count=1 .venv/bin/python bench/matmuls.py

Every matmul of one training step of a named size (forward, and the two products per
matmul of the backward pass), each shape timed by itself (best of several runs) and summed
by how often the step runs it. Their FLOP/s, ÷ the 2048² matmul peak, is what the
model-FLOP/s figure would read if nothing but these matmuls took time; the workload's
model FLOP/s ÷ theirs is the share of its step spent in them (the rest: norms, softmax,
GELU, rotary, the loss and the optimizer). The logits are timed at the rows the model pads
its embedding table to, the work the step does, and counted at the tokenizer's vocabulary,
as `workloads.perf.model_flops_per_token` counts them (checked), so both figures count the
same model FLOPs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

Shape = tuple[int, int, int]  # (m, k, n): [m, k] @ [k, n]


def step_matmuls(d: int, ff: int, heads: int, layers: int, vocab: int, batch: int, seq: int):
    """[(shape, batch dims, times per step)] of one training step's matmuls.

    Args:
        d, ff, heads, layers: The model's width, MLP width, heads and depth.
        vocab: Rows of the (tied) embedding table's logits: the tokenizer's vocabulary to
            count model FLOPs, the padded table's rows to time what the step runs.
        batch, seq: Sequences per step and their length.
    """
    tokens, hd, attn = batch * seq, d // heads, (batch, heads)
    forward = [
        ((tokens, d, 3 * d), (), layers),  # q, k, v
        ((tokens, d, d), (), layers),  # attention output
        ((tokens, d, ff), (), layers),  # MLP up
        ((tokens, ff, d), (), layers),  # MLP down
        ((tokens, d, vocab), (), 1),  # logits (tied embedding)
    ]
    out = []
    for (m, k, n), dims, times in forward:
        # Forward y = x @ w, then dx = dy @ w.T and dw = x.T @ dy.
        out += [((m, k, n), dims, times), ((m, n, k), dims, times), ((k, m, n), dims, times)]
    # Per (sequence, head): scores = q @ k.T, ctx = p @ v and their four gradients.
    out += [
        ((seq, hd, seq), attn, layers),  # scores
        ((seq, seq, hd), attn, layers),  # ctx
        ((seq, seq, hd), attn, 2 * layers),  # dq = ds @ k, dk = ds.T @ q
        ((seq, hd, seq), attn, layers),  # dp = dctx @ v.T
        ((seq, seq, hd), attn, layers),  # dv = p.T @ dctx
    ]
    return out


def flops(shape: Shape, dims: tuple[int, ...]) -> int:
    """FLOPs of one batched matmul (2 per multiply-add)."""
    m, k, n = shape
    return 2 * m * k * n * math.prod(dims)


def time_matmul(shape: Shape, dims: tuple[int, ...], repeats: int = 10) -> float:
    """Best seconds of one float32 `[*dims, m, k] @ [*dims, k, n]` on the default device."""
    import jax

    from workloads.perf import best_matmul_seconds

    m, k, n = shape
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, (*dims, m, k))
    b = jax.random.normal(key_b, (*dims, k, n))
    return best_matmul_seconds(a, b, repeats)


def measure(size: str, batch: int, seq_len: int) -> dict:
    """The step's matmul FLOP/s, seconds and FLOPs for a named size."""
    from workloads.config import ModelConfig, padded_vocab_size
    from workloads.perf import model_flops_per_token

    cfg = ModelConfig(size=size, dtype="float32", max_seq_len=seq_len)
    vocab = 257  # the byte tokenizer's vocabulary, as the bench trains
    model_dims = (cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_layers)
    counted = step_matmuls(*model_dims, vocab, batch, seq_len)
    total = sum(flops(s, dims) * times for s, dims, times in counted)
    expected = model_flops_per_token(cfg, vocab, seq_len) * batch * seq_len
    if total != expected:  # the two counts must describe the same work
        raise AssertionError(f"step matmuls count {total} FLOPs, the model's formula {expected}")
    run = step_matmuls(*model_dims, padded_vocab_size(vocab), batch, seq_len)
    seconds = sum(time_matmul(s, dims) * times for s, dims, times in run)
    return {"flops_per_s": total / seconds, "seconds": seconds, "flops": total}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    print(json.dumps(measure(args.model, args.batch, args.seq_len)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
