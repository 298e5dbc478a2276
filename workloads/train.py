"""The training workload: `python -m workloads.train --config <run_dir>/config.json`.

This is the whole interface between the orchestrator and a slice: the workload reads its
resolved config, resumes from the newest committed checkpoint, trains, and reports through
the run directory (`status.json`, `metrics.jsonl`, checkpoints). It needs neither Prefect nor
any cloud SDK. Every host of a slice runs this same module; host 0 writes the reports.

Exit codes: 0 finished; 1 a bug or bad state (never retried); PREEMPTED_EXIT after a SIGTERM
(a preemption notice) once the current step has been saved.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import os
import sys
import time
from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import jax
from etils import epath

from workloads import checkpoint, input
from workloads.compile_cache import configure_compile_cache
from workloads.config import WorkloadConfig
from workloads.config_file import ConfigError, load_workload_config, misplaced_config
from workloads.config_infra import SliceConfig
from workloads.events import SUPERSEDED_EXIT, EventLog, LeaseLost, beside_live_workload
from workloads.hosts import PreemptionNotice, host_index, init_distributed, record_failure
from workloads.perf import CompileCounter, model_flops_per_token, slice_peak
from workloads.rundir import RunDir, finite_or_none, read_json, write_json_atomic
from workloads.step_metrics import MetricsWindow, NonFiniteError
from workloads.trainer import (
    create_train_state,
    lr_hyper,
    lr_schedule,
    make_mesh,
    make_train_step,
    place_batch,
)

if TYPE_CHECKING:
    import orbax.checkpoint as ocp

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: "try again", distinct from a crash
log = logging.getLogger("workloads.train")

__all__ = ["PREEMPTED_EXIT", "PreemptionNotice", "init_distributed", "main", "run"]


class _Reporter:
    """Writes status, metrics and events from host 0 only, so hosts never race on the same
    files, and only while this attempt holds the run's lease."""

    def __init__(self, run_dir: str) -> None:
        self.rd = RunDir(run_dir)
        self.events = EventLog.from_env(run_dir)
        self.primary = jax.process_index() == 0
        self.last_status = time.monotonic()
        self.quarantined: list[dict[str, Any]] = []
        self.resumed_from: int | None = None  # the step restored (0: none), once known

    def status(self, phase: str, **fields: Any) -> None:
        if self.primary:
            self.events.check_lease()
            # The attempt tells the orchestrator this attempt's heartbeat from the last one's.
            if self.quarantined:  # in every beat: the watch may miss any single one
                fields["quarantined"] = self.quarantined
            if self.resumed_from is not None:
                fields["resumed_from"] = self.resumed_from
            self.rd.write_status(phase, attempt=self.events.attempt, **fields)
        self.last_status = time.monotonic()

    def quarantine(self, step: int, reason: str) -> None:
        """Tell the ledger and the orchestrator's console that a checkpoint this attempt
        would have resumed from was quarantined (otherwise only its slice log said so)."""
        self.quarantined.append({"step": step, "reason": reason})
        self.event("quarantined", step=step, reason=reason)

    def silent_for(self) -> float:
        """Seconds since the last heartbeat."""
        return time.monotonic() - self.last_status

    def metrics(self, rows: list[dict[str, Any]]) -> None:
        if self.primary:
            self.events.check_lease()
            self.rd.append_metrics(rows)

    def event(self, event: str, **fields: Any) -> None:
        if self.primary:
            self.events.check_lease()
            self.events.emit(event, **fields)


def heartbeat_interval(slice_cfg: SliceConfig) -> float:
    """The longest silence between heartbeats while training: a quarter of the time after
    which the orchestrator takes a silent workload for a lost one (at most a minute).

    0 (a beat every step) when the local slice's chaos waits for a step count
    (`slice.chaos.at_step`): it reads the step from the heartbeat, and with log steps far
    apart it signalled late, or in a run shorter than a log interval never, the attempt
    counted as hit all the same. A beat is a small local write without a device sync (chaos
    is the local provider's only: elsewhere, say to a gs:// run directory, it never beats
    every step).
    """
    chaos = slice_cfg.chaos
    if slice_cfg.provider == "local" and chaos.times and chaos.at_step is not None:
        return 0.0
    return min(60.0, slice_cfg.heartbeat_timeout_s / 4)


