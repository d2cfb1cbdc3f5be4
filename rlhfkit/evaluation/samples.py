"""An evaluation's samples: drawn through the rollout component, described once, in one typed record.

`sample` draws the policy's (and the reference's) responses to the held-out prompts through a rollout component
(`rlhfkit.rollout`: the run's own, `rollout.maker.FreshRollout`, so the Python API's `Objects.rollout` is what is
evaluated; one turn per sample, `rollout.single_turn.SingleTurn`, when none is given), batch i under seed
`seed + i` for both models, and the per-sequence KL of the policy's samples to the reference. `Samples` is one model's
responses as every figure reads them: the text the rollout component decoded (once: the judges read the same), the
policy's token counts, EOS flags, groups, tool counts, and the judges' scores. `summarize` gives eval.json's per-model
figures from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlhfkit.config import GenerationConfig
from rlhfkit.data import collate_prompts
from rlhfkit.errors import UserError
from rlhfkit.evaluation.alarms import DISTINCT_KEY, TOP_SHARE_KEY, WORDS_KEY, diversity_figures
from rlhfkit.evaluation.capability import frozen_reference
from rlhfkit.evaluation.judges import Judged, judged
from rlhfkit.evaluation.metrics import distinct_n, empty_rate, eos_rate, mean_std, sequence_kl, truncation_rate
from rlhfkit.generation import seeded
from rlhfkit.models import rollout_logprobs
from rlhfkit.reward_functions import extra_columns
from rlhfkit.rollout.single_turn import SingleTurn
from rlhfkit.types import Rollout, ToolCounts


@dataclass(frozen=True)
class Samples:
    """One model's responses, rows in prompt order (a prompt's samples adjacent)."""

    prompts: list[str]  # each row's prompt as the model saw it, decoded (special tokens skipped)
    texts: list[str]  # each response's text (a whole episode's with tools), as the rollout component decoded it
    lengths: list[int]  # the policy's own tokens (`Rollout.action_mask`): tool results are not in it
    has_eos: list[bool]
    groups: list[int]  # the prompt of each row
    completions: list | None = None  # what reward functions got (TRL's contract); message lists with tools
    tools: ToolCounts | None = None  # what the episodes' tool calls did; None without tools
    scores: dict[str, list[float | None]] = field(default_factory=dict)  # judge -> one score per row
    logged: dict[str, float] = field(default_factory=dict)  # what the Python judges logged with log_metric
    extras: dict[str, list] = field(default_factory=dict)  # their log_extra columns, one value per row

    @classmethod
    def of(cls, ro: Rollout, tokenizer, verdicts: Judged | None = None) -> "Samples":
        """`ro` described: the text the rollout component decoded (decoded here, once, when it decoded none), the
        prompts in one batch decode, and the judges' `verdicts` (none: no scores)."""
        texts = list(ro.texts) if ro.texts is not None else tokenizer.batch_decode(
            [row[m.bool()].tolist() for row, m in zip(ro.response_ids, ro.response_mask)], skip_special_tokens=True)
        prompts = tokenizer.batch_decode([row[m.bool()].tolist() for row, m in zip(ro.prompt_ids, ro.prompt_mask)],
                                         skip_special_tokens=True)
        verdicts = verdicts or Judged({})
        return cls(prompts=prompts, texts=texts, lengths=ro.action_mask.sum(-1).tolist(), has_eos=ro.has_eos.tolist(),
                   groups=ro.group_ids.tolist(), completions=list(ro.completions) if ro.completions is not None else None,
                   tools=ro.tools, scores=verdicts.scores, logged=verdicts.logged, extras=verdicts.extras)

    def side(self, j: int) -> dict:
        """Row j as eval.json's samples show one model's response."""
        return {"response": self.texts[j], "scores": {n: v[j] for n, v in self.scores.items()}, "length": self.lengths[j],
                "eos": self.has_eos[j], "extra": extra_columns(self.extras, j)}


