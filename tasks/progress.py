"""Training progress for people watching in the Prefect UI: a progress artifact that
follows the workload's heartbeat, and a loss-curve PNG written into the run directory.

Both read only what the workload already writes (`status.json`, `metrics.jsonl`), so
they add nothing to the workload's interface.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import time
from collections.abc import Callable
from typing import Any
from uuid import UUID

from etils import epath
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from workloads.rundir import EVAL, RunDir, read_json

LOSS_CURVE = "loss_curve.png"
_log = logging.getLogger(__name__)


def progress_key(run_id: str) -> str:
    """The artifact key of a run's training progress (lowercase letters, digits, dashes)."""
    return f"train-{run_id}"[:100].rstrip("-")


class TrainingProgress:
    """A Prefect progress artifact moved by the training heartbeat.

    The first `update` creates the artifact; later ones update it when the bar moves by
    `min_step` percent, at most every `min_interval_s`, or when the phase changes, so a
    fast heartbeat does not flood the API (each call costs the orchestrator and the API
    server CPU that, on a small machine, the workload is using: 100 updates in a 15 s run
    slowed it by ~1 s).
    A failing artifact call is logged and never stops training.
    """

    def __init__(
        self,
        total_steps: int,
        key: str,
        min_step: float = 1.0,
        create: Callable[..., UUID] = create_progress_artifact,
        update: Callable[..., Any] = update_progress_artifact,
        min_interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Follow a run of `total_steps` optimizer steps under the artifact `key`.

        Args:
            total_steps: `train.steps` of the run.
            key: artifact key, see `progress_key`.
            min_step: smallest move of the bar, in percent, worth an API call.
            create: creates the artifact (injectable for tests).
            update: updates it by id (injectable for tests).
            min_interval_s: least seconds between two moves of the bar in one phase.
            clock: monotonic seconds (injectable for tests).
        """
        self.total_steps, self.key, self.min_step = max(total_steps, 1), key, min_step
        self.min_interval_s, self._clock, self._sent_at = min_interval_s, clock, -math.inf
        self._create, self._update = create, update
        self.artifact_id: UUID | None = None
        self.percent = -1.0
        self._phase: str | None = None
        self._step: int | None = None  # the step shown
        self._loss: float | None = None  # and its loss
        self._heard: dict[str, Any] = {}  # the step and loss of the last heartbeat, shown or not
        self._failed = False

    def update(self, heartbeat: dict[str, Any] | None) -> float | None:
        """Move the bar to the heartbeat's step; returns the percent shown (None before
        the first heartbeat with a step, or when nothing changed). A heartbeat without a
        step (a workload's "failed") keeps the step shown and says its phase."""
        if not heartbeat or self._failed:
            return None
        step = heartbeat.get("step")
        if step is not None:
            self._heard = {"step": step, "loss": heartbeat.get("loss")}
        step = self._step if step is None else step
        if step is None:
            return None
        step, phase = int(step), heartbeat.get("phase")
        percent = 100.0 if phase == "finished" else min(100.0, 100.0 * step / self.total_steps)
        now = self._clock()
        moved = percent - self.percent >= self.min_step and now - self._sent_at >= (
            self.min_interval_s
        )
        moved = moved or percent == 100.0 > self.percent
        if self.artifact_id is not None and not moved and phase == self._phase:
            return None
        loss = heartbeat.get("loss", self._loss if step == self._step else None)
        description = self.describe(step, loss, phase)
        try:
            if self.artifact_id is None:
                self.artifact_id = self._create(
                    progress=percent, key=self.key, description=description
                )
            else:
                self._update(self.artifact_id, progress=percent, description=description)
        except Exception:  # the UI's bar is not worth a failed run
            _log.warning("training progress artifact %s stopped updating", self.key, exc_info=True)
            self._failed = True
            return None
        self.percent, self._phase, self._sent_at, self._step = percent, phase, now, step
        self._loss = loss
        return percent

    def end(self, outcome: str, step: int | None = None) -> None:
        """Say how the attempt ended (`finished`, `preempted`, `failed`, `stopped`), at
        `step` or the last heartbeat's step, whatever that heartbeat said: a workload
        killed outright leaves one that says "training", and a stopped orchestrator none.
        Not the step shown: the bar moves every few seconds at most, and a stopped run's
        read "step 10 of 120 (stopped)" where it had saved step 47 (probe R). Nothing
        before the bar exists (an attempt that never trained)."""
        if self.artifact_id is None or self._failed:
            return
        heard = self._heard if step in (None, self._heard.get("step")) else {"step": step}
        # A new phase is always sent; said already (the watch passed on the workload's own
        # last heartbeat, "finished" at its step), nothing is.
        self.update({"step": self._step, **heard, "phase": outcome})

    def describe(self, step: int, loss: float | None, phase: str | None) -> str:
        """The line under the bar: `step 40 of 100, loss 3.2104 (training)`."""
        loss_text = "" if loss is None else f", loss {loss:.4f}"
        return f"step {step} of {self.total_steps}{loss_text} ({phase or 'starting'})"


def write_loss_curve(run_dir: str) -> str | None:
    """Plot the run's training loss (and its final eval loss) to `loss_curve.png` in the
    run directory (local or gs://).

    Args:
        run_dir: the run directory.

    Returns:
        The PNG's path, or None when no step has a finite loss yet.
    """
    rows = [m for m in RunDir(run_dir).step_metrics() if m.get("loss") is not None]
    if not rows:
        return None
    # Imported here: matplotlib costs a second, and only landing needs it.
    import matplotlib

    matplotlib.use("Agg")  # no display on workers
    from matplotlib.figure import Figure

    rows.sort(key=lambda m: m["step"])
    fig = Figure(figsize=(6.4, 3.6), dpi=100, layout="tight")
    ax = fig.add_subplot()
    ax.plot([m["step"] for m in rows], [m["loss"] for m in rows], label="train loss")
    # The eval point only decorates the plot: an unreadable eval.json (a failed run's, left
    # from before) must not fail the landing that draws it.
    evaluation = read_json(epath.Path(run_dir) / EVAL, unreadable_as_missing=True) or {}
    if evaluation.get("loss") is not None:
        ax.scatter(
            [evaluation["step"]],
            [evaluation["loss"]],
            color="C3",
            zorder=3,
            label=f"eval loss {evaluation['loss']:.4f}",
        )
    ax.set(xlabel="step", ylabel="cross-entropy loss", title=epath.Path(run_dir).name)
    ax.grid(alpha=0.3)
    ax.legend()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    path = epath.Path(run_dir) / LOSS_CURVE
    try:
        path.write_bytes(buffer.getvalue())
    except OSError as exc:  # a picture: never the reason a trained, landed run fails
        _log.warning("could not write the loss curve %s: %s", path, exc)
        with contextlib.suppress(OSError):
            path.unlink()  # no half-written picture
        return None
    return str(path)


def loss_curve_link(path: str | None) -> str:
    """A markdown link to the loss-curve PNG for the run summary (`n/a` without one)."""
    if not path:
        return "n/a"
    if path.startswith("gs://"):
        url = "https://storage.cloud.google.com/" + path.removeprefix("gs://")
    else:
        url = epath.Path(path).resolve().as_uri()
    return f"[{LOSS_CURVE}]({url}) (`{path}`)"
