"""Base class of every config section: unknown keys are errors, never silently ignored."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section. `extra="forbid"` turns a typo such as `learner.lrr` into an error."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ConfigError(ValueError):
    """A config file or override that does not validate; the message names key and source."""
