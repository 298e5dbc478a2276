"""Config errors that point: each problem on one line, blamed on where its value came from.

pydantic reports a problem by its field; the user fixes a line of the file or a `--set`.
`Blame` finds which: the override that gave the field (or a section holding it), else the
field's line in the file, else its section's line, where a field left at its default would
be added. A problem of the whole config (a cross-field check) names its fields in its
message and is blamed on the first of them the user wrote.

`workloads.config_file` parses the overrides, builds the `Blame` and raises its lines as a
`ConfigError`; this module reads no file, raises nothing and does not import that one.
"""

from __future__ import annotations

import datetime
import re
import shlex

from pydantic import ValidationError

from workloads.config import PipelineConfig
from workloads.config_yaml import did_you_mean


def format_validation_error(err: ValidationError, blame: Blame) -> str:
    """One line per problem: `file:line: field.path: message (got value)`, or `--set: ...
    (from --set key=value)` when the value came from an override.

    Args:
        err: pydantic's error for the config.
        blame: where the config's values came from: its file's lines and its overrides.
    """
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


class Blame:
    """Where a problem's values came from: a line of the file, or a `--set`.

    Args:
        source: the config file's name.
        lines: `line_index` of the file.
        overrides: the `key=value` overrides applied on top of it, in order, each as
            (its key's path, its text), e.g. `(("train", "steps"), "train.steps=200")`.
    """

    def __init__(self, source: str, lines: dict, overrides: list[tuple[tuple, str]]):
        self.source, self.lines, self.overrides = source, lines, overrides
        # The overrides in effect: not one a later override replaced (`--set slice.hosts=2
        # --set slice.hosts=3`: the 3), which had no effect to be blamed for.
        self._live = [
            (p, t)
            for i, (p, t) in enumerate(overrides)
            if not any(p[: len(q)] == q for q, _ in overrides[i + 1 :])
        ]

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
        # An override in effect of the field or of a section holding it, or of a key inside it.
        n = len(field)
        return [t for p, t in self._live if field and (field[: len(p)] == p or p[:n] == field)]

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
