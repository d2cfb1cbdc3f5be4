"""Reward-model training: Bradley-Terry on chosen/rejected pairs, scored at each sequence's last real token."""

from __future__ import annotations

import torch

from rlhfkit.config import RMConfig
from rlhfkit.data import collate_preference
from rlhfkit.losses.reward import bradley_terry_loss
from rlhfkit.models import load_reward_model
from rlhfkit.rewards import sequence_scores
from rlhfkit.trainers.base import Trainer
from rlhfkit.types import PreferenceBatch


class RewardTrainer(Trainer):
    kind = "preference"
    cfg: RMConfig

    def load_model(self, tokenizer):
        return load_reward_model(self.cfg.model, tokenizer)

    def collate(self, examples) -> PreferenceBatch:
        return collate_preference(examples, self.tokenizer.pad_token_id)

    def count(self, batch: PreferenceBatch) -> int:
        return batch.chosen_input_ids.shape[0]

    def compute_loss(self, model, batch: PreferenceBatch, num_items: float):
        # Chosen and rejected in one forward: (2B, T), split back into halves.
        input_ids = torch.cat([batch.chosen_input_ids, batch.rejected_input_ids])
        attention_mask = torch.cat([batch.chosen_attention_mask, batch.rejected_attention_mask])
        chosen, rejected = sequence_scores(model, input_ids, attention_mask).chunk(2)
        margin = batch.margin * self.cfg.algo.margin_scale if self.cfg.algo.margin_scale else None
        loss, metrics = bradley_terry_loss(chosen, rejected, margin, self.cfg.algo.center_coef)
        return loss.sum() / num_items, {"loss": loss.mean().detach(), **{k: v.mean() for k, v in metrics.items()}}
