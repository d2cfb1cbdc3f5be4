"""The config reference is generated from the declarations: every key documented, the committed page current, the
facts it states (type, default, range, meaning) those the loader enforces."""

import os
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Annotated, Literal

import pytest
from annotated_types import Ge, Interval, doc

from rlhfkit.cli import main
from rlhfkit.config import reference
from rlhfkit.stages import STAGES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_key_of_every_stage_is_documented():
    missing = reference.undocumented()
    assert not missing, ("these config keys have no meaning where they are declared (a comment on the field's line or "
                         f"directly above it, in rlhfkit/config/): {', '.join(missing)}")


def test_the_committed_page_is_what_the_code_generates():
    with open(os.path.join(ROOT, reference.PAGE), encoding="utf-8") as f:
        committed = f.read()
    assert committed == reference.page(), f"{reference.PAGE} is out of date: run `{reference.COMMAND}`"


@dataclass(frozen=True)
class _Inner:
    depth: Annotated[int, Ge(1)] = 2  # how deep


@dataclass(frozen=True)
class _Example:
    """An example section."""

    # The comment block above a field,
    # over two lines.
    first: Annotated[float, Interval(ge=0, lt=1), doc("0 = off")] = 0.5
    second: str | None = None  # an inline comment

    third: Literal["a", "b"] = "a"  # after a blank line: its own comment only
    fourth: list[str] = field(default_factory=lambda: ["x"])
    inner: _Inner = field(default_factory=_Inner)


def test_meaning_comes_from_the_comment_above_or_beside_the_field():
    top, inner = reference.sections(_Example)
    assert top.doc == "An example section." and top.prefix == ""
    assert [(k.name, k.type, k.default, k.range, k.doc) for k in top.keys] == [
        ("first", "float", "0.5", "in [0, 1)", "The comment block above a field, over two lines. (0 = off)"),
        ("second", "str | None", "null", "", "an inline comment"),
        ("third", '"a" | "b"', '"a"', "", "after a blank line: its own comment only"),
        ("fourth", "list[str]", '["x"]', "", ""),  # undocumented: the test above would name it
    ]
    assert inner.prefix == "inner" and inner.keys == (reference.Key("inner.depth", "int", "2", ">= 1", "how deep"),)


def test_keys_of_the_real_stages_state_their_declarations():
    keys = {k.name: k for k in reference.stage_keys("grpo")}
    assert keys["optim.lr"] == reference.Key("optim.lr", "float", "1e-05", ">= 0", "peak learning rate (AdamW)")
    assert keys["optim.adam_betas"].range == "2 items, each in [0, 1)"
    assert keys["optim.adam_betas"].default == "[0.9, 0.999]"
    assert keys["data.max_length"].range == ">= 2" and keys["data.max_length"].doc.startswith("Tokens in prompt")
    assert keys["reward.missing_eos_penalty"].type == "float | None" and keys["reward.missing_eos_penalty"].range == ">= 0"
    assert keys["generation.top_k"].doc.endswith("(0 = off)")
    assert keys["algo.algorithm"].default == '"grpo"'  # the command's own algorithm, not the class default
    assert keys["seed"].range == "in [0, 2**32)"
    assert "model.lora.r" in keys and "model.quantization.load_in_4bit" in keys and "reward.quantization.load_in_4bit" in keys
    assert "algo.completion_only" not in keys and "kl.coef" in keys


def test_help_config_prints_every_key_of_the_stage(capsys):
    assert main(["grpo", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert 'algo.algorithm: str = "grpo"\n' in out
    assert "optim.lr: float = 1e-05  (>= 0)\n    peak learning rate (AdamW)\n" in out
    printed = {line.split(":")[0] for line in out.splitlines()[2:] if line and not line.startswith(" ")}
    assert printed == {k.name for k in reference.stage_keys("grpo")}


def test_every_stage_has_a_help_config():
    for stage in STAGES:
        assert reference.help_text(stage).count("\n") > 10, stage


def test_version_is_the_package_metadata(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"rlhfkit {version('rlhfkit')}\n"
