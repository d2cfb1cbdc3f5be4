"""The LoRA export: merged on a CPU copy, the same files as peft's own merge, the trained model left as it was."""

import copy
import os

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.config import LoraConfig, ModelConfig
from rlhfkit.model_sources import build_tiny_model
from rlhfkit.models import cpu_copy, load_causal_lm, load_reward_model, load_tokenizer, save_model

LORA = LoraConfig(enabled=True, r=4, alpha=8, dropout=0.0)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny") / "model")
    build_tiny_model(path)
    return path


def _trained(tiny_dir, loader, device="cpu"):
    cfg = ModelConfig(name_or_path=tiny_dir, lora=LORA)
    tokenizer = load_tokenizer(cfg)
    torch.manual_seed(0)
    model = loader(cfg, tokenizer).to(device)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:  # LoRA B starts at zero: random adapters make the merge change every targeted weight
                p.copy_(torch.randn(p.shape, generator=gen).to(device) * 0.1)
    return model, tokenizer


@pytest.mark.parametrize("loader", [load_causal_lm, load_reward_model], ids=["policy", "reward_model"])
def test_merged_export_equals_peft_merge_of_a_full_copy(tmp_path, tiny_dir, loader):
    model, tokenizer = _trained(tiny_dir, loader)
    before = {n: (p.detach().clone(), p.requires_grad) for n, p in model.named_parameters()}
    out = str(tmp_path / "merged")
    save_model(model, tokenizer, out)

    saved = load_file(os.path.join(out, "model.safetensors"))
    expected = copy.deepcopy(model).merge_and_unload().state_dict()  # the export as it was: a full deep copy merged
    assert set(saved) <= set(expected) and set(expected) - set(saved) <= {"lm_head.weight"}  # tied to the embeddings
    for k, v in saved.items():
        assert torch.equal(v, expected[k].contiguous()), k
    # Every LoRA-targeted weight really moved (the test would pass vacuously on a no-op adapter otherwise).
    base = load_file(os.path.join(tiny_dir, "model.safetensors"))
    assert not torch.equal(saved["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    # The trained model is untouched: same tensors, same trainable flags, still a peft model.
    after = dict(model.named_parameters())
    assert before.keys() == after.keys()
    for n, (value, trainable) in before.items():
        assert torch.equal(after[n], value) and after[n].requires_grad == trainable, n


def test_cpu_copy_keeps_ties_and_leaves_the_original(tiny_dir):
    model, _ = _trained(tiny_dir, load_causal_lm)
    twin = cpu_copy(model)
    assert all(p.device.type == "cpu" for p in twin.parameters())
    assert all(a is not b for a, b in zip(model.parameters(), twin.parameters()))
    base = twin.get_base_model()
    tied = base.config.tie_word_embeddings
    assert (base.lm_head.weight is base.get_input_embeddings().weight) == tied == (
        model.get_base_model().lm_head.weight is model.get_base_model().get_input_embeddings().weight)
    for (n, a), (_, b) in zip(model.named_parameters(), twin.named_parameters()):
        assert torch.equal(a, b) and a.requires_grad == b.requires_grad, n


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures accelerator memory")
def test_merged_export_allocates_no_second_copy_on_the_accelerator(tmp_path, tiny_dir):
    model, tokenizer = _trained(tiny_dir, load_causal_lm, device="cuda")
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    save_model(model, tokenizer, str(tmp_path / "merged"))
    torch.cuda.synchronize()
    # A deep copy on the device would add model_bytes; the CPU merge adds nothing beyond transient copies.
    assert torch.cuda.max_memory_allocated() - start < 0.1 * model_bytes


def test_cpu_copy_keeps_meta_tensors_on_the_meta_device():
    """Under FSDP the main process saves a whole copy built on the meta device around the gathered state dict, whose
    non-persistent buffers stay meta: the CPU copy must carry them over as they are (copying one raised)."""
    from rlhfkit.models import cpu_copy

    module = torch.nn.Linear(3, 2)
    module.register_buffer("inv_freq", torch.empty(4, device="meta"), persistent=False)
    module.register_parameter("extra", torch.nn.Parameter(torch.empty(2, device="meta")))
    copied = cpu_copy(module)
    assert copied.inv_freq.is_meta and copied.extra.is_meta
    assert copied.weight.device.type == "cpu" and torch.equal(copied.weight, module.weight)
    assert copied.weight is not module.weight


@pytest.mark.parametrize("loader", [load_causal_lm, load_reward_model], ids=["policy", "reward_model"])
def test_merged_export_keeps_the_adapter_beside_it_that_peft_reloads_onto_the_base(tmp_path, tiny_dir, loader):
    """The final directory holds the merged model and, in adapter/, the adapter alone: the base plus that adapter,
    loaded by peft, computes what the merged model computes."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    model, tokenizer = _trained(tiny_dir, loader)
    out = str(tmp_path / "merged")
    save_model(model, tokenizer, out)
    assert os.path.isfile(os.path.join(out, "adapter", "adapter_config.json"))
    auto = AutoModelForCausalLM if loader is load_causal_lm else AutoModelForSequenceClassification
    merged = auto.from_pretrained(out)
    torch.manual_seed(0)  # a reward model's new head: the adapter directory carries the trained one
    base = auto.from_pretrained(tiny_dir, **({} if loader is load_causal_lm else {"num_labels": 1}))
    base.config.pad_token_id = merged.config.pad_token_id
    if len(tokenizer) > base.get_input_embeddings().num_embeddings:
        base.resize_token_embeddings(len(tokenizer))
    adapted = PeftModel.from_pretrained(base, os.path.join(out, "adapter"))
    ids = tokenizer("the lamp was fine", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
