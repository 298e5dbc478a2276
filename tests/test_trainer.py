"""The model and train step on a faked 8-device CPU mesh."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from workloads.config import MeshConfig, ModelConfig, TrainConfig
from workloads.model import Block, Transformer
from workloads.step_metrics import MetricsWindow, NonFiniteError
from workloads.trainer import (
    create_train_state,
    lr_hyper,
    lr_schedule,
    make_mesh,
    make_train_step,
    place_batch,
)

MODEL = ModelConfig(d_model=32, n_layers=1, n_heads=4, d_ff=64, max_seq_len=64, dtype="float32")
TRAIN = TrainConfig(steps=10, batch_size=8, learning_rate=1e-2, warmup_steps=1)


def make_batch(seed: int = 0, batch: int = 8, seq: int = 16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 256, (batch, seq + 1)).astype(np.int32)
    return {
        "inputs": toks[:, :-1],
        "targets": toks[:, 1:],
        "segment_ids": np.ones((batch, seq), np.int32),
        "positions": np.tile(np.arange(seq, dtype=np.int32), (batch, 1)),
        "weights": np.ones((batch, seq), np.float32),
    }


def losses_on(mesh_shape: tuple[int, int, int], steps: int = 3) -> list[float]:
    mesh = make_mesh(MeshConfig(data=mesh_shape[0], fsdp=mesh_shape[1], tensor=mesh_shape[2]))
    state = create_train_state(MODEL, TRAIN, 257, seed=0, mesh=mesh)
    step = make_train_step(state.graphdef, mesh, lr_hyper(TRAIN))
    arrays, out = state.arrays, []
    for i in range(steps):
        arrays, metrics = step(arrays, place_batch(make_batch(i), mesh))
        out.append(float(metrics["loss"]))
    return out


def test_parameters_are_sharded_on_the_mesh():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    state = create_train_state(MODEL, TRAIN, 257, seed=0, mesh=mesh)
    qkv = state.arrays["model"]["blocks"][0]["attn"]["qkv"]["kernel"][...]
    assert qkv.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    # Each device holds a quarter of the kernel (fsdp=2 × tensor=2), not all of it.
    assert qkv.addressable_shards[0].data.size == qkv.size // 4


def test_same_losses_on_different_meshes():
    reference = losses_on((8, 1, 1))
    assert reference[-1] < reference[0]
    for shape in [(2, 2, 2), (1, 2, 4)]:
        np.testing.assert_allclose(losses_on(shape), reference, rtol=2e-5)


def test_the_step_compiles_once_and_keeps_the_state_on_its_shardings():
    # Step 1's output came back on other shardings than the initial state (norm scales
    # sharded over fsdp), so step 2 compiled the step again: 6.5 s of the tiny model's 7,
    # counted in the step time, tokens/s and MFU of the first logged steps.

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    state = create_train_state(MODEL, TRAIN, 257, seed=0, mesh=mesh)
    before = jax.tree.map(lambda x: x.sharding, state.arrays)
    step, arrays = make_train_step(state.graphdef, mesh, lr_hyper(TRAIN)), state.arrays
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: (
            compiles.append(event)
            if event == "/jax/core/compile/backend_compile_duration"
            else None
        )
    )
    per_step = []
    for i in range(3):
        seen = len(compiles)
        arrays, metrics = step(arrays, place_batch(make_batch(i), mesh))
        jax.block_until_ready(metrics)
        per_step.append(len(compiles) - seen)
    assert per_step[1:] == [0, 0]
    assert jax.tree.map(lambda x: x.sharding, arrays) == before


def test_a_long_max_seq_len_gives_the_same_losses_on_short_sequences():
    # The rotary table covers the sequence, not every position below max_seq_len: with
    # 2**28 it was a 16 GiB table built each step, and 2**31 overflowed int32 positions.
    mesh = make_mesh(MeshConfig(data=8))
    out = {}
    for max_len in (64, 2**28):
        model = MODEL.model_copy(update={"max_seq_len": max_len})
        state = create_train_state(model, TRAIN, 257, seed=0, mesh=mesh)
        _, metrics = make_train_step(state.graphdef, mesh, lr_hyper(TRAIN))(
            state.arrays, place_batch(make_batch(), mesh)
        )
        out[max_len] = float(metrics["loss"])
    assert out[2**28] == out[64]


def test_attention_never_crosses_documents():
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    with jax.set_mesh(mesh):
        from flax import nnx

        model = Transformer(MODEL, 257, rngs=nnx.Rngs(0))
        batch = make_batch(0, batch=1)
        seg = np.array([[1] * 6 + [2] * 10], np.int32)
        pos = np.array([list(range(6)) + list(range(10))], np.int32)
        base = model(batch["inputs"], pos, seg)
        changed = batch["inputs"].copy()
        changed[0, :6] = (changed[0, :6] + 7) % 256  # rewrite the first document only
        after = model(changed, pos, seg)
    np.testing.assert_allclose(np.asarray(after)[0, 6:], np.asarray(base)[0, 6:], atol=1e-5)
    assert not np.allclose(np.asarray(after)[0, :6], np.asarray(base)[0, :6])


def test_a_norm_scale_applied_by_the_next_projection_is_a_standard_rmsnorm():
    # The model multiplies a norm's scale into the next kernel's rows (cheaper on CPU); the
    # result must be flax's own RMSNorm followed by the projection, for any learned scale.
    from flax import nnx

    with jax.set_mesh(make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])):
        block = Block(MODEL, nnx.Rngs(0))
    rng = np.random.default_rng(0)
    block.mlp_norm.scale[...] = rng.uniform(0.5, 2.0, MODEL.d_model).astype(np.float32)
    x = rng.normal(size=(2, 5, MODEL.d_model)).astype(np.float32) * 3.0
    folded = block.up(block.mlp_norm.normalize(x), block.mlp_norm.scale[...])
    standard = nnx.RMSNorm.__call__(block.mlp_norm, x) @ block.up.kernel[...]
    np.testing.assert_allclose(np.asarray(folded), np.asarray(standard), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(folded), np.asarray(block.up(block.mlp_norm.normalize(x))))


def test_padding_rows_of_the_vocab_get_no_probability():
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    with jax.set_mesh(mesh):
        from flax import nnx

        model = Transformer(MODEL, 257, rngs=nnx.Rngs(0))
        b = make_batch(0, batch=1)
        probs = jax.nn.softmax(model(b["inputs"], b["positions"], b["segment_ids"]), axis=-1)
    assert float(probs[..., 257:].sum()) == pytest.approx(0.0, abs=1e-6)


def test_non_finite_loss_stops_with_a_clear_error_and_the_rows_up_to_it():
    def metrics(loss):
        return {"loss": np.float32(loss), "grad_norm": np.float32(1.0), "tokens": 8.0}

    window = MetricsWindow(lr_schedule(TRAIN), 1e6, 1e9)
    window.pending = [(5, metrics(2.5)), (6, metrics(2.25)), (7, metrics("nan")), (8, metrics(2))]
    with pytest.raises(NonFiniteError, match=r"step 7: loss=nan .* not finite") as err:
        window.flush()
    # The finite steps before it were lost with the error (up to log_every - 1 rows); the
    # diverged step is a row too, which lands flagged as non-finite.
    assert [(r["step"], r["loss"]) for r in err.value.rows[:2]] == [(5, 2.5), (6, 2.25)]
    assert err.value.rows[2]["step"] == 7 and np.isnan(err.value.rows[2]["loss"])
    assert len(err.value.rows) == 3 and window.pending == []


class _Step:
    """A dispatched step's loss: records whether the loop waited for it."""

    def __init__(self) -> None:
        self.waited = False

    def block_until_ready(self) -> _Step:
        self.waited = True
        return self


