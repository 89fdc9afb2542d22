"""Typed YAML configs: dataclass schemas, strict loading and `key.sub=value` overrides.

Every key is a typed dataclass field with a default. Loading rejects unknown keys and values
of the wrong type with a one-line `ConfigError` naming the key, so a typo stops a job before
it starts instead of silently training with a default (nanoGPT's configurator does the same).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

from ssl_vit.atomic import write_text
from ssl_vit.config.frozen import freeze
from ssl_vit.config.shipped import find_config
from ssl_vit.errors import ConfigError

__all__ = [
    "ConfigError",
    "flat_keys",
    "from_dict",
    "load_config",
    "parse_overrides",
    "read_yaml_file",
    "to_dict",
    "save_config",
]

T = TypeVar("T")


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`, converting only where lossless (int->float)."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue  # the next member of the union; none fits: the line below
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: expected one of {list(args)}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{key}: expected {len(args)} values, got {len(value)}")
            return tuple(
                _coerce(v, a, f"{key}[{i}]")
                for i, (v, a) in enumerate(zip(value, args, strict=True))
            )
        item = args[0] if args else Any
        out = [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return from_dict(tp, value, prefix=f"{key}.")
    if tp is Any:
        return value
    if tp is float and not isinstance(value, bool) and isinstance(value, (int, float, str)):
        # YAML 1.1 reads `1e-3` (no dot) as a string; accept any numeric float spelling.
        try:
            number = float(value)
        except (ValueError, OverflowError):  # an int past 1e308 too
            raise ConfigError(f"{key}: expected float, got {_clip(repr(value))}") from None
        if not math.isfinite(number):  # inf / nan would end a job "done" with a NaN loss
            raise ConfigError(f"{key}: must be a finite number, got {value!r}")
        return number
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int and isinstance(value, bool):
        raise ConfigError(f"{key}: expected int, got {value!r}")
    if tp is int and isinstance(value, int) and not -(2**63) <= value < 2**63:
        # Counters and sizes reach torch and NumPy as 64-bit integers.
        raise ConfigError(f"{key}: out of range (an integer of {len(str(abs(value)))} digits)")
    if not isinstance(value, tp):
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    return value


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass `cls` from a nested dict; unknown keys and wrong types raise ConfigError."""
    preset = getattr(cls, "preset_defaults", None)
    if preset is not None:  # e.g. a fine-tuning recipe: its defaults go under the given keys
        data = _merge(preset(data), data)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(f"unknown config key '{prefix}{key}' (known: {sorted(names)})")
    kwargs = {k: _coerce(v, hints[k], f"{prefix}{k}") for k, v in data.items()}
    try:
        obj = cls(**kwargs)
    except TypeError as e:  # a field without default that was not given
        raise ConfigError(f"{prefix or 'config'}: {e}") from None
    if hasattr(obj, "resolved"):  # derived fields (a model variant's shape), in a copy
        obj = obj.resolved()
    if hasattr(obj, "validate"):
        obj.validate()
    return obj


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain dict/list/scalars, tuples as lists (YAML and JSON friendly)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


