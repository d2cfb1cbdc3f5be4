"""The Python API (`rlhfkit.train`): objects in — a model, a tokenizer, a `datasets.Dataset`, TRL-style reward
functions, a peft `LoraConfig` — plain Hugging Face outputs out, with the CLI's validation and one-line errors."""

import json
import os

import datasets
import pytest
import torch

import rlhfkit
from rlhfkit.cli import main
from rlhfkit.errors import UserError
from rlhfkit.model_sources import resolve_model_path
from rlhfkit.config import ModelConfig


def rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def tiny_model_and_tokenizer():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(ModelConfig(name_or_path="tiny"))
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


SFT_OVERRIDES = {"max_steps": 3, "logging.logging_steps": 1, "logging.progress_bar": False, "data.eval": None,
                 "optim.per_device_batch_size": 4}


def test_sft_from_objects_equals_the_cli_from_names(tmp_path):
    """A model object, a tokenizer object and a Dataset give the run the CLI gives from the same names and file."""
    model, tokenizer = tiny_model_and_tokenizer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dataset = datasets.Dataset.from_list(rows("data/tiny/sft_train.jsonl"))
    result = rlhfkit.train("sft", model=model, tokenizer=tokenizer, train_dataset=dataset, config="configs/sft_tiny.yaml",
                           overrides=SFT_OVERRIDES, output_dir=str(tmp_path / "api"))
    cli_out = tmp_path / "cli"
    args = [f"{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}" for k, v in SFT_OVERRIDES.items()]
    assert main(["sft", "--config", "configs/sft_tiny.yaml", f"output_dir={cli_out}", *args]) == 0
    api_rows, cli_rows = rows(tmp_path / "api" / "metrics.jsonl"), rows(cli_out / "metrics.jsonl")
    assert [r["loss"] for r in api_rows] == pytest.approx([r["loss"] for r in cli_rows], rel=1e-5)
    assert result.output_dir == str(tmp_path / "api")
    assert result.metrics["loss"] == pytest.approx(api_rows[-1]["loss"])
    # The caller's own model object is the one trained, and it is what the result hands back.
    assert result.model is model
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert (tmp_path / "api" / "config.json").exists() and (tmp_path / "api" / "model.safetensors").exists()


def test_a_list_of_dicts_and_a_dict_config(tmp_path):
    records = rows("data/tiny/sft_train.jsonl")[:32]
    result = rlhfkit.train("sft", model="tiny", train_dataset=records,
                           config={"optim": {"lr": 1e-3, "per_device_batch_size": 8}, "max_steps": 2,
                                   "logging": {"progress_bar": False}},
                           output_dir=str(tmp_path / "run"))
    assert len(rows(tmp_path / "run" / "metrics.jsonl")) >= 1 and "loss" in result.metrics


@pytest.mark.parametrize("config, key", [
    ({"optim": {"lr": -1.0}}, "optim.lr"),
    ({"optimm": {}}, "optimm"),
])
def test_dict_configs_get_the_cli_validation(tmp_path, config, key):
    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        rlhfkit.train("sft", model="tiny", train_dataset="data/tiny/sft_train.jsonl", config=config,
                      output_dir=str(tmp_path / "run"))


def test_a_config_object_is_validated_like_yaml(tmp_path):
    """A config object built in Python went unvalidated through `run_stage`; through the API it gets the YAML path's
    checks and the same message as the CLI."""
    import dataclasses

    from rlhfkit.config import SFTConfig

    cfg = SFTConfig()
    bad = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=-1.0))
    with pytest.raises(UserError) as api_error:
        rlhfkit.train("sft", model="tiny", train_dataset="data/tiny/sft_train.jsonl", config=bad,
                      output_dir=str(tmp_path / "run"))
    assert "optim.lr" in str(api_error.value)
    assert not (tmp_path / "run").exists()


