"""The local places a run creates, checked before anything is spent (`check_local_paths`)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

from infra.metrics.duckdb_file import LONGEST_SUFFIX, database_file_problem
from infra.slices import registry_dir
from tasks.plan import COMPILE_CACHE_ENV, RunPlan, shared_compile_cache
from tasks.run_lock import beyond_mode, locks_dir, owner_and_mode
from tasks.shared_root import check_writable, metrics_field
from workloads.config import PipelineConfig
from workloads.config_file import ConfigError
from workloads.config_infra import place_problem
from workloads.dataset_cache import DATASET_CACHE_ENV, cache_root

# The deepest path a run writes beneath its run directory is a checkpoint's file in orbax's
# temporary directories, e.g. checkpoints/<step>.orbax-checkpoint-tmp-<16 digits>/state.orbax-
# checkpoint-tmp-<16 digits>/ocdbt.process_0/d/<32 hex digits> (~160 bytes), or a parameter's
# own directory with the zarr driver; JAX's cache entries are `<name>-<64 hex digits>-atime`.
BENEATH_BYTES = 256


def check_local_paths(config: PipelineConfig, plan: RunPlan) -> None:
    """The local directories a run creates or writes in can be (beneath a local
    storage.root: `runs/<run_name>`, `datasets/`, `compile_cache/`, `slices/`, `locks/`;
    the dataset cache of a `gs://` one; TPUPIPE_COMPILE_CACHE, when it applies, checked as
    a local storage.root is: no `~`, URI or blank value), the DuckDB file is a database
    (or is not there yet), and the files a run writes in place are writable
    (`tasks.shared_root.check_writable`).

    Each of these passed validation and failed the run later: a storage root below a
    regular file or in a directory this user cannot write at its lock (exit 1), a storage
    root that is a symlink to a missing target (an unmounted disk) with a bare "File
    exists", and a `metrics.path` naming a directory or a file that is not a DuckDB
    database (a 0-byte stub a create on a full disk left) only when landing, after the
    whole training run. In a root a group shares, a teammate's `locks/`, `runs/` or
    metrics file this user may read but not write failed the run with a traceback (or at
    landing), one directory per attempt.

    Raises:
        ConfigError: naming the field (or variable), its value and the path in the way.
    """
    root = {"storage.root": config.storage.root}
    # (fields, directory, whether this run must write in it); paths made absolute: the
    # walk up to an existing directory never ended for a relative one.
    places = [(root, plan.slices_root, True)]
    if "://" not in plan.datasets_root:  # read only where the dataset is complete already
        places.append((root, plan.datasets_root, False))
    else:  # sharded in the local dataset cache, then published
        cache = os.environ.get(DATASET_CACHE_ENV)
        field = DATASET_CACHE_ENV if cache is not None else "the dataset cache"
        places.append(({field: cache or cache_root()}, cache_root(), False))
    shared = shared_compile_cache(config)
    # The checks of a local storage.root: `~/x` became <cwd>/~/x and `gs://b/x` the local
    # directory <cwd>/gs:/b/x, each a cold cache no other run shared.
    if shared is not None and (problem := place_problem(shared, COMPILE_CACHE_ENV, True)):
        raise ConfigError(problem)
    if "://" not in plan.compile_cache_dir:  # JAX runs without a cache it cannot write
        cache_field = {COMPILE_CACHE_ENV: shared} if shared is not None else root
        places.append((cache_field, plan.compile_cache_dir, True))
    if config.metrics.sink == "duckdb":
        field, value = metrics_field(config)
        _check_metrics_file(field, value, plan.metrics_path)
        places.append(({field: value}, os.path.dirname(plan.metrics_path), True))
    if "://" not in plan.run_dir:  # the deepest directory a local run makes
        places.append(({**root, "run_name": plan.run_name}, plan.run_dir, True))
    if config.slice.provider == "local":  # the local slices' registry
        registry = registry_dir(plan.slices_root)
        if os.path.islink(registry):
            # Shared with another root, it had each root take the other's live copy of a
            # run name for its own, and delete it (probe Q).
            raise ConfigError(
                f"storage.root {config.storage.root!r}: {registry} is a symlink to "
                f"{os.readlink(registry)}: the local slices' registry must be the root's "
                "own directory (a registry two roots share has each delete the other's live "
                "slices); make it one, or point storage.root itself at the other root"
            )
        places.append((root, registry, True))
    locks = str(locks_dir(plan))
    if "://" not in plan.storage_root:
        places.append((root, locks, True))
    elif xdg := os.environ.get("XDG_CACHE_HOME"):  # a gs:// root's locks: this user's
        places.append(({"XDG_CACHE_HOME": xdg}, locks, True))
    else:
        places.append(({"the lock directory": locks}, locks, True))
    for fields, path, write in places:
        path = os.path.abspath(path)
        if problem := _too_long(path):
            raise ConfigError(f"{_naming(fields, _shown)}: {problem}")
        if problem := _cannot_create(path, write):
            raise ConfigError(f"{_naming(fields, repr)}: {path} cannot be {problem}")
    check_writable(config, plan)


def _naming(fields: dict[str, str], show: Callable[[str], str]) -> str:
    """ "field = 'value'" for each of `fields`, joined by "and"."""
    return " and ".join(f"{name} = {show(value)}" for name, value in fields.items())


def _check_metrics_file(field: str, value: str, path: str) -> None:
    """Refuse a DuckDB file (`field` = `value`, at absolute `path`) that DuckDB cannot use:
    an existing directory or file that is not a database, or a new file's name too long
    for the temporary name it is created under."""
    if os.path.isdir(path):
        raise ConfigError(
            f"{field} = {value!r}: {path} is a directory; give the DuckDB file's path in "
            "metrics.path, e.g. <dir>/metrics.duckdb"
        )
    if dangling := _dangling_link(path):
        problem = f"it {dangling}"
    elif os.path.exists(path):
        problem = database_file_problem(path)
    else:
        name, name_max = os.path.basename(path), _limit(_existing(path), "PC_NAME_MAX", 255)
        if (length := len(os.fsencode(name)) + len(LONGEST_SUFFIX)) > name_max:
            raise ConfigError(
                f"{field} = {_shown(value)}: the DuckDB file's name {_shown(name)} is too long: "
                f"it is created as <name>{LONGEST_SUFFIX} at most, {length} bytes, over this "
                f"file system's limit of {name_max} (NAME_MAX)"
            )
        if os.path.lexists(wal := f"{path}.wal"):
            # DuckDB replays it into the new file at the landing's first connect, and fails
            # ("WAL does not match database file"), after the whole training run: left by a
            # database moved away without it.
            raise ConfigError(
                f"{field} = {value!r}: {path} does not exist, but its write-ahead log {wal} "
                "does (the log of a database moved or deleted without it): move it away with "
                "that database, or delete it"
            )
        return  # created on first use, complete or not at all (`infra.metrics.duckdb_file`)
    if problem:
        raise ConfigError(f"{field} = {value!r}: {path} is not a usable DuckDB database: {problem}")


def _dangling_link(path: str) -> str | None:
    """ "is a symlink to <target>, which does not exist: ..." if `path` is one, else None."""
    if not os.path.islink(path) or os.path.exists(path):
        return None
    target = os.readlink(path)
    return f"is a symlink to {target}, which does not exist: is its disk mounted?"


def _cannot_create(path: str, write: bool = True) -> str | None:
    """Why the directory at absolute `path` cannot be created (or written, if it exists;
    with `write` False, only what is in the way of it), as "created (...)" or "written
    (...)", or None."""
    existing = path
    # lexists, not exists: a symlink to a missing target (an unmounted disk) is in the way
    # of creating the directory, where exists() walked past it to its writable parent.
    while not os.path.lexists(existing) and existing != os.path.dirname(existing):
        existing = os.path.dirname(existing)
    if dangling := _dangling_link(existing):
        return f"created ({existing} {dangling})"
    if not os.path.isdir(existing):
        return f"created ({existing} is not a directory)"
    if not write and existing == path:
        return None  # there: a run that only reads it needs nothing more
    verb = "written" if existing == path else "created"
    if not os.access(existing, os.W_OK | os.X_OK):
        why = f"{owner_and_mode(existing)}{beyond_mode(existing)}"
        return f"{verb} ({existing} is not writable{why})"
    try:  # root passes os.access everywhere: /proc, a root-squashed NFS mount
        with tempfile.TemporaryFile(dir=existing):  # unnamed where the system allows
            pass
    except OSError as exc:
        return f"{verb} (nothing can be written in {existing}: {exc.strerror or exc})"
    return None


