"""Online RL: one loop for PPO, RLOO, GRPO (Dr.GRPO, DAPO) and REINFORCE++.

Each step reads like the algorithm box of a paper:
  1-4. `ExperienceMaker.make`: roll out (`rlhfkit.rollout`: single-turn sampling, or multi-turn episodes with tools),
     score once per rollout batch, no-grad forwards (π_old, reference, critic), the KL penalty and the advantages;
  5. `PolicyUpdate`: `ppo_epochs` passes of minibatch updates, each applied by `optimizer_step`, stopping early when
     approx-KL passes `algo.target_kl`; a non-finite rollout, loss or gradient skips the step's remaining updates
     (the schedule advances past them, as it does after an early stop);
  6. β follows the measured KL, then `StepLog`: log, evaluate, alarms, samples, checkpoint.
The trainer builds the components and calls them; what differs between methods is data in
`rlhfkit.algorithms.Algorithm`, and this file never branches on a name.
"""

from __future__ import annotations

import json
import os
import time

import torch

from rlhfkit.algorithms import get_algorithm
from rlhfkit.config import OnlineConfig
from rlhfkit.critic import PolicyAndCritic, SharedBaseCritic, load_critic
from rlhfkit.errors import UserError
from rlhfkit.kl_control import AdaptiveEntropyController, AdaptiveKLController, FixedKLController
from rlhfkit.models import Reference, disable_dropout, load_causal_lm
from rlhfkit.objects import Objects
from rlhfkit.rewards import Rewards, RunningMoments
from rlhfkit.rollout.maker import environment_rewards, rollout_maker
from rlhfkit.trainers.experience import ExperienceMaker, Made, old_logprob_source
from rlhfkit.trainers.held_out import HeldOutEval
from rlhfkit.trainers.online_setup import (PromptStream, Samples, StepLog, load_online_data, policy_is_finite,
                                           total_steps_of)
from rlhfkit.trainers.optim import build_optimizer, build_scheduler, optimizer_step
from rlhfkit.trainers.policy_update import PolicyUpdate, Update
from rlhfkit.trainers.ptx import Ptx
from rlhfkit.trainers.ref_sync import RefSync
from rlhfkit.trainers.run import Run


def sampler_is_exact(cfg: OnlineConfig, mixed_precision: str, policy, objects: Objects) -> bool:
    """Whether the rollout's recorded log-probs are π_old to float noise, so that `algo.old_logprob_source: auto` may
    take them instead of a forward: rlhfkit's own single-turn decode loop (a rollout component the config made, no
    tools), in fp32 weights without autocast — the update starts from the weights that sampled, both run without
    dropout at the same temperature, and differ only in the KV cache's summation order (~1e-7)."""
    return (cfg.generation.engine == "rlhfkit" and mixed_precision == "no" and policy.dtype == torch.float32
            and not cfg.model.quantization.load_in_4bit and objects.rollout is None and objects.toolbox is None)