def summarize(s: Samples) -> dict:
    """The figures of one model's samples (eval.json's "policy" / "reference" objects)."""
    diversity = diversity_figures(s.texts, s.groups)
    return {
        "length": mean_std(s.lengths),
        "distinct_1": distinct_n(s.texts, 1), "distinct_2": diversity[DISTINCT_KEY],
        "words_avg": diversity[WORDS_KEY], "top_share": diversity.get(TOP_SHARE_KEY),
        "eos_rate": eos_rate(s.has_eos), "truncation_rate": truncation_rate(s.has_eos),
        "empty_rate": empty_rate(s.texts), "reward": {name: judged(v) for name, v in s.scores.items()},
        "logged": s.logged,
    }


def example(pol: Samples, ref: Samples | None, kls: list[float], j: int) -> dict:
    """eval.json's side-by-side sample j."""
    out = {"prompt": pol.prompts[j], "policy": pol.side(j), "reference": ref.side(j) if ref else None}
    if kls:
        out["policy"]["kl"] = kls[j]
    return out


@torch.no_grad()
def sample(policy, reference, tokenizer, prompts: list[dict], params: GenerationConfig, batch_size: int = 16,
           seed: int = 0, state=None, sample_reference: bool = True, rollout=None,
           ) -> tuple[list[Rollout], list[Rollout], list[float]]:
    """The policy's and the reference's rollouts (one per batch of `batch_size` prompts, batch i drawn under seed
    `seed + i` by both) and the per-sequence KL(policy || reference) of the policy's samples.

    `reference` is a model, a `models.Reference` (e.g. the policy's base with its LoRA adapters disabled) or None;
    with `sample_reference=False` it only gives the KL's log-probs (no reference rollouts: the online evaluation).
    With `state` (accelerate's, several processes) process r samples batches r, r + world, ... and every process
    returns all of them in batch order, on its own device: the same samples as one process. `rollout`: the rollout
    component to draw with (module docstring). The KL sums over the policy's own tokens (`Rollout.action_mask`).
    """
    if not prompts:
        raise UserError("no prompts to evaluate")
    rollout = rollout if rollout is not None else SingleTurn(tokenizer, params, seed)
    rank, world = (state.process_index, state.num_processes) if state is not None else (0, 1)
    device = next(policy.parameters()).device
    parts = []  # (batch index, policy rollout, reference rollout or None, KLs) of this process's batches
    for i, start in enumerate(range(0, len(prompts), batch_size)):
        if i % world != rank:
            continue
        examples = prompts[start : start + batch_size]
        batch = collate_prompts(examples, tokenizer.pad_token_id).to(device)

        def draw(model) -> Rollout:
            with seeded(seed + i):
                made = rollout(model, batch, examples, 0)
            if made is None:
                raise UserError("the model's next-token probabilities are not finite (inf or nan): its weights are broken")
            return made

        ro = draw(policy)
        ref_ro, kls = None, []
        if reference is not None:
            lp = rollout_logprobs(policy, ro, params.temperature)  # (B, R)
            with frozen_reference(reference, policy) as ref:
                if sample_reference:
                    ref_ro = draw(ref)
                ref_lp = rollout_logprobs(ref, ro, params.temperature)  # (B, R)
            kls = sequence_kl(lp, ref_lp, ro.action_mask).tolist()
        parts.append((i, ro, ref_ro, kls))
    if world > 1:
        from accelerate.utils import gather_object

        def to(ro: Rollout | None, where) -> Rollout | None:
            return ro.to(where) if ro is not None else None

        gathered = gather_object([(i, to(ro, "cpu"), to(ref_ro, "cpu"), kls) for i, ro, ref_ro, kls in parts])
        parts = [(i, to(ro, device), to(ref_ro, device), kls) for i, ro, ref_ro, kls in sorted(gathered, key=lambda p: p[0])]
    return ([ro for _, ro, _, _ in parts], [ref_ro for _, _, ref_ro, _ in parts if ref_ro is not None],
            [kl for *_, kls in parts for kl in kls])
