"""Configs are read-only once checked: every derived value is resolved before `freeze`, and a
job that needs a changed copy makes one with `dataclasses.replace` and checks it again
(`validated`): `validate()` only raises, so it may run on any copy."""

from __future__ import annotations

import dataclasses
from typing import Any

from ssl_vit.errors import ConfigError

__all__ = ["Frozen", "FrozenConfigError", "freeze", "validated"]


class FrozenConfigError(ConfigError, AttributeError):
    """A field of a checked (frozen) config was set."""


class Frozen:
    """Base of the config sections: settable while the loader builds them, not after `freeze`
    (a plain dataclass: `dataclasses.replace` makes changed copies; `resolved()` derives values
    in a copy before `validate()`, which only checks)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen", False):
            raise FrozenConfigError(
                f"{type(self).__name__}.{name}: the config is frozen after its checks; "
                "make a changed copy with dataclasses.replace"
            )
        object.__setattr__(self, name, value)


def freeze(cfg: Any) -> Any:
    """`cfg` and every config section in it (lists of sections too: the study's variants)
    made read-only; returns `cfg`."""
    for section in _sections(cfg):
        freeze(section)
    if isinstance(cfg, Frozen):
        object.__setattr__(cfg, "_frozen", True)
    return cfg


def validated(cfg: Any) -> Any:
    """`cfg` after the checks the loader runs (every section's `validate()`, innermost first,
    as `from_dict` builds them): a changed copy is refused as a loaded config would be."""
    for section in _sections(cfg):
        validated(section)
    if hasattr(cfg, "validate") and not isinstance(cfg, type):
        cfg.validate()
    return cfg


def _sections(cfg: Any) -> list[Any]:
    """The values of a config's fields, and the items of a list of sections."""
    if isinstance(cfg, (list, tuple)):
        return list(cfg)
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return [getattr(cfg, f.name) for f in dataclasses.fields(cfg)]
    return []
