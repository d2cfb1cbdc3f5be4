"""Exactly one decode loop: every sampler goes through the engine (`rlhfkit.generation`), and nothing in rlhfkit/
subclasses a transformers cache class.

Two checks. Statically, no module outside rlhfkit/generation/ can run a decode loop of its own: none calls a
`.generate(...)` method (transformers' loop), builds or imports a KV cache, draws tokens (`multinomial`,
`sample_next`) or passes a cache to a forward; and every sampler module imports the engine. Dynamically, the
samplers run on a watched tiny model, and every forward they make comes from the engine's session."""

import ast
import importlib
import pathlib
import traceback

import pytest
import torch

import rlhfkit
from rlhfkit.config import GenerationConfig
from tests.unit.test_tool_loop import tiny  # noqa: F401 - tiny is a fixture

PACKAGE = pathlib.Path(rlhfkit.__file__).parent
ENGINE = PACKAGE / "generation"
# The samplers, each importing the engine or the module through which it samples (evaluation and online DPO through
# the rollout component, label candidates through evaluation's sampling).
SAMPLERS = {"rlhfkit.rollout.single_turn": "rlhfkit.generation", "rlhfkit.rollout.tool_loop": "rlhfkit.generation",
            "rlhfkit.evaluation.samples": "rlhfkit.rollout.single_turn", "rlhfkit.trainers.best_of_n": "rlhfkit.generation",
            "rlhfkit.tasks.demo": "rlhfkit.generation", "rlhfkit.label.candidates": "rlhfkit.evaluation.samples",
            "rlhfkit.trainers.online_dpo": "rlhfkit.rollout.maker"}
DECODING_NAMES = {"multinomial", "sample_next", "DynamicCache", "StaticCache", "Cache", "DynamicLayer", "StaticLayer"}
CACHE_KEYWORDS = {"past_key_values", "cache", "use_cache"}


def decode_loop_signs(path: pathlib.Path) -> list[str]:
    """What in one module could be a decode loop of its own: 'line: why' each."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "generate":
            found.append(f"{node.lineno}: calls .generate()")
        if isinstance(node, ast.Call):
            found += [f"{node.lineno}: passes {k.arg}=" for k in node.keywords if k.arg in CACHE_KEYWORDS
                      and not (isinstance(k.value, ast.Constant) and k.value.value in (False, None))]
        if isinstance(node, (ast.Name, ast.Attribute)):
            name = node.id if isinstance(node, ast.Name) else node.attr
            if name in DECODING_NAMES:
                found.append(f"{node.lineno}: uses {name}")
        if isinstance(node, ast.ImportFrom) and node.module and "cache_utils" in node.module:
            found.append(f"{node.lineno}: imports {node.module}")
    return found


def cache_subclasses(source: str) -> list[str]:
    """Classes of one module's source that derive from a transformers cache class (a base named *Cache or *Layer,
    or one reached through transformers.cache_utils)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            bases = [ast.unparse(b) for b in node.bases]
            found += [f"{node.lineno}: class {node.name}({b})" for b in bases
                      if b.endswith(("Cache", "Layer", "LayerMixin")) or "cache_utils" in b]
    return found


def test_no_module_outside_the_engine_decodes():
    modules = [p for p in PACKAGE.rglob("*.py") if ENGINE not in p.parents]
    signs = {str(p.relative_to(PACKAGE)): s for p in modules if (s := decode_loop_signs(p))}
    assert signs == {}
    # The check sees a loop: the engine's own session is full of the signs it looks for.
    assert len(decode_loop_signs(ENGINE / "session.py")) >= 4


def test_nothing_subclasses_a_transformers_cache_class():
    found = {str(p.relative_to(PACKAGE)): s for p in PACKAGE.rglob("*.py") if (s := cache_subclasses(p.read_text()))}
    assert found == {}
    # what the tool loop had before the engine: the check sees it
    assert cache_subclasses("class GrowingLayer(DynamicLayer):\n    pass\n") == ["1: class GrowingLayer(DynamicLayer)"]


@pytest.mark.parametrize("module, engine", sorted(SAMPLERS.items()))
def test_every_sampler_imports_the_engine(module, engine):
    source = pathlib.Path(importlib.import_module(module).__file__).read_text()
    imported = {node.module for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)}
    assert engine in imported


class Watched(torch.nn.Module):
    """A model that records, for each forward, whether the engine's session made it."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config, self.calls = model, model.config, []

    def forward(self, *args, **kwargs):
        frames = traceback.extract_stack()
        self.calls.append(any(pathlib.Path(f.filename).parent == ENGINE and f.name == "call" for f in frames))
        return self.model(*args, **kwargs)


def test_the_samplers_forward_only_through_the_engine(tiny):
    """The single-turn rollout, the tool loop and evaluation's sampling, each on a watched model: they make
    forwards, and every one of them is the session's."""
    from rlhfkit.data import collate_prompts
    from rlhfkit.evaluation.samples import sample
    from rlhfkit.rollout.single_turn import SingleTurn
    from rlhfkit.rollout.tool_loop import ToolLoop
    from rlhfkit.tools import Toolbox
    from tests.smoke.agent_tools import add

    model, tok = tiny
    params = GenerationConfig(max_new_tokens=6, num_samples=2)
    examples = [{"prompt": "add 1 2", "prompt_ids": tok("add 1 2", add_special_tokens=False)["input_ids"], "columns": {}},
                {"prompt": "hi", "prompt_ids": tok("hi", add_special_tokens=False)["input_ids"], "columns": {}}]
    batch = collate_prompts(examples, tok.pad_token_id)
    samplers = {
        "single_turn": lambda m: SingleTurn(tok, params, 0)(m, batch, examples, 0),
        "tool_loop": lambda m: ToolLoop(tok, params, 0, Toolbox([add]), 2, 2.0, 50)(m, batch, examples, 0),
        "evaluation": lambda m: sample(m, None, tok, examples, params, batch_size=1, seed=0),
    }
    for name, run in samplers.items():
        watched = Watched(model)
        run(watched)
        assert watched.calls and all(watched.calls), name
