"""Loading a `PipelineConfig` from YAML with `key=value` overrides, with errors that point.

A bad value is reported with the file, the line and the dotted field, e.g.
`configs/x.yaml:12: train.batch_size: Input should be greater than or equal to 1 (got 0)`;
one that came from an override is blamed on it instead, e.g.
`--set: train.batch_size: ... (got 0, from --set train.batch_size=0)`, so a user fixes the
right thing before anything is provisioned.
"""

from __future__ import annotations

import datetime
import os
import re
import shlex
from collections.abc import Callable
from typing import Any

import yaml
from pydantic import ValidationError

from workloads.config import PipelineConfig, WorkloadConfig
from workloads.config_memory import memory_problems
from workloads.config_yaml import (
    did_you_mean,
    duplicate_key,
    field_annotation,
    is_text_field,
    line_index,
    strings_as_written,
)


class ConfigError(ValueError):
    """A config that cannot train; the message names the file, line and fields."""


def read_yaml(source: str) -> tuple[yaml.Node, dict]:
    """The composed node tree and the loaded mapping of the config file `source`.

    Raises:
        ConfigError: naming the file (and line or byte offset) if it cannot be read, is not
            UTF-8, is not YAML, is empty, gives a key twice or is not a mapping.
    """
    try:
        with open(source, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read config: {exc.strerror}") from exc
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
    return path, strings_as_written(node, value, annotation)


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


def format_validation_error(
    err: ValidationError, source: str, lines: dict, overrides: list[str]
) -> str:
    """One line per problem: `file:line: field.path: message (got value)`, or `--set: ...
    (from --set key=value)` when the value came from an override.

    Args:
        err: pydantic's error for the config.
        source: the config file's name.
        lines: `line_index` of the file.
        overrides: the `key=value` overrides applied on top of it.
    """
    blame = _Blame.of(source, lines, overrides)
    out = []
    for item in err.errors():
        loc = tuple(str(p) for p in item["loc"])
        msg = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":  # most often a typo of a field next to it
            msg += did_you_mean(PipelineConfig, list(loc))
        # Cross-field problems come joined from one validator; each names its fields.
        for problem in _PROBLEMS.split(msg) if not loc else [msg]:
            out.append(blame.line(loc, problem, _got(item)))
    return "\n".join(out)


# A dotted field name in a message: `train.batch_size`, `slice.chaos.times`.
_FIELD = re.compile(r"\b[a-z_]+(?:\.[a-z_0-9]+)+")
# Problems joined by "; " (each problem starts with a field; see workloads/config_checks.py).
_PROBLEMS = re.compile(r"; (?=[a-z_]+\.[a-z_])")


def _got(item: dict) -> str | None:
    # Messages of our own validators name the value; pydantic's own ones do not.
    if item["type"] in ("value_error", "missing", "extra_forbidden"):
        return None
    value = item.get("input")
    if isinstance(value, str):
        shown = repr(value)
    elif value is None or isinstance(value, int | float | datetime.date):
        shown = str(value)
    else:
        return None  # a section or a list: the message and the location say enough
    return shown if len(shown) <= 60 else shown[:57] + "..."


class _Blame:
    """Where a problem's values came from: a line of the file, or a `--set`."""

    def __init__(self, source: str, lines: dict, overrides: list[tuple[tuple, str]]):
        self.source, self.lines, self.overrides = source, lines, overrides

    @classmethod
    def of(cls, source: str, lines: dict, overrides: list[str]) -> _Blame:
        return cls(source, lines, [(tuple(parse_override(o)[0]), o) for o in overrides])

    def line(self, loc: tuple, problem: str, got: str | None) -> str:
        named = [
            tuple(f.split("."))
            for f in _FIELD.findall(problem)
            if f.split(".")[0] in PipelineConfig.model_fields
        ]
        # The problem is about the most precise field known: a named field inside the
        # error's location (a section's validator names its fields), else the location.
        inside = [f for f in named if loc and f[: len(loc)] == loc]
        primary = inside[0] if inside else loc or self._written(named)
        from_set = self._from_override(primary)
        where = "--set" if from_set else self._file_line(primary)
        texts = dict.fromkeys(t for f in (primary, *named) for t in self._overrides_of(f))
        notes = [f"got {got}"] if got else []
        if texts:
            sets = ", ".join(f"--set {shlex.quote(t)}" for t in texts)
            notes.append(f"from {sets}" if from_set else f"with {sets}")
        field = f"{'.'.join(loc)}: " if loc else ""
        return f"{where}: {field}{problem}" + (f" ({', '.join(notes)})" if notes else "")

    def _written(self, named: list[tuple]) -> tuple:
        """Of the fields a problem names, the first the user wrote (a line of the file or a
        `--set`), else the first whose section the file has, else the first: the mesh
        left at its defaults named no line, though `slice.devices` had one."""
        for field in named:
            if field in self.lines or self._from_override(field):
                return field
        for field in named:
            if any(field[:n] in self.lines for n in range(len(field) - 1, 0, -1)):
                return field
        return named[0] if named else ()

    def _overrides_of(self, field: tuple) -> list[str]:
        # An override of the field or of a section holding it, or of a key inside it.
        n = len(field)
        return [t for p, t in self.overrides if field and (field[: len(p)] == p or p[:n] == field)]

    def _from_override(self, field: tuple) -> bool:
        if not field:
            return False
        for path, _ in self.overrides:
            if field[: len(path)] == path:
                return True  # set by the override, or inside a section it replaced
            if path[: len(field)] == field and field not in self.lines:
                return True  # a section the override created
        return False

    def _file_line(self, field: tuple) -> str:
        # A field left at its default has no line: its section's line is the place to add it.
        found = next(
            (self.lines[field[:n]] for n in range(len(field), 0, -1) if field[:n] in self.lines),
            None,
        )
        return f"{self.source}:{found}" if found else self.source


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
    data = strings_as_written(node, data, PipelineConfig)
    data = apply_overrides(data, overrides)
    try:
        config = PipelineConfig.model_validate(data)
    except ValidationError as exc:
        message = format_validation_error(exc, source, line_index(node), overrides)
        raise ConfigError(message) from None
    problems = memory_problems(config, host_memory()) if host_memory else []
    if problems:
        blame = _Blame.of(source, line_index(node), overrides)
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