def test_unknown_stage_and_unknown_argument_are_one_line(tmp_path):
    with pytest.raises(UserError, match="stage"):
        rlhfkit.train("sftt", model="tiny", output_dir=str(tmp_path / "x"))


def test_peft_config_maps_onto_lora_and_refuses_what_it_cannot_honour(tmp_path):
    from peft import LoraConfig

    out = tmp_path / "lora"
    rlhfkit.train("sft", model="tiny", train_dataset="data/tiny/sft_train.jsonl",
                  peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"),
                  config={"max_steps": 1, "logging": {"progress_bar": False}}, output_dir=str(out))
    import yaml

    saved = yaml.safe_load((out / "config.yaml").read_text())["model"]["lora"]
    assert saved["enabled"] is True and saved["r"] == 4 and saved["alpha"] == 8
    with pytest.raises(UserError, match="use_dora"):
        rlhfkit.train("sft", model="tiny", train_dataset="data/tiny/sft_train.jsonl",
                      peft_config=LoraConfig(r=4, use_dora=True), output_dir=str(tmp_path / "dora"))


def format_reward(completions, **kwargs):
    """TRL style: keywords only, any dataset column in kwargs."""
    return [1.0 if c.strip().endswith(".") else 0.0 for c in completions]


def vowels(prompts, completions, **kwargs):
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]


def test_grpo_with_two_trl_reward_functions_and_weights(tmp_path):
    out = tmp_path / "grpo"
    result = rlhfkit.train("grpo", model="tiny", train_dataset=datasets.Dataset.from_list(rows("data/tiny/prompts_train.jsonl")),
                           reward_funcs=[format_reward, vowels], reward_weights=[0.5, 1.0], config="configs/grpo_tiny.yaml",
                           overrides={"max_steps": 2, "logging.progress_bar": False}, output_dir=str(out))
    last = rows(out / "metrics.jsonl")[-1]
    for name in ("format_reward", "vowels"):
        assert f"rewards/{name}/mean" in last and f"rewards/{name}/std" in last
    assert last["objective/scores"] == pytest.approx(0.5 * last["rewards/format_reward/mean"] + last["rewards/vowels/mean"],
                                                     rel=1e-5)
    assert result.metrics["objective/scores"] == pytest.approx(last["objective/scores"])


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("api") / "rm"
    rlhfkit.train("rm", model="tiny", train_dataset="data/tiny/pref_train.jsonl", config="configs/rm_tiny.yaml",
                  overrides={"max_steps": 2, "data.eval": None, "logging.progress_bar": False}, output_dir=str(out))
    return str(out)


GRPO = {"max_steps": 2, "logging.progress_bar": False}


def test_a_reward_model_object_scores_as_its_directory(tmp_path, rm_dir):
    """A sequence-classification model object among reward_funcs gives the scores its directory gives."""
    from transformers import AutoModelForSequenceClassification

    by_dir = rlhfkit.train("grpo", model="tiny", reward_funcs=[rm_dir, vowels], reward_weights=[1.0, 0.5],
                           config="configs/grpo_tiny.yaml", overrides=GRPO, output_dir=str(tmp_path / "dir"))
    rm = AutoModelForSequenceClassification.from_pretrained(rm_dir)
    by_object = rlhfkit.train("grpo", model="tiny", reward_funcs=[rm, vowels], reward_weights=[1.0, 0.5],
                              config="configs/grpo_tiny.yaml", overrides=GRPO, output_dir=str(tmp_path / "obj"))
    a, b = rows(tmp_path / "dir" / "metrics.jsonl"), rows(tmp_path / "obj" / "metrics.jsonl")
    assert [r["rewards/rm/mean"] for r in a] == pytest.approx([r["rewards/rm/mean"] for r in b], rel=1e-5)
    assert [r["objective/scores"] for r in a] == pytest.approx([r["objective/scores"] for r in b], rel=1e-5)
    assert by_dir.metrics["objective/scores"] == pytest.approx(by_object.metrics["objective/scores"], rel=1e-5)


