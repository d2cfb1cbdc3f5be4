"""Online RL with tools end to end on the tiny model (chatml_tools template): the CLI from names (tools.functions,
tools.environment), the Python API from objects (TRL's `tools=` / `environment_factory=`), a run whose policy really
calls the tool (a scripted sampler given as the rollout component's policy), and the one-line refusals."""

import json
import os

import pytest
import yaml

import rlhfkit
from rlhfkit.cli import main
from rlhfkit.config import load_config
from rlhfkit.config.stages import OnlineConfig
from rlhfkit.errors import UserError
from rlhfkit.model_sources import build_tiny_tokenizer
from rlhfkit.objects import Objects
from rlhfkit.stages import trainer_of
from tests.scripted import Scripted
from tests.smoke.agent_tools import Tally, add

TOOLS = "tests.smoke.agent_tools"
BASE = ["logging.progress_bar=false", "max_steps=2", "model.chat_template=chatml_tools",
        "data.max_length=2048", "data.max_prompt_length=1024"]  # the prompts with the tools' schemas fit


def rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_grpo_with_tools_and_an_environment_from_the_cli(tmp_path):
    out = tmp_path / "grpo"
    assert main(["grpo", "--config", "configs/grpo_tiny.yaml", f"output_dir={out}", *BASE,
                 f"tools.functions=[{TOOLS}:add]", f"tools.environment={TOOLS}:Tally", "tools.max_calls=2",
                 f"reward.function={TOOLS}:completion_turns"]) == 0
    last = rows(out / "metrics.jsonl")[-1]
    assert {"tools/call_frequency", "tools/failure_frequency", "tools/calls_per_episode", "tools/failures_per_call",
            "tools/malformed_per_call", "tools/timeouts_per_call", "tools/turns_per_episode",
            "tools/calls_per_episode/add", "tools/calls_per_episode/bump"} <= set(last)
    assert last["tools/turns_per_episode"] >= 1.0
    assert last["tools/call_frequency"] == last["tools/calls_per_episode"]  # TRL's name: an alias of the same number
    assert "rewards/Tally/mean" in last  # the environment's get_reward() is a reward source
    saved = yaml.safe_load((out / "config.yaml").read_text())["tools"]
    assert saved["functions"] == [f"{TOOLS}:add"] and saved["environment"] == f"{TOOLS}:Tally"


def test_trl_tools_and_environment_objects_through_the_python_api(tmp_path):
    out = tmp_path / "api"
    seen = []

    def episodes(completions, environments, **kwargs):
        seen.append((completions, environments))
        return [float(len(c)) for c in completions]

    rlhfkit.train("grpo", model="tiny", config="configs/grpo_tiny.yaml", reward_funcs=[episodes], tools=[add],
                  environment_factory=Tally, overrides={"max_steps": 1, "logging.progress_bar": False,
                                                       "model.chat_template": "chatml_tools", "data.max_length": 2048,
                                                       "data.max_prompt_length": 1024}, output_dir=str(out))
    completions, environments = seen[0]
    assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in completions)
    assert len({id(e) for e in environments}) == len(environments) and all(type(e) is Tally for e in environments)
    saved = yaml.safe_load((out / "config.yaml").read_text())["tools"]
    assert saved["functions"] == [f"{TOOLS}:add"] and saved["environment"] == f"{TOOLS}:Tally"


def script(text: str) -> str:
    """Call add(2, 3) on a prompt; answer with the result once it is read."""
    if "<tool_response" in text:
        return "done<|im_end|>"
    return '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'


def test_a_policy_that_calls_the_tool_trains_on_its_episodes(tmp_path):
    """The trainer's rollout component samples through a scripted policy (the trained model, steered): every episode
    calls add and reads 5; the reward functions get the whole episodes, the tool figures count the calls."""
    seen = []

    def read_five(completions, **kwargs):
        seen.extend(completions)
        return [float(any(m["role"] == "tool" and m["content"] == "5" for m in c)) for c in completions]

    tok = build_tiny_tokenizer()
    steer = lambda made: lambda policy, *args: made(Scripted(policy, tok, script), *args)  # noqa: E731
    cfg = load_config(OnlineConfig, "configs/grpo_tiny.yaml",
                      [f"output_dir={tmp_path / 'steered'}", *BASE, "generation.top_k=1", "generation.max_new_tokens=160",
                       f"tools.functions=[{TOOLS}:add]"])
    trainer_of("grpo", cfg, Objects(reward_funcs=(read_five,), tools=(add,), rollout=steer)).fit()
    last = rows(tmp_path / "steered" / "metrics.jsonl")[-1]
    assert last["tools/call_frequency"] == 1.0 and last["tools/calls_per_episode/add"] == 1.0
    assert last["tools/turns_per_episode"] == 2.0
    assert last["tools/failure_frequency"] == 0.0 and last["rewards/read_five/mean"] == 1.0
    assert seen[0] == [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "name": "add", "content": "5"}, {"role": "assistant", "content": "done"}]
    # the policy's tokens per episode: the two turns, not the tool result and headers between them
    policy_tokens = len(tok(script("") + script("<tool_response"), add_special_tokens=False)["input_ids"])
    assert last["response/length_avg"] == policy_tokens


@pytest.mark.parametrize("overrides, message", [
    (["tools.max_calls=0", f"tools.functions=[{TOOLS}:add]"], "config key 'tools.max_calls' must be >= 1 or null, got 0"),
    (["tools.max_tool_calling_iterations=3"], "TRL's max_tool_calling_iterations is tools.max_calls"),
    ([f"tools.functions=[{TOOLS}:undocumented]"], "undocumented: transformers' get_json_schema cannot describe it"),
    ([f"tools.functions=[{TOOLS}:add, {TOOLS}:add]"], "two tools are named 'add'"),
    ([f"tools.functions=[{TOOLS}:add]", "generation.engine=hf"], "config key 'generation.engine' must be rlhfkit with tools"),
])
def test_bad_tool_settings_are_one_line(tmp_path, capsys, overrides, message):
    code = main(["grpo", "--config", "configs/grpo_tiny.yaml", f"output_dir={tmp_path / 'bad'}", *BASE, *overrides])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not os.path.exists(tmp_path / "bad" / "metrics.jsonl")


def test_tools_on_an_offline_stage_are_refused(tmp_path, capsys):
    code = main(["sft", "--config", "configs/sft_tiny.yaml", f"output_dir={tmp_path / 'sft'}", f"tools.functions=[{TOOLS}:add]"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "tools apply to the online stages" in err and "\n" not in err
    with pytest.raises(UserError, match="samples no episodes"):
        rlhfkit.train("sft", model="tiny", config="configs/sft_tiny.yaml", tools=[add], output_dir=str(tmp_path / "s"))
