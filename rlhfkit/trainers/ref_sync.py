"""TR-DPO's reference sync as a service the DPO and online loops call after each step: every `algo.ref_model_sync_steps`
steps the reference moves toward the policy (`models.mix_weights`); a checkpoint carries the moved reference, so a
resumed run goes on from the same one (resume ≡ uninterrupted).

Gorbatovski et al. 2024, arXiv 2404.09656; TRL's `sync_ref_model`, `ref_model_mixup_alpha`, `ref_model_sync_steps`
(its callback syncs on `global_step % ref_model_sync_steps == 0`, as `after_step` does).
"""

from __future__ import annotations

import os

from rlhfkit.errors import UserError
from rlhfkit.models import Reference

REF_DIR = "ref_model"  # beside the checkpoint's model/


class RefSync:
    def __init__(self, reference: Reference, alpha: float, every: int, distributed_type: str):
        """`reference`: a second model (the config refuses LoRA's shared base); `distributed_type`: accelerate's."""
        if distributed_type in ("FSDP", "DEEPSPEED"):
            raise UserError(f"algo.sync_ref_model: not supported under {distributed_type} (the policy's weights are "
                            "sharded there and the reference is mixed from whole weights); run on one process or DDP")
        self.reference, self.alpha, self.every = reference, alpha, every

    def after_step(self, done: int, policy) -> bool:
        """Mix the unwrapped `policy` into the reference when `done` steps are a multiple of the period; True if it did."""
        if done % self.every:
            return False
        self.reference.sync(policy, self.alpha)
        return True

    def save(self, model_dir: str, tokenizer) -> None:
        """Write the reference beside a checkpoint's `model_dir` (main process)."""
        from rlhfkit.models import save_model

        save_model(self.reference.model, tokenizer, os.path.join(os.path.dirname(model_dir), REF_DIR), merge_lora=False)

    def load(self, checkpoint: str) -> None:
        """Restore the reference a checkpoint carries (every process)."""
        from rlhfkit.checkpoint import load_model_weights

        load_model_weights(self.reference.model, os.path.join(checkpoint, REF_DIR))