def test_the_host_runs_at_most_two_steps_ahead_of_the_devices():
    # Unbounded, a few hundred steps queued between two log steps deadlocked XLA:CPU's
    # collectives on 8 devices (aborted after 40 s): the window waits, without fetching,
    # for the step two before the one just dispatched.
    window = MetricsWindow(lr_schedule(TRAIN), 1e6, 1e9)
    losses = [_Step() for _ in range(6)]
    for step, loss in enumerate(losses, start=1):
        window.add(step, {"loss": loss})
        assert [x.waited for x in losses[:step]] == [i < step - 2 for i in range(step)]


@pytest.mark.parametrize("clip", [0.25, None])
def test_gradients_are_clipped_to_the_configured_global_norm(clip):
    # Adam's first moment after one update is (1 - b1) times the gradient it was given:
    # its global norm shows the gradient after clipping.
    import optax

    from workloads.trainer import make_optimizer

    grads = {"w": np.full((4, 4), 3.0, np.float32), "b": np.full((4,), 4.0, np.float32)}
    params = jax.tree.map(np.zeros_like, grads)
    opt = make_optimizer(TRAIN.model_copy(update={"grad_clip_norm": clip}))
    _, state = opt.update(grads, opt.init(params), params, lr=lr_hyper(TRAIN))
    first_moment = state[1][0].mu
    norm = float(optax.tree.norm(grads))
    assert float(optax.tree.norm(first_moment)) == pytest.approx(0.1 * (clip or norm), rel=1e-5)
