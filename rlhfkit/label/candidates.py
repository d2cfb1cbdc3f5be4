"""What people judge: `Pair`s of two responses to one prompt, made once before the page is served.

Candidates come from a file of ready-made responses, or are sampled from one model (k responses per prompt, every
two of them a pair) or from two (compare mode: the same prompts, the same seeds, one pair per sample) through
`evaluation.samples.sample`, which draws through the single-turn rollout exactly as `rlhfkit eval` does: with the same
prompts, generation settings, seed and batch size, compare mode judges the samples `rlhfkit eval` scored.

A candidates file is JSON lines (or one JSON list), a record per prompt:
`{"prompt": TEXT or MESSAGES, "responses": [RESPONSE, ...], "models": [NAME, ...]}` with at least two responses;
a response is text, a list of messages, or `{"response": TEXT or MESSAGES, "model": NAME}`; "models" is optional
(it names each response's source, hidden from annotators, kept in exports). Messages are `{role, content}` dicts
with role system, user, assistant or tool; an assistant turn may carry OpenAI-style `tool_calls`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlhfkit.errors import UserError

if TYPE_CHECKING:
    from rlhfkit.config import GenerationConfig

Content = str | list[dict]  # text, or chat messages
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Candidate:
    content: Content  # the response: text or messages
    model: str  # which model (or file column) made it; never shown to annotators


@dataclass(frozen=True)
class Pair:
    """One item: two responses to one prompt. `swap` puts `second` on the left of the page (position balance);
    judgements are stored in terms of first/second, whatever side they were shown on."""

    prompt: Content
    first: Candidate
    second: Candidate
    swap: bool = False
    overlap: bool = False  # judged by two annotators (agreement is measured on these)


@dataclass(frozen=True)
class Group:
    """A prompt and its candidate responses (k >= 2)."""

    prompt: Content
    responses: tuple[Candidate, ...]


def fingerprint(spec: dict) -> str:
    """A short hash of what the candidates are made from (a file's bytes, or the models, prompts and settings): a
    database made for other candidates is refused, and a restart with the same inputs never samples again."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# 1. Reading a candidates file -----------------------------------------------------------------------------------


def check_messages(value, where: str) -> list[dict]:
    """Chat messages, tool turns included: roles system/user/assistant/tool, content text (or null beside
    `tool_calls`)."""
    if not isinstance(value, list) or not value:
        raise UserError(f"{where}: expected text or a non-empty list of {{role, content}} messages")
    for j, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise UserError(f"{where} message {j}: expected a {{role, content}} dict with role one of {', '.join(ROLES)}")
        content, calls = m.get("content"), m.get("tool_calls")
        if not (isinstance(content, str) or (content is None and calls)):
            raise UserError(f"{where} message {j}: content must be a string (or null beside tool_calls)")
        if calls is not None and not isinstance(calls, list):
            raise UserError(f"{where} message {j}: tool_calls must be a list")
    return value


def _content(value, where: str) -> Content:
    if isinstance(value, str):
        if not value.strip():
            raise UserError(f"{where}: empty text")
        return value
    return check_messages(value, where)


def _group(record, where: str) -> Group:
    if not isinstance(record, dict) or "prompt" not in record or "responses" not in record:
        raise UserError(f"{where}: expected an object with 'prompt' and 'responses'")
    prompt = _content(record["prompt"], f"{where} field 'prompt'")
    responses, models = record["responses"], record.get("models")
    if not isinstance(responses, list) or len(responses) < 2:
        raise UserError(f"{where} field 'responses': expected a list of at least 2 responses to compare")
    if models is not None and (not isinstance(models, list) or len(models) != len(responses)
                               or not all(isinstance(m, str) for m in models)):
        raise UserError(f"{where} field 'models': expected one name (a string) per response")
    out = []
    for j, r in enumerate(responses):
        model = models[j] if models else f"response_{j}"
        if isinstance(r, dict):
            model = r.get("model", model)
            r = r.get("response", r.get("content"))
        out.append(Candidate(_content(r, f"{where} response {j}"), str(model)))
    return Group(prompt, tuple(out))


def read_candidates(path: str) -> list[Group]:
    """The groups of a candidates file (module docstring); one line naming the line and field on bad input."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise UserError(f"candidates file '{path}': {exc.strerror or exc}") from None
    if text.lstrip().startswith("["):
        try:
            records = [(f"{path} record {i}", r) for i, r in enumerate(json.loads(text))]
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    else:
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append((f"{path} line {n}", json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise UserError(f"{path} line {n}: not valid JSON ({exc.msg})") from None
    if not records:
        raise UserError(f"candidates file '{path}' holds no prompts")
    return [_group(record, where) for where, record in records]


# 2. Pairs --------------------------------------------------------------------------------------------------------


def balanced_swaps(n: int, rng: random.Random) -> list[bool]:
    """n left/right flags, half of them set (one more unset when n is odd), in a random order: each source appears
    on each side equally often, so a bias for the left response cannot favour either."""
    flags = [i % 2 == 1 for i in range(n)]
    rng.shuffle(flags)
    return flags


def overlap_flags(n: int, share: float, rng: random.Random) -> list[bool]:
    """Which of n items two annotators judge: round(share * n) of them, chosen at random."""
    chosen = set(rng.sample(range(n), round(share * n)))
    return [i in chosen for i in range(n)]


def make_pairs(groups: list[Group], overlap: float, seed: int) -> list[Pair]:
    """Every two responses of each group as one pair, in prompt order, sides balanced and an `overlap` share of
    pairs marked for two annotators, all drawn from `seed`."""
    raw = [(g.prompt, a, b) for g in groups for a, b in itertools.combinations(g.responses, 2)]
    rng = random.Random(seed)
    swaps, shared = balanced_swaps(len(raw), rng), overlap_flags(len(raw), overlap, rng)
    return [Pair(p, a, b, s, o) for (p, a, b), s, o in zip(raw, swaps, shared)]


def compare_groups(prompts: list[Content], first: list[str], second: list[str], names: tuple[str, str], k: int) -> list[Group]:
    """Compare mode: prompt i's j-th sample of each model as one group of two (`first`, `second` hold k samples
    per prompt, prompt by prompt)."""
    return [Group(prompts[i // k], (Candidate(a, names[0]), Candidate(b, names[1])))
            for i, (a, b) in enumerate(zip(first, second, strict=True))]


def pair_to_json(pair: Pair) -> dict:
    return dataclasses.asdict(pair)


def pair_from_json(data: dict) -> Pair:
    return Pair(data["prompt"], Candidate(**data["first"]), Candidate(**data["second"]), data["swap"], data["overlap"])


# 3. Sampling -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingSpec:
    """What to sample: `model` alone (k responses per prompt) or against `reference` (compare mode)."""

    model: str
    prompts: str
    generation: GenerationConfig
    reference: str | None = None
    seed: int = 0
    batch_size: int = 8
    max_prompts: int | None = None

    def as_dict(self) -> dict:
        digest = file_digest(self.prompts) if os.path.isfile(self.prompts) else self.prompts
        return {**dataclasses.asdict(self), "generation": dataclasses.asdict(self.generation), "prompts": digest}


def sample_groups(spec: SamplingSpec) -> list[Group]:
    """Loads the model(s) and the prompts file, samples, decodes: one group per prompt (k responses of `model`), or
    in compare mode one group per sample (`model`'s and `reference`'s j-th response to the same prompt, drawn under
    the same seed)."""
    import torch

    from rlhfkit.config import DataConfig, ModelConfig
    from rlhfkit.data import build_datasets
    from rlhfkit.evaluation.samples import Samples, sample
    from rlhfkit.models import load_causal_lm, load_tokenizer
    from rlhfkit.types import Rollout

    cfg = ModelConfig(name_or_path=spec.model)
    tokenizer = load_tokenizer(cfg)
    prompts, _ = build_datasets("prompt", DataConfig(train=spec.prompts, max_samples=spec.max_prompts), tokenizer, spec.seed)
    if not prompts:
        raise UserError(f"prompts file '{spec.prompts}' holds no prompts")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    policy = load_causal_lm(cfg, tokenizer, trainable=False).to(device)
    reference = None
    if spec.reference is not None:
        ref_cfg = ModelConfig(name_or_path=spec.reference)
        if load_tokenizer(ref_cfg).get_vocab() != tokenizer.get_vocab():  # the two sample from one batch of prompt ids
            raise UserError(f"--compare '{spec.reference}' has a different tokenizer from --model '{spec.model}': compare "
                            "mode samples both from the same prompt tokens, so they must share one")
        reference = load_causal_lm(ref_cfg, tokenizer, trainable=False).to(device)
    pol, ref, _ = sample(policy, reference, tokenizer, prompts, spec.generation, spec.batch_size, spec.seed)
    texts = Samples.of(Rollout.concat(pol, tokenizer.pad_token_id), tokenizer).texts
    k = spec.generation.num_samples
    if reference is None:
        return [Group(p["prompt"], tuple(Candidate(t, spec.model) for t in texts[i * k : (i + 1) * k]))
                for i, p in enumerate(prompts)]
    ref_texts = Samples.of(Rollout.concat(ref, tokenizer.pad_token_id), tokenizer).texts
    return compare_groups([p["prompt"] for p in prompts], texts, ref_texts, (spec.model, spec.reference), k)
