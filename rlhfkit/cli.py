"""`rlhfkit <stage> --config FILE [key.sub=value ...]`: one entry point for every stage.

Bad input (a `UserError` anywhere: config, data, model path, output_dir) prints one line and exits with status 2,
without a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from importlib.metadata import version

from rlhfkit.errors import UserError
from rlhfkit.stages import STAGES, stage_config


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose refusal is one line, as every other refusal of rlhfkit (argparse writes its usage
    first); the subcommands' parsers are of this class too."""

    def error(self, message: str):
        _say(f"rlhfkit: error: {message} (see `{self.prog} --help`)")
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rlhfkit", description="Align language models with human preferences.")
    parser.add_argument("--version", action="version", version=f"rlhfkit {version('rlhfkit')}")
    parser.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")
    for name, (_, _, help_text) in STAGES.items():
        p = sub.add_parser(name, help=help_text, description=f"rlhfkit {name}: {help_text}")
        p.add_argument("--config", help="YAML config file (see configs/)")
        p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
        p.add_argument("--help-config", action="store_true",
                       help="print every config key of this stage (type, default, range, meaning) and exit")
        p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides, applied after the file")
    _add_plan_parser(sub)
    p = sub.add_parser("dashboard", help="draw a run's dashboard.png and write its report.html",
                       description="rlhfkit dashboard: draw a finished (or running) run's dashboard.png and report.html")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run's output_dir (holding config.yaml and metrics.jsonl)")
    p.add_argument("--out", metavar="DIR", help="where to write them (default: RUN_DIR)")
    p = sub.add_parser("pipeline", help="run a pipeline file: its stages in order with their gates, wired, resumable, "
                                         "iterated, with one report",
                       description="rlhfkit pipeline: every stage of the file in order (SFT -> RM -> policy -> eval, "
                                   "label, iterations), gated, skipped when done, resumed when interrupted; "
                                   "report.html at its output_dir (docs/pipeline.md)")
    p.add_argument("--config", required=True, metavar="PIPELINE.yaml", help="the pipeline file (see configs/pipelines/)")
    p.add_argument("--from", dest="from_stage", metavar="STAGE", help="rerun this stage and every later one")
    p.add_argument("--continue-past-gates", action="store_true",
                   help="run on when a gate fails, recording it in pipeline.json and the report")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="output_dir=, iterations=, vars.NAME=, STAGE.key.sub= (a stage's overrides), STAGE.gate.FIGURE=")
    p = sub.add_parser("demo", help="end-to-end RLHF of SmolLM2-135M on a sentiment task: SFT, reward model, PPO/DPO/best-of-n, evaluation",
                       description="rlhfkit demo: SFT -> reward model -> PPO, DPO and best-of-4 on the built-in reviews task "
                                   "(gold judge: VADER sentiment), evaluated on held-out prompts; offline")
    p.add_argument("--quick", action="store_true", help="the whole path, online DPO included, on a tiny random model, in "
                                                        "under a minute (plumbing only)")
    p.add_argument("--full", action="store_true", help="add online DPO (the same reward model and prompts as PPO; about "
                                                       "1.3x PPO's time)")
    p.add_argument("--agent", action="store_true", help="the agent task instead: SFT on tool-using and direct traces, GRPO "
                                                        "with a calculator tool, evaluated with and without tools")
    p.add_argument("--seed", type=int, default=0, help="the run's seed: data, sampling and training (default: 0)")
    p.add_argument("--output-dir", metavar="DIR", help="where every stage's outputs go (default: runs/demo, with --agent "
                                                       "runs/agent)")
    p.add_argument("--from-stage", metavar="STAGE",
                   help="rerun this stage and the later ones, reusing the earlier stages' outputs in --output-dir (the "
                        "stages of configs/pipelines/demo.yaml: prompts, sft_data, sft, pairs, rm, ppo, online_dpo, "
                        "dpo, eval; of agent.yaml: prompts, sft, grpo, eval). Without it, the same command skips the "
                        "stages already done with the same settings and resumes an interrupted one")
    p.add_argument("--overwrite", action="store_true", help="rerun every stage, replacing the demo's earlier outputs")
    from rlhfkit.label.command import add_label_parser  # the arguments live with the command

    add_label_parser(sub)
    for stage_parser in sub.choices.values():  # also after the stage; SUPPRESS keeps a --verbose given before it
        stage_parser.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    return parser


VERBOSE_HELP = ("show the debug log too: the notices dependencies print when imported (kernels, bitsandbytes) and "
                "transformers' warnings")


def _add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="memory per process (by part and phase) and time per step of a stage on a device, "
                                    "from config.json alone; whether it fits, and what to change so it does",
                       description="rlhfkit plan: plan a stage's memory and time before it runs (docs/memory.md)")
    p.add_argument("plan_stage", metavar="STAGE", help="the stage to plan: sft, rm, dpo, orpo, kto, ppo, rloo, grpo, "
                                                       "reinforce_pp, online_dpo, rft")
    p.add_argument("--config", help="the stage's YAML config file")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--device", help="a device of the table (H100-80GB, H200-141GB, A100-40GB, A100-80GB, L4, "
                                        "RTX-4090) or cpu (this machine's RAM)")
    where.add_argument("--memory", type=float, metavar="GB", help="a device known by its memory (GB = 2**30 bytes)")
    p.add_argument("--processes", type=int, default=1, metavar="N", help="processes the run is launched with (default 1)")
    p.add_argument("--sharding", default="none", choices=["none", "zero2", "zero3", "fsdp"],
                   help="how the processes split the state (default none: each holds all, as DDP)")
    p.add_argument("--offload", action="store_true", help="the optimizer states in CPU memory (DeepSpeed offload)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (Plan.to_dict) instead of text")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides, applied after the file")


