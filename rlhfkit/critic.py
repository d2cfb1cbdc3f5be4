"""PPO's critic in one place: where it comes from (`load_critic`), the second-adapter critic that shares the policy's
base (`SharedBaseCritic`), the pair DeepSpeed prepares as one module (`PolicyAndCritic`), and what it reads of a
rollout (`critic_values`). Its loss is `losses.policy.value_loss`, applied by the online update."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel

from rlhfkit.config import ModelConfig, OnlineConfig
from rlhfkit.errors import UserError
from rlhfkit.forwards import attention_inputs, moved_left_rollout
from rlhfkit.models import load_reward_model
from rlhfkit.rewards import RewardModelSource, token_scores
from rlhfkit.types import Rollout


class PolicyAndCritic(torch.nn.Module):
    """The policy and its critic as one module, for engines that take one model per Accelerator (DeepSpeed): prepared
    together, each still called through its own forward, never through this one."""

    def __init__(self, policy: torch.nn.Module, critic: torch.nn.Module):
        super().__init__()
        self.policy, self.critic = policy, critic

    def forward(self, *args, **kwargs):
        raise TypeError("PolicyAndCritic only holds the two models: call .policy or .critic")


class SharedBaseCritic(torch.nn.Module):
    """A PPO critic on the policy's own frozen base: a second LoRA adapter ("value") plus a linear value head.

    With LoRA, the policy (adapter "default"), the reference (adapters disabled) and this critic hold one copy of
    the base weights. The policy is not registered as a submodule (its parameters belong to the policy); the
    critic's trainable parameters are the "value" adapter (inside the policy) and `head`.

    Switching adapters with peft's `set_adapter` also flips `requires_grad`; `active` restores the flags, so both
    adapters stay trainable. Gradient checkpointing recomputes each layer's forward in the backward with whatever
    adapter is active then: a caller that backpropagates the values runs the backward inside `active()` too (under
    the policy's adapter the recomputed activations, and so the critic's gradients, would be the policy's).
    """

    ADAPTER = "value"

    def __init__(self, policy: PeftModel, cfg: ModelConfig):
        super().__init__()
        object.__setattr__(self, "policy", policy)  # not a submodule
        base = policy.get_base_model()
        policy.add_adapter(self.ADAPTER, PeftLoraConfig(
            task_type="CAUSAL_LM", r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
            target_modules=cfg.lora.target_modules))
        for name, p in policy.named_parameters():
            if f".{self.ADAPTER}." in name:
                p.requires_grad_(True)
        hidden = base.config.hidden_size
        self.head = torch.nn.Linear(hidden, 1)
        torch.nn.init.normal_(self.head.weight, std=1 / (hidden + 1) ** 0.5)  # TRL's value-head initialisation
        torch.nn.init.zeros_(self.head.bias)
        self.head.to(next(base.parameters()).device)

    def active(self):
        """The "value" adapter active (both adapters' `requires_grad` kept) until the context exits."""

        @contextlib.contextmanager
        def swap():
            flags = {n: p.requires_grad for n, p in self.policy.named_parameters()}
            previous = self.policy.active_adapter
            self.policy.set_adapter(self.ADAPTER)
            try:
                yield
            finally:
                self.policy.set_adapter(previous)
                for n, p in self.policy.named_parameters():
                    p.requires_grad_(flags[n])

        return swap()

    def forward(self, input_ids, attention_mask):
        """(B, T) values: the head on the last hidden state of the base run with the "value" adapter. Rows with a pad
        before a real token keep their mask; right-padded ones (a rollout `moved_left`) run without one
        (`forwards.attention_inputs`): no (B, 1, T, T) mask, its float copy or the keys and values expanded to the
        query heads kept for the backward, so the critic's update holds what the policy's does."""
        base = self.policy.get_base_model()
        backbone = getattr(base, base.base_model_prefix)
        with self.active():
            hidden = backbone(input_ids=input_ids, **attention_inputs(attention_mask),
                              use_cache=False).last_hidden_state  # (B, T, H)
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()  # (B, T, H) -> (B, T)

    def save(self, directory: str) -> None:
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        state = get_peft_model_state_dict(self.policy, adapter_name=self.ADAPTER)
        state.update({f"head.{k}": v for k, v in self.head.state_dict().items()})
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(directory, "critic.safetensors"))

    def load(self, directory: str) -> None:
        from peft.utils import set_peft_model_state_dict
        from safetensors.torch import load_file

        state = load_file(os.path.join(directory, "critic.safetensors"))
        head = {k[len("head."):]: v for k, v in state.items() if k.startswith("head.")}
        self.head.load_state_dict(head)
        set_peft_model_state_dict(self.policy, {k: v for k, v in state.items() if not k.startswith("head.")}, adapter_name=self.ADAPTER)


def load_critic(cfg: OnlineConfig, policy, tokenizer, first: RewardModelSource | None, given_policy=None):
    """PPO's value model: with LoRA (and no algo.value_model) a second adapter on the policy's own base; otherwise a
    sequence-classification model from algo.value_model, the first reward model (`first`), or the policy.
    `given_policy`: the policy object the Python API was given, if any."""
    a = cfg.algo
    if cfg.model.lora.enabled and not a.value_model:
        return SharedBaseCritic(policy, cfg.model)  # one base for policy, reference and critic
    first = first if not a.value_model else None
    if first is not None and first.own_vocabulary:
        raise UserError(f"algo.value_model: PPO's critic starts from the first reward model ('{first.name}'), whose "
                        f"tokenizer is not the policy's ('{cfg.model.name_or_path}'), and the critic reads the "
                        "policy's tokens; set algo.value_model to a model with the policy's tokenizer (the policy "
                        "itself, with algo.allow_new_value_head=true)")
    init = a.value_model or (cfg.model.name_or_path if first is None else first.name if first.given is not None
                             else cfg.reward.model[0])
    given = None
    if first is not None and first.given is not None:
        # A reward-model object given from Python: the critic is a trainable copy (the reward model stays frozen).
        given = copy.deepcopy(first.given).requires_grad_(True).train()
    elif not a.value_model and first is None and given_policy is not None:
        given = policy  # a policy object given from Python: a copy of its backbone under a new value head
    return load_reward_model(dataclasses.replace(cfg.model, name_or_path=init, gguf_file=None), tokenizer, given=given,
                             allow_new_head=not a.value_model or a.allow_new_value_head, key="algo.value_model",
                             hint="set algo.allow_new_value_head=true to start the critic's value head at random")


def critic_values(critic, plain, ro: Rollout) -> torch.Tensor:
    """(B, R) values V(s_t) of the state before each of the policy's tokens, 0 on the other tokens (a tool result is
    no action: it takes no value loss). `critic` is the module to call (prepared for the update, the unwrapped one in
    no-grad forwards), `plain` the unwrapped critic (which kind of critic it is)."""
    ids, mask, take = moved_left_rollout(ro)  # right-padded: no mask to build (`models.moved_left`)
    v = critic(ids, mask) if isinstance(plain, SharedBaseCritic) else token_scores(critic, ids, mask)  # (B, T)
    return v.gather(1, take) * ro.action_mask
