"""The online trainer's setup, checkpoints and step log: its models (policy, reference, critic, reward), data, the
KL controller and reward moments, resume, and what is logged after each step (metrics, console table, alarms,
samples, checkpoint). The step itself is `online.OnlineTrainer`'s."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os

import torch

from rlhfkit.algorithms import get_algorithm
from rlhfkit.config import OnlineConfig
from rlhfkit.data import collate_prompts
from rlhfkit.errors import UserError
from rlhfkit.evaluation.alarms import AlarmThresholds, check_alarms
from rlhfkit.generation import generate, prompt_seed
from rlhfkit.io import read_jsonl_rows
from rlhfkit.kl import AdaptiveKLController, FixedKLController
from rlhfkit.models import (PolicyAndCritic, Reference, SharedBaseCritic, disable_dropout, load_causal_lm, load_reward_model,
                            rollout_logprobs)
from rlhfkit.objects import Objects
from rlhfkit.reward_functions import extra_columns
from rlhfkit.rewards import Rewards, RunningMoments
from rlhfkit.sharding import gathered_weights
from rlhfkit.trainers.held_out import HeldOutEval, capability_set
from rlhfkit.trainers.optim import build_optimizer, build_scheduler
from rlhfkit.trainers.ptx import Ptx, load_ptx_set
from rlhfkit.trainers.run import Run
from rlhfkit.types import Experience, Rollout

logger = logging.getLogger("rlhfkit")
TABLE = [("Step", "step"), ("Reward", "objective/scores"), ("KL", "objective/kl"), ("ClipFrac", "policy/clipfrac_avg"),
         ("ValueLoss", "loss/value_avg"), ("PolicyLoss", "loss/policy_avg"), ("LR", "lr")]


class OnlineModels:
    cfg: OnlineConfig

    def __init__(self, cfg: OnlineConfig, objects: Objects | None = None):
        """`objects`: what the Python API was given (`rlhfkit.train`): model, tokenizer, reward sources, callbacks."""
        self.cfg, self.objects = cfg, objects or Objects()
        # The lock taken and output_dir checked, before anything loads; the callbacks called at the run's events.
        self.run = Run(cfg, cfg.algo.algorithm, self.objects.callbacks)

    def setup(self) -> None:
        """Tokenizer, the policy's structure checked from its config, prompts; accelerate, models; resume."""
        from accelerate.utils import set_seed

        from rlhfkit.data import build_datasets
        from rlhfkit.launch import distributed_state
        from rlhfkit.models import check_model_structure, load_tokenizer

        cfg, run = self.cfg, self.run
        set_seed(cfg.seed)
        with distributed_state().main_process_first():  # one process tokenises into the cache; the others then read it
            self.tokenizer = load_tokenizer(cfg.model, given=self.objects.tokenizer)
            check_model_structure(cfg.model, self.tokenizer, given=self.objects.model)
            self.train_set, eval_prompts = build_datasets("prompt", cfg.data, self.tokenizer, cfg.seed)
            capability = capability_set(cfg, self.tokenizer)
            self.ptx_set = load_ptx_set(cfg, self.tokenizer)
        self.accelerator = run.make_accelerator()
        self.world = run.world
        set_seed(cfg.seed)
        self.build()
        self.held_out = HeldOutEval(run, cfg, self.tokenizer, eval_prompts, capability, cfg.algo.rollout_batch_size)
        self.held_out.check_reference(self.ref)
        self.start_step = 0
        if run.resume_from:
            state = run.resume(self.trained_models(), self.load_models, self.optim)
            self.start_step = int(state["step"])
            self.kl_ctl.load_state_dict(json.loads(state["kl_controller"]))
            self.moments.load_state_dict(json.loads(state["reward_moments"]))
            run.restore_rng(state)

    def build(self) -> None:
        cfg, a, acc = self.cfg, self.cfg.algo, self.accelerator
        self.algo = get_algorithm(a.algorithm)
        # One pass over the experience (ppo_epochs × num_minibatches = 1) and no KL in the reward: π_old is then the
        # update forward's own log-probs, detached (the ratio is 1 by definition), so the separate no-grad forward is
        # skipped, as TRL's GRPO does (unless algo.old_logprob_source=recompute); `update` returns them for the statistics.
        self.one_pass = (a.ppo_epochs * a.num_minibatches == 1 and not self.algo.kl_in_reward
                         and a.old_logprob_source != "recompute")
        policy = load_causal_lm(cfg.model, self.tokenizer, given=self.objects.model)
        # With LoRA the reference is the base with adapters disabled: one copy of the weights, not two.
        frozen = self.run.frozen_dtype
        self.ref = Reference(cfg.model, None, policy, self.tokenizer, acc.device, frozen, copy_of=self.objects.model) \
            if self.algo.needs_reference else None
        self.reward = Rewards(cfg.reward, self.tokenizer, acc.device, batch_size=cfg.optim.per_device_batch_size,
                              policy_name=cfg.model.name_or_path, dtype=frozen, given=self.objects.reward_funcs,
                              given_weights=self.objects.reward_weights,
                              attn_implementation=cfg.model.attn_implementation)
        value = self.load_critic(policy) if self.algo.needs_value else None
        self.shares_base = isinstance(value, SharedBaseCritic)  # the critic is a second adapter on the policy's base
        if a.disable_dropout:
            for module in (policy, value):
                if module is not None:
                    disable_dropout(module)
        self.steps_per_epoch = max(1, math.ceil(len(self.train_set) / (a.rollout_batch_size * self.world)))
        self.total_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_epochs * self.steps_per_epoch)
        optimizer = build_optimizer(torch.nn.ModuleList([m for m in (policy, value) if m is not None]), cfg)
        scheduler = build_scheduler(optimizer, cfg, self.total_steps * a.ppo_epochs * a.num_minibatches)
        self.refuse_unsupported_critic(value)
        if value is not None and acc.distributed_type == "DEEPSPEED":
            # DeepSpeed takes one model per Accelerator: policy and critic are prepared as one module, then each is
            # called through its own forward (ZeRO-3's hooks sit on every submodule; the engine steps at backward).
            engine, optimizer = acc.prepare(PolicyAndCritic(policy, value), optimizer)
            self.model, self.value = engine.module.policy, engine.module.critic
        elif value is not None:
            self.model, self.value, optimizer = acc.prepare(policy, value, optimizer)
        else:
            (self.model, optimizer), self.value = acc.prepare(policy, optimizer), None
        self.optim = self.run.make_optim(optimizer, scheduler, [m for m in (self.model, self.value) if m is not None])
        self.ptx = self.make_ptx(a.rollout_batch_size * cfg.generation.num_samples // a.num_minibatches)
        k = cfg.kl
        self.kl_ctl = AdaptiveKLController(k.coef, k.target, k.horizon) if k.controller == "adaptive" else FixedKLController(k.coef)
        self.moments = RunningMoments()

    def make_ptx(self, per_update: int) -> Ptx | None:
        """The PPO-ptx term (`trainers.ptx`): `per_update` records per optimizer step and process; None without data.ptx."""
        if self.ptx_set is None:
            return None
        return Ptx(self.ptx_set, self.cfg.algo.ptx_coef, self.run, per_update, self.cfg.optim.per_device_batch_size,
                   self.tokenizer.pad_token_id)

    def refuse_unsupported_critic(self, value) -> None:
        acc = self.accelerator
        if self.shares_base and acc.distributed_type == "DEEPSPEED":
            raise UserError("model.lora.enabled: PPO's LoRA critic (a second adapter on the policy's base) is "
                            "backpropagated on its own, which DeepSpeed's gradient hooks do not take; under DeepSpeed "
                            "give the critic its own model (algo.value_model) or run without DeepSpeed")
        if value is not None and acc.distributed_type == "FSDP":
            if self.shares_base:
                raise UserError("model.lora.enabled: PPO's LoRA critic (a second adapter on the policy's base) runs the "
                                "policy's layers outside the policy's own forward, which FSDP does not gather; under FSDP "
                                "give the critic its own model (algo.value_model)")
            if getattr(acc.state.fsdp_plugin, "fsdp_version", 1) == 2:
                raise UserError("PPO under FSDP2: accelerate prepares one model under FSDP2 and PPO trains two (policy "
                                "and critic); launch with configs/accelerate/fsdp.yaml (FSDP1) or without FSDP")

    def load_critic(self, policy):
        """PPO's value model: with LoRA (and no algo.value_model) a second adapter on the policy's own base;
        otherwise a sequence-classification model from algo.value_model, the first reward model, or the policy."""
        cfg, a = self.cfg, self.cfg.algo
        if cfg.model.lora.enabled and not a.value_model:
            return SharedBaseCritic(policy, cfg.model)  # one base for policy, reference and critic
        first = self.reward.first_model() if not a.value_model else None
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
        elif not a.value_model and first is None and self.objects.model is not None:
            given = policy  # a policy object given from Python: a copy of its backbone under a new value head
        return load_reward_model(dataclasses.replace(cfg.model, name_or_path=init, gguf_file=None), self.tokenizer, given=given,
                                 allow_new_head=not a.value_model or a.allow_new_value_head, key="algo.value_model",
                                 hint="set algo.allow_new_value_head=true to start the critic's value head at random")

    # The step's sampling, shared by the online loops ---------------------------------------------------------------
    def prompts_for(self, step: int):
        """This process's prompts for `step`: (PromptBatch, their dataset examples); see `Run.step_indices`."""
        per_step = self.cfg.algo.rollout_batch_size * self.world
        order = torch.tensor(self.run.step_indices(step, len(self.train_set), per_step, self.steps_per_epoch))
        examples = [self.train_set[i] for i in order.view(self.world, -1)[self.accelerator.process_index].tolist()]
        return collate_prompts(examples, self.tokenizer.pad_token_id), examples

    def sample(self, prompts, step: int) -> Rollout | None:
        """`generation.generate` from the policy (with `generation.seed_per_prompt`, each prompt under its own seed);
        None when the policy's probabilities are not finite (weights that blew up): the step is then a bad step, not
        a crash."""
        tok, cfg = self.tokenizer, self.cfg
        seeds = [prompt_seed(cfg.seed, step, ids[mask.bool()]) for ids, mask in zip(prompts.input_ids, prompts.attention_mask)] \
            if cfg.generation.seed_per_prompt else None
        try:
            with gathered_weights(self.accelerator, self.model, self.run.unwrap(self.model)) as policy:  # FSDP / ZeRO-3
                return generate(policy, prompts, cfg.generation, tok.eos_token_id, tok.pad_token_id, seeds)
        except RuntimeError as exc:
            if "inf" in str(exc) and "nan" in str(exc):  # torch.multinomial: "probability tensor contains either inf, nan or element < 0"
                return None
            raise

    def response_logprobs(self, model, ro: Rollout, with_entropy: bool = False):
        """(B, R) fp32 log-probs of the response tokens (temperature as when sampling); with `with_entropy` also the
        (B, R) entropies of the distributions they were drawn from."""
        return rollout_logprobs(model, ro, self.cfg.generation.temperature, with_entropy)

    @torch.no_grad()
    def policy_is_finite(self, exp: Experience) -> bool:
        """Whether the policy, as updated, still gives finite log-probs on a micro-batch of this step's rollout (one
        no-grad forward, before a checkpoint: weights that blew up can be finite while every output is inf/NaN)."""
        policy = self.run.unwrap(self.model)
        policy.eval()
        rollout = exp.rollout.select(slice(0, self.cfg.optim.per_device_batch_size))
        return self.run.on_every_process(bool(torch.isfinite(self.response_logprobs(policy, rollout)).all()))

    # Checkpoints -----------------------------------------------------------------------------------------------------
    def trained_models(self) -> list:
        """The policy, and a critic that is a model of its own (a shared-base critic's adapter is in the policy)."""
        return [self.model] + ([self.value] if self.value is not None and not self.shares_base else [])

    def save_models(self, directory: str, models: list) -> None:
        from rlhfkit.models import save_model

        save_model(models[0], self.tokenizer, directory, merge_lora=False)
        value_dir = os.path.join(os.path.dirname(directory), "value_model")
        if self.shares_base:
            self.run.unwrap(self.value).save(value_dir)
        elif self.value is not None:
            save_model(models[1], self.tokenizer, value_dir, merge_lora=False)

    def load_models(self, checkpoint: str) -> None:
        from rlhfkit.checkpoint import load_model_weights
        from rlhfkit.sharding import loaded_weights

        for module, sub in ((self.model, "model"), (self.value, "value_model")):
            if module is None:
                continue
            directory = os.path.join(checkpoint, sub)
            if module is self.value and self.shares_base:
                self.run.unwrap(self.value).load(directory)
            else:
                loaded_weights(self.accelerator, module, lambda m, d=directory: load_model_weights(m, d), self.run.unwrap(module))

    def checkpoint(self, step: int) -> None:
        extra = {"kl_controller": json.dumps(self.kl_ctl.state_dict()), "reward_moments": json.dumps(self.moments.state_dict())}
        self.run.save_checkpoint(step, self.trained_models(), self.save_models, self.optim, extra)

    # After each step -------------------------------------------------------------------------------------------------
    def logged_rows(self) -> list[dict]:
        """The rows a resumed run logged before its checkpoint (null = NaN), so the alarms see the whole run."""
        path = os.path.join(self.cfg.output_dir, "metrics.jsonl")
        if not (self.run.resume_from and os.path.isfile(path)):
            return []
        return [{k: math.nan if v is None else v for k, v in row.items()} for row in read_jsonl_rows(path)]

    def end_step(self, done: int, exp: Experience | None, stats: dict[str, float], bad: bool, kl) -> None:
        """Log step `done` (1-based), evaluate when due, raise the alarms, write samples, checkpoint. `kl`: (B,)
        sequence KL or None."""
        cfg, a, run = self.cfg, self.cfg.algo, self.run
        self.last = stats
        run.step_end(done, {k: stats[key] for k, key in (("reward", "objective/scores"), ("kl", "objective/kl")) if key in stats})
        if done % cfg.logging.logging_steps == 0 or done == self.total_steps:
            run.log(done, stats)
        self.history.append({"step": done, **stats})
        evaluated = self.held_out.due(done, done == self.total_steps)
        if evaluated:  # logged as its own row of the step, before the step's checkpoint
            figures = self.held_out(done, self.model, self.ref, self.reward, self.total_steps)
            self.history.append({"step": done, **figures})
            self.last = {**stats, **figures}
        if self.accelerator.is_main_process and (done % a.table_steps == 0 or done == self.total_steps):
            run.write(self.table_row(done, stats, header=done <= a.table_steps or done == self.start_step + 1))
        if self.accelerator.is_main_process and (done % a.table_steps == 0 or done == self.total_steps or evaluated):
            thresholds = AlarmThresholds(alignment_tax_nats=cfg.alarms.alignment_tax_nats)
            for alarm in check_alarms(self.history, thresholds=thresholds):
                if alarm.name not in self.raised:
                    self.raised.add(alarm.name)
                    logger.warning("alarm %s at step %d: %s", alarm.name, done, alarm.message)
        if exp is not None and (done % a.sample_log_steps == 0 or done == 1 or done == self.total_steps):
            run.log_samples(done, self.sample_rows(exp, kl))
        if run.checkpoint_due(done, self.total_steps):
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

    def sample_rows(self, exp: Experience, kl, n: int = 4) -> list[dict]:
        ro, tok = exp.rollout, self.tokenizer
        extras = getattr(self, "sample_extras", {})  # the step's log_extra columns (`experience.make_experience`)
        return [{"prompt": tok.decode(ro.prompt_ids[i][ro.prompt_mask[i].bool()], skip_special_tokens=True),
                 "response": tok.decode(ro.response_ids[i][ro.response_mask[i].bool()], skip_special_tokens=True),
                 "score": float(exp.scores[i]), "kl": float(kl[i]) if kl is not None else None,
                 **extra_columns(extras, i)}
                for i in range(min(n, ro.response_ids.shape[0]))]
