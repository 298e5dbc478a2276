"""A sweep's trials: each point of its search space applied to the base config and
validated, so that a bad point fails the sweep before any trial runs, naming the trial, its
overrides and the field at fault (the search space itself: `tasks.sweep_space`).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from tasks.sweep_space import SweepConfig, Trial, expand_space
from workloads.config import PipelineConfig
from workloads.config_file import ConfigError
from workloads.config_yaml import did_you_mean


def trial_chips(config: PipelineConfig) -> int:
    """Chips a trial's slice occupies: its device count (one JAX device per TPU chip on
    every generation, see `workloads.config.tpu_topology`)."""
    return config.slice.devices


def build_trials(config: SweepConfig, sweep_id: str) -> list[Trial]:
    """Every trial's validated config, so a bad point fails the sweep before any trial runs.

    Raises:
        ConfigError: naming each trial, the overrides it got and what is wrong with them.
    """
    # Less its fill-ins: what the base's sections filled in themselves (a size preset's
    # dimensions, a TPU type's devices, a mesh axis given as -1) fills in again from each
    # trial's values.
    base = config.base.without_fill_ins()
    trials, problems = [], []
    for index, params in enumerate(expand_space(config.space)):
        run_name = f"{sweep_id}-t{index:02d}"
        try:
            data = json.loads(json.dumps(base))  # a deep copy per trial
            for key, value in [*params.items(), ("run_name", run_name)]:
                _set_dotted(data, key, value)
            cfg = PipelineConfig.model_validate(data)
        except (ValidationError, KeyError) as exc:
            problems.append(f"trial {index} ({_params_text(params)}): {_problem_text(exc)}")
            continue
        trials.append(
            Trial(index=index, run_name=run_name, params=params, config=cfg, chips=trial_chips(cfg))
        )
    if not problems:
        problems = _same_configs(trials)
    if problems:
        raise ConfigError("\n".join(problems))
    if not trials:
        raise ConfigError("the search space has no trials")
    return trials


def _same_configs(trials: list[Trial]) -> list[str]:
    """Trials that would train one config twice (a grid value listed twice, 1 and 1.0 for
    a float field, a random draw repeated, `model.size` over a base whose dimensions are
    all given): twice the chips for one result."""
    first: dict[str, Trial] = {}
    problems = []
    for trial in trials:
        # model.size is a label: the dimensions it filled in are compared; the sharding
        # workers give the same dataset.
        exclude = {"run_name": True, "model": {"size"}, "dataset": {"workers"}}
        key = trial.config.model_dump_json(exclude=exclude)
        if key in first:
            other = first[key]
            problems.append(
                f"trials {other.index} and {trial.index} ({_params_text(trial.params)}) train "
                "the same config: drop the repeated value, or vary seed (a size the "
                "base's explicit dimensions override changes nothing)"
            )
        else:
            first[key] = trial
    return problems


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    *sections, name = key.split(".")
    node = data
    for depth, part in enumerate(sections, start=1):
        node = node.get(part)
        if not isinstance(node, dict):
            hint = did_you_mean(PipelineConfig, sections[:depth])
            raise KeyError(f"{key}: {part!r} is not a config section{hint}")
    node[name] = value


def _params_text(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in params.items()) or "the base config"


def _problem_text(exc: Exception) -> str:
    if isinstance(exc, KeyError):
        return str(exc.args[0])
    return "; ".join(
        (".".join(map(str, e["loc"])) + ": " if e["loc"] else "")
        + e["msg"].removeprefix("Value error, ")
        + (did_you_mean(PipelineConfig, [str(p) for p in e["loc"]]) if _extra(e) else "")
        for e in exc.errors()
    )


def _extra(error: dict) -> bool:
    return error["type"] == "extra_forbidden"
