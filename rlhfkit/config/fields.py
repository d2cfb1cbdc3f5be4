"""How a config is read: YAML files and `key.sub=value` overrides merged, then coerced field by field into the frozen
dataclasses of `rlhfkit.config.sections` and `rlhfkit.config.stages`.

`load_config(cls, path, overrides)` builds each section, checking every key, type and range (the `annotated_types`
constraints declared on a field, such as `Ge(1)`); the few rules that join two fields are each section's `check()`.
Any problem raises `ConfigError` naming the full key (`optim.lr`, `data.train`) before a model is loaded.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import operator
import os
import re
import types
import typing
from typing import Annotated, Any, Literal

import yaml
from annotated_types import DocInfo, Ge, Gt, Interval, Le, Len, Lt

from rlhfkit.errors import ConfigError

# Ranges used by many fields. A constraint on `X | None` applies to numbers; null stays allowed.
PosInt = Annotated[int, Ge(1)]
NonNegInt = Annotated[int, Ge(0)]
Positive = Annotated[float, Gt(0)]
NonNeg = Annotated[float, Ge(0)]
Fraction = Annotated[float, Interval(ge=0, lt=1)]
# numpy (seeded by accelerate's set_seed) takes seeds in [0, 2**32); torch would take a negative one silently.
Seed = Annotated[int, Interval(ge=0, lt=2**32)]


class _Refused(ConfigError):
    """A value of the right type refused (NaN/inf, out of range): reported as such even inside `X | None`."""


def _type_phrase(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        return _type_phrase(args[0])
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_phrase(a) for a in args)
    if origin is list:
        return f"a list of {_type_phrase(args[0])}"
    if origin is dict:
        return f"a mapping of {_type_phrase(args[0])} to {_type_phrase(args[1])}"
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string", type(None): "null"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def _number(bound: Any) -> str:
    """A bound as written in the declaration: 4294967296 as 2**32."""
    power_of_two = isinstance(bound, int) and bound > 2**16 and not bound & (bound - 1)
    return f"2**{bound.bit_length() - 1}" if power_of_two else str(bound)


_OPS = {Gt: (">", operator.gt), Ge: (">=", operator.ge), Lt: ("<", operator.lt), Le: ("<=", operator.le)}


def _describe(c: Any) -> str:
    """`Ge(1)` -> ">= 1", `Interval(ge=0, lt=1)` -> "in [0, 1)"."""
    if isinstance(c, Interval):
        (lo, low), (hi, high) = [(type(p), dataclasses.astuple(p)[0]) for p in c]
        return f"in {'[' if lo is Ge else '('}{_number(low)}, {_number(high)}{']' if hi is Le else ')'}"
    return f"{_OPS[type(c)][0]} {_number(dataclasses.astuple(c)[0])}"


def _constrain(value: Any, meta: tuple, key: str, nullable: bool) -> Any:
    """Check `value` against the `annotated_types` constraints declared on its field; the message names `key`, and
    adds the field's `doc(...)` note."""
    notes = "".join(f" ({m.documentation})" for m in meta if isinstance(m, DocInfo))
    for c in meta:
        if isinstance(c, Len):
            if not c.min_length <= len(value) <= c.max_length:
                raise _Refused(f"config key '{key}' must have {c.min_length} items{notes}, got {value!r}")
        elif isinstance(c, Interval) or type(c) in _OPS:
            if not all(_OPS[type(b)][1](value, dataclasses.astuple(b)[0]) for b in (c if isinstance(c, Interval) else [c])):
                raise _Refused(f"config key '{key}' must be {_describe(c)}{' or null' * nullable}{notes}, got {value!r}")
        elif not isinstance(c, DocInfo):  # declared means enforced: a constraint the loader cannot read is a bug
            raise TypeError(f"config key '{key}': unsupported constraint {c!r}")
    return value


