"""The CheckpointManagers the training loop uses: orbax's, minus its own preemption checks,
and one that writes a new checkpoint into the memory of the one it replaces; and
`make_manager`, which opens the right one over a run's checkpoint directory (re-exported
by workloads/checkpoint.py)."""

from __future__ import annotations

from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath


class TrainingManager(ocp.CheckpointManager):
    """Orbax's CheckpointManager, leaving the preemption sync point to the training loop.

    With several hosts, JAX's preemption service stops every host at one step: one past
    the largest number any host last passed to `reached_preemption_sync_point`. The loop
    passes the count of this attempt's steps (`train.PreemptionNotice.stop_at`), which a
    notice during start-up needs; orbax passed the global step on every save, and again
    from its finalize thread. In an attempt resumed at step 14, a SIGTERM after the save
    of step 15 then set the stop at step 14 + 16: the hosts trained on, and a 20-step run
    finished without ever saving at the notice. The loop saves at the notice itself, so
    orbax is told there is none (it only logs and times it).
    """

    def reached_preemption(self, step: int) -> bool:
        """Always False: see the class docstring."""
        return False

    # A failure of this host's writes of the save under way, recorded by its finalize
    # thread before that thread waits for the other hosts (`wait_until_finished`).
    _write_failure: BaseException | None = None

    def _wait_for_checkpointers(self) -> None:
        # Orbax's finalize thread: waits for the background writes, raising their error.
        try:
            super()._wait_for_checkpointers()
        except BaseException as exc:
            self._write_failure = exc
            raise

    def wait_until_finished(self) -> None:
        """Orbax's wait, except that a failure of this host's own writes raises at once.

        Why: with several hosts, the finalize thread of a host whose write failed (a full
        disk, a quota) then waits at a barrier for the other hosts, which wait at another
        for its commit. Every host hung, silent, until the barrier's 20-minute timeout;
        the orchestrator took the silence for a preemption and tried again, on every
        attempt. Raised here, the host exits with the error and its slice ends at once.
        The step is never committed: the finalize thread stopped before its commit.

        Raises:
            SaveFailed: this host's writes of the save under way failed.
        """
        finalize = self._finalize_thread.get()
        while finalize is not None and finalize.is_alive():
            if (failure := self._write_failure) is not None:
                raise SaveFailed(
                    f"saving checkpoint step {finalize.step()} failed on host "
                    f"{jax.process_index()}: {type(failure).__name__}: {failure}"
                ) from failure
            finalize.join(0.05)
        super().wait_until_finished()


class SaveFailed(RuntimeError):
    """This host's background writes of a checkpoint failed."""


class OldestFirstManager(TrainingManager):
    """A CheckpointManager that keeps `keep` checkpoints by deleting the oldest just before
    each save instead of after it, so the new checkpoint is written into the memory the old
    one held.

    Why: on a VM whose kernel reports free memory to its hypervisor (free page reporting,
    common on cloud VMs, these machines included), memory freed for more than ~2 s faults
    back in through the host when touched again. Orbax deleted the oldest step once the new
    one committed, seconds before the next save, so every save wrote its whole state into
    such pages: saving the 153 MB state of the `small` model cost 0.33-0.49 s of kernel
    time, against 0.11-0.17 s when the oldest was deleted first (same script, runs
    alternating). On 2 cores that kernel time is taken from training.

    While a save is written, `keep - 1` committed checkpoints remain (never none: use it
    with `keep >= 2`), and `keep` once it commits.
    """

    def __init__(self, directory: epath.PathLike, keep: int, **kwargs: Any):
        if keep < 2:
            raise ValueError(f"keep must be at least 2, got {keep}")
        super().__init__(directory, **kwargs)
        self._keep = keep

    def save(self, step: int, *args: Any, **kwargs: Any) -> bool:
        """Delete the oldest committed steps down to `keep - 1`, then save `step`."""
        self.wait_until_finished()  # what save does first anyway: every step listed is done
        steps = sorted(self.all_steps())
        if step not in steps:  # a step saved again replaces nothing
            for old in steps[: max(0, len(steps) - (self._keep - 1))]:
                self.delete(old)
        return super().save(step, *args, **kwargs)


def checkpoint_dir(run_dir: str) -> epath.Path:
    """Where a run's checkpoints live."""
    return epath.Path(run_dir) / "checkpoints"


def make_manager(
    run_dir: str, keep: int = 3, async_save: bool = True, read_only: bool = False
) -> ocp.CheckpointManager:
    """A CheckpointManager over the run's checkpoint directory, keeping `keep` steps.

    Saving cadence is decided by the training loop (every K steps, the final step and on a
    preemption notice), so the manager saves whenever asked. On local storage with
    `keep >= 2` the oldest step goes just before a save (`OldestFirstManager`); on gs://,
    where no local memory is written, and with `keep == 1`, orbax deletes it after the
    new one commits.
    """
    oldest_first = keep >= 2 and not read_only and "://" not in str(run_dir)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if oldest_first else keep,
        enable_async_checkpointing=async_save,
        # Orbax's own read_only mode logs warnings on every open; not creating and not
        # cleaning is all a reader needs.
        cleanup_tmp_directories=not read_only,
        create=not read_only,
    )
    handlers = item_handlers()
    if oldest_first:
        return OldestFirstManager(
            checkpoint_dir(run_dir), keep, options=options, item_handlers=handlers
        )
    return TrainingManager(checkpoint_dir(run_dir), options=options, item_handlers=handlers)


def item_handlers() -> dict:
    """The handlers of a step's three items."""
    return {
        # Float parameters barely compress (zstd gained ~3% here) while compressing costs
        # the CPU time an async save should leave to training: store them raw.
        "state": ocp.PyTreeCheckpointHandler(use_compression=False),
        "data_iter": ocp.JsonCheckpointHandler(),
        "meta": ocp.JsonCheckpointHandler(),
    }
