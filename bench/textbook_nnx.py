"""A textbook Flax NNX decoder, the reference for what the model-FLOP/s figure can reach.

    XLA_FLAGS=--xla_force_host_platform_device_count=1 .venv/bin/python bench/textbook_nnx.py

Built only from Flax's stock layers (`nnx.MultiHeadAttention` with a causal mask,
`nnx.LayerNorm`, a GELU MLP of `nnx.Linear`, tied `nnx.Embed`) and trained with
`optax.adamw`, with the dimensions of a named size of ours and the benchmark's batch. Its
model FLOP/s use the same count as the workload's (`workloads.perf.model_flops_per_token`),
so "textbook ÷ matmul peak" next to "workload ÷ matmul peak" says how much of the gap to the
peak belongs to the machine and XLA:CPU rather than to our model. Nothing of `workloads/`
but the size table and the FLOP count is used.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def measure(size: str, batch: int, seq_len: int, steps: int) -> dict:
    """Tokens/s and model FLOP/s of the textbook model's train step, over `steps` steps
    timed together (as the minimal loop in bench/workload.py is)."""
    import jax
    import optax
    from flax import nnx

    from workloads.config import ModelConfig, padded_vocab_size
    from workloads.perf import model_flops_per_token

    cfg = ModelConfig(size=size, dtype="float32", max_seq_len=seq_len)
    d, heads, ff, vocab = cfg.d_model, cfg.n_heads, cfg.d_ff, padded_vocab_size(257)

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(heads, d, use_bias=False, decode=False, rngs=rngs)
            self.up = nnx.Linear(d, ff, use_bias=False, rngs=rngs)
            self.down = nnx.Linear(ff, d, use_bias=False, rngs=rngs)

        def __call__(self, x, mask):
            x = x + self.attn(self.ln1(x), mask=mask)
            return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))

    class Decoder(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(vocab, d, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(cfg.n_layers)])
            self.ln = nnx.LayerNorm(d, rngs=rngs)

        def __call__(self, tokens):
            x, mask = self.embed(tokens), nnx.make_causal_mask(tokens)
            for block in self.blocks:
                x = block(x, mask)
            return self.embed.attend(self.ln(x))

    net = Decoder(nnx.Rngs(0))
    opt = nnx.Optimizer(net, optax.adamw(1e-3), wrt=nnx.Param)
    toks = jax.random.randint(jax.random.key(0), (batch, seq_len + 1), 0, 256)

    @nnx.jit
    def step(net, opt, toks):
        def loss_fn(net):
            logits = net(toks[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, toks[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(net)
        opt.update(net, grads)
        return loss

    for _ in range(3):  # compile and settle
        step(net, opt, toks).block_until_ready()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step(net, opt, toks)
    loss.block_until_ready()
    tokens_per_s = batch * seq_len * steps / (time.perf_counter() - start)
    return {
        "tokens_per_s": tokens_per_s,
        "flops_per_s": model_flops_per_token(cfg, 257, seq_len) * tokens_per_s,
        "params": sum(x.size for x in jax.tree.leaves(nnx.state(net, nnx.Param))),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    print(json.dumps(measure(args.model, args.batch, args.seq_len, args.steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
