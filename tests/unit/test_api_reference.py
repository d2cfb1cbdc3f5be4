"""docs/reference/api.md lists only what exists: every `::: name` it renders and every member it names resolves (the
docs build renders a missing member as nothing, silently), and it covers the core a contributor extends."""

import importlib
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(ROOT, "docs", "reference", "api.md")


def entries(text: str) -> list[tuple[str, list[str]]]:
    """(dotted name, members listed under it) for every `::: name` directive of a page."""
    found = []
    for block in re.split(r"^(?=::: )", text, flags=re.M)[1:]:
        name = block.split()[1]
        members = re.findall(r"^ {8}- (\w+)\s*$", block.split("\n\n")[0], flags=re.M)
        found.append((name, members))
    return found


def resolve(name: str):
    """The object a dotted name means: a module, or an attribute of the longest importable module prefix."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


def test_every_documented_name_exists():
    with open(PAGE, encoding="utf-8") as f:
        listed = entries(f.read())
    missing = []
    for name, members in listed:
        try:
            obj = resolve(name)
        except (ModuleNotFoundError, AttributeError):
            missing.append(name)
            continue
        missing += [f"{name}.{m}" for m in members if not hasattr(obj, m)]
    assert not missing, f"docs/reference/api.md names what does not exist: {', '.join(missing)}"


def test_the_core_is_covered():
    with open(PAGE, encoding="utf-8") as f:
        names = [name for name, _ in entries(f.read())]
    for module in ("rlhfkit.losses", "rlhfkit.advantages", "rlhfkit.kl", "rlhfkit.algorithms"):
        assert any(n == module or n.startswith(module + ".") for n in names), module


def test_a_missing_member_is_found():
    text = "::: rlhfkit.kl\n    options:\n      members:\n        - kl_penalty\n        - no_such_thing\n"
    assert entries(text) == [("rlhfkit.kl", ["kl_penalty", "no_such_thing"])]
    assert not hasattr(resolve("rlhfkit.kl"), "no_such_thing")