def test_ppo_from_a_model_object_with_a_reward_model(tmp_path, rm_dir):
    """Full fine-tuning PPO from a model object: the reference is a frozen copy (KL 0 before the first update, not
    after), the critic starts from the reward model's directory."""
    model, tokenizer = tiny_model_and_tokenizer()
    result = rlhfkit.train("ppo", model=model, tokenizer=tokenizer, reward_funcs=rm_dir, config="configs/ppo_tiny.yaml",
                           overrides={"max_steps": 3, "logging.progress_bar": False, "reward.function": None},
                           output_dir=str(tmp_path / "ppo"))
    history = rows(tmp_path / "ppo" / "metrics.jsonl")
    assert history[0]["objective/kl"] == pytest.approx(0.0, abs=1e-6)
    assert history[-1]["objective/kl"] != pytest.approx(0.0, abs=1e-6)
    assert "rewards/rm/mean" in history[-1] and result.model is model
    assert (tmp_path / "ppo" / "model.safetensors").exists()


def test_dpo_full_and_lora_from_a_model_object(tmp_path):
    """DPO from an object: without LoRA the reference is a frozen copy taken before training (the implicit rewards
    move away from 0), with LoRA the base with its adapters disabled."""
    overrides = {"max_steps": 3, "logging.progress_bar": False, "data.eval": None, "logging.logging_steps": 1}
    model, tokenizer = tiny_model_and_tokenizer()
    rlhfkit.train("dpo", model=model, tokenizer=tokenizer, train_dataset="data/tiny/pref_train.jsonl",
                  config="configs/dpo_tiny.yaml", overrides=overrides, output_dir=str(tmp_path / "full"))
    history = rows(tmp_path / "full" / "metrics.jsonl")
    assert history[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert history[-1]["rewards/margins"] != pytest.approx(0.0, abs=1e-6)
    from peft import LoraConfig

    model, tokenizer = tiny_model_and_tokenizer()
    result = rlhfkit.train("dpo", model=model, tokenizer=tokenizer, train_dataset="data/tiny/pref_train.jsonl",
                           peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                           config="configs/dpo_tiny.yaml", overrides=overrides, output_dir=str(tmp_path / "lora"))
    history = rows(tmp_path / "lora" / "metrics.jsonl")
    assert history[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert history[-1]["rewards/margins"] != pytest.approx(0.0, abs=1e-6)
    assert type(result.model).__name__ == "PeftModelForCausalLM"


def test_iterable_and_dict_datasets(tmp_path):
    records = rows("data/tiny/sft_train.jsonl")[:16]
    stream = datasets.IterableDataset.from_generator(lambda: iter(records))
    rlhfkit.train("sft", model="tiny", train_dataset=stream, config={"max_steps": 1, "logging": {"progress_bar": False}},
                  output_dir=str(tmp_path / "stream"))
    import yaml

    saved = yaml.safe_load((tmp_path / "stream" / "config.yaml").read_text())["data"]["train"]
    assert rows(saved) == records  # the stream, written once where config.yaml says
    with pytest.raises(UserError, match="DatasetDict"):
        rlhfkit.train("sft", model="tiny", train_dataset=datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}),
                      output_dir=str(tmp_path / "dd"))
    with pytest.raises(UserError, match="reward_weights"):
        rlhfkit.train("grpo", model="tiny", reward_funcs=[vowels], reward_weights=[1.0, 2.0],
                      config="configs/grpo_tiny.yaml", output_dir=str(tmp_path / "w"))


