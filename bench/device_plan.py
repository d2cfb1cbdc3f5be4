"""bench/device.sh's `plan` hook: the GPU's rates, then planned against measured peak memory and step time.

First bench/plan_calibrate.py measures this GPU's rates (FLOP/s of training and no-grad forwards, decode bytes/s,
the fixed costs per layer, call and decode step, the optimizer's) into $HOOK_OUT/rates.json under the GPU's name in
the devices table: merged into rlhfkit/plan/rates.json, they turn the GPU's planned times from unmeasured into
measured. The cells below are then planned with them (RLHFKIT_PLAN_RATES), so their "planned s" is the calibrated
figure, beside the measured one.
A few cells of bench/plan_grid.py's grid (SFT, DPO, GRPO, PPO on the tiny model, and on SmolLM2-135M when the
converted GGUF is in RLHFKIT_CACHE), each run by `rlhfkit.train` for a few steps: the run's own plan.json (planned
on this GPU's free memory, bf16 mixed precision) beside torch.cuda.max_memory_allocated and the median step time.
Writes $HOOK_OUT/plan_gpu_cells.json and, through bench/results.py, plan_gpu.{json,md}; with DEVICE_DRY_RUN=1 (on a CPU) the tiny cells only, as plumbing.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))  # bench/results.py

from bench.plan_grid import cell_config, run_cell, smollm2_dir, write_data  # noqa: E402

CELLS = [("sft", "full", False, 4, 128), ("sft", "lora", True, 4, 128), ("dpo", "full", False, 2, 128),
         ("dpo", "lora", False, 2, 128), ("grpo", "full", False, 2, 128), ("ppo", "lora", True, 2, 128)]


def calibrate(out: str, budget: float) -> str | None:
    """bench/plan_calibrate.py on this GPU (on the CPU in a dry run), no stage runs: the rates file, or None."""
    import subprocess

    path = os.path.join(out, "rates.json")
    device = "cpu" if os.environ.get("DEVICE_DRY_RUN") == "1" else "cuda"
    command = [sys.executable, os.path.join(ROOT, "bench", "plan_calibrate.py"), "--device", device, "--out", path,
               "--no-stages", "--results", out] + (["--name", "cpu-dry-run"] if device == "cpu" else [])
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=budget)
        print(proc.stdout[-3000:], proc.stderr[-2000:] if proc.returncode else "", flush=True)
    except subprocess.TimeoutExpired:
        print(f"plan_calibrate: over its {budget:.0f} s", flush=True)
    return path if os.path.isfile(path) else None


def main() -> None:
    out = os.environ.get("HOOK_OUT", os.path.join(ROOT, ".device", "plan"))
    budget = float(os.environ.get("HOOK_BUDGET_S", "90"))
    os.makedirs(out, exist_ok=True)
    t0, rows = time.time(), []
    rates = calibrate(out, budget / 2)
    if rates:
        os.environ["RLHFKIT_PLAN_RATES"] = rates
    data = write_data(tempfile.mkdtemp(prefix="plan-gpu-"))
    models = ["tiny"] + ([] if os.environ.get("DEVICE_DRY_RUN") == "1" or smollm2_dir() is None else ["smollm2"])
    for model_name in models:
        for stage, mode, ckpt, mb, length in CELLS:
            if time.time() - t0 > budget - 20:
                break
            model = "tiny" if model_name == "tiny" else smollm2_dir()
            overrides = cell_config(stage, model, mode, ckpt, mb, length, data, os.path.join(out, "run"))
            overrides["plan.measure"] = False  # a GPU measures with torch.cuda.max_memory_allocated
            row = {"model": model_name, "stage": stage, "mode": mode, "ckpt": ckpt, "mb": mb, "length": length}
            try:
                row.update(run_cell(stage, overrides))
            except Exception as exc:  # noqa: BLE001 - recorded, the next cell runs
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(os.path.join(out, "plan_gpu_cells.json"), "w") as f:
                json.dump(rows, f, indent=1)
    from results import record

    table = [[r["model"], r["stage"], r["mode"], r["ckpt"], f"{r['planned_gb']:.3f}", f"{(r['measured_gb'] or 0):.3f}",
              f"{r['planned_s'] or 0:.4f}", f"{r['measured_s'] or 0:.4f}"] for r in rows if "error" not in r]
    record("plan_gpu", "rlhfkit plan against the measured peak and step time on the GPU",
           ["model", "stage", "mode", "ckpt", "planned GB", "measured GB", "planned s", "measured s"], table,
           command="bash bench/device.sh (hook: bench/device_plan.py)", directory=out)

if __name__ == "__main__":
    main()
