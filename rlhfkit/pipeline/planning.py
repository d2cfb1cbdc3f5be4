"""Every training stage planned (`rlhfkit.plan`) before the first stage runs: one that will not fit its device stops
the pipeline there, with the planner's suggestion, rather than hours later when its turn comes.

The device is the file's `device` (a name of the plan's devices table) or `memory_gb`; without either, this machine's
first GPU by its memory; on a machine without one, the plans are printed with no verdict. A stage's processes come
from its `launch` (`--num_processes N`). A stage wired to an earlier stage's output, which does not exist yet, is
planned with the shape that output will have: the shape of the model the earlier stage trains, cut to its
`model.num_layers` (an SFT output has its base model's shape, a reward model cut to 10 layers has 10). The plan reads
config.json or a GGUF file's metadata, never weights.
"""

from __future__ import annotations

import logging
import os

from rlhfkit.errors import UserError
from rlhfkit.pipeline.resolve import Resolved

logger = logging.getLogger("rlhfkit")


def local_memory_gb() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / 2**30


def processes_of(launch: tuple[str, ...] | None) -> int:
    args = list(launch or ())
    for i, a in enumerate(args):
        if a.startswith("--num_processes="):
            return int(a.split("=", 1)[1])
        if a == "--num_processes" and i + 1 < len(args):
            return int(args[i + 1])
    return 1


def _output_shapes(stages: list[Resolved], load) -> dict[str, object]:
    """Each training stage's folder -> the `ModelShape` of the model it will write (followed through earlier stages:
    `load` reads a name that is an earlier stage's folder from this mapping). A stage whose model cannot be read is
    left out: its own plan says why, and the stages reading its output say it again."""
    from rlhfkit.plan.shape import cut

    shapes: dict[str, object] = {}
    for r in stages:
        m = getattr(r.cfg, "model", None)
        if not isinstance(getattr(m, "name_or_path", None), str):
            continue
        try:
            shapes[os.path.abspath(r.dir)] = (cut(shapes[m.name_or_path], m.num_layers) if m.name_or_path in shapes else
                             load(m.name_or_path, "model.name_or_path", m.gguf_file, m.revision, m.num_layers))
        except UserError:
            continue
    return shapes


def check_fits(path: str, stages: list[Resolved], device: str | None = None, memory_gb: float | None = None) -> list:
    """Plan every training stage; raise a `UserError` naming the first that does not fit and the planner's best
    suggestion. Returns the plans (stage name, Plan)."""
    from rlhfkit.plan import STAGES_PLANNED, plan_for
    from rlhfkit.plan.shape import load_shape

    if device is None and memory_gb is None:
        memory_gb = local_memory_gb()
    made, plans = _output_shapes([r for r in stages if r.stage in STAGES_PLANNED], load_shape), []
    for r in stages:
        if r.stage not in STAGES_PLANNED:
            continue
        try:
            plan = plan_for(r.stage, r.cfg, device=device, memory_gb=memory_gb, processes=processes_of(r.spec.launch),
                            models=made)
        except UserError as exc:
            logger.warning("plan: stage '%s' could not be planned (%s)", r.name, exc)
            continue
        print(f"  {r.name}: {plan.summary()}", flush=True)
        plans.append((r.name, plan))
        if plan.fits is False:
            fitting = [s for s in plan.suggestions if s.fits] or list(plan.suggestions)
            hint = (f"; the plan suggests: {fitting[0].text} (saves {fitting[0].saves_gb:.3g} GB, peak "
                    f"{fitting[0].peak_gb:.3g} GB)") if fitting else "; no change the planner knows makes it fit"
            raise UserError(f"{path}: {r.spec.where} will not fit: planned peak {plan.peak_gb:.3g} GB per process on "
                            f"{plan.device or f'{plan.memory_gb:.3g} GB'}{hint}. Nothing has run yet")
    return plans
