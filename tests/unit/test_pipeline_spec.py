"""The pipeline file and its gates, without running a model: vars, command-line overrides, one-line refusals naming
the stage and key, the wiring, and every default gate of the seeds passing and failing on hand-made figures."""

import pytest

from rlhfkit.errors import ConfigError
from rlhfkit.pipeline.gates import check, default_gate, effective_gate
from rlhfkit.pipeline.resolve import Upstream, resolve
from rlhfkit.pipeline.spec import read_spec
from rlhfkit.stages import stage_config


def spec(stages, **top):
    return read_spec("p.yaml", top.pop("overrides", ()), data={"output_dir": "out", "stages": stages, **top})


def test_vars_overrides_and_names():
    s = spec([{"stage": "sft", "overrides": {"optim.lr": "${lr}", "output_dir": "${root}/x"}},
              {"stage": "rm", "name": "rm2", "overrides": ["max_steps=3"]}],
             vars={"lr": 0.5, "root": "r"}, overrides=["vars.lr=0.25", "rm2.optim.lr=0.001", "rm2.gate.eval/accuracy=>= 0.9"])
    sft, rm = s.stages
    assert sft.overrides == {"optim": {"lr": 0.25}, "output_dir": "r/x"}  # a whole "${x}" keeps the value's type
    assert rm.name == "rm2" and rm.overrides == {"max_steps": 3, "optim": {"lr": 0.001}}
    assert rm.gate == {"eval/accuracy": ">= 0.9"}


@pytest.mark.parametrize("stages, top, message", [
    ([{"stage": "sft"}, {"stage": "sft"}], {}, "stage 2 (sft): the name 'sft' is used twice"),
    ([{"stage": "sfft"}], {}, "stage 1: 'stage' must be one of"),
    ([{"stage": "sft", "colour": 1}], {}, "stage 1: unknown key 'colour'"),
    ([{"stage": "sft", "overrides": {"x": "${nope}"}}], {}, "'${nope}' is not in vars"),
    ([{"stage": "sft"}], {"iterations": 2}, "iterations: 2 repeats the stages marked `round: true`, and none is"),
    ([{"stage": "sft", "gate": {"eval/loss": "about 2"}}], {}, None),
    ([{"stage": "sft", "round": True, "retrain": True}], {}, "stage 1 (sft): 'retrain' applies to an `rm` stage marked"),
    ([{"stage": "rm", "retrain": True}], {}, "stage 1 (rm): 'retrain' applies to an `rm` stage marked `round: true`"),
    ([{"stage": "rm", "round": True, "retrain": "yes"}], {}, "stage 1 (rm): 'retrain' must be true or false"),
])
def test_a_bad_file_is_one_line_naming_the_stage(stages, top, message):
    if message is None:  # a bad gate condition is caught when the gate is built
        with pytest.raises(ConfigError, match="gate condition 'about 2'"):
            effective_gate({}, spec(stages, **top).stages[0].gate, "p.yaml: stage 1")
        return
    with pytest.raises(ConfigError) as err:
        spec(stages, **top)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_wiring_fills_a_template_and_an_explicit_key_wins():
    up = Upstream(sft=("sft", "out/sft"), rm=("rm", "out/rm"))
    ppo = spec([{"stage": "ppo", "config": "configs/ppo_tiny.yaml"}]).stages[0]
    r = resolve(ppo, up, "out", 1, "p.yaml: stage 1 (ppo)")
    assert (r.cfg.model.name_or_path, r.cfg.reward.model, r.cfg.output_dir) == ("out/sft", ["out/rm"], "out/ppo")
    assert r.cfg.reward.function == "rlhfkit.tasks.toy:vowel_reward"  # the template's own keys stay
    explicit = spec([{"stage": "ppo", "config": "configs/ppo_tiny.yaml", "overrides": {"model.name_or_path": "tiny"}}])
    r = resolve(explicit.stages[0], up, "out", 1, "w")
    assert r.cfg.model.name_or_path == "tiny" and [w.key for w in r.wires] == ["output_dir", "reward.model"]
    with pytest.raises(ConfigError, match="config key 'resume': the pipeline sets it"):
        resolve(spec([{"stage": "sft", "overrides": {"resume": True}}]).stages[0], up, "out", 1, "w")


