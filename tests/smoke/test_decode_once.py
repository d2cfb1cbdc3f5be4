"""The rollout is decoded once per step (issue 26): the rollout component decodes it, and every consumer — reward
functions, the gold judge, the diversity figures, the sample rows — reads that text. Counted through the tokenizer
object the run is given."""

import pytest

import rlhfkit
from rlhfkit.config import ModelConfig
from rlhfkit.models import load_tokenizer


class Counted:
    """Counts a tokenizer's decode calls: one `batch_decode` counts once, a `decode` outside it once each."""

    def __init__(self, tokenizer):
        self.calls, self.inside = 0, False
        batch_decode, decode = tokenizer.batch_decode, tokenizer.decode

        def counted_batch(*args, **kwargs):
            self.calls += 1
            self.inside = True
            try:
                return batch_decode(*args, **kwargs)
            finally:
                self.inside = False

        def counted(*args, **kwargs):
            self.calls += 0 if self.inside else 1
            return decode(*args, **kwargs)

        tokenizer.batch_decode, tokenizer.decode = counted_batch, counted


@pytest.mark.parametrize("stage", ["grpo", "ppo", "online_dpo"])
def test_each_step_decodes_its_rollout_once(stage, tmp_path):
    counts = {}
    for steps in (2, 4):
        tokenizer = load_tokenizer(ModelConfig(name_or_path="tiny"))
        counter = Counted(tokenizer)
        rlhfkit.train(stage, tokenizer=tokenizer, config=f"configs/{stage}_tiny.yaml", output_dir=str(tmp_path / str(steps)),
                      overrides=[f"max_steps={steps}", "logging.progress_bar=false", "logging.sample_log_steps=1",
                                 "reward.gold_function=tests.smoke.reward_fns:zeros", "algo.rollout_batch_size=4",
                                 "optim.per_device_batch_size=4", "algo.num_minibatches=1"]
                      if stage != "online_dpo" else [f"max_steps={steps}", "logging.progress_bar=false",
                                                      "logging.sample_log_steps=1", "algo.rollout_batch_size=4",
                                                      "reward.gold_function=tests.smoke.reward_fns:zeros",
                                                      "optim.per_device_batch_size=4"])
        counts[steps] = counter.calls
    assert counts[4] - counts[2] == 2, counts  # two more steps, one decode each (samples written every step)


def test_an_evaluation_decodes_each_rollout_once_whatever_the_number_of_judges(tmp_path):
    """`evaluate` (what `rlhfkit eval` runs): the rollout component decodes each model's completions once, per
    sampling batch, and the judges and figures read that text; the prompts are decoded once per model. One judge or
    three: the same decodes."""
    import json

    from rlhfkit.config import DataConfig, GenerationConfig
    from rlhfkit.data import build_datasets
    from rlhfkit.evaluation.evaluate import evaluate
    from rlhfkit.evaluation.judges import python_judge
    from rlhfkit.models import load_causal_lm

    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    def vowels(completions, **kwargs):
        return [float(sum(ch in "aeiou" for ch in c)) for c in completions]

    def none(completions, **kwargs):
        return [None for _ in completions]

    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("hi", "tell me", "why", "ok")))
    calls = {}
    for judges in ({"length": length}, {"length": length, "vowels": vowels, "none": none}):
        tokenizer = load_tokenizer(ModelConfig(name_or_path="tiny"))
        prompts, _ = build_datasets("prompt", DataConfig(train=str(tmp_path / "p.jsonl")), tokenizer, 0)
        model = load_causal_lm(ModelConfig(name_or_path="tiny"), tokenizer, trainable=False)
        counter = Counted(tokenizer)
        result = evaluate(model, model, tokenizer, prompts, {n: python_judge(f) for n, f in judges.items()},
                          GenerationConfig(max_new_tokens=4, num_samples=2), batch_size=2)
        assert result["num_samples"] == 8 and result["kl"]["mean"] == 0.0
        calls[len(judges)] = counter.calls
    # two models x (2 sampling batches + 1 prompt decode)
    assert calls == {1: 6, 3: 6}, calls
