"""Loading a `PipelineConfig` from YAML with `key=value` overrides, with errors that point.

A bad value is reported with the file, the line and the dotted field, e.g.
`configs/x.yaml:12: train.batch_size: Input should be greater than or equal to 1`, so a
user fixes it before anything is provisioned.
"""

from __future__ import annotations

import os
import re
from typing import Any

import yaml
from pydantic import ValidationError

from workloads.config import PipelineConfig, WorkloadConfig


class ConfigError(ValueError):
    """A config that cannot train; the message names the file, line and fields."""


def _line_index(node: yaml.Node, prefix: tuple = (), out: dict | None = None) -> dict:
    """Map every dotted key path in a YAML document to its 1-based line number."""
    out = {} if out is None else out
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            path = (*prefix, str(key.value))
            out[path] = key.start_mark.line + 1
            _line_index(value, path, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out[(*prefix, str(i))] = item.start_mark.line + 1
            _line_index(item, (*prefix, str(i)), out)
    return out


def _duplicate_key(node: yaml.Node | None, source: str) -> None:
    """Refuse a key given twice in one mapping (YAML would silently keep the last)."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key, value in node.value:
            line = key.start_mark.line + 1
            if str(key.value) in seen:
                raise ConfigError(
                    f"{source}:{line}: duplicate key {key.value!r} "
                    f"(first given at line {seen[str(key.value)]})"
                )
            seen[str(key.value)] = line
            _duplicate_key(value, source)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _duplicate_key(item, source)


# Keys whose values are names: YAML must not turn `123`, `2024-01-01` or `no` into a number,
# a date or a boolean, so their text is kept as written.
_NAME_KEYS = (("run_name",),)


def _names_as_written(node: yaml.Node | None, data: dict) -> None:
    if not isinstance(node, yaml.MappingNode):
        return
    for key, value in node.value:
        is_name = (key.value,) in _NAME_KEYS and isinstance(value, yaml.ScalarNode)
        if is_name and value.value and not isinstance(data.get(key.value), str):
            data[key.value] = value.value


def parse_override(text: str) -> tuple[list[str], Any]:
    """`train.steps=200` -> (['train', 'steps'], 200); the value is parsed as YAML (a name
    key's value is kept as text)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected key=value, e.g. train.steps=200")
    path = key.strip().split(".")
    if tuple(path) in _NAME_KEYS:
        return path, raw.strip() or None
    try:
        return path, yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"--set {text!r}: the value is not valid YAML: {problem}") from None


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
    err: ValidationError, source: str, lines: dict, overridden: set
) -> str:
    """One line per problem: `file:line: field.path: message`."""
    out = []
    for item in err.errors():
        loc = tuple(str(p) for p in item["loc"])
        msg = item["msg"].removeprefix("Value error, ")
        if loc:
            out.append(f"{_where(loc, source, lines, overridden)}: {'.'.join(loc)}: {msg}")
            continue
        # Cross-field problems come joined from one validator; each names its fields, and
        # the first field named is where the line number comes from.
        for problem in msg.split("; "):
            first = _FIELD.search(problem)
            field_loc = tuple(first.group(0).split(".")) if first else ()
            out.append(f"{_where(field_loc, source, lines, overridden)}: {problem}")
    return "\n".join(out)


_FIELD = re.compile(r"\b[a-z_]+\.[a-z_]+\b")


def _where(loc: tuple, source: str, lines: dict, overridden: set) -> str:
    if loc and ".".join(loc) in overridden:
        return "--set"
    line = next((lines[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in lines), None)
    return f"{source}:{line}" if line else source


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> PipelineConfig:
    """Read, override and validate a pipeline config file.

    Raises:
        ConfigError: with the file, line and field of each problem.
    """
    overrides = overrides or []
    source = os.fspath(path)
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
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
    if node is None or data is None:
        raise ConfigError(f"{source}: the config is empty (only comments or blank lines)")
    _duplicate_key(node, source)
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of config sections")
    _names_as_written(node, data)
    data = apply_overrides(data, overrides)
    lines = _line_index(node)
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as exc:
        overridden = {".".join(parse_override(o)[0]) for o in overrides}
        raise ConfigError(format_validation_error(exc, source, lines, overridden)) from None


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
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ConfigError(
            f"{path}: not a workload config: {where}: {first['msg']}{more}"
        ) from None
