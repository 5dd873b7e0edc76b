"""ConfigError, and the range check the config groups share."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is missing or out of range; the message names the field."""


def _positive(group: str, obj, names) -> None:
    for name in names:
        if getattr(obj, name) <= 0:
            raise ConfigError(f"{group}.{name} must be > 0, got {getattr(obj, name)}")
