"""KTO (Ethayarajh et al. 2024, arXiv 2402.01306) on unpaired completions labelled desirable or undesirable.

Each step: the completions through the policy (with gradient); the mismatched (prompt, other completion) pairs that
estimate the reference point z0 through the policy WITHOUT gradient, as TRL 1.16's `KTOTrainer._compute_kl_logprobs`
does (z0 is detached in the loss anyway, so a graph would only cost memory); both through the reference under no_grad.
z0 is estimated per micro-batch (TRL averages it over processes; see `kto_loss`).

Logged metrics: `loss`, `kl` (z0), `rewards/chosen` and `logps/chosen` (means over desirable rows),
`rewards/rejected` and `logps/rejected` (over undesirable rows), `rewards/margins` (their difference, as TRL logs it)
and `rewards/accuracies` (rlhfkit's: the fraction of rows whose implicit reward β·r lies on the label's side of β·z0,
i.e. whose KTO value is positive). Class means are exact over a step's micro-batches and processes and over the whole
eval set; a training step holding no row of a class logs 0 for that class. A class absent from the training set
(one-label data, warned at setup) is not logged at all.
"""

from __future__ import annotations

import logging

import torch

from rlhfkit.config import KTOConfig
from rlhfkit.data import collate_unpaired
from rlhfkit.losses.kto import kto_loss
from rlhfkit.models import Reference, load_causal_lm, sequence_logprobs
from rlhfkit.trainers.base import Trainer
from rlhfkit.types import UnpairedBatch

logger = logging.getLogger("rlhfkit")

CLASSES = {"chosen": True, "rejected": False}  # metric suffix -> label


