"""The held-out evaluation of a sampling stage during training (online RL, RFT): `rlhfkit eval`'s own sampling and
figures on the run's live models, logged under `eval/`.

`held_out_figures` samples the eval prompts with `evaluate.sample` (batch i under seed `seed + i`, the batches shared
out among processes and gathered back, so the figures are those of one process), scores the samples with the run's
`rewards.Rewards` (every reward source, their weighted total, the gold judge) and summarises them with
`evaluate.summarize` (length, EOS rate, distinct-2, ...): `rlhfkit eval` on the same weights, prompts, seed, batch size
and generation settings reports the same figures. `capability_figures` is the alignment tax of
`capability.measure_alignment_tax`.
"""

from __future__ import annotations

import torch

import math

from rlhfkit.evaluation.agent import AgentOptions
from rlhfkit.evaluation.alarms import ALIGNMENT_TAX_KEY, DISTINCT_KEY, TOP_SHARE_KEY, WORDS_KEY
from rlhfkit.evaluation.capability import measure_alignment_tax
from rlhfkit.evaluation.samples import Samples, sample, summarize
from rlhfkit.evaluation.metrics import mean_std
from rlhfkit.reward_functions import extra_columns, source_stats
from rlhfkit.types import Rollout


# The agent figures a training run logs under eval/agent/ (the shares and per-episode means; the counts stay in eval.json).
AGENT_LOGGED = ("format_accuracy", "task_completion", "calls_per_episode", "failures_per_call", "malformed_per_call",
                "timeouts_per_call", "turns_per_episode")


@torch.no_grad()
def held_out_figures(policy, reference, rewards, tokenizer, prompts: list[dict], params, batch_size: int, seed: int,
                     state=None, num_rows: int = 8, trainer_state=None, rollout=None,
                     agent: AgentOptions | None = None) -> tuple[dict[str, float], list[dict]]:
    """(figures, sample rows) of `policy` on the held-out `prompts` (tokenised prompt examples).

    Args:
        policy: the policy's module to call (in eval mode, weights whole on this process).
        reference: a model or a `models.Reference`, or None (no `eval/objective/kl`).
        rewards: the run's `rewards.Rewards`; every process scores every sample (the same forwards on each, which
            a ZeRO-3 reward model needs).
        params, batch_size, seed, state: as `evaluate.sample`.
        num_rows: samples returned for samples.jsonl (the first ones, in prompt order).
        trainer_state: what the reward functions and the gold judge get as `trainer_state` (the training's, as TRL
            passes its own state when it evaluates; None: no state).
        rollout: the run's rollout component for evaluation (`rollout.maker.FreshRollout`: the Python API's
            `Objects.rollout` honoured; with tools, the episodes `rlhfkit eval` plays).
        agent: the format rule and task judge of the agent figures (`agent.task_judge`: a reward source's name, or
            "gold"); with tools, `eval/agent/<figure>` joins the figures (`AgentFigures.as_dict`'s shares and means).

    Figures: `eval/objective/scores` (the weighted total), `eval/rewards/<source>/mean|std`, `eval/objective/gold`,
    `eval/objective/kl` (mean sequence KL to the reference, nats), `eval/response/length_avg`, `eos_rate`,
    `empty_rate`, `distinct_2`, `words_avg` and `top_share` (with 2 prompts or more), and `eval/<name>` for what the
    reward functions logged with `log_metric` (their `log_extra` columns join the sample rows).
    """
    parts, _, kls = sample(policy, reference, tokenizer, prompts, params, batch_size, seed, state, sample_reference=False,
                           rollout=rollout)
    ro = Rollout.concat(parts, tokenizer.pad_token_id)
    rows = [example for example in prompts for _ in range(params.num_samples)]  # each row's prompt example
    scored = rewards(ro, rows, trainer_state)
    gold = rewards.gold(ro, rows, trainer_state)
    logged, extras = rewards.logs.take()  # log_metric / log_extra: every process scored every sample, alike
    s = Samples.of(ro, tokenizer)  # the judges here are the run's reward sources: scored above, summarised apart
    summary = summarize(s)
    figures = {"objective/scores": float(scored.total.float().mean()), **source_stats(scored.per_source),
               "response/length_avg": summary["length"]["mean"], "response/eos_rate": summary["eos_rate"],
               "response/empty_rate": summary["empty_rate"], DISTINCT_KEY: summary["distinct_2"],
               WORDS_KEY: summary["words_avg"]}
    if summary["top_share"] is not None:
        figures[TOP_SHARE_KEY] = summary["top_share"]
    if gold is not None:
        figures["objective/gold"] = float(gold.float().mean())
    if kls:
        figures["objective/kl"] = mean_std(kls)["mean"]
    figures.update({name: sum(values) / len(values) for name, values in logged.items() if values})
    if ro.tools is not None:
        judged = {**scored.per_source, **({"gold": gold} if gold is not None else {})}
        scores = {name: [None if math.isnan(x) else x for x in v.float().tolist()] for name, v in judged.items()}
        agent_dict = (agent or AgentOptions()).figures(ro.tools, ro.completions, scores).as_dict()
        figures.update({f"agent/{k}": v for k, v in agent_dict.items() if k in AGENT_LOGGED and v is not None})
    samples = [{"prompt": s.prompts[i], "response": s.texts[i], "score": float(scored.total[i]),
                "kl": kls[i] if kls else None, **extra_columns(extras, i)} for i in range(min(num_rows, len(s.texts)))]
    return {f"eval/{k}": v for k, v in figures.items()}, samples


def capability_figures(policy, reference, examples: list[dict], pad_token_id: int, batch_size: int,
                       state=None) -> dict[str, float]:
    """The alignment tax of tokenised SFT `examples`: `eval/capability/policy_nll` and `reference_nll` (mean nats per
    response token) and their difference under the key the `alignment_tax` alarm reads (`capability/delta_nats`)."""
    tax = measure_alignment_tax(policy, reference, examples, pad_token_id, batch_size, state)
    return {"eval/capability/policy_nll": tax.policy_nll, "eval/capability/reference_nll": tax.reference_nll,
            ALIGNMENT_TAX_KEY: tax.delta}