def _coerce(value: Any, tp: Any, key: str, nullable: bool = False) -> Any:
    """Return `value` as type `tp` within its declared constraints, or raise ConfigError naming `key`.

    Float fields take finite numbers only: YAML's `.nan` and `.inf` (or `1e999`) would otherwise train on NaN
    (`optim.lr`, `optim.max_grad_norm`) or never stop (`num_epochs`), and no range check can catch NaN.
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        return _constrain(_coerce(value, args[0], key), args[1:], key, nullable)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}': expected a mapping of {tp.__name__} fields, got {value!r}")
        return _build(tp, value, key + ".")
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            try:
                return _coerce(value, arg, key, nullable=type(None) in args)
            except _Refused:
                raise
            except ConfigError:
                continue
    elif origin is list and isinstance(value, (list, tuple)):
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    elif origin is dict and isinstance(value, dict):
        return {_coerce(k, args[0], f"{key}.{k}"): _coerce(v, args[1], f"{key}.{k}") for k, v in value.items()}
    elif origin is Literal and value in args:
        return value
    elif tp is float and not isinstance(value, bool) and (isinstance(value, (int, float)) or (
            isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", value.strip()))):
        # (YAML 1.1 reads `1e-5`, with no dot, as a string; users mean the number.)
        if not math.isfinite(float(value)):
            raise _Refused(f"config key '{key}': expected a finite number, got {value!r}")
        return float(value)
    elif tp in (bool, str, type(None)) and type(value) is tp or tp is int and type(value) is int:
        return value
    raise ConfigError(f"config key '{key}': expected {_type_phrase(tp)}, got {value!r}")


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls, include_extras=True)
    names = [f.name for f in dataclasses.fields(cls)]
    renamed = getattr(cls, "RENAMED", {})  # old key -> new key, for keys a release renamed
    moved = getattr(cls, "MOVED", {})  # old key -> its new dotted path from the top, for keys a release moved
    # KEY_HINTS: key -> what to use instead, for keys users bring from other tools
    for key in data:
        if key in renamed:
            raise ConfigError(f"config key '{prefix}{key}' was renamed: use '{prefix}{renamed[key]}'")
        if key in moved:
            raise ConfigError(f"config key '{prefix}{key}' moved: use '{moved[key]}'")
        if key not in names and key in getattr(cls, "KEY_HINTS", {}):  # a key users bring from elsewhere
            raise ConfigError(f"unknown config key '{prefix}{key}': {cls.KEY_HINTS[key]}")
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else f" (known: {', '.join(names)})"
            raise ConfigError(f"unknown config key '{prefix}{key}'{hint}")
    # Absent sections are built too, so their checks run (e.g. a missing model.name_or_path).
    obj = cls(**{name: _coerce(data.get(name, {}), hints[name], prefix + name) for name in names
                 if name in data or dataclasses.is_dataclass(hints[name])})
    for name, message in obj.check() if callable(getattr(obj, "check", None)) else ():  # plan.check is a field
        raise ConfigError(f"config key '{prefix}{name}' {message}")
    return obj


def parse_overrides(overrides: list[str]) -> dict:
    """`["optim.lr=1e-4", "data.train=x.jsonl"]` -> nested dict; values are parsed as YAML scalars/lists."""
    tree: dict = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override '{item}': expected key.sub=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw  # not valid YAML: take the text as a string
        *parents, last = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}': '{part}' was already given a value")
        node[last] = value
    return tree


def merge(base: dict, update: dict) -> dict:
    """`update` over `base`, nested mappings merged key by key (later wins)."""
    return {**base, **{k: merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
                       for k, v in update.items()}}


MISSING: Any = object()  # `lookup`'s answer for a key that is absent (where a present key may hold None)


def lookup(tree: dict, dotted: str, default: Any = MISSING) -> Any:
    """The value at `dotted` ("model.lora.r") in nested mappings (a config read from YAML, a stage's overrides), or
    `default` where any part of it is absent."""
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


class _DuplicateKeyError(yaml.MarkedYAMLError):
    pass


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, refusing a key given twice in one mapping (SafeLoader silently keeps the last one)."""

    def construct_document(self, node):
        _refuse_duplicate_keys(node, "", set())
        return super().construct_document(node)


def _refuse_duplicate_keys(node: yaml.Node, path: str, seen: set) -> None:
    """Walk the composed tree with each mapping's dotted path, each node once (aliases share nodes). `<<` merge
    keys may be overridden, as YAML intends."""
    if id(node) in seen:
        return
    seen.add(id(node))
    children = []
    if isinstance(node, yaml.SequenceNode):
        children = [(item, f"{path.rstrip('.')}[{i}].") for i, item in enumerate(node.value)]
    if isinstance(node, yaml.MappingNode):
        first_line: dict = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = key_node.value
                if key in first_line:
                    raise _DuplicateKeyError(problem_mark=key_node.start_mark, problem=(
                        f"duplicate key '{path}{key}' (first given on line {first_line[key]}); give each key once"))
                first_line[key] = key_node.start_mark.line + 1
            children.append((value_node, f"{path}{key_node.value}."))
    for child, child_path in children:
        _refuse_duplicate_keys(child, child_path, seen)


def read_yaml(path: str) -> dict:
    """The mapping in the YAML file `path`; a missing file, non-UTF-8 bytes, bad YAML or a duplicate key is a
    ConfigError naming the file and line."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file '{path}' not found")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        data = yaml.load(raw.decode("utf-8-sig"), Loader=_StrictLoader)  # noqa: S506  a SafeLoader; a UTF-8 BOM is dropped
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"config file '{path}' line {line}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); "
                          "save it as UTF-8") from None
    except _DuplicateKeyError as exc:
        raise ConfigError(f"config file '{path}' line {exc.problem_mark.line + 1}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())  # one line (a ReaderError spans two)
        raise ConfigError(f"config file '{path}'{where}: not valid YAML ({problem})") from None
    if not isinstance(data, dict | None):
        raise ConfigError(f"config file '{path}': expected a mapping of keys at the top level, got {type(data).__name__}")
    return data or {}


C = typing.TypeVar("C")


def load_config(cls: type[C], path: str | None = None, overrides: list[str] | None = None, defaults: dict | None = None) -> C:
    """Build a validated, frozen `cls` from `defaults`, a YAML file and `key.sub=value` overrides (later wins)."""
    data = merge(merge(defaults or {}, read_yaml(path) if path else {}), parse_overrides(overrides or []))
    return _build(cls, data)


def config_to_yaml(cfg: Any) -> str:
    """The resolved config as YAML, loadable again by `load_config` (each run saves it as `config.yaml`)."""
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
