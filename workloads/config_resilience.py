"""Config of how a run survives the cloud: retry budgets, and chaos to prove it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from workloads.config_types import Float, Int
from workloads.config_types import StrictModel as _Strict


class ChaosConfig(_Strict):
    """Failures the local slice provider injects, so anyone can reproduce a preemption.

    Chaos is off unless `times` or `fail_creates` is above zero.
    """

    signal: Literal["TERM", "KILL"] = Field(
        "TERM", description="TERM: a preemption notice (saves, exits 75); KILL: a hard loss."
    )
    at_step: Int | None = Field(
        None,
        ge=1,
        description=(
            "Signal once an attempt has trained this many steps (the workload then writes "
            "its heartbeat every step, where the monkey reads the step)."
        ),
    )
    after_s: Float | None = Field(
        None, gt=0, description="Signal this many seconds after an attempt starts."
    )
    during_save: bool = Field(
        False, description="Signal right after a checkpoint save starts, while it is written."
    )
    times: Int = Field(
        0,
        ge=0,
        description="How many attempts of the run are hit (one that ends before its trigger "
        "fires is not counted).",
    )
    fail_creates: Int = Field(
        0, ge=0, description="The run's first N slice creates fail with a capacity error."
    )

    @model_validator(mode="after")
    def _has_a_trigger(self) -> ChaosConfig:
        if self.times and self.at_step is None and self.after_s is None and not self.during_save:
            raise ValueError(
                "slice.chaos.times > 0 needs a trigger: slice.chaos.at_step, "
                "slice.chaos.after_s or slice.chaos.during_save"
            )
        return self


class ResilienceConfig(_Strict):
    """Retry budgets: preemptions are expected, failures are not."""

    max_preemptions: Int = Field(
        20, ge=0, description="Preempted attempts tolerated; each re-provisions and resumes."
    )
    max_failures: Int = Field(
        3,
        ge=0,
        description="Failed slice creates (capacity, quota) retried with backoff before the "
        "run fails; also the attempts whose workload never started on a READY slice. A "
        "workload bug is never retried.",
    )
    max_stalled_attempts: Int = Field(
        3,
        ge=1,
        description="Attempts in a row lost without a preemption notice (killed, or silent) "
        "before committing a checkpoint past the one they resumed from; at this many the run "
        "fails instead of provisioning again: a workload that dies at the same place each "
        "time is more likely out of memory or stuck than preempted.",
    )
    backoff_s: Float = Field(
        10.0,
        gt=0,
        description="Wait after the first failed create, on average; each later wait doubles.",
    )
    backoff_jitter: Float = Field(
        0.5,
        ge=0,
        le=1,
        description="Each wait is drawn within ± this fraction of its average (Prefect's "
        "retry_jitter_factor), so runs that failed together do not retry together.",
    )
    heartbeat_confirm_s: Float = Field(
        30.0,
        ge=0,
        description="A stale heartbeat is checked again after this long before the attempt "
        "is declared lost (a slow status read never triggers a recovery by itself).",
    )

    @model_validator(mode="after")
    def _waits_a_run_can_take(self) -> ResilienceConfig:
        # Past what a datetime holds, the first retry crashed in Prefect's scheduling
        # ("OverflowError: Python int too large to convert to C int"), hiding the failure
        # it retried; well before that, a run would sit idle for months.
        if (
            self.max_failures
            and (
                longest := self.backoff_s
                * 2.0 ** (self.max_failures - 1)
                * (1 + self.backoff_jitter)
            )
            > MAX_BACKOFF_S
        ):
            raise ValueError(
                f"resilience.backoff_s = {self.backoff_s:g}, doubled for each of "
                f"resilience.max_failures = {self.max_failures} retries (± backoff_jitter "
                f"{self.backoff_jitter:g}), waits up to {longest:.3g} s before the last, more "
                f"than a week ({MAX_BACKOFF_S:g} s): lower either"
            )
        return self


MAX_BACKOFF_S = 7 * 86400.0  # the longest wait before a retried create
