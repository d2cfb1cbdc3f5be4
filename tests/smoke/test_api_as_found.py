"""`rlhfkit.train` leaves the caller's objects as it found them: a given tokenizer's padding side, chat template and
pad token, a given model's train/eval mode (every module's), its parameters' `requires_grad` flags and its KV-cache
and checkpointing settings, and a given reward model's mode and flags, when it returns and when it raises. The model
it trains is trained (its weights change); nothing else about it does."""

import pytest
import torch
from transformers import TrainerCallback

import rlhfkit
from rlhfkit.errors import UserError
from tests.smoke.test_api import tiny_model_and_tokenizer
from tests.unit.test_reward_functions import rm_object


def tokenizer_state(tok) -> dict:
    return {"padding_side": tok.padding_side, "truncation_side": tok.truncation_side, "pad_token": tok.pad_token,
            "chat_template": tok.chat_template, "response_template": getattr(tok, "response_template", None),
            "size": len(tok)}


def model_state(model) -> dict:
    return {"modes": [(name, m.training) for name, m in model.named_modules()],
            "requires_grad": [(name, p.requires_grad) for name, p in model.named_parameters()],
            "use_cache": model.config.use_cache, "checkpointing": getattr(model, "is_gradient_checkpointing", False),
            "pad_token_id": model.config.pad_token_id, "dropout": dropout_rates(model)}


def dropout_rates(model) -> list:
    """Every dropout probability a run may set to 0 (algo.disable_dropout): Dropout layers' p, attention modules'
    attention_dropout."""
    return [(name, m.p if isinstance(m, torch.nn.Dropout) else m.attention_dropout) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Dropout) or isinstance(getattr(m, "attention_dropout", None), float)]


def weights(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


class RaiseAtStep(TrainerCallback):
    """Raises at the end of step 1: the run stops with a UserError, its models prepared and in training."""

    def on_step_end(self, args, state, control, **kwargs):
        raise RuntimeError("stop here")


def train_once(stage: str, raises: bool, tmp_path, **kwargs):
    """`rlhfkit.train(stage, ...)` to its end (its result), or with `raises` stopped by `RaiseAtStep` (None), the
    UserError it ends with checked."""
    kwargs.update(callbacks=[RaiseAtStep()] if raises else None, output_dir=str(tmp_path / stage))
    if not raises:
        return rlhfkit.train(stage, **kwargs)
    with pytest.raises(UserError, match="RaiseAtStep.on_step_end raised"):
        rlhfkit.train(stage, **kwargs)
    return None


def a_callers_policy():
    """The tiny policy as a caller may hold it: in eval mode, its embeddings frozen, left padding, no chat template
    of rlhfkit's."""
    model, tokenizer = tiny_model_and_tokenizer()
    model.eval()
    model.get_input_embeddings().weight.requires_grad_(False)
    tokenizer.padding_side = "left"
    tokenizer.truncation_side = "left"
    return model, tokenizer


@pytest.mark.parametrize("raises", [False, True], ids=["returns", "raises"])
def test_sft_leaves_the_callers_model_and_tokenizer_as_found(tmp_path, raises):
    model, tokenizer = a_callers_policy()
    model_before, tokenizer_before, weights_before = model_state(model), tokenizer_state(tokenizer), weights(model)
    result = train_once(
        "sft", raises, tmp_path, model=model, tokenizer=tokenizer, train_dataset="data/tiny/sft_train.jsonl",
        config="configs/sft_tiny.yaml",
        overrides={"max_steps": 2, "data.eval": None, "logging.progress_bar": False, "optim.per_device_batch_size": 4,
                   "model.chat_template": "chatml_tools", "model.gradient_checkpointing": True})
    assert raises or result.model is model
    assert tokenizer_state(tokenizer) == tokenizer_before
    assert model_state(model) == model_before
    after = weights(model)
    changed = {k for k in after if not torch.equal(after[k], weights_before[k])}
    assert "model.embed_tokens.weight" not in changed  # frozen by the caller, so not trained
    assert changed or raises  # trained


@pytest.mark.parametrize("raises", [False, True], ids=["returns", "raises"])
def test_grpo_leaves_the_callers_reward_model_as_found(tmp_path, raises):
    """A reward model given with its tokenizer, in training mode with gradients on, as it came out of the caller's own
    training: scored with in eval mode, no gradients, and handed back as it was."""
    _, tokenizer = tiny_model_and_tokenizer()
    rm, rm_tokenizer = rm_object(len(tokenizer)), tokenizer
    rm.train()
    rm_tokenizer.padding_side = "left"
    rm_before, tok_before, rm_weights = model_state(rm), tokenizer_state(rm_tokenizer), weights(rm)
    train_once("grpo", raises, tmp_path, model="tiny", reward_funcs=[(rm, rm_tokenizer)], config="configs/grpo_tiny.yaml",
               overrides={"max_steps": 1, "logging.progress_bar": False, "reward.function": None})
    assert model_state(rm) == rm_before
    assert tokenizer_state(rm_tokenizer) == tok_before
    assert all(torch.equal(v, rm_weights[k]) for k, v in weights(rm).items())


@pytest.mark.parametrize("raises", [False, True], ids=["returns", "raises"])
def test_grpo_gives_back_the_callers_dropout(tmp_path, raises):
    """The online stages turn dropout off while they train (algo.disable_dropout, as TRL does); the caller's model
    object gets its own dropout rates back."""
    model, tokenizer = a_callers_policy()
    model.model.layers[0].self_attn.attention_dropout = 0.1
    model.model.layers[1].mlp.add_module("drop", torch.nn.Dropout(0.25))  # a Dropout layer (not on the forward path)
    before = model_state(model)
    rates = dict(before["dropout"])
    assert (rates["model.layers.0.self_attn"], rates["model.layers.1.mlp.drop"]) == (0.1, 0.25)
    train_once("grpo", raises, tmp_path, model=model, tokenizer=tokenizer, config="configs/grpo_tiny.yaml",
               overrides={"max_steps": 1, "logging.progress_bar": False})
    assert model_state(model) == before
