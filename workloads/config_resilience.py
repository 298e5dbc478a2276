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
