"""Step metrics, fetched from the devices in windows and checked before they are trusted.

Fetching a scalar every step would stall the device pipeline; the loop instead keeps the
device arrays of a window of steps and fetches them together, at log and checkpoint steps.
"""

from __future__ import annotations

import math
import time
from typing import Any

import jax
import optax

# Steps the host may dispatch beyond the last one known finished (see MetricsWindow.add).
MAX_STEPS_AHEAD = 2


# What to do about it. A rerun must keep the run's training config (`tasks.rerun`): "lower
# train.learning_rate" alone sent users to a rerun that was refused.
NON_FINITE_HINT = (
    "a rerun resumes from the last checkpoint, which helps only if the cause was transient; "
    "a lower train.learning_rate or other data needs a new run_name"
)


class NonFiniteError(RuntimeError):
    """Loss or gradient norm became NaN/Inf: the run stops and nothing bad is saved.

    `rows`: from `MetricsWindow.flush`, the window's rows up to and including the first
    non-finite step, for the run's metrics (a diverged step stays visible, flagged).
    """

    def __init__(self, message: str, rows: list[dict[str, Any]] | None = None):
        super().__init__(message)
        self.rows = rows or []


class MetricsWindow:
    """Device metrics of the steps since the last flush, and what they cost in time."""

    def __init__(
        self, schedule: optax.Schedule, flops_per_token: float, peak_flops_per_s: float
    ) -> None:
        self.schedule = schedule
        self.flops_per_token = flops_per_token
        self.peak = peak_flops_per_s
        self.pending: list[tuple[int, dict]] = []
        self.started = time.perf_counter()

    def add(self, step: int, metrics: dict) -> None:
        """Remember a step's (still on-device) metrics, and wait until the step
        `MAX_STEPS_AHEAD` before it has finished.

        Without a bound the host dispatches every step between two log steps at once. On
        XLA:CPU, a few hundred queued steps of a program with collectives on 8 devices
        deadlocked (each device's thread stuck in a different collective's rendezvous
        until XLA aborted the process after 40 s: `train.log_every=1000`, mesh 2x2x2, a
        2-core machine). Two steps ahead keeps the devices busy: one runs while the next
        waits. Waiting is not a transfer: nothing is fetched.
        """
        self.pending.append((step, metrics))
        if len(self.pending) > MAX_STEPS_AHEAD:
            jax.block_until_ready(self.pending[-MAX_STEPS_AHEAD - 1][1]["loss"])

    def flush(self) -> list[dict[str, Any]]:
        """Fetch the window in one transfer, check it, and return one row per step.

        Raises:
            NonFiniteError: naming the first step whose loss or gradient norm is NaN/Inf,
                with the rows up to it (`NonFiniteError.rows`): the finite steps before it
                in the window were lost with the error.
        """
        fetched = jax.device_get([m for _, m in self.pending])
        now = time.perf_counter()
        per_step = (now - self.started) / max(len(self.pending), 1)
        window, self.pending, self.started = self.pending, [], now
        rows = []
        for (step, _), m in zip(window, fetched, strict=True):
            rows.append(self._row(step, m, per_step))
            loss, grad_norm = rows[-1]["loss"], rows[-1]["grad_norm"]
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                raise NonFiniteError(
                    f"step {step}: loss={loss} grad_norm={grad_norm} is not finite; stopping "
                    f"without saving this state ({NON_FINITE_HINT})",
                    rows,
                )
        return rows

    def _row(self, step: int, m: dict, step_time_s: float) -> dict[str, Any]:
        loss, grad_norm = float(m["loss"]), float(m["grad_norm"])
        tokens_per_s = float(m["tokens"]) / step_time_s if step_time_s > 0 else None
        model_flops = self.flops_per_token * tokens_per_s if tokens_per_s else None
        return {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "learning_rate": float(self.schedule(step - 1)),
            "step_time_s": step_time_s,
            "tokens_per_s": tokens_per_s,
            "model_flops_per_token": self.flops_per_token,
            "mfu": model_flops / self.peak if model_flops and self.peak else None,
            "time": time.time(),
        }