def test_a_label_stages_serving_options_are_checked_with_the_file():
    """As `rlhfkit label` checks them, but before the first stage runs rather than when the label stage starts."""
    up = Upstream(sft=("sft", "out/sft"))
    for keys, message in [({"overlap": 2}, r"--overlap must be a share in \[0, 1\], got 2"),
                          ({"annotators": ["al", "al"]}, "--annotators: 'al' is named twice"),
                          ({"token": "short"}, "--token must be at least 16 characters")]:
        label = spec([{"stage": "label", "config": {"prompts": "p.jsonl", **keys}}]).stages[0]
        with pytest.raises(ConfigError, match=r"^p.yaml: stage 1 \(label\): " + message):
            resolve(label, up, "out", 1, "p.yaml: stage 1 (label)")


def test_the_docs_pipeline_files_resolve_whole(tmp_path):
    """docs/pipeline.md's copy-and-edit file and its iterated example: every stage's config built and validated as the
    pipeline does before the first stage (the data files are the user's to point at)."""
    import os
    import re

    import yaml

    from rlhfkit.pipeline.runner import Runner

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "pipeline.md"), encoding="utf-8") as f:
        files = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", f.read(), re.S)]
    files = [f for f in files if isinstance(f, dict) and "stages" in f]
    resolved = [Runner(read_spec("docs", data={**f, "output_dir": str(tmp_path / "run")}), plan=False).check_all()
                for f in files]
    assert [[r.name for r in first] for first in resolved] == [["sft", "rm", "ppo", "eval"],
                                                               ["sft", "judge", "rm", "ppo", "eval"]]
    assert resolved[0][2].spec.launch == ("--num_processes", "2")


def _verdicts(gate, figures):
    return [(v.figure, v.passed) for v in check("s", gate, figures)]


def test_every_default_gate_passes_and_fails_at_its_threshold():
    sft = default_gate("sft", None, False)
    assert _verdicts(sft, {"eval/loss": 1.2}) == [("eval/loss", True)]
    assert _verdicts(sft, {"loss": 1.2}) == [("eval/loss", False)]  # no held-out loss reported
    rm = default_gate("rm", None, False)
    assert _verdicts(rm, {"eval/accuracy": 0.70}) == [("eval/accuracy", True)]
    assert _verdicts(rm, {"eval/accuracy": 0.6999}) == [("eval/accuracy", False)]
    policy = default_gate("eval", None, True)
    assert _verdicts(policy, {"win_rate/rm": 0.6, "win_rate/gold": 0.59, "alarms": 0.0}) == [
        ("win_rate/gold", False), ("win_rate/rm", True), ("alarms", True)]
    assert _verdicts(policy, {"win_rate/rm": 0.9, "alarms": 1.0})[-1] == ("alarms", False)
    agent = default_gate("eval", stage_config("eval", "configs/eval_tiny.yaml", ["tools.functions=[m:f]"]), False)
    assert agent == {"agent/format_accuracy": ">= 0.95", "agent/task_completion": ">= 0.8"}
    assert _verdicts(agent, {"agent/format_accuracy": 0.95, "agent/task_completion": 0.79}) == [
        ("agent/format_accuracy", True), ("agent/task_completion", False)]
    human = default_gate("label", {"mode": "compare"}, False)
    assert _verdicts(human, {"human/win_rate_low": 0.5}) == [("human/win_rate_low", False)]
    assert _verdicts(human, {"human/win_rate_low": 0.51}) == [("human/win_rate_low", True)]
    assert effective_gate(rm, False, "w") == {} and effective_gate(policy, {"alarms": None}, "w") == {"win_rate/*": ">= 0.60"}
