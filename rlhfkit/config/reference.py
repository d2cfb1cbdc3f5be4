"""The config reference, generated from the declarations: every key of every stage with its type, default, allowed
range and meaning. `python -m rlhfkit.config.reference` rewrites `docs/reference/config.md`;
`rlhfkit <stage> --help-config` prints one stage's keys.

A key's meaning is written where the key is declared (`rlhfkit/config/sections.py`, `stages.py`), in one of the
forms the declarations already use, read here from the source:
    the comment on the field's own line:         lr: NonNeg = 1e-5  # peak learning rate (AdamW)
    the comment lines directly above the field:  # Tokens in prompt + response ...
                                                  max_length: Annotated[int, Ge(2)] = 1024
and any `doc("...")` note among its constraints (which the loader also puts in its error messages). A section's
meaning is its class docstring, or the comment on the field that holds it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import os
import sys
import textwrap
import tokenize
import types
import typing
from typing import Annotated, Any, Literal

from annotated_types import DocInfo, Interval, Len

from rlhfkit.config.fields import _OPS, _describe
from rlhfkit.stages import STAGES, config_class

PAGE = os.path.join("docs", "reference", "config.md")
COMMAND = "python -m rlhfkit.config.reference"


@dataclasses.dataclass(frozen=True)
class Key:
    """One config key as a user writes it (`optim.lr`), with what its declaration says."""

    name: str
    type: str  # as in Python: `int | None`, `"nf4" | "fp4"`, `list[str]`
    default: str  # as in YAML: `null`, `true`, `1e-05`, `"all-linear"`, `[]`
    range: str  # the declared constraints: `>= 1`, `in [0, 1)`, `2 items, each in [0, 1)`; "" when none
    doc: str  # the declaration's comment and doc() notes, one line; "" when none


@dataclasses.dataclass(frozen=True)
class Section:
    """The keys under one prefix (`model.lora`) that one dataclass declares; "" is a config's top-level keys."""

    prefix: str
    cls: type
    doc: str
    keys: tuple[Key, ...]