def run_plan(args) -> None:
    """`rlhfkit plan`: the plan as text or JSON on stdout."""
    import json

    from rlhfkit.plan import plan
    from rlhfkit.plan.render import render

    result = plan(args.plan_stage, config=args.config, overrides=args.overrides, device=args.device,
                  memory_gb=args.memory, processes=args.processes, sharding=args.sharding, offload=args.offload)
    print(json.dumps(result.to_dict(), indent=1) if args.json else render(result))


def _process_rank() -> int:
    """This process's global rank as the launcher set it (torchrun, accelerate launch, MPI); 0 when launched alone."""
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def _setup_logging(verbose: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("rlhfkit: %(message)s"))
    log = logging.getLogger("rlhfkit")
    log.handlers[:] = [handler]
    # Under torchrun / accelerate launch, information is logged once (process 0); warnings and errors by every process.
    # --verbose: the debug log too, which holds the dependencies' import-time notices (rlhfkit.QUIETED_LOGGERS).
    log.setLevel(logging.DEBUG if verbose else logging.INFO if _process_rank() == 0 else logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    if verbose:
        hf_logging.set_verbosity_warning()
    else:
        hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # weight loading/saving bars would bury rlhfkit's own progress


def run_command(stage: str, config: str | None, overrides: list[str], print_config: bool = False) -> dict:
    """`rlhfkit <stage>`: `rlhfkit.train` on the YAML file and overrides, then a closing line; or, with
    `--print-config`, the resolved config printed instead."""
    if print_config:
        from rlhfkit.config import config_to_yaml

        print(config_to_yaml(stage_config(stage, config, overrides)), end="")
        return {}
    from rlhfkit.api import train

    t0 = time.time()
    result = train(stage, config=config, overrides=overrides)
    summary = ", ".join(f"{k}={v:.4g}" for k, v in result.metrics.items() if k.startswith(("loss", "eval/", "accuracy")))
    if _process_rank() == 0:
        print(f"rlhfkit {stage}: done in {time.time() - t0:.1f}s; model saved to {result.output_dir}"
              + (f" ({summary})" if summary else ""))
    return result.metrics


def run_dashboard(run_dir: str, out: str | None) -> None:
    from rlhfkit.evaluation.dashboard import write_dashboard
    from rlhfkit.evaluation.report import write_report

    out = out or run_dir
    print(write_dashboard(run_dir, os.path.join(out, "dashboard.png")))
    print(write_report(run_dir, out_path=os.path.join(out, "report.html")))


def _say(line: str) -> None:
    """One stderr line in one write: every process of a launch may print it into one shared pipe, and a line written
    in two calls (text, then newline) interleaves with the others'."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.stage == "plan" and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides += extra  # overrides after --device and the like
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _setup_logging(getattr(args, "verbose", False))
    try:
        if args.stage == "dashboard":
            run_dashboard(args.run_dir, args.out)
        elif args.stage == "demo":
            from rlhfkit.tasks.demos import run_demo  # only `rlhfkit demo` pays for its imports

            if args.full and args.agent:
                raise UserError("--full adds online DPO to the reviews demo; it does not apply with --agent")
            run_demo("agent" if args.agent else "demo", args.output_dir, quick=args.quick, seed=args.seed,
                     from_stage=args.from_stage, overwrite=args.overwrite, full=args.full)
        elif args.stage == "plan":
            run_plan(args)
        elif args.stage == "pipeline":
            from rlhfkit.pipeline import run as run_pipeline

            run_pipeline(args.config, args.overrides, from_stage=args.from_stage,
                         continue_past_gates=args.continue_past_gates)
        elif args.stage == "label":
            from rlhfkit.label.command import options_from, run_label

            run_label(options_from(args))
        elif args.help_config:
            from rlhfkit.config.reference import help_text

            print(help_text(args.stage), end="")
        else:
            run_command(args.stage, args.config, args.overrides, args.print_config)
    except UserError as exc:
        if type(exc).__name__ == "GateFailed":  # the input was fine; a stage's result was not
            _say(f"rlhfkit: pipeline stopped: {exc}")
            return 3
        _say(f"rlhfkit: error: {exc}")
        return 2
    except KeyboardInterrupt:
        _say("rlhfkit: interrupted")
        return 130
    return 0


def entry() -> int:
    """The `rlhfkit` command (and `python -m rlhfkit.cli`): `main` on the command line's arguments, then the process
    group, if any, destroyed on the way out, on an error too (`launch.end_process_group`). `main` itself leaves the
    group alone: a Python caller owns it, and may run several stages in one group."""
    from rlhfkit.launch import end_process_group

    try:
        return main()
    finally:
        end_process_group()


if __name__ == "__main__":
    sys.exit(entry())