def test_callbacks_reach_the_run(tmp_path):
    """A TrainerCallback given to rlhfkit.train sees the run's logs and can stop it."""
    from transformers import TrainerCallback

    class StopAtTwo(TrainerCallback):
        logged: list = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logged.append((state.global_step, dict(logs)))

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                control.should_training_stop = True

    cb = StopAtTwo()
    result = rlhfkit.train("sft", model="tiny", train_dataset="data/tiny/sft_train.jsonl", callbacks=[cb],
                           config={"max_steps": 6, "logging": {"progress_bar": False, "logging_steps": 1}},
                           output_dir=str(tmp_path / "run"))
    history = rows(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in history] == [1, 2]
    assert [s for s, _ in cb.logged] == [1, 2] and cb.logged[-1][1]["loss"] == pytest.approx(history[-1]["loss"])
    assert result.metrics["loss"] == pytest.approx(history[-1]["loss"])


# PPO's critic when the reward models come from Python -------------------------------------------------------------

PPO = {"max_steps": 2, "logging.progress_bar": False, "reward.function": None}


def test_ppo_critic_copies_a_reward_model_object_built_in_memory(tmp_path):
    """A reward-model object with no directory behind it: the critic starts from a copy of it (the reward model
    stays frozen, the critic trains), instead of loading the object's class name from the hub."""
    from tests.unit.test_reward_functions import rm_object

    _, tokenizer = tiny_model_and_tokenizer()
    rm = rm_object(len(tokenizer))
    before = {k: v.clone() for k, v in rm.state_dict().items()}
    rlhfkit.train("ppo", model="tiny", reward_funcs=[rm], config="configs/ppo_tiny.yaml", overrides=PPO,
                  output_dir=str(tmp_path / "ppo"))
    assert all(torch.equal(before[k], v) for k, v in rm.state_dict().items())  # the reward model did not train
    history = rows(tmp_path / "ppo" / "metrics.jsonl")
    assert len(history) == 2 and "rewards/reward_model_0/mean" in history[0]
    assert history[0]["loss/value_avg"] > 0 and history[1]["val/ratio"] != 1.0  # a critic trained


def test_ppo_refuses_a_critic_from_a_reward_model_of_another_tokenizer(tmp_path, capsys):
    """The critic reads the policy's token ids: started from a reward model with another vocabulary it would read
    them through the wrong embeddings. Refused in one line, from Python and from the CLI."""
    from tests.unit.test_reward_functions import other_tokenizer, rm_object, save_rm

    other = other_tokenizer()
    with pytest.raises(UserError) as err:
        rlhfkit.train("ppo", model="tiny", reward_funcs=[(rm_object(len(other)), other)], config="configs/ppo_tiny.yaml",
                      overrides=PPO, output_dir=str(tmp_path / "obj"))
    assert str(err.value).startswith("algo.value_model: PPO's critic starts from the first reward model "
                                     "('reward_model_0'), whose tokenizer is not the policy's ('tiny')"), err.value