@functools.lru_cache(maxsize=None)
def _comments(cls: type) -> dict[str, str]:
    """Field name -> the comments written beside its declaration in `cls`'s own source (see the module docstring)."""
    lines, first = inspect.getsourcelines(cls)
    source = textwrap.dedent("".join(lines))
    comment_at: dict[int, str] = {}  # line (1-based, in `source`) -> its comment's text
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comment_at[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    found = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above, line = [], node.lineno - 1
            while line in comment_at and line not in code_lines:  # the comment block directly above
                above.insert(0, comment_at[line])
                line -= 1
            inline = [comment_at[n] for n in range(node.lineno, node.end_lineno + 1) if n in comment_at]
            found[node.target.id] = " ".join(above + inline)
    return found


def _owner(cls: type, name: str) -> type:
    """The class in `cls`'s hierarchy that declares field `name` (where its comment is)."""
    return next(c for c in cls.__mro__ if name in c.__dict__.get("__annotations__", {}))


def _strip(tp: Any) -> tuple[Any, list]:
    """`Annotated[T, *meta]` -> (T, meta); anything else -> (tp, [])."""
    if typing.get_origin(tp) is Annotated:
        return typing.get_args(tp)[0], list(typing.get_args(tp)[1:])
    return tp, []


def _type_text(tp: Any) -> str:
    tp, _ = _strip(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_text(a) for a in args)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_text(a) for a in args)}]"
    return "None" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _constraints(tp: Any) -> list:
    """Every constraint declared on `tp`, on its union members and on a list's items (marked by a leading "each")."""
    tp, meta = _strip(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        meta = meta + [c for a in args for c in _constraints(a)]
    if origin is list:
        meta = meta + ["each"] + _constraints(args[0])
    return meta


def _range_text(tp: Any) -> str:
    parts = []
    for c in _constraints(tp):
        if c == "each":
            parts.append("each")
        elif isinstance(c, Len):
            parts.append(f"{c.min_length} items" if c.min_length == c.max_length else f"{c.min_length}-{c.max_length} items")
        elif isinstance(c, Interval) or type(c) in _OPS:
            parts.append(_describe(c))
    text = ", ".join(parts).replace("each, ", "each ")
    return "" if text in ("each", "") else text.removesuffix(", each")


def _yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def sections(cls: type, prefix: str = "", defaults: dict | None = None) -> list[Section]:
    """The keys of config class `cls`, one `Section` per dataclass (its own scalar keys first, then each nested section
    in declaration order). `defaults` replace declared defaults by full key (a stage's own, e.g. `algo.algorithm`)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    own, nested = [], []
    for f in dataclasses.fields(cls):
        name, tp = prefix + f.name, hints[f.name]
        if dataclasses.is_dataclass(tp):
            nested.extend(sections(tp, name + ".", defaults))
            continue
        notes = [m.documentation for m in _constraints(tp) if isinstance(m, DocInfo)]
        comment = _comments(_owner(cls, f.name)).get(f.name, "")
        doc = comment + "".join(f" ({n})" for n in notes) if comment else "; ".join(notes)
        default = (defaults or {}).get(name, _default(f))
        own.append(Key(name, _type_text(tp), _yaml_value(default), _range_text(tp), doc))
    return [Section(prefix.rstrip("."), cls, section_doc(cls), tuple(own))] + nested


def section_doc(cls: type) -> str:
    """A section class's docstring, in one line (dataclasses give undocumented classes a signature: none)."""
    doc = cls.__dict__.get("__doc__") or ""
    return "" if doc.startswith(cls.__name__ + "(") else " ".join(doc.split())


def stage_defaults(stage: str) -> dict:
    """Defaults a stage sets beyond its config class's: an online command runs its namesake algorithm."""
    from rlhfkit.algorithms import family_members

    family = family_members(stage)
    return {"algo.algorithm": family[0]} if family else {}


def stage_keys(stage: str) -> list[Key]:
    """Every key of `rlhfkit <stage>`, in declaration order."""
    return [k for s in sections(config_class(stage), "", stage_defaults(stage)) for k in s.keys]


def help_text(stage: str) -> str:
    """`rlhfkit <stage> --help-config`: each key, its type, default and range, then its meaning indented."""
    out = [f"rlhfkit {stage}: config keys (YAML file and key.sub=value overrides)", ""]
    for k in stage_keys(stage):
        out.append(f"{k.name}: {k.type} = {k.default}" + (f"  ({k.range})" if k.range else ""))
        out.extend(textwrap.wrap(k.doc, 100, initial_indent="    ", subsequent_indent="    "))
    return "\n".join(out) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(section: Section) -> list[str]:
    rows = ["| key | type | default | range | meaning |", "|---|---|---|---|---|"]
    for k in section.keys:
        meaning = k.doc[:1].upper() + k.doc[1:]
        rows.append(f"| `{k.name}` | `{_cell(k.type)}` | `{_cell(k.default)}` | {_cell(k.range)} | {_cell(meaning)} |")
    return rows


def _anchor(section: Section, stages: list[str]) -> str:
    """A stable anchor: the prefix, plus the first stage for a table only some stages share (`algo-ppo`, `top-sft`)."""
    return (section.prefix.replace(".", "-") or "top") + ("" if _shared(section) else "-" + stages[0])


def _shared(section: Section) -> bool:
    """A section whose class is the same wherever the prefix appears (model, data, ...): listed once."""
    return section.prefix not in ("", "algo")


def page() -> str:
    """docs/reference/config.md: every stage's keys; a table that several stages share (a section, the same top-level
    keys) is listed once."""
    groups: dict[type, list[str]] = {}
    for stage in STAGES:  # stages of one config class share its keys (ppo, rloo, grpo, reinforce_pp)
        groups.setdefault(config_class(stage), []).append(stage)
    out = ["# Config reference", "",
           f"<!-- Generated from rlhfkit/config/ by `{COMMAND}`: edit the declarations, not this page. -->", "",
           "Every key of every stage: its type, its default, the range the loader enforces, and what it means. A run "
           "reads a YAML file (`--config`) and then `key.sub=value` overrides; an unknown key, a wrong type or a value "
           "out of range stops the run with one line naming the key. `rlhfkit <stage> --help-config` prints one "
           "stage's keys; `rlhfkit <stage> --print-config` prints the resolved values of a config.", "",
           "## Stages", ""]
    shared: dict[str, Section] = {}
    own: dict[tuple, tuple[Section, list[str]]] = {}  # (prefix, keys) -> the section and every stage that has it
    for cls, stages in groups.items():
        links = []
        for s in sections(cls, "", stage_defaults(stages[0])):
            if not s.keys:
                continue
            if _shared(s):
                shared.setdefault(s.prefix, s)
                assert shared[s.prefix].cls is s.cls, f"{s.prefix} is declared by two classes"
                anchor = _anchor(s, stages)
            else:
                first, users = own.setdefault((s.prefix, s.keys), (s, []))
                users.extend(stages)
                anchor = _anchor(first, users)
            links.append(f"[`{s.prefix or 'top level'}`](#{anchor})")
        out += [f"- **{', '.join(f'`{s}`' for s in stages)}**: " + ", ".join(links)]
    out += ["", "## Keys of each stage", ""]
    for s, stages in own.values():
        title = f"`{s.prefix}.*`" if s.prefix else "top-level keys"
        out += [f"### {title}: {', '.join(stages)} {{#{_anchor(s, stages)}}}", ""]
        out += ([s.doc, ""] if s.doc else []) + _table(s) + [""]
    out += ["## Shared sections", ""]
    for s in shared.values():
        out += [f"### `{s.prefix}.*` {{#{_anchor(s, [])}}}", ""] + ([s.doc, ""] if s.doc else []) + _table(s) + [""]
    return "\n".join(out).rstrip() + "\n"


def undocumented() -> list[str]:
    """Keys of any stage whose declaration carries no meaning."""
    return sorted({k.name + f" ({stage})" for stage in STAGES for k in stage_keys(stage) if not k.doc})


def write_page(path: str, text: str, command: str, argv: list[str]) -> int:
    """Write a generated page (default) or, with `--check` in `argv`, exit 1 when the committed page differs."""
    if "--check" in argv:
        with open(path, encoding="utf-8") as f:
            if f.read() != text:
                print(f"{path} is out of date: run `{command}`", file=sys.stderr)
                return 1
        return 0
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Write the page (default) or, with `--check`, exit 1 when the committed page differs from the code's."""
    return write_page(PAGE, page(), COMMAND, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
