"""A job's flags and its `key=value` overrides as one list of overrides, with one rule for a key
named by both (predict, select, few-shot: `--batch-size 8` is `batch_size=8`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ssl_vit.config.loader import T, flat_keys, load_config, parse_overrides
from ssl_vit.errors import ConfigError

__all__ = ["flag_overrides", "given_flags", "load_flagged"]


def flag_overrides(flags: dict[str, tuple[str, Any]], overrides: Sequence[str]) -> list[str]:
    """The flags a job was given (each as typed, e.g. '--batch-size 8' or '--no-copy', -> its
    config key and value) as `key=value` items, then `overrides`. A flag and an override of
    one key say one setting twice: equal values are fine, different ones are a ConfigError
    naming both, wherever each stands on the command line (neither wins silently)."""
    items = {shown: f"{key}={json.dumps(value)}" for shown, (key, value) in flags.items()}
    said = [(other, flat_keys(parse_overrides([other]))) for other in overrides]
    for shown, item in items.items():
        [(key, value)] = flat_keys(parse_overrides([item])).items()
        for other, keys in said:
            if key in keys and keys[key] != value:
                raise ConfigError(f"{shown} and {other} disagree")
    return [*items.values(), *overrides]


def given_flags(args: Any, names: dict[str, str]) -> dict[str, tuple[str, Any]]:
    """The flags of `names` (argparse dest -> config key) given in `args` (not None), for
    `flag_overrides`: {'--batch-size 8': ('batch_size', 8)}."""
    given = {dest: v for dest in names if (v := getattr(args, dest)) is not None}
    return {f"--{dest.replace('_', '-')} {v}": (names[dest], v) for dest, v in given.items()}


def load_flagged(
    cls: type[T], path: str | None, flags: dict[str, tuple[str, Any]], overrides: Sequence[str]
) -> T:
    """`load_config` of the flags and overrides (`flag_overrides`). A check that refuses a key a
    flag set names the flag as it was typed before the key, since the user typed no key:
    "--top-k 0: top_k: must be > 0, got 0"."""
    try:
        return load_config(cls, path, flag_overrides(flags, overrides))
    except ConfigError as e:
        message = str(e)
        for shown, (key, _) in flags.items():
            if any(message.startswith(key + sep) for sep in (":", "=", " ")):
                raise ConfigError(f"{shown}: {message}") from None
        raise
