"""A scripted policy for rollout tests: a real model whose next token a script chooses.

`Scripted(model, tokenizer, script)` adds `bias` to the model's logit of the token the script wants next, so sampling
with top_k=1 writes the script while the recorded log-probs stay the model's (tilted). The script reads only what a
forward is given: `script(text)` is called on the real tokens of any forward of several tokens (a prefill, or the
chunk a multi-turn loop appends after a turn: tool results and the next header) and returns the turn to write; each
one-token forward then takes its next token, then EOS. The queues follow the rows of the cache: when the loop selects
or copies its rows (`batch_select_indices`, e.g. one prefill of a prompt several rows share), they are selected alike;
when rows prefilled in a cache of their own join the session's (continuous refill: the first one-token forward comes
through a cache not seen before), their queues follow the session's rows'."""

from __future__ import annotations

import torch


class OneProcess:
    """The run's process group, for one process (what `trainers.run.Run` gives the experience maker)."""

    world = 1

    def __init__(self):
        from accelerate import Accelerator

        self.accelerator = Accelerator(cpu=True)

    def unwrap(self, module):
        return module

    def gather(self, x):
        return x

    def on_every_process(self, flag):
        return bool(flag)

    def sum_over_processes(self, x):
        return x


class Scripted(torch.nn.Module):
    def __init__(self, model, tokenizer, script, bias: float = 8.0):
        super().__init__()
        self.model, self.tok, self.script, self.bias, self.config = model, tokenizer, script, bias, model.config
        self.queues: list[list[int]] = []
        self.before: list[list[int]] = []  # the session's rows' queues while a prefill's rows are about to join them

    @property
    def device(self):
        return self.model.device

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=True, logits_to_keep=1):
        new = cache is not None and not getattr(cache, "scripted_rows", False)
        if new:
            self._follow_rows(cache)
            if input_ids.shape[1] == 1:  # a cache rebuilt from two (rows joined): the session's rows, then the new
                self.queues = self.before + self.queues
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                         use_cache=use_cache, logits_to_keep=logits_to_keep)
        if input_ids.shape[1] > 1:
            self.before = self.queues if new else []  # a prefill in a cache of its own: the rows may join others
            if attention_mask is not None and getattr(attention_mask, "ndim", 0) == 2:
                real = attention_mask[:, -input_ids.shape[1]:].bool()
            else:  # 4D masks (a sliding-window model's, built by the engine): the chunk after its left padding
                real = (input_ids != self.tok.pad_token_id).long().cummax(1).values.bool()
            self.queues = [self.tok(self.script(self.tok.decode(ids[m])), add_special_tokens=False)["input_ids"]
                           for ids, m in zip(input_ids, real)]
        wanted = torch.tensor([q.pop(0) if q else self.tok.eos_token_id for q in self.queues], device=input_ids.device)
        out.logits[:, -1, :] += self.bias * torch.nn.functional.one_hot(wanted, out.logits.shape[-1])
        return out

    def _follow_rows(self, cache) -> None:
        select = cache.batch_select_indices

        def select_and_follow(indices):
            select(indices)
            self.queues = [list(self.queues[i]) for i in indices.tolist()]

        cache.batch_select_indices, cache.scripted_rows = select_and_follow, True
