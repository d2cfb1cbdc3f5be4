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


def test_the_critic_on_moved_left_rows_holds_no_more_than_the_policy():
    """PPO's LoRA critic reads a rollout moved left past its prompts' padding (right-padded rows) and runs them
    without a mask, as the policy's log-probs do: its forward and backward (live tensors) peak no
    higher (to 1%) than the policy's on the same rows, which is what the planner plans the update from. With a mask it held
    the (B, 1, T, T) mask, its float copy and the keys and values expanded to the query heads besides, which left
    the tiny PPO LoRA and QLoRA cells at 4 x 128 planned 8-13% under. The values are those of the rows run with
    their mask."""
    from rlhfkit.critic import critic_values
    from rlhfkit.models import rollout_logprobs
    from rlhfkit.plan.measure import LiveTensors
    from tests.unit.test_response_logits import rollout

    cfg = ModelConfig(name_or_path="tiny", lora=LoraConfig(enabled=True, r=8, dropout=0.0))
    policy = load_causal_lm(cfg)  # as the online stages do
    policy.train()
    critic = SharedBaseCritic(policy, cfg)
    ro = rollout([64, 3, 64, 10], [64, 64, 40, 64], p=64, r=64)
    peaks = []
    for read in (lambda: critic_values(critic, critic, ro), lambda: rollout_logprobs(policy, ro)):
        tracker = LiveTensors()
        tracker.add_module(policy)
        tracker.add_module(critic)
        with tracker:
            base = tracker.current
            tracker.reset_peak()
            read().sum().backward()
            peaks.append(tracker.peak - base)
        policy.zero_grad(set_to_none=True)
        critic.zero_grad(set_to_none=True)
    assert peaks[0] <= 1.01 * peaks[1], peaks  # the value head against the logits: a few hundred bytes either way
    with torch.no_grad():
        masked = critic(ro.input_ids, ro.attention_mask)[:, 63:-1] * ro.action_mask  # the left-padded batch, masked
        torch.testing.assert_close(critic_values(critic, critic, ro), masked, rtol=1e-6, atol=1e-6)
