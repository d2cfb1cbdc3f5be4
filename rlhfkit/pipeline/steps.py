"""How one resolved stage runs, as its own command would, and the figures it reports.

- an `rlhfkit` stage runs through `stages.run_stage` in this process (the same validation, outputs and checkpoints as
  `rlhfkit <stage>`), or under `accelerate launch` when its `launch` says so (its effective config written to
  `output_dir/.pipeline/<name>.yaml`, then `accelerate launch ARGS -m rlhfkit.cli <stage> --config that`);
- `label` makes its items once (`rlhfkit label`'s own `prepare`, which resumes a database made for the same inputs),
  serves the labelling page while the pipeline waits, and when every item is judged writes `pairs.jsonl` (collect)
  or the human win rate (compare);
- `judge` samples the policy and lets reward functions or reward models pick each prompt's pair (`pairs.jsonl`);
- `python` calls a built-in task's function with a `StepContext` and its `args`.
Figures come back from disk, so a stage run under a launcher, run here, or skipped reports the same ones: a training
run's last value of every metric in metrics.jsonl, an eval's headline figures and its alarm count.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass

from rlhfkit.errors import UserError
from rlhfkit.io import atomic_write_text, read_jsonl_rows
from rlhfkit.pipeline.resolve import Resolved, label_options, private_file
from rlhfkit.pipeline.spec import JUDGE, LABEL, PYTHON

logger = logging.getLogger("rlhfkit")


@dataclass(frozen=True)
class StepContext:
    """What a `python` stage's function gets: its folder and the folders of every stage so far, by name."""

    output_dir: str  # this stage's folder (created, empty on a fresh run)
    root: str  # the pipeline's output_dir
    dirs: dict  # stage name -> folder, for every stage resolved so far in this run
    resume: bool  # an earlier start of this stage was interrupted
    vars: dict  # the pipeline file's vars, as substituted (a step may record them beside its outputs)

    def path(self, stage: str, *parts: str) -> str:
        """A file in an earlier stage's folder."""
        return os.path.join(self.dirs[stage], *parts)

    def path_out(self, *parts: str) -> str:
        """A file in this stage's folder."""
        return os.path.join(self.output_dir, *parts)


def run(r: Resolved, mode: str, root: str, dirs: dict, variables: dict) -> dict[str, float]:
    """Run stage `r` (mode: "fresh", "resume" from its newest checkpoint, or "replace" an earlier run of it) and
    return its figures."""
    if r.stage == PYTHON:
        os.makedirs(r.dir, exist_ok=True)
        ctx = StepContext(r.dir, root, dict(dirs), mode == "resume", dict(variables))
        figures = r.cfg["function"](ctx, **r.cfg["args"]) or {}
        if not isinstance(figures, dict):
            raise UserError(f"stage '{r.name}': {r.cfg['run']} returned {type(figures).__name__}, expected a dict of "
                            "figures or None")
        return {k: float(v) for k, v in figures.items() if isinstance(v, (int, float))}
    if r.stage == LABEL:
        return run_label(r)
    if r.stage == JUDGE:
        return run_judge(r)
    cfg = dataclasses.replace(r.cfg, overwrite=mode == "replace",
                              **({"resume": mode == "resume"} if hasattr(r.cfg, "resume") else {}))
    for wire in r.wires:
        if wire.parts:
            join_files(wire.parts, wire.value)
    if r.spec.launch is not None:
        launched(r, cfg, root)
    else:
        from rlhfkit.stages import run_stage

        run_stage(r.stage, cfg)
    return figures_of(r.stage, r.dir)


def launched(r: Resolved, cfg, root: str) -> None:
    """`accelerate launch <launch args> -m rlhfkit.cli <stage> --config <the effective config>`."""
    from rlhfkit.config import config_to_yaml

    path = private_file(root, r.dir, ".yaml")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write_text(path, config_to_yaml(cfg))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *r.spec.launch, "-m", "rlhfkit.cli", r.stage,
           "--config", path]
    print("  " + " ".join(cmd[1:]), flush=True)
    rc = subprocess.run(cmd).returncode
    if rc != 0:
        raise UserError(f"stage '{r.name}' under accelerate launch exited with status {rc} (its output is above); "
                        "the same command resumes it")


