"""The model card (read back with huggingface_hub), the push path against a stand-in for HfApi (no network), the
offline refusal, and a reward model read by transformers alone against rlhfkit's scorer."""

import dataclasses
import json
import os

import pytest
import torch
from huggingface_hub import ModelCard
from huggingface_hub.utils import filter_repo_objects
from transformers import AutoModelForSequenceClassification

from rlhfkit.config import LoraConfig, ModelConfig, OnlineConfig, RMConfig, load_config
from rlhfkit.errors import UserError
from rlhfkit.hub import (PUSH_IGNORE, check_hub, push_checkpoint, push_final_model, score_reading, write_model_card)
from rlhfkit.model_sources import build_tiny_model
from rlhfkit.models import load_reward_model, load_tokenizer, save_model
from rlhfkit.rewards import POOLING_ATTR, sequence_scores


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny") / "model")
    build_tiny_model(path)
    return path


def _grpo_cfg(**over) -> dict:
    items = {"model.name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "data.train": "trl-lib/tldr",
             "output_dir": "out", "reward.function": "m:f", "optim.lr": 3e-6, "algo.algorithm": "dr_grpo",
             "generation.num_samples": 4, **over}
    cfg = load_config(OnlineConfig, None, [f"{k}={v}" for k, v in items.items()])
    return dataclasses.asdict(cfg)


def _model_dir(tmp_path, tiny_dir, name="final"):
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / name)
    AutoModelForCausalLM.from_pretrained(tiny_dir).save_pretrained(out)
    return out


# 1. The card ----------------------------------------------------------------------------------------------------


def test_policy_card_has_hub_metadata_method_config_metrics_and_eval(tmp_path, tiny_dir):
    out = _model_dir(tmp_path, tiny_dir)
    path = write_model_card(out, "grpo", _grpo_cfg(), {"loss": 0.125, "objective/kl": 0.03125, "eval/reward": 1.5})
    assert path == os.path.join(out, "README.md")
    card = ModelCard.load(path)
    meta = card.data.to_dict()
    assert meta == {"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "library_name": "rlhfkit",
                    "tags": ["rlhfkit", "grpo", "dr_grpo", "trl-compatible"], "datasets": ["trl-lib/tldr"],
                    "pipeline_tag": "text-generation"}
    text = card.text
    assert "`rlhfkit grpo`): Dr. GRPO (Liu et al. 2025, arXiv 2503.20783)." in text
    assert "| `algo.algorithm` | dr_grpo |" in text and "| `optim.lr` | 3e-06 |" in text
    assert "| `generation.num_samples` | 4 |" in text and "| `kl.coef` | 0.05 |" in text
    assert "`model.lora.r`" not in text  # LoRA's settings only where LoRA trained
    train, evaluation = text.split("## Final training metrics")[1].split("## Evaluation")
    assert "| `loss` | 0.125 |" in train and "| `objective/kl` | 0.03125 |" in train and "eval/" not in train
    assert "| `eval/reward` | 1.5 |" in evaluation
    assert "Reading the score" not in text


def test_card_follows_a_local_start_to_its_hub_base_and_names_no_local_dataset(tmp_path, tiny_dir):
    sft = _model_dir(tmp_path, tiny_dir, "sft")
    write_model_card(sft, "sft", _grpo_cfg(), {})  # the SFT card names the hub base
    cfg = dataclasses.asdict(load_config(RMConfig, None, [f"model.name_or_path={sft}", "data.train=data/pairs.jsonl",
                                                          "output_dir=out"]))
    rm = _model_dir(tmp_path, tiny_dir, "rm")
    meta = ModelCard.load(write_model_card(rm, "rm", cfg, {"accuracy": 0.75})).data.to_dict()
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "datasets" not in meta
    tiny = dataclasses.asdict(load_config(RMConfig, None, ["model.name_or_path=tiny", "data.train=x.jsonl", "output_dir=o"]))
    assert "base_model" not in ModelCard.load(write_model_card(rm, "rm", tiny, {})).data.to_dict()


# 2. A reward model outside rlhfkit -------------------------------------------------------------------------------


