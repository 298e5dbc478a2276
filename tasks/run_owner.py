"""Is the run name this run lands under free in the metrics sink, or this run's own?

Rows are keyed by run name (`runs.run_id`), while a run's files live in its run directory
under `storage.root`. Two runs of one name in different storage roots that land in one
metrics file or BigQuery dataset (two checkouts, a colleague's run of `demo`, a moved
storage root) replaced each other's rows and mixed them: the second run's row kept the
first's `started_at`, the first run's step rows past the second's final step stayed under
it, and a failed third run landed one row from three runs' results. The run checks,
before anything is sharded or provisioned, that a landed row of its name, if any, names
its own run directory.

A storage root moved elsewhere (another disk, another machine) takes its run directories
along, and with them the invocations their events record. The row of a run whose
directory holds the invocation that landed it, while the directory it names is gone, is
this run's, landed before the move: a moved root's runs were all refused, naming a
directory that no longer existed, and the advice (another run name) threw away their
checkpoints. So is a copy's, landing in its own copy of the metrics file (inside its
root, the default). A copy beside a directory that still exists, landing where the
original lands, is refused, saying so.
"""

from __future__ import annotations

import logging
import os
from datetime import UTC

from etils import epath

from tasks.plan import RunPlan
from workloads.config import PipelineConfig
from workloads.config_file import ConfigError
from workloads.events import event_lines
from workloads.rundir import CONFIG, same_directory

log = logging.getLogger(__name__)

# A DuckDB file another process holds is not waited for, nor a failed BigQuery read
# retried: the check passes (landing waits for its sink, and says so if it must give up).
LOCK_WAIT_S = 0.0


def check_run_owner(config: PipelineConfig, plan: RunPlan, remote: bool = True) -> None:
    """Refuse a run name whose landed `runs` row belongs to another run directory.

    Best effort: a sink that cannot be read (no file or table yet, a held DuckDB file, a
    BigQuery error) passes, as landing reports its own errors. `remote=False` skips a
    BigQuery sink (`tpupipe validate` contacts no cloud service).

    Raises:
        ConfigError: naming the run name, where it landed from and what to change; or a
            DuckDB table landing cannot use (`infra.metrics.duckdb_tables.SchemaError`),
            or a DuckDB file it cannot read at all.
    """
    metrics = config.metrics
    if metrics.sink == "duckdb" and not os.path.exists(plan.metrics_path):
        return  # nothing landed; reading would create the file
    if metrics.sink == "bigquery" and not remote:
        return
    from infra.metrics import build_sink
    from infra.metrics.duckdb_file import unusable_database
    from infra.metrics.duckdb_tables import SchemaError

    try:
        sink = build_sink(metrics.sink, plan.metrics_path, metrics, LOCK_WAIT_S)
        row = sink.read_run(plan.run_id)  # first: a table landing cannot use is named
        if metrics.sink == "duckdb":
            sink.check_readable(plan.run_id)  # a damaged block anywhere fails the landing
    except SchemaError as exc:  # landing would fail on it after the whole training run
        raise ConfigError(f"metrics.path = {plan.metrics_path!r}: {exc}") from None
    except Exception as exc:  # the check is advisory: landing reports a real problem
        if metrics.sink == "duckdb" and unusable_database(exc):
            raise ConfigError(damaged_database(plan.metrics_path, exc)) from None
        log.warning(
            "could not look up run %s in %s: %s", plan.run_id, plan.metrics_path, unread(exc)
        )
        return
    if (problem := owner_problem(config, plan, row)) is not None:
        raise ConfigError(problem)


def unread(exc: BaseException) -> object:
    """Why a check before the run could not read the metrics sink, as its warning says it:
    a DuckDB file another process holds is said as such, not in landing's words ('held
    open ... for over 0 s': the check waits for nothing)."""
    from infra.metrics.duckdb_sink import MetricsLocked

    if isinstance(exc, MetricsLocked):
        return "another process holds it open (landing waits for it, then says which)"
    return exc


def damaged_database(path: str, exc: BaseException) -> str:
    """The refusal of a DuckDB metrics file that cannot be read (torn by a full disk, a
    copy cut short, another DuckDB's storage version): it passed as a warning, and the
    run trained to the end before its landing failed on it, then every rerun again."""
    said = str(exc).split("\n", 1)[0]  # DuckDB's later lines are a storage page's advice
    if "storage version" in said:
        todo = (
            "Open it with the DuckDB version that wrote it (EXPORT DATABASE there, IMPORT "
            "DATABASE here), or give another metrics.path"
        )
    else:
        todo = (
            "Restore the file from a copy, or move it away with its .wal if it has one: a "
            "new one is made, and a run landed in the old one lands again when run again"
        )
    return (
        f"metrics.path = {path!r}: DuckDB cannot read it ({said}), so landing this run's "
        f"metrics would fail after its training. {todo}"
    )


