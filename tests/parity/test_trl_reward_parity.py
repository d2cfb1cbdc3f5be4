"""Parity with TRL's own reward code: the same rows and reward sources give the same per-source rewards and the same
weighted sum in rlhfkit (`rewards.Rewards`) and in TRL's `GRPOTrainer._calculate_rewards` (trl 1.16), on standard and
conversational data.

TRL's method is called unbound on a bare `GRPOTrainer` instance carrying only the attributes it reads. The sources:
TRL's `think_format_reward` (conversational only), a function reading a dataset column that returns None for some
rows, one reading `trainer_state`, an async one, and a reward model whose tokenizer is not the policy's (TRL
re-tokenises the text; so does rlhfkit).
"""

from __future__ import annotations

import asyncio
import types

import pytest
import torch

pytest.importorskip("trl")

from transformers import LlamaConfig, LlamaForSequenceClassification, TrainerState  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
from trl.rewards import think_format_reward  # noqa: E402
from trl.trainer.utils import start_event_loop_in_daemon  # noqa: E402

from rlhfkit.model_sources import build_tiny_tokenizer  # noqa: E402
from rlhfkit.reward_functions import trainer_state  # noqa: E402
from rlhfkit.rewards import Rewards  # noqa: E402
from rlhfkit.types import Rollout  # noqa: E402

PROMPTS = ["What is 2+2?", "Name a colour."]
ANSWERS = [["4", "four", "<think>\nadd\n</think>\n4"], ["red", "<think>x</think>blue", "7"]]
SOLUTION = ["4", None]  # the second prompt has no reference: `matches` returns None there


def matches(completions, solution, **kwargs):
    text = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [None if s is None else float(t.strip().endswith(s)) for t, s in zip(text, solution)]


def progress(completions, trainer_state, **kwargs):
    return [trainer_state.global_step / trainer_state.max_steps] * len(completions)


async def brevity(completions, **kwargs):
    await asyncio.sleep(0)
    text = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [-len(t) / 10 for t in text]


@pytest.fixture(scope="module")
def rm(tmp_path_factory):
    """A tiny reward model whose tokenizer has one token more than the policy's: rlhfkit re-tokenises for it."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_tokens(["<extra>"])
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config).eval()
    path = tmp_path_factory.mktemp("rm") / "judge"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), model, tokenizer


def rollout(tok, prompts, responses):
    p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    r_ids = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in responses]
    P, R, pad = max(map(len, p_ids)), max(map(len, r_ids)), tok.pad_token_id
    return Rollout(
        prompt_ids=torch.tensor([[pad] * (P - len(x)) + x for x in p_ids]),
        prompt_mask=torch.tensor([[0] * (P - len(x)) + [1] * len(x) for x in p_ids]),
        response_ids=torch.tensor([x + [pad] * (R - len(x)) for x in r_ids]),
        response_mask=torch.tensor([[1] * len(x) + [0] * (R - len(x)) for x in r_ids]),
        group_ids=torch.arange(len(set(prompts))).repeat_interleave(len(prompts) // len(set(prompts))),
        has_eos=torch.ones(len(r_ids), dtype=torch.bool),
        sampler_logprobs=torch.zeros(len(r_ids), R),
        action_mask=torch.tensor([[1] * len(x) + [0] * (R - len(x)) for x in r_ids]),
    )


def trl_rewards(funcs, names, classes, inputs, prompts, completions, completion_ids, state):
    """TRL's `_calculate_rewards` on a bare GRPOTrainer holding only what it reads: (B, K) per-source rewards."""
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    cpu = torch.device("cpu")
    loop_thread, loop, ready = start_event_loop_in_daemon(name="parity")
    ready.wait()
    trainer.__dict__.update(
        accelerator=types.SimpleNamespace(device=cpu, is_main_process=True), args=types.SimpleNamespace(report_to=[], device=cpu),
        state=state, reward_funcs=funcs, reward_func_names=names, reward_processing_classes=classes, environments=None,
        _log_completion_extra=lambda *a, **k: None, _log_metric=lambda *a, **k: None, chat_template_kwargs={},
        is_deepspeed_enabled=False, async_loop=loop)
    try:
        return GRPOTrainer._calculate_rewards(trainer, inputs, prompts, completions, completion_ids)
    finally:
        loop.call_soon_threadsafe(loop.stop)


@pytest.mark.parametrize("conversational", [False, True])
def test_per_source_rewards_and_weighted_sum_match_trl(conversational, rm):
    path, model, rm_tokenizer = rm
    tok = build_tiny_tokenizer()
    texts = [a for answers in ANSWERS for a in answers]
    prompt_of = [p for p in PROMPTS for _ in range(3)]
    solution = [s for s in SOLUTION for _ in range(3)]
    prompts = [[{"role": "user", "content": p}] for p in prompt_of] if conversational else prompt_of
    ro = rollout(tok, prompt_of, texts)
    completion_ids = [row[m.bool()].tolist() for row, m in zip(ro.response_ids, ro.response_mask)]
    completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
    funcs = [matches, progress, brevity] + ([think_format_reward] if conversational else [])
    weights = [1.0, 0.5, 2.0, -0.3] + ([0.7] if conversational else [])
    state = TrainerState(global_step=3, max_steps=12)

    inputs = [{"prompt": p, "solution": s} for p, s in zip(prompts, solution)]
    theirs = trl_rewards([model] + funcs, ["judge"] + [f.__name__ for f in funcs], [rm_tokenizer] + [None] * len(funcs),
                         inputs, prompts, completions, completion_ids, state)  # (B, K)
    trl_total = (theirs * torch.tensor(weights)).nansum(dim=1)

    cfg = types.SimpleNamespace(model=[path], function=funcs, weights=weights, ensemble="mean", gold_function=None,
                                quantization=None)
    ours = Rewards(cfg, tok, "cpu", policy_name="tiny")(
        ro, [{"prompt": p, "columns": {"solution": s}} for p, s in zip(prompts, solution)], trainer_state(3, 12))
    assert list(ours.per_source) == ["judge"] + [f.__name__ for f in funcs]
    mine = torch.stack(list(ours.per_source.values()), dim=1)  # (B, K)
    assert torch.isnan(theirs[:, 1]).sum() == 3  # the rows without a solution, for both
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0, equal_nan=True)
    torch.testing.assert_close(ours.total, trl_total, atol=1e-5, rtol=0)
