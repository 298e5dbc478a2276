"""The YAML side of a config: where each key is, keys given twice, and text YAML retyped.

The loaded data keeps neither line numbers nor the text as written; PyYAML's composed node
tree keeps both, so these helpers read the tree next to the data. They never raise: the
caller (`workloads.config_file`) turns what they find into errors naming the file.
"""

from __future__ import annotations

import difflib
import re
import types
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel

# Tags PyYAML gives plain scalars that are not text. For a string field the text as written
# is what the user meant: `run_name: 2024-01-01` is a name, `slice.project: 123456` an id.
_RETYPED = frozenset(f"tag:yaml.org,2002:{t}" for t in ("int", "float", "bool", "timestamp"))


def line_index(node: yaml.Node | None) -> dict[tuple[str, ...], int]:
    """Map every key path of a YAML document, e.g. `('train', 'steps')`, to its 1-based line.

    Sequence items are keyed by their index as a string, as pydantic's error locations are.
    """
    out: dict[tuple[str, ...], int] = {}
    for path, key, _ in _entries(node):
        out.setdefault(path, key.start_mark.line + 1)
    return out


def duplicate_key(node: yaml.Node | None) -> tuple[str, int, int] | None:
    """The first key given twice in one mapping, as (key, its line, the line it was first
    given), or None. YAML itself would silently keep the last value."""
    seen: dict[tuple[str, ...], int] = {}
    for path, key, _ in _entries(node):
        line = key.start_mark.line + 1
        if isinstance(key, yaml.ScalarNode) and path in seen:
            return path[-1], line, seen[path]
        seen.setdefault(path, line)
    return None


# Plain keys YAML 1.1 reads as something other than text, and what it reads them as.
_KEY_KINDS = {
    "tag:yaml.org,2002:bool": "the boolean",
    "tag:yaml.org,2002:int": "the number",
    "tag:yaml.org,2002:float": "the number",
    "tag:yaml.org,2002:null": "null",
    "tag:yaml.org,2002:timestamp": "a date",
}


def key_not_text(node: yaml.Node | None) -> tuple[tuple[str, ...], str, int, str] | None:
    """The first mapping key YAML reads as something other than text (`on:`, `yes:`, `1:`,
    `~:`, a date), as (the path of its mapping, the key as written, its line, what YAML
    reads it as), or None. Every key of a config names a field or a label, so such a key
    is a word YAML 1.1 took for a value: pydantic then said `train.1: Keys should be
    strings (got True)`, on the line of the section, not of the key."""
    for path, key, value in _entries(node):
        if key is value:  # a sequence's item, no key
            continue
        if isinstance(key, yaml.ScalarNode) and (kind := _KEY_KINDS.get(key.tag)):
            if kind != "null":
                kind = f"{kind} {yaml.safe_load(key.value)!r}"
            return path[:-1], key.value, key.start_mark.line + 1, kind
    return None


def _entries(node: yaml.Node | None):
    """(path, key or item node, value node) of every mapping entry and sequence item.

    A node reached again through an alias is not walked again: a few lines of anchors can
    otherwise stand for billions of nodes (the loaded data shares them, so it stays small).
    """
    walked: set[int] = set()
    stack: list[tuple[tuple[str, ...], yaml.Node | None]] = [((), node)]
    while stack:
        prefix, current = stack.pop()
        if current is None or id(current) in walked:
            continue
        walked.add(id(current))
        if isinstance(current, yaml.MappingNode):
            children = [((*prefix, str(k.value)), k, v) for k, v in current.value]
        elif isinstance(current, yaml.SequenceNode):
            children = [((*prefix, str(i)), v, v) for i, v in enumerate(current.value)]
        else:
            continue
        yield from children
        # Reversed onto the stack, so a document is walked in reading order.
        stack.extend((path, value) for path, _, value in reversed(children))


# Numbers as a reader reads them: YAML 1.1, which PyYAML reads, also takes `010` as octal 8,
# `0x20`, `0b11`, and `1:30` as base 60 (90); `steps: 010` trained 8 steps, silently.
_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_DECIMAL = {
    _INT: re.compile(r"[-+]?(0|[1-9][0-9_]*)"),
    _FLOAT: re.compile(
        r"[-+]?(\.[0-9_]+|[0-9][0-9_]*(\.[0-9_]*)?)([eE][-+]?[0-9]+)?|[-+]?\.inf|\.nan", re.I
    ),
}


