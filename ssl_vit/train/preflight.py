"""Checks a job runs before its first step: everything it will touch exists and fits.

A missing few-shot source must surface in the first seconds, not after a million steps: each
check raises `ConfigError` with one line naming the config key and its value.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

from ssl_vit.config import ConfigError
from ssl_vit.data import open_source, resolve_shards

__all__ = ["check_labelled_source", "check_shards", "check_writable", "load_init_encoder"]

_REMOTE = re.compile(r"^(pipe:|[a-zA-Z][a-zA-Z0-9+.-]*://)")  # read only when the job gets there


def check_shards(key: str, spec: str) -> list[str]:
    """The shard URLs of `spec`; every local shard must exist."""
    try:
        return resolve_shards(spec)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"{key}={spec!r}: {e}") from None


def check_labelled_source(key: str, spec: str) -> list[str]:
    """Label names of the labelled source `spec` (shards, image folder, HF dataset).

    Remote shards (pipe:, URLs) without an index are only read when the job gets to them."""
    try:
        source = open_source(spec)
    except (FileNotFoundError, NotADirectoryError, ValueError) as e:
        raise ConfigError(f"{key}={spec!r}: {e}") from None
    if not source.label_names and not _REMOTE.match(spec):
        raise ConfigError(
            f"{key}={spec!r}: has no labels (shards without label names in index.json, or an "
            "image folder without class sub-folders)"
        )
    return list(source.label_names)


def check_writable(key: str, path: str | Path) -> None:
    """`path` (created if missing) accepts new files."""
    if not str(path).strip():  # Path("") is the current directory
        raise ConfigError(f"{key}: empty; name a directory")
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write_test_"):
            pass
    except OSError as e:
        raise ConfigError(f"{key}={str(path)!r}: not writable ({e.strerror or e})") from None


def load_init_encoder(
    key: str, path: str, model_cfg: Any, pos_interp: str, fmt: str
) -> tuple[str, Any]:
    """(the checkpoint used, `encoder_from_checkpoint`'s `LoadedEncoder`): a run directory
    stands for its newest valid checkpoint; failures (missing, invalid, another shape) are a
    one-line error naming `key`."""
    from ssl_vit.train.checkpoint import (
        CheckpointError,
        encoder_from_checkpoint,
        resolve_checkpoint,
    )

    if not os.path.exists(os.path.expanduser(path)):
        raise ConfigError(f"{key}={path!r}: no such file or directory")
    try:
        path = str(resolve_checkpoint(path))
        return path, encoder_from_checkpoint(path, model_cfg, pos_interp, fmt)
    except (CheckpointError, FileNotFoundError, ValueError, KeyError) as e:
        raise ConfigError(f"{key}={path!r}: {e}") from None
