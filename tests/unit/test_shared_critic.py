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


def test_a_checkpointed_update_gives_the_critic_the_gradients_of_a_plain_one(tmp_path):
    """PPO with LoRA: one update of the same experience with and without gradient checkpointing moves the policy's
    and the critic's adapters (and the value head) alike. Checkpointing recomputes each layer in the backward under
    the adapter active then, so the critic's backward runs under its own ("value"); under the policy's, its
    gradients came from the policy's activations (several times off on this model). AdamW at eps 1 takes a step
    along the gradient itself (|g| << 1), not its sign."""
    from tests.property.test_online_math import build

    args = ("model.lora.enabled=true", "model.lora.dropout=0.0", "max_steps=1", "optim.lr=1.0", "optim.adam_eps=1.0",
            "algo.ppo_epochs=1", "algo.rollout_batch_size=4", "optim.per_device_batch_size=4")
    plain = build(tmp_path / "plain", "ppo_tiny.yaml", *args)
    ckpt = build(tmp_path / "ckpt", "ppo_tiny.yaml", *args, "model.gradient_checkpointing=true")
    assert plain.shares_base and ckpt.shares_base
    before = []
    for t in (plain, ckpt):  # LoRA's B starts at zero: give both adapters a value, the same in both runs
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in t.run.unwrap(t.model).named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        before.append(trained(t))
    exp = plain.experience(0).experience
    for t in (plain, ckpt):
        t.update(exp, 1)
    moved = [{k: v - before[i][k] for k, v in trained(t).items()} for i, t in enumerate((plain, ckpt))]
    assert any(".value." in k for k in moved[0]) and "head.weight" in moved[0]
    for k, step in moved[0].items():
        assert step.abs().max() > 0, k
        torch.testing.assert_close(moved[1][k], step, rtol=1e-4, atol=1e-7, msg=k)


def trained(t) -> dict[str, torch.Tensor]:
    """The trained tensors of an online trainer with a shared-base critic: both adapters and the value head."""
    policy, critic = t.run.unwrap(t.model), t.run.unwrap(t.value)
    out = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_" in n}
    return out | {f"head.{n}": p.detach().clone() for n, p in critic.head.named_parameters()}


def test_a_checkpointed_lora_backward_leaves_only_the_adapters_gradients_alive():
    """LoRA with gradient checkpointing (torch's non-reentrant variant): once the policy's backward is done, with its
    loss still referenced (the PPO update holds it through the critic's forward and backward), what the step added is
    the adapters' gradients alone. peft's `enable_input_require_grads` recipe, which only the reentrant variant needs,
    made the embedding's output a leaf that requires grad: it and its own B·T·H gradient stayed alive beside them,
    what left the tiny PPO LoRA and QLoRA cells with checkpointing planned 5-6% under."""
    from rlhfkit.models import rollout_logprobs
    from rlhfkit.plan.measure import LiveTensors
    from tests.unit.test_response_logits import rollout

    cfg = ModelConfig(name_or_path="tiny", gradient_checkpointing=True, lora=LoraConfig(enabled=True, r=8, dropout=0.0))
    policy = load_causal_lm(cfg)
    policy.train()
    ro = rollout([64, 3, 64, 10], [64, 64, 40, 64], p=64, r=64)
    tracker = LiveTensors()
    tracker.add_module(policy)
    with tracker:
        base = tracker.current
        loss = rollout_logprobs(policy, ro).sum()
        loss.backward()
        left = tracker.current - base
    grads = sum(p.grad.numel() * 4 for p in policy.parameters() if p.grad is not None)
    assert grads == 2 * 8 * (4 * 64 + 3 * 128 + 2 * 96 + 192) * 4  # r x (in + out) per adapted linear, 2 layers, fp32
    assert left == grads + loss.untyped_storage().nbytes(), (left, grads)
