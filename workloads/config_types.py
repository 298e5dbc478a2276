"""What every config model shares: unknown keys are errors, and numbers mean numbers.

YAML reads `yes` as True and Python counts True as 1, so a lax `int` field takes
`steps: yes` as one step, `steps: 12.5` fails but `12.0` passes, and a quoted `"12"` is
silently a number. A float that is inf or nan validates and only fails much later, on the
device or in a timer. The field types here refuse all of that at validation time, before
anything is provisioned.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, AllowInfNan, BaseModel, BeforeValidator, ConfigDict, Strict


class StrictModel(BaseModel):
    """Base of the config models: a typo in a YAML file must not be silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _not_a_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"{value} is a boolean, not a number")
    return value


# An integer field: booleans, floats (even 12.0) and strings ("12") are refused.
Int = Annotated[int, Strict()]

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
    if not _PROJECT_ID.match(value):
        raise ValueError(
            f"{value!r} is neither a project id (6-30 lowercase letters, digits and "
            "hyphens, starting with a letter, e.g. my-project-123) nor a project number"
        )
    return value


# A Google Cloud project id, or None for the credentials' own project.
ProjectId = Annotated[str | None, AfterValidator(_project_id)]
