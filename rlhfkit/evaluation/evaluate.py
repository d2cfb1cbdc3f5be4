"""`rlhfkit eval`: sample the policy and the reference on held-out prompts with the same seed, judge both, compare.

`evaluate(...)` is the core, usable from Python on loaded models; `Evaluator` is the `rlhfkit eval` stage around it
(load models, prompts and judges from an `EvalConfig`, add reward-model accuracy and a run's alarms, write
`output_dir/eval.json`, print a summary table). The parts are beside it: `samples` draws through the rollout component
(as online RL does; with tools, episodes with environments of their own) and holds one model's responses in a typed
record, `judges` scores them through the reward-source protocol, `summary` prints and returns the figures. Log-probs
go through `models.rollout_logprobs`, as in online RL, so the KL here is the `objective/kl` a training run logs.
Launched on several processes, `rlhfkit eval` shares the generation batches out among them (the same samples as one
process) and the main process alone judges, writes eval.json and prints the table.

A judge is a reward source (`rewards.RewardSource`, `score(rollout, inputs)`): a Python reward function under TRL's
contract (`judges.python_judge`), a reward model or an ensemble. Each is called once per model, on all of that model's
samples, which are decoded once whatever the number of judges.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable

import torch

from rlhfkit.config import DataConfig, EvalConfig, GenerationConfig, ModelConfig, config_to_yaml
from rlhfkit.data import build_datasets
from rlhfkit.errors import UserError
from rlhfkit.evaluation.agent import AgentOptions, gate, load_format_check
from rlhfkit.evaluation.alarms import (
    ALIGNMENT_TAX_KEY, DISTINCT_KEY, EMPTY_KEY, EOS_KEY, TOP_SHARE_KEY, WORDS_KEY, AlarmThresholds, SampleStats,
    check_alarms,
)
from rlhfkit.evaluation.alarms import alignment_tax as check_alignment_tax
from rlhfkit.evaluation.capability import AlignmentTax, measure_alignment_tax
from rlhfkit.evaluation.judges import (
    judge, paired_win_rate, pairs_in_tokens_of, python_judge, reward_model_judges, rm_accuracy,
)
from rlhfkit.evaluation.metrics import mean_std
from rlhfkit.evaluation.red_team import RedTeam
from rlhfkit.evaluation.samples import Samples, example, sample, summarize
from rlhfkit.evaluation.summary import headline, summary_table
from rlhfkit.io import atomic_write_text, check_writable
from rlhfkit.launch import distributed_state, log_launch
from rlhfkit.models import load_causal_lm, load_tokenizer
from rlhfkit.objects import Objects
from rlhfkit.reward_functions import load_reward_function, trainer_state
from rlhfkit.rewards import RewardSource, as_list, reward_inputs
from rlhfkit.rollout.maker import FreshRollout, check_prompt_room, check_row_tools, toolbox_of
from rlhfkit.types import Rollout

logger = logging.getLogger("rlhfkit")


@torch.no_grad()
def evaluate(
    policy, reference, tokenizer, prompts: list[dict], judges: dict[str, RewardSource], params: GenerationConfig,
    batch_size: int = 16, seed: int = 0, num_examples: int = 16,
) -> dict:
    """Sample `policy` and `reference` on `prompts` with the same seed per batch; judge, compare, raise alarms.

    Args:
        policy, reference: causal LMs sharing `tokenizer`, on one device; `reference` may be None (the policy alone:
            no KL, win rates or reference figures).
        prompts: prompt examples `{"prompt_ids", "prompt", "columns"}` (`data.build_datasets("prompt", ...)`).
        judges: name -> reward source; each is called once per model, on all its samples.
        params: sampling parameters; `num_samples` responses per prompt (the policy's j-th sample of a prompt is
            compared with the reference's j-th).
        batch_size: prompts per sampling batch; batch i is drawn under seed `seed + i` by both models, so a
            reference identical to the policy gives identical responses (KL 0, every win rate exactly 0.5).
        num_examples: side-by-side samples kept in the result.

    Returns the eval.json figures: "num_prompts", "num_samples", "policy" and "reference" ({"length": {mean, std},
    "distinct_1", "distinct_2", "words_avg", "top_share" (`alarms.diversity_figures`), "eos_rate", "truncation_rate",
    "empty_rate", "reward": {judge: {mean, std, n}}, "logged": {name: mean of what Python judges logged with
    `log_metric`}}; reference None without one), "kl" ({mean, std} of the per-sequence KL(policy || reference) in
    nats on policy samples, or None), "win_rate" ({judge: P(policy beats reference)}), "alarms" ([{name, message,
    source}]), "samples".
    """
    samples = sample(policy, reference, tokenizer, prompts, params, batch_size, seed)
    return compare(*samples, tokenizer, prompts, judges, params, num_examples)


def judged_samples(parts: list[Rollout], tokenizer, judges: dict[str, RewardSource], rows: list[dict]) -> Samples:
    """One model's rollouts (in prompt order) as one, judged: `Samples` with every judge's scores."""
    ro = Rollout.concat(parts, tokenizer.pad_token_id)
    return Samples.of(ro, tokenizer, judge(judges, ro, rows, tokenizer))


def compare(pol_parts: list[Rollout], ref_parts: list[Rollout], kls: list[float], tokenizer, prompts: list[dict],
            judges: dict[str, RewardSource], params: GenerationConfig, num_examples: int = 16,
            agent: AgentOptions | None = None) -> dict:
    """`evaluate`'s figures from `sample`'s rollouts and KLs: judge, summarise, compare, raise alarms; with tool
    episodes, "agent" too (`evaluation.agent`: `agent`'s format rule and task judge, default none)."""
    rows = [e for e in prompts for _ in range(params.num_samples)]  # each row's prompt example
    pol = judged_samples(pol_parts, tokenizer, judges, rows)
    ref = judged_samples(ref_parts, tokenizer, judges, rows) if ref_parts else None
    result = {
        "num_prompts": len(prompts), "num_samples": len(pol.texts),
        "policy": summarize(pol), "reference": summarize(ref) if ref else None,
        "kl": mean_std(kls) if ref else None,
        "win_rate": {name: paired_win_rate(pol.scores[name], ref.scores[name]) for name in judges} if ref else {},
    }
    if pol.tools is not None:
        result["agent"] = (agent or AgentOptions()).section(pol, ref)
    # Alarms on the samples: the policy's score-length correlation, and reference -> policy as a 2-row history
    # (diversity collapse, more empty or truncated responses).
    history = [] if ref is None else [
        {"label": label, DISTINCT_KEY: s["distinct_2"], WORDS_KEY: s["words_avg"], TOP_SHARE_KEY: s["top_share"],
         EMPTY_KEY: s["empty_rate"], EOS_KEY: s["eos_rate"]}
        for label, s in (("reference", result["reference"]), ("policy", result["policy"]))]
    alarms = check_alarms(history, SampleStats(pol.lengths, pol.scores))
    result["alarms"] = [{**dataclasses.asdict(a), "source": "samples"} for a in alarms]
    result["samples"] = [example(pol, ref, kls, j) for j in range(min(num_examples, len(pol.texts)))]
    return result


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
            prompts = build_datasets("prompt", self.data_config(cfg.data.eval, cfg.max_prompts), tokenizer,
                                     cfg.seed)[0] if cfg.data.eval else []  # (none: red-teaming alone)
            pairs = []
            if cfg.preference_data:
                pairs, _ = build_datasets("preference", self.data_config(cfg.preference_data), tokenizer, cfg.seed)
            capability = []
            if cfg.capability_data:
                capability, _ = build_datasets("sft", self.data_config(cfg.capability_data), tokenizer, cfg.seed)
            self.red_prompts = self.read_red_team_prompts(tokenizer) if cfg.red_team.prompts else []
        scorers = reward_model_judges(cfg, tokenizer, device)
        judges: dict[str, RewardSource] = dict(scorers)
        specs = [(ref.rpartition(":")[2], ref, "reward.function") for ref in as_list(cfg.reward.function)]
        specs += [(name.strip(), ref.strip(), "judges") for name, _, ref in (spec.partition("=") for spec in cfg.judges)]
        judges.update({name: python_judge(load_reward_function(ref, key)) for name, ref, key in specs})
        agent = AgentOptions(load_format_check(cfg.agent.format_check), cfg.agent.task_judge, cfg.agent.task_threshold)
        agent.check_judge(judges)
        # The tools are imported and described here, before any model loads; episodes get environments of their own.
        rollout = FreshRollout(cfg, tokenizer, Objects(toolbox=toolbox_of(cfg, Objects())))
        check_row_tools(rollout.toolbox, prompts, cfg.data.eval)
        for examples, source in ((prompts, cfg.data.eval), (self.red_prompts, "red_team.prompts")):
            check_prompt_room(rollout.toolbox, tokenizer, examples, cfg.data.max_prompt_length, source)
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
        parts = sample(policy, reference, tokenizer, prompts, params, cfg.batch_size, cfg.seed, state,
                       rollout=rollout) if prompts else None
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
        if parts is not None:
            result = compare(*parts, tokenizer, prompts, judges, cfg.generation, cfg.num_examples, agent)
        else:  # red-teaming alone: no held-out samples to judge
            result = {"num_prompts": 0, "num_samples": 0, "policy": None, "reference": None, "kl": None, "win_rate": {},
                      "alarms": [], "samples": []}
        if "agent" in result:  # the gate before reward modelling, on the policy's figures
            pol = result["agent"]["policy"]
            result["gate"] = gate(pol["format_accuracy"], pol["task_completion"], cfg.gate.format_accuracy,
                                  cfg.gate.task_completion)
        own_pairs = pairs_in_tokens_of(self.data_config(cfg.preference_data), cfg.seed) if pairs else None
        accuracy = {name: rm_accuracy(scorer, pairs, tokenizer.pad_token_id, device, cfg.batch_size, own_pairs)
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
                    ro = Rollout.concat(parts, tokenizer.pad_token_id)
                    inputs[i] = reward_inputs(tokenizer, ro, rows, trainer_state(0, 0))
            kl = mean_std(kls) if kls else None
        return self.red_team.report(*inputs, len(self.red_prompts), kl)

    def data_config(self, source: str, max_samples: int | None = None) -> DataConfig:
        """`source` as the train split of a DataConfig: the first split `build_datasets` returns."""
        d = self.cfg.data
        return DataConfig(train=source, train_split=d.eval_split, subset=d.subset, columns=d.columns, max_length=d.max_length,
                          max_prompt_length=d.max_prompt_length, truncation=d.truncation, max_samples=max_samples)


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


