"""`rlhfkit pipeline` and `rlhfkit.pipeline(...)`: the seeds' stages in order with their gates, wired, planned,
resumable and iterated, with one report (docs/pipeline.md).

    result = rlhfkit.pipeline("pipeline.yaml", overrides=["rm.max_steps=100"])

The package is callable (`rlhfkit.pipeline(...)` is `rlhfkit.pipeline.run(...)`) while its modules stay importable:
spec (the file), resolve (wiring and validation), gates, steps (one stage), runner (order, resume, rounds), report.
"""

from __future__ import annotations

import sys
import types

from rlhfkit.errors import UserError


def run(config: str | dict, overrides: list[str] | dict | None = None, *, from_stage: str | None = None,
        continue_past_gates: bool = False, output_dir: str | None = None):
    """Run the pipeline in the YAML file `config` (or a mapping of its keys) and return its `PipelineResult`.

    overrides: ["rm.optim.lr=1e-5", "vars.model=..."] or {"rm.optim.lr": 1e-5}, as on the command line.
    from_stage: rerun this stage and every later one, even when done with the same config.
    continue_past_gates: a failed gate is recorded (pipeline.json, the report) and the pipeline runs on; otherwise it
        stops with `GateFailed` naming the figure, the threshold and what the seeds suggest.
    """
    from rlhfkit.pipeline.runner import Runner
    from rlhfkit.pipeline.spec import read_spec

    if isinstance(overrides, dict):
        import json

        overrides = [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    if overrides is not None and not (isinstance(overrides, list) and all(isinstance(o, str) for o in overrides)):
        raise UserError("overrides: expected a list of 'key=value' strings or a dict")
    overrides = list(overrides or []) + ([f"output_dir={output_dir}"] if output_dir else [])
    if isinstance(config, dict):
        spec = read_spec("<pipeline>", overrides, data=config)
    else:
        spec = read_spec(str(config), overrides)
    return Runner(spec, from_stage, continue_past_gates).run()


class _CallablePackage(types.ModuleType):
    """Makes `rlhfkit.pipeline(...)` call `run`, as `rlhfkit.train(...)` calls the API, while `rlhfkit.pipeline.spec`
    and the other modules stay importable under the package's name."""

    def __call__(self, *args, **kwargs):
        return run(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
