"""An online step's experience, made once: rollout → scores → shaped scores → KL → per-token rewards → advantages.

`make_experience` is the one place that builds an `Experience`; nothing changes it afterwards. What a step measured
about it (`rollout_stats`, `policy_stats`) is computed from it over every process's rows, as one process holding the
whole batch would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rlhfkit.advantages import AdvantageInput, compute_advantages, loss_mask, penalize_missing_eos, per_token_rewards
from rlhfkit.evaluation.alarms import diversity_figures
from rlhfkit.evaluation.metrics import pearson
from rlhfkit.ops import kl_penalty
from rlhfkit.reward_functions import source_stats, trainer_state
from rlhfkit.rewards import RunningMoments, normalize_scores
from rlhfkit.trainers.optim import Fault
from rlhfkit.types import Experience, Rollout


@dataclass(frozen=True)
class Made:
    """What `make_experience` made of a step: its experience, or the fault that skips the step (a non-finite
    rollout on some process); and its rollout statistics (over every process)."""

    experience: Experience | None
    fault: Fault | None
    stats: dict[str, float]
    kl: float | None = None  # the mean sequence KL to the reference, when π_old was known before the update


@dataclass(frozen=True)
class PolicyFigures:
    """What π_old's log-probs measure over every process's rows: the logged statistics, and the mean sequence KL to
    the reference that the adaptive KL controller follows (None without a reference)."""

    stats: dict[str, float]
    kl: float | None


def token_kl(logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor | None:
    """(B, R) k1 KL per response token to the reference; None without a reference or before π_old is known."""
    if logprobs is None or ref_logprobs is None:
        return None
    return kl_penalty(logprobs, ref_logprobs, "k1") * mask


def pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    """(b, r) -> (b, width) with zeros on the right (a trimmed micro-batch's outputs back at the rollout's width)."""
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


@torch.no_grad()
def make_experience(t, step: int) -> Made:
    """Step `step`'s experience, built once by the online trainer `t` (its models, reward, KL controller, running
    moments): 1. sample; 2. score; 3. no-grad forwards (π_old, reference, critic) without dropout; 4. shaped scores,
    per-token rewards with the KL penalty, advantages. A fault when anything it holds is not finite on any process."""
    cfg, run, mb = t.cfg, t.run, t.cfg.optim.per_device_batch_size
    prompts, examples = t.prompts_for(step)
    t0 = time.perf_counter()
    ro = t.sample(prompts.to(t.accelerator.device), step)  # 1. sample
    stats: dict[str, float] = {"time/generate_s": time.perf_counter() - t0}
    if not run.on_every_process(ro is not None):
        return Made(None, Fault.ROLLOUT, stats)
    rows = [e for e in examples for _ in range(cfg.generation.num_samples)]  # the dataset example of each row
    state = trainer_state(step, t.total_steps)
    scored = t.reward(ro, rows, state)  # 2. score, once for the whole rollout batch
    scores = scored.total  # (B,) the weighted sum over the reward sources
    stats.update(source_stats({name: run.gather(v) for name, v in scored.per_source.items()}))
    # 3. No-grad forwards without dropout, on the unwrapped modules (no DDP collectives): with unchanged weights
    # they give exactly the update forward's values.
    policy = run.unwrap(t.model)
    critic = run.unwrap(t.value) if t.value is not None else None
    for module in (policy, critic):
        if module is not None:
            module.eval()
    # Each micro-batch is cut to its own longest response, its outputs padded back to the rollout's width.
    chunks = [ro.select(slice(i, i + mb)).trimmed() for i in range(0, ro.response_ids.shape[0], mb)]
    cat = lambda f: torch.cat([pad_to(f(c), ro.response_ids.shape[1]) for c in chunks])  # noqa: E731
    if t.one_pass:
        old_logprobs = None  # the update forward's own, detached (`update` returns them)
    elif cfg.algo.old_logprob_source == "sampler":
        old_logprobs = ro.sampler_logprobs
    else:
        old_logprobs = cat(lambda c: t.response_logprobs(policy, c))
    ref_logprobs = cat(lambda c: t.ref.rollout_logprobs(policy, c, cfg.generation.temperature)) if t.ref is not None else None
    values = cat(lambda c: t.values_of(critic, c)) if critic is not None else None
    finite = run.on_every_process(all(torch.isfinite(x).all() for x in (scores, old_logprobs, ref_logprobs) if x is not None))
    exp = shape_and_estimate(t, ro, scores, old_logprobs, ref_logprobs, values, finite)
    stats.update(rollout_stats(t, exp, rows, state))
    logged, t.sample_extras = t.reward.logs.take()  # log_metric / log_extra: the step's metrics, samples' columns
    stats.update(logged_means(run, logged))
    figures = policy_stats(run, exp, t.kl_ctl.value, gap=cfg.algo.old_logprob_source != "sampler") \
        if old_logprobs is not None else PolicyFigures({}, None)
    stats.update(figures.stats)
    if not run.on_every_process(finite and bool(torch.isfinite(exp.advantages).all())):
        return Made(None, Fault.ROLLOUT, stats)
    return Made(exp, None, stats, figures.kl)


def logged_means(run, values: dict[str, list[float]]) -> dict[str, float]:
    """name -> the mean of every process's values under it (a name some process lacks counts none there), as TRL
    averages what reward functions log with `log_metric`. Collective: every process calls it."""
    names = sorted(values)
    if run.world > 1:
        from accelerate.utils import gather_object

        names = sorted(set(gather_object(names)))
    if not names:
        return {}
    sums = torch.tensor([[sum(values.get(n, [])), len(values.get(n, []))] for n in names], dtype=torch.float64)
    sums = run.sum_over_processes(sums.to(run.accelerator.device)).cpu()
    return {n: float(total / count) for n, (total, count) in zip(names, sums.tolist()) if count}


def shape_and_estimate(t, ro: Rollout, scores, old_logprobs, ref_logprobs, values, finite: bool) -> Experience:
    """4. The EOS penalty, normalisation and clipping of the scores, the KL once per token, the per-token rewards and
    the advantages — statistics over the global batch, as one process would compute them."""
    cfg, algo, run = t.cfg, t.algo, t.run
    mask = ro.response_mask.float()
    shaped = penalize_missing_eos(scores, ro.has_eos, cfg.reward.missing_eos_penalty)
    # The running moments see only finite batches: one NaN must not poison every later step.
    shaped = normalize_scores(shaped, cfg.reward.normalize, t.moments if finite else RunningMoments(), cfg.reward.clip,
                              population=run.gather(shaped) if cfg.reward.normalize != "none" else None)
    kl = token_kl(old_logprobs, ref_logprobs, mask)  # (B, R) or None
    rewards = per_token_rewards(shaped, kl if kl is not None else torch.zeros_like(mask), mask,
                                t.kl_ctl.value if algo.kl_in_reward else 0.0)
    whiten = cfg.algo.whiten_advantages if cfg.algo.whiten_advantages is not None else algo.whiten_by_default
    # Advantages see every response (`mask`): a sample excluded from the loss still counts in its group's baseline.
    advantages, returns = compute_advantages(algo.advantage, AdvantageInput(
        rewards=rewards, scores=shaped, response_mask=mask, values=values, group_ids=ro.group_ids,
        gamma=cfg.algo.gamma, lam=cfg.algo.lam, whiten=whiten,
        all_reduce=(lambda x: run.accelerator.reduce(x, "sum")) if run.world > 1 else None))
    return Experience(
        rollout=ro, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, values=values, scores=scores,
        shaped_scores=shaped, kl=kl.sum(1) if kl is not None else None, advantages=advantages, returns=returns,
        loss_mask=loss_mask(mask, ro.has_eos, shaped, ro.group_ids, mask_truncated=cfg.algo.mask_truncated,
                            drop_zero_variance_groups=cfg.algo.dynamic_filtering))


def rollout_stats(t, exp: Experience, rows: list[dict], state=None) -> dict[str, float]:
    """What the rollout measured, over every process's rows (README: the online metric table); `state`: the
    `trainer_state` the gold judge gets."""
    from accelerate.utils import gather_object

    run, ro, mask = t.run, exp.rollout, exp.rollout.response_mask.float()
    per_row = {"scores": exp.scores, "length": mask.sum(1), "eos": ro.has_eos.float()}  # (B,) each
    gold = t.reward.gold(ro, rows, state)
    if gold is not None:
        per_row["gold"] = gold.to(mask.device)
    g = {k: run.gather(v.float()) for k, v in per_row.items()}  # (world·B,) each
    texts = t.tokenizer.batch_decode(ro.response_ids, skip_special_tokens=True)
    groups = (ro.group_ids + t.accelerator.process_index * t.cfg.algo.rollout_batch_size).tolist()
    if run.world > 1:
        texts, groups = gather_object(texts), gather_object(groups)
    stats = {
        "objective/scores": g["scores"].mean(),
        "response/length_avg": g["length"].mean(), "response/eos_rate": g["eos"].mean(),
        # Evidence for the reward-hacking alarms (rlhfkit.evaluation.alarms).
        "response/empty_rate": ((g["length"] - g["eos"]) <= 0).float().mean(),
        "response/score_length_corr": pearson(g["scores"].tolist(), g["length"].tolist()),
        **diversity_figures(texts, groups),  # distinct-2, words per response, top share
    }
    if "gold" in g:
        stats["objective/gold"] = g["gold"].mean()
    return {k: float(v) for k, v in stats.items()}


def policy_stats(run, exp: Experience, kl_coef: float, gap: bool = True, old_logprobs: torch.Tensor | None = None,
                 kl: torch.Tensor | None = None) -> PolicyFigures:
    """What π_old's log-probs (the experience's, or `old_logprobs` with their sequence `kl` when the update measured
    them) tell, over every process's rows: entropy, sampler gap (unless π_old is the sampler's own: the update
    measures it then), and — where there is a reference — the KL, β and the KL-regularised reward."""
    ro, mask = exp.rollout, exp.rollout.response_mask.float()
    old = old_logprobs if old_logprobs is not None else exp.old_logprobs
    kl = kl if kl is not None else exp.kl
    per_row = {"entropy": (-old * mask).sum(1), "length": mask.sum(1),
               "gap": ((ro.sampler_logprobs - old).abs() * mask).sum(1), "shaped": exp.shaped_scores}
    if kl is not None:
        per_row["kl"] = kl
    g = {k: run.gather(v.float()) for k, v in per_row.items()}  # (world·B,) each
    stats = {"objective/entropy": g["entropy"].mean()}
    if gap:
        stats["policy/sampler_logprob_gap"] = g["gap"].sum() / g["length"].sum().clamp(min=1)
    if "kl" in g:
        stats.update({"objective/kl": g["kl"].mean(), "objective/kl_coef": kl_coef,
                      "objective/rlhf_reward": (g["shaped"] - kl_coef * g["kl"]).mean()})
    stats = {k: float(v) for k, v in stats.items()}
    return PolicyFigures(stats, stats.get("objective/kl"))
