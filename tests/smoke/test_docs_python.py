"""Every Python block marked runnable (`<!-- runnable -->` on the line before it) in README.md and docs/ runs, on the
tiny model and in a few steps; the blocks of one page run in order, in one namespace, as a reader would run them."""

import glob
import os
import re

import pytest

from rlhfkit.api import TrainResult
from rlhfkit.config import ModelConfig
from rlhfkit.model_sources import resolve_model_path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARK = "<!-- runnable -->"


def pages() -> list[str]:
    return ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                                              recursive=True))


def runnable_blocks(page: str) -> list[str]:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        text = f.read()
    blocks = re.findall(re.escape(MARK) + r"\n```python\n(.*?)```", text, re.S)
    assert len(blocks) == text.count(MARK), f"{page}: every {MARK} line must come right before a ```python block"
    return blocks


def test_the_runnable_examples_cover_every_family():
    code = "\n".join(runnable_blocks("docs/python-api.md"))
    for stage in ('"sft"', '"rm"', '"dpo"', '"grpo"', '"ppo"'):
        assert re.search(rf"rlhfkit\.train\(\s*{stage}", code), stage
    assert runnable_blocks("README.md") and runnable_blocks("docs/getting-started.md")


@pytest.mark.parametrize("page", [p for p in pages() if runnable_blocks(p)])
def test_every_runnable_block_runs(page, tmp_path):
    tiny = resolve_model_path(ModelConfig(name_or_path="tiny"))
    namespace: dict = {}
    for block in runnable_blocks(page):
        code, n = re.subn(r'"max_steps": \d+', '"max_steps": 2', block)
        assert n == block.count("rlhfkit.train("), f"{page}: every run sets max_steps once (the test shortens it): {block[:80]}"
        code = code.replace('"HuggingFaceTB/SmolLM2-135M-Instruct"', repr(tiny))
        code = code.replace('output_dir="runs/', f'output_dir="{tmp_path}/')
        code = code.replace("print(", "(lambda *a: None)(")  # quiet, but every printed figure is still computed
        exec(compile(code, page, "exec"), namespace)
    results = {k: v for k, v in namespace.items() if isinstance(v, TrainResult)}
    assert results, f"{page}: its runnable blocks train nothing"
    for name, result in results.items():
        assert os.path.isfile(os.path.join(result.output_dir, "config.json")), name
        assert result.metrics, name
    if page == "docs/python-api.md":
        assert "rewards/format_reward/mean" in namespace["grpo"].metrics
