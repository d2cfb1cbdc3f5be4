"""Reward-model training: Bradley-Terry on chosen/rejected pairs, scored at each sequence's last real token (or,
with `algo.pooling: mean`, averaged over its response tokens); padded or padding-free (`data.padding_free`) batches."""

from __future__ import annotations

import dataclasses

import torch

from rlhfkit.config import RMConfig
from rlhfkit.data import collate_preference, collate_preference_padding_free
from rlhfkit.losses.reward import bradley_terry_loss
from rlhfkit.models import disable_dropout, load_reward_model, unwrap_peft
from rlhfkit.rewards import POOLING_ATTR, sequence_scores, sequence_scores_padding_free
from rlhfkit.trainers.offline import OfflineTrainer
from rlhfkit.types import PaddingFreePairs, PreferenceBatch


class RewardTrainer(OfflineTrainer):
    kind = "preference"
    cfg: RMConfig

    model_task = "SEQ_CLS"

    def model_config(self):
        cfg = self.cfg.model
        if self.cfg.algo.head_only:  # the body runs as inference: no adapters, no checkpointing
            cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, enabled=False), gradient_checkpointing=False)
        return cfg

    def load_model(self, tokenizer):
        model = load_reward_model(self.model_config(), tokenizer, given=self.objects.model)
        if getattr(self.cfg.algo, "disable_dropout", False):
            disable_dropout(model)
        if self.cfg.algo.head_only:  # no parameter below the head needs a gradient: the body runs as inference
            model.requires_grad_(False)
            model.score.requires_grad_(True)
        setattr(unwrap_peft(model).config, POOLING_ATTR, self.cfg.algo.pooling)  # saved in config.json with the model
        return model

    def collate(self, examples) -> PreferenceBatch | PaddingFreePairs:
        # The reward model reads the whole conversation, tool results included (actions_only=False).
        if self.cfg.data.padding_free:
            return collate_preference_padding_free(examples, actions_only=False)
        return collate_preference(examples, self.tokenizer.pad_token_id, actions_only=False)

    def count(self, batch: PreferenceBatch | PaddingFreePairs) -> int:
        return batch.margin.shape[0]

    def compute_loss(self, model, batch: PreferenceBatch | PaddingFreePairs, num_items: float):
        # Chosen and rejected in one forward: (2B, T) or one padding-free row of 2B sequences, scores split in halves.
        if isinstance(batch, PaddingFreePairs):
            scores = sequence_scores_padding_free(model, batch.sequences)  # (2B,)
        else:
            input_ids = torch.cat([batch.chosen_input_ids, batch.rejected_input_ids])
            attention_mask = torch.cat([batch.chosen_attention_mask, batch.rejected_attention_mask])
            response_mask = torch.cat([batch.chosen_labels, batch.rejected_labels]) != -100
            scores = sequence_scores(model, input_ids, attention_mask, response_mask)  # (2B,)
        chosen, rejected = scores.chunk(2)
        margin = batch.margin * self.cfg.algo.margin_scale if self.cfg.algo.margin_scale else None
        loss, metrics = bradley_terry_loss(chosen, rejected, margin, self.cfg.algo.center_coef)
        return loss.sum() / num_items, {"loss": loss.mean().detach(), **{k: v.mean() for k, v in metrics.items()}}
