"""The training workload: `python -m workloads.train --config <run_dir>/config.json`.

This is the whole interface between the orchestrator and a slice: the workload reads its
resolved config, resumes from the newest committed checkpoint, trains, and reports through
the run directory (`status.json`, `metrics.jsonl`, checkpoints). It needs neither Prefect nor
any cloud SDK.

Exit codes: 0 finished; 1 a bug or bad state (never retried); PREEMPTED_EXIT after a SIGTERM
(a preemption notice) once the current step has been saved.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
import time
from typing import Any

import jax

from workloads import checkpoint, input
from workloads.config import WorkloadConfig
from workloads.rundir import RunDir, finite_or_none
from workloads.trainer import (
    create_train_state,
    lr_schedule,
    make_mesh,
    make_train_step,
    place_batch,
)

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: "try again", distinct from a crash
log = logging.getLogger("workloads.train")


class NonFiniteError(RuntimeError):
    """Loss or gradient norm became NaN/Inf: the run stops and nothing bad is saved."""


class PreemptionNotice:
    """Set by SIGTERM; the loop saves at the next step boundary and exits."""

    def __init__(self) -> None:
        self.received = False

    def install(self) -> None:
        """Route SIGTERM to this flag instead of killing the process mid-step."""
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = True


def configure_compile_cache(cache_dir: str | None) -> None:
    """Share compiled programs between attempts: a resumed attempt skips recompiling."""
    if not cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def _metric_rows(pending: list, schedule, window_s: float) -> list[dict[str, Any]]:
    """Fetch a window of device metrics in one transfer and check them."""
    fetched = jax.device_get([m for _, m in pending])
    per_step = window_s / len(pending)
    rows = []
    for (step, _), m in zip(pending, fetched, strict=True):
        loss, grad_norm = float(m["loss"]), float(m["grad_norm"])
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise NonFiniteError(
                f"step {step}: loss={loss} grad_norm={grad_norm} is not finite; stopping "
                "without saving this state (lower train.learning_rate or check the data)"
            )
        rows.append(
            {
                "step": step,
                "loss": loss,
                "grad_norm": grad_norm,
                "learning_rate": float(schedule(step - 1)),
                "step_time_s": per_step,
                "tokens_per_s": float(m["tokens"]) / per_step if per_step > 0 else None,
                "time": time.time(),
            }
        )
    return rows


def run(wcfg: WorkloadConfig, notice: PreemptionNotice | None = None) -> int:
    """Train until `train.steps` (resuming if checkpoints exist); returns the exit code."""
    cfg, rd = wcfg.pipeline, RunDir(wcfg.run_dir)
    notice = notice or PreemptionNotice()
    rd.write_status("starting", step=None)
    configure_compile_cache(wcfg.compile_cache_dir)
    info = input.dataset_info(wcfg.dataset_dir)
    mesh = make_mesh(cfg.mesh)
    state = create_train_state(cfg.model, cfg.train, info.vocab_size, cfg.seed, mesh)
    arrays = state.arrays
    data = input.train_iterator(
        wcfg.dataset_dir,
        cfg.train.batch_size // jax.process_count(),
        cfg.seed,
        shard_index=jax.process_index(),
        shard_count=jax.process_count(),
    )
    mngr = checkpoint.make_manager(wcfg.run_dir, keep=cfg.train.keep_checkpoints)
    start = mngr.latest_step() or 0
    if start:
        arrays, data_state, meta = checkpoint.restore(mngr, start, arrays)
        if meta["config_hash"] != wcfg.config_hash:
            raise checkpoint.CheckpointError(
                f"checkpoint step {start} has config {meta['config_hash']}, "
                f"run has {wcfg.config_hash}"
            )
        input.restore_iterator_state(data, data_state)
        log.info("resumed from step %d", start)
    step_fn = make_train_step(state.graphdef, mesh)
    schedule = lr_schedule(cfg.train)
    total, every = cfg.train.steps, cfg.train.checkpoint_every
    pending: list = []
    window_start = time.perf_counter()
    last_saved = start
    step = start
    rd.write_status("training", step=start, last_checkpoint=start or None)
    while step < total:
        step += 1
        arrays, metrics = step_fn(arrays, place_batch(next(data), mesh))
        pending.append((step, metrics))
        save_now = step % every == 0 or step == total or notice.received
        if save_now or step % cfg.train.log_every == 0 or step == start + 1:
            rows = _metric_rows(pending, schedule, time.perf_counter() - window_start)
            pending, window_start = [], time.perf_counter()
            if jax.process_index() == 0:
                rd.append_metrics(rows)
            loss = finite_or_none(rows[-1]["loss"])
            rd.write_status("training", step=step, loss=loss, last_checkpoint=last_saved or None)
        if save_now:
            checkpoint.save(
                mngr, step, arrays, input.iterator_state_to_json(data), wcfg.config_hash
            )
            last_saved = step
        if notice.received:
            rd.write_status("saving", step=step, last_checkpoint=step)
            mngr.wait_until_finished()
            mngr.close()
            rd.write_status("preempted", step=step, last_checkpoint=step)
            return PREEMPTED_EXIT
    mngr.wait_until_finished()
    mngr.close()
    rd.write_status("finished", step=step, last_checkpoint=last_saved or None)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; see the module docstring for exit codes."""
    parser = argparse.ArgumentParser(prog="python -m workloads.train")
    parser.add_argument("--config", required=True, help="the run's config.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from etils import epath

    wcfg = WorkloadConfig.model_validate_json(epath.Path(args.config).read_text())
    notice = PreemptionNotice()
    notice.install()
    try:
        return run(wcfg, notice)
    except Exception as exc:
        RunDir(wcfg.run_dir).write_status("failed", error=f"{type(exc).__name__}: {exc}")
        log.exception("training failed")
        return 1


if __name__ == "__main__":
    sys.exit(main())
