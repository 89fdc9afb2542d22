"""Reading JSON that a job did not just write itself: every such file is untrusted input.

A shard `index.json`, a run's `labelled.json` or `teacher.json`, a checkpoint's manifest and the
JSON in a safetensors header may be truncated, of another shape, gigabytes long or nested
200,000 deep (which makes `json.loads` raise RecursionError). `read_json` / `parse_json` bound
the size and the nesting depth and check the top-level type, so each of those is one
`JsonFileError` line naming the file instead of a traceback.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["MAX_DEPTH", "MAX_JSON_BYTES", "JsonFileError", "parse_json", "read_json"]

# Far above any file of ours (a labelled.json of 1.3M image keys is ~35 MB), far below what
# would take the memory of a job: json.loads builds ~10x the text's size in Python objects.
MAX_JSON_BYTES = 128 << 20
# Our files nest 4 levels at most; CPython's parser recurses per level (RecursionError ~1000).
MAX_DEPTH = 32


class JsonFileError(ValueError):
    """A JSON file or field that is unreadable, too large, too deep or of the wrong shape: one
    line naming it."""


def parse_json(
    text: str | bytes,
    source: str,
    expect: type | tuple[type, ...] = dict,
) -> Any:
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


def read_json(
    path: str | os.PathLike,
    expect: type | tuple[type, ...] = dict,
    max_bytes: int = MAX_JSON_BYTES,
) -> Any:
    """`parse_json` of the file at `path`, read only when it holds at most `max_bytes` bytes.
    A missing or unreadable file raises OSError as `open` does."""
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)  # bounded even when the size changes under us
    if len(data) > max_bytes:
        raise JsonFileError(f"{path}: over {max_bytes} bytes, too large for a JSON file of ours")
    return parse_json(data, str(path), expect)


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
    if isinstance(value, tuple):
        return " or ".join(_json_type(t) for t in value)
    kind = value if isinstance(value, type) else type(value)
    return names.get(kind, kind.__name__)
