"""The online RL stages through the real CLI on the shipped tiny configs (a Python reward on a tiny random model)."""

import json
import os

import pytest

from rlhfkit.cli import main


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def first_last_fifth(values):
    k = max(1, len(values) // 5)
    return sum(values[:k]) / k, sum(values[-k:]) / k


@pytest.mark.parametrize("stage", ["ppo", "rloo", "grpo", "reinforce_pp"])
def test_tiny_config_raises_the_score(stage, tmp_path):
    out = tmp_path / stage
    assert main([stage, "--config", f"configs/{stage}_tiny.yaml", f"output_dir={out}", "logging.progress_bar=false"]) == 0
    rows = metrics(out)
    first, last = first_last_fifth([m["objective/scores"] for m in rows])
    assert last > first, (first, last)
    needed = {"objective/kl", "objective/scores", "objective/rlhf_reward", "objective/entropy", "policy/approxkl_avg",
              "policy/clipfrac_avg", "loss/policy_avg", "lr", "objective/kl_coef", "response/length_avg", "response/eos_rate"}
    assert needed <= set(rows[-1])
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and {"step", "prompt", "response", "score"} <= set(samples[0])
    assert (out / "config.json").exists() and (out / "config.yaml").exists()
    if stage == "ppo":
        assert {"loss/value_avg", "val/clipfrac_avg"} <= set(rows[-1])
        # Adaptive control: the KL stays far below its target, so β only ever moves down from its initial 0.05.
        assert max(m["objective/kl"] for m in rows) < 6.0
        assert rows[-1]["objective/kl_coef"] < 0.05
