"""Evaluation: sample the policy and the reference on held-out prompts with the same seed, judge both, compare.

`evaluate(...)` is the core, usable from Python on loaded models; `Evaluator` is the `rlhfkit eval` stage around it
(load models, prompts and judges from an `EvalConfig`, add reward-model accuracy and a run's alarms, write
`output_dir/eval.json`, print a summary table). Sampling goes through `generation.generate` and log-probs through
`models.rollout_logprobs`, as in online RL, so the KL here is the `objective/kl` a training run logs. Launched on
several processes, `rlhfkit eval` shares the generation batches out among them (`sample`: the same samples as one
process) and the main process alone judges, writes eval.json and prints the table.

A judge is any `judge(rollout, examples) -> list[float]`: one score per row of the rollout, higher is better, where
`examples[i]` is row i's prompt example (`data.build_datasets("prompt", ...)`). Each judge is called once per model,
on all of that model's samples. `python_judge` wraps a Python reward function under TRL's reward contract
(`rlhfkit.reward_functions`: keywords prompts=, completions=, completion_ids=, every other field of the prompt records,
trainer_state=None); `SourceJudge` wraps any reward source (`rewards.RewardSource`): a reward model reads the rollout's
own token ids, or the text re-tokenised when its tokenizer is not the policy's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable

import torch

from rlhfkit.config import DataConfig, EvalConfig, ModelConfig, config_to_yaml
from rlhfkit.data import build_datasets, collate_preference, collate_prompts
from rlhfkit.errors import UserError
from rlhfkit.evaluation.alarms import (
    ALIGNMENT_TAX_KEY, DISTINCT_KEY, EMPTY_KEY, EOS_KEY, TOP_SHARE_KEY, WORDS_KEY, AlarmThresholds, SampleStats,
    check_alarms, diversity_figures,
)
from rlhfkit.evaluation.alarms import alignment_tax as check_alignment_tax
from rlhfkit.evaluation.capability import AlignmentTax, frozen_reference, measure_alignment_tax
from rlhfkit.evaluation.red_team import RedTeam, summary_lines
from rlhfkit.evaluation.agent import AgentOptions, gate, gate_lines, load_format_check, tool_rollout
from rlhfkit.evaluation.metrics import (
    distinct_n, empty_rate, eos_rate, mean_std, reward_model_accuracy, sequence_kl, truncation_rate, win_rate,
)
from rlhfkit.config import GenerationConfig
from rlhfkit.generation import generate, seeded
from rlhfkit.io import atomic_write_text, check_writable
from rlhfkit.launch import distributed_state, log_launch
from rlhfkit.models import load_causal_lm, load_tokenizer, rollout_logprobs
from rlhfkit.reward_functions import RewardFunction, RewardLogs, extra_columns, load_reward_function, trainer_state
from rlhfkit.rewards import EnsembleSource, as_list, load_reward_model_source, reduce_ensemble, reward_inputs
from rlhfkit.rollout.maker import check_row_tools
from rlhfkit.types import Rollout, Rows, ToolCounts

logger = logging.getLogger("rlhfkit")

Judge = Callable[[Rollout, list[dict] | None], list[float]]


# 1. Judges ---------------------------------------------------------------------------------------------------


def python_judge(fn: Callable, tokenizer) -> Judge:
    """A Python reward function under TRL's contract (e.g. `rlhfkit.tasks.toy:vowel_reward`, or a `RewardFunction`
    from `reward_functions.load_reward_function`) as a judge; `tokenizer` decodes the rollout. A row the function
    returns None for is one it does not apply to (TRL's convention): its score stays None, and the figures leave it
    out. The function gets `trainer_state` as a fresh `transformers.TrainerState` (global_step 0): there is no
    training here, and a TRL function that reads it must still run."""
    reward = fn if isinstance(fn, RewardFunction) else RewardFunction(fn, f"judge {getattr(fn, '__name__', fn)!r}")
    return SourceJudge(reward, tokenizer, RewardLogs())


class SourceJudge:
    """A reward source (`rewards.RewardSource`: a function, a reward model, an ensemble) as a judge: one score per
    row, None where the source does not apply. `logs`: where a function's `log_metric` / `log_extra` write (None for
    a reward model)."""

    def __init__(self, source, tokenizer, logs: RewardLogs | None = None):
        self.source, self.tokenizer, self.logs = source, tokenizer, logs

    @torch.no_grad()
    def __call__(self, rollout: Rollout, examples: list[dict] | None = None) -> list:
        from rlhfkit.reward_functions import trainer_state

        inputs = reward_inputs(self.tokenizer, rollout, examples, trainer_state(0, 0), self.logs)
        values, applies = self.source.score(rollout, inputs)
        return [float(v) if a else None for v, a in zip(values.tolist(), applies.tolist())]


# 2. The core -------------------------------------------------------------------------------------------------


def _decode(tokenizer, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    return [tokenizer.decode(row[m.bool()], skip_special_tokens=True) for row, m in zip(ids, mask)]


def _judge_all(judges: dict[str, Judge], rollout: Rollout, examples: list[dict]) -> dict:
    """judge name -> one score per row of `rollout`: a finite number, or None where the judge does not apply."""
    out = {}
    n = rollout.response_ids.shape[0]
    for name, judge in judges.items():
        scores = [None if s is None else float(s) for s in judge(rollout, examples)]
        if len(scores) != n:
            raise UserError(f"judge '{name}' returned {len(scores)} scores for {n} completions")
        bad = next(((i, s) for i, s in enumerate(scores) if s is not None and not math.isfinite(s)), None)
        if bad is not None:
            raise UserError(f"judge '{name}' returned a non-finite score ({bad[1]}) at row {bad[0]}: return a number, "
                            "or None for a row the judge does not apply to")
        if all(s is None for s in scores):
            logger.warning("judge '%s' returned None for all %d samples: it has no figures", name, n)
        out[name] = scores
    return out


def concat_rollouts(parts: list[Rollout], pad_token_id: int) -> Rollout:
    """The rollouts of several generation batches as one: prompts left-padded and responses right-padded to the
    widest, group ids continued (reward models score the same with more padding: positions follow the mask)."""
    P, R = max(r.prompt_ids.shape[1] for r in parts), max(r.response_ids.shape[1] for r in parts)

    def pad(t: torch.Tensor, width: int, value, left: bool = False) -> torch.Tensor:
        return torch.nn.functional.pad(t, (width - t.shape[1], 0) if left else (0, width - t.shape[1]), value=value)

    offsets = [0]
    for r in parts[:-1]:
        offsets.append(offsets[-1] + int(r.group_ids.max()) + 1)
    return Rollout(
        prompt_ids=torch.cat([pad(r.prompt_ids, P, pad_token_id, left=True) for r in parts]),  # (B, P)
        prompt_mask=torch.cat([pad(r.prompt_mask, P, 0, left=True) for r in parts]),
        response_ids=torch.cat([pad(r.response_ids, R, pad_token_id) for r in parts]),  # (B, R)
        response_mask=torch.cat([pad(r.response_mask, R, 0) for r in parts]),
        group_ids=torch.cat([r.group_ids + o for r, o in zip(parts, offsets)]),
        has_eos=torch.cat([r.has_eos for r in parts]),
        sampler_logprobs=torch.cat([pad(r.sampler_logprobs, R, 0.0) for r in parts]),
        action_mask=torch.cat([pad(r.action_mask, R, 0) for r in parts]),
        **{name: Rows(row for r in parts for row in getattr(r, name)) for name in ("texts", "completions", "environments")
           if all(getattr(r, name) is not None for r in parts)},
        tools=concat_counts([r.tools for r in parts]) if all(r.tools is not None for r in parts) else None,
    )


def concat_counts(parts: list[ToolCounts]) -> ToolCounts:
    """The tool counts of several generation batches as one (rows in order; the tools are the same in each)."""
    return ToolCounts(**{f.name: torch.cat([getattr(c, f.name) for c in parts]) for f in dataclasses.fields(ToolCounts)
                         if isinstance(getattr(parts[0], f.name), torch.Tensor)},
                      tool_names=parts[0].tool_names, well_formed=Rows(r for c in parts for r in c.well_formed))


def describe(ro: Rollout, tokenizer) -> dict:
    """A rollout's prompts, response texts (a whole episode's with tools), lengths (the policy's tokens), EOS flags
    and group ids (rows in rollout order)."""
    return {"prompts": _decode(tokenizer, ro.prompt_ids, ro.prompt_mask), "texts": _decode(tokenizer, ro.response_ids, ro.response_mask),
            "lengths": ro.action_mask.sum(-1).tolist(), "has_eos": ro.has_eos.tolist(), "groups": ro.group_ids.tolist()}


def _samples(parts: list[Rollout], tokenizer, judges: dict[str, Judge], examples: list[dict]) -> dict:
    """One model's responses (its rollouts, in prompt order): `describe` and the judges' scores, each judge called
    once on all of them."""
    ro = concat_rollouts(parts, tokenizer.pad_token_id)
    scores = _judge_all(judges, ro, examples)
    logged: dict[str, list[float]] = {}
    extras: dict[str, list] = {}
    for judge in judges.values():  # what the Python judges logged with log_metric / log_extra on these samples
        if getattr(judge, "logs", None) is not None:
            metrics, columns = judge.logs.take()
            for name, values in metrics.items():
                logged.setdefault(name, []).extend(values)
            extras.update(columns)
    return {**describe(ro, tokenizer), "scores": scores, "tools": ro.tools, "completions": ro.completions,
            "logged": {name: sum(v) / len(v) for name, v in logged.items() if v}, "extras": extras}


def judged(scores: list) -> dict:
    """{"mean", "std", "n"} of a judge's scores over the rows it applies to (not None); mean and std are None when
    it applies to none."""
    applied = [x for x in scores if x is not None]
    return {**(mean_std(applied) if applied else {"mean": None, "std": None}), "n": len(applied)}


def paired_win_rate(a: list, b: list) -> float | None:
    """`metrics.win_rate` over the pairs both sides have a score for (None when there are none)."""
    both = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    return win_rate([x for x, _ in both], [y for _, y in both]) if both else None


def summarize(s: dict) -> dict:
    """The figures of one model's samples (`describe` plus "scores": judge -> scores; eval.json's "policy" /
    "reference" objects)."""
    diversity = diversity_figures(s["texts"], s["groups"])
    return {
        "length": mean_std(s["lengths"]),
        "distinct_1": distinct_n(s["texts"], 1), "distinct_2": diversity[DISTINCT_KEY],
        "words_avg": diversity[WORDS_KEY], "top_share": diversity.get(TOP_SHARE_KEY),
        "eos_rate": eos_rate(s["has_eos"]), "truncation_rate": truncation_rate(s["has_eos"]),
        "empty_rate": empty_rate(s["texts"]), "reward": {name: judged(v) for name, v in s["scores"].items()},
        "logged": s.get("logged", {}),
    }


@torch.no_grad()
def evaluate(
    policy, reference, tokenizer, prompts: list[dict], judges: dict[str, Judge], params: GenerationConfig,
    batch_size: int = 16, seed: int = 0, num_examples: int = 16,
) -> dict:
    """Sample `policy` and `reference` on `prompts` with the same seed per batch; judge, compare, raise alarms.

    Args:
        policy, reference: causal LMs sharing `tokenizer`, on one device; `reference` may be None (the policy alone:
            no KL, win rates or reference figures).
        prompts: prompt examples `{"prompt_ids", "prompt", "columns"}` (`data.build_datasets("prompt", ...)`).
        judges: name -> judge(rollout, examples) -> scores; each is called once per model, on all its samples.
        params: sampling parameters; `num_samples` responses per prompt (the policy's j-th sample of a prompt is
            compared with the reference's j-th).
        batch_size: prompts per `generate` call; batch i is drawn under seed `seed + i` by both models, so a
            reference identical to the policy gives identical responses (KL 0, every win rate exactly 0.5).
        num_examples: side-by-side samples kept in the result.

    Returns the eval.json figures: "num_prompts", "num_samples", "policy" and "reference" ({"length": {mean, std},
    "distinct_1", "distinct_2", "words_avg", "top_share" (`alarms.diversity_figures`), "eos_rate", "truncation_rate",
    "empty_rate", "reward": {judge: {mean, std, n}}, "logged": {name: mean of what Python judges logged with
    `log_metric`}}; reference
    None without one), "kl" ({mean, std} of the per-sequence KL(policy || reference) in nats on policy samples, or
    None), "win_rate" ({judge: P(policy beats reference)}), "alarms" ([{name, message, source}]), "samples".
    """
    samples = sample(policy, reference, tokenizer, prompts, params, batch_size, seed)
    return compare(*samples, tokenizer, prompts, judges, params, num_examples)


@torch.no_grad()
def sample(policy, reference, tokenizer, prompts: list[dict], params: GenerationConfig, batch_size: int = 16,
           seed: int = 0, state=None, sample_reference: bool = True, rollout=None,
           ) -> tuple[list[Rollout], list[Rollout], list[float]]:
    """`evaluate`'s sampling: the policy's and the reference's rollouts (one per batch of `batch_size` prompts, batch
    i drawn under seed `seed + i` by both) and the per-sequence KL(policy || reference) of the policy's samples.

    `reference` is a model, a `models.Reference` (e.g. the policy's base with its LoRA adapters disabled) or None;
    with `sample_reference=False` it only gives the KL's log-probs (no reference rollouts: the online evaluation).
    With `state` (accelerate's, several processes) process r samples batches r, r + world, ... and every process
    returns all of them in batch order, on its own device: the same samples as one process. `rollout`: a rollout
    component (`rlhfkit.rollout`; with tools, episodes from `evaluation.agent.tool_rollout`) sampling in place of one
    `generate` turn, under the same seeds. The KL sums over the policy's own tokens (`Rollout.action_mask`).
    """
    if not prompts:
        raise UserError("no prompts to evaluate")
    rank, world = (state.process_index, state.num_processes) if state is not None else (0, 1)
    device = next(policy.parameters()).device
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    parts = []  # (batch index, policy rollout, reference rollout or None, KLs) of this process's batches
    for i, start in enumerate(range(0, len(prompts), batch_size)):
        if i % world != rank:
            continue
        examples = prompts[start : start + batch_size]
        batch = collate_prompts(examples, pad).to(device)

        def draw(model) -> Rollout:
            with seeded(seed + i):
                if rollout is None:
                    return generate(model, batch, params, eos, pad)
                made = rollout(model, batch, examples, 0)
            if made is None:
                raise UserError("the model's next-token probabilities are not finite (inf or nan): its weights are broken")
            return made

        ro = draw(policy)
        ref_ro, kls = None, []
        if reference is not None:
            lp = rollout_logprobs(policy, ro, params.temperature)  # (B, R)
            with frozen_reference(reference, policy) as ref:
                if sample_reference:
                    ref_ro = draw(ref)
                ref_lp = rollout_logprobs(ref, ro, params.temperature)  # (B, R)
            kls = sequence_kl(lp, ref_lp, ro.action_mask).tolist()
        parts.append((i, ro, ref_ro, kls))
    if world > 1:
        from accelerate.utils import gather_object

        def to(ro: Rollout | None, where) -> Rollout | None:
            return ro.to(where) if ro is not None else None

        gathered = gather_object([(i, to(ro, "cpu"), to(ref_ro, "cpu"), kls) for i, ro, ref_ro, kls in parts])
        parts = [(i, to(ro, device), to(ref_ro, device), kls) for i, ro, ref_ro, kls in sorted(gathered, key=lambda p: p[0])]
    return ([ro for _, ro, _, _ in parts], [ref_ro for _, _, ref_ro, _ in parts if ref_ro is not None],
            [kl for *_, kls in parts for kl in kls])


def compare(pol_parts: list[Rollout], ref_parts: list[Rollout], kls: list[float], tokenizer, prompts: list[dict],
            judges: dict[str, Judge], params: GenerationConfig, num_examples: int = 16,
            agent: AgentOptions | None = None) -> dict:
    """`evaluate`'s figures from `sample`'s rollouts and KLs: judge, summarise, compare, raise alarms; with tool
    episodes, "agent" too (`evaluation.agent`: `agent`'s format rule and task judge, default none)."""
    # Judges once per model, on all of its samples (a judge may batch its work or normalise over the batch).
    rows = [example for example in prompts for _ in range(params.num_samples)]  # each row's prompt example
    pol = _samples(pol_parts, tokenizer, judges, rows)
    ref = _samples(ref_parts, tokenizer, judges, rows) if ref_parts else None
    result = {
        "num_prompts": len(prompts), "num_samples": len(pol["texts"]),
        "policy": summarize(pol), "reference": summarize(ref) if ref else None,
        "kl": mean_std(kls) if ref else None,
        "win_rate": {name: paired_win_rate(pol["scores"][name], ref["scores"][name]) for name in judges} if ref else {},
    }
    if pol["tools"] is not None:
        result["agent"] = (agent or AgentOptions()).section(pol, ref)
    # Alarms on the samples: the policy's score-length correlation, and reference -> policy as a 2-row history
    # (diversity collapse, more empty or truncated responses).
    rows = [] if ref is None else [
        {"label": label, DISTINCT_KEY: s["distinct_2"], WORDS_KEY: s["words_avg"], TOP_SHARE_KEY: s["top_share"],
         EMPTY_KEY: s["empty_rate"], EOS_KEY: s["eos_rate"]}
        for label, s in (("reference", result["reference"]), ("policy", result["policy"]))]
    alarms = check_alarms(rows, SampleStats(pol["lengths"], pol["scores"]))
    result["alarms"] = [{**dataclasses.asdict(a), "source": "samples"} for a in alarms]
    result["samples"] = [_example(pol, ref, kls, j) for j in range(min(num_examples, len(pol["texts"])))]
    return result


def _example(pol: dict, ref: dict | None, kls: list[float], j: int) -> dict:
    def side(s: dict) -> dict:
        return {"response": s["texts"][j], "scores": {n: v[j] for n, v in s["scores"].items()},
                "length": s["lengths"][j], "eos": s["has_eos"][j], "extra": extra_columns(s.get("extras", {}), j)}

    out = {"prompt": pol["prompts"][j], "policy": side(pol), "reference": side(ref) if ref else None}
    if kls:
        out["policy"]["kl"] = kls[j]
    return out


# 3. The stage ------------------------------------------------------------------------------------------------


class Evaluator:
    """`rlhfkit eval`: `Evaluator(cfg).fit()` evaluates, writes `output_dir/eval.json` and returns headline figures."""

    def __init__(self, cfg: EvalConfig):
        self.cfg = cfg
        self.path = os.path.join(cfg.output_dir, "eval.json")
        self.red_team: RedTeam | None = None  # red_team's judges and flags, loaded by `fit`
        self.red_prompts: list[dict] = []  # red_team.prompts' examples
        self.red_parts = None  # `sample`'s rollouts and KLs on them

    def check(self) -> None:
        """Fail before any model loads: an unusable output_dir, an eval.json to keep, a run_dir without metrics."""
        cfg = self.cfg
        check_writable(cfg.output_dir)
        if os.path.exists(self.path) and not cfg.overwrite:
            raise UserError(f"'{self.path}' exists; pass overwrite=true to replace it")
        if cfg.run_dir and not os.path.isfile(os.path.join(cfg.run_dir, "metrics.jsonl")):
            raise UserError(f"run_dir '{cfg.run_dir}' holds no metrics.jsonl")

    def fit(self) -> dict[str, float]:
        cfg = self.cfg
        # 1. Everything that can fail on bad input before the policy loads: the launch, paths, data, judges.
        state = distributed_state()
        log_launch(state)
        self.check()
        device = state.device
        tokenizer = load_tokenizer(cfg.model)
        with state.main_process_first():  # one process tokenises into the cache; the others then read it
            prompts, _ = build_datasets("prompt", self.data_config(cfg.data.eval, cfg.max_prompts), tokenizer, cfg.seed)
            pairs = []
            if cfg.preference_data:
                pairs, _ = build_datasets("preference", self.data_config(cfg.preference_data), tokenizer, cfg.seed)
            capability = []
            if cfg.capability_data:
                capability, _ = build_datasets("sft", self.data_config(cfg.capability_data), tokenizer, cfg.seed)
            self.red_prompts = self.read_red_team_prompts(tokenizer) if cfg.red_team.prompts else []
        scorers = self.load_scorers(tokenizer, device)
        judges: dict[str, Judge] = {name: SourceJudge(s, tokenizer) for name, s in scorers.items()}
        specs = [(ref.rpartition(":")[2], ref, "reward.function") for ref in as_list(cfg.reward.function)]
        specs += [(name.strip(), ref.strip(), "judges") for name, _, ref in (spec.partition("=") for spec in cfg.judges)]
        judges.update({name: python_judge(load_reward_function(ref, key), tokenizer) for name, ref, key in specs})
        agent = AgentOptions(load_format_check(cfg.agent.format_check), cfg.agent.task_judge, cfg.agent.task_threshold)
        agent.check_judge(judges)
        rollout = tool_rollout(cfg, tokenizer)  # None without tools: one turn from `generate`
        check_row_tools(rollout.toolbox if rollout else None, prompts, cfg.data.eval)
        if cfg.red_team.prompts or cfg.red_team.human_flags:
            self.red_team = RedTeam(cfg.red_team, cfg.model.name_or_path, cfg.reference, device, cfg.batch_size)
        # 2. The models, then the evaluation itself.
        policy = load_causal_lm(cfg.model, tokenizer, trainable=False).to(device)
        reference = None
        if cfg.reference is not None:
            ref_cfg = ModelConfig(name_or_path=cfg.reference, gguf_file=cfg.reference_gguf_file, dtype=cfg.model.dtype,
                                  trust_remote_code=cfg.model.trust_remote_code, quantization=cfg.model.quantization)
            _same_tokenizer(load_tokenizer(ref_cfg), tokenizer, f"reference '{cfg.reference}'")
            reference = load_causal_lm(ref_cfg, tokenizer, trainable=False).to(device)
        else:
            logger.info("no reference: reporting the policy alone (no KL, win rates or reference figures)")
        params = cfg.generation
        parts = sample(policy, reference, tokenizer, prompts, params, cfg.batch_size, cfg.seed, state, rollout=rollout)
        if self.red_prompts:  # the red-team prompts, drawn as data.eval's are (episodes, with tools)
            self.red_parts = sample(policy, reference, tokenizer, self.red_prompts, params, cfg.batch_size, cfg.seed,
                                    state, rollout=rollout)
        tax = measure_alignment_tax(policy, reference, capability, tokenizer.pad_token_id, cfg.batch_size, state) \
            if capability else None
        # 3. The main process judges and compares, adds reward-model accuracy and the training run's alarms, writes
        # eval.json (samples last) and prints the table; every process returns the headline figures.
        return _on_main_process(state, lambda: self.report(parts, tokenizer, prompts, judges, scorers, pairs, device, tax,
                                                           agent))

    def report(self, parts, tokenizer, prompts, judges, scorers, pairs, device, tax: AlignmentTax | None = None,
               agent: AgentOptions | None = None) -> dict[str, float]:
        cfg = self.cfg
        result = compare(*parts, tokenizer, prompts, judges, cfg.generation, cfg.num_examples, agent)
        if "agent" in result:  # the gate before reward modelling, on the policy's figures
            pol = result["agent"]["policy"]
            result["gate"] = gate(pol["format_accuracy"], pol["task_completion"], cfg.gate.format_accuracy,
                                  cfg.gate.task_completion)
        accuracy = {name: self.rm_accuracy(scorer, pairs, tokenizer.pad_token_id, device)
                    for name, scorer in scorers.items()} if pairs else {}
        thresholds = AlarmThresholds(alignment_tax_nats=cfg.alarms.alignment_tax_nats)
        if tax is not None:
            result["alarms"] += [dataclasses.asdict(a) for a in
                                 check_alignment_tax([{"label": "policy", ALIGNMENT_TAX_KEY: tax.delta}], thresholds)]
        if cfg.run_dir:
            with open(os.path.join(cfg.run_dir, "metrics.jsonl"), encoding="utf-8") as f:
                history = [json.loads(line) for line in f if line.strip()]
            result["alarms"] += [{**dataclasses.asdict(a), "source": "run_dir"} for a in check_alarms(history, thresholds=thresholds)]
        red_team = None
        if self.red_team is not None:
            red_team, alarms = self.red_team_section(tokenizer)
            result["alarms"] += [{**dataclasses.asdict(a), "source": "red_team"} for a in alarms]
        samples = result.pop("samples")
        report = {"policy_model": cfg.model.name_or_path, "reference_model": cfg.reference,
                  "generation": dataclasses.asdict(cfg.generation), "seed": cfg.seed, **result,
                  "reward_model_accuracy": accuracy, "alignment_tax": tax.as_dict() if tax is not None else None,
                  "red_team": red_team, "samples": samples}
        os.makedirs(cfg.output_dir, exist_ok=True)
        atomic_write_text(os.path.join(cfg.output_dir, "eval_config.yaml"), config_to_yaml(cfg))
        atomic_write_text(self.path, json.dumps(report, indent=2) + "\n")
        print(summary_table(report))
        return headline(report)

    def read_red_team_prompts(self, tokenizer) -> list[dict]:
        """red_team.prompts' examples, read as data.eval's are (with its own columns; a hub dataset's train split);
        errors name the key."""
        r, d = self.cfg.red_team, self.cfg.data
        source = DataConfig(train=r.prompts, columns=r.columns, max_length=d.max_length,
                            max_prompt_length=d.max_prompt_length, truncation=d.truncation, max_samples=r.max_prompts)
        try:
            prompts, _ = build_datasets("prompt", source, tokenizer, self.cfg.seed)
        except UserError as exc:
            raise UserError(f"red_team.prompts: {exc}") from None
        return prompts

    def red_team_section(self, tokenizer) -> tuple[dict, list]:
        """eval.json's `red_team` section and its alarms: both models' responses to the red-team prompts, judged."""
        inputs, kl = [None, None], None
        if self.red_parts is not None:
            pol_parts, ref_parts, kls = self.red_parts
            rows = [example for example in self.red_prompts for _ in range(self.cfg.generation.num_samples)]
            for i, parts in enumerate((pol_parts, ref_parts)):
                if parts:
                    ro = concat_rollouts(parts, tokenizer.pad_token_id)
                    inputs[i] = reward_inputs(tokenizer, ro, rows, trainer_state(0, 0))
            kl = mean_std(kls) if kls else None
        return self.red_team.report(*inputs, len(self.red_prompts), kl)

    def data_config(self, source: str, max_samples: int | None = None) -> DataConfig:
        """`source` as the train split of a DataConfig: the first split `build_datasets` returns."""
        d = self.cfg.data
        return DataConfig(train=source, train_split=d.eval_split, subset=d.subset, columns=d.columns, max_length=d.max_length,
                          max_prompt_length=d.max_prompt_length, truncation=d.truncation, max_samples=max_samples)

    def load_scorers(self, tokenizer, device) -> dict[str, object]:
        """name -> reward-model source: each reward model, and their ensemble when there are several (and
        reward.ensemble is not none)."""
        r, cfg = self.cfg.reward, self.cfg
        members = {}
        for path in r.model:
            source = load_reward_model_source(path, tokenizer, cfg.model.name_or_path, r.quantization, cfg.batch_size,
                                              attn_implementation=cfg.model.attn_implementation)
            source.scorer.model.to(device)
            base = "reward_model" if len(r.model) == 1 else f"reward_model/{os.path.basename(os.path.normpath(path))}"
            name = base if base not in members else f"{base}_{len(members)}"  # two directories of the same name
            members[name] = source
        if len(members) > 1 and r.ensemble != "none":
            members[f"reward_model/ensemble_{r.ensemble}"] = EnsembleSource(list(members.values()), r.ensemble)
        return members

    @torch.no_grad()
    def rm_accuracy(self, source, pairs: list[dict], pad_token_id: int, device) -> float:
        """The fraction of preference `pairs` whose chosen response the reward model (or ensemble) `source` scores
        above the rejected one. The pairs are in the policy's tokens: a reward model with a tokenizer of its own is
        given the pairs in its own tokens (`pairs_for`)."""
        members = source.members if isinstance(source, EnsembleSource) else [source]
        chosen, rejected = [], []
        for member in members:
            c, r = [], []
            own = self.pairs_for(member) if member.retokenize else pairs
            pad = member.scorer.tokenizer.pad_token_id if member.retokenize else pad_token_id
            for start in range(0, len(own), self.cfg.batch_size):
                b = collate_preference(own[start : start + self.cfg.batch_size], pad, actions_only=False).to(device)
                c.append(member.scorer(b.chosen_input_ids, b.chosen_attention_mask, b.chosen_labels != -100))
                r.append(member.scorer(b.rejected_input_ids, b.rejected_attention_mask, b.rejected_labels != -100))
            chosen.append(torch.cat(c))
            rejected.append(torch.cat(r))
        if isinstance(source, EnsembleSource):
            return reward_model_accuracy(reduce_ensemble(torch.stack(chosen), source.reduce),
                                         reduce_ensemble(torch.stack(rejected), source.reduce))
        return reward_model_accuracy(chosen[0], rejected[0])

    def pairs_for(self, source) -> list[dict]:
        """`preference_data` in the reward model's own tokens."""
        pairs, _ = build_datasets("preference", self.data_config(self.cfg.preference_data), source.scorer.tokenizer, self.cfg.seed)
        return pairs


def _on_main_process(state, fn: Callable):
    """`fn()` on the main process; its result, or the UserError it raised, on every process (so that none waits for
    a main process that stopped)."""
    result, error = None, None
    if state.is_main_process:
        try:
            result = fn()
        except UserError as exc:
            error = str(exc)
    if state.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        result, error = broadcast_object_list([result, error])
    if error is not None:
        raise UserError(error)
    return result


def _same_tokenizer(other, tokenizer, what: str) -> None:
    if other.get_vocab() != tokenizer.get_vocab():
        raise UserError(f"{what} has a different tokenizer ({len(other)} tokens) from the policy's ({len(tokenizer)}): "
                        "they must share one, since the KL compares log-probs of the same token ids")


# 4. Reporting ------------------------------------------------------------------------------------------------


def headline(report: dict) -> dict[str, float]:
    """The figures `Evaluator.fit()` returns: "kl", and per judge "reward/<judge>" (the policy's mean),
    "win_rate/<judge>" and "rm_accuracy/<judge>", with tools "agent/format_accuracy", "agent/task_completion" and
    "gate/passed" (1.0 or 0.0; absent when undecided), and with red-teaming "red_team/<side>_harmful_rate". (No "eval/" prefix: the table printed them already, so the CLI's
    closing line does not repeat them.)"""
    out = {"kl": report["kl"]["mean"]} if report["kl"] is not None else {}
    out.update({f"reward/{name}": r["mean"] for name, r in report["policy"]["reward"].items() if r["mean"] is not None})
    out.update({f"win_rate/{name}": w for name, w in report["win_rate"].items() if w is not None})
    out.update({f"rm_accuracy/{name}": a for name, a in report["reward_model_accuracy"].items()})
    if report.get("alignment_tax"):
        out["alignment_tax/delta_nats"] = report["alignment_tax"]["delta_nats"]
    for name, value in ((report.get("agent") or {}).get("policy") or {}).items():
        if name in ("format_accuracy", "task_completion") and value is not None:
            out[f"agent/{name}"] = value
    if report.get("gate") and report["gate"]["passed"] is not None:
        out["gate/passed"] = float(report["gate"]["passed"])
    for side in ("policy", "reference"):
        if (figures := (report.get("red_team") or {}).get(side)) and figures["harmful_rate"] is not None:
            out[f"red_team/{side}_harmful_rate"] = figures["harmful_rate"]
    return out


def summary_table(report: dict) -> str:
    """A compact console table: policy | reference | win rate per figure, then RM accuracy and alarms."""
    pol, ref = report["policy"], report["reference"]

    def cell(v) -> str:
        return f"{'-':>12}" if v is None else f"{v:>12.4g}"

    kl = report["kl"] or {}
    rows = [("KL(policy||ref) nats", kl.get("mean"), None, None), ("  std across samples", kl.get("std"), None, None),
            ("length, tokens", pol["length"]["mean"], ref and ref["length"]["mean"], None)]
    rows += [(name, pol[key], ref and ref[key], None) for name, key in (
        ("distinct-1", "distinct_1"), ("distinct-2", "distinct_2"), ("words per response", "words_avg"),
        ("top response share", "top_share"), ("eos rate", "eos_rate"), ("truncation rate", "truncation_rate"),
        ("empty rate", "empty_rate"))]
    rows += [(f"reward: {name}", r["mean"], ref and ref["reward"][name]["mean"], report["win_rate"].get(name))
             for name, r in pol["reward"].items()]
    rows += [(f"RM accuracy: {name}", a, None, None) for name, a in report["reward_model_accuracy"].items()]
    if tax := report.get("alignment_tax"):
        rows += [("capability NLL, nats/token", tax["policy_nll"], tax["reference_nll"], None),
                 ("  alignment tax, nats/token", tax["delta_nats"], None, None)]
    if agent := report.get("agent"):
        rows += [(label, agent["policy"][key], agent["reference"] and agent["reference"][key], None) for label, key in (
            ("format accuracy", "format_accuracy"), ("task completion", "task_completion"),
            ("tool calls / episode", "calls_per_episode"), ("  failed / call", "failures_per_call"),
            ("  malformed / call", "malformed_per_call"), ("turns / episode", "turns_per_episode"))]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':<{width}} {'policy':>12} {'reference':>12} {'win rate':>12}"]
    lines += [f"{name:<{width}} {cell(p)} {cell(r)} {cell(w)}" for name, p, r, w in rows]
    lines += summary_lines(report["red_team"]) if report.get("red_team") else []
    lines += gate_lines(report["gate"]) if report.get("gate") else []
    lines += [f"alarm {a['name']}: {a['message']}" for a in report["alarms"]] or ["alarms: none"]
    return "\n".join(lines)
