"""A sweep's parameters and its search space: grids and seeded random draws over any
config field, expanded into each trial's overrides (`expand_space`); `tasks.sweep_trials`
applies them to the base config and validates every trial before any runs.

Plain pydantic and functions, no Prefect: `SweepConfig` is the sweep flow's parameter, so
the Prefect UI builds its form from the descriptions here.
"""

from __future__ import annotations

import itertools
import math
import random
import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from workloads.config import PipelineConfig
from workloads.config_types import Float, Int


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Distribution(_Strict):
    """Where a random search draws one field's values from."""

    kind: Literal["uniform", "log_uniform", "int_uniform", "choice"] = Field(
        description="'uniform' or 'log_uniform' floats in [low, high], 'int_uniform' integers "
        "in [low, high], or 'choice': one of `values`."
    )
    low: Float | None = Field(None, description="Lower bound (uniform, log_uniform, int_uniform).")
    high: Float | None = Field(None, description="Upper bound, inclusive.")
    values: list[Any] = Field(default_factory=list, description="The options of a 'choice'.")

    @model_validator(mode="after")
    def _bounds(self) -> Distribution:
        if self.kind == "choice":
            if not self.values:
                raise ValueError("a 'choice' distribution needs values")
            return self
        if self.low is None or self.high is None or self.low > self.high:
            raise ValueError(f"a {self.kind!r} distribution needs low <= high")
        if self.kind == "int_uniform" and math.ceil(self.low) > math.floor(self.high):
            # randint would fail mid-plan with "empty range for randrange()".
            raise ValueError(
                f"an 'int_uniform' distribution over [{self.low}, {self.high}] has no integer "
                "to draw"
            )
        if self.kind == "log_uniform" and self.low <= 0:
            raise ValueError("a 'log_uniform' distribution needs low > 0")
        return self

    def sample(self, rng: random.Random) -> Any:
        """One value drawn with `rng`."""
        if self.kind == "choice":
            return rng.choice(self.values)
        if self.kind == "int_uniform":
            return rng.randint(math.ceil(self.low), math.floor(self.high))
        if self.kind == "log_uniform":
            return math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        return rng.uniform(self.low, self.high)


class SearchSpace(_Strict):
    """Trials = every combination of the grid, times `samples` random draws each.

    Fields are dotted config paths such as `train.learning_rate` or `model.d_model`.
    """

    grid: dict[str, list[Any]] = Field(
        default_factory=dict,
        description="Dotted field -> values; every combination of the values is a trial.",
    )
    random: dict[str, Distribution] = Field(
        default_factory=dict,
        description="Dotted field -> distribution, drawn anew for each trial.",
    )
    samples: Int = Field(
        1, ge=1, le=1000, description="Random draws per grid combination (with `random`)."
    )
    seed: Int = Field(0, description="Seed of the random draws: the same seed, the same trials.")

    @model_validator(mode="after")
    def _disjoint(self) -> SearchSpace:
        if not self.grid and not self.random:
            raise ValueError("the search space varies no field: give space.grid or space.random")
        if "run_name" in self.grid or "run_name" in self.random:
            # Each trial is the run <sweep_name>-tNN: a searched name would be replaced.
            raise ValueError("run_name cannot be searched: trial i runs as <sweep_name>-tNN")
        if self.samples > 1 and not self.random:
            raise ValueError(
                f"space.samples = {self.samples} repeats random draws, but space.random is "
                "empty: every repeat would train the same config"
            )
        both = sorted(set(self.grid) & set(self.random))
        if both:
            raise ValueError(f"fields both in grid and random: {', '.join(both)}")
        empty = sorted(k for k, v in self.grid.items() if not v)
        if empty:
            raise ValueError(f"grid fields with no values: {', '.join(empty)}")
        return self


