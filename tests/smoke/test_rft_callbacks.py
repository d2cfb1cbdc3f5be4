"""`rlhfkit rft` checkpoints and callbacks: a checkpoint after any SFT step (logging.save_steps, control.should_save, a
callback's stop), resumable in the middle of an iteration exactly as the run would have gone on; a callback that raises
leaves the last good checkpoint; the reward model loads in the run's precision."""

import json

import pytest
import torch
from transformers import TrainerCallback

import rlhfkit
from rlhfkit.cli import main
from rlhfkit.errors import UserError

CONFIG = "configs/rft_tiny.yaml"
# 16 prompts per iteration in SFT batches of 4: 4 SFT steps per iteration, 8 in the run (iteration 2: steps 5-8).
TINY = ["logging.progress_bar=false", "logging.logging_steps=2", "algo.iterations=2", "algo.prompts_per_iteration=16",
        "algo.sampling_batch_size=16", "generation.max_new_tokens=6", "optim.per_device_batch_size=4"]


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in rows(out) if "loss" in r]


def samples(out) -> list[tuple[int, int, str]]:
    logged = map(json.loads, (out / "samples.jsonl").read_text().splitlines())
    return [(r["step"], r["iteration"], r["completion"]) for r in logged]


def train(out, *extra, callbacks=()):
    overrides = [*TINY, f"output_dir={out}", *extra]
    return rlhfkit.train("rft", config=CONFIG, overrides=overrides, callbacks=list(callbacks))


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run every interrupted one is compared with."""
    out = tmp_path_factory.mktemp("rft-whole") / "run"
    train(out)
    return out


class StopAt(TrainerCallback):
    """Sets control.should_training_stop after step `stop` and should_save after step `save`; records its events."""

    def __init__(self, stop=None, save=None):
        self.stop, self.save, self.events = stop, save, []

    def on_step_end(self, args, state, control, **kw):
        self.events.append(("step_end", state.global_step))
        control.should_training_stop |= state.global_step == self.stop
        control.should_save |= state.global_step == self.save

    def on_save(self, args, state, control, **kw):
        self.events.append(("save", state.global_step))


class Boom(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if state.global_step == 3:
            raise RuntimeError("boom\nsecond line")


def test_a_stop_mid_iteration_resumes_at_the_next_sft_step_of_the_same_iteration(whole, tmp_path):
    """Stopped after SFT step 3 of iteration 1 (of 4), between two logged steps: a finished run with checkpoint-3, whose
    resume logs exactly the losses and the last step of the uninterrupted run (the partial logging window included)."""
    out = tmp_path / "run"
    stop = StopAt(stop=3)
    train(out, callbacks=[stop])
    assert stop.events[-2:] == [("step_end", 3), ("save", 3)]
    for name in ("model.safetensors", "report.html", "config.yaml", "checkpoint-3/trainer_state.pt"):
        assert (out / name).is_file(), name
    assert losses(out) == losses(whole)[:1]  # step 2: nothing after the stop
    train(out, "resume=true")
    assert losses(out) == losses(whole)  # exactly: the same steps on the same weights, optimizer state and data
    assert rows(out)[-1]["step"] == rows(whole)[-1]["step"] == 8
    assert [r["rft/iteration"] for r in rows(out) if "rft/mean_score_all" in r] == [1, 2]  # each iteration sampled once
    assert samples(out) == samples(whole)


def test_save_steps_are_honoured_inside_an_iteration_and_a_raising_callback_leaves_the_last_one(whole, tmp_path):
    """save_steps=2 writes checkpoint-2 in the middle of iteration 1; a callback raising at step 3 stops the run in one
    line naming it, and `rlhfkit rft ... resume=true` finishes it as the uninterrupted run."""
    out = tmp_path / "run"
    with pytest.raises(UserError) as exc:
        train(out, "logging.save_steps=2", callbacks=[Boom()])
    assert str(exc.value) == "callback Boom.on_step_end raised RuntimeError: boom; the run stopped at step 3"
    assert (out / "checkpoint-2" / "trainer_state.pt").is_file() and not (out / "model.safetensors").exists()
    assert main(["rft", "--config", CONFIG, *TINY, f"output_dir={out}", "logging.save_steps=2", "resume=true"]) == 0
    assert losses(out) == losses(whole)
    assert rows(out)[-1]["step"] == 8 and (out / "model.safetensors").is_file()


def test_should_save_at_step_1_writes_checkpoint_1(tmp_path):
    out = tmp_path / "run"
    cb = StopAt(save=1)
    train(out, "algo.iterations=1", callbacks=[cb])
    assert ("save", 1) in cb.events and (out / "checkpoint-1" / "trainer_state.pt").is_file()
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-1"]


def save_rm(path):
    """A tiny random reward model (with a score head) on the tiny policy's tokenizer, saved in fp32."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from rlhfkit.config import ModelConfig
    from rlhfkit.models import load_tokenizer

    tokenizer = load_tokenizer(ModelConfig(name_or_path="tiny"))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_the_reward_model_scores_in_the_runs_precision(tmp_path):
    """model.dtype=bfloat16 (no mixed precision on a CPU): the reward model loads in bf16, as the online stages load it.

    Observed through the CLI's own output: the reward model is loaded inside the run from its directory (a model object
    passed to `rlhfkit.train` is used as given, whatever its dtype, so it would show nothing), and a bf16 model's score
    head writes bf16 values, which the kept samples' scores in rft_iter1.jsonl carry unchanged (weight 1, no EOS
    penalty). An fp32 reward model's scores are, but for a chance of 2^-16 each, not bf16 numbers."""
    out = tmp_path / "run"
    rm = save_rm(tmp_path / "rm")
    assert main(["rft", "--config", CONFIG, *TINY, f"output_dir={out}", "algo.iterations=1", "model.dtype=bfloat16",
                 "reward.function=null", f"reward.model=[{rm}]"]) == 0
    scores = torch.tensor([json.loads(line)["score"] for line in (out / "rft_iter1.jsonl").read_text().splitlines()])
    assert len(scores) == 16 and scores.std() > 0
    assert torch.equal(scores.to(torch.bfloat16).float(), scores), f"not bf16 scores: {scores.tolist()}"
