"""The parts a sampling stage's step is made of, the same for every loop that samples: the experience maker (PPO,
RLOO, GRPO, REINFORCE++), online DPO and RFT roll out, score and run the reference's forward through them."""

from __future__ import annotations

import torch

from rlhfkit.models import set_training
from rlhfkit.reward_functions import source_stats
from rlhfkit.rewards import Rewards, Scores
from rlhfkit.rollout import RolloutMaker
from rlhfkit.sharding import gathered_weights
from rlhfkit.types import PromptBatch, Rollout


def pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    """(b, r) -> (b, width) with zeros on the right (a trimmed micro-batch's outputs back at the rollout's width)."""
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))



class Sampling:
    """The parts a sampling stage's step is made of, the same for every loop that samples (the experience maker,
    online DPO, RFT): 1. the rollout, the policy's weights whole on this process while it samples; 2. the scores, once
    for the batch, each source's figures over every process; 3. the reference's log-probs, in no-grad forwards without
    dropout, each micro-batch cut to its own longest response and padded back. Built from what it uses, never from
    the trainer."""

    def __init__(self, rollout: RolloutMaker, rewards: Rewards, reference, run, micro_batch: int, temperature: float):
        self.rollout, self.rewards, self.reference, self.run = rollout, rewards, reference, run
        self.micro_batch, self.temperature = micro_batch, temperature

    def roll_out(self, policy, prompts: PromptBatch, examples: list[dict], step) -> Rollout | None:
        """1. This process's rollout of `prompts` by the prepared `policy` (None: its probabilities were not finite)."""
        run = self.run
        with gathered_weights(run.accelerator, policy, run.unwrap(policy)) as sampler:  # FSDP / ZeRO-3: whole weights
            return self.rollout(sampler, prompts.to(run.accelerator.device), examples, step)

    def score(self, ro: Rollout, rows: list[dict], state) -> tuple[Scores, dict[str, float]]:
        """2. The rows' scores (`rows[i]`: row i's prompt example), and each source's figures over every process."""
        scored = self.rewards(ro, rows, state)
        return scored, source_stats({name: self.run.gather(v) for name, v in scored.per_source.items()})

    def micro(self, ro: Rollout, forward) -> torch.Tensor:
        """(B, R) `forward(chunk)` of each micro-batch of `ro`, cut to its own longest response, padded back to the
        rollout's width, 0 off the action mask."""
        width, mb = ro.response_ids.shape[1], self.micro_batch
        chunks = [ro.select(slice(i, i + mb)).trimmed() for i in range(0, ro.response_ids.shape[0], mb)]
        return torch.cat([pad_to(forward(c), width) for c in chunks]) * ro.action_mask

    def reference_logprobs(self, policy, ro: Rollout) -> torch.Tensor | None:
        """3. (B, R) log π_ref of the rollout's tokens (None without a reference); `policy`: the unwrapped module (a
        LoRA reference is its base)."""
        if self.reference is None:
            return None
        set_training(policy, False)
        return self.micro(ro, lambda c: self.reference.rollout_logprobs(policy, c, self.temperature))
