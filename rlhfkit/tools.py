"""Tools and environments under TRL 1.16's contract (`GRPOTrainer(tools=..., environment_factory=...)`). No model code.

- A tool is a registered Python callable (sync or `async def`), described to the model by the JSON schema transformers'
  `get_json_schema` makes from its signature and Google-style docstring. A function it cannot describe is refused when
  the run starts (`describe`), not at the first prompt; two tools of one name are refused.
- `environment_factory` is a class (any callable returning an instance) or a dict of them chosen per row by the row's
  `environment` column. Each episode gets its own instance (instances are pooled: made once, `reset` before each
  episode, as TRL does); its public methods (all but `reset`, `get_reward` and `_private` ones) are that episode's
  tools beside the standalone ones, and an optional `get_reward()` is a reward source (`Environments.reward_functions`).
- A call runs only a registered callable, looked up by its exact name, with arguments that fit the tool's schema
  (`fit_arguments`); nothing the model writes is evaluated. A call that names no tool or whose arguments do not fit is
  malformed: never run, answered with an error message the model reads.
- A tool that raises, runs past `timeout_s` or returns what `str()` refuses becomes `str({"error": message})` in the
  episode, TRL's convention, and a counted failure (`Outcome`). The calls of one episode run one after another (an
  environment's state depends on their order), the episodes' calls concurrently, each call in its own daemon thread: a
  hung tool is abandoned at its deadline (Python cannot stop a thread), never waited for, and an environment whose
  method was abandoned leaves the pool (`Environments.discard`). A function tool must therefore be thread-safe.
- A result longer than `max_result_tokens` tokens is cut there and marked (`cap_result`).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from rlhfkit.errors import UserError, first_line

# The methods of an environment that are not tools (TRL's names).
ENVIRONMENT_HOOKS = ("reset", "get_reward")


def import_ref(ref: str, label: str, what: str = "object"):
    """The object `ref` = "module:name" names (tools, environments, reward functions), `label` naming it in errors
    and `what` saying what was expected ("function", "class").

    Importing runs the module's code, so a config that names one is code: load configs you trust. The working
    directory is importable while the module imports (as for `python -m`), then `sys.path` is restored, so the user's
    own modules never shadow later imports; import what the object needs at the module's top level."""
    import importlib
    import os
    import sys

    module_name, _, name = ref.partition(":")
    saved = list(sys.path)
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"{label}: cannot import module '{module_name}' ({first_line(exc)})") from None
    except Exception as exc:  # the module's own code failed at import: the user's to fix
        raise UserError(f"{label}: cannot import module '{module_name}' ({first_line(exc, with_type=True)})") from None
    finally:
        sys.path[:] = saved
    found = module
    for part in name.split("."):  # a qualified name: Class.method
        found = getattr(found, part, None)
    if found is None:
        raise UserError(f"{label}: module '{module_name}' has no {what} '{name}'")
    return found


@dataclass(frozen=True)
class Tool:
    """A registered callable: its name (the function's `__name__`, the one the model calls) and JSON schema."""

    name: str
    fn: Callable
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters": {...}}}

    @property
    def parameters(self) -> dict:
        return self.schema["function"].get("parameters") or {"type": "object", "properties": {}}


def describe(fn: Callable, where: str = "tool") -> Tool:
    """`fn` as a `Tool`, its schema from transformers' `get_json_schema`; a function it cannot describe (no docstring,
    an argument without a type hint or an `Args:` line) is a one-line UserError naming the function."""
    from transformers.utils import get_json_schema

    name = getattr(fn, "__name__", None)
    label = getattr(fn, "__qualname__", None) or repr(fn)
    if not callable(fn) or not name:
        raise UserError(f"{where} {label} is not a named function: a tool is a function or method with type hints and a "
                        "Google-style docstring")
    try:
        schema = get_json_schema(fn)
    except Exception as exc:  # transformers' DocstringParsingException, TypeHintParsingException, ...
        raise UserError(f"{where} {label}: transformers' get_json_schema cannot describe it ({first_line(exc)}); a tool "
                        "needs a type hint on every argument and a Google-style docstring with an Args: line for each") \
            from exc
    return Tool(name, fn, schema)


def unique_tools(tools: list[Tool], where: str) -> dict[str, Tool]:
    """name -> tool; two tools of one name are a UserError (a call names exactly one tool)."""
    named: dict[str, Tool] = {}
    for tool in tools:
        if tool.name in named:
            raise UserError(f"{where}: two tools are named '{tool.name}' ({named[tool.name].fn!r} and {tool.fn!r}); a "
                            "model calls a tool by its name, so names must be unique")
        named[tool.name] = tool
    return named


