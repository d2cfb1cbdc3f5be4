"""Online RL: one loop for PPO, RLOO, GRPO (Dr.GRPO, DAPO) and REINFORCE++.

Each step reads like the algorithm box of a paper:
  1. sample k responses per prompt (`generation.generate`);
  2. score them once per rollout batch (reward model(s) or a Python function), penalise a missing EOS, normalise
     and clip;
  3. old / reference log-probs and critic values in no-grad forwards without dropout (fp32 log-probs);
  4. per-token rewards with the KL penalty, then advantages from the algorithm's estimator;
  5. `ppo_epochs` passes of minibatch updates of `losses.policy.policy_objective` (+ value loss), stopping early
     when approx-KL passes `algo.target_kl`; a non-finite loss or gradient skips the step;
  6. update the KL controller, log, checkpoint.
What differs between methods is data in `rlhfkit.algorithms.Algorithm`; this file never branches on a name.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time

import torch

from rlhfkit.advantages import AdvantageInput, compute_advantages, loss_mask, penalize_missing_eos, per_token_rewards
from rlhfkit.algorithms import get_algorithm
from rlhfkit.config import OnlineConfig
from rlhfkit.data import build_datasets, collate_prompts
from rlhfkit.errors import UserError
from rlhfkit.evaluation.alarms import check_alarms, diversity_figures
from rlhfkit.evaluation.metrics import pearson
from rlhfkit.generation import generate
from rlhfkit.io import read_jsonl_rows
from rlhfkit.kl import AdaptiveKLController, FixedKLController
from rlhfkit.losses.aggregate import aggregate
from rlhfkit.losses.policy import policy_objective, value_loss
from rlhfkit.models import (
    PolicyAndCritic, Reference, SharedBaseCritic, disable_dropout, load_causal_lm, load_reward_model, rollout_logprobs,
    save_model,
)
from rlhfkit.ops import kl_penalty, masked_mean
from rlhfkit.reward_functions import source_stats, trainer_state
from rlhfkit.rewards import Rewards, RunningMoments, normalize_scores, token_scores
from rlhfkit.sharding import clip_grad_norm, gathered_weights, loaded_weights
from rlhfkit.trainers.base import (
    Trainer, build_optimizer, build_scheduler, last_checkpoint_note, load_model_weights,
)
from rlhfkit.types import Experience, Rollout

logger = logging.getLogger("rlhfkit")
TABLE = [("Step", "step"), ("Reward", "objective/scores"), ("KL", "objective/kl"), ("ClipFrac", "policy/clipfrac_avg"),
         ("ValueLoss", "loss/value_avg"), ("PolicyLoss", "loss/policy_avg"), ("LR", "lr")]


class OnlineTrainer(Trainer):
    kind = "prompt"
    cfg: OnlineConfig

    # 0. Models, data, reward: the hooks of the trainer skeleton (trainers.base.Trainer.setup) -----------------
    def load_data(self) -> None:
        self.train_set, _ = build_datasets("prompt", self.cfg.data, self.tokenizer, self.cfg.seed)

    def build(self) -> None:
        cfg, a, acc = self.cfg, self.cfg.algo, self.accelerator
        self.algo = get_algorithm(a.algorithm)
        policy = load_causal_lm(cfg.model, self.tokenizer)
        # With LoRA the reference is the base with adapters disabled: one copy of the weights, not two.
        self.ref = Reference(cfg.model, None, policy, self.tokenizer, acc.device) if self.algo.needs_reference else None
        self.reward = Rewards(cfg.reward, self.tokenizer, acc.device, batch_size=cfg.optim.per_device_batch_size,
                              policy_name=cfg.model.name_or_path)
        value = self.load_critic(policy) if self.algo.needs_value else None
        if a.disable_dropout:
            for module in (policy, value):
                if module is not None:
                    disable_dropout(module)
        self.steps_per_epoch = max(1, math.ceil(len(self.train_set) / (a.rollout_batch_size * self.world)))
        self.total_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_epochs * self.steps_per_epoch)
        optimizer = build_optimizer(torch.nn.ModuleList([m for m in (policy, value) if m is not None]), cfg)
        self.scheduler = build_scheduler(optimizer, cfg, self.total_steps * a.ppo_epochs * a.num_minibatches)
        if isinstance(value, SharedBaseCritic) and acc.distributed_type == "DEEPSPEED":
            raise UserError("model.lora.enabled: PPO's LoRA critic (a second adapter on the policy's base) is "
                            "backpropagated on its own, which DeepSpeed's gradient hooks do not take; under DeepSpeed "
                            "give the critic its own model (algo.value_model) or run without DeepSpeed")
        if value is not None and acc.distributed_type == "FSDP":
            if isinstance(value, SharedBaseCritic):
                raise UserError("model.lora.enabled: PPO's LoRA critic (a second adapter on the policy's base) runs the "
                                "policy's layers outside the policy's own forward, which FSDP does not gather; under FSDP "
                                "give the critic its own model (algo.value_model)")
            if getattr(acc.state.fsdp_plugin, "fsdp_version", 1) == 2:
                raise UserError("PPO under FSDP2: accelerate prepares one model under FSDP2 and PPO trains two (policy "
                                "and critic); launch with configs/accelerate/fsdp.yaml (FSDP1) or without FSDP")
        if value is not None and acc.distributed_type == "DEEPSPEED":
            # DeepSpeed takes one model per Accelerator: policy and critic are prepared as one module, then each is
            # called through its own forward (ZeRO-3's hooks sit on every submodule; the engine steps at backward).
            engine, self.optimizer = acc.prepare(PolicyAndCritic(policy, value), optimizer)
            self.model, self.value = engine.module.policy, engine.module.critic
        elif value is not None:
            self.model, self.value, self.optimizer = acc.prepare(policy, value, optimizer)
        else:
            (self.model, self.optimizer), self.value = acc.prepare(policy, optimizer), None
        k = cfg.kl
        self.kl_ctl = AdaptiveKLController(k.coef, k.target, k.horizon) if k.controller == "adaptive" else FixedKLController(k.coef)
        self.moments = RunningMoments()

    def load_critic(self, policy):
        """PPO's value model: with LoRA (and no algo.value_model) a second adapter on the policy's own base;
        otherwise a sequence-classification model from algo.value_model, the first reward model, or the policy."""
        cfg, a = self.cfg, self.cfg.algo
        if cfg.model.lora.enabled and not a.value_model:
            return SharedBaseCritic(policy, cfg.model)  # one base for policy, reference and critic
        init = a.value_model or (cfg.reward.model[0] if cfg.reward.model else cfg.model.name_or_path)
        return load_reward_model(dataclasses.replace(cfg.model, name_or_path=init, gguf_file=None), self.tokenizer,
                                 allow_new_head=not a.value_model or a.allow_new_value_head, key="algo.value_model",
                                 hint="set algo.allow_new_value_head=true to start the critic's value head at random")

    def trained_models(self) -> list:
        """The policy, and a critic that is a model of its own (a shared-base critic's adapter is in the policy)."""
        return [self.model] + ([self.value] if self.value is not None and not self.shared_critic() else [])

    def save_models(self, directory: str, models: list) -> None:
        super().save_models(directory, models)
        value_dir = os.path.join(os.path.dirname(directory), "value_model")
        if self.shared_critic():
            self.unwrap(self.value).save(value_dir)
        elif self.value is not None:
            save_model(models[1], self.tokenizer, value_dir, merge_lora=False)

    def load_models(self, checkpoint: str) -> None:
        super().load_models(checkpoint)
        value_dir = os.path.join(checkpoint, "value_model")
        if self.shared_critic():
            self.unwrap(self.value).load(value_dir)
        elif self.value is not None:
            loaded_weights(self.accelerator, self.value, lambda m: load_model_weights(m, value_dir), self.unwrap(self.value))

    def extra_state(self) -> dict:
        return {"kl_controller": json.dumps(self.kl_ctl.state_dict()), "reward_moments": json.dumps(self.moments.state_dict())}

    def load_extra_state(self, state: dict) -> None:
        self.kl_ctl.load_state_dict(json.loads(state["kl_controller"]))
        self.moments.load_state_dict(json.loads(state["reward_moments"]))

    # 1. Sample -------------------------------------------------------------------------------------------------
    def prompts_for(self, step: int):
        """This process's prompts for `step`: (PromptBatch, their dataset examples); see `Trainer.step_indices`."""
        order = torch.tensor(self.step_indices(step, len(self.train_set), self.cfg.algo.rollout_batch_size * self.world))
        examples = [self.train_set[i] for i in order.view(self.world, -1)[self.accelerator.process_index].tolist()]
        return collate_prompts(examples, self.tokenizer.pad_token_id), examples

    def sample(self, prompts) -> Rollout | None:
        """`generation.generate` from the policy; None when the policy's probabilities are not finite (weights
        that blew up): the step is then a bad step, not a crash."""
        tok = self.tokenizer
        try:
            with gathered_weights(self.accelerator, self.model, self.unwrap(self.model)) as policy:  # FSDP / ZeRO-3: gathered once
                return generate(policy, prompts, self.cfg.generation, tok.eos_token_id, tok.pad_token_id)
        except RuntimeError as exc:
            if "inf" in str(exc) and "nan" in str(exc):  # torch.multinomial: "probability tensor contains either inf, nan or element < 0"
                return None
            raise

    # 2-4. Score, no-grad forwards, advantages -----------------------------------------------------------------
    def response_logprobs(self, model, ro: Rollout, with_entropy: bool = False):
        """(B, R) fp32 log-probs of the response tokens (temperature as when sampling); with `with_entropy` also the
        (B, R) entropies of the distributions they were drawn from."""
        return rollout_logprobs(model, ro, self.cfg.generation.temperature, with_entropy)

    def values_of(self, critic, ro: Rollout):
        """(B, R) values V(s_t) of the state before each response token, from `critic` (the prepared critic for the
        update, its unwrapped module for no-grad forwards)."""
        if isinstance(self.unwrap(critic), SharedBaseCritic):
            v = critic(ro.input_ids, ro.attention_mask)  # (B, T)
        else:
            v = token_scores(critic, ro.input_ids, ro.attention_mask)  # (B, T)
        return v[:, ro.prompt_ids.shape[1] - 1 : -1] * ro.response_mask

    def reference_logprobs(self, ro: Rollout):
        return self.ref.rollout_logprobs(self.unwrap(self.model), ro, self.cfg.generation.temperature)

    @torch.no_grad()
    def make_experience(self, step: int) -> tuple[Experience | None, dict[str, float]]:
        """Step `step`'s experience and its rollout statistics (over every process); None for the experience when
        anything it holds is not finite on any process (the step is then skipped everywhere, and counted)."""
        cfg, acc, mb = self.cfg, self.accelerator, self.cfg.optim.per_device_batch_size
        prompts, examples = self.prompts_for(step)
        t0 = time.perf_counter()
        ro = self.sample(prompts.to(acc.device))  # 1. sample
        stats: dict[str, float] = {"time/generate_s": time.perf_counter() - t0}
        if not self.on_every_process(ro is not None):
            return None, stats
        rows = [e for e in examples for _ in range(cfg.generation.num_samples)]  # the dataset example of each row
        scored = self.reward(ro, rows, trainer_state(step, self.total_steps))  # 2. score, once for the whole rollout batch
        scores = scored.total  # (B,) the weighted sum over the reward sources
        stats.update(source_stats({name: self.gather(v) for name, v in scored.per_source.items()}))
        # 3. No-grad forwards without dropout, on the unwrapped modules (no DDP collectives): with unchanged weights
        # they give exactly the update forward's values.
        policy = self.unwrap(self.model)
        critic = self.unwrap(self.value) if self.value is not None else None
        for module in (policy, critic):
            if module is not None:
                module.eval()
        # Each micro-batch is cut to its own longest response, its outputs padded back to the rollout's width.
        chunks = [ro.select(slice(i, i + mb)).trimmed() for i in range(0, ro.response_ids.shape[0], mb)]
        width = ro.response_ids.shape[1]
        cat = lambda f: torch.cat([_pad_to(f(c), width) for c in chunks])  # noqa: E731
        if self.one_pass():
            old_logprobs = None  # the update forward's own, filled in by `update`
        elif cfg.algo.old_logprobs == "sampler":
            old_logprobs = ro.sampler_logprobs
        else:
            old_logprobs = cat(lambda c: self.response_logprobs(policy, c))
        ref_logprobs = cat(self.reference_logprobs) if self.algo.needs_reference else None
        values = cat(lambda c: self.values_of(critic, c)) if critic is not None else None
        finite = self.on_every_process(all(torch.isfinite(t).all() for t in (scores, old_logprobs, ref_logprobs) if t is not None))
        # 4. Shaped scores, per-token rewards, advantages — statistics over the global batch, as one process would.
        mask = ro.response_mask.float()
        shaped = penalize_missing_eos(scores, ro.has_eos, cfg.reward.missing_eos_penalty)
        # The running moments see only finite batches: one NaN must not poison every later step.
        shaped = normalize_scores(shaped, cfg.reward.normalize, self.moments if finite else RunningMoments(), cfg.reward.clip,
                                  population=self.gather(shaped) if cfg.reward.normalize != "none" else None)
        kl_coef = self.kl_ctl.value
        kl = sequence_kl(old_logprobs, ref_logprobs, mask)  # (B,) or None
        rewards = per_token_rewards(shaped, _token_kl(old_logprobs, ref_logprobs, mask), mask,
                                    kl_coef if self.algo.kl_in_reward else 0.0)
        whiten = cfg.algo.whiten_advantages if cfg.algo.whiten_advantages is not None else self.algo.whiten_by_default
        # Advantages see every response (`mask`): a sample excluded from the loss still counts in its group's baseline.
        advantages, returns = compute_advantages(self.algo.advantage, AdvantageInput(
            rewards=rewards, scores=shaped, response_mask=mask, values=values, group_ids=ro.group_ids,
            gamma=cfg.algo.gamma, lam=cfg.algo.lam, whiten=whiten,
            all_reduce=(lambda t: acc.reduce(t, "sum")) if self.world > 1 else None))
        exp = Experience(
            rollout=ro, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, values=values, scores=scores,
            shaped_scores=shaped, kl=kl, advantages=advantages, returns=returns,
            loss_mask=loss_mask(mask, ro.has_eos, shaped, ro.group_ids, mask_truncated=cfg.algo.mask_truncated,
                                drop_zero_variance_groups=cfg.algo.dynamic_filtering))
        stats.update(self.rollout_stats(exp, rows))
        if old_logprobs is not None:
            stats.update(self.policy_stats(exp, kl_coef, gap=cfg.algo.old_logprobs == "recompute"))
        finite = self.on_every_process(finite and bool(torch.isfinite(advantages).all()))
        return (exp if finite else None), stats

    def one_pass(self) -> bool:
        """One pass over the experience (ppo_epochs × num_minibatches = 1) and no KL in the reward: π_old is then the
        update forward's own log-probs, detached (the ratio is 1 by definition), so the separate no-grad forward is
        skipped, as TRL's GRPO does; `update` fills `old_logprobs` in for the statistics."""
        a = self.cfg.algo
        return a.ppo_epochs * a.num_minibatches == 1 and not self.algo.kl_in_reward

    def on_every_process(self, flag: bool) -> bool:
        """Whether `flag` holds on every process: every decision that changes control flow is taken on it, so the
        processes never fall out of step (one all-reduce)."""
        if self.world == 1:
            return bool(flag)
        return self.accelerator.reduce(torch.tensor(float(not flag), device=self.accelerator.device), "sum").item() == 0

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(world·B, ...) the rows of every process, in process order (B is the same on every process)."""
        return self.accelerator.gather(x) if self.world > 1 else x

    def rollout_stats(self, exp: Experience, rows: list[dict]) -> dict[str, float]:
        """What the rollout measured, over every process's rows (README: the online metric table)."""
        from accelerate.utils import gather_object

        ro, mask = exp.rollout, exp.rollout.response_mask.float()
        per_row = {"scores": exp.scores, "length": mask.sum(1), "eos": ro.has_eos.float()}  # (B,) each
        gold = self.reward.gold(ro, rows)
        if gold is not None:
            per_row["gold"] = gold.to(mask.device)
        g = {k: self.gather(v.float()) for k, v in per_row.items()}  # (world·B,) each
        texts = self.tokenizer.batch_decode(ro.response_ids, skip_special_tokens=True)
        groups = (ro.group_ids + self.accelerator.process_index * self.cfg.algo.rollout_batch_size).tolist()
        if self.world > 1:
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

    def policy_stats(self, exp: Experience, kl_coef: float, gap: bool = True) -> dict[str, float]:
        """What π_old's log-probs measure, over every process's rows: entropy, sampler gap (unless π_old is the
        sampler's own: `update` measures it then), and — where there is a reference — the KL, β and the
        KL-regularised reward."""
        ro, mask = exp.rollout, exp.rollout.response_mask.float()
        per_row = {"entropy": (-exp.old_logprobs * mask).sum(1), "length": mask.sum(1),
                   "gap": ((ro.sampler_logprobs - exp.old_logprobs).abs() * mask).sum(1), "shaped": exp.shaped_scores}
        if exp.kl is not None:
            per_row["kl"] = exp.kl
        g = {k: self.gather(v.float()) for k, v in per_row.items()}  # (world·B,) each
        stats = {"objective/entropy": g["entropy"].mean()}
        if gap:
            stats["policy/sampler_logprob_gap"] = g["gap"].sum() / g["length"].sum().clamp(min=1)
        if "kl" in g:
            stats.update({"objective/kl": g["kl"].mean(), "objective/kl_coef": kl_coef,
                          "objective/rlhf_reward": (g["shaped"] - kl_coef * g["kl"]).mean()})
        return {k: float(v) for k, v in stats.items()}

    # 5. Updates -----------------------------------------------------------------------------------------------
    def update(self, exp: Experience) -> dict[str, float]:
        """`algo.ppo_epochs` passes of `algo.num_minibatches` optimizer steps over the experience. Returns the
        loss-mask-weighted means of the losses' metrics over every process, or a `faults/...` entry when a loss or
        the gradient is not finite on any process (that step and the remaining ones are skipped everywhere).
        Early stopping on `algo.target_kl` reads the approx-KL of the whole minibatch, all processes."""
        cfg, a, acc = self.cfg, self.cfg.algo, self.accelerator
        n = exp.loss_mask.shape[0]
        mb_size, micro = n // a.num_minibatches, cfg.optim.per_device_batch_size
        agg = a.loss_agg or self.algo.default_loss_agg
        sums: dict[str, float] = {}
        early_stopped = 0.0
        norms: list[float] = []  # each optimizer step's gradient norm, before clipping
        for module in (self.model, self.value):
            if module is not None:
                module.train()
        one_pass = exp.old_logprobs is None  # π_old = this pass's own log-probs, kept for the statistics
        kept = torch.zeros_like(exp.loss_mask) if one_pass else None
        # π_old from the sampler: its gap to the training forward, read where the weights are still the sampler's
        # (the first minibatch of the first epoch).
        measure_gap = not one_pass and a.old_logprobs == "sampler"
        for _epoch in range(a.ppo_epochs):
            perm = torch.randperm(n, device=exp.loss_mask.device)
            for m in range(a.num_minibatches):
                idx = perm[m * mb_size : (m + 1) * mb_size]
                mask = exp.loss_mask[idx]
                counts = acc.reduce(torch.stack([mask.sum(), torch.tensor(float(len(idx)), device=mask.device)]), "sum")
                num_tokens, num_seqs = (counts / self.world).clamp(min=1).tolist()  # DDP averages: per-process share
                # (non-finite losses, approx-KL · tokens, tokens) of this minibatch on this process
                control = torch.zeros(3, device=mask.device)
                for i in range(0, len(idx), micro):
                    rows = idx[i : i + micro]
                    batch = exp.select(rows).trimmed()  # at its own longest response
                    parts = {}
                    losses = [lambda: self.policy_loss(batch, agg, num_tokens, num_seqs)]
                    if self.value is not None:
                        losses.append(lambda: self.critic_loss(batch, num_tokens))
                    # A shared-base critic's loss is backpropagated on its own: gradient checkpointing recomputes
                    # each forward under the adapter active at backward time. Otherwise one backward of the sum.
                    groups = [[t] for t in losses] if self.shared_critic() else [losses]
                    for g, group in enumerate(groups):
                        loss = 0.0
                        for term in group:
                            term_loss, term_parts = term()
                            loss = loss + term_loss
                            parts.update(term_parts)
                        # Backward even when the loss is not finite: every process runs the same collectives, and
                        # the decision below is taken on all of them together.
                        control[0] += float(not torch.isfinite(loss))
                        self.backward(loss, last=i + micro >= len(idx) and g == len(groups) - 1)
                    logprobs = parts.pop("_logprobs")  # (b, r) this forward's, detached
                    if one_pass:
                        kept[rows] = _pad_to(logprobs, kept.shape[1])
                    if measure_gap:
                        on = batch.rollout.response_mask.float() * (_epoch == 0 and m == 0)
                        sums["_gap"] = sums.get("_gap", 0.0) + float(((logprobs - batch.old_logprobs).abs() * on).sum())
                        sums["_gap_n"] = sums.get("_gap_n", 0.0) + float(on.sum())
                    w = float(batch.loss_mask.sum())
                    for k, v in parts.items():
                        sums[k] = sums.get(k, 0.0) + float(v) * w
                    sums["_w"] = sums.get("_w", 0.0) + w
                    control[1:] += torch.tensor([float(parts["policy/approxkl_avg"]) * w, w], device=control.device)
                max_norm = cfg.optim.max_grad_norm
                norm = clip_grad_norm(acc, [self.model, self.value], max_norm if max_norm is not None else math.inf)
                bad_norm = norm is not None and acc.scaler is None and not math.isfinite(float(norm))
                if norm is not None:
                    norms.append(float(norm))  # global already: the same on every process
                control = acc.reduce(control, "sum") if self.world > 1 else control
                if control[0] > 0 or bad_norm:
                    self.optimizer.zero_grad(set_to_none=True)
                    return {"faults/nonfinite_loss" if control[0] > 0 else "faults/nonfinite_gradient": 1.0}
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                if a.target_kl is not None and control[1] / control[2].clamp(min=1.0) > a.target_kl:
                    early_stopped = 1.0
                    break
            if early_stopped:
                break
        keys = sorted(sums)  # the same keys on every process
        totals = torch.tensor([sums[k] for k in keys], device=exp.loss_mask.device)
        totals = (acc.reduce(totals, "sum") if self.world > 1 else totals).tolist()
        out = dict(zip(keys, totals))
        w = max(out.pop("_w", 0.0), 1.0)
        gap = {"policy/sampler_logprob_gap": out.pop("_gap") / max(out.pop("_gap_n"), 1.0)} if measure_gap else {}
        if one_pass:
            exp.old_logprobs = kept
            exp.kl = sequence_kl(kept, exp.ref_logprobs, exp.rollout.response_mask.float())
        grad_norm = {"grad_norm": sum(norms) / len(norms)} if norms else {}  # the mean over the step's updates
        return {**{k: v / w for k, v in out.items()}, **gap, **grad_norm, "policy/early_stopped": early_stopped}

    def shared_critic(self) -> bool:
        """Whether the critic is a second adapter on the policy's base (`SharedBaseCritic`)."""
        return self.value is not None and isinstance(self.unwrap(self.value), SharedBaseCritic)

    def policy_loss(self, batch: Experience, agg: str, num_tokens: float, num_seqs: float):
        """Policy loss of a micro-batch, normalised by its minibatch's global counts (see losses.aggregate);
        Dr. GRPO's constant is `generation.max_new_tokens`, whatever width this rollout was padded to."""
        a, mask = self.cfg.algo, batch.loss_mask
        if a.entropy_coef:
            logprobs, entropy = self.response_logprobs(self.model, batch.rollout, with_entropy=True)
        else:
            logprobs, entropy = self.response_logprobs(self.model, batch.rollout), None
        old = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
        per_token, m = policy_objective(
            logprobs, old, batch.advantages, clip_eps=a.clip_eps, clip_eps_high=a.clip_eps_high,
            dual_clip=a.dual_clip, ref_logprobs=batch.ref_logprobs if self.algo.kl_in_loss else None,
            kl_coef=self.kl_ctl.value, entropy=entropy, entropy_coef=a.entropy_coef)
        loss = aggregate(per_token, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs,
                         max_len=self.cfg.generation.max_new_tokens)
        metrics = {"loss/policy_avg": masked_mean(m["surrogate"], mask), "policy/approxkl_avg": masked_mean(m["approxkl"], mask),
                   "policy/clipfrac_avg": masked_mean(m["clipfrac"], mask), "val/ratio": masked_mean(m["ratio"], mask)}
        if entropy is not None:
            metrics["policy/entropy_avg"] = masked_mean(entropy.detach(), mask)
        metrics["_logprobs"] = logprobs.detach()  # π_old of a one-pass update; the sampler gap's other side
        return loss, metrics

    def critic_loss(self, batch: Experience, num_tokens: float):
        """Clipped value loss of a micro-batch (token mean over the minibatch's global token count), times vf_coef."""
        a, mask = self.cfg.algo, batch.loss_mask
        vl, vm = value_loss(self.values_of(self.value, batch.rollout), batch.values, batch.returns, clip_range_value=a.clip_range_value)
        loss = a.vf_coef * aggregate(vl, mask, "token-mean", num_tokens=num_tokens)
        return loss, {"loss/value_avg": masked_mean(vl.detach(), mask), "val/clipfrac_avg": masked_mean(vm["clipfrac"], mask)}

    @torch.no_grad()
    def policy_is_finite(self, exp: Experience) -> bool:
        """Whether the policy, as updated, still gives finite log-probs on a micro-batch of this step's rollout (one
        no-grad forward, before a checkpoint: weights that blew up can be finite while every output is inf/NaN)."""
        policy = self.unwrap(self.model)
        policy.eval()
        rollout = exp.rollout.select(slice(0, self.cfg.optim.per_device_batch_size))
        return self.on_every_process(bool(torch.isfinite(self.response_logprobs(policy, rollout)).all()))

    # 6. The loop ----------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Each step: sample → score → advantages → K epochs of updates → β, log, checkpoint."""
        self.setup()
        bar = self.progress_bar()
        self.history = self.logged_rows()  # the run's rows so far, for the reward-hacking alarms
        self.raised: set[str] = set()
        for step in range(self.start_step, self.total_steps):
            lr, t0 = self.scheduler.get_last_lr()[0], time.perf_counter()
            exp, stats = self.make_experience(step)  # 1-4. sample, score, no-grad forwards, advantages
            t1 = time.perf_counter()
            kl_coef = self.kl_ctl.value
            one_pass = exp is not None and exp.old_logprobs is None
            out = self.update(exp) if exp is not None else {"faults/nonfinite_rollout": 1.0}  # 5. updates
            bad = self.count_bad_step(step + 1, out)
            if one_pass and not bad:  # π_old came from the update's forward
                stats.update(self.policy_stats(exp, kl_coef))
            if not bad and exp.kl is not None:  # 6. β follows the KL measured over every process (adaptive controller)
                self.kl_ctl.update(stats["objective/kl"], exp.kl.numel() * self.world)
            stats.update(out, lr=lr, episodes=(step + 1) * self.cfg.algo.rollout_batch_size * self.cfg.generation.num_samples
                         * self.world, **{"faults/skipped_total": self.bad_steps, "time/rollout_s": t1 - t0,
                                          "time/update_s": time.perf_counter() - t1})
            self.end_step(step + 1, exp, stats, bad, bar)  # 7. log, alarms, samples, checkpoint
        bar.close()
        self.finish()
        return self.last

    def logged_rows(self) -> list[dict]:
        """The rows a resumed run logged before its checkpoint (null = NaN), so the alarms see the whole run."""
        path = os.path.join(self.cfg.output_dir, "metrics.jsonl")
        if not (self.resume_from and os.path.isfile(path)):
            return []
        return [{k: math.nan if v is None else v for k, v in row.items()} for row in read_jsonl_rows(path)]

    def progress_bar(self):
        from tqdm.auto import tqdm

        return tqdm(total=self.total_steps, initial=self.start_step, desc=self.cfg.algo.algorithm, dynamic_ncols=True,
                    disable=not (self.cfg.logging.progress_bar and self.accelerator.is_main_process))

    def count_bad_step(self, done: int, out: dict) -> bool:
        """Whether step `done` was skipped (`out` holds a faults/ entry); `max_bad_steps` of them stop the run."""
        fault = next((k for k in out if k.startswith("faults/")), None)
        if fault is None:
            return False
        cfg = self.cfg
        self.bad_steps += 1
        logger.warning("step %d: non-finite %s; update skipped (%d/%d)", done, fault.partition("nonfinite_")[2],
                       self.bad_steps, cfg.max_bad_steps)
        if self.bad_steps >= cfg.max_bad_steps:
            raise UserError(f"stopping at step {done}: {self.bad_steps} updates skipped for non-finite rewards, "
                            f"log-probs or loss (max_bad_steps={cfg.max_bad_steps}); {last_checkpoint_note(cfg.output_dir)}")
        return True

    def end_step(self, done: int, exp: Experience | None, stats: dict[str, float], bad: bool, bar) -> None:
        cfg, a, acc = self.cfg, self.cfg.algo, self.accelerator
        self.last = stats
        bar.update(1)
        bar.set_postfix({k: f"{stats[key]:.3g}" for k, key in (("reward", "objective/scores"), ("kl", "objective/kl")) if key in stats})
        if done % cfg.logging.logging_steps == 0 or done == self.total_steps:
            self.metrics.log(done, stats)
        self.history.append({"step": done, **stats})
        if acc.is_main_process and (done % a.table_steps == 0 or done == self.total_steps):
            bar.write(self.table_row(done, stats, header=done <= a.table_steps or done == self.start_step + 1))
            for alarm in check_alarms(self.history):
                if alarm.name not in self.raised:
                    self.raised.add(alarm.name)
                    logger.warning("alarm %s at step %d: %s", alarm.name, done, alarm.message)
        if exp is not None and acc.is_main_process and (done % a.sample_log_steps == 0 or done == 1 or done == self.total_steps):
            self.log_samples(done, exp)
        if cfg.logging.save_steps and done % cfg.logging.save_steps == 0 and done < self.total_steps:
            if bad:  # the weights may be what made this step bad: keep the last good checkpoint as the newest
                logger.warning("step %d: no checkpoint after a skipped step", done)
            elif not self.policy_is_finite(exp):
                logger.warning("step %d: no checkpoint: the updated policy's log-probs are not finite", done)
            else:
                self.checkpoint(done)

    def table_row(self, step: int, m: dict, header: bool) -> str:
        """One row of the console table (critic-free methods show "-" for the value loss)."""
        cells = [f"{step:>6d}"] + [f"{m[key]:>10.4g}" if key in m else f"{'-':>10}" for _, key in TABLE[1:]]
        head = " | ".join([f"{TABLE[0][0]:>6}"] + [f"{name:>10}" for name, _ in TABLE[1:]])
        return f"{head}\n{' | '.join(cells)}" if header else " | ".join(cells)

    def log_samples(self, step: int, exp: Experience, n: int = 4) -> None:
        ro, tok = exp.rollout, self.tokenizer
        with open(os.path.join(self.cfg.output_dir, "samples.jsonl"), "a", encoding="utf-8") as f:
            for i in range(min(n, ro.response_ids.shape[0])):
                f.write(json.dumps({
                    "step": step, "prompt": tok.decode(ro.prompt_ids[i][ro.prompt_mask[i].bool()], skip_special_tokens=True),
                    "response": tok.decode(ro.response_ids[i][ro.response_mask[i].bool()], skip_special_tokens=True),
                    "score": float(exp.scores[i]), "kl": float(exp.kl[i]) if exp.kl is not None else None}) + "\n")


def sequence_kl(logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor | None:
    """(B,) Σ_t k1 KL of the sampled responses to the reference; None without a reference or before π_old is known."""
    if logprobs is None or ref_logprobs is None:
        return None
    return (kl_penalty(logprobs, ref_logprobs, "k1") * mask).sum(1)


def _token_kl(logprobs, ref_logprobs, mask) -> torch.Tensor:
    """(B, R) k1 KL per token for the per-token rewards; zeros where it is not measured (no KL in the reward)."""
    if logprobs is None or ref_logprobs is None:
        return torch.zeros_like(mask)
    return kl_penalty(logprobs, ref_logprobs, "k1") * mask


def _pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    """(b, r) -> (b, width) with zeros on the right (a trimmed micro-batch's outputs back at the rollout's width)."""
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))