class OnlineTrainer:
    def __init__(self, cfg: OnlineConfig, objects: Objects | None = None):
        """`objects`: what the Python API was given (`rlhfkit.train`): model, tokenizer, reward sources, tools,
        callbacks."""
        self.cfg, self.objects = cfg, objects or Objects()
        # The lock taken and output_dir checked, before anything loads; the callbacks called at the run's events.
        self.run = Run(cfg, cfg.algo.algorithm, self.objects.callbacks)

    def setup(self) -> None:
        """Tokenizer and data; accelerate, models and the step's components; resume."""
        from accelerate.utils import set_seed

        cfg, run = self.cfg, self.run
        set_seed(cfg.seed)
        data = load_online_data(cfg, self.objects)
        self.tokenizer = data.tokenizer
        self.accelerator = run.make_accelerator()
        set_seed(cfg.seed)
        self.prompts = PromptStream(run, data.train_set, cfg.algo.rollout_batch_size, self.tokenizer.pad_token_id)
        self.total_steps = total_steps_of(cfg, self.prompts.steps_per_epoch)
        self.build(data.ptx_set)
        self.held_out = HeldOutEval(run, cfg, self.tokenizer, data.eval_prompts, data.capability, cfg.algo.rollout_batch_size,
            self.objects)
        self.held_out.check_reference(self.ref)
        self.start_step = 0
        if run.resume_from:
            state = run.resume(self.trained_models(), self.load_models, self.optim)
            self.start_step = int(state["step"])
            self.kl_ctl.load_state_dict(json.loads(state["kl_controller"]))
            self.moments.load_state_dict(json.loads(state["reward_moments"]))
            if self.entropy_ctl is not None:
                self.entropy_ctl.load_state_dict(json.loads(state["entropy_controller"]))
            run.restore_rng(state)

    def build(self, ptx_set) -> None:
        cfg, a, acc, run = self.cfg, self.cfg.algo, self.accelerator, self.run
        self.algo = get_algorithm(a.algorithm)
        policy = load_causal_lm(cfg.model, self.tokenizer, given=self.objects.model)
        old_source = old_logprob_source(cfg, self.algo, sampler_is_exact(cfg, run.mixed_precision, policy, self.objects))
        # The reference: for the KL term, or only to monitor the drift (`kl.monitor`). With LoRA it is the base with
        # adapters disabled: one copy of the weights, not two.
        monitor = cfg.kl.monitor if cfg.kl.monitor is not None else cfg.model.lora.enabled
        self.ref = Reference(cfg.model, None, policy, self.tokenizer, acc.device, run.frozen_dtype,
                             copy_of=self.objects.model) if self.algo.needs_reference or monitor else None
        self.reward = Rewards(cfg.reward, self.tokenizer, acc.device, batch_size=cfg.optim.per_device_batch_size,
                              policy_name=cfg.model.name_or_path, dtype=run.frozen_dtype, given=self.objects.reward_funcs,
                              given_weights=self.objects.reward_weights, attn_implementation=cfg.model.attn_implementation,
                              environment_rewards=environment_rewards(self.objects))
        value = load_critic(cfg, policy, self.tokenizer, self.reward.first_model(), self.objects.model) \
            if self.algo.needs_value else None
        self.shares_base = isinstance(value, SharedBaseCritic)  # the critic is a second adapter on the policy's base
        if a.disable_dropout:
            for module in (policy, value):
                if module is not None:
                    disable_dropout(module)
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
        self.optim = run.make_optim(optimizer, scheduler, [m for m in (self.model, self.value) if m is not None])
        ptx = None if ptx_set is None else Ptx(ptx_set, a.ptx_coef, run, a.rollout_batch_size * cfg.generation.num_samples
                                               // a.num_minibatches, cfg.optim.per_device_batch_size, self.tokenizer.pad_token_id)
        k = cfg.kl
        self.kl_ctl = AdaptiveKLController(k.coef, k.target, k.horizon) if k.controller == "adaptive" else FixedKLController(k.coef)
        self.moments = RunningMoments()
        self.entropy_ctl = AdaptiveEntropyController(a.entropy_coef, a.entropy_target, a.entropy_coef_delta,
                                                     a.entropy_coef_min, a.entropy_coef_max) if a.adaptive_entropy else None
        rollout = rollout_maker(cfg, self.tokenizer, self.objects)
        self.maker = ExperienceMaker(rollout, self.reward, self.ref, self.value, self.kl_ctl, self.moments, cfg, self.algo,
                                     run, old_source, candidates=self.prompts.candidates)
        self.update = PolicyUpdate(cfg, self.algo, run, self.model, self.value, self.shares_base, self.optim, ptx,
                                   self.kl_ctl, old_source, self.entropy_ctl)
        self.ref_sync = RefSync(self.ref, a.ref_model_mixup_alpha, a.ref_model_sync_steps, acc.distributed_type) \
            if a.sync_ref_model else None  # TR-DPO

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

    def experience(self, step: int) -> Made:
        """Step `step`'s (0-based) experience, from this process's prompts of that step."""
        prompts, examples = self.prompts(step)
        return self.maker.make(self.model, prompts, examples, step, self.total_steps)

    # The loop ------------------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Each step: roll out → score → advantages → K epochs of updates → β, log, checkpoint."""
        a = self.cfg.algo
        with self.run as run:
            self.setup()
            run.begin(self.start_step, self.total_steps, self.prompts.steps_per_epoch)
            # After `begin`, which drops a resumed run's rows past its checkpoint: the alarms see the rows before it.
            self.log = StepLog(run, self.cfg, self.held_out, self.total_steps, self.start_step)
            for step in range(self.start_step, self.total_steps):
                lr, t0 = self.optim.lr, time.perf_counter()
                made = self.experience(step)  # 1-4
                t1 = time.perf_counter()
                if made.fault is not None:
                    optimizer_step(self.optim, step + 1, made.fault, schedule_steps=a.ppo_epochs * a.num_minibatches)
                    update = Update({}, None, made.fault)
                else:
                    update = self.update(made.experience, step + 1)  # 5
                stats, kl, seq_kl = dict(made.stats), made.kl, made.experience.kl if made.experience else None
                if update.old_logprobs is not None:  # π_old came from the update's forward: its figures now
                    figures = self.maker.policy_figures(made.experience, update.old_logprobs)
                    stats.update(figures.stats)
                    kl, seq_kl = figures.kl, figures.seq_kl
                if update.fault is None and kl is not None:  # 6. β follows the KL over every process (adaptive)
                    self.kl_ctl.update(kl, made.experience.rollout.response_ids.shape[0] * run.world)
                stats.update(update.metrics, lr=lr, episodes=(step + 1) * a.rollout_batch_size
                             * self.cfg.generation.num_samples * run.world,
                             **{"faults/skipped_total": self.optim.bad_steps, "time/rollout_s": t1 - t0,
                                "time/update_s": time.perf_counter() - t1})
                if self.ref_sync is not None:
                    self.ref_sync.after_step(step + 1, run.unwrap(self.model))
                self.end_step(step + 1, made, stats, update.fault is not None, seq_kl)
                if run.stopping:  # a callback stopped the run (end_step wrote its checkpoint)
                    break
            run.finish(self.model, run.unwrap(self.model), self.tokenizer)
            return self.log.last

    def end_step(self, done: int, made: Made, stats: dict[str, float], bad: bool, seq_kl) -> None:
        exp = made.experience
        samples = Samples(exp.rollout, [e["prompt"] for e in made.examples], exp.scores, seq_kl, made.extras) \
            if exp is not None else None
        self.log.record(done, stats, samples, lambda: self.held_out(done, self.model, self.ref, self.reward, self.total_steps))
        self.log.checkpoint(done, bad, lambda: policy_is_finite(self.run, self.model, exp.rollout, self.cfg.optim.per_device_batch_size,
                                                                self.cfg.generation.temperature), self.checkpoint)

    # Checkpoints -----------------------------------------------------------------------------------------------------
    def trained_models(self) -> list:
        """The policy, and a critic that is a model of its own (a shared-base critic's adapter is in the policy)."""
        return [self.model] + ([self.value] if self.value is not None and not self.shares_base else [])

    def save_models(self, directory: str, models: list) -> None:
        from rlhfkit.models import save_model

        save_model(models[0], self.tokenizer, directory, merge_lora=False)
        if self.ref_sync is not None:
            self.ref_sync.save(directory, self.tokenizer)
        value_dir = os.path.join(os.path.dirname(directory), "value_model")
        if self.shares_base:
            self.run.unwrap(self.value).save(value_dir)
        elif self.value is not None:
            save_model(models[1], self.tokenizer, value_dir, merge_lora=False)

    def load_models(self, checkpoint: str) -> None:
        from rlhfkit.checkpoint import load_model_weights
        from rlhfkit.sharding import loaded_weights

        if self.ref_sync is not None:
            self.ref_sync.load(checkpoint)
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
        if self.entropy_ctl is not None:
            extra["entropy_controller"] = json.dumps(self.entropy_ctl.state_dict())
        self.run.save_checkpoint(step, self.trained_models(), self.save_models, self.optim, extra)
