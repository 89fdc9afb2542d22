"""The errors of the user's making: one line `error: ...`, no traceback, exit 1.

A job's guard (`train.guard`) prints a `UserError` as one line and anything else (a bare
`ValueError`, `KeyError`, `TypeError` from a bug) with its traceback, so that a programming
error is never mistaken for a bad input. Each kind also subclasses the builtin it replaced, so
every `except ValueError` / `except OSError` written before keeps catching it. The specific
errors of a file format or a step (`JsonFileError`, `WeightsFileError`, `ClassifierError`,
`InteropError`, `ArchitectureError`, `DamagedRunError`, ...) subclass one of these kinds.
Torch-free and import-free: the bottom layer, importable from everywhere.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "ConfigError",
    "InputError",
    "JobError",
    "UserError",
    "WriteError",
]


class UserError(Exception):
    """Something the user gave or asked for cannot be used. The message, one line, says what."""


class ConfigError(UserError, ValueError):
    """A config key or flag is unknown, missing, of the wrong type or refused (names the key)."""


class InputError(UserError, ValueError):
    """A source, image, file or directory the user named is missing, damaged or of another
    kind than the job reads (names the path)."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or of another model."""


class WriteError(UserError, OSError):
    """Writing `path` failed for lack of room or permission: a one-line user error."""


class JobError(UserError, RuntimeError):
    """A condition library code detects that ends the job (e.g. too many bad steps in a row):
    its message, which names what to do, is the job's one error line; exit 1."""