def _saved_reward_model(tmp_path, tiny_dir, pooling, lora):
    cfg = ModelConfig(name_or_path=tiny_dir, lora=LoraConfig(enabled=lora, r=4, alpha=8, dropout=0.0))
    tokenizer = load_tokenizer(cfg)
    torch.manual_seed(0)
    model = load_reward_model(cfg, tokenizer)  # trainable: a new head is accepted
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    model.eval()
    setattr(model.config if not lora else model.get_base_model().config, POOLING_ATTR, pooling)
    out = str(tmp_path / f"rm-{pooling}")
    save_model(model, tokenizer, out)
    rm_cfg = dataclasses.asdict(load_config(RMConfig, None, [f"model.name_or_path={tiny_dir}", "data.train=x.jsonl",
                                                             "output_dir=o", f"algo.pooling={pooling}"]))
    write_model_card(out, "rm", rm_cfg, {})
    return model, tokenizer, out


def _batch(tokenizer):
    """Two prompt + response texts, right-padded; the response mask marks the response tokens."""
    prompts, responses = ["Rate: the film", "Hi"], [" was wonderful and moving", " bad"]
    ids = [tokenizer(p + r).input_ids for p, r in zip(prompts, responses)]
    starts = [len(tokenizer(p).input_ids) for p in prompts]
    width = max(map(len, ids))
    input_ids = torch.tensor([x + [tokenizer.pad_token_id] * (width - len(x)) for x in ids])
    attention = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
    response = torch.tensor([[int(s <= t < len(x)) for t in range(width)] for x, s in zip(ids, starts)])
    assert all(x[-1] != tokenizer.pad_token_id for x in ids)  # no text ends with the pad (= eos) token
    return input_ids, attention, response


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_last_pooled_reward_model_scores_the_same_in_plain_transformers(tmp_path, tiny_dir, lora):
    model, tokenizer, out = _saved_reward_model(tmp_path, tiny_dir, "last", lora)
    input_ids, attention, _ = _batch(tokenizer)
    plain = AutoModelForSequenceClassification.from_pretrained(out)  # transformers alone: no rlhfkit code
    with torch.no_grad():
        theirs = plain(input_ids=input_ids, attention_mask=attention).logits[:, 0]
        ours = sequence_scores(model, input_ids, attention)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    # rlhfkit trains on responses that end with eos, which is the pad token here: on such a text transformers' forward
    # reads the token before it. The card says so, and does not claim TRL compatibility.
    ended = torch.cat([input_ids[:1, : int(attention[0].sum())], torch.tensor([[tokenizer.eos_token_id]])], 1)
    with torch.no_grad():
        assert not torch.allclose(plain(input_ids=ended).logits[:, 0], sequence_scores(model, ended, torch.ones_like(ended)),
                                  atol=1e-4)
    meta = ModelCard.load(os.path.join(out, "README.md")).data.to_dict()
    assert "trl-compatible" not in meta["tags"] and meta["pipeline_tag"] == "text-classification"
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["rlhfkit_score"] == score_reading("last", pad_is_eos=True)
    assert "pad = eos here" in score_reading("last", pad_is_eos=True)


def test_a_last_pooled_reward_model_with_its_own_pad_token_is_tagged_trl_compatible(tmp_path, tiny_dir):
    model, tokenizer, out = _saved_reward_model(tmp_path, tiny_dir, "last", lora=False)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    config["pad_token_id"] = 0 if config["eos_token_id"] != 0 else 1  # a pad token that is not eos
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    rm_cfg = dataclasses.asdict(load_config(RMConfig, None, [f"model.name_or_path={tiny_dir}", "data.train=x.jsonl",
                                                             "output_dir=o"]))
    write_model_card(out, "rm", rm_cfg, {})
    assert "trl-compatible" in ModelCard.load(os.path.join(out, "README.md")).data.to_dict()["tags"]


def test_mean_pooled_reward_model_is_read_as_its_card_and_config_say(tmp_path, tiny_dir):
    model, tokenizer, out = _saved_reward_model(tmp_path, tiny_dir, "mean", lora=False)
    input_ids, attention, response = _batch(tokenizer)
    with open(os.path.join(out, "config.json")) as f:
        line = json.load(f)["rlhfkit_score"]
    card = ModelCard.load(os.path.join(out, "README.md"))
    assert line == score_reading("mean", pad_is_eos=True) and line in card.text
    assert "trl-compatible" not in card.data.tags
    plain = AutoModelForSequenceClassification.from_pretrained(out)
    with torch.no_grad():
        ours = sequence_scores(model, input_ids, attention, response)
        # The line's recipe, in transformers alone: the score head on every token, averaged over the response.
        hidden = plain.model(input_ids=input_ids, attention_mask=attention).last_hidden_state
        per_token = plain.score(hidden)[..., 0]
        recipe = (per_token * response).sum(-1) / response.sum(-1)
        forward = plain(input_ids=input_ids, attention_mask=attention).logits[:, 0]
    torch.testing.assert_close(recipe, ours, atol=1e-5, rtol=0)
    assert not torch.allclose(forward, ours, atol=1e-3)  # the plain forward is not this model's reward, as the line says


