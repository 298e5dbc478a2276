"""Loading a `PipelineConfig` from YAML with `key=value` overrides, with errors that point.

A bad value is reported with the file, the line and the dotted field, e.g.
`configs/x.yaml:12: train.batch_size: Input should be greater than or equal to 1 (got 0)`;
one that came from an override is blamed on it instead, e.g.
`--set: train.batch_size: ... (got 0, from --set train.batch_size=0)`, so a user fixes the
right thing before anything is provisioned. The blaming is `workloads.config_blame`'s.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import Any

import yaml
from pydantic import ValidationError

from workloads.config import PipelineConfig, WorkloadConfig
from workloads.config_blame import Blame, format_validation_error
from workloads.config_memory import memory_problems
from workloads.config_yaml import (
    duplicate_key,
    field_annotation,
    is_text_field,
    key_not_text,
    line_index,
    number_not_decimal,
    strings_as_written,
)
from workloads.rundir import same_directory


class ConfigError(ValueError):
    """A config that cannot train; the message names the file, line and fields."""


# A config is a few kilobytes; more than this is not one (`--config /dev/zero` read until
# the machine's memory ran out, and the OOM killer struck machine-wide).
MAX_CONFIG_BYTES = 10 * 2**20


def _read_bounded(source: str) -> bytes:
    """The bytes of the config file `source`, at most `MAX_CONFIG_BYTES`; a pipe too
    (`--config <(...)`). A FIFO nothing writes to reads as empty, not as a wait without
    end: it is opened without waiting for a writer.

    Raises:
        ConfigError: naming the file, if it cannot be read, is a device or is too large.
    """
    try:
        kind = os.stat(source).st_mode
        if stat.S_ISCHR(kind) or stat.S_ISBLK(kind):
            raise ConfigError(f"{source}: a device, not a config file")
        fd = os.open(source, os.O_RDONLY | (os.O_NONBLOCK if stat.S_ISFIFO(kind) else 0))
        os.set_blocking(fd, True)  # opened: now wait for what a writer sends
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read config: {exc.strerror}") from exc
    if not raw and stat.S_ISFIFO(kind):
        raise ConfigError(f"{source}: a FIFO with no writer when it was read: nothing to read")
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source}: over {MAX_CONFIG_BYTES // 2**20} MiB: not a config file")
    return raw


def read_yaml(source: str) -> tuple[yaml.Node, dict]:
    """The composed node tree and the loaded mapping of the config file `source`.

    Raises:
        ConfigError: naming the file (and line or byte offset) if it cannot be read, is not
            UTF-8, is not YAML, is empty, gives a key twice or is not a mapping.
    """
    raw = _read_bounded(source)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{source}: not UTF-8 text (invalid byte at offset {exc.start})"
        ) from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"{_yaml_where(exc, source, text)}: not valid YAML: {_yaml_problem(exc)}"
        ) from None
    except RecursionError:
        raise ConfigError(f"{source}: not valid YAML: nested too deeply") from None
    if node is None or data is None:
        raise ConfigError(f"{source}: the config is empty (only comments or blank lines)")
    duplicate = duplicate_key(node)
    if duplicate:
        key, line, first = duplicate
        raise ConfigError(f"{source}:{line}: duplicate key {key!r} (first given at line {first})")
    if odd_key := key_not_text(node):
        section, key, line, kind = odd_key
        raise ConfigError(f"{source}:{line}: {_key_not_text(section, key, kind)}")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of config sections")
    if {"pipeline", "run_id", "config_hash"} <= set(data):
        # JSON is YAML: without this, six 'Extra inputs' lines and a wrong guess.
        raise ConfigError(
            f"{source}: a run's config.json (what its workload reads), not a pipeline "
            "config; its 'pipeline' section is one"
        )
    return node, data


def _yaml_where(exc: yaml.YAMLError, source: str, text: str) -> str:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    if mark is not None:
        return f"{source}:{mark.line + 1}"
    position = getattr(exc, "position", None)  # a ReaderError: a character YAML forbids
    return f"{source}:{text.count(chr(10), 0, position) + 1}" if position is not None else source


def _yaml_problem(exc: yaml.YAMLError) -> str:
    problem = getattr(exc, "problem", None)
    if not problem:
        return str(exc).splitlines()[0]
    context, mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    return f"{problem} ({context} at line {mark.line + 1})" if context and mark else problem


def parse_override(text: str) -> tuple[list[str], Any]:
    """`train.steps=200` -> (['train', 'steps'], 200).

    The value is YAML, except that a string field takes the text as typed (`run_name=123`
    is the name "123"; null and quoted strings aside); an empty value is None.

    Raises:
        ConfigError: naming the override if it is not `key=value`, its value not YAML or
            a key given twice in it.
    """
    key, sep, raw = text.partition("=")
    path = [part.strip() for part in key.split(".")]
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected key=value, e.g. train.steps=200")
    if not all(path):
        raise ConfigError(f"--set {text!r}: the key {key.strip()!r} has an empty part")
    raw = raw.strip()
    if not raw:
        return path, None
    annotation = field_annotation(PipelineConfig, path)
    if is_text_field(annotation):
        return path, _text_value(raw)
    try:
        node = yaml.compose(raw, Loader=yaml.SafeLoader)
        value = yaml.safe_load(raw)
    except (yaml.YAMLError, RecursionError) as exc:
        problem = _yaml_problem(exc) if isinstance(exc, yaml.YAMLError) else "nested too deeply"
        raise ConfigError(f"--set {text!r}: the value is not valid YAML: {problem}") from None
    duplicate = duplicate_key(node)  # as in the file: YAML would keep the last one silently
    if duplicate:
        raise ConfigError(f"--set {text!r}: the value gives the key {duplicate[0]!r} twice")
    if odd_key := key_not_text(node):
        section, key, _, kind = odd_key
        raise ConfigError(f"--set {text!r}: {_key_not_text((*path, *section), key, kind)}")
    if odd := number_not_decimal(node, PipelineConfig, tuple(path)):
        where, _, written = odd
        raise ConfigError(f"--set {text!r}: {_not_decimal(where, written)}")
    return path, strings_as_written(node, value, annotation)


def _key_not_text(section: tuple[str, ...], key: str, kind: str) -> str:
    where = f"{'.'.join(section)}: " if section else ""
    return (
        f"{where}the key {key!r} is read by YAML as {kind}, not as a name: "
        f"quote it ('{key}':) if you mean the word"
    )


def _not_decimal(path: tuple[str, ...], text: str) -> str:
    read = yaml.safe_load(text)
    return (
        f"{'.'.join(path)}: {text!r} is not a decimal number: YAML reads it as {read!r} (a "
        "leading 0 is octal, 0x hexadecimal, 0b binary, a colon base 60); write the number "
        "in decimal"
    )


def _text_value(raw: str) -> str | None:
    # For a string field what was typed is the string: as YAML, `a #b` would lose its
    # comment, `a: b` become a mapping and `123` a number. Only null and a quoted string
    # are read as YAML, so `--set run_name=null` means "no name" as in the file.
    if raw[0] in "'\"":
        try:
            node = yaml.compose(raw, Loader=yaml.SafeLoader)
        except yaml.YAMLError:
            return raw
        return node.value if isinstance(node, yaml.ScalarNode) else raw
    return None if raw in _NULLS else raw


_NULLS = frozenset({"~", "null", "Null", "NULL"})


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Set each dotted `key=value` in `data` (a nested dict), creating sections as needed."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {text!r}: {part!r} is not a section")
            node = child
        node[path[-1]] = value
    return data


def _blame(source: str, node: yaml.Node, overrides: list[str]) -> Blame:
    """Where the values of the config in `source` (composed as `node`) came from."""
    paths = [(tuple(parse_override(o)[0]), o) for o in overrides]
    return Blame(source, line_index(node), paths)


def load_config(
    path: str | os.PathLike,
    overrides: list[str] | None = None,
    host_memory: Callable[[], int | None] | None = None,
) -> PipelineConfig:
    """Read, override and validate a pipeline config file.

    Args:
        path: the YAML config file.
        overrides: `key=value` strings (`--set`), applied in order on top of the file.
        host_memory: given, a model whose training state cannot fit the slice's devices is
            refused too (`workloads.config_memory`); it returns the memory of this host, which
            a local slice's devices share (`config_memory.host_memory_bytes`). Not given: a
            config that only finds a run (`tpupipe report`) is not checked against the host.

    Raises:
        ConfigError: with the file and line, or the override, and the field of each problem.
    """
    overrides = overrides or []
    source = os.fspath(path)
    node, data = read_yaml(source)
    if odd := number_not_decimal(node, PipelineConfig):
        where, line, written = odd
        raise ConfigError(f"{source}:{line}: {_not_decimal(where, written)}")
    data = strings_as_written(node, data, PipelineConfig)
    data = apply_overrides(data, overrides)
    try:
        config = PipelineConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, _blame(source, node, overrides))) from None
    problems = memory_problems(config, host_memory()) if host_memory else []
    if problems:
        blame = _blame(source, node, overrides)
        raise ConfigError("\n".join(blame.line((), p, None) for p in problems))
    return config


def load_workload_config(path: str) -> WorkloadConfig:
    """Read the `config.json` the orchestrator wrote for the workload.

    Raises:
        ConfigError: one line naming the file and the first problem (it was not written by
            this version of the orchestrator, or was edited by hand).
    """
    from etils import epath  # gs:// paths too, as on a TPU VM

    try:
        text = epath.Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the workload config: {exc}") from None
    try:
        return WorkloadConfig.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the file"
        msg = first["msg"].removeprefix("Value error, ")
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ConfigError(f"{path}: not a workload config: {where}: {msg}{more}") from None


# What only a run directory holds beside its config.json.
_RUN_DIR_MARKS = ("events.jsonl", "status.json", "checkpoints")


def misplaced_config(path: str, wcfg: WorkloadConfig) -> str | None:
    """Why the workload alone must not use the run's `config.json` at `path`, or None: it
    lies in a run directory other than the `run_dir` it names.

    Why: `config.json` names its run directory (and dataset) by absolute path. Read from a
    copy of a storage root, the workload trained, and evaluation evaluated, the original's
    run directory, writing its status and events; from a moved root, they found no
    checkpoint, or died on a directory that no longer existed. `tpupipe run` of the run
    rewrites the file for where it now is.
    """
    from etils import epath

    here = epath.Path(path).parent
    if same_directory(str(here), wcfg.run_dir):
        return None
    if not any((here / mark).exists() for mark in _RUN_DIR_MARKS):
        return None  # a config.json kept elsewhere (edited, say): it names where to work
    return (
        f"{path} names the run directory {wcfg.run_dir}, not the one it is in ({here}): "
        "the storage root was copied or moved, and the workload would work in the other "
        "directory. `tpupipe run` of this run (its config with this storage.root) rewrites "
        "it for this place"
    )
