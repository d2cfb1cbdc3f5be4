"""Supervised fine-tuning: next-token loss on completion tokens (or on everything), optional packing, or padding-free
batches (`data.padding_free`: the same loss and gradient as the padded batch, without computing pad tokens)."""

from __future__ import annotations

from rlhfkit.config import SFTConfig
from rlhfkit.data import collate_sft, collate_sft_padding_free, pack_sft
from rlhfkit.losses.sft import sft_loss
from rlhfkit.models import load_causal_lm, scored_logits
from rlhfkit.trainers.offline import OfflineTrainer
from rlhfkit.types import PaddingFreeBatch, SFTBatch


class SFTTrainer(OfflineTrainer):
    kind = "sft"
    cfg: SFTConfig

    def load_model(self, tokenizer):
        return load_causal_lm(self.cfg.model, tokenizer, given=self.objects.model)

    def prepare_train_set(self, examples):
        return pack_sft(examples, self.cfg.data.max_length) if self.cfg.data.packing else examples

    def collate(self, examples) -> SFTBatch | PaddingFreeBatch:
        if self.cfg.data.padding_free:
            if not self.cfg.algo.completion_only:
                examples = [{**e, "labels": e["input_ids"]} for e in examples]
            return collate_sft_padding_free(examples)
        batch = collate_sft(examples, self.tokenizer.pad_token_id)
        if not self.cfg.algo.completion_only:
            batch.labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
        return batch

    def count(self, batch: SFTBatch | PaddingFreeBatch) -> int:
        labels = batch.next_token_labels if isinstance(batch, PaddingFreeBatch) else batch.labels
        return int((labels[:, 1:] != -100).sum())

    def compute_loss(self, model, batch: SFTBatch | PaddingFreeBatch, num_items: float):
        if isinstance(batch, PaddingFreeBatch):  # one row: (1, N), no mask, positions restarting per sequence
            labels = batch.next_token_labels
            logits, first = scored_logits(model, batch.input_ids, None, labels, batch.position_ids)  # (1, N-first, V)
        else:
            labels = batch.labels
            logits, first = scored_logits(model, batch.input_ids, batch.attention_mask, labels)  # (B, T-first, V)
        return sft_loss(logits, labels[:, first:], num_tokens=num_items)