# 3. The push ----------------------------------------------------------------------------------------------------


class StandInApi:
    """Records HfApi calls; lists the files an upload would send with huggingface_hub's own pattern filter."""

    def __init__(self):
        self.calls = []

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def upload_folder(self, *, repo_id, folder_path, path_in_repo=None, ignore_patterns=None, delete_patterns=None, **kw):
        files = sorted(os.path.relpath(os.path.join(d, f), folder_path) for d, _, fs in os.walk(folder_path) for f in fs)
        sent = list(filter_repo_objects(files, ignore_patterns=ignore_patterns))
        self.calls.append(("upload_folder", repo_id, path_in_repo, sent, delete_patterns, kw["commit_message"]))


def test_push_sends_the_final_model_without_checkpoints_and_checkpoints_by_strategy(tmp_path):
    run = tmp_path / "run"
    for name in ("model.safetensors", "config.json", "README.md", "config.yaml", "metrics.jsonl",
                 "checkpoint-2/trainer_state.pt", "checkpoint-2/model/model.safetensors", ".tmp-x/junk",
                 "wandb/offline-run/run.wandb", "runs/run/events.out"):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("x")
    api = StandInApi()
    push_final_model(str(run), "me/model", api=api)
    assert api.calls[0] == ("create_repo", "me/model", {"repo_type": "model", "exist_ok": True})
    assert api.calls[1] == ("upload_folder", "me/model", None, ["README.md", "config.json", "config.yaml",
                                                               "metrics.jsonl", "model.safetensors"], None,
                            "rlhfkit: final model")
    checkpoint = str(run / "checkpoint-2")
    api = StandInApi()
    push_checkpoint(checkpoint, "me/model", "end", api=api)
    assert api.calls == []
    push_checkpoint(checkpoint, "me/model", "checkpoint", api=api)
    push_checkpoint(checkpoint, "me/model", "all_checkpoints", api=api)
    uploads = [c for c in api.calls if c[0] == "upload_folder"]
    assert [(c[2], c[3], c[4]) for c in uploads] == [
        ("last-checkpoint", ["model/model.safetensors", "trainer_state.pt"], ["*"]),
        ("checkpoint-2", ["model/model.safetensors", "trainer_state.pt"], None)]
    assert PUSH_IGNORE[0] == "checkpoint-*"


def test_push_is_refused_at_start_offline_or_without_a_repo(monkeypatch):
    check_hub(False, None)  # no push: nothing to check
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError) as exc:
        check_hub(True, "me/model")
    assert str(exc.value) == ("config key 'logging.push_to_hub': the hub is offline (HF_HUB_OFFLINE is set); unset it "
                              "or pass logging.push_to_hub=false")
    with pytest.raises(UserError, match=r"^config key 'logging.push_to_hub': needs logging.hub_model_id"):
        check_hub(True, None)
    with pytest.raises(UserError, match=r"^config key 'logging.hub_strategy': must be one of end, checkpoint, "
                                        r"all_checkpoints, got 'every_step'$"):
        check_hub(True, "me/model", "every_step")


def test_card_names_canonical_hub_datasets_without_an_owner(tmp_path, tiny_dir):
    """`imdb`, `squad`: hub datasets with no owner prefix are datasets too; a local directory or file is not."""
    out = _model_dir(tmp_path, tiny_dir)
    os.makedirs(tmp_path / "localdir", exist_ok=True)
    cfg = _grpo_cfg(**{"data.train": "imdb", "data.eval": str(tmp_path / "localdir")})
    assert ModelCard.load(write_model_card(out, "grpo", cfg, {})).data.to_dict()["datasets"] == ["imdb"]
    cfg = _grpo_cfg(**{"data.train": "prompts.jsonl"})
    assert "datasets" not in ModelCard.load(write_model_card(out, "grpo", cfg, {})).data.to_dict()
