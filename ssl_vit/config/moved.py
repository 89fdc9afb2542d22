"""Config keys that moved or were dropped: old files keep loading, with one deprecation line.

A job's schema lists its `moved_keys` (`Moved(old, new)`, dotted paths from the job's top
level). Before a YAML file or the overrides are checked against the schema, each old key found
is moved to its new place (or dropped, `new=None`) and one WARNING line names both; giving the
old and the new key in one place is an error naming both (which one would win is a guess).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ssl_vit.config.errors import ConfigError

__all__ = ["Moved", "apply_moves", "tensorboard_tracker"]

log = logging.getLogger("ssl_vit.config")


@dataclass(frozen=True)
class Moved:
    """`old` (dotted key) now lives at `new` (None: dropped, it did nothing); `convert` maps an
    old value to the new one; `append`: a list joined to one already at `new` (two old keys
    that both meant trackers), instead of an error."""

    old: str
    new: str | None
    why: str = ""
    convert: Callable[[Any], Any] | None = None
    append: bool = False


def tensorboard_tracker(value: Any) -> Any:
    """The old `tensorboard: true` -> the tracker list [tensorboard] (false: none)."""
    return ["tensorboard"] if value is True else [] if value is False else value


def _pop(data: dict[str, Any], path: str) -> tuple[bool, Any]:
    *parents, leaf = path.split(".")
    node = data
    for p in parents:
        node = node.get(p) if isinstance(node, dict) else None
    if not isinstance(node, dict) or leaf not in node:
        return False, None
    return True, node.pop(leaf)


def _put(data: dict[str, Any], path: str, value: Any, old: str, append: bool = False) -> None:
    *parents, leaf = path.split(".")
    node = data
    for p in parents:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):  # e.g. the new section given as a scalar: its own error
            return
        node = child
    if leaf in node:
        if append and isinstance(node[leaf], list) and isinstance(value, list):
            node[leaf] = list(dict.fromkeys([*node[leaf], *value]))
            return
        raise ConfigError(f"{old} and {path}: the same setting twice ({old} is its old name)")
    node[leaf] = value


def apply_moves(data: dict[str, Any], moves: Iterable[Moved]) -> dict[str, Any]:
    """`data` (a nested config dict, changed in place and returned) with every old key of
    `moves` moved to its new place, one deprecation WARNING each."""
    for m in moves:
        found, value = _pop(data, m.old)
        if not found:
            continue
        if m.new is not None and m.new.startswith(m.old + ".") and isinstance(value, dict):
            _put(data, m.old, value, m.old)  # already the new section (`compile: {mode: ..}`)
            continue
        why = f" ({m.why})" if m.why else ""
        if m.new is None:
            log.warning("config key %s is deprecated and ignored%s", m.old, why)
            continue
        _put(data, m.new, m.convert(value) if m.convert else value, m.old, m.append)
        log.warning("config key %s is deprecated: use %s%s", m.old, m.new, why)
    return data
