"""What the online loops (PPO/RLOO/GRPO/REINFORCE++ in `trainers.online`, online DPO in `trainers.online_dpo`) share,
as services each calls — not a base class either inherits (nanochat's and torchtune's recipes):

- `load_online_data`: tokenizer, prompts, held-out prompts, capability texts and PPO-ptx records, read once;
- `PromptStream`: this process's prompts of each step, a function of the step alone (resume needs no loader state);
- `StepLog`: what is done after each step — metrics, held-out evaluation, console table, alarms, samples — and the
  checkpoint, skipped after a bad step or when the updated policy's log-probs are not finite.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Callable

import torch

from rlhfkit.config import OnlineConfig
from rlhfkit.data import collate_prompts
from rlhfkit.trainers.dynamic_sampling import refill_order
from rlhfkit.evaluation.alarms import AlarmThresholds, check_alarms
from rlhfkit.io import read_jsonl_rows
from rlhfkit.models import rollout_logprobs
from rlhfkit.objects import Objects
from rlhfkit.reward_functions import extra_columns
from rlhfkit.trainers.held_out import capability_set
from rlhfkit.trainers.ptx import load_ptx_set
from rlhfkit.trainers.run import Run
from rlhfkit.types import PromptBatch, Rollout

logger = logging.getLogger("rlhfkit")
TABLE = [("Step", "step"), ("Reward", "objective/scores"), ("KL", "objective/kl"), ("ClipFrac", "policy/clipfrac_avg"),
         ("ValueLoss", "loss/value_avg"), ("PolicyLoss", "loss/policy_avg"), ("LR", "lr")]


@dataclass(frozen=True)
class OnlineData:
    """What an online run reads before its models load."""

    tokenizer: object
    train_set: object  # the prompt examples (`data.build_datasets("prompt", ...)`)
    eval_prompts: object  # held-out prompt examples, or None
    capability: list[dict]  # reference texts of the alignment tax (`data.capability`), or []
    ptx_set: list[dict] | None  # PPO-ptx records (`data.ptx`), or None


def load_online_data(cfg: OnlineConfig, objects: Objects) -> OnlineData:
    """The tokenizer (the policy's structure checked from its config) and every data set of the run; one process
    tokenises into the cache, the others then read it."""
    from rlhfkit.data import build_datasets
    from rlhfkit.launch import distributed_state
    from rlhfkit.models import check_model_structure, load_tokenizer
    from rlhfkit.rollout.maker import check_prompt_room, check_row_tools

    with distributed_state().main_process_first():
        tokenizer = load_tokenizer(cfg.model, given=objects.tokenizer)
        check_model_structure(cfg.model, tokenizer, given=objects.model)
        train_set, eval_prompts = build_datasets("prompt", cfg.data, tokenizer, cfg.seed)
        check_row_tools(objects.toolbox, train_set, cfg.data.train)  # a record's own tools: registered ones only
        check_row_tools(objects.toolbox, eval_prompts or [], cfg.data.eval or cfg.data.train)
        for examples, source in ((train_set, cfg.data.train), (eval_prompts or [], cfg.data.eval or cfg.data.train)):
            check_prompt_room(objects.toolbox, tokenizer, examples, cfg.data.max_prompt_length, source)
        return OnlineData(tokenizer, train_set, eval_prompts, capability_set(cfg, tokenizer), load_ptx_set(cfg, tokenizer))


class PromptStream:
    """This process's prompts for each step: `rollout_batch_size` of them, the run's order a function of the step
    (`Run.step_indices`)."""

    def __init__(self, run: Run, train_set, rollout_batch_size: int, pad_token_id: int):
        self.run, self.train_set, self.per_process, self.pad_token_id = run, train_set, rollout_batch_size, pad_token_id
        self.steps_per_epoch = max(1, math.ceil(len(train_set) / (rollout_batch_size * run.world)))

    def __call__(self, step: int) -> tuple[PromptBatch, list[dict]]:
        """(left-padded prompts, their dataset examples) of `step` (0-based) on this process."""
        per_step = self.per_process * self.run.world
        return self.mine(self.run.step_indices(step, len(self.train_set), per_step, self.steps_per_epoch))

    def candidates(self, step: int, round_: int) -> tuple[PromptBatch, list[dict]]:
        """This process's refill candidates of dynamic sampling's round `round_` of `step`, one per slot
        (`trainers.dynamic_sampling.refill_order`): a function of (seed, step, round), not of the epoch's order."""
        per_step = self.per_process * self.run.world
        return self.mine(refill_order(self.run.cfg.seed, step, round_, len(self.train_set), per_step))

    def mine(self, indices: list[int]) -> tuple[PromptBatch, list[dict]]:
        """This process's share of a step's global `indices` (process p takes the p-th block), collated."""
        run = self.run
        order = torch.tensor(indices)
        examples = [self.train_set[i] for i in order.view(run.world, -1)[run.accelerator.process_index].tolist()]
        return collate_prompts(examples, self.pad_token_id), examples


def total_steps_of(cfg, steps_per_epoch: int) -> int:
    return cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_epochs * steps_per_epoch)