def flat_keys(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dict -> {"model.width": 128, ...} (dotted keys, the leaves as they are)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`["train.steps=10", "model.width=64"]` -> nested dict; values are parsed as YAML."""
    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            msg = f"override '{item}' is not of the form key.sub=value"
            if os.path.exists(item):  # `ssl-vit predict runs/ft photos`: a path without its flag
                msg += ": a path goes after its flag (--help lists them)"
            raise ConfigError(msg)
        node = out
        *parents, leaf = key.strip().lstrip("-").split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}' conflicts with another override")
        node[leaf] = _parse_yaml(raw, f"override '{_clip(item)}'") if raw.strip() else ""
    return out


def _clip(item: str, keep: int = 60) -> str:
    """An override as an error line shows it: the key and the start of a long value."""
    return item if len(item) <= keep + 20 else f"{item[:keep]}... ({len(item)} characters)"


# Values a config may expand to through YAML aliases (`*name`): a few hundred in a real config,
# 10^9 in a 438-byte alias bomb (whose repr in an error line would take gigabytes). The same
# bound on the values written out, counted while parsing, and on the size and nesting of a file:
# a 36 MB flow mapping took 109 s and 3.6 GB to parse in full (PyYAML is pure Python here).
MAX_YAML_VALUES = 10_000
MAX_YAML_DEPTH = 32
MAX_CONFIG_BYTES = 1 << 20  # a config is a few KB


class _Refused(yaml.MarkedYAMLError):
    """Well-formed YAML that a config may not be (a duplicated key, an alias bomb)."""


def _expanded_size(node: yaml.Node, sizes: dict[int, int], pending: set[int]) -> int:
    """Values under `node` with every alias expanded (shared nodes counted once per use)."""
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in pending:
        raise _Refused(problem="a recursive YAML alias", problem_mark=node.start_mark)
    pending.add(id(node))
    children = node.value if isinstance(node, yaml.SequenceNode) else []
    if isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    size = 1
    for child in children:
        size += _expanded_size(child, sizes, pending)
        if size > MAX_YAML_VALUES:
            raise _Refused(
                problem=f"YAML aliases expand to more than {MAX_YAML_VALUES} values",
                problem_mark=node.start_mark,
            )
    pending.discard(id(node))
    sizes[id(node)] = size
    return size


class _ConfigLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key given twice in one mapping (YAML keeps the last
    silently), more than `MAX_YAML_VALUES` values or `MAX_YAML_DEPTH` levels (as they are
    parsed: a huge file fails after its first values) and aliases that expand beyond
    `MAX_YAML_VALUES` values, and names an integer too long for Python's `int`."""

    _nodes, _depth = 0, 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        self._nodes += 1
        problem = None
        if self._nodes > MAX_YAML_VALUES:
            problem = f"more than {MAX_YAML_VALUES} values (a config has a few hundred)"
        elif self._depth >= MAX_YAML_DEPTH:
            problem = f"more than {MAX_YAML_DEPTH} levels of nesting (a config has 3 or 4)"
        if problem is not None:
            raise _Refused(problem=problem, problem_mark=self.peek_event().start_mark)
        self._depth += 1  # the composer recurses per level: bounded before RecursionError
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # over int()'s digit limit: its message names no key
            problem = f"an integer of {len(node.value)} characters is out of range"
            raise _Refused(problem=problem, problem_mark=node.start_mark) from None

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        _expanded_size(node, {}, set())
        return self.construct_document(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` merges, overridable
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: SafeLoader's own error
                continue
            if duplicate:
                problem = f"key {key!r} given twice (YAML would keep only the last)"
                raise _Refused(problem=problem, problem_mark=key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


_ConfigLoader.add_constructor("tag:yaml.org,2002:int", _ConfigLoader.construct_yaml_int)


def read_yaml_file(path: str | Path) -> Any:
    """The YAML value of the config file at `path` (`_parse_yaml`), read only when it holds at
    most `MAX_CONFIG_BYTES` bytes; ConfigError naming it otherwise (OSError as `open`)."""
    with open(path, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        size = os.path.getsize(path)
        raise ConfigError(
            f"{path}: {size} bytes, too large for a config (at most {MAX_CONFIG_BYTES} bytes)"
        )
    try:
        text = data.decode()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return _parse_yaml(text, str(path))


def _parse_yaml(text: str, where: str) -> Any:
    """`yaml.safe_load(text)`, refusing duplicated keys and alias bombs; malformed or refused
    YAML is one ConfigError line naming `where` and the place of the problem."""
    try:
        return yaml.load(text, Loader=_ConfigLoader)  # a SafeLoader: plain data only
    except _Refused as e:
        mark = e.problem_mark
        raise ConfigError(
            f"{where}, line {mark.line + 1}, column {mark.column + 1}: {e.problem}"
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: malformed YAML{at}: {problem}") from None


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = _merge(merged[k], v)
        else:
            merged[k] = v
    return merged


def load_config(cls: type[T], path: str | Path | None, overrides: list[str] = ()) -> T:
    """Load YAML `path` (optional) into `cls`, apply `key.sub=value` overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        path = find_config(path)  # a file, or the name of a shipped config (pretrain/smoke)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        data = read_yaml_file(path) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
    overrides_data = parse_overrides(list(overrides))
    data, overrides_data = _checkpoint_keys(cls, data, overrides_data)
    return freeze(from_dict(cls, _merge(data, overrides_data)))  # read-only once checked


def _checkpoint_keys(
    cls: type, data: dict[str, Any], overrides: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(file data, overrides) for a job that loads a checkpoint (`init.checkpoint` not `none`):
    the schema's `checkpoint_keys` (the encoder's shape, its pixel normalisation) are the
    checkpoint's. A config file's are dropped (they serve from-scratch runs); those the
    overrides do not give are null (read from the checkpoint by the job, which checks the
    given ones against it)."""
    keys = getattr(cls, "checkpoint_keys", ())
    init = _merge(data, overrides).get("init")
    checkpoint = init.get("checkpoint", "none") if isinstance(init, dict) else "none"
    if not keys or not isinstance(checkpoint, str) or checkpoint.strip().lower() == "none":
        return data, overrides
    data, overrides = copy.deepcopy(data), copy.deepcopy(overrides)
    for key in keys:
        *parents, leaf = key.split(".")
        section = _section(data, parents)
        if section is not None:
            section.pop(leaf, None)
        node = overrides
        for p in parents:
            node = node.setdefault(p, {}) if isinstance(node, dict) else None
        # Left unset: null, unless the default means unset already (model.width, model.variant).
        if isinstance(node, dict) and leaf not in node:
            if _field_default(cls, key) not in (None, ""):
                node[leaf] = None
    return data, overrides


def _section(data: dict[str, Any], path: list[str]) -> dict[str, Any] | None:
    """The mapping at `path` in the nested dict `data`, or None."""
    for p in path:
        data = data.get(p) if isinstance(data, dict) else None
    return data if isinstance(data, dict) else None


def _field_default(cls: type, key: str) -> Any:
    """The default of the schema field at the dotted `key` (e.g. `model.mlp_ratio`)."""
    *parents, leaf = key.split(".")
    for p in parents:
        cls = typing.get_type_hints(cls)[p]
    f = next(f for f in dataclasses.fields(cls) if f.name == leaf)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def save_config(cfg: Any, path: str | Path) -> None:
    """The resolved config as YAML, written atomically (`atomic.write_text`)."""
    write_text(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))
