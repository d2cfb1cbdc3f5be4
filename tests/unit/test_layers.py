"""The package's layers (../shared/ARCHITECTURE.md): the core imports only torch, every import points up the layer
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

# The layer map, top first: a module may import only from layers above its own. A module belongs to the layer of its
# longest matching entry, so a package entry covers its modules unless one has an entry of its own. Modules of one
# layer never import each other (the trainers share only the services above them).
LAYERS = [
    "rlhfkit",  # the package's __init__: imports nothing
    "rlhfkit.errors",
    "rlhfkit.io",  # stdlib only
    "rlhfkit.types",  # the core, torch only: types ... kl_control
    "rlhfkit.ops",
    "rlhfkit.kl",  # KL estimators, per-token and per-sequence KL: the one home of the KL
    "rlhfkit.losses.aggregate",
    "rlhfkit.losses.preference",  # the DPO family, which online DPO's pair loss (losses.online_preference) applies
    "rlhfkit.losses",
    "rlhfkit.advantages",
    "rlhfkit.algorithms",
    "rlhfkit.kl_control",  # the controllers of the KL coefficient
    "rlhfkit.config.fields",  # config: reading and coercion, then the sections, the stage configs, the package
    "rlhfkit.config.sections",
    "rlhfkit.config.stages",
    "rlhfkit.config",
    "rlhfkit.objects",  # what the Python API hands a run besides its config (model, tokenizer, rewards, callbacks)
    "rlhfkit.precision",  # mixed precision "auto", frozen models' dtype, attention implementation check
    "rlhfkit.launch",  # how the process was launched: accelerate state, launch checks, output_dir lock
    "rlhfkit.sharding",  # FSDP / ZeRO-3: gathering the policy to sample, placing frozen models
    "rlhfkit.checkpoint",  # the on-disk checkpoint: save, find, validate, load, RNG state
    "rlhfkit.model_sources",  # where a model comes from: "tiny", a GGUF file, a directory, a hub name
    "rlhfkit.templates",  # bundled chat templates with their response templates; the model.chat_template setting
    "rlhfkit.models",
    "rlhfkit.attention",  # padding-free attention, registered with transformers' attention interface
    "rlhfkit.tools",  # tools and environments: schemas, dispatch by exact name, argument checks, timeouts; no model code
    "rlhfkit.data.sources",  # data: reading, formats, rendering, tokenization, collators, the package
    "rlhfkit.data.formats",
    "rlhfkit.data.render",
    "rlhfkit.data.tokenize",
    "rlhfkit.data.collate",
    "rlhfkit.data",
    "rlhfkit.generation",
    "rlhfkit.rollout",  # the rollout component: prompts in, a Rollout out (its protocol; then each kind)
    "rlhfkit.rollout.single_turn",
    "rlhfkit.rollout.tool_loop",
    "rlhfkit.rollout.maker",  # which rollout component a run uses
    "rlhfkit.reward_functions",  # Python reward functions under TRL's contract, and how sources combine
    "rlhfkit.rewards",
    "rlhfkit.critic",  # PPO's critic: where it comes from, the shared-base adapter critic, what it reads of a rollout
    "rlhfkit.trackers",  # W&B / TensorBoard / trackio metric sinks
    "rlhfkit.hub",  # model card and hub push
    "rlhfkit.evaluation.metrics",  # evaluation: the trainers log its figures, alarms and reports
    "rlhfkit.evaluation.alarms",
    "rlhfkit.evaluation.capability",  # the alignment tax: NLL of reference texts under policy and reference
    "rlhfkit.evaluation.dashboard",
    "rlhfkit.evaluation.report",
    "rlhfkit.evaluation.red_team",  # red-teaming: harmful and refusal rates, safety judges, human flags
    "rlhfkit.evaluation.agent",  # agents: format accuracy, task completion, the gate before reward modelling
    "rlhfkit.evaluation",  # its __init__ and `rlhfkit eval` (evaluate), which needs nothing from the trainers
    "rlhfkit.evaluation.during_training",  # `rlhfkit eval`'s sampling and figures on a training run's live models
    "rlhfkit.trainers.optim",  # the trainers' services, each used the same way by every loop
    "rlhfkit.trainers.processes",  # reductions over processes by name; a process's share of a global count
    "rlhfkit.trainers.rundir",
    "rlhfkit.trainers.sinks",
    "rlhfkit.trainers.callbacks",  # transformers TrainerCallbacks at the run's events
    "rlhfkit.trainers.run",
    "rlhfkit.trainers.held_out",  # the sampling stages' evaluation during training
    "rlhfkit.trainers.experience",  # ExperienceMaker: an online step's experience from explicit parts
    "rlhfkit.trainers.policy_update",  # the online update: epochs, minibatches, losses, target_kl
    "rlhfkit.trainers.best_of_n",  # rft's sampling and selection, as experience is the online loops'
    "rlhfkit.trainers.ptx",  # PPO-ptx: the SFT term every online loop mixes into its updates
    "rlhfkit.trainers.offline",  # the offline loop (sft, rm, dpo, kto) and the train_step RFT reuses
    "rlhfkit.trainers.online_setup",  # what the online loops share, as services: data, prompt stream, step log
    "rlhfkit.trainers",
    "rlhfkit.stages",  # every stage by name, and `run_stage`
    "rlhfkit.config.reference",  # the config reference generated from the declarations (docs, --help-config)
    "rlhfkit.api",  # `rlhfkit.train`: the Python entry point; the CLI is a shell over it
    "rlhfkit.tasks",
    "rlhfkit.tasks.demo",
    "rlhfkit.tasks.agent",  # `rlhfkit demo --agent`: the tool-using task, its stages and its evaluation
    "rlhfkit.label",  # `rlhfkit label`: candidates, the SQLite store, figures, export, the ASGI app, the command
    "rlhfkit.label.candidates",
    "rlhfkit.label.store",
    "rlhfkit.label.figures",
    "rlhfkit.label.export",
    "rlhfkit.label.app",
    "rlhfkit.label.command",
    "rlhfkit.cli",
]


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
    assert matches, f"{module} has no layer: add it to LAYERS here (and to the map in ARCHITECTURE.md)"
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
