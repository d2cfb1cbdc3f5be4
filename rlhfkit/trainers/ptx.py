"""PPO-ptx: a supervised next-token loss mixed into every optimizer step of an online method.

InstructGPT (Ouyang et al. 2022, arXiv 2203.02155, eq. 2) adds γ · E_{x~D_pretrain}[log π(x)] to the RL objective to
limit the "alignment tax"; OpenRLHF calls γ `ptx_coef`. Here the mixed-in data are SFT records (`data.ptx`, any
format the sft stage takes) and the loss is their response tokens' mean NLL (`losses.sft.sft_loss`), so each
optimizer step minimises  policy loss + ptx_coef · NLL.

Each optimizer step (the u-th of the run, counted over every update of every step) reads its own batch of ptx
records: as many, over all processes, as the step's minibatch holds samples. Which records is a function of u alone
(`Run.step_indices`), so resuming needs no state. The NLL is a token mean over the whole batch's labelled tokens (a
global count), so micro-batching and the world size leave the loss and its gradient unchanged.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from rlhfkit.data import build_datasets, collate_sft
from rlhfkit.errors import DataError
from rlhfkit.losses.sft import sft_loss
from rlhfkit.models import scored_logits
from rlhfkit.trainers.processes import global_share, sums_by_name


def load_ptx_set(cfg, tokenizer) -> list[dict] | None:
    """The tokenised `data.ptx` records, or None when the config mixes none in. Problems with them are one
    `DataError` line naming data.ptx."""
    if cfg.data.ptx is None:
        return None
    data = dataclasses.replace(cfg.data, train=cfg.data.ptx, eval=None, eval_fraction=0.0, columns={}, subset=None,
                               packing=False, padding_free=False)
    try:
        examples, _ = build_datasets("sft", data, tokenizer, cfg.seed)
    except DataError as exc:
        raise DataError(f"data.ptx (SFT records: prompt/completion, messages or text): {exc}") from None
    return examples


class Ptx:
    """The ptx term of a run: `backward` adds ptx_coef · NLL of one optimizer step's ptx batch to the gradients;
    `metrics` is the step's mean NLL per labelled token (`loss/ptx_avg`) over every process."""

    def __init__(self, examples: list[dict], coef: float, run, per_update: int, micro: int, pad_token_id: int):
        self.examples, self.coef, self.run = examples, coef, run
        self.per_update = per_update * run.world  # records per optimizer step, all processes
        self.micro, self.pad = micro, pad_token_id
        self.updates_per_epoch = max(1, math.ceil(len(examples) / self.per_update))
        self.sums = {"nll": 0.0, "tokens": 0.0}  # Σ NLL and labelled tokens: this process, this step

    def batch(self, update: int) -> list[dict]:
        """This process's ptx records for the run's `update`-th optimizer step (0-based)."""
        run = self.run
        order = torch.tensor(run.step_indices(update, len(self.examples), self.per_update, self.updates_per_epoch))
        return [self.examples[i] for i in order.view(run.world, -1)[run.accelerator.process_index].tolist()]

    def backward(self, model, update: int, last: bool) -> float:
        """Backward of ptx_coef · the token-mean NLL of `update`'s ptx batch, micro-batch by micro-batch (`last`: its
        final backward ends the optimizer step); returns how many of this process's losses were not finite."""
        run, device = self.run, self.run.accelerator.device
        batches = [collate_sft(chunk, self.pad).to(device) for chunk in split(self.batch(update), self.micro)]
        local = sum(float((b.labels[:, 1:] != -100).sum()) for b in batches)
        # clamp: a step whose ptx records hold no labelled token normalises by 1, not 0
        tokens = max(global_share(run, {"tokens": local})["tokens"], 1.0)
        nonfinite = 0.0
        for i, b in enumerate(batches):
            logits, first = scored_logits(model, b.input_ids, b.attention_mask, b.labels)  # (b, T-first, V)
            loss, m = sft_loss(logits, b.labels[:, first:], num_tokens=tokens)
            loss = self.coef * loss
            nonfinite += float(not torch.isfinite(loss))
            run.backward(loss, last=last and i == len(batches) - 1)
            n = float((b.labels[:, 1:] != -100).sum())
            self.sums = {"nll": self.sums["nll"] + float(m["loss"]) * n, "tokens": self.sums["tokens"] + n}
        return nonfinite

    def start_step(self) -> None:
        self.sums = {"nll": 0.0, "tokens": 0.0}

    def metrics(self) -> dict[str, float]:
        """`loss/ptx_avg` of the step's ptx batches, over every process (collective)."""
        (sums,) = sums_by_name(self.run, self.sums)
        return {"loss/ptx_avg": sums["nll"] / max(sums["tokens"], 1.0)}


def split(rows: list, size: int) -> list[list]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]
