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
from rlhfkit.generation import SamplingParams, generate
from rlhfkit.kl import AdaptiveKLController, FixedKLController
from rlhfkit.losses.aggregate import aggregate
from rlhfkit.losses.policy import policy_objective, value_loss
from rlhfkit.models import (
    SharedBaseCritic, disable_dropout, load_causal_lm, load_reward_model, load_tokenizer, rollout_logprobs, save_model,
)
from rlhfkit.ops import kl_penalty, masked_mean
from rlhfkit.rewards import RewardSource, RunningMoments, normalize_scores, token_scores
from rlhfkit.trainers.base import (
    MetricsLogger, Trainer, build_optimizer, build_scheduler, last_checkpoint_note, load_checkpoint, load_model_weights,
    save_checkpoint, set_rng_state,
)
from rlhfkit.types import Rollout

logger = logging.getLogger("rlhfkit")
TABLE = [("Step", "step"), ("Reward", "objective/scores"), ("KL", "objective/kl"), ("ClipFrac", "policy/clipfrac_avg"),
         ("ValueLoss", "loss/value_avg"), ("PolicyLoss", "loss/policy_avg"), ("LR", "lr")]


class OnlineTrainer(Trainer):
    kind = "prompt"
    cfg: OnlineConfig

    # 0. Models, data, reward ----------------------------------------------------------------------------------
    def setup(self) -> None:
        from accelerate.utils import set_seed

        cfg, a = self.cfg, self.cfg.algo
        self.algo = get_algorithm(a.algorithm)
        set_seed(cfg.seed)
        self.tokenizer = load_tokenizer(cfg.model)
        self.train_set, _ = build_datasets("prompt", cfg.data, self.tokenizer, cfg.seed)
        self.accelerator = acc = self.make_accelerator()
        set_seed(cfg.seed)
        policy = load_causal_lm(cfg.model, self.tokenizer)
        # With LoRA the reference is the base with adapters disabled: one copy of the weights, not two.
        self.ref = None
        if self.algo.needs_reference and not cfg.model.lora.enabled:
            self.ref = load_causal_lm(cfg.model, self.tokenizer, trainable=False).to(acc.device)
        self.reward = RewardSource(cfg.reward, self.tokenizer, acc.device, batch_size=cfg.optim.per_device_batch_size)
        value = None
        if self.algo.needs_value and cfg.model.lora.enabled and not a.value_model:
            value = SharedBaseCritic(policy, cfg.model)  # one base for policy, reference and critic
        elif self.algo.needs_value:
            init = a.value_model or (cfg.reward.model[0] if cfg.reward.model else cfg.model.name_or_path)
            value = load_reward_model(dataclasses.replace(cfg.model, name_or_path=init, gguf_file=None), self.tokenizer,
                                      allow_new_head=not a.value_model or a.allow_new_value_head, key="algo.value_model",
                                      hint="set algo.allow_new_value_head=true to start the critic's value head at random")
        if a.disable_dropout:
            disable_dropout(policy)
            if value is not None:
                disable_dropout(value)
        self.world = acc.num_processes
        self.steps_per_epoch = max(1, math.ceil(len(self.train_set) / (a.rollout_batch_size * self.world)))
        self.total_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_epochs * self.steps_per_epoch)
        modules = torch.nn.ModuleList([policy] + ([value] if value is not None else []))
        optimizer = build_optimizer(modules, cfg)
        self.scheduler = build_scheduler(optimizer, cfg, self.total_steps * a.ppo_epochs * a.num_minibatches)
        if value is not None:
            self.model, self.value, self.optimizer = acc.prepare(policy, value, optimizer)
        else:
            (self.model, self.optimizer), self.value = acc.prepare(policy, optimizer), None
        k = cfg.kl
        self.kl_ctl = AdaptiveKLController(k.coef, k.target, k.horizon) if k.controller == "adaptive" else FixedKLController(k.coef)
        self.moments = RunningMoments()
        self.params = SamplingParams(**dataclasses.asdict(cfg.generation))
        self.bad_steps, self.start_step = 0, 0
        if self.resume_from:
            state = load_checkpoint(self.resume_from)
            load_model_weights(acc.unwrap_model(self.model), os.path.join(self.resume_from, "model"))
            critic = acc.unwrap_model(self.value) if self.value is not None else None
            if isinstance(critic, SharedBaseCritic):
                critic.load(os.path.join(self.resume_from, "value_model"))
            elif critic is not None:
                load_model_weights(critic, os.path.join(self.resume_from, "value_model"))
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.kl_ctl.load_state_dict(json.loads(state["kl_controller"]))
            self.moments.load_state_dict(json.loads(state["reward_moments"]))
            self.bad_steps = int(state["bad_steps"])
            set_rng_state(state["rng"])
            self.start_step = int(state["step"])
        if acc.is_main_process:
            self.run_dir.prepare(self.start_step if self.resume_from else None)
        acc.wait_for_everyone()
        if cfg.logging.report_to:
            acc.init_trackers(cfg.logging.run_name or os.path.basename(os.path.abspath(cfg.output_dir)))
        self.metrics = MetricsLogger(cfg.output_dir, acc, cfg.logging.report_to)

    # 1-3. Sample, score, no-grad forwards ---------------------------------------------------------------------
    def prompts_for(self, step: int):
        """This process's prompts for `step` — (PromptBatch, their dataset examples) — from a seeded permutation per
        epoch, so a step's prompts depend on the step alone (resume needs no loader state)."""
        n, per_step = len(self.train_set), self.cfg.algo.rollout_batch_size * self.world
        epoch, k = divmod(step, self.steps_per_epoch)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.cfg.seed * 100003 + epoch))
        order = perm.repeat(math.ceil(self.steps_per_epoch * per_step / n))[k * per_step : (k + 1) * per_step]
        mine = order.view(self.world, -1)[self.accelerator.process_index].tolist()
        examples = [self.train_set[i] for i in mine]
        return collate_prompts(examples, self.tokenizer.pad_token_id), examples

    def response_logprobs(self, model, ro: Rollout, with_entropy: bool = False):
        """(B, R) fp32 log-probs of the response tokens (temperature as when sampling); with `with_entropy` also the
        (B, R) entropies of the distributions they were drawn from."""
        return rollout_logprobs(model, ro, self.cfg.generation.temperature, with_entropy)

    def values_of(self, ro: Rollout):
        """(B, R) critic values V(s_t) of the state before each response token."""
        critic = self.accelerator.unwrap_model(self.value)
        if isinstance(critic, SharedBaseCritic):
            v = self.value(ro.input_ids, ro.attention_mask)  # (B, T)
        else:
            v = token_scores(self.value, ro.input_ids, ro.attention_mask)  # (B, T)
        return v[:, ro.prompt_ids.shape[1] - 1 : -1] * ro.response_mask

    def reference_logprobs(self, ro: Rollout):
        if self.ref is not None:
            return self.response_logprobs(self.ref, ro)
        with _adapters_disabled(self.accelerator.unwrap_model(self.model)):
            return self.response_logprobs(self.model, ro)

    @torch.no_grad()
    def make_experience(self, step: int) -> dict:
        cfg, acc, mb = self.cfg, self.accelerator, self.cfg.optim.per_device_batch_size
        prompts, examples = self.prompts_for(step)
        prompts = prompts.to(acc.device)
        tok = self.tokenizer
        t0 = time.perf_counter()
        ro = self.sample(prompts)
        t_generate = time.perf_counter() - t0
        if ro is None:
            return {"rollout": None, "finite": False, "seq_kl": None, "stats": {"time/generate_s": t_generate}}
        rows = [e for e in examples for _ in range(cfg.generation.num_samples)]  # the dataset example of each row
        raw = self.reward(ro, rows).float()  # (B,) once for the whole rollout batch
        # No-grad forwards without dropout: with unchanged weights they give exactly the update forward's values.
        self.model.eval()
        if self.value is not None:
            self.value.eval()
        chunks = [_rows(ro, i, i + mb) for i in range(0, ro.response_ids.shape[0], mb)]
        cat = lambda f: torch.cat([f(c) for c in chunks])  # noqa: E731
        old_lp = cat(lambda c: self.response_logprobs(self.model, c))
        ref_lp = cat(self.reference_logprobs) if self.algo.needs_reference else None
        values = cat(self.values_of) if self.value is not None else None
        mask = ro.response_mask.float()
        finite = bool(torch.isfinite(raw).all() and all(torch.isfinite(t).all() for t in (old_lp, ref_lp) if t is not None))
        scores = penalize_missing_eos(raw, ro.has_eos, cfg.reward.missing_eos_penalty)
        # The running moments see only finite batches: one NaN must not poison every later step.
        scores = normalize_scores(scores, cfg.reward.normalize, self.moments if finite else RunningMoments(), cfg.reward.clip)
        beta = self.kl_ctl.value
        kl = kl_penalty(old_lp, ref_lp, "k1") * mask if ref_lp is not None else torch.zeros_like(old_lp)  # (B, R)
        rewards = per_token_rewards(scores, kl, mask, beta if self.algo.kl_in_reward else 0.0)
        lmask = loss_mask(mask, ro.has_eos, scores, ro.group_ids, mask_truncated=cfg.algo.mask_truncated,
                          drop_zero_variance_groups=cfg.algo.dynamic_filtering)
        whiten = cfg.algo.whiten_advantages if cfg.algo.whiten_advantages is not None else self.algo.advantage == "gae"
        # Advantages see every response (`mask`): a sample excluded from the loss still counts in its group's baseline.
        adv, returns = compute_advantages(self.algo.advantage, AdvantageInput(
            rewards=rewards, scores=scores, response_mask=mask, values=values, group_ids=ro.group_ids,
            gamma=cfg.algo.gamma, lam=cfg.algo.lam, whiten=whiten))
        seq_kl = kl.sum(1) if ref_lp is not None else None  # (B,), only where there is a reference
        stats = {
            "objective/scores": raw.mean(),
            "objective/entropy": (-old_lp * mask).sum(1).mean(),
            "response/length_avg": mask.sum(1).mean(), "response/eos_rate": ro.has_eos.float().mean(),
            "policy/sampler_logprob_gap": masked_mean((ro.sampler_logprobs - old_lp).abs(), mask),
            # Evidence for the reward-hacking alarms (rlhfkit.evaluation.alarms).
            "response/empty_rate": ((mask.sum(1) - ro.has_eos.float()) <= 0).float().mean(),
            "response/score_length_corr": pearson(raw.tolist(), mask.sum(1).tolist()),
            "time/generate_s": t_generate,
        }
        # distinct-2, words per response, the share of prompts answered by the commonest response (the collapse alarm)
        stats.update(diversity_figures(tok.batch_decode(ro.response_ids, skip_special_tokens=True), ro.group_ids.tolist()))
        if seq_kl is not None:
            stats.update({"objective/kl": seq_kl.mean(), "objective/kl_coef": beta,
                          "objective/rlhf_reward": (scores - beta * seq_kl).mean()})
        gold = self.reward.gold(ro, rows)
        if gold is not None:
            stats["objective/gold"] = gold.mean()
        finite = finite and bool(torch.isfinite(adv).all())
        return {"rollout": ro, "old_lp": old_lp, "ref_lp": ref_lp, "values": values, "adv": adv, "returns": returns,
                "loss_mask": lmask, "scores": raw, "stats": stats, "finite": finite, "seq_kl": seq_kl}

    def sample(self, prompts) -> Rollout | None:
        """`generation.generate` from the policy; None when the policy's probabilities are not finite (weights
        that blew up): the step is then a bad step, not a crash."""
        tok = self.tokenizer
        try:
            return generate(self.accelerator.unwrap_model(self.model), prompts, self.params, tok.eos_token_id, tok.pad_token_id)
        except RuntimeError as exc:
            if "inf" in str(exc) and "nan" in str(exc):  # torch.multinomial: "probability tensor contains either inf, nan or element < 0"
                return None
            raise

    # 5. Updates -----------------------------------------------------------------------------------------------
    def update(self, exp: dict) -> dict[str, float]:
        cfg, a, acc = self.cfg, self.cfg.algo, self.accelerator
        lmask = exp["loss_mask"]
        n = lmask.shape[0]
        mb_size, micro = n // a.num_minibatches, cfg.optim.per_device_batch_size
        agg = a.loss_agg or self.algo.default_loss_agg
        sums: dict[str, float] = {}
        early_stopped = 0.0
        self.model.train()
        if self.value is not None:
            self.value.train()
        for _epoch in range(a.ppo_epochs):
            perm = torch.randperm(n, device=lmask.device)
            for m in range(a.num_minibatches):
                idx = perm[m * mb_size : (m + 1) * mb_size]
                counts = acc.reduce(torch.stack([lmask[idx].sum(), torch.tensor(float(len(idx)), device=lmask.device)]), "sum")
                num_tokens, num_seqs = (counts / self.world).clamp(min=1).tolist()  # DDP averages: per-process share
                mb_kl = 0.0
                for i in range(0, len(idx), micro):
                    j = idx[i : i + micro]
                    parts = {}
                    # Policy and value losses are backpropagated one at a time: with a shared-base critic,
                    # gradient checkpointing recomputes each forward under the adapter active at backward time.
                    terms = [self.policy_loss] + ([self.critic_loss] if self.value is not None else [])
                    for term in terms:
                        loss, term_parts = term(exp, j, agg, num_tokens, num_seqs)
                        if not torch.isfinite(loss):
                            self.optimizer.zero_grad(set_to_none=True)
                            return {"faults/nonfinite_loss": 1.0}
                        acc.backward(loss)
                        parts.update(term_parts)
                    w = float(lmask[j].sum())
                    for k, v in parts.items():
                        sums[k] = sums.get(k, 0.0) + float(v) * w
                    sums["_w"] = sums.get("_w", 0.0) + w
                    mb_kl += float(parts["policy/approxkl_avg"]) * w
                max_norm = cfg.optim.max_grad_norm
                norm = acc.clip_grad_norm_(self.optimizer_params(), max_norm if max_norm is not None else math.inf)
                if norm is not None and acc.scaler is None and not math.isfinite(float(norm)):
                    self.optimizer.zero_grad(set_to_none=True)
                    return {"faults/nonfinite_gradient": 1.0}
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                if a.target_kl is not None and mb_kl / max(float(lmask[idx].sum()), 1.0) > a.target_kl:
                    early_stopped = 1.0
                    break
            if early_stopped:
                break
        w = max(sums.pop("_w", 0.0), 1.0)
        return {**{k: v / w for k, v in sums.items()}, "policy/early_stopped": early_stopped}

    @torch.no_grad()
    def policy_is_finite(self, exp: dict) -> bool:
        """Whether the policy, as updated, still gives finite log-probs on a micro-batch of this step's rollout (one
        no-grad forward, before a checkpoint: weights that blew up can be finite while every output is inf/NaN)."""
        ro = _rows(exp["rollout"], 0, self.cfg.optim.per_device_batch_size)
        self.model.eval()
        finite = torch.isfinite(self.response_logprobs(self.model, ro)).all().float()
        return bool(self.accelerator.reduce(finite, "min") > 0)

    def optimizer_params(self):
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def policy_loss(self, exp: dict, j, agg: str, num_tokens: float, num_seqs: float):
        """Policy loss of micro-batch rows `j`, normalised by the minibatch's global counts (see losses.aggregate);
        Dr. GRPO's constant is `generation.max_new_tokens`, whatever width this rollout was padded to."""
        a, ro = self.cfg.algo, _select(exp["rollout"], j)
        lmask = exp["loss_mask"][j]
        if a.entropy_coef:
            new_lp, entropy = self.response_logprobs(self.model, ro, with_entropy=True)
        else:
            new_lp, entropy = self.response_logprobs(self.model, ro), None
        per_token, m = policy_objective(
            new_lp, exp["old_lp"][j], exp["adv"][j], clip_eps_low=a.clip_eps, clip_eps_high=a.clip_eps_high,
            dual_clip=a.dual_clip, ref_logprobs=exp["ref_lp"][j] if self.algo.kl_in_loss else None,
            kl_coef=self.kl_ctl.value, entropy=entropy, entropy_coef=a.entropy_coef)
        loss = aggregate(per_token, lmask, agg, num_tokens=num_tokens, num_seqs=num_seqs,
                         max_len=self.cfg.generation.max_new_tokens)
        metrics = {"loss/policy_avg": masked_mean(m["surrogate"], lmask), "policy/approxkl_avg": masked_mean(m["approxkl"], lmask),
                   "policy/clipfrac_avg": masked_mean(m["clipfrac"], lmask), "val/ratio": masked_mean(m["ratio"], lmask)}
        if entropy is not None:
            metrics["policy/entropy_avg"] = masked_mean(entropy.detach(), lmask)
        return loss, metrics

    def critic_loss(self, exp: dict, j, agg: str, num_tokens: float, num_seqs: float):
        """Clipped value loss of rows `j` (token mean over the minibatch's global token count), times vf_coef."""
        a, ro, lmask = self.cfg.algo, _select(exp["rollout"], j), exp["loss_mask"][j]
        vl, vm = value_loss(self.values_of(ro), exp["values"][j], exp["returns"][j], clip_range_value=a.clip_range_value)
        loss = a.vf_coef * aggregate(vl, lmask, "token-mean", num_tokens=num_tokens)
        return loss, {"loss/value_avg": masked_mean(vl.detach(), lmask), "val/clipfrac_avg": masked_mean(vm["clipfrac"], lmask)}

    # 6. The loop ----------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        from tqdm.auto import tqdm

        self.setup()
        cfg, a, acc = self.cfg, self.cfg.algo, self.accelerator
        bar = tqdm(total=self.total_steps, initial=self.start_step, desc=f"{a.algorithm}", dynamic_ncols=True,
                   disable=not (cfg.logging.progress_bar and acc.is_main_process))
        last: dict[str, float] = {}
        history: list[dict] = []  # this process's rows since start (or resume), for the reward-hacking alarms
        raised: set[str] = set()
        for step in range(self.start_step, self.total_steps):
            done = step + 1
            lr = self.scheduler.get_last_lr()[0]
            t0 = time.perf_counter()
            exp = self.make_experience(step)
            t1 = time.perf_counter()
            out = self.update(exp) if exp["finite"] else {"faults/nonfinite_rollout": 1.0}
            bad = any(k.startswith("faults/") for k in out)
            timing = {"time/rollout_s": t1 - t0, "time/update_s": time.perf_counter() - t1}
            if bad:
                self.bad_steps += 1
                logger.warning("step %d: non-finite %s; update skipped (%d/%d)", done, next(iter(out)).partition("nonfinite_")[2],
                               self.bad_steps, cfg.max_bad_steps)
                if self.bad_steps >= cfg.max_bad_steps:
                    raise UserError(f"stopping at step {done}: {self.bad_steps} updates skipped for non-finite rewards, "
                                    f"log-probs or loss (max_bad_steps={cfg.max_bad_steps}); {last_checkpoint_note(cfg.output_dir)}")
            elif exp["seq_kl"] is not None:
                self.kl_ctl.update(float(exp["seq_kl"].mean()), exp["seq_kl"].numel() * self.world)
            samples = a.rollout_batch_size * cfg.generation.num_samples * self.world  # per step, all processes
            last = {**{k: float(v) for k, v in exp["stats"].items()}, **out, "lr": lr, "faults/skipped_total": self.bad_steps,
                    "episodes": done * samples, **timing}
            bar.update(1)
            bar.set_postfix({k: f"{last[key]:.3g}" for k, key in (("reward", "objective/scores"), ("kl", "objective/kl")) if key in last})
            if done % cfg.logging.logging_steps == 0 or done == self.total_steps:
                self.metrics.log(done, last)
            history.append({"step": done, **last})
            if acc.is_main_process and (done % a.table_steps == 0 or done == self.total_steps):
                bar.write(self.table_row(done, last, header=done <= a.table_steps or step == self.start_step))
                for alarm in check_alarms(history):
                    if alarm.name not in raised:
                        raised.add(alarm.name)
                        logger.warning("alarm %s at step %d: %s", alarm.name, done, alarm.message)
            if exp["rollout"] is not None and acc.is_main_process and (done % a.sample_log_steps == 0 or done == 1 or done == self.total_steps):
                self.log_samples(done, exp)
            if cfg.logging.save_steps and done % cfg.logging.save_steps == 0 and done < self.total_steps:
                if bad:  # the weights may be what made this step bad: keep the last good checkpoint as the newest
                    logger.warning("step %d: no checkpoint after a skipped step", done)
                elif not self.policy_is_finite(exp):
                    logger.warning("step %d: no checkpoint: the updated policy's log-probs are not finite", done)
                else:
                    self.checkpoint(done)
        bar.close()
        self.finish()
        return last

    def table_row(self, step: int, m: dict, header: bool) -> str:
        """One row of the console table (critic-free methods show "-" for the value loss)."""
        cells = [f"{step:>6d}"] + [f"{m[key]:>10.4g}" if key in m else f"{'-':>10}" for _, key in TABLE[1:]]
        head = " | ".join([f"{TABLE[0][0]:>6}"] + [f"{name:>10}" for name, _ in TABLE[1:]])
        return f"{head}\n{' | '.join(cells)}" if header else " | ".join(cells)

    def log_samples(self, step: int, exp: dict, n: int = 4) -> None:
        ro, tok = exp["rollout"], self.tokenizer
        with open(os.path.join(self.cfg.output_dir, "samples.jsonl"), "a", encoding="utf-8") as f:
            for i in range(min(n, ro.response_ids.shape[0])):
                f.write(json.dumps({
                    "step": step, "prompt": tok.decode(ro.prompt_ids[i][ro.prompt_mask[i].bool()], skip_special_tokens=True),
                    "response": tok.decode(ro.response_ids[i][ro.response_mask[i].bool()], skip_special_tokens=True),
                    "score": float(exp["scores"][i]),
                    "kl": float(exp["seq_kl"][i]) if exp["seq_kl"] is not None else None}) + "\n")

    def checkpoint(self, step: int) -> None:
        acc = self.accelerator
        acc.wait_for_everyone()
        if acc.is_main_process:
            policy = acc.unwrap_model(self.model)
            value = acc.unwrap_model(self.value) if self.value is not None else None

            def save(d: str) -> None:
                save_model(policy, self.tokenizer, d, merge_lora=False)
                value_dir = os.path.join(os.path.dirname(d), "value_model")
                if isinstance(value, SharedBaseCritic):
                    value.save(value_dir)
                elif value is not None:
                    save_model(value, self.tokenizer, value_dir, merge_lora=False)

            state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                     "kl_controller": json.dumps(self.kl_ctl.state_dict()), "reward_moments": json.dumps(self.moments.state_dict()),
                     "bad_steps": self.bad_steps}
            save_checkpoint(self.cfg.output_dir, step, save, state, self.cfg.logging.save_total_limit)
        acc.wait_for_everyone()


def _adapters_disabled(model):
    """`disable_adapter()` of a peft model: inside it the model is its frozen base (the LoRA reference)."""
    if not hasattr(model, "disable_adapter"):
        raise UserError("a KL reference needs either full fine-tuning (a frozen copy) or LoRA (the base with adapters disabled)")
    return model.disable_adapter()


def _select(ro: Rollout, idx) -> Rollout:
    return Rollout(**{f.name: getattr(ro, f.name)[idx] for f in dataclasses.fields(ro)})


def _rows(ro: Rollout, start: int, end: int) -> Rollout:
    return Rollout(**{f.name: getattr(ro, f.name)[start:end] for f in dataclasses.fields(ro)})
