"""Offline preference optimisation on chosen/rejected pairs: DPO, cDPO, IPO, hinge (SLiC), SimPO and ORPO.

One trainer for all of them: `rlhfkit dpo` (the method is `algo.loss_type`) and `rlhfkit orpo`. Each step runs chosen
and rejected through the policy in ONE forward ((2B, T), split back into halves). The reference log-probs come from
a frozen model under no_grad — with LoRA the policy's own base with its adapters disabled (no second copy), else a
second model (`algo.ref_model`, or the policy's starting weights) — or were computed once before training
(`algo.precompute_ref_logprobs`) and ride in the batch. SimPO and ORPO are reference-free: they load no reference model.
With `data.padding_free` the 2B sequences run as one row without padding (`PaddingFreePairs`): the same log-probs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from rlhfkit.config import DPOConfig, ORPOConfig, ORPOOptions
from rlhfkit.data import collate_preference, collate_preference_padding_free
from rlhfkit.losses.preference import orpo_loss, preference_loss, simpo_loss
from rlhfkit.objects import Objects
from rlhfkit.models import (Reference, disable_dropout, load_causal_lm, sequence_logprobs,
                            sequence_logprobs_padding_free)
from rlhfkit.trainers.offline import OfflineTrainer
from rlhfkit.trainers.ref_sync import RefSync
from rlhfkit.types import PaddingFreePairs, PreferenceBatch

logger = logging.getLogger("rlhfkit")

REFERENCE_FREE = ("simpo", "orpo")


@dataclass
class PairsWithRefs(PreferenceBatch):
    """A PreferenceBatch with the precomputed reference log-probs of its pairs (None when computed per step)."""

    ref_chosen_logprobs: torch.Tensor | None = None  # (B,)
    ref_rejected_logprobs: torch.Tensor | None = None  # (B,)


@dataclass
class PaddingFreePairsWithRefs(PaddingFreePairs):
    """`PairsWithRefs` in the padding-free layout."""

    ref_chosen_logprobs: torch.Tensor | None = None  # (B,)
    ref_rejected_logprobs: torch.Tensor | None = None  # (B,)


def concat_pairs(batch: PreferenceBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chosen rows then rejected rows: (2B, T) input_ids, attention_mask, labels — one forward for both."""
    return (
        torch.cat([batch.chosen_input_ids, batch.rejected_input_ids]),
        torch.cat([batch.chosen_attention_mask, batch.rejected_attention_mask]),
        torch.cat([batch.chosen_labels, batch.rejected_labels]),
    )


