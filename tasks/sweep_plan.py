"""Planning a sweep, all before any trial runs: its name, every trial's config checked
(price, inputs, resumability), the chip limit that admits the trials, and the lock that
keeps one orchestrator per sweep name.

Split from `tasks.sweep`, which runs the trials and still re-exports these names.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NONE
from prefect.client.orchestration import get_client
from prefect.exceptions import ObjectNotFound

from tasks.access import check_sweeps_table
from tasks.plan import plan_run
from tasks.prepare import DatasetError, check_inputs, check_memory
from tasks.pricing import price_for
from tasks.rerun import check_resumable
from tasks.run_lock import sweep_held
from tasks.run_owner import check_run_owner
from tasks.sweep_deployed import ensure_trial_deployment
from tasks.sweep_models import SweepError, SweepPlan
from tasks.sweep_space import SweepConfig, Trial
from tasks.sweep_trials import build_trials
from workloads.config_file import ConfigError
from workloads.config_memory import host_memory_bytes


def new_sweep_name(now: datetime | None = None, token: str | None = None) -> str:
    """A fresh, sortable sweep name: `sweep-20261122-061530-a1b2`."""
    now = now or datetime.now(UTC)
    return f"sweep-{now:%Y%m%d-%H%M%S}-{token or secrets.token_hex(2)}"


def ensure_chip_limit(
    name: str,
    quota: int | None,
    needed: int,
    client: Any,
    warn: Callable[[str], None] | None = None,
) -> int:
    """Make sure the global concurrency limit `name` exists and can admit a trial.

    Args:
        name: the limit's name.
        quota: set the limit to this many chips (created if missing); None: use the
            existing limit unchanged.
        needed: chips of the largest trial.
        client: a synchronous Prefect client.
        warn: told when some of the limit's chips are held already.

    Returns:
        The chips the limit holds.

    Raises:
        SweepError: the limit is missing with no quota given, or smaller than a trial (it
            would wait forever).
    """
    if quota is not None:
        client.upsert_global_concurrency_limit_by_name(name, quota)
    try:
        limit = client.read_global_concurrency_limit_by_name(name)
    except ObjectNotFound:
        raise SweepError(
            f"no global concurrency limit {name!r}: create it with `prefect gcl create "
            f"{name} --limit <chips>`, or give the sweep a chip_quota"
        ) from None
    if not limit.active:
        raise SweepError(f"global concurrency limit {name!r} is inactive: it would admit all")
    if needed > limit.limit:
        raise SweepError(
            f"a trial needs {needed} chips but the limit {name!r} holds {limit.limit}: it "
            "would wait forever"
        )
    held = getattr(limit, "active_slots", 0)
    if held and warn is not None:
        # Prefect's temporary local API keeps slot leases in its own memory: a sweep killed
        # there with SIGKILL leaves its chips held for good, and every later trial waits.
        warn(
            f"{held} of the {limit.limit} chips of limit {name!r} are held now: by sweeps "
            "running, or left by one killed outright; if none runs, free them with "
            f"`prefect gcl update {name} --active-slots 0`"
        )
    return limit.limit


@task(name="plan-sweep", cache_policy=NONE)
def plan_sweep(config: SweepConfig, flow_run_id: str | None, deployed: bool) -> SweepPlan:
    """Name the sweep, validate every trial's config and check the chip limit: all of
    it before any trial runs."""
    sweep_id = config.sweep_name or new_sweep_name()
    trials = build_trials(config, sweep_id)
    via = config.trials_via
    if via == "auto":
        via = "deployment" if deployed else "subflow"
    check_trials(trials, local_inputs=via == "subflow")
    first = trials[0].config
    check_sweeps_table(first, plan_run(first))  # the table the sweep's rows land in
    with get_client(sync_client=True) as client:
        if via == "deployment":
            ensure_trial_deployment(config.trial_deployment, client)
        needed = max(t.chips for t in trials)
        # Said once this sweep holds its name (`sweep_lock`): a second sweep of a running
        # name, refused there, told to free chips its first run legitimately held.
        held: list[str] = []
        chips = ensure_chip_limit(config.chip_limit, config.chip_quota, needed, client, held.append)
    plan = SweepPlan(
        sweep_id=sweep_id,
        flow_run_id=flow_run_id,
        trials=trials,
        via=via,
        trial_deployment=config.trial_deployment,
        chip_limit=config.chip_limit,
        chips=chips,
        objective=config.objective,
        max_parallel=config.max_parallel or len(trials),
        base=config.base,
        held_warning=held[0] if held else None,
    )
    at_once = min(plan.max_parallel, _most_at_once(chips, [t.chips for t in trials]))
    get_run_logger().info(
        "sweep %s: %d trials as %ss, at most %d at once, limit %r of %d chips",
        sweep_id,
        len(trials),
        via,
        at_once,
        plan.chip_limit,
        chips,
    )
    return plan


def _most_at_once(quota: int, chips: list[int]) -> int:
    """The most trials the chip limit admits at once: the smallest ones first (trials of
    mixed slice sizes fit more than the quota over the largest one)."""
    fit, used = 0, 0
    for need in sorted(chips):
        used += need
        if used > quota:
            break
        fit += 1
    return max(1, fit)


@contextmanager
def sweep_lock(plan: SweepPlan) -> Iterator[None]:
    """One orchestrator per sweep name (`tasks.run_lock.sweep_held`: on this machine, and
    across machines for a `gs://` storage root): a second sweep of a name that is running
    stops at once, before any trial.

    Raises:
        RunInUse: naming the sweep and the orchestrator running it.
    """
    first = plan_run(plan.trials[0].config).model_copy(update={"flow_run_id": plan.flow_run_id})
    with sweep_held(first, plan.sweep_id, plan.trials[0].config):
        if plan.held_warning:
            get_run_logger().warning(plan.held_warning)
        yield


def check_trials(trials: list[Trial], local_inputs: bool) -> None:
    """What `tpupipe validate` checks, for every trial, before any trial runs.

    Each trial's price (a `cost.price_table` that does not read), that its model's training
    state fits its slice's devices (`tasks.prepare.check_memory`; a local slice's against
    this host only when the trials run here) and, when the trials run on this machine
    (`local_inputs`), what its config points at: its local sources and tokenizer file
    (`tasks.prepare.check_inputs`). A source that matched no file used to fail its trial
    only once the trials before it had trained. Deployed trials run on a worker, whose
    files and memory are not this machine's: they check their inputs there.

    A sweep run again resumes its trials, so each must also train what its run trained:
    a space changed since the first sweep of this name otherwise let every trial take
    its chips and fail its own validation, and the sweep then replaced the finished
    sweep's `sweeps` rows with failed ones. For the same reason no trial's run name may
    have landed from another run directory (`tasks.run_owner`: a sweep of this name from
    another storage root), checked where the trial's runs row lands from: this machine,
    or BigQuery, which every worker shares.

    Raises:
        ConfigError: naming each trial, its overrides and what is wrong.
    """
    problems, listed = [], {}  # trials of one corpus list it once
    host = host_memory_bytes() if local_inputs else None  # a worker's memory is its own
    for trial in trials:
        try:
            price_for(trial.config)
            check_memory(trial.config, host)
            plan = plan_run(trial.config)
            if local_inputs:
                plan, _ = check_inputs(trial.config, plan, remote=False, listed=listed)
            else:
                check_resumable(trial.config, plan)
            if local_inputs or trial.config.metrics.sink == "bigquery":
                check_run_owner(trial.config, plan)
        except (ConfigError, DatasetError) as exc:
            params = ", ".join(f"{k}={v!r}" for k, v in trial.params.items())
            problems.append(f"trial {trial.index} ({params}): {exc}")
    if problems:
        raise ConfigError("\n".join(problems))
