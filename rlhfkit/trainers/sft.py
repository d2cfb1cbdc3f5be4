"""Supervised fine-tuning: next-token loss on completion tokens (or on everything), optional packing."""

from __future__ import annotations

from rlhfkit.config import SFTConfig
from rlhfkit.data import collate_sft, pack_sft
from rlhfkit.losses.sft import sft_loss
from rlhfkit.models import load_causal_lm, scored_logits
from rlhfkit.trainers.base import Trainer
from rlhfkit.types import SFTBatch


class SFTTrainer(Trainer):
    kind = "sft"
    cfg: SFTConfig

    def load_model(self, tokenizer):
        return load_causal_lm(self.cfg.model, tokenizer)

    def prepare_train_set(self, examples):
        return pack_sft(examples, self.cfg.data.max_length) if self.cfg.data.packing else examples

    def collate(self, examples) -> SFTBatch:
        batch = collate_sft(examples, self.tokenizer.pad_token_id)
        if not self.cfg.algo.completion_only:
            batch.labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
        return batch

    def count(self, batch: SFTBatch) -> int:
        return int((batch.labels[:, 1:] != -100).sum())

    def compute_loss(self, model, batch: SFTBatch, num_items: float):
        logits, first = scored_logits(model, batch.input_ids, batch.attention_mask, batch.labels)  # (B, T-first, V)
        return sft_loss(logits, batch.labels[:, first:], num_tokens=num_items)