@dataclass(frozen=True)
class Samples:
    """A step's rows as the samples file shows them (B rows): the rollout (its decoded text), each row's prompt as the
    dataset holds it, its raw score, its sequence KL (None without a reference) and its `log_extra` columns."""

    rollout: Rollout
    prompts: list
    scores: torch.Tensor  # (B,)
    kl: torch.Tensor | None  # (B,)
    extras: dict[str, list]


def prompt_text(prompt) -> str:
    """A prompt as one line of text: the string, or a message list as "role: content" lines (never decoded again)."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.get('role')}: {m.get('content') or ''}" for m in prompt)


class StepLog:
    """After each online step: metrics, evaluation when due, the console table, the alarms, samples, checkpoint."""

    def __init__(self, run: Run, cfg, held_out, total_steps: int, start_step: int):
        self.run, self.cfg, self.held_out, self.total_steps, self.start_step = run, cfg, held_out, total_steps, start_step
        self.history, self.raised = self.logged_rows(), set()  # the run's rows so far, for the alarms
        self.last: dict[str, float] = {}

    def logged_rows(self) -> list[dict]:
        """The rows a resumed run logged before its checkpoint (null = NaN), so the alarms see the whole run."""
        path = os.path.join(self.cfg.output_dir, "metrics.jsonl")
        if not (self.run.resume_from and os.path.isfile(path)):
            return []
        return [{k: math.nan if v is None else v for k, v in row.items()} for row in read_jsonl_rows(path)]

    def record(self, done: int, stats: dict[str, float], samples: Samples | None, evaluate: Callable[[], dict]) -> None:
        """Log step `done` (1-based); run the held-out evaluation (`evaluate()`) when due; the table, the alarms and
        the samples."""
        cfg, log, run = self.cfg, self.cfg.logging, self.run
        self.last = stats
        run.step_end(done, {k: stats[key] for k, key in (("reward", "objective/scores"), ("kl", "objective/kl")) if key in stats})
        if done % log.logging_steps == 0 or done == self.total_steps:
            run.log(done, stats)
        self.history.append({"step": done, **stats})
        evaluated = self.held_out.due(done, done == self.total_steps)
        if evaluated:  # logged as its own row of the step, before the step's checkpoint
            figures = evaluate()
            self.history.append({"step": done, **figures})
            self.last = {**stats, **figures}
        main = run.accelerator.is_main_process
        if main and (done % log.table_steps == 0 or done == self.total_steps):
            run.write(table_row(done, stats, header=done <= log.table_steps or done == self.start_step + 1))
        if main and (done % log.table_steps == 0 or done == self.total_steps or evaluated):
            for alarm in check_alarms(self.history, thresholds=AlarmThresholds(alignment_tax_nats=cfg.alarms.alignment_tax_nats)):
                if alarm.name not in self.raised:
                    self.raised.add(alarm.name)
                    logger.warning("alarm %s at step %d: %s", alarm.name, done, alarm.message)
        if samples is not None and (done % log.sample_log_steps == 0 or done == 1 or done == self.total_steps):
            run.log_samples(done, sample_rows(samples))

    def checkpoint(self, done: int, bad: bool, finite: Callable[[], bool], save: Callable[[int], None]) -> None:
        """`save(done)` when a checkpoint is due, unless the step was bad or the updated policy is not finite
        (`finite()`, collective): the weights may be what made it so, and the last good checkpoint stays the newest."""
        if not self.run.checkpoint_due(done, self.total_steps):
            return
        if bad:
            logger.warning("step %d: no checkpoint after a skipped step", done)
        elif not finite():
            logger.warning("step %d: no checkpoint: the updated policy's log-probs are not finite", done)
        else:
            save(done)


def table_row(step: int, m: dict, header: bool) -> str:
    """One row of the console table (critic-free methods show "-" for the value loss)."""
    cells = [f"{step:>6d}"] + [f"{m[key]:>10.4g}" if key in m else f"{'-':>10}" for _, key in TABLE[1:]]
    head = " | ".join([f"{TABLE[0][0]:>6}"] + [f"{name:>10}" for name, _ in TABLE[1:]])
    return f"{head}\n{' | '.join(cells)}" if header else " | ".join(cells)


def sample_rows(s: Samples, n: int = 4) -> list[dict]:
    """The first `n` rows of a step, with the text its rollout component decoded."""
    texts = s.rollout.texts
    if texts is None:
        raise ValueError("a rollout component returns its completions decoded (Rollout.texts)")
    return [{"prompt": prompt_text(s.prompts[i]), "response": texts[i], "score": float(s.scores[i]),
             "kl": float(s.kl[i]) if s.kl is not None else None, **extra_columns(s.extras, i)}
            for i in range(min(n, len(texts)))]


@torch.no_grad()
def policy_is_finite(run: Run, model, rollout: Rollout, micro: int, temperature: float) -> bool:
    """Whether the policy, as updated, still gives finite log-probs on a micro-batch of this step's rollout (one
    no-grad forward, before a checkpoint: weights that blew up can be finite while every output is inf/NaN).
    Collective."""
    policy = run.unwrap(model)
    policy.eval()
    logprobs = rollout_logprobs(policy, rollout.select(slice(0, micro)), temperature)
    return run.on_every_process(bool(torch.isfinite(logprobs).all()))
