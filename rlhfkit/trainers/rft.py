"""Best-of-n / rejection-sampling fine-tuning (`rlhfkit rft`), iterated for iterative RLHF.

Each iteration is the loop of RAFT (Dong et al. 2023, arXiv 2304.06767) and of ReST's Grow/Improve steps
(Gulcehre et al. 2023, arXiv 2308.08998), with best-of-n as the filter:
  1. sample n = `generation.num_samples` responses per prompt from the current policy (`generation.generate`);
  2. score them (reward model(s) or a Python function, as the online stages do: one call per sampling batch, with
     the prompt records) and keep the best per prompt, dropping prompts whose best scores below `algo.min_score`;
  3. write the kept rows to `rft_iter{i}.jsonl`, log the scores and the analytic KL of best-of-n sampling to
     the policy sampled, log n − (n − 1)/n (Stiennon et al. 2020, arXiv 2009.01325; an upper bound, Beirami
     et al. 2024, arXiv 2401.01879);
  4. fine-tune on the kept rows with the SFT loss on completion tokens (the offline loop's `train_step`).
The next iteration samples from the fine-tuned policy. Scores include `reward.missing_eos_penalty` (subtracted).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time


from rlhfkit.checkpoint import load_model_weights
from rlhfkit.config import RFTConfig
from rlhfkit.data import IGNORE_INDEX, build_datasets, collate_sft
from rlhfkit.evaluation.alarms import AlarmThresholds, check_alarms
from rlhfkit.io import atomic_write_text, read_jsonl_rows
from rlhfkit.losses.sft import sft_loss
from rlhfkit.models import Reference, load_causal_lm, save_model, scored_logits
from rlhfkit.objects import Objects
from rlhfkit.rewards import Rewards
from rlhfkit.sharding import loaded_weights
from rlhfkit.rollout.single_turn import SingleTurn
from rlhfkit.trainers.best_of_n import BestOfN
from rlhfkit.trainers.sampling import Sampling
from rlhfkit.trainers.held_out import HeldOutEval, capability_set
from rlhfkit.trainers.offline import micro_batch_positions, train_step
from rlhfkit.trainers.optim import build_optimizer, build_scheduler
from rlhfkit.trainers.run import Run
from rlhfkit.types import SFTBatch

logger = logging.getLogger("rlhfkit")


class RFTTrainer:
    """Best-of-n fine-tuning: the loop of iterations is its own; step 4 is the offline loop's `train_step` on the
    SFT loss over completion tokens."""

    cfg: RFTConfig

    def __init__(self, cfg: RFTConfig, objects: Objects | None = None):
        """`objects`: what the Python API was given (`rlhfkit.train`): model, tokenizer, reward sources and
        TrainerCallbacks. A callback's stop ends the run after the current SFT step, and its checkpoint request is met
        there, as `logging.save_steps` is: a checkpoint inside an iteration resumes at its next SFT step."""
        self.cfg, self.objects = cfg, objects or Objects()
        self.run = Run(cfg, "rft", self.objects.callbacks)  # the lock taken and output_dir checked, before anything loads

    def collate(self, examples) -> SFTBatch:
        return collate_sft(examples, self.tokenizer.pad_token_id)

    # The SFT loss on completion tokens (step 4), as `rlhfkit sft` computes it.
    def count(self, batch: SFTBatch) -> int:
        return int((batch.labels[:, 1:] != IGNORE_INDEX).sum())

    def compute_loss(self, model, batch: SFTBatch, num_items: float):
        logits, first = scored_logits(model, batch.input_ids, batch.attention_mask, batch.labels)  # (B, T-first, V)
        return sft_loss(logits, batch.labels[:, first:], num_tokens=num_items)

    # 0. Models, data, reward ------------------------------------------------------------------------------------
    def setup(self) -> None:
        from accelerate.utils import set_seed

        from rlhfkit.launch import distributed_state
        from rlhfkit.models import check_model_structure, load_tokenizer

        cfg, run, acc = self.cfg, self.run, None
        set_seed(cfg.seed)
        with distributed_state().main_process_first():  # one process tokenises into the cache; the others then read it
            self.tokenizer = load_tokenizer(cfg.model, given=self.objects.tokenizer)
            check_model_structure(cfg.model, self.tokenizer, given=self.objects.model)
            self.prompts, eval_prompts = build_datasets("prompt", cfg.data, self.tokenizer, cfg.seed)
            capability = capability_set(cfg, self.tokenizer)
        acc = self.accelerator = run.make_accelerator()
        self.world = run.world
        set_seed(cfg.seed)
        policy = load_causal_lm(cfg.model, self.tokenizer, given=self.objects.model)
        self.held_out = HeldOutEval(run, cfg, self.tokenizer, eval_prompts, capability, cfg.algo.sampling_batch_size)
        # The evaluation's reference is the starting policy: with LoRA its base, else a frozen copy.
        self.ref = Reference(cfg.model, None, policy, self.tokenizer, acc.device, run.frozen_dtype,
                             copy_of=self.objects.model) if self.held_out.enabled else None
        self.held_out.check_reference(self.ref)
        self.reward = Rewards(cfg.reward, self.tokenizer, acc.device, batch_size=cfg.optim.per_device_batch_size,
                              policy_name=cfg.model.name_or_path, dtype=run.frozen_dtype,
                              given=self.objects.reward_funcs, given_weights=self.objects.reward_weights,
                              attn_implementation=cfg.model.attn_implementation)
        self.per_iteration = min(cfg.algo.prompts_per_iteration or len(self.prompts), len(self.prompts))
        # Every prompt kept is the most each iteration can train on: the schedule's length is an upper bound.
        self.total_steps = cfg.algo.iterations * self.sft_steps(self.per_iteration)
        optimizer = build_optimizer(policy, cfg)
        scheduler = build_scheduler(optimizer, cfg, self.total_steps)
        self.model, optimizer = acc.prepare(policy, optimizer)
        self.optim = run.make_optim(optimizer, scheduler, [self.model])
        parts = Sampling(SingleTurn(self.tokenizer, cfg.generation, cfg.seed), self.reward, None, run,
                         cfg.optim.per_device_batch_size, cfg.generation.temperature)
        self.best_of_n = BestOfN(parts, cfg, self.prompts, self.per_iteration, self.total_steps)
        self.start_step = self.start_iteration = 0
        self.resumed = None  # a checkpoint inside an iteration: its trainer state, which `resume_iteration` continues
        self.metrics, self.evaluations, self.raised = {}, [], set()  # what `checkpoint` carries over
        if run.resume_from:
            state = run.resume([self.model], self.load_models, self.optim)
            self.start_step, self.start_iteration = int(state["step"]), int(state["iteration"])
            self.metrics = json.loads(state.get("metrics", "{}"))
            self.evaluations, self.raised = json.loads(state.get("evaluations", "[]")), set(state.get("alarms", []))
            self.resumed = state if "sft_step" in state else None
            run.restore_rng(state)

    def load_models(self, checkpoint: str) -> None:
        model_dir = os.path.join(checkpoint, "model")
        loaded_weights(self.accelerator, self.model, lambda m: load_model_weights(m, model_dir), self.run.unwrap(self.model))

    def save_models(self, directory: str, models: list) -> None:
        save_model(models[0], self.tokenizer, directory, merge_lora=False)

    def trim_metrics(self) -> None:
        """On resume from an iteration's end: the next iteration's row and kept samples were logged at the checkpoint's
        own step, which `RunDir.prepare` keeps, and the resumed run logs them again. (Inside an iteration, its own row
        and samples stay: the resumed run does not sample it again.) Before `Run.begin`, so that the callbacks'
        `state.log_history` holds the rows as they stay."""
        if self.run.resume_from and self.accelerator.is_main_process:
            kept = self.start_iteration + (self.resumed is not None)  # the 1-based number of the last iteration kept
            for name, key in (("metrics.jsonl", "rft/iteration"), ("samples.jsonl", "iteration")):
                path = os.path.join(self.cfg.output_dir, name)
                if os.path.isfile(path):
                    rows = [r for r in read_jsonl_rows(path) if r.get(key, 0) <= kept]
                    atomic_write_text(path, "".join(json.dumps(r, allow_nan=False) + "\n" for r in rows))

    def sft_steps(self, num_examples: int) -> int:
        """Optimizer steps of one iteration's SFT on `num_examples`: max_steps, or num_epochs passes over them.
        Sets `steps_per_epoch`, which `micro_batches` reads."""
        o = self.cfg.optim
        self.steps_per_epoch = max(1, math.ceil(num_examples / (o.per_device_batch_size * self.world * o.grad_accum_steps)))
        return self.cfg.max_steps if self.cfg.max_steps > 0 else math.ceil(self.cfg.num_epochs * self.steps_per_epoch)

    def micro_batches(self, k: int) -> list[SFTBatch]:
        """This process's micro-batches of the iteration's SFT step `k` (0-based, from 0 each iteration)."""
        order, positions = micro_batch_positions(self.run, k, len(self.train_set), self.steps_per_epoch)
        return [self.collate([self.train_set[order[p]] for p in mine]) for mine in positions]

    # 4. Fine-tune, log, checkpoint ----------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        with self.run as run:
            self.setup()
            self.trim_metrics()
            run.begin(self.start_step, self.total_steps)
            cfg, step, last = self.cfg, self.start_step, self.metrics
            self.evaluated_at = None
            for iteration in range(self.start_iteration, cfg.algo.iterations):
                if self.resumed is not None:  # resumed inside this iteration: its samples were kept before the stop
                    first, window = self.resume_iteration()
                elif self.sample_and_keep(iteration, step, last):
                    first, window = 0, []
                else:
                    continue
                step = self.fine_tune(iteration, step, last, first, window)
                if run.stopping:
                    break
            if step != self.evaluated_at and self.held_out.due(step, last=True):  # the end, unless its last step just was
                self.evaluate(step, last)
            run.finish(self.model, run.unwrap(self.model), self.tokenizer)
            return last

    def sample_and_keep(self, iteration: int, step: int, last: dict) -> bool:
        """1-3. Sample n per prompt, keep the best (`train_set`), log the iteration; whether anything was kept."""
        self.train_set, stats, self.samples = self.best_of_n(self.model, iteration, step)
        self.run.log(step, stats)
        self.run.log_samples(step, self.samples)
        last.update(stats)
        self.run.write(f"iteration {iteration + 1}: " + ", ".join(
            f"{k.split('/')[-1]}={v:.4g}" for k, v in stats.items() if k != "rft/iteration"))
        if not self.train_set:
            logger.warning("iteration %d: no prompt's best sample reached algo.min_score=%s; nothing to fine-tune on",
                           iteration + 1, self.cfg.algo.min_score)
        return bool(self.train_set)

    def resume_iteration(self) -> tuple[int, list[dict]]:
        """The iteration a checkpoint interrupted: its kept examples back into `train_set`; returns the SFT step to
        continue from (0-based, within the iteration) and the partial logging window."""
        state, self.resumed = self.resumed, None
        self.train_set = [{"input_ids": ids, "labels": labels} for ids, labels in zip(state["input_ids"], state["labels"])]
        return int(state["sft_step"]), json.loads(state["log_window"])

    def evaluate(self, step: int, last: dict) -> None:
        """The held-out evaluation after SFT step `step` (`trainers.held_out`); its alignment-tax alarm."""
        figures = self.held_out(step, self.model, self.ref, self.reward, self.total_steps)
        self.evaluated_at = step
        last.update(figures)
        self.evaluations.append({"step": step, **figures})
        thresholds = AlarmThresholds(alignment_tax_nats=self.cfg.alarms.alignment_tax_nats)
        for alarm in check_alarms(self.evaluations, thresholds=thresholds) if self.accelerator.is_main_process else []:
            if alarm.name not in self.raised:
                self.raised.add(alarm.name)
                logger.warning("alarm %s at step %d: %s", alarm.name, step, alarm.message)

    def fine_tune(self, iteration: int, step: int, last: dict, first: int = 0, window: list[dict] | None = None) -> int:
        """4. SFT on the kept samples (each iteration's data order seeded by its own step numbers from 0), from its
        step `first` with the logging window `window` (a resume inside the iteration); returns the run's step count
        after it."""
        n_steps, window, t0 = self.sft_steps(len(self.train_set)), window or [], time.time()
        for k in range(first, n_steps):
            window.append(train_step(self.run, self.optim, self.model, self.micro_batches(k), self.count,
                                     self.compute_loss, step + 1))
            step += 1
            self.run.step_end(step, {"loss": window[-1]["loss"]})
            if self.held_out.due(step, last=False):
                self.evaluate(step, last)
            if step % self.cfg.logging.logging_steps == 0 or k == n_steps - 1:
                last.update({key: sum(m[key] for m in window) / len(window) for key in window[0]})
                self.run.log(step, {**{key: last[key] for key in window[0]}, "rft/iteration": iteration + 1,
                                    "elapsed_s": time.time() - t0})
                window = []
            # checkpoint_due on every process alike (a collective), every step: it also sets `run.stopping`.
            if self.run.checkpoint_due(step, self.total_steps) or (k == n_steps - 1 and self.cfg.logging.save_steps):
                self.checkpoint(step, iteration, k + 1, n_steps, window, last)
            if self.run.stopping:
                break
        return step

    def checkpoint(self, step: int, iteration: int, done: int, n_steps: int, window: list[dict], last: dict) -> None:
        """checkpoint-{step}, after SFT step `done` of the `n_steps` of `iteration`. At the iteration's end, resuming
        starts with the next iteration's sampling; inside it, the checkpoint also holds the iteration's kept examples
        (the samples cannot be drawn again: the policy has moved), its SFT step and the partial logging window, and
        resuming goes on with the next SFT step as if the run had never stopped. None after the last iteration: the
        run's final model follows. The last metrics and the evaluations (the alignment-tax alarm's history) travel
        along, so a resumed run returns and alarms as the whole run would."""
        if done == n_steps and iteration + 1 == self.cfg.algo.iterations:
            return
        extra = {"metrics": json.dumps(last), "evaluations": json.dumps(self.evaluations),
                 "alarms": sorted(self.raised)}
        if done == n_steps:
            extra["iteration"] = iteration + 1
        else:  # trainer_state.pt holds lists, not the examples' dicts (see rlhfkit.checkpoint)
            extra.update(iteration=iteration, sft_step=done, log_window=json.dumps(window),
                         input_ids=[e["input_ids"] for e in self.train_set],
                         labels=[e["labels"] for e in self.train_set])
        self.run.save_checkpoint(step, [self.model], self.save_models, self.optim, extra)