def _too_long(path: str) -> str | None:
    """Why `path`, or what a run writes beneath it, is a name too long for this system.

    Why: a storage root of 3,978 bytes passed validation, and the run failed at its first
    checkpoint save ("File name too long"), its slice and steps spent; a part over 255
    bytes passed `tpupipe validate` as valid, then ended it with a traceback.
    """
    existing = _existing(path)
    name_max, path_max = _limit(existing, "PC_NAME_MAX", 255), _limit(existing, "PC_PATH_MAX", 4096)
    for part in path.split(os.sep):
        if (size := len(os.fsencode(part))) > name_max:
            return (
                f"{_shown(path)}: a part of it, {_shown(part)}, is {size} bytes long, over "
                f"this file system's limit of {name_max} (NAME_MAX)"
            )
    length = len(os.fsencode(path))
    if length + BENEATH_BYTES >= path_max:
        return (
            f"{_shown(path)} is {length} bytes long, and a run writes paths up to {BENEATH_BYTES} "
            f"bytes longer beneath it (checkpoints): over this system's limit of {path_max} "
            "(PATH_MAX)"
        )
    return None


def _existing(path: str) -> str:
    """`path`, or its nearest ancestor that is a directory (where its limits are read)."""
    while not os.path.isdir(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    return path


def _limit(path: str, name: str, default: int) -> int:
    try:
        return os.pathconf(path, name)
    except (OSError, ValueError):
        return default


def _shown(value: str, keep: int = 60) -> str:
    """`value` quoted, its middle elided when long: a limit's message names it, not all of it."""
    if len(value) <= keep:
        return repr(value)
    return repr(f"{value[: keep - 20]}…{value[-20:]}")
