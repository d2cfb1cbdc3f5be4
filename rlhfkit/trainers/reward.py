"""Reward-model training: Bradley-Terry on chosen/rejected pairs, scored at each sequence's last real token (or,
with `algo.pooling: mean`, averaged over its response tokens)."""

from __future__ import annotations

import dataclasses

import torch

from rlhfkit.config import RMConfig
from rlhfkit.data import collate_preference
from rlhfkit.losses.reward import bradley_terry_loss
from rlhfkit.models import load_reward_model, unwrap_peft
from rlhfkit.rewards import POOLING_ATTR, sequence_scores
from rlhfkit.trainers.base import Trainer
from rlhfkit.types import PreferenceBatch


class RewardTrainer(Trainer):
    kind = "preference"
    cfg: RMConfig

    def load_model(self, tokenizer):
        cfg = self.cfg.model
        if self.cfg.algo.head_only:
            cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, enabled=False), gradient_checkpointing=False)
        model = load_reward_model(cfg, tokenizer)
        if self.cfg.algo.head_only:  # no parameter below the head needs a gradient: the body runs as inference
            model.requires_grad_(False)
            model.score.requires_grad_(True)
        setattr(unwrap_peft(model).config, POOLING_ATTR, self.cfg.algo.pooling)  # saved in config.json with the model
        return model

    def collate(self, examples) -> PreferenceBatch:
        return collate_preference(examples, self.tokenizer.pad_token_id)

    def count(self, batch: PreferenceBatch) -> int:
        return batch.chosen_input_ids.shape[0]

    def compute_loss(self, model, batch: PreferenceBatch, num_items: float):
        # Chosen and rejected in one forward: (2B, T), split back into halves.
        input_ids = torch.cat([batch.chosen_input_ids, batch.rejected_input_ids])
        attention_mask = torch.cat([batch.chosen_attention_mask, batch.rejected_attention_mask])
        response_mask = torch.cat([batch.chosen_labels, batch.rejected_labels]) != -100
        chosen, rejected = sequence_scores(model, input_ids, attention_mask, response_mask).chunk(2)
        margin = batch.margin * self.cfg.algo.margin_scale if self.cfg.algo.margin_scale else None
        loss, metrics = bradley_terry_loss(chosen, rejected, margin, self.cfg.algo.center_coef)
        return loss.sum() / num_items, {"loss": loss.mean().detach(), **{k: v.mean() for k, v in metrics.items()}}
