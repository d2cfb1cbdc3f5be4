"""The LoRA critic shares the policy's base: a second adapter plus a value head, one copy of the weights."""

import torch

from rlhfkit.config import LoraConfig, ModelConfig
from rlhfkit.critic import SharedBaseCritic
from rlhfkit.models import load_causal_lm, load_tokenizer


def build():
    cfg = ModelConfig(name_or_path="tiny", lora=LoraConfig(enabled=True, r=4))
    tok = load_tokenizer(cfg)
    torch.manual_seed(0)
    policy = load_causal_lm(cfg, tok)
    critic = SharedBaseCritic(policy, cfg)
    ids = torch.tensor([[5, 6, 7, 8, 9], [2, 2, 5, 6, 7]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    return policy, critic, ids, mask


def test_value_gradients_reach_only_the_value_adapter_and_head():
    policy, critic, ids, mask = build()
    assert sum(p.numel() for p in critic.parameters()) == critic.head.weight.numel() + 1  # the base is not copied
    critic(ids, mask).sum().backward()
    grads = {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}
    assert grads and all(".value." in n for n in grads)
    assert any(g.abs().sum() > 0 for g in grads.values())
    assert critic.head.weight.grad.abs().sum() > 0
    # Both adapters stay trainable after the switch, and the policy is back on its own adapter.
    assert policy.active_adapter == "default"
    assert all(p.requires_grad for n, p in policy.named_parameters() if "lora_" in n)


def test_value_adapter_does_not_change_the_policy():
    policy, critic, ids, mask = build()
    before = policy(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if ".value." in n:
                p.add_(0.5)
    after = policy(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(after, before)


def test_save_and_load_round_trip(tmp_path):
    _, critic, ids, mask = build()
    with torch.no_grad():
        critic.head.bias.fill_(1.25)
    values = critic(ids, mask)
    critic.save(str(tmp_path))
    _, fresh, _, _ = build()
    fresh.load(str(tmp_path))
    torch.testing.assert_close(fresh(ids, mask), values)