def run(wcfg: WorkloadConfig, notice: PreemptionNotice | None = None) -> int:
    """Train until `train.steps` (resuming if checkpoints exist); returns the exit code."""
    started = time.perf_counter()
    cfg, report = wcfg.pipeline, _Reporter(wcfg.run_dir)
    notice = notice or PreemptionNotice()
    compiles = CompileCounter()
    report.status("starting", step=None)
    report.event("started", hosts=jax.process_count(), devices=jax.device_count())
    configure_compile_cache(wcfg.compile_cache_dir, wcfg.pipeline.storage.compile_cache_gb)
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
    if mngr.latest_step():
        report.status("restoring", step=mngr.latest_step())
    restore_started = time.perf_counter()
    start, arrays, data_state = checkpoint.restore_newest_valid(
        mngr,
        wcfg.run_dir,
        arrays,
        wcfg.config_hash,
        partial(input.iterator_state_problem, data),
        report.quarantine,
    )
    report.resumed_from = start
    if start:
        input.restore_iterator_state(data, data_state)
        report.event("restored", step=start, seconds=time.perf_counter() - restore_started)
        log.info("resumed from step %d", start)
    peak_file = epath.Path(wcfg.run_dir) / "peak.json"
    peak = slice_peak(cfg.model.dtype, read_json(peak_file, unreadable_as_missing=True))
    if report.primary:
        write_json_atomic(peak_file, {"flops_per_s": peak.flops_per_s, "source": peak.source})
    window = MetricsWindow(
        lr_schedule(cfg.train),
        model_flops_per_token(cfg.model, info.vocab_size, info.seq_len),
        peak.flops_per_s,
    )
    step_fn = make_train_step(state.graphdef, mesh, lr_hyper(cfg.train))
    total, every = cfg.train.steps, cfg.train.checkpoint_every
    step = last_saved = committed = start
    loss, beat_s = None, heartbeat_interval(cfg.slice)
    # Noticed during start-up: nothing new to save. (A finished run just says so below.)
    if notice.received and start < total:
        report.status("preempted", step=start, last_checkpoint=start or None, saved=False)
        return PREEMPTED_EXIT
    report.status("compiling", step=start, last_checkpoint=start or None, peak=peak.source)
    with _saves_land_if_training_fails(mngr):
        while step < total:
            step += 1
            arrays, metrics = step_fn(arrays, place_batch(next(data), mesh))
            if last_saved > committed and step - committed > cfg.train.lost_steps_bound:
                # A kill after this step would go back further than the bound: let the
                # save under way commit first (it overlapped this step's dispatch). Every
                # host decides this from step numbers alone, so they all wait together.
                mngr.wait_until_finished()
                committed = last_saved
            window.add(step, metrics)
            # Read the flag once: a signal landing mid-iteration must not skip the save below
            # yet still take the exit, or the exit would claim a step that was never saved.
            # A notice at the last step is no preemption: that step is saved as the final
            # one anyway, and a "preempted" exit would make the orchestrator provision a
            # slice only to restore it, spending one of the run's preemption retries.
            preempted = notice.stop_at(step - start) and step < total
            save_now = step % every == 0 or step == total or preempted
            logged = save_now or step % cfg.train.log_every == 0 or step == start + 1
            if logged:
                try:
                    rows = window.flush()  # raises NonFiniteError before a bad state is saved
                except NonFiniteError as exc:
                    report.metrics(exc.rows)  # the window's steps up to the bad one
                    raise
                if step == start + 1:
                    # On the step's output layouts (the initial ones: `make_train_step` keeps them).
                    checkpoint.prepare_saves(arrays)
                    report.event("first_step", step=step, resumed_from=start)
                    rows[0].update(
                        startup_s=time.perf_counter() - started,
                        compile_cache_hits=compiles.hits,
                        compile_cache_misses=compiles.misses,
                        compile_s=compiles.compile_s,
                        resumed_from=start,
                    )
                report.metrics(rows)
                loss = finite_or_none(rows[-1]["loss"])
            # Log steps alone may be further apart than the orchestrator's heartbeat timeout:
            # between them, beat without fetching metrics (a sync with the devices), with the
            # step dispatched and the last loss fetched. The beat says its interval (how
            # long its silence means nothing: `tasks.own_slice`).
            if logged or report.silent_for() >= beat_s:
                at = last_saved or None
                report.status("training", step=step, loss=loss, last_checkpoint=at, beat_s=beat_s)
            if save_now:
                if report.primary:
                    report.events.check_lease()  # a zombie must never write a checkpoint
                checkpoint.save(
                    mngr, step, arrays, input.iterator_state_to_json(data), wcfg.config_hash
                )
                committed, last_saved = last_saved, step  # a save first waits for the last one
                report.event("checkpoint", step=step)
            if preempted:
                report.status("saving", step=step, last_checkpoint=step)
                mngr.wait_until_finished()
                mngr.close()
                report.status("preempted", step=step, last_checkpoint=step)
                report.event("preempted", step=step)
                return PREEMPTED_EXIT
    mngr.wait_until_finished()
    mngr.close()
    report.status("finished", step=step, last_checkpoint=last_saved or None)
    report.event("finished", step=step)
    return 0