def test_ppo_refuses_a_critic_from_a_reward_model_directory_of_another_tokenizer(tmp_path, capsys):
    from tests.unit.test_reward_functions import other_tokenizer, save_rm

    path = save_rm(tmp_path / "rm_other", other_tokenizer())
    code = main(["ppo", "--config", "configs/ppo_tiny.yaml", f"reward.model=[{path}]", "reward.function=null",
                 "max_steps=1", f"output_dir={tmp_path / 'cli'}", "logging.progress_bar=false"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rlhfkit: error:")]
    assert code == 2 and len(errors) == 1 and "('rm_other'), whose tokenizer is not the policy's ('tiny')" in errors[0]


def test_reward_funcs_on_a_stage_without_reward_sources_is_one_clear_line(tmp_path):
    with pytest.raises(UserError) as err:
        rlhfkit.train("dpo", model="tiny", train_dataset="data/tiny/pref_train.jsonl", reward_funcs=[vowels],
                      output_dir=str(tmp_path / "dpo"))
    assert str(err.value).startswith("reward_funcs: the dpo stage learns from its data and takes no reward sources "
                                     "(stages that do:"), err.value


def test_data_split_points_at_the_split_keys(tmp_path):
    """TRL's scripts say dataset_train_split; rlhfkit's keys are data.train_split and data.eval_split."""
    with pytest.raises(UserError) as err:
        rlhfkit.train("sft", model="tiny", train_dataset="data/tiny/sft_train.jsonl", overrides={"data.split": "validation"},
                      output_dir=str(tmp_path / "sft"))
    assert str(err.value) == ("unknown config key 'data.split': a hub dataset's splits are data.train_split (default "
                              "'train') and data.eval_split (default 'test')")


def test_a_bad_record_in_a_dataset_object_is_named_by_its_argument(tmp_path):
    """The records of a Dataset go through a cached file, but the error names what the caller passed."""
    bad = datasets.Dataset.from_list([{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": None}])
    with pytest.raises(UserError) as err:
        rlhfkit.train("sft", model="tiny", train_dataset=bad, output_dir=str(tmp_path / "sft"))
    assert str(err.value) == ("train_dataset record 1: field 'completion' must be a string or a list of {role, content} "
                              "messages, got null")


# Arguments of the wrong kind: one line naming the argument, before anything loads ---------------------------------


@pytest.mark.parametrize("kwargs,message", [
    ({"tokenizer": "tiny"}, "tokenizer: expected a transformers tokenizer object (omit it to load the model's own), got str"),
    ({"callbacks": object()}, "callbacks: expected a list of transformers TrainerCallbacks, got object"),
    ({"overrides": "max_steps=1"}, "overrides: expected a dict {'key.sub': value} or a list of 'key.sub=value' strings, got str"),
    ({"overrides": 5}, "overrides: expected a dict {'key.sub': value} or a list of 'key.sub=value' strings, got int"),
    ({"model": 123}, "model: expected a transformers model object, a hub name or a directory, got int"),
    ({"reward_funcs": [vowels], "reward_weights": "ab"}, "reward_weights: expected a list of numbers, got str"),
    ({"reward_funcs": (format_reward, vowels)},
     "reward_funcs: a tuple is one (reward model, its tokenizer) pair, and vowels is not a tokenizer: pass several "
     "reward sources as a list"),
])
def test_arguments_of_the_wrong_kind_are_one_line(tmp_path, kwargs, message):
    with pytest.raises(UserError) as err:
        rlhfkit.train("grpo", **{"model": "tiny", "config": "configs/grpo_tiny.yaml", "output_dir": str(tmp_path / "x"),
                                 **kwargs})
    assert str(err.value) == message
    assert not (tmp_path / "x").exists()


def test_a_reward_model_pair_whose_tokenizer_has_no_pad_token_pads_with_eos(tmp_path):
    """As TRL does for a reward model's tokenizer (Llama's and Mistral's have no pad token); the caller's tokenizer
    object is left as it was."""
    from tests.unit.test_reward_functions import other_tokenizer, rm_object

    tok = other_tokenizer()
    tok.eos_token = "~"
    tok.pad_token = None
    rm = rm_object(len(tok))
    rlhfkit.train("grpo", model="tiny", reward_funcs=[(rm, tok)], config="configs/grpo_tiny.yaml", overrides=GRPO,
                  output_dir=str(tmp_path / "grpo"))
    assert tok.pad_token is None
    assert len(rows(tmp_path / "grpo" / "metrics.jsonl")) == 2


def test_a_directory_paired_with_a_tokenizer_reads_with_that_tokenizer(tmp_path, rm_dir):
    """(directory, tokenizer): TRL's reward_processing_classes for a model it loads; the tokenizer is not dropped."""
    from tests.unit.test_reward_functions import other_tokenizer, save_rm

    other = other_tokenizer()
    bare = save_rm(tmp_path / "bare_rm", None, vocab_size=len(other))  # saved without a tokenizer, another vocabulary
    rlhfkit.train("grpo", model="tiny", reward_funcs=[(bare, other)], config="configs/grpo_tiny.yaml", overrides=GRPO,
                  output_dir=str(tmp_path / "grpo"))
    assert "rewards/bare_rm/mean" in rows(tmp_path / "grpo" / "metrics.jsonl")[-1]
