"""KTO (Ethayarajh et al. 2024, arXiv 2402.01306) on unpaired completions labelled desirable or undesirable.

Each step: the reference point z0 first, from mismatched (prompt, other completion) pairs through the policy WITHOUT
gradient, as TRL 1.16's `KTOTrainer._compute_kl_logprobs` does (z0 is detached in the loss anyway, so a graph would
only cost memory), and through the reference; then the completions through the policy (with gradient) and the
reference. z0 is ONE estimate per optimizer step over its whole global batch: each example is paired with the next
example's completion in the step's global order, every process computes its own rows' pairs and the sums are added
over processes. So the pairs, z0 and the loss do not depend on how the global batch is split into micro-batches and
processes: 2 processes × B equal 1 × 2B and B × 2 accumulation steps (TRL estimates z0 per micro-batch, averaged
over processes). Evaluation uses one z0 over the whole eval set, paired the same way (example i with example i + 1).

Logged metrics: `loss`, `kl` (z0), `rewards/chosen` and `logps/chosen` (means over desirable rows),
`rewards/rejected` and `logps/rejected` (over undesirable rows), `rewards/margins` (their difference, as TRL logs it)
and `rewards/accuracies` (rlhfkit's: the fraction of rows whose implicit reward β·r lies on the label's side of β·z0,
i.e. whose KTO value is positive). Class means are exact over a step's micro-batches and processes and over the whole
eval set; a training step holding no row of a class logs 0 for that class. A class absent from the training set
(one-label data, warned at setup) is not logged at all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from rlhfkit.config import KTOConfig
from rlhfkit.data import collate_unpaired
from rlhfkit.losses.kto import kto_loss
from rlhfkit.models import Reference, disable_dropout, load_causal_lm, sequence_logprobs
from rlhfkit.trainers.offline import OfflineTrainer, micro_batch_positions
from rlhfkit.trainers.processes import sums_by_name
from rlhfkit.types import UnpairedBatch

logger = logging.getLogger("rlhfkit")

CLASSES = {"chosen": True, "rejected": False}  # metric suffix -> label


@dataclass
class UnpairedWithZ0(UnpairedBatch):
    """An UnpairedBatch with the reference point of the set it belongs to (the step's global batch, the eval set)."""

    z0: torch.Tensor | None = None  # () mean log π(y'|x) − log π_ref(y'|x) over that set's mismatched pairs


def next_partners(examples: list[dict]) -> list[dict]:
    """KTO's mismatched partner of each example: the next one, cyclically (`collate_unpaired`'s in-batch pairing, over
    a whole set)."""
    return examples[1:] + examples[:1]


class KTOTrainer(OfflineTrainer):
    kind = "unpaired"
    cfg: KTOConfig

    def load_model(self, tokenizer):
        policy = load_causal_lm(self.cfg.model, tokenizer, given=self.objects.model)
        if getattr(self.cfg.algo, "disable_dropout", False):
            disable_dropout(policy)
        with torch.random.fork_rng(devices=[]):  # loading the reference leaves the RNG as it was
            self.reference = Reference(self.cfg.model, self.cfg.algo.ref_model, policy, tokenizer, self.accelerator.device,
                                           self.run.frozen_dtype, copy_of=self.objects.model)
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

    def collate(self, examples, partners=None) -> UnpairedBatch:
        return collate_unpaired(examples, self.tokenizer.pad_token_id, partners)

    def micro_batches(self, step: int) -> list[UnpairedWithZ0]:
        """This process's micro-batches of step `step`, each example paired with the next one of the step's global
        batch, with the step's z0 (the same on every process)."""
        order, positions = micro_batch_positions(self.run, step, len(self.train_set), self.steps_per_epoch)
        examples = [self.train_set[i] for i in order]  # the global batch
        partners = next_partners(examples)
        batches = [self.collate([examples[p] for p in mine], [partners[p] for p in mine]) for mine in positions]
        z0 = self.reference_point(batches)
        return [UnpairedWithZ0(**vars(b), z0=z0) for b in batches]

    def eval_batches(self):
        """(batch, counted) for each of the base's `eval_chunks`, each example paired with the next one of the eval
        set, with one z0 over the whole eval set (filler batches run in it too, uncounted)."""
        n = len(self.eval_set)
        chunks = self.eval_chunks()

        def batch(chunk: list[int]) -> UnpairedBatch:
            return self.collate([self.eval_set[i] for i in chunk], [self.eval_set[(i + 1) % n] for i in chunk])

        z0 = self.reference_point([batch(c) for c, _ in chunks], [counted for _, counted in chunks])
        return ((UnpairedWithZ0(**vars(batch(c)), z0=z0), counted) for c, counted in chunks)

    @torch.no_grad()
    def reference_point(self, batches, counted: list[bool] | None = None) -> torch.Tensor:
        """KTO's z0 before clamping: the mean of log π(y'|x) − log π_ref(y'|x) over the mismatched rows of `batches`
        (those that count: all, or where `counted` says so) and of every other process's batches (a collective:
        every process calls it, with or without rows)."""
        acc = self.accelerator
        policy = self.run.unwrap(self.model)
        sums = {"log_ratio": torch.zeros((), device=acc.device), "rows": 0.0}
        for i, b in enumerate(batches):
            b = b.to(acc.device)
            with acc.autocast():
                logprobs, _ = sequence_logprobs(policy, b.kl_input_ids, b.kl_attention_mask, b.kl_labels)  # (B,)
                ref_logprobs = self.reference.sequence_logprobs(policy, b.kl_input_ids, b.kl_attention_mask, b.kl_labels)
            if counted is None or counted[i]:
                sums = {"log_ratio": sums["log_ratio"] + (logprobs.float() - ref_logprobs.float()).sum(),
                        "rows": sums["rows"] + len(logprobs)}
        (total,) = sums_by_name(self.run, sums)
        return torch.tensor(total["log_ratio"] / max(total["rows"], 1.0), device=acc.device)

    def count(self, batch: UnpairedBatch) -> int:
        return batch.input_ids.shape[0]

    def compute_loss(self, model, batch: UnpairedWithZ0, num_items: float):
        policy = self.run.unwrap(model)
        # 1. Completions through the policy (with gradient) and the reference; z0 came with the batch.
        logprobs, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.labels)  # (B,)
        with self.accelerator.autocast():
            ref_logprobs = self.reference.sequence_logprobs(policy, batch.input_ids, batch.attention_mask, batch.labels)
        algo = self.cfg.algo
        loss, m = kto_loss(
            logprobs, ref_logprobs, batch.desirable, None, None, beta=algo.beta, desirable_weight=algo.desirable_weight,
            undesirable_weight=algo.undesirable_weight, z0=batch.z0,
        )
        # 2. Metrics. Per-class sums are divided by B here and by the class fraction in `class_means`, so the base's
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