@contextlib.contextmanager
def _saves_land_if_training_fails(mngr: ocp.CheckpointManager) -> Iterator[None]:
    """Let a save already under way commit when training stops on an error (NaN, a bug):
    the previous good step is then the one a fixed run resumes from. Not for a lost lease:
    a newer attempt owns the checkpoints, and this one must write nothing more."""
    try:
        yield
    except LeaseLost:
        raise
    except Exception:
        try:
            mngr.wait_until_finished()
        except Exception:  # the training error is the one to report
            log.exception("the checkpoint save under way failed too")
        raise


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; see the module docstring for exit codes."""
    parser = argparse.ArgumentParser(prog="python -m workloads.train")
    parser.add_argument("--config", required=True, help="the run's config.json")
    args = parser.parse_args(argv)
    # force: a library may have installed a root handler already, which would swallow ours.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", force=True)
    # A crash (SIGSEGV, SIGABRT) then leaves its Python stack in the slice log, which the
    # orchestrator quotes: "Fatal Python error: Segmentation fault" (this thread's alone,
    # so that line stays near the log's end).
    faulthandler.enable(all_threads=False)
    notice = PreemptionNotice()
    notice.install()  # before the slow imports and start-up: a notice then is not lost
    try:
        wcfg = load_workload_config(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    if elsewhere := misplaced_config(args.config, wcfg):
        print(elsewhere, file=sys.stderr)
        return 1
    if busy := beside_live_workload(wcfg.run_dir, wcfg.pipeline.slice.heartbeat_timeout_s):
        print(busy, file=sys.stderr)
        return 1
    try:
        notice.across_hosts = init_distributed()
        return run(wcfg, notice)
    except LeaseLost as exc:
        log.error("%s", exc)  # a newer attempt owns the run directory: write nothing
        return SUPERSEDED_EXIT
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        log.exception("training failed")  # first: writing the run directory may fail too
        try:
            record_failure(wcfg.run_dir, error, host_index(notice.across_hosts))
        except LeaseLost as lost:  # a newer attempt owns the run directory: write nothing
            log.error("%s", lost)
        except Exception:  # a full disk: the slice log says why, as the exit code does
            log.exception("could not record the failure in %s", wcfg.run_dir)
        if notice.across_hosts:
            _exit_now(1)
        return 1


def _exit_now(code: int) -> None:
    """End this host's process now, skipping the interpreter's exit: it joins a checkpoint
    save's threads and shuts `jax.distributed` down, both waiting at barriers for hosts
    that may be stuck waiting for this one (a save that failed here only). Exiting, it
    ends the slice: the provider reports a host's failure at once."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
