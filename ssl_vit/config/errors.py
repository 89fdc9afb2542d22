"""The one error type of config loading and checking."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A config key is unknown, missing or of the wrong type. The message is one line."""