def pair_logprobs(model, batch: PreferenceBatch | PaddingFreePairs) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs of the response tokens and their counts, (2B,) each, chosen then rejected: one forward."""
    if isinstance(batch, PaddingFreePairs):
        return sequence_logprobs_padding_free(model, batch.sequences)
    return sequence_logprobs(model, *concat_pairs(batch))


class PreferenceTrainer(OfflineTrainer):
    kind = "preference"
    cfg: DPOConfig | ORPOConfig

    def __init__(self, cfg: DPOConfig | ORPOConfig, objects: Objects | None = None):
        super().__init__(cfg, objects)
        self.method = "orpo" if isinstance(cfg.algo, ORPOOptions) else cfg.algo.loss_type
        self.reference: Reference | None = None
        self.ref_sync: RefSync | None = None  # TR-DPO's reference sync (algo.sync_ref_model)

    def load_model(self, tokenizer):
        policy = load_causal_lm(self.cfg.model, tokenizer, given=self.objects.model)
        if getattr(self.cfg.algo, "disable_dropout", False):
            disable_dropout(policy)
        if self.method not in REFERENCE_FREE:
            with torch.random.fork_rng(devices=[]):  # loading the reference leaves the RNG as it was
                self.reference = Reference(self.cfg.model, self.cfg.algo.ref_model, policy, tokenizer, self.accelerator.device,
                                           self.run.frozen_dtype, copy_of=self.objects.model)
            if self.cfg.data.padding_free and self.reference.model is not None:  # a second model: the same attention
                self.use_padding_free_attention(self.reference.model)
        return policy

    def setup(self) -> None:
        super().setup()
        if self.reference is not None and self.cfg.algo.precompute_ref_logprobs:
            self.precompute_ref_logprobs()

    def build(self) -> None:
        super().build()
        algo = self.cfg.algo
        if getattr(algo, "sync_ref_model", False):  # TR-DPO (checked before any model loads: a second reference model)
            self.ref_sync = RefSync(self.reference, algo.ref_model_mixup_alpha, algo.ref_model_sync_steps,
                                    self.accelerator.distributed_type)

    def train_step(self, step: int) -> dict[str, float]:
        metrics = super().train_step(step)
        if self.ref_sync is not None:
            self.ref_sync.after_step(step + 1, self.run.unwrap(self.model))
        return metrics

    def save_models(self, directory: str, models: list) -> None:
        super().save_models(directory, models)
        if self.ref_sync is not None:
            self.ref_sync.save(directory, self.tokenizer)

    def load_models(self, checkpoint: str) -> None:
        super().load_models(checkpoint)
        if self.ref_sync is not None:
            self.ref_sync.load(checkpoint)

    @torch.no_grad()
    def precompute_ref_logprobs(self) -> None:
        """Store each pair's reference log-probs in its example dict (the collator carries them into the batch), then
        free a second reference model. Every process computes every example: simple, and done once."""
        from tqdm.auto import tqdm

        sets = [self.train_set] + ([self.eval_set] if self.eval_set else [])
        bs = self.cfg.optim.per_device_batch_size
        chunks = [examples[i : i + bs] for examples in sets for i in range(0, len(examples), bs)]
        show = self.cfg.logging.progress_bar and self.accelerator.is_main_process
        policy = self.run.unwrap(self.model)
        for chunk in tqdm(chunks, desc="reference log-probs", disable=not show, dynamic_ncols=True):
            batch = self.collate(chunk).to(self.accelerator.device)
            with self.accelerator.autocast(), self.reference.frozen(policy) as reference:
                ref, _ = pair_logprobs(reference, batch)
            ref_chosen, ref_rejected = ref.float().cpu().chunk(2)
            for example, c, r in zip(chunk, ref_chosen.tolist(), ref_rejected.tolist()):
                example["ref_chosen_logprobs"], example["ref_rejected_logprobs"] = c, r
        self.reference.release()

    def collate(self, examples) -> PairsWithRefs | PaddingFreePairsWithRefs:
        if self.cfg.data.padding_free:
            batch, cls = collate_preference_padding_free(examples), PaddingFreePairsWithRefs
        else:
            batch, cls = collate_preference(examples, self.tokenizer.pad_token_id), PairsWithRefs
        refs = {}
        if "ref_chosen_logprobs" in examples[0]:
            refs = {k: torch.tensor([e[k] for e in examples], dtype=torch.float32) for k in ("ref_chosen_logprobs", "ref_rejected_logprobs")}
        return cls(**vars(batch), **refs)

    def count(self, batch: PairsWithRefs | PaddingFreePairsWithRefs) -> int:
        return batch.margin.shape[0]

    def compute_loss(self, model, batch: PairsWithRefs | PaddingFreePairsWithRefs, num_items: float):
        algo, method = self.cfg.algo, self.method
        # 1. Chosen and rejected through the policy in one forward ((2B, T) or one padding-free row) -> (2B,), in halves.
        logprobs, lengths = pair_logprobs(model, batch)
        chosen, rejected = logprobs.chunk(2)  # (B,) each
        chosen_len, rejected_len = lengths.chunk(2)  # (B,) response tokens
        # 2. The loss of the method.
        if method == "orpo":
            chosen_nll = -chosen / chosen_len.clamp(min=1)  # per-example mean NLL of the chosen response
            loss, metrics = orpo_loss(chosen, rejected, chosen_len, rejected_len, chosen_nll, beta=algo.beta)
        elif method == "simpo":
            loss, metrics = simpo_loss(
                chosen, rejected, chosen_len, rejected_len, beta=algo.beta, gamma=algo.simpo_gamma,
                label_smoothing=algo.label_smoothing,
            )
        else:
            if batch.ref_chosen_logprobs is not None:
                ref_chosen, ref_rejected = batch.ref_chosen_logprobs, batch.ref_rejected_logprobs
            else:
                with self.accelerator.autocast(), self.reference.frozen(self.run.unwrap(model)) as reference:
                    ref, _ = pair_logprobs(reference, batch)
                ref_chosen, ref_rejected = ref.chunk(2)
            # IPO's loss on per-token log-ratios, its metrics on summed ones: TRL's definitions (see preference_loss).
            lengths = {"chosen_lengths": chosen_len, "rejected_lengths": rejected_len} if method == "ipo" else {}
            loss, metrics = preference_loss(
                chosen, rejected, ref_chosen, ref_rejected, loss_type=method, beta=algo.beta,
                label_smoothing=algo.label_smoothing, **lengths,
            )
        # 3. Sum over pairs / global pair count; metrics are this micro-batch's means (the base weights them by B).
        return loss.sum() / num_items, {"loss": loss.mean().detach(), **{k: v.mean() for k, v in metrics.items()}}
