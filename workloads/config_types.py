"""What every config model shares: unknown keys are errors, and numbers mean numbers.

YAML reads `yes` as True and Python counts True as 1, so a lax `int` field takes
`steps: yes` as one step, `steps: 12.5` fails but `12.0` passes, and a quoted `"12"` is
silently a number. A float that is inf or nan validates and only fails much later, on the
device or in a timer. The field types here refuse all of that at validation time, before
anything is provisioned.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar

from pydantic import (
    AfterValidator,
    AllowInfNan,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Strict,
    field_validator,
    model_validator,
)

I64_MIN, I64_MAX = -(2**63), 2**63 - 1


class StrictModel(BaseModel):
    """Base of the config models: a typo in a YAML file must not be silently ignored, and
    no integer passes the 64 bits every integer field's schema allows (`Int`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # The fields this section fills in by itself from its others (`filled_in`) where they
    # are not given, or given as None: what the Prefect UI's form sends for them unless
    # the user types a value (`form_values`).
    FILLED_IN: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def filled_in(cls, data: dict) -> dict[str, Any]:
        """The values of `FILLED_IN` fields this section gives itself from the others in
        `data` (its input): none here."""
        return {}

    @model_validator(mode="before")
    @classmethod
    def _fill_in(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not cls.FILLED_IN:
            return data
        given = {k: v for k, v in data.items() if not (k in cls.FILLED_IN and v is None)}
        return {**cls.filled_in(given), **given}

    @model_validator(mode="after")
    def _filled_again(self) -> Any:
        # An assignment (`cfg.model.d_model = None`) skips the fill-in above: None stayed,
        # and a sweep built on it failed with a TypeError (probe P). Filled in here too.
        if empty := [k for k in self.FILLED_IN if getattr(self, k) is None]:
            filled = self.filled_in(dict(self.__dict__))
            for name in empty:
                self.__dict__[name] = filled[name]
        return self

    @field_validator("*", mode="after")
    @classmethod
    def _fits_64_bits(cls, value: Any) -> Any:
        # Here, not in `Int`: a validator in the type kept pydantic from putting a field's
        # own `ge` into the JSON schema of an optional field (`Int | None`).
        if (
            isinstance(value, int)
            and not isinstance(value, bool)
            and not I64_MIN <= value <= I64_MAX
        ):
            raise ValueError(f"{value} does not fit a 64-bit integer (at most {I64_MAX})")
        return value


def _not_a_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"{value} is a boolean, not a number")
    return value


class _Within64Bits:
    """An integer's JSON schema bounds, where its field sets none: 64 bits.

    Prefect stores a flow run's parameters and checks them against the deployment's schema
    when the run is created. `train.steps = 10**30` sent from the UI was stored, and every
    later listing of flow runs (the UI's Runs page) failed with HTTP 500 ("Integer exceeds
    64-bit range") until that run was deleted. With a maximum, the API refuses it at once.
    """

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict[str, Any]:
        schema = handler(core_schema)
        if schema.get("type") == "integer":
            schema.setdefault("minimum", I64_MIN)
            schema.setdefault("maximum", I64_MAX)
        return schema


# An integer field: booleans, floats (even 12.0) and strings ("12") are refused, and so is
# one beyond 64 bits (the JSON schema here, `StrictModel` when validating).
Int = Annotated[int, Strict(), _Within64Bits()]

# A float field: finite, never a boolean. Ints and numeric strings stay accepted: PyYAML
# reads `1e-3` (no dot) as a string, and `learning_rate: 1e-3` is how people write it.
Float = Annotated[float, AllowInfNan(False), BeforeValidator(_not_a_bool)]


# Google Cloud's rule for project ids (6-30 characters, with the legacy domain prefix), or
# a project number: the APIs take either.
_PROJECT_ID = re.compile(r"^(?:(?:[a-z0-9.-]+:)?[a-z][a-z0-9-]{4,28}[a-z0-9]|[0-9]{1,20})$")


def _project_id(value: str | None) -> str | None:
    # An empty project (an unset "$PROJECT" in a YAML file) used to pass and fail only at
    # the first API call, after the dataset was sharded and uploaded, without naming the
    # field; a malformed one reached the TPU API.
    if value is None:
        return None
    if not value.strip():
        raise ValueError("is empty: leave it out to use the credentials' project")
    if not _PROJECT_ID.fullmatch(value):
        raise ValueError(
            f"{value!r} is neither a project id (6-30 lowercase letters, digits and "
            "hyphens, starting with a letter, e.g. my-project-123) nor a project number"
        )
    return value


# A Google Cloud project id, or None for the credentials' own project.
ProjectId = Annotated[str | None, AfterValidator(_project_id)]


def form_values(model: BaseModel) -> dict[str, Any]:
    """`model`'s JSON dump with None for each field its section fills in by itself and
    holds what it would fill in: the values a Prefect UI run form starts from.

    The form sends every field it shows. Started from the plain dump, it sent the default
    model's dimensions next to the size a user picked, and those, given explicitly,
    overrode the size: a run of `model.size: small` from the UI trained the tiny model.
    """
    return _unfilled(model, model.model_dump(mode="json"))


def _unfilled(model: BaseModel, dumped: dict) -> dict:
    filled = model.filled_in(dumped) if isinstance(model, StrictModel) else {}
    out = dict(dumped)
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            out[name] = _unfilled(value, dumped[name])
        elif name in filled and filled[name] == dumped[name]:
            out[name] = None
    return out
