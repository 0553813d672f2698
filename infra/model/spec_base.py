"""The base of every spec model and the value types several spec modules share (infra/model/spec.py,
infra/model/spec_capacity.py)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from infra.model.spec_patterns import NAME_PATTERN

Name = Annotated[str, Field(pattern=NAME_PATTERN)]
# An amount: a finite number as written (YAML's true, "5" or .inf are refused, not read as 1, 5 or no limit).
Amount = Annotated[float, Field(strict=True, allow_inf_nan=False)]


class SpecModel(BaseModel):
    """Base of every spec model: unknown keys are errors, values are frozen, keys are camelCase."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel,
                              populate_by_name=True)