class RunOwnerConflict(RuntimeError):
    """At landing: the run name's row came from another run directory meanwhile (two runs
    of one name in two storage roots at once); nothing of this run was landed."""


def owner_problem(config: PipelineConfig, plan: RunPlan, row, say: bool = True) -> str | None:
    """Why `row`, the landed `runs` row of this run's name (or None), is not this run's to
    replace, or None. A row that names no run directory (landed before the column
    existed) is taken as this run's, as is one landed from where this run's directory
    was moved from (see the module docstring), which is logged unless not `say`."""
    if row is None or row.run_dir is None or same_directory(row.run_dir, plan.run_dir):
        return None
    copied = row.flow_run_id is not None and row.flow_run_id in recorded_invocations(plan.run_dir)
    if copied and (not _exists(row.run_dir) or _own_file(config, plan)):
        (log.info if say else log.debug)(
            "run %s landed from %s; this run directory, %s, holds that run's attempts (its "
            "storage root was %s): its rows in %s will name this one once it lands",
            config.run_name,
            row.run_dir,
            plan.run_dir,
            "copied, with its metrics file" if _exists(row.run_dir) else "moved",
            plan.metrics_path,
        )
        return None
    metrics = config.metrics
    where = (
        f"metrics.path {plan.metrics_path}"
        if metrics.sink == "duckdb"
        else f"metrics.dataset {metrics.dataset}"
    )
    if copied:
        there = "is not looked up" if "://" in row.run_dir else "still exists"
        return (
            f"run_name = {config.run_name!r}: this run directory, {plan.run_dir}, is a copy "
            f"of {row.run_dir} (it holds the attempts that landed from there, in {where}), "
            f"which {there}: both would land under one name. Delete or move away one of "
            "them, or give this one another metrics sink"
        )
    return (
        f"run_name = {config.run_name!r}: a run of this name from another run directory, "
        f"{row.run_dir}, has landed in {where} ({row.status}, {row.final_step} steps); this "
        f"run's directory is {plan.run_dir}. Its rows would be replaced by and mixed with "
        "this run's: give this run another run_name, or another metrics sink"
    )


def earlier_life(plan: RunPlan, row) -> bool:
    """Whether `row`, the landed `runs` row of this run's name, is an earlier run's whose
    directory was at this run's path and was deleted since: the row names this directory,
    but the directory holds neither the invocation that landed the row nor any event from
    before that run ended, and that run got as far as a slice. Its rows are replaced whole
    by this run's landing (`infra.metrics.landing_rule`: `fresh`); kept, the row's start
    predated this run's first event, and a failed landing kept that run's results too."""
    if row is None or row.run_dir is None or row.flow_run_id is None or not row.attempts:
        return False  # an earlier invocation that never provisioned: nothing of it to tell
    if not same_directory(row.run_dir, plan.run_dir):
        return False
    events = event_lines(plan.run_dir)
    if any(e.get("invocation") == row.flow_run_id for e in events):
        return False
    times = [e["time"] for e in events if isinstance(e.get("time"), int | float)]
    if not times:
        # The run had attempts, so its directory had a ledger: gone (the directory deleted,
        # this run stopped before making it anew), unless its config.json says otherwise
        # (only the ledger was lost: the same run).
        return not (epath.Path(plan.run_dir) / CONFIG).exists()
    ended = row.finished_at or row.started_at
    if ended.tzinfo is None:  # stored as UTC
        ended = ended.replace(tzinfo=UTC)
    return min(times) > ended.timestamp()


def recorded_invocations(run_dir: str) -> set[str]:
    """The flow runs (invocations) the orchestrator's events in `run_dir` were written by."""
    return {e["invocation"] for e in event_lines(run_dir) if isinstance(e.get("invocation"), str)}


def _own_file(config: PipelineConfig, plan: RunPlan) -> bool:
    """Whether the run lands in a DuckDB file inside its own storage root (the default):
    a copy of the root copied the file too, so the copy's rows replace none of the
    original's."""
    if config.metrics.sink != "duckdb" or "://" in plan.storage_root:
        return False
    root = os.path.join(os.path.realpath(plan.storage_root), "")
    return os.path.realpath(plan.metrics_path).startswith(root)


def _exists(run_dir: str) -> bool:
    """Whether a run directory is there; a gs:// one is taken as there (never looked up:
    the check reads no bucket), so a root copied between buckets stays refused."""
    return "://" in run_dir or os.path.exists(run_dir)
