"""The package's layers (docs/architecture.md): the core imports only torch, every import points up the layer
map, and no two modules import each other, directly or around a loop.

Imports are read from the source with `ast`, not executed: a lazy import inside a function counts for the layer
order (it is still a dependency) but not for cycles (it runs after both modules have loaded); imports under
`if TYPE_CHECKING:` count for neither.
"""

import ast
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "rlhfkit")

CORE = ("rlhfkit.types", "rlhfkit.ops", "rlhfkit.kl", "rlhfkit.losses", "rlhfkit.advantages", "rlhfkit.algorithms",
        "rlhfkit.kl_control")
STDLIB_ONLY = ("rlhfkit.errors", "rlhfkit.io")
ENGINES = ("transformers", "peft", "accelerate", "datasets")

# The layer map, read from docs/architecture.md ("The layers"), turned here so the foundation comes first: a module
# may import only from the entries before its own. A module belongs to the layer of its longest matching entry, so a
# package entry covers its modules unless one has an entry of its own. Modules of one layer never import each other
# (the trainers share only the services above them).
MAP = os.path.join(ROOT, "docs", "architecture.md")
MARKER = "<!-- layers:"


def read_layers(path: str = MAP) -> list[str]:
    """The module names of the first code block after the layers marker in `path`, one per line (the rest of a line
    is its comment), the top layer first as written there."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert MARKER in text, f"{path} has no {MARKER!r} line above its layer list"
    block = text[text.index(MARKER):].split("```", 2)[1]
    names = [line.split()[0] for line in block.splitlines()[1:] if line.strip()]
    bad = [n for n in names if not (n == "rlhfkit" or n.startswith("rlhfkit."))]
    assert names and not bad, f"{path}: the layer list holds {bad or 'nothing'}, not module names"
    return names


LAYERS = list(reversed(read_layers()))


def _modules() -> dict[str, str]:
    """Every module of the package: dotted name -> file."""
    found = {}
    for dirpath, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), ROOT)[: -len(".py")]
                found[rel.replace(os.sep, ".").removesuffix(".__init__")] = os.path.join(dirpath, name)
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, path: str, modules: dict[str, str]) -> list[tuple[str, bool, int]]:
    """(imported module, at import time?, line) for every import in `path`. `from pkg import name` names the
    submodule pkg.name where there is one; importing pkg.sub also runs pkg's __init__."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found: list[tuple[str, bool, int]] = []

    def targets(node) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = node.module or ""
        if node.level:  # relative: from .x import y
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]

    def visit(node, at_import: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(ast.Module(body=[other], type_ignores=[]), at_import)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for name in targets(child):
                    found.append((name, at_import, child.lineno))
            inner = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, at_import and not inner)

    visit(tree, True)
    return found


def _graph(at_import_only: bool) -> dict[str, dict[str, int]]:
    """rlhfkit -> rlhfkit edges: module -> {imported module: line}."""
    modules = _modules()
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for module, path in modules.items():
        for name, at_import, line in _imports(module, path, modules):
            if at_import_only and not at_import:
                continue
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # pkg.sub.mod runs pkg/__init__ and pkg/sub/__init__ first
                target = ".".join(parts[:i])
                if target in modules and target != module and not module.startswith(target + "."):
                    graph[module].setdefault(target, line)
    return graph


def _find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def _layer(module: str) -> int:
    matches = [i for i, entry in enumerate(LAYERS) if module == entry or module.startswith(entry + ".")]
    assert matches, f"{module} has no layer: add a line for it to the layer list in docs/architecture.md"
    return max(matches, key=lambda i: len(LAYERS[i]))


def test_no_import_cycle():
    graph = _graph(at_import_only=True)
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(
        f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b": 1}, "b": {}, "c": {"a": 1, "b": 1}}) is None


# The one import against the map: the package's `__getattr__` hands out `rlhfkit.train` on first use (PEP 562), so
# `import rlhfkit` loads nothing while `rlhfkit.train` works.
LAZY = {("rlhfkit", "rlhfkit.api")}


def test_every_import_points_up_the_layer_map():
    graph = _graph(at_import_only=False)
    wrong = [f"{m} (line {line}) imports {t}: {LAYERS[_layer(t)]} is not above {LAYERS[_layer(m)]}"
             for m, targets in sorted(graph.items()) for t, line in sorted(targets.items())
             if _layer(t) >= _layer(m) and (m, t) not in LAZY]
    assert not wrong, "\n".join(wrong)


def test_the_core_imports_only_torch_and_the_standard_library():
    modules = _modules()
    allowed = set(sys.stdlib_module_names) | {"__future__", "rlhfkit"}
    wrong = []
    for module, path in sorted(modules.items()):
        if not module.startswith(CORE + STDLIB_ONLY):
            continue
        extra = {"torch"} if module.startswith(CORE) else set()
        for name, _, line in _imports(module, path, modules):
            top = name.split(".")[0]
            if top not in allowed | extra:
                wrong.append(f"{module} (line {line}) imports {name}")
    assert not wrong, "\n".join(wrong)


def test_the_core_imports_with_the_engines_blocked():
    """In a fresh interpreter where transformers, peft, accelerate and datasets cannot be imported, every core module
    (and rlhfkit.io) imports, and none of the engines was even attempted."""
    core = sorted(m for m in _modules() if m.startswith(CORE + STDLIB_ONLY))
    script = textwrap.dedent(f"""
        import importlib, importlib.abc, sys

        BLOCKED = {ENGINES!r}
        attempted = []

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    attempted.append(name)
                    raise ImportError(f"{{name}} is blocked in this test")
                return None

        sys.meta_path.insert(0, Block())
        for module in {core!r}:
            importlib.import_module(module)
        assert not attempted, attempted
        for engine in BLOCKED:  # the block itself works (else this test would prove nothing)
            try:
                importlib.import_module(engine)
            except ImportError:
                continue
            raise SystemExit(f"{{engine}} imported despite the block")
        print("imported", len({core!r}))
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"imported {len(core)}"


def test_every_stage_config_names_its_stage():
    """The callbacks' args.stage, the trackers' config and the model card name a run's stage from its config class."""
    from rlhfkit.stages import STAGES, stage_config
    from rlhfkit.trainers.callbacks import stage_of

    online = ("ppo", "rloo", "grpo", "reinforce_pp", "online_dpo", "rft")
    for stage in STAGES:
        if stage == "eval":
            continue
        overrides = ["model.name_or_path=tiny", "data.train=x.jsonl", "output_dir=o"]
        overrides += ["reward.function=m:f"] if stage in online else []
        overrides += [f"algo.algorithm={stage}"] if stage in ("rloo", "grpo", "reinforce_pp") else []
        overrides += ["generation.num_samples=2"] if stage in ("rloo", "grpo", "online_dpo") else []
        assert stage_of(stage_config(stage, None, overrides)) == stage, stage


def test_the_layer_list_is_read_from_the_page(tmp_path):
    """The order comes from the page, not from a copy here: a page listing two modules gives those two, top first."""
    page = tmp_path / "architecture.md"
    page.write_text("# Map\n\n<!-- layers: top first -->\n```text\nrlhfkit.cli   the shell\n\nrlhfkit.types  core\n```\n"
                    "```text\nrlhfkit.not_read\n```\n", encoding="utf-8")
    assert read_layers(str(page)) == ["rlhfkit.cli", "rlhfkit.types"]
    assert LAYERS[0] == "rlhfkit" and LAYERS[-1] == "rlhfkit.cli"