def number_not_decimal(
    node: yaml.Node | None, model: type[BaseModel], prefix: tuple[str, ...] = ()
) -> tuple[tuple[str, ...], int, str] | None:
    """The first number YAML read from another form than decimal, where a field of `model`
    takes it (a string field keeps the text as written), as (key path, line, text), or
    None. `node` is the document, or with `prefix` the value of the field at that path."""
    entries = [((), node, node)] if isinstance(node, yaml.ScalarNode) else _entries(node)
    for path, _, value in entries:
        # A merge key's mapping (`<<: {steps: 010}`) lands in the mapping that holds it.
        full = tuple(part for part in (*prefix, *path) if part != "<<")
        pattern = _DECIMAL.get(value.tag) if isinstance(value, yaml.ScalarNode) else None
        if pattern is None or pattern.fullmatch(value.value.strip()):
            continue
        annotation = field_annotation(model, list(full))
        if annotation is None and full and full[-1].isdigit():  # an item of a list field
            annotation = field_annotation(model, list(full[:-1]))
        # Unknown keys are named by validation; text fields keep the text as written.
        if annotation is not None and _string_kind(annotation) is None:
            return full, value.start_mark.line + 1, value.value
    return None


def strings_as_written(node: yaml.Node | None, value: Any, annotation: Any) -> Any:
    """`value`, loaded from `node`, with YAML's numbers, booleans and dates put back to
    their text wherever the field's type (`annotation`) wants a string.

    Walks pydantic models (their fields by name), `str` fields and `list[str]` fields; null
    stays None, and anything else is left for validation to judge.
    """
    kind = _string_kind(annotation)
    if kind == "str":
        return node.value if isinstance(node, yaml.ScalarNode) and node.tag in _RETYPED else value
    if kind == "list":
        sequence = isinstance(node, yaml.SequenceNode) and isinstance(value, list)
        if sequence and len(node.value) == len(value):
            return [strings_as_written(n, v, str) for n, v in zip(node.value, value, strict=True)]
        return value
    model = _model_of(annotation)
    if model is not None and isinstance(node, yaml.MappingNode) and isinstance(value, dict):
        for key, child in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else None
            if name in model.model_fields and name in value:
                value[name] = strings_as_written(
                    child, value[name], model.model_fields[name].annotation
                )
    return value


def field_annotation(model: type[BaseModel], path: list[str]) -> Any:
    """The type of the field at `path` (e.g. `['slice', 'project']`), or None if no such
    field exists (validation then names the unknown key)."""
    annotation: Any = model
    for part in path:
        current = _model_of(annotation)
        if current is None or part not in current.model_fields:
            return None
        annotation = current.model_fields[part].annotation
    return annotation


def did_you_mean(model: type[BaseModel], path: list[str]) -> str:
    """` (did you mean 'train'?)` for an unknown key at `path` (e.g. `['trian']`,
    `['train', 'learning_rte']`) that is close to a field of its section, else ''."""
    section = _model_of(field_annotation(model, path[:-1])) if path else None
    if section is None or path[-1] in section.model_fields:
        return ""  # a field named as a section (train.steps.x): its own name is no hint
    close = difflib.get_close_matches(path[-1], list(section.model_fields), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def is_text_field(annotation: Any) -> bool:
    """Whether a field of type `annotation` holds one string (`str` or `str | None`)."""
    return _string_kind(annotation) == "str"


def _without_none(annotation: Any) -> tuple:
    if get_origin(annotation) in (Union, types.UnionType):
        return tuple(a for a in get_args(annotation) if a is not type(None))
    return (annotation,)


def _string_kind(annotation: Any) -> str | None:
    args = _without_none(annotation)
    if args == (str,):
        return "str"
    if len(args) == 1 and get_origin(args[0]) is list and get_args(args[0]) == (str,):
        return "list"
    return None


def _model_of(annotation: Any) -> type[BaseModel] | None:
    args = _without_none(annotation)
    if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0]
    return None