class SweepConfig(_Strict):
    """A hyperparameter sweep: a base config, a search space, and how trials are admitted."""

    base: PipelineConfig = Field(
        default_factory=PipelineConfig,
        description="The config every trial starts from; its run_name is replaced by the trial's.",
    )
    space: SearchSpace = Field(
        default_factory=lambda: SearchSpace(grid={"train.learning_rate": [1e-3, 3e-3]}),
        description="The fields to vary and their values.",
    )
    sweep_name: str | None = Field(
        None,
        description="Names the sweep and its trials' runs (`<name>-t00`…); running a sweep "
        "of the same name again resumes its trials. Empty: a new name is generated.",
    )
    objective: Literal["eval_loss", "eval_bits_per_byte", "train_loss_last"] = Field(
        "eval_loss", description="The run metric the leaderboard ranks by (lower is better)."
    )
    chip_limit: str = Field(
        "tpu-chips",
        description="Prefect global concurrency limit counting TPU chips; each trial holds "
        "its slice's chip count while it runs.",
    )
    chip_quota: Int | None = Field(
        None,
        ge=1,
        description="Set the limit to this many chips (creating it if needed). Empty: use the "
        "existing limit as it is (`prefect gcl create tpu-chips --limit N`).",
    )
    max_parallel: Int | None = Field(
        None,
        ge=1,
        description="Trials of this sweep run at once: as many lanes, each running trials "
        "one after another and keeping their chips between them. Empty: all of them at once "
        "(the chip limit alone decides).",
    )
    max_trials: Int = Field(
        100,
        ge=1,
        description="Most trials the space may make (grid combinations × samples); a "
        "larger space is refused before any trial runs. Raise it for a sweep that big.",
    )
    trials_via: Literal["auto", "subflow", "deployment"] = Field(
        "auto",
        description="'subflow': trials run in this process; 'deployment': through "
        "run_deployment, on the workers of trial_deployment's pool; 'auto': 'deployment' "
        "when the sweep itself runs from a deployment.",
    )
    trial_deployment: str = Field(
        "tpu-training-pipeline/train",
        description="The deployment (flow name/deployment name) trials run as, with "
        "trials_via 'deployment'.",
    )

    @model_validator(mode="after")
    def _not_too_many_trials(self) -> SweepConfig:
        # Counted, not expanded: a grid typo (a value list pasted twice, one more field)
        # multiplies the trials, each a real training run holding real chips.
        count = trial_count(self.space)
        if count > self.max_trials:
            sizes = " × ".join(f"{k} {len(v)}" for k, v in self.space.grid.items())
            if self.space.random:
                sizes = f"{sizes} × samples {self.space.samples}".removeprefix(" × ")
            raise ValueError(
                f"the space makes {count} trials ({sizes}), more than max_trials = "
                f"{self.max_trials}: raise max_trials if you mean to run them all"
            )
        return self

    @field_validator("sweep_name")
    @classmethod
    def _sweep_name_shape(cls, value: str | None) -> str | None:
        # Checked here rather than as a schema pattern, so an empty name means "generate
        # one" as the description says (and as PipelineConfig.run_name does), in the UI too.
        if value == "":
            return None
        if value is not None and not _SWEEP_NAME.fullmatch(value):
            raise ValueError(
                f"sweep_name {value!r} must be 1-51 lowercase letters, digits or dashes, "
                "starting with a letter or digit (its trials are <sweep_name>-tNN)"
            )
        return value

    @field_validator("trial_deployment")
    @classmethod
    def _deployment_named_in_full(cls, value: str) -> str:
        if len(value.split("/")) != 2 or not all(value.split("/")):
            raise ValueError(
                f"trial_deployment {value!r} must be 'flow name/deployment name', e.g. "
                "tpu-training-pipeline/train"
            )
        return value


_SWEEP_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,50}$")


class Trial(_Strict):
    """One point of the search space and the config it trains."""

    index: int
    run_name: str
    params: dict[str, Any]
    config: PipelineConfig
    chips: int


def trial_count(space: SearchSpace) -> int:
    """How many trials `expand_space(space)` makes, without making them."""
    combos = math.prod(len(values) for values in space.grid.values())
    return combos * (space.samples if space.random else 1)


def expand_space(space: SearchSpace) -> list[dict[str, Any]]:
    """The overrides of every trial, grid combinations in order, random draws seeded.

    Returns:
        One `{dotted field: value}` dict per trial.
    """
    keys = list(space.grid)
    combos = [
        dict(zip(keys, values, strict=True))
        for values in itertools.product(*(space.grid[k] for k in keys))
    ]
    if not space.random:
        return combos
    rng = random.Random(space.seed)
    return [
        {**combo, **{k: dist.sample(rng) for k, dist in space.random.items()}}
        for combo in combos
        for _ in range(space.samples)
    ]
