"""The single-turn rollout: `generation.num_samples` responses per prompt from the decode loop, decoded once."""

from __future__ import annotations

from dataclasses import replace

import torch

from rlhfkit.config import GenerationConfig
from rlhfkit.data.formats import is_conversational
from rlhfkit.generation import generate, stop_strings
from rlhfkit.rollout import is_nonfinite_sampling, prompt_seeds
from rlhfkit.types import PromptBatch, Rollout, Rows


class SingleTurn:
    """`RolloutMaker` of one assistant turn per sample (`generation.generate`)."""

    def __init__(self, tokenizer, params: GenerationConfig, seed: int):
        self.tokenizer, self.params, self.seed = tokenizer, params, seed
        self.stop = stop_strings(params, tokenizer)

    @torch.no_grad()
    def __call__(self, policy, prompts: PromptBatch, examples: list[dict], step: int) -> Rollout | None:
        tok, k = self.tokenizer, self.params.num_samples
        seeds = prompt_seeds(self.seed, step, prompts, self.params.seed_per_prompt)
        try:
            ro = generate(policy, prompts, self.params, tok.eos_token_id, tok.pad_token_id, seeds, self.stop)
        except RuntimeError as exc:
            if is_nonfinite_sampling(exc):
                return None
            raise
        return decoded(ro, tok, [e["prompt"] for e in examples for _ in range(k)])


def decoded(ro: Rollout, tokenizer, prompts: list) -> Rollout:
    """`ro` with its completions decoded (one `batch_decode`): the text of each, and what reward functions get under
    TRL's contract, `[{"role": "assistant", "content": text}]` where the row's prompt is a message list."""
    texts = tokenizer.batch_decode([row[m.bool()].tolist() for row, m in zip(ro.response_ids, ro.response_mask)],
                                   skip_special_tokens=True)
    completions = [[{"role": "assistant", "content": t}] if is_conversational(p) else t for p, t in zip(prompts, texts)]
    return replace(ro, texts=Rows(texts), completions=Rows(completions))