def environment_methods(instance) -> list[Callable]:
    """The public methods of an environment that are tools: listed on the class (so properties are not evaluated)."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in ENVIRONMENT_HOOKS and not name.startswith("_")]


class Environments:
    """`environment_factory`: one factory, or a dict name -> factory chosen per row by its `environment` column.

    Built once at start: one instance of each factory is made and checked (a callable `reset`, describable methods, no
    name shared with a standalone tool). `take` hands each episode its own instance from a pool (made on demand, reused
    across steps: TRL's "construct once, reset often").
    """

    def __init__(self, factory, tools: dict[str, Tool]):
        self.factories = dict(factory) if isinstance(factory, dict) else {None: factory}
        self.routed = isinstance(factory, dict)
        if self.routed and not self.factories:
            raise UserError("environment_factory is an empty dict: give at least one name -> factory")
        self.pools: dict[Any, list] = {}
        self.methods: dict[Any, dict[str, Tool]] = {}  # each environment's method tools, bound to its first instance
        self.classes: list[type] = []  # the distinct classes made, for their get_reward reward sources
        for name, make in self.factories.items():
            instance = self._make(name, make)
            label = f"environment_factory{'' if name is None else f'[{name!r}]'}"
            if not callable(getattr(instance, "reset", None)):
                raise UserError(f"{label}: {type(instance).__name__} has no callable reset(); TRL's contract resets each "
                                "environment with the row's fields before its episode")
            methods = [describe(m, f"{label} method") for m in environment_methods(instance)]
            unique_tools(list(tools.values()) + methods, label)
            self.methods[name] = {m.name: m for m in methods}
            self.pools[name] = [instance]
            if type(instance) not in self.classes:
                self.classes.append(type(instance))

    def tools_of(self, instance, name) -> dict[str, Tool]:
        """Environment `name`'s method tools bound to `instance` (an episode's own environment)."""
        return {n: Tool(n, getattr(instance, n), t.schema) for n, t in self.methods[name].items()}

    def _make(self, name, make):
        if not callable(make):
            raise UserError(f"environment_factory{'' if name is None else f'[{name!r}]'} is not callable: give a class "
                            "or a function that returns an environment")
        return make()

    def take(self, rows: list[dict]) -> list[tuple[Any, Any]]:
        """(environment name, instance) per row, no instance handed out twice in this call, for the row's environment
        (its `environment` column when the factories are a dict: a missing or unknown name is a UserError)."""
        given: dict[Any, int] = {}
        out = []
        for i, row in enumerate(rows):
            name = self.environment_of(row, i)
            pool, index = self.pools[name], given.get(name, 0)
            if index == len(pool):
                pool.append(self._make(name, self.factories[name]))
            out.append((name, pool[index]))
            given[name] = index + 1
        return out

    def discard(self, name, instance) -> None:
        """Takes `instance` out of environment `name`'s pool (a call of it was abandoned at its timeout and may still
        change it): a later episode gets a new one."""
        self.pools[name] = [e for e in self.pools[name] if e is not instance]

    def environment_of(self, row: dict, i: int):
        if not self.routed:
            return None
        name = row.get("environment")
        if name not in self.factories:
            raise UserError(f"prompt row {i}: environment={name!r} names none of environment_factory's environments "
                            f"({', '.join(map(repr, self.factories))}); a dict of factories picks one by the row's "
                            "'environment' column")
        return name

    def reset_arguments(self, row: dict) -> dict:
        """What `reset(**row)` gets: the row's fields, without the `environment` column that routed it."""
        return {k: v for k, v in row.items() if not (self.routed and k == "environment")}

    def reward_functions(self) -> list[Callable]:
        """A reward function under TRL's contract for each environment class with a `get_reward()`, named after the
        class: a row whose environment is exactly that class is scored by it, any other row is None (not applicable)."""
        functions = []
        for cls in self.classes:
            if not callable(getattr(cls, "get_reward", None)):
                continue

            def get_reward(environments, _cls=cls, **_):
                return [awaited(e.get_reward()) if type(e) is _cls else None for e in environments]

            get_reward.__name__ = cls.__name__
            functions.append(get_reward)
        return functions


