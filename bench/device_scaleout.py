"""Sharded engines on one GPU (issue 10 item 3): tiny GRPO, PPO (a critic of its own) and DPO runs through
`accelerate launch --config_file configs/accelerate/<fsdp|fsdp2|zero2|zero3>.yaml --num_processes 1`, each compared
with the same run without accelerate; prints one PASS / FAIL / SKIP line per run and writes a summary.

For the device machine (docs/distributed.md), from the repository root:

    python3 bench/device_scaleout.py --out "$OUT"      # about 3-4 minutes; runs 4 at a time on the one GPU

It needs rlhfkit's dependencies and `deepspeed` (without it the ZeRO runs SKIP; `--check` lists what is missing). The
device image has torch, accelerate, transformers, peft, safetensors, einops, msgpack, ninja, psutil and py-cpuinfo,
but not deepspeed nor its needs hjson and pydantic. Carry them as wheels (the device README's recipe), made here:

    mkdir -p .git/info && echo /.whl/ >> .git/info/exclude
    pip wheel --no-deps deepspeed==0.19.8 -w .whl    # PyPI has only its source; the wheel is pure Python
    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
        hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0 typing-extensions
    # plus rlhfkit's own needs missing there (datasets and its needs, gguf, vaderSentiment): see --check

and start the device command with `python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
export PYTHONPATH=/tmp/site:$PWD`.

Why one process: the device has one GPU, and NCCL joins one process per GPU. At world size 1 FSDP and ZeRO-3 still
wrap, partition (ZeRO-3 with `stage3_param_persistence_threshold: 0`, generated here, so the tiny model's weights are
partitioned too; the shipped zero3.yaml keeps tensors under 100k elements whole, as DeepSpeed does by default), gather
and save through the same code as on N GPUs, but every collective is between one process: this checks the plumbing
(accelerate's engines with rlhfkit's trainers, sampling from the gathered policy, frozen models, saving), not the
communication — 2 processes with real collectives are tested on CPU (tests/multiprocess/test_sharded_engines.py).

One backward per optimizer step (per_device_batch_size = the minibatch), as when this was written; several are one
DeepSpeed step now (docs/distributed.md).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from results import record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["logging.progress_bar=false", "optim.adam_eps=1e-4", "max_steps=3"]
GRPO = ["grpo", "--config", "configs/grpo_tiny.yaml", "optim.per_device_batch_size=16", "generation.max_new_tokens=8"]
# PPO with a separate critic (no LoRA): under DeepSpeed the policy and critic are prepared as one module, under FSDP1
# they are two sharded models; the LoRA critic is refused under both (docs/distributed.md).
PPO_FULL = ["ppo", "--config", "configs/ppo_tiny.yaml", "algo.num_minibatches=1", "optim.per_device_batch_size=16",
            "generation.max_new_tokens=8"]
DPO = ["dpo", "--config", "configs/dpo_tiny.yaml"]  # a separate frozen reference (no LoRA)
ZERO3_PARTITIONED = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1,
                     "gradient_clipping": 1.0, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
# name -> (accelerate config or None for the plain run, arguments, what is expected)
RUNS = {
    "plain-grpo": (None, GRPO, "reference"),
    "plain-dpo": (None, DPO, "reference"),
    "fsdp1-grpo": ("configs/accelerate/fsdp.yaml", GRPO, "equal"),
    "fsdp2-grpo": ("configs/accelerate/fsdp2.yaml", GRPO, "equal"),
    "fsdp1-ppofull": ("configs/accelerate/fsdp.yaml", PPO_FULL, "equal"),  # a critic of its own: the LoRA one is refused under FSDP
    "zero2-grpo": ("configs/accelerate/zero2.yaml", GRPO, "equal"),
    "zero3-grpo": ("configs/accelerate/zero3.yaml", GRPO, "equal"),
    "zero3p-grpo": ("zero3_partitioned", GRPO, "equal"),
    "zero3p-dpo": ("zero3_partitioned", DPO, "equal"),
    "plain-ppofull": (None, PPO_FULL, "reference"),
    "zero2-ppofull": ("configs/accelerate/zero2.yaml", PPO_FULL, "equal"),  # passes on 1 CPU process
    "zero3p-ppofull": ("zero3_partitioned", PPO_FULL, "equal"),  # passes on 1 CPU process
}
NEEDS_DEEPSPEED = ("zero",)
IGNORED = ("time/", "elapsed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def zero3_partitioned_config(tmp: str) -> str:
    ds = os.path.join(tmp, "ds_zero3_partitioned.json")
    with open(ds, "w", encoding="utf-8") as f:
        json.dump(ZERO3_PARTITIONED, f)
    path = os.path.join(tmp, "zero3_partitioned.yaml")
    with open(path, "w", encoding="utf-8") as f:
        f.write("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_machines: 1\nnum_processes: 1\n"
                f"use_cpu: false\ndeepspeed_config:\n  deepspeed_config_file: {ds}\n  zero3_init_flag: true\n")
    return path


def run(name: str, config: str | None, args: list[str], out: str, timeout: int) -> dict:
    cmd = [sys.executable, "-m", "rlhfkit.cli"] if config is None else [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--num_processes", "1",
        "--main_process_port", str(free_port()), "-m", "rlhfkit.cli"]
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONUNBUFFERED="1")
    env.pop("ACCELERATE_USE_CPU", None)
    t0 = time.time()
    try:
        r = subprocess.run([*cmd, *args, *COMMON, f"output_dir={out}"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=timeout)
        code, err = r.returncode, r.stderr
    except subprocess.TimeoutExpired as exc:
        code, err = "timeout", (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else str(exc.stderr)
    launch = [line for line in err.splitlines() if "launch: world size" in line]
    errors = [line for line in err.splitlines()
              if ("Error:" in line and "ChildFailedError" not in line) or line.startswith("rlhfkit: error")]
    return {"name": name, "exit": code, "seconds": round(time.time() - t0, 1), "launch": launch[-1] if launch else None,
            "error": errors[-1][:500] if errors else None, "stderr_tail": err[-3000:]}


def compare(plain: str, other: str) -> dict:
    """Largest metric and weight differences of `other` against `plain` (same stage, same arguments)."""
    from safetensors.torch import load_file

    def rows(d):
        with open(os.path.join(d, "metrics.jsonl"), encoding="utf-8") as f:
            return [json.loads(line) for line in f]

    a, b = rows(plain), rows(other)
    metric = 0.0
    for x, y in zip(a, b):
        for k, v in x.items():
            if not k.startswith(IGNORED) and isinstance(v, (int, float)) and k in y:
                metric = max(metric, abs(y[k] - v) / max(abs(v), 1e-3))  # relative, absolute below 1e-3
    wa, wb = (load_file(os.path.join(d, f)) for d, f in ((plain, _weights(plain)), (other, _weights(other))))
    shapes_ok = all(k in wb and wb[k].shape == v.shape for k, v in wa.items())
    weight = max(((wb[k].float() - v.float()).abs().max().item() for k, v in wa.items()), default=0.0) if shapes_ok else None
    return {"rows": [len(a), len(b)], "metric_max_diff": metric, "saved_shapes_ok": shapes_ok, "weight_max_diff": weight}


def _weights(d: str) -> str:
    return next(f for f in sorted(os.listdir(d)) if f.endswith(".safetensors"))


def check_environment() -> list[str]:
    missing = [m for m in ("torch", "accelerate", "transformers", "peft", "datasets", "safetensors", "yaml",
                           "annotated_types", "gguf", "vaderSentiment", "deepspeed") if importlib.util.find_spec(m) is None]
    import torch

    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}, "
          f"GPUs: {torch.cuda.device_count()}; missing modules: {missing or 'none'}", flush=True)
    return missing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/device_scaleout"))
    parser.add_argument("--only", nargs="*", help="run only these names (plain runs they compare with included)")
    parser.add_argument("--jobs", type=int, default=4, help="runs at once (world size 1 each, sharing the GPU)")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per run")
    parser.add_argument("--check", action="store_true", help="only report the environment")
    opts = parser.parse_args()
    missing = check_environment()
    if opts.check:
        return 0
    os.makedirs(opts.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="scaleout-")
    configs = {"zero3_partitioned": zero3_partitioned_config(tmp)}
    names = [n for n in RUNS if not opts.only or n in opts.only or (RUNS[n][2] == "reference"
                                                                   and any(RUNS[o][1] is RUNS[n][1] for o in opts.only))]
    results, todo = {}, []
    for name in names:
        config, args, _ = RUNS[name]
        if config and name.startswith(NEEDS_DEEPSPEED) and "deepspeed" in missing:
            results[name] = {"name": name, "status": "SKIP", "why": "deepspeed is not importable (carry its wheels)"}
            continue
        todo.append((name, configs.get(config, config), args, os.path.join(tmp, name)))
    with concurrent.futures.ThreadPoolExecutor(max_workers=opts.jobs) as pool:
        for res in pool.map(lambda job: run(*job, opts.timeout), todo):
            results[res["name"]] = res
    for name in names:
        res, (config, args, expect) = results[name], RUNS[name]
        if res.get("status") == "SKIP":
            continue
        wanted = "FSDP" if config and "fsdp" in name else "DEEPSPEED"
        if res["exit"] != 0:
            res["status"] = "FAIL"
        elif config and f"distributed type {wanted}" not in (res["launch"] or ""):
            # accelerate falls back silently: on a machine without a GPU an FSDP config runs as plain one-process
            res["status"], res["error"] = "FAIL", f"not run under {wanted}: {res['launch']}"
        elif expect == "reference":
            res["status"] = "PASS"
        else:
            plain = next(n for n, (c, a, e) in RUNS.items() if e == "reference" and a is args)
            try:
                res["compare"] = compare(os.path.join(tmp, plain), os.path.join(tmp, name))
                c = res["compare"]
                ok = c["saved_shapes_ok"] and c["metric_max_diff"] < 1e-3 and c["weight_max_diff"] < 1e-4
                res["status"] = "PASS" if ok else "FAIL"
            except Exception as exc:  # noqa: BLE001 - a missing or unreadable output is a failure to report
                res["status"], res["error"] = "FAIL", f"comparison failed: {exc!r}"[:500]
    with open(os.path.join(opts.out, "scaleout_summary.json"), "w", encoding="utf-8") as f:
        json.dump({n: {k: v for k, v in r.items() if k != "stderr_tail"} for n, r in results.items()}, f, indent=1)
    with open(os.path.join(opts.out, "scaleout_logs.txt"), "w", encoding="utf-8") as f:
        for name in names:
            f.write(f"===== {name}\n{results[name].get('stderr_tail', '')}\n")
    for name in names:
        r = results[name]
        detail = r.get("why") or r.get("error") or json.dumps(r.get("compare")) if r["status"] != "PASS" or "compare" in r else ""
        print(f"{r['status']:4} {name:13} {r.get('seconds', '')!s:>6}s  {r.get('launch') or ''}  {detail or ''}", flush=True)
    # The docs' table, into --out (the device's files come back from there): copy scaleout.json/.md to docs/results/.
    record("scaleout", "Sharded engines on one GPU against the plain run", ["run", "status", "launch", "seconds", "detail"],
           [[name, results[name]["status"], results[name].get("launch") or "", results[name].get("seconds", ""),
             results[name].get("why") or results[name].get("error") or json.dumps(results[name].get("compare") or "")]
            for name in names], command="python3 bench/device_scaleout.py --out DIR", directory=opts.out,
           notes=["PASS: metrics within 1e-3 and saved weights within 1e-4 of the same run without accelerate."])
    return 0 if all(results[n]["status"] in ("PASS", "SKIP") for n in names) else 1


if __name__ == "__main__":
    sys.exit(main())
