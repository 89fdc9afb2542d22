"""Reading JSON that a job did not just write itself, and writing JSON that anyone can read.

A shard `index.json`, a run's `labelled.json` or `teacher.json`, a checkpoint's manifest and the
JSON in a safetensors header may be truncated, of another shape, gigabytes long or nested
200,000 deep (which makes `json.loads` raise RecursionError). `read_json` / `parse_json` bound
the size and the nesting depth and check the top-level type, so each of those is one
`JsonFileError` line naming the file instead of a traceback.

`dump_json` is how the project writes JSON: strict (RFC 8259). Python's `json.dumps` writes a
NaN or an infinity as a bare `NaN` / `Infinity`, which is not JSON: `JSON.parse`, jq, Go and
pandas' strict readers refuse the whole file. A value that may legitimately be non-finite (a
metric of a diverged run) is written as null; anywhere else a non-finite float is a bug, and
one `JsonFileError` line naming the file and the key.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from ssl_vit.errors import InputError

__all__ = [
    "MAX_DEPTH",
    "MAX_JSON_BYTES",
    "JsonFileError",
    "dump_json",
    "finite_or_null",
    "parse_json",
    "read_json",
]

# Far above any file of ours (a labelled.json of 1.3M image keys is ~35 MB), far below what
# would take the memory of a job: json.loads builds ~10x the text's size in Python objects.
MAX_JSON_BYTES = 128 << 20
# Our files nest 4 levels at most; CPython's parser recurses per level (RecursionError ~1000).
MAX_DEPTH = 32


class JsonFileError(InputError):
    """A JSON file or field that is unreadable, too large, too deep or of the wrong shape: one
    line naming it."""


def parse_json(text: str | bytes, source: str, expect: type = dict) -> Any:
    """The JSON value of `text`, which must be of type `expect` (a JSON object: dict) and nest
    at most `MAX_DEPTH` levels; JsonFileError naming `source` otherwise."""
    try:
        value = json.loads(text)
    except RecursionError:  # the C parser recurses per level: caught before our own code
        raise JsonFileError(f"{source}: JSON nested deeper than {MAX_DEPTH} levels") from None
    except (ValueError, TypeError) as e:  # JSONDecodeError, bad UTF-8, a 5,000-digit number
        raise JsonFileError(f"{source}: not valid JSON ({str(e).splitlines()[0]})") from None
    if _depth(value, MAX_DEPTH) > MAX_DEPTH:
        raise JsonFileError(f"{source}: JSON nested deeper than {MAX_DEPTH} levels")
    if not isinstance(value, expect):
        raise JsonFileError(f"{source}: expected {_json_type(expect)}, got {_json_type(value)}")
    return value


def read_json(path: str | os.PathLike, expect: type = dict, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """`parse_json` of the file at `path`, read only when it holds at most `max_bytes` bytes.
    A missing or unreadable file raises OSError as `open` does."""
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)  # bounded even when the size changes under us
    if len(data) > max_bytes:
        raise JsonFileError(f"{path}: over {max_bytes} bytes, too large for a JSON file of ours")
    return parse_json(data, str(path), expect)


def dump_json(value: Any, target: str, indent: int | None = None, nan_as_null: bool = False) -> str:
    """`value` as strict JSON text, for the file `target`. A non-finite float is null with
    `nan_as_null` (metrics: a diverged loss), else a JsonFileError naming `target` and its key."""
    if nan_as_null:
        value = finite_or_null(value)
    try:
        return json.dumps(value, indent=indent, allow_nan=False)
    except ValueError:  # "Out of range float values are not JSON compliant"
        where = _non_finite_key(value)
        raise JsonFileError(
            f"{target}: {where} is not a finite number, which JSON cannot hold"
        ) from None


def finite_or_null(value: Any) -> Any:
    """`value` with every non-finite float (NaN, +-inf) replaced by None, in nested dicts,
    lists and tuples (as lists) too."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_null(v) for v in value]
    return value


def _non_finite_key(value: Any) -> str:
    """Where the first non-finite float of `value` is, as `a.b[2]` ('the value' at the top)."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            return f"{where.lstrip('.') or 'the value'} ({node})"
        if isinstance(node, dict):
            stack.extend((v, f"{where}.{k}") for k, v in reversed(node.items()))
        elif isinstance(node, list | tuple):
            stack.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(node))))
    return "a value"


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of a parsed value (a scalar: 0), walked without recursion; stops counting
    past `limit`."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        node, level = stack.pop()
        if not isinstance(node, dict | list):
            continue
        deepest = max(deepest, level + 1)
        if deepest > limit:
            return deepest
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, level + 1) for child in children)
    return deepest


def _json_type(value: Any) -> str:
    """'a JSON object' for dict (or a dict value), 'a JSON array' for list, ..."""
    names = {dict: "a JSON object", list: "a JSON array", str: "a string", bool: "true/false"}
    names.update({int: "a number", float: "a number", type(None): "null"})
    kind = value if isinstance(value, type) else type(value)
    return names.get(kind, kind.__name__)