class Toolbox:
    """What a run's episodes may call: the standalone `functions` and the `environment_factory` (either may be empty).

    `names` lists every tool once, standalone first then each environment's methods (the K columns of
    `ToolCounts.per_tool`); `episode_tools` gives one episode its tools."""

    def __init__(self, functions=(), environment_factory=None):
        if callable(functions) or isinstance(functions, (str, bytes)):
            raise UserError("tools must be a list of functions, got a single " + type(functions).__name__)
        self.functions = unique_tools([describe(fn) for fn in functions], "tools")
        self.environments = Environments(environment_factory, self.functions) if environment_factory is not None \
            else None
        names = list(self.functions)
        for methods in (self.environments.methods.values() if self.environments else ()):
            names += [n for n in methods if n not in names]
        self.names = tuple(names)
        if not self.names and self.environments is None:
            raise UserError("no tools: give tools=[functions] or an environment_factory")

    def episode_tools(self, environment=None, name=None, listed: list[dict] | None = None) -> dict[str, Tool]:
        """The standalone tools, plus the methods of the episode's own `environment` (of environment `name`); only
        those its record's `tools` column names when it has one (`listed`, JSON schemas)."""
        tools = self.functions if environment is None else {**self.functions, **self.environments.tools_of(environment, name)}
        if listed is None:
            return tools
        names = {schema_name(schema) for schema in listed}
        return {n: tool for n, tool in tools.items() if n in names}

    def row_problem(self, listed: list[dict], environment=None) -> str | None:
        """Why a record whose `tools` column is `listed` cannot be played, or None. Its episode may call only tools of
        this run (so a schema names a standalone tool or a method of the record's environment: `environment`, its
        key in a dict of factories) with the parameters the function takes, since what the record shows the model is
        what the model will call."""
        envs = self.environments
        own = {**self.functions, **(envs.methods.get(environment if envs.routed else None, {}) if envs else {})}
        for j, schema in enumerate(listed):
            name = schema_name(schema)
            if name is None:
                return f"field 'tools' item {j} names no function (expected {{type: function, function: {{name, ...}}}})"
            if name not in own:
                homes = [key for key, methods in (envs.methods.items() if envs else ()) if name in methods]
                if homes:
                    return (f"field 'tools' names '{name}', a method of environment '{homes[0]}', which is not this "
                            f"record's (its environment column: {environment!r})")
                return (f"field 'tools' names '{name}', which is not one of the run's tools ({', '.join(self.names)}): "
                        "register it (tools.functions, or tools= in Python); only registered functions run")
            given = list((described(schema).get("parameters") or {}).get("properties") or {})
            takes = list(own[name].parameters.get("properties") or {})
            if set(given) != set(takes):
                return (f"field 'tools' describes '{name}' with parameters ({', '.join(given)}), but the registered "
                        f"{name} takes ({', '.join(takes)})")
        return None


def described(schema) -> dict:
    """The function part of a JSON schema: {"type": "function", "function": {...}}'s inner dict, or the bare {...};
    {} for what is neither."""
    inner = schema.get("function", schema) if isinstance(schema, dict) else None
    return inner if isinstance(inner, dict) else {}


def schema_name(schema) -> str | None:
    """The function a JSON schema describes (`described`); None when it names none."""
    name = described(schema).get("name")
    return name if isinstance(name, str) and name else None


def awaited(value):
    """`value`, or its result when it is awaitable (an `async def` tool, environment `get_reward` or reward function),
    run to completion here: the one runner of the package. On a fresh event loop; in a thread of its own when this
    thread already runs one (a notebook), where `asyncio.run` is refused."""
    if not inspect.isawaitable(value):
        return value

    async def wait():
        return await value

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, wait()).result()


# Arguments -----------------------------------------------------------------------------------------------------------


_NO_FIT = object()


def _fit_value(value, schema: dict):
    """`value` as `schema` wants it, or `_NO_FIT`. Covers what `get_json_schema` emits: type (or a list of types),
    nullable, enum, array items, anyOf/oneOf. A string holding a number or boolean is cast, as transformers' response
    parser casts tool arguments; a whole float is an integer (JSON Schema's rule)."""
    if not schema:
        return value
    for choice in schema.get("anyOf", []) + schema.get("oneOf", []):
        if (fitted := _fit_value(value, choice)) is not _NO_FIT:
            return fitted
    types = schema.get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    if schema.get("nullable"):
        types.append("null")
    for kind in types:
        fitted = _fit_type(value, kind, schema)
        if fitted is not _NO_FIT and ("enum" not in schema or fitted in schema["enum"]):
            return fitted
    if not types and "enum" in schema and value in schema["enum"]:
        return value
    return _NO_FIT


def _fit_type(value, kind: str, schema: dict):
    if kind == "null":
        return None if value is None else _NO_FIT
    if kind == "boolean":
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        return value if isinstance(value, bool) else _NO_FIT
    if kind in ("integer", "number"):
        if isinstance(value, str):
            try:
                value = float(value) if any(c in value for c in ".eE") else int(value)
            except ValueError:
                return _NO_FIT
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return _NO_FIT
        if kind == "integer":
            return int(value) if float(value).is_integer() else _NO_FIT
        return value
    if kind == "string":
        return value if isinstance(value, str) else _NO_FIT
    if kind == "array":
        if not isinstance(value, list):
            return _NO_FIT
        items = [_fit_value(v, schema.get("items") or {}) for v in value]
        return _NO_FIT if any(v is _NO_FIT for v in items) else items
    if kind == "object":
        return value if isinstance(value, dict) else _NO_FIT
    return value  # a type this checker does not know: left to the tool


