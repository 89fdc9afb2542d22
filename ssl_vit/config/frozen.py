"""Configs are read-only once checked: every derived value is resolved before `freeze`, and a
job that needs a changed copy makes one with `dataclasses.replace`."""

from __future__ import annotations

import dataclasses
from typing import Any

from ssl_vit.config.errors import ConfigError

__all__ = ["Frozen", "FrozenConfigError", "freeze"]


class FrozenConfigError(ConfigError, AttributeError):
    """A field of a checked (frozen) config was set."""


class Frozen:
    """Base of the config sections: settable while the loader builds and checks them, not
    after `freeze` (a plain dataclass, so `validate` may still resolve its own fields)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen", False):
            raise FrozenConfigError(
                f"{type(self).__name__}.{name}: the config is frozen after its checks; "
                "make a changed copy with dataclasses.replace"
            )
        object.__setattr__(self, name, value)


def freeze(cfg: Any) -> Any:
    """`cfg` and every config section in it made read-only; returns `cfg`."""
    if isinstance(cfg, Frozen):
        object.__setattr__(cfg, "_frozen", True)
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        for f in dataclasses.fields(cfg):
            freeze(getattr(cfg, f.name))
    return cfg
