"""The rollout component: this process's prompts in, a `Rollout` out. The experience maker never knows which one.

- `single_turn.SingleTurn`: each prompt's `generation.num_samples` responses from the decode loop (`generation`);
- `tool_loop.ToolLoop`: multi-turn episodes, the policy's turns with the results of the tools it calls between them
  (its `Rollout.action_mask` then differs from the `response_mask`).

A component is called with the policy as a plain module (gathered when sharded: the caller's job), the left-padded
prompts, their dataset examples (`data.build_datasets("prompt", ...)`: "prompt", "columns"; one per prompt) and the
step (0-based, for `generation.seed_per_prompt`). It returns one row per sample, a prompt's samples adjacent, with the
completions decoded once (`Rollout.texts`, `Rollout.completions`), or None when the policy's probabilities are not
finite (weights that blew up: a bad step, not a crash).
"""

from __future__ import annotations

from typing import Protocol

import torch

from rlhfkit.generation import prompt_seed
from rlhfkit.types import PromptBatch, Rollout


class RolloutMaker(Protocol):
    def __call__(self, policy: torch.nn.Module, prompts: PromptBatch, examples: list[dict], step: int) -> Rollout | None:
        ...


def prompt_seeds(seed: int, step: int, prompts: PromptBatch, per_prompt: bool) -> list[int] | None:
    """With `generation.seed_per_prompt`, one seed per prompt from (the run's seed, the step, the prompt's tokens):
    a prompt's samples are then the same on any number of processes. None otherwise (the run's random state)."""
    if not per_prompt:
        return None
    return [prompt_seed(seed, step, ids[mask.bool()]) for ids, mask in zip(prompts.input_ids, prompts.attention_mask)]


def is_nonfinite_sampling(exc: RuntimeError) -> bool:
    """Whether `torch.multinomial` refused the policy's probabilities ("probability tensor contains either inf, nan or
    element < 0"): the weights blew up."""
    return "inf" in str(exc) and "nan" in str(exc)