def join_files(parts: tuple[str, ...], path: str) -> None:
    """The JSON-lines files `parts`, in order, as one file at `path` (a retrained reward model's comparisons so far)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    text = ""
    for part in parts:
        with open(part, encoding="utf-8") as f:
            body = f.read()
        text += body if not body or body.endswith("\n") else body + "\n"
    atomic_write_text(path, text)


def figures_of(stage: str, folder: str) -> dict[str, float]:
    """A finished stage's figures from its folder: eval's headline and alarm count, else metrics.jsonl's last value
    of every metric."""
    if stage == "eval":
        from rlhfkit.evaluation.summary import headline

        with open(os.path.join(folder, "eval.json"), encoding="utf-8") as f:
            report = json.load(f)
        return {**headline(report), "alarms": float(len(report.get("alarms") or []))}
    path = os.path.join(folder, "metrics.jsonl")
    figures: dict[str, float] = {}
    for row in read_jsonl_rows(path) if os.path.isfile(path) else []:
        figures.update({k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return figures


# `label`: the pipeline waits for people ----------------------------------------------------------------------------


def run_label(r: Resolved) -> dict[str, float]:
    """`rlhfkit label`'s own checks, items and server (`serve_labels`), waiting until every item is judged, then the
    labels' outputs."""
    from rlhfkit.label.command import serve_labels

    store = serve_labels(label_options(r.cfg, r.dir), until_done_poll_s=float(r.cfg.get("poll_s", 2.0)))
    return label_outputs(r, store)


def label_outputs(r: Resolved, store) -> dict[str, float]:
    from rlhfkit.label.export import preference_rows, write_jsonl
    from rlhfkit.label.figures import human_win_rate

    judgements = store.judgements()
    if r.cfg.get("mode", "collect") == "collect":
        rows = preference_rows(judgements)
        write_jsonl(rows, os.path.join(r.dir, "pairs.jsonl"))
        return {"labels/pairs": float(len(rows)), "labels/judgements": float(len(judgements))}
    human = human_win_rate(judgements)
    figures = {"human/win_rate": human.win_rate, "human/win_rate_low": human.interval[0],
               "human/win_rate_high": human.interval[1], "human/judgements": float(human.n)}
    atomic_write_text(os.path.join(r.dir, "human_win_rate.json"), json.dumps(dataclasses.asdict(human), indent=2))
    return figures


# `judge`: comparisons from reward functions or a reward-model ensemble --------------------------------------------


def run_judge(r: Resolved) -> dict[str, float]:
    """`num_samples` responses of `model` to each prompt (`rlhfkit label`'s sampling), scored by the judge's reward
    sources (reward.function under TRL's contract, reward.model directories: their mean, an ensemble), summed; each
    prompt's best and worst response become one preference pair in `pairs.jsonl` (ties dropped)."""
    from rlhfkit.config import GenerationConfig
    from rlhfkit.label.candidates import SamplingSpec, sample_groups

    cfg = r.cfg
    k = int(cfg.get("num_samples", 2))
    if k < 2:
        raise UserError(f"stage '{r.name}': num_samples must be at least 2 (a pair per prompt), got {k}")
    generation = GenerationConfig(**{**(cfg.get("generation") or {}), "num_samples": k})
    groups = sample_groups(SamplingSpec(cfg["model"], cfg["prompts"], generation, None, int(cfg.get("seed", 0)),
                                        int(cfg.get("batch_size", 8)), cfg.get("max_prompts")))
    scores = judge_scores(cfg["reward"], [(g.prompt, c.content) for g in groups for c in g.responses])
    rows, ties = [], 0
    for i, g in enumerate(groups):
        s = scores[i * k : (i + 1) * k]
        best, worst = max(range(k), key=s.__getitem__), min(range(k), key=s.__getitem__)
        if s[best] == s[worst]:
            ties += 1
            continue
        rows.append({"prompt": g.prompt, "chosen": g.responses[best].content, "rejected": g.responses[worst].content,
                     "chosen_score": s[best], "rejected_score": s[worst], "judge": "rlhfkit pipeline judge"})
    if not rows:
        raise UserError(f"stage '{r.name}': the judge tied every prompt's {k} responses, so there is no preference "
                        "pair to learn from: sample more (num_samples, max_prompts) or judge with finer rewards")
    os.makedirs(r.dir, exist_ok=True)
    atomic_write_text(os.path.join(r.dir, "pairs.jsonl"), "".join(json.dumps(row) + "\n" for row in rows))
    return {"judge/pairs": float(len(rows)), "judge/ties": float(ties),
            "judge/mean_score": sum(scores) / len(scores) if scores else 0.0}


def judge_scores(reward: dict, texts: list[tuple]) -> list[float]:
    """Σ of each source's score per (prompt, response): every function in reward.function, the mean of the reward
    models in reward.model (an ensemble's mean, as `reward.ensemble: mean`)."""
    from rlhfkit.label.command import reward_scores
    from rlhfkit.reward_functions import RewardInputs, load_reward_function

    total = [0.0] * len(texts)
    refs = reward.get("function") or []
    for ref in [refs] if isinstance(refs, str) else refs:
        fn = load_reward_function(ref, "reward.function")
        values = fn(RewardInputs([p for p, _ in texts], [c for _, c in texts], [[] for _ in texts]))
        total = [t + (v or 0.0) for t, v in zip(total, values)]
    models = reward.get("model") or []
    for path in models:
        values = reward_scores(path, texts)
        total = [t + (v or 0.0) / len(models) for t, v in zip(total, values)]
    return total