def fit_arguments(arguments, parameters: dict) -> tuple[dict | None, str | None]:
    """(the arguments cast to the tool's `parameters` schema, None) or (None, why they do not fit): not a dict, an
    unknown argument, a required one missing, a value of the wrong type or outside its enum."""
    if not isinstance(arguments, dict):
        return None, f"arguments must be an object, got {type(arguments).__name__}"
    properties = parameters.get("properties") or {}
    unknown = sorted(set(arguments) - set(properties))
    if unknown:
        return None, f"unknown argument(s) {', '.join(unknown)} (expected: {', '.join(properties) or 'none'})"
    missing = [name for name in parameters.get("required", []) if name not in arguments]
    if missing:
        return None, f"missing required argument(s) {', '.join(missing)}"
    fitted = {}
    for name, value in arguments.items():
        fitted[name] = _fit_value(value, properties[name])
        if fitted[name] is _NO_FIT:
            return None, f"argument {name}={value!r} does not fit its schema {_schema_text(properties[name])}"
    return fitted, None


def _schema_text(schema: dict) -> str:
    return str({k: v for k, v in schema.items() if k != "description"})


# Running calls -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One tool call of an episode, resolved and checked: `tool` None means it is malformed (`error` says why) and is
    never run."""

    name: str
    arguments: dict
    tool: Tool | None = None
    error: str | None = None


@dataclass(frozen=True)
class Outcome:
    """What a call gave the episode: the tool message's content, and whether it counts as a failure / a timeout."""

    content: str
    failed: bool = False
    timed_out: bool = False


def error_content(message: str) -> str:
    """TRL's error result: the str() of {"error": message}, the text the model reads in the tool turn."""
    return str({"error": message})


def resolve(name, arguments, tools: dict[str, Tool]) -> Call:
    """A parsed call checked against the episode's tools: by exact name, with arguments fitted to the schema."""
    if not isinstance(name, str) or name not in tools:
        return Call(str(name), arguments if isinstance(arguments, dict) else {},
                    error=f"unknown tool {name!r} (tools: {', '.join(tools) or 'none'})")
    fitted, why = fit_arguments(arguments, tools[name].parameters)
    if why is not None:
        return Call(name, arguments if isinstance(arguments, dict) else {}, error=f"{name}: {why}")
    return Call(name, fitted, tools[name])


def _run_one(call: Call, timeout_s: float) -> Outcome:
    """Runs a well-formed call in a daemon thread, waiting at most `timeout_s` seconds for it."""
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = awaited(call.tool.fn(**call.arguments))
        except BaseException as exc:  # noqa: BLE001 - whatever the tool raises is the episode's error message
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"rlhfkit-tool-{call.name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return Outcome(error_content(f"{call.name} timed out after {timeout_s:g} s"), failed=True, timed_out=True)
    if "error" in box:
        return Outcome(error_content(first_line(box["error"], with_type=True)), failed=True)
    try:
        return Outcome(str(box["value"]))
    except Exception as exc:  # noqa: BLE001 - a result whose __str__ raises
        return Outcome(error_content(f"{call.name} returned a result that cannot be printed: {first_line(exc)}"),
                       failed=True)


def run_calls(episodes: list[list[Call]], timeout_s: float) -> list[list[Outcome]]:
    """The outcome of every call, episode by episode: an episode's calls in order, the episodes concurrently. A
    malformed call is not run: its outcome is its error message (not a failure: `ToolCounts.malformed` counts it)."""

    def episode(calls: list[Call]) -> list[Outcome]:
        return [_run_one(c, timeout_s) if c.tool is not None else Outcome(error_content(c.error)) for c in calls]

    busy = [calls for calls in episodes if calls]
    if len(busy) <= 1:
        return [episode(calls) for calls in episodes]
    with ThreadPoolExecutor(max_workers=min(32, len(busy)), thread_name_prefix="rlhfkit-episode") as pool:
        return list(pool.map(episode, episodes))


def cap_result(text: str, tokenizer, max_tokens: int) -> str:
    """`text` cut to its first `max_tokens` tokens (the policy's tokenizer) and marked, when it is longer."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    return tokenizer.decode(ids[:max_tokens]) + f" [cut: {len(ids) - max_tokens} more tokens]"
