"""Run `rlhfkit.cli.main(sys.argv[1:])` with sampling made a function of (step, prompt) alone.

Each process of a data-parallel run samples its own prompts with its own random stream, so a run on two processes
can never draw the same responses as one process drawing the whole batch — unless each prompt's k responses are
drawn from a generator seeded by the step and the prompt's tokens. With that (and dropout off, as by default), the
global batch of a run is the same whatever the world size, and so must be its losses, gradients and weights.

Usage: `python deterministic_run.py grpo --config ...` or `torchrun --nproc_per_node 2 deterministic_run.py ...`.
"""

import hashlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from rlhfkit.cli import main  # noqa: E402
from rlhfkit.generation import generate  # noqa: E402
from rlhfkit.trainers import online_setup  # noqa: E402
from rlhfkit.types import PromptBatch, Rollout  # noqa: E402

prompts_for = online_setup.OnlineModels.prompts_for


def recording_step(self, step):
    self.current_step = step
    return prompts_for(self, step)


def seeded_sample(self, prompts):
    """`generate` one prompt at a time under a seed of (step, prompt tokens); the rows padded back together."""
    tok, policy = self.tokenizer, self.accelerator.unwrap_model(self.model)
    parts = []
    for ids, mask in zip(prompts.input_ids, prompts.attention_mask):
        ids = ids[mask.bool()].unsqueeze(0)
        seed = int(hashlib.sha256(f"{self.current_step}:{ids.tolist()}".encode()).hexdigest()[:8], 16)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            parts.append(generate(policy, PromptBatch(ids, torch.ones_like(ids)), self.cfg.generation, tok.eos_token_id,
                                  tok.pad_token_id))
    width_p = max(p.prompt_ids.shape[1] for p in parts)
    width_r = max(p.response_ids.shape[1] for p in parts)
    left = lambda x, v: torch.nn.functional.pad(x, (width_p - x.shape[1], 0), value=v)  # noqa: E731
    right = lambda x, v: torch.nn.functional.pad(x, (0, width_r - x.shape[1]), value=v)  # noqa: E731
    k = self.cfg.generation.num_samples
    return Rollout(
        prompt_ids=torch.cat([left(p.prompt_ids, tok.pad_token_id) for p in parts]),
        prompt_mask=torch.cat([left(p.prompt_mask, 0) for p in parts]),
        response_ids=torch.cat([right(p.response_ids, tok.pad_token_id) for p in parts]),
        response_mask=torch.cat([right(p.response_mask, 0) for p in parts]),
        group_ids=torch.arange(len(parts), device=prompts.input_ids.device).repeat_interleave(k),
        has_eos=torch.cat([p.has_eos for p in parts]),
        sampler_logprobs=torch.cat([right(p.sampler_logprobs, 0.0) for p in parts]),
    )


# On the online loops' shared base: every online stage (PPO, ..., online DPO) samples through it.
online_setup.OnlineModels.prompts_for = recording_step
online_setup.OnlineModels.sample = seeded_sample

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
