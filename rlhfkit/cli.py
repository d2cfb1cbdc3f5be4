"""`rlhfkit <stage> --config FILE [key.sub=value ...]`: one entry point for every stage.

Bad input (a `UserError` anywhere: config, data, model path, output_dir) prints one line and exits with status 2,
without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time

from rlhfkit.errors import UserError

# stage -> (config class, trainer class, what it trains), imported lazily so `--help` is instant.
STAGES = {
    "sft": ("rlhfkit.config:SFTConfig", "rlhfkit.trainers.sft:SFTTrainer", "supervised fine-tuning on prompt/completion or chat data"),
    "rm": ("rlhfkit.config:RMConfig", "rlhfkit.trainers.reward:RewardTrainer", "reward model on chosen/rejected pairs (Bradley-Terry)"),
    "ppo": ("rlhfkit.config:OnlineConfig", "rlhfkit.trainers.online:OnlineTrainer", "PPO with a critic, GAE and a KL penalty"),
    "rloo": ("rlhfkit.config:OnlineConfig", "rlhfkit.trainers.online:OnlineTrainer", "RLOO: k samples per prompt, leave-one-out baseline"),
    "grpo": ("rlhfkit.config:OnlineConfig", "rlhfkit.trainers.online:OnlineTrainer", "GRPO (algo.algorithm=dr_grpo|dapo for the variants)"),
    "reinforce_pp": ("rlhfkit.config:OnlineConfig", "rlhfkit.trainers.online:OnlineTrainer", "REINFORCE++ (algo.algorithm=reinforce_pp_baseline for the group baseline)"),
    "dpo": ("rlhfkit.config:DPOConfig", "rlhfkit.trainers.preference:PreferenceTrainer", "direct preference optimisation on chosen/rejected pairs (algo.loss_type: sigmoid = DPO/cDPO, ipo, hinge, simpo)"),
    "orpo": ("rlhfkit.config:ORPOConfig", "rlhfkit.trainers.preference:PreferenceTrainer", "odds-ratio preference optimisation: SFT + odds-ratio loss on pairs, no reference model"),
    "kto": ("rlhfkit.config:KTOConfig", "rlhfkit.trainers.kto:KTOTrainer", "Kahneman-Tversky optimisation on unpaired completions labelled desirable or not"),
    "eval": ("rlhfkit.config:EvalConfig", "rlhfkit.evaluation.evaluate:Evaluator", "evaluate a policy against a reference: rewards per judge, KL, win rates, length, diversity, reward-hacking alarms"),
    "rft": ("rlhfkit.config:RFTConfig", "rlhfkit.trainers.rft:RFTTrainer", "best-of-n rejection-sampling fine-tuning: sample n per prompt, keep the best by the reward, SFT on them; iterated"),
}


# Online stages fix the algorithm family; the config may pick a variant within it.
ONLINE_FAMILIES = {
    "ppo": ("ppo",), "rloo": ("rloo",), "grpo": ("grpo", "dr_grpo", "dapo"),
    "reinforce_pp": ("reinforce_pp", "reinforce_pp_baseline"),
}


def _load(ref: str):
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhfkit", description="Align language models with human preferences.")
    sub = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")
    for name, (_, _, help_text) in STAGES.items():
        p = sub.add_parser(name, help=help_text, description=f"rlhfkit {name}: {help_text}")
        p.add_argument("--config", help="YAML config file (see configs/)")
        p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
        p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides, applied after the file")
    p = sub.add_parser("dashboard", help="draw a run's dashboard.png and write its report.html",
                       description="rlhfkit dashboard: draw a finished (or running) run's dashboard.png and report.html")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run's output_dir (holding config.yaml and metrics.jsonl)")
    p.add_argument("--out", metavar="DIR", help="where to write them (default: RUN_DIR)")
    p = sub.add_parser("demo", help="end-to-end RLHF of SmolLM2-135M on a sentiment task: SFT, reward model, PPO/DPO/best-of-n, evaluation",
                       description="rlhfkit demo: SFT -> reward model -> PPO, DPO and best-of-4 on the built-in reviews task "
                                   "(gold judge: VADER sentiment), evaluated on held-out prompts; offline")
    p.add_argument("--quick", action="store_true", help="the same path on a tiny random model, in under 20 seconds (plumbing only)")
    p.add_argument("--output-dir", default="runs/demo", metavar="DIR", help="where every stage's outputs go (default: runs/demo)")
    p.add_argument("--from-stage", default="prompts", choices=["prompts", "sft", "rm", "ppo", "dpo", "eval"],
                   help="rerun from this stage on, reusing the earlier stages' outputs in --output-dir (default: all)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the demo in a non-empty --output-dir (refused without this or --from-stage)")
    return parser


def _setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("rlhfkit: %(message)s"))
    log = logging.getLogger("rlhfkit")
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # weight loading/saving bars would bury rlhfkit's own progress


def run_stage(stage: str, config: str | None, overrides: list[str], print_config: bool = False) -> dict:
    from rlhfkit.config import config_to_yaml, load_config

    config_ref, trainer_ref, _ = STAGES[stage]
    family = ONLINE_FAMILIES.get(stage)
    defaults = {"algo": {"algorithm": family[0]}} if family else None
    cfg = load_config(_load(config_ref), config, overrides, defaults)
    if family and cfg.algo.algorithm not in family:
        raise UserError(f"config key 'algo.algorithm': `rlhfkit {stage}` runs one of {', '.join(family)}, got {cfg.algo.algorithm!r}")
    if print_config:
        print(config_to_yaml(cfg), end="")
        return {}
    trainer = _load(trainer_ref)(cfg)
    t0 = time.time()
    result = trainer.fit()
    summary = ", ".join(f"{k}={v:.4g}" for k, v in result.items() if k.startswith(("loss", "eval/", "accuracy")))
    print(f"rlhfkit {stage}: done in {time.time() - t0:.1f}s; model saved to {cfg.output_dir}" + (f" ({summary})" if summary else ""))
    return result


def run_dashboard(run_dir: str, out: str | None) -> None:
    from rlhfkit.evaluation.dashboard import write_dashboard
    from rlhfkit.evaluation.report import write_report

    out = out or run_dir
    print(write_dashboard(run_dir, os.path.join(out, "dashboard.png")))
    print(write_report(run_dir, out_path=os.path.join(out, "report.html")))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _setup_logging()
    try:
        if args.stage == "dashboard":
            run_dashboard(args.run_dir, args.out)
        elif args.stage == "demo":
            from rlhfkit.demo import run_demo

            run_demo(args.output_dir, quick=args.quick, from_stage=args.from_stage, overwrite=args.overwrite)
        else:
            run_stage(args.stage, args.config, args.overrides, args.print_config)
    except UserError as exc:
        print(f"rlhfkit: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rlhfkit: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