class KTOTrainer(Trainer):
    kind = "unpaired"
    cfg: KTOConfig

    def load_model(self, tokenizer):
        policy = load_causal_lm(self.cfg.model, tokenizer)
        with torch.random.fork_rng(devices=[]):  # loading the reference leaves the RNG as it was
            self.reference = Reference(self.cfg.model, self.cfg.algo.ref_model, policy, tokenizer, self.accelerator.device)
        return policy

    def setup(self) -> None:
        super().setup()
        self.classes = self.check_labels()

    def check_labels(self) -> list[str]:
        """Warn about one-label data (the loss stays defined: z0 still anchors it) and, like TRL, about class weights
        outside the paper's advice; return the metric suffixes of the classes present in the training set."""
        algo, source = self.cfg.algo, self.cfg.data.train
        n_desirable = sum(e["desirable"] for e in self.train_set)
        n_undesirable = len(self.train_set) - n_desirable
        if not n_desirable or not n_undesirable:
            present, missing = ("desirable", "undesirable") if n_desirable else ("undesirable", "desirable")
            logger.warning(
                f"{source}: all {len(self.train_set)} examples are {present}: KTO only pushes them "
                f"{'above' if n_desirable else 'below'} the reference point z0, and nothing is logged for {missing} "
                f"rows; add {missing} examples (label {str(not n_desirable).lower()}) for the full KTO objective"
            )
            return ["chosen" if n_desirable else "rejected"]
        ratio = algo.desirable_weight * n_desirable / (algo.undesirable_weight * n_undesirable or 1e-12)
        if not 1 / 1.1 <= ratio <= 4 / 3 * 1.1:  # 10% slack: near-balanced data with unit weights stays quiet
            low = algo.undesirable_weight * n_undesirable / n_desirable
            logger.warning(
                f"{source}: desirable_weight·n_desirable / (undesirable_weight·n_undesirable) = {ratio:.2f} with "
                f"{n_desirable} desirable and {n_undesirable} undesirable examples; the KTO paper advises [1, 4/3], "
                f"e.g. algo.desirable_weight in [{low:.2f}, {low * 4 / 3:.2f}]"
            )
        if self.eval_set and len({e["desirable"] for e in self.eval_set}) < 2:
            logger.warning(f"{self.cfg.data.eval or source} (eval): every example has the same label")
        return list(CLASSES)

    def collate(self, examples) -> UnpairedBatch:
        if len(examples) > 1:
            return collate_unpaired(examples, self.tokenizer.pad_token_id)
        # A lone example (only the tail of the eval set: training batches are always full) has no mismatched partner
        # of its own; borrow another example's completion for the two KL rows and keep only its own main row.
        partner = next(e for e in self.train_set if e is not examples[0])
        pair = collate_unpaired([examples[0], partner], self.tokenizer.pad_token_id)
        return UnpairedBatch(
            input_ids=pair.input_ids[:1], attention_mask=pair.attention_mask[:1], labels=pair.labels[:1],
            desirable=pair.desirable[:1], kl_input_ids=pair.kl_input_ids, kl_attention_mask=pair.kl_attention_mask,
            kl_labels=pair.kl_labels,
        )

    def count(self, batch: UnpairedBatch) -> int:
        return batch.input_ids.shape[0]

    def compute_loss(self, model, batch: UnpairedBatch, num_items: float):
        policy = self.accelerator.unwrap_model(model)
        # 1. Completions through the policy (with gradient), mismatched pairs through it without.
        logprobs, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.labels)  # (B,)
        with torch.no_grad(), self.accelerator.autocast():
            kl_logprobs, _ = sequence_logprobs(policy, batch.kl_input_ids, batch.kl_attention_mask, batch.kl_labels)  # (B',)
        # 2. Both through the reference.
        with self.accelerator.autocast():
            ref_logprobs = self.reference.sequence_logprobs(policy, batch.input_ids, batch.attention_mask, batch.labels)
            ref_kl_logprobs = self.reference.sequence_logprobs(policy, batch.kl_input_ids, batch.kl_attention_mask, batch.kl_labels)
        algo = self.cfg.algo
        loss, m = kto_loss(
            logprobs, ref_logprobs, batch.desirable, kl_logprobs, ref_kl_logprobs, beta=algo.beta,
            desirable_weight=algo.desirable_weight, undesirable_weight=algo.undesirable_weight,
        )
        # 3. Metrics. Per-class sums are divided by B here and by the class fraction in `class_means`, so the base's
        # B-weighted averaging over micro-batches and processes yields exact class means.
        rewards = m["rewards/chosen"] + m["rewards/rejected"]  # (B,) β·r on every row
        correct = torch.where(batch.desirable, rewards > algo.beta * m["kl"], rewards < algo.beta * m["kl"])
        metrics = {"loss": loss.mean().detach(), "kl": m["kl"].mean(), "rewards/accuracies": correct.float().mean()}
        metrics["desirable_fraction"] = m["desirable_mask"].mean()
        for name in self.classes:
            metrics[f"rewards/{name}"] = m[f"rewards/{name}"].mean()
            metrics[f"logps/{name}"] = m[f"logps/{name}"].mean()
        return loss.sum() / num_items, metrics

    def class_means(self, metrics: dict[str, float], prefix: str = "") -> dict[str, float]:
        """Turn the B-weighted class sums of `compute_loss` into means over each class's rows."""
        fraction = metrics.pop(prefix + "desirable_fraction")
        for name in self.classes:
            share = fraction if CLASSES[name] else 1 - fraction
            for key in (f"{prefix}rewards/{name}", f"{prefix}logps/{name}"):
                metrics[key] = metrics[key] / share if share > 0 else 0.0
        if len(self.classes) == 2:
            metrics[f"{prefix}rewards/margins"] = metrics[f"{prefix}rewards/chosen"] - metrics[f"{prefix}rewards/rejected"]
        return metrics

    def train_step(self, step: int) -> dict[str, float]:
        return self.class_means(super().train_step(step))

    def evaluate(self) -> dict[str, float]:
        return self.class_means(super().evaluate(), prefix="eval/")
