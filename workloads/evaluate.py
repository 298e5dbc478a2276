"""Evaluation of a checkpoint: loss and bits-per-byte on the held-out shards.

Restores parameters as host arrays, so it runs on any mesh or device count (the
orchestrator's single CPU device by default), and writes `eval.json` in the run directory.
`python -m workloads.evaluate --config <run_dir>/config.json [--step N]` runs it alone.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import jax
import numpy as np
from etils import epath
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from workloads import checkpoint, input
from workloads.config import MeshConfig, WorkloadConfig
from workloads.config_file import ConfigError, load_workload_config, misplaced_config
from workloads.eval_bytes import ScoredBytes
from workloads.model import Transformer, token_losses
from workloads.rundir import EVAL, read_json, write_json_atomic
from workloads.sources import DatasetError
from workloads.trainer import BATCH_KEYS, batch_sharding, make_mesh


class EvaluationStopped(RuntimeError):
    """`evaluate`'s `stop` said to stop; says after how many batches."""


@dataclass(frozen=True)
class EvalResult:
    """Evaluation of one checkpoint step on the eval split."""

    step: int
    loss: float
    bits_per_byte: float
    tokens: int
    batches: int


def load_model(wcfg: WorkloadConfig, step: int, mesh) -> Transformer:
    """Rebuild the model from a checkpoint's parameters, without a random init first.

    The parameters are replicated on every device of `mesh` (an evaluation mesh splits
    only the batch), whatever mesh wrote them, once checked (`checkpoint.restore_params`:
    a step whose bytes changed after the save gave a loss, where the pipeline refused it).

    Raises:
        CheckpointError: the step is damaged, non-finite or of another config.
        CheckpointUnreadable: it could not be read (no permission, storage unavailable).
    """
    info = input.dataset_info(wcfg.dataset_dir)
    params = checkpoint.restore_params(wcfg.run_dir, step, wcfg.config_hash)
    with jax.set_mesh(mesh):
        abstract = nnx.eval_shape(
            lambda: Transformer(wcfg.pipeline.model, info.vocab_size, rngs=nnx.Rngs(0))
        )
        graphdef, state = nnx.split(abstract)
        replicated = NamedSharding(mesh, P())
        nnx.replace_by_pure_dict(state, jax.device_put(params, replicated))
        return nnx.merge(graphdef, state)


def evaluate(
    wcfg: WorkloadConfig,
    step: int,
    devices: list | None = None,
    stop: Callable[[], bool] | None = None,
) -> EvalResult:
    """Mean token loss (nats) and bits per byte of checkpoint `step` on the eval split.

    `devices` (default: the first one) split each batch of `eval.batch_size` records;
    any count gives the same result up to float rounding (the sums are split otherwise:
    1, 3 and 8 devices gave 3.873303, 3.873164, 3.873164), whatever mesh trained the
    checkpoint. The pipeline and the CLI always use one device, so their figures repeat.

    Raises:
        EvaluationStopped: `stop()`, asked before each batch, was true (an evaluation of
            many batches takes minutes, and a stopped sweep waited for it).
    """
    devices = devices or jax.devices()[:1]
    mesh = make_mesh(MeshConfig(data=len(devices), fsdp=1, tensor=1), devices)
    model = load_model(wcfg, step, mesh)
    info = input.dataset_info(wcfg.dataset_dir)

    @nnx.jit
    def batch_sums(model: Transformer, batch: dict) -> tuple[jax.Array, jax.Array]:
        nll, weights = token_losses(model, batch)
        return (nll * weights).sum(), weights.sum()

    total_nll, total_tokens, batches = 0.0, 0.0, 0
    scored_bytes = ScoredBytes(info.tokenizer, info.bytes_per_token)
    sharding = batch_sharding(mesh)
    with jax.set_mesh(mesh):
        for batch in input.eval_batches(
            wcfg.dataset_dir, wcfg.pipeline.eval.batch_size, wcfg.pipeline.eval.max_batches
        ):
            if stop is not None and stop():
                raise EvaluationStopped(f"stopped after {batches} eval batches")
            scored_bytes.add(batch["targets"], batch["weights"])
            rows = pad_rows(batch, len(devices))
            nll, tokens = batch_sums(
                model, {k: jax.device_put(rows[k], sharding) for k in BATCH_KEYS}
            )
            total_nll += float(nll)
            total_tokens += float(tokens)
            batches += 1
    if total_tokens == 0:
        raise ValueError(f"eval split of {wcfg.dataset_dir} produced no tokens")
    loss = total_nll / total_tokens
    # Over the bytes of the text scored, not the split's average (workloads/eval_bytes.py).
    bpb = total_nll / math.log(2) / max(scored_bytes.total, 1.0)
    return EvalResult(step, loss, bpb, int(total_tokens), batches)


def pad_rows(batch: dict[str, np.ndarray], multiple: int) -> dict[str, np.ndarray]:
    """`batch` with rows of weight 0 appended until its row count divides by `multiple`.

    The batch is split over the devices, so its rows must divide evenly; padding, rather
    than cutting the configured batch size down, keeps the scored records the same on any
    device count. A padding row is all zeros (its weight too), so it scores nothing.
    """
    missing = -len(batch["weights"]) % multiple
    if not missing:
        return batch
    return {
        key: np.concatenate([rows, np.zeros((missing, *rows.shape[1:]), rows.dtype)])
        for key, rows in batch.items()
    }


def write_result(run_dir: str, result: EvalResult) -> None:
    """Record the evaluation in the run directory's eval.json."""
    write_json_atomic(epath.Path(run_dir) / EVAL, asdict(result))


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: evaluate the newest (or a given) checkpoint."""
    parser = argparse.ArgumentParser(prog="python -m workloads.evaluate")
    parser.add_argument("--config", required=True, help="the run's config.json")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (newest)")
    args = parser.parse_args(argv)
    try:
        wcfg = load_workload_config(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    if elsewhere := misplaced_config(args.config, wcfg):
        print(elsewhere, file=sys.stderr)
        return 2
    steps = checkpoint.committed_steps(wcfg.run_dir)
    if not steps:
        print(f"no checkpoint in {wcfg.run_dir}", file=sys.stderr)
        return 1
    step = args.step if args.step is not None else steps[-1]
    if step not in steps:  # orbax would raise FileNotFoundError from deep in a restore
        where = checkpoint.checkpoint_dir(wcfg.run_dir)
        listed = ", ".join(map(str, steps))
        print(f"no committed checkpoint step {step} in {where} (steps: {listed})", file=sys.stderr)
        return 1
    try:
        result = evaluate(wcfg, step)
    except (checkpoint.CheckpointError, checkpoint.CheckpointUnreadable, DatasetError) as exc:
        print(exc, file=sys.stderr)  # one line: what a traceback buried in orbax's frames
        return 1
    print(result)
    # eval.json is the run's evaluation of its newest step, which `tpupipe report` and
    # the landing read: an older step's figures are printed, not written over it.
    held = read_json(epath.Path(wcfg.run_dir) / EVAL, unreadable_as_missing=True) or {}
    if isinstance(held.get("step"), int) and held["step"] > step:
        print(f"{EVAL} left as it is: it holds the newer step {held['step']}", file=sys.stderr)
    else:
        try:
            write_result(wcfg.run_dir, result)
        except OSError as exc:  # a teammate's run directory, read-only for this user
            print(f"{EVAL} not written (its figures are above): {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    from workloads.closed_loop_noise import drop_closed_loop_noise

    drop_closed_loop_noise()
    sys.exit(main())
